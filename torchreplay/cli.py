"""The ``torchreplay`` command line: ``bench``, ``check``, ``explain`` and ``cache``.

The only module that prints and the only one that configures logging handlers. Importing it
initialises no CUDA; CUDA is first touched when a benchmark runs.

Exit codes:

- ``torchreplay check module:factory``: 0 when the report is clean, 1 when it has findings, 2 when
  the factory cannot be loaded, returns something else than ``(fn, args[, kwargs])`` or raises.
  On a machine without CUDA every call touches only CPU tensors, so the ``(no CUDA tensor)``
  finding is printed but does not make the exit code 1 there; a line after the report says so.
- ``torchreplay bench``: 0 when the table was produced (a method that failed is a row that says
  ``failed: <reason>``); 2 for a factory that cannot be loaded. Without CUDA it says so and
  checks instead of timing: ``torchreplay check`` on the factory of each chosen row
  (:data:`~torchreplay.models.factories.ROW_FACTORIES`) or on ``--factory``, findings to
  ``--json``; the ``compile-*`` rows have no CPU stand-in and are skipped with a line that says
  so. It exits 0 whatever the findings, 2 when a factory fails.
- ``torchreplay explain module:factory``: compiles the factory's ``fn`` with ``tr.compile``, calls
  it once under ``torch.no_grad()`` and prints ``tr.explain``; without CUDA (no graphs then) also
  the split a GPU would get (:func:`~torchreplay.compile.preview.preview_split`). 0 when the
  report was printed, 1 when compiling or calling raised, 2 when the factory fails as for ``check``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table
from rich.text import Text

import torchreplay
from torchreplay import bench
from torchreplay.check import NO_CUDA_OP, Finding, Report, check_call
from torchreplay.compile import cache
from torchreplay.compile.preview import preview_split
from torchreplay.models.factories import ROW_FACTORIES

__all__ = ["main", "build_parser", "load_factory", "results_table", "FactoryError", "BUILTIN_FACTORY"]

log = logging.getLogger(__name__)

#: The factory of the ``mlp`` row, the example in help and error messages.
BUILTIN_FACTORY = ROW_FACTORIES["mlp"]

_NO_CUDA = (
    "CUDA is not available on this machine (torch {torch}), so there is nothing to time: "
    "`torchreplay bench` compares CUDA graphs on a GPU."
)
#: Why the ``compile-*`` rows are not checked without CUDA, and what to run instead.
_COMPILE_SKIPPED = (
    "they time torch.compile backends as CUDA graphs and have no CPU stand-in; "
    "`torchreplay explain MODULE:FACTORY` shows how tr.compile would split a model on this "
    "machine (e.g. torchreplay.models.blocks:nonzero_factory)"
)


class FactoryError(Exception):
    """A ``module:factory`` that cannot be imported, found, called or unpacked."""


# ---------------------------------------------------------------------------------------------
# Arguments


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``torchreplay [-v] {bench,check,explain} ...``."""
    parser = argparse.ArgumentParser(
        prog="torchreplay",
        description="Run PyTorch callables as CUDA graphs: benchmark them, check what would "
        "break capture, or explain how the torch.compile backend splits them.",
    )
    parser.add_argument(
        "--version", action="version",
        version=f"torchreplay {torchreplay.__version__} (torch {torch.__version__})",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0,
        help="log torchreplay's INFO lines (-v) or DEBUG lines (-vv) to stderr",
    )
    sub = parser.add_subparsers(dest="command", metavar="{bench,check,explain,cache}")
    sub.required = True

    b = sub.add_parser(
        "bench",
        help="time eager vs hand-written CUDA graph vs torch.compile vs tr.graph",
        description="Time each built-in model (or --factory) eagerly, as a hand-written "
        "torch.cuda.CUDAGraph (the floor), with torch.compile(mode='reduce-overhead') and with "
        "tr.graph; the compile-* rows time torch.compile's CUDA graph modes against tr.compile "
        "(and its memory for many sizes, and the host cost of a split). Without CUDA, run "
        "`torchreplay check` on the model of each chosen row (or on --factory) instead, and "
        "write its findings to --json; the compile-* rows are skipped.",
    )
    b.add_argument(
        "--model", choices=[*bench.ROWS, "compile", "all"], default="all",
        help="which built-in row to run: one row, `compile` (every compile-* row) or `all` "
        "(default: every row but the compile-* rows, which take minutes to compile)",
    )
    b.add_argument(
        "--factory", metavar="MODULE:FACTORY",
        help="time your own workload: FACTORY() returns (fn, args) or (fn, args, kwargs) on the GPU",
    )
    defaults = bench.BenchOptions()
    b.add_argument("--repeats", type=_positive_int, default=defaults.repeats,
                   help=f"timed samples per method, median reported (default {defaults.repeats})")
    b.add_argument("--calls", type=_positive_int, default=defaults.calls,
                   help=f"calls per timed sample (default {defaults.calls})")
    b.add_argument("--no-compile", action="store_true",
                   help="skip torch.compile(mode='reduce-overhead') (and, in the compile-* rows, "
                   "backend='cudagraphs'), which take a while to compile; tr.compile stays")
    b.add_argument("--json", metavar="PATH",
                   help="also write the numbers (without CUDA: the check findings) to PATH as JSON")
    b.set_defaults(run=_cmd_bench)

    c = sub.add_parser(
        "check",
        help="report what in a callable would break CUDA graph capture, with file:line",
        description="Import MODULE, call FACTORY() -> (fn, args) or (fn, args, kwargs), run "
        "tr.check(fn, *args, **kwargs) and print the report. Exit 0 when clean, 1 with findings, "
        "2 when the factory fails.",
    )
    c.add_argument("target", metavar="MODULE:FACTORY",
                   help="e.g. torchreplay.models.factories:mlp_factory")
    c.set_defaults(run=_cmd_check)

    e = sub.add_parser(
        "explain",
        help="compile a callable with tr.compile, call it once and print tr.explain",
        description="Import MODULE, call FACTORY() -> (fn, args) or (fn, args, kwargs), compile fn "
        "with tr.compile(fn, sizes=..., splitting_ops=...), call it once under torch.no_grad() "
        "and print tr.explain: each Dynamo graph, its pieces (graphed, or eager with the op, the "
        "reason and your file:line), sizes, captures and memory. Without CUDA, tr.compile runs "
        "without CUDA graphs, so the split a GPU would get is printed too. Exit 0 with the "
        "report, 1 when compiling or calling raised, 2 when the factory fails.",
    )
    e.add_argument("target", metavar="MODULE:FACTORY",
                   help="e.g. torchreplay.models.blocks:nonzero_factory")
    e.add_argument("--sizes", type=_sizes, metavar="N,N,...",
                   help="sizes of dimension --dim to capture, e.g. 1,2,4,8 (default: one shape)")
    e.add_argument("--dim", type=int, default=0, help="the dimension --sizes counts (default 0)")
    e.add_argument("--splitting-ops", type=_names, default=(), metavar="OP,OP,...",
                   help="ops to run eagerly between graphs, e.g. mylib.attention,torch.sigmoid")
    e.add_argument("--no-inductor", action="store_true",
                   help="compile each piece as FX code instead of with Inductor (faster to build)")
    e.set_defaults(run=_cmd_explain)

    k = sub.add_parser(
        "cache", help="list or clear the compile cache of tr.compile / backend='torchreplay'",
        description="The compile cache holds each piece's Inductor code (default folder: "
        f"${cache.ENV_VAR}, else ~/.cache/torchreplay). `list` prints its entries; `clear` "
        "removes them (all, or those older than --older-than). Exit 0, or 2 for a bad age.",
    )
    k.add_argument("action", choices=["list", "clear"])
    k.add_argument("--dir", metavar="PATH", help="the cache folder (default: as tr.compile's)")
    k.add_argument("--older-than", metavar="AGE",
                   help="with clear: only entries older than AGE, e.g. 30m, 12h, 7d")
    k.set_defaults(run=_cmd_cache)
    return parser


def _cmd_cache(ns: argparse.Namespace, out: Console, err: Console) -> int:
    folder = Path(ns.dir) if ns.dir else cache.default_dir()
    now = time.time()
    if ns.action == "list":
        found = cache.entries(folder)
        total = sum(e.bytes for e in found)
        out.print(f"{folder}: {len(found)} entr{'y' if len(found) == 1 else 'ies'}, "
                  f"{total / 1e6:.1f} MB", highlight=False)
        for entry in found:
            out.print(f"  {entry.line(now)}", highlight=False)
        return 0
    try:
        age = cache.parse_age(ns.older_than) if ns.older_than else None
    except ValueError as exc:
        err.print(f"torchreplay cache clear: {exc}", highlight=False)
        return 2
    removed = cache.clear(folder, age)
    out.print(f"{folder}: removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'}, "
              f"{sum(e.bytes for e in removed) / 1e6:.1f} MB", highlight=False)
    return 0


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes such as 1,2,4,8, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected sizes >= 1 such as 1,2,4,8, got {text!r}")
    return sizes


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    ns = build_parser().parse_args(argv)
    out, err = Console(), Console(stderr=True)
    if not out.is_terminal:
        # A log or a pipe has no width to respect: keep each table row on one line.
        out = Console(width=max(out.width, 120))
    with _logging_to(err, ns.verbose):
        return ns.run(ns, out, err)


@contextlib.contextmanager
def _logging_to(console: Console, verbose: int) -> Iterator[None]:
    # The handler lives as long as the command, so main() can run many times in one process
    # (tests) without stacking handlers.
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logger = logging.getLogger("torchreplay")
    handler = RichHandler(console=console, show_path=verbose > 1, rich_tracebacks=True)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


# ---------------------------------------------------------------------------------------------
# check


def load_factory(spec: str) -> Callable[[], Any]:
    """Import ``"module:factory"`` (``factory`` may be dotted) and return the callable.

    The current directory is importable, as with ``python -m``.

    Raises:
        FactoryError: saying what is wrong and how to fix it.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise FactoryError(
            f"expected MODULE:FACTORY, got {spec!r}; e.g. {BUILTIN_FACTORY}"
        )
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise FactoryError(
            f"cannot import {module_name!r}: {exc}; run from the directory that contains it or "
            "add that directory to PYTHONPATH"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise FactoryError(f"{module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise FactoryError(f"{spec} is a {type(obj).__name__}, not a callable factory")
    return obj


def _call_factory(factory: Callable[[], Any], spec: str
                  ) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    try:
        result = factory()
    except Exception as exc:
        raise FactoryError(f"{spec}() raised {type(exc).__name__}: {exc}") from exc
    try:
        return bench.unpack_factory_result(result, spec)
    except TypeError as exc:
        raise FactoryError(str(exc)) from exc


def _defined_at(factory: Callable[[], Any]) -> tuple[str, int] | None:
    """Return the file and line where ``factory`` (a function or a class) is defined, if known."""
    target = inspect.unwrap(factory)
    if not (inspect.isroutine(target) or inspect.isclass(target)):
        target = type(target)  # a callable object: point at its class
    try:
        filename = inspect.getsourcefile(target)
        return (filename, inspect.getsourcelines(target)[1]) if filename else None
    except (TypeError, OSError):
        return None


@dataclasses.dataclass(frozen=True)
class _Checked:
    """The outcome of checking one factory: a report, or why there is none (already printed)."""

    label: str  # the bench row, or the factory spec
    spec: str
    report: Report | None = None
    error: str | None = None


def _check_factory(spec: str, out: Console, err: Console, command: str,
                   label: str | None = None) -> _Checked:
    """Load ``spec``, check the call it returns and print the report (or the error, on ``err``)."""
    label = label or spec
    try:
        factory = load_factory(spec)
        fn, args, kwargs = _call_factory(factory, spec)
    except FactoryError as exc:
        err.print(Text(f"torchreplay {command}: {exc}"), soft_wrap=True)
        return _Checked(label, spec, error=str(exc))
    try:
        # The factory is the user's code that made the call, so the finding about the whole
        # call points there; this module's frames mean nothing to the user.
        report = check_call(fn, args, kwargs, origin=_defined_at(factory))
    except Exception as exc:
        err.print_exception()
        message = (f"the call from {spec} raised {type(exc).__name__}; fix it so that it runs "
                   "eagerly, then check again")
        err.print(Text(f"torchreplay {command}: {message}"), soft_wrap=True)
        return _Checked(label, spec, error=message)
    # A table on a terminal; the plain text (every file:line in full, greppable) in logs and pipes.
    if out.is_terminal:
        out.print(report)
    else:
        out.print(Text(str(report)), soft_wrap=True)
    return _Checked(label, spec, report)


def _blocking(report: Report) -> list[Finding]:
    # Without CUDA nothing can touch a CUDA tensor; that finding says nothing about the code.
    cuda = torch.cuda.is_available()
    return [f for f in report if cuda or f.op != NO_CUDA_OP]


def _not_counted(report: Report) -> str | None:
    """Say why the ``(no CUDA tensor)`` finding does not count, or None when all findings count."""
    counted = len(_blocking(report))
    if counted == len(report):
        return None
    if counted == 0:
        return (f"the only finding, {NO_CUDA_OP}, is expected on a machine without CUDA; every "
                "other finding would break capture on a GPU")
    return (f"{counted} finding{'s' if counted != 1 else ''} would break capture on a GPU; the "
            f"{NO_CUDA_OP} finding is expected on a machine without CUDA and is not counted")


def _cmd_check(ns: argparse.Namespace, out: Console, err: Console) -> int:
    checked = _check_factory(ns.target, out, err, "check")
    if checked.report is None:
        return 2
    status = 1 if _blocking(checked.report) else 0
    note = _not_counted(checked.report)
    if note:
        out.print(Text(f"exit {status}: {note}"), soft_wrap=True)
    return status


# ---------------------------------------------------------------------------------------------
# bench


def _rows_of(model: str) -> list[str]:
    """The rows ``--model`` names: one row, ``compile`` (every compile-* row) or ``all``."""
    if model == "all":  # the quick table; the compile rows take minutes of compiling
        return [r for r in bench.ROWS if r not in bench.COMPILE_ROWS]
    if model == "compile":
        return list(bench.COMPILE_ROWS)
    return [model]


def _bench_without_cuda(ns: argparse.Namespace, out: Console, err: Console) -> int:
    """Check, instead of timing, the call of each chosen row (or of --factory)."""
    skipped: list[str] = []
    if ns.factory:
        targets = {ns.factory: ns.factory}
        what = f"`torchreplay check {ns.factory}`"
    else:
        rows = _rows_of(ns.model)
        targets = {row: ROW_FACTORIES[row] for row in rows if row in ROW_FACTORIES}
        skipped = [row for row in rows if row not in ROW_FACTORIES]
        checked = list(targets)
        what = ("" if not checked else
                f"`torchreplay check` on the model of the {checked[0]} row" if len(checked) == 1 else
                f"`torchreplay check` on the model of each row ({', '.join(checked)})")
    intro = _NO_CUDA.format(torch=torch.__version__)
    out.print(Text(f"{intro} Running {what} instead." if what else intro), soft_wrap=True)
    results = []
    for label, spec in targets.items():
        if not ns.factory:
            out.print(Text(f"\n{label}: torchreplay check {spec}", style="bold"), soft_wrap=True)
        checked_one = _check_factory(spec, out, err, "bench", label)
        if checked_one.report is not None:
            out.print(Text(f"{label}: {_not_counted(checked_one.report) or 'every finding counts'}"),
                      soft_wrap=True)
        results.append(checked_one)
    if skipped:
        out.print(Text(f"\nskipped without CUDA: {', '.join(skipped)}: {_COMPILE_SKIPPED}"),
                  soft_wrap=True)
    if ns.json:
        _write_check_json(ns.json, results, skipped)
        out.print(Text(f"wrote {ns.json}"), soft_wrap=True)
    if any(c.report is None for c in results):
        return 2
    if any(_blocking(c.report) for c in results if c.report is not None):
        out.print(Text("exit 0: without CUDA `torchreplay bench` only checks and does not count "
                       "findings; `torchreplay check MODULE:FACTORY` exits 1 on them"),
                  soft_wrap=True)
    return 0


def _write_check_json(path: str, results: Sequence[_Checked], skipped: Sequence[str] = ()) -> None:
    """Write ``{"environment", "cuda": false, "checks": [{"row", "factory", "findings"}]}``;
    a skipped row is ``{"row", "skipped"}``."""
    checks: list[dict[str, Any]] = []
    for c in results:
        entry: dict[str, Any] = {"row": c.label, "factory": c.spec}
        if c.report is None:
            entry["error"] = c.error
        else:
            entry["findings"] = [
                {"op": f.op, "kind": f.kind, "location": f.location, "code": f.code,
                 "reason": f.reason, "fix": f.fix}
                for f in c.report
            ]
        checks.append(entry)
    checks += [{"row": row, "skipped": _COMPILE_SKIPPED} for row in skipped]
    doc = {"environment": bench.environment(), "cuda": False, "checks": checks}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def _cmd_bench(ns: argparse.Namespace, out: Console, err: Console) -> int:
    if not torch.cuda.is_available():
        return _bench_without_cuda(ns, out, err)

    opts = bench.BenchOptions(repeats=ns.repeats, calls=ns.calls, compile=not ns.no_compile)
    env = bench.environment()
    out.print(Text(f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}; "
                   f"median of {opts.repeats} x {opts.calls} calls"), soft_wrap=True)
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=out, transient=True) as progress:
        task = progress.add_task("starting", total=None)

        def on_step(workload: str, method: str) -> None:
            progress.update(task, description=f"{workload}: {method}")

        if ns.factory:
            try:
                fn, args, kwargs = _call_factory(load_factory(ns.factory), ns.factory)
            except FactoryError as exc:
                err.print(Text(f"torchreplay bench: {exc}"), soft_wrap=True)
                return 2
            results = bench.run_factory(lambda: (fn, args, kwargs), ns.factory, opts, on_step)
        else:
            results = bench.run(_rows_of(ns.model), opts, on_step)

    out.print(results_table(dataclasses.asdict(m) for m in results))
    if ns.json:
        bench.write_json(ns.json, results, opts)
        out.print(Text(f"wrote {ns.json}"))
    return 0


def results_table(rows: Iterable[Mapping[str, Any]], title: str | None = None) -> Table:
    """Return a rich Table of benchmark measurements (``dataclasses.asdict`` of each, or JSON).

    Each workload is a bold heading row followed by one row per method; a method that failed
    (or was skipped) shows its reason under its name, a method with a note (a ratio, memory, the
    cost of a split) its note. A ``first call s`` column (compile and capture) is shown when a
    row measured it.
    """
    rows = list(rows)
    first_call = any(r.get("first_call_s") is not None for r in rows)
    table = Table(
        title=title or "eager vs CUDA graphs, time per call (lower is better)",
        caption="us/call: median, synchronized. vs floor: over the hand-written CUDAGraph. "
        "speed-up: eager over this. host us: CPU time of one call without a sync in the loop "
        "(min over samples); host Δ: minus the floor's."
        + (" first call s: from building the method to the end of its first call on every "
           "shape (compile and capture)." if first_call else ""),
    )
    table.add_column("workload / method", min_width=24, overflow="fold")
    headers = ["us/call", "vs floor", "speed-up", "host us", "host Δ"]
    if first_call:
        headers.append("first call s")
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True)
    previous = None
    for r in rows:
        if r["workload"] != previous:
            if previous is not None:
                table.add_section()
            table.add_row(Text(r["workload"], style="bold"))
            previous = r["workload"]
        cell = Text(r["method"])
        if r.get("note"):
            cell.append("\n" + r["note"], style="cyan")
        if r.get("error"):
            was_skipped = r["error"].startswith("skipped")
            style = "yellow" if was_skipped else "red"
            cell.append("\n" + r["error"], style=style)
            status = [Text("skipped" if was_skipped else "failed", style=style)]
            if first_call:
                status += ["", "", "", "", _fmt(r.get("first_call_s"), "{:.2f}")]
            table.add_row(cell, *status)
            continue
        values = [
            _fmt(r.get("per_call_us"), "{:.1f}"),
            _fmt(r.get("vs_floor"), "{:.2f}x"),
            _fmt(r.get("speedup"), "{:.2f}x"),
            _fmt(r.get("host_us"), "{:.1f}"),
            _fmt(r.get("host_delta_us"), "{:+.1f}"),
        ]
        if first_call:
            values.append(_fmt(r.get("first_call_s"), "{:.2f}"))
        table.add_row(cell, *values)
    return table


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


# ---------------------------------------------------------------------------------------------
# explain


def _cmd_explain(ns: argparse.Namespace, out: Console, err: Console) -> int:
    spec = ns.target
    try:
        fn, args, kwargs = _call_factory(load_factory(spec), spec)
    except FactoryError as exc:
        err.print(Text(f"torchreplay explain: {exc}"), soft_wrap=True)
        return 2
    # A fresh Dynamo cache: the report is about this call alone, and a process that explains
    # many factories (tests) does not reach Dynamo's recompile limit.
    torch.compiler.reset()
    step = "setting up tr.compile"
    try:
        compiled = torchreplay.compile(fn, sizes=ns.sizes, dim=ns.dim,
                                       splitting_ops=ns.splitting_ops, inductor=not ns.no_inductor)
        step = "compiling and calling it"
        with torch.no_grad():
            compiled(*args, **kwargs)
        report = torchreplay.explain(compiled)
        out.print(Text(report), soft_wrap=True)
        if compiled.backend.runtimes:
            return 0
        step = "tracing it for the split a GPU would get"
        why = ("CUDA is not available on this machine, so tr.compile ran without CUDA graphs."
               if not torch.cuda.is_available() else
               f"tr.compile made no CUDA graph: are the tensors from {spec} on the GPU?")
        out.print(Text(f"\n{why} The split a GPU would get (traced here; a model that branches "
                       "on the device may be split otherwise there):"), soft_wrap=True)
        with torch.no_grad():
            out.print(Text(preview_split(fn, args, kwargs, ns.splitting_ops)), soft_wrap=True)
        return 0
    except Exception as exc:
        err.print_exception()
        first = (str(exc).strip().splitlines() or [""])[0]
        err.print(Text(f"torchreplay explain: the call from {spec} raised {type(exc).__name__} "
                       f"while {step}: {first}; `torchreplay check {spec}` shows what a CUDA "
                       "graph cannot hold"), soft_wrap=True)
        return 1
    finally:
        compiled = None  # noqa: F841 - its graphs and pools go before the next command
        torch.compiler.reset()
