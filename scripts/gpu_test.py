#!/usr/bin/env python3
"""The GPU check (``make gpu-test``): ``tests/gpu``, then the quick benchmark rows, then a summary.

Meant for a CUDA machine with torch preinstalled and no network: it installs nothing. It

1. prints the torch version, CUDA version and GPU name;
2. runs ``pytest tests/gpu -q -rA`` and reads the counts from pytest's summary line;
3. runs every benchmark row with few repeats (``torchreplay bench --model ROW --repeats 3
   --calls 20 --json ...``), each row in its own process so that a crash (torch.compile has taken
   processes down) costs only that row; ``--no-compile`` leaves out torch.compile in the other
   rows; the ``compile-*`` rows (the torch.compile backend's) run only when ``--rows`` names
   them (``--rows compile``: all of them), since they take minutes of compiling;
4. prints a summary: test counts, then the benchmark table.

With ``$OUT`` set, writes ``$OUT/gpu_test.log`` (everything printed) and ``$OUT/bench.json`` (all
rows, in the format of ``--json``). Exits 1 if a test failed or errored, or pytest could not run.

Usage: ``python scripts/gpu_test.py [--tests core,compile,training,distributed] [--rows mlp,llama]
[--no-compile] [--skip-tests] [--skip-bench]`` (``--rows compile`` stands for every ``compile-*``
row). The whole of ``tests/gpu`` takes longer than one 10-minute device call: ``--tests`` runs
one group of it (``core``: every file but those below, a few minutes; ``compile``: the
``test_compile*`` files but the next two, about 5 minutes of Inductor; ``training``:
``test_compile_hf_training.py`` (Hugging Face models trained through the backend, one process
each) and ``test_compile_training_loop.py`` (training loops as people write them), about 7
minutes; ``distributed``: ``test_distributed.py``,
which spawns processes and compiles, the slowest), or test files by path. A run cut off by
``--timeout`` still reports what it saw, from pytest's progress line.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, TextIO

ROOT = Path(__file__).resolve().parents[1]


def default_rows(compile_rows: bool = True) -> list[str]:
    """Every row of ``torchreplay.bench.ROWS`` (without the ``compile-*`` rows when
    ``compile_rows`` is false); the first three if torchreplay does not import."""
    sys.path.insert(0, str(ROOT))
    try:
        from torchreplay.bench import ROWS
    except Exception as exc:  # report the tests anyway; the bench rows will show the error
        print(f"cannot import torchreplay.bench ({type(exc).__name__}: {exc})", flush=True)
        return ["mlp", "resnet50", "llama"]
    return [row for row in ROWS if compile_rows or not row.startswith("compile-")]


def chosen_rows(rows: str | None, no_compile: bool) -> list[str]:
    """The rows of ``--rows`` (``compile``: every compile-* row), or the default rows."""
    if not rows:
        # The compile-* rows take minutes of compiling: with them, tests and rows would not fit
        # in one 10-minute device call. Run them with `--skip-tests --rows compile`.
        return default_rows(compile_rows=False)
    out: list[str] = []
    for row in rows.split(","):
        out += [r for r in default_rows() if r.startswith("compile-")] if row == "compile" else [row]
    return out


class Log:
    """Print to stdout (flushed at once) and, when given, to a log file."""

    def __init__(self, file: TextIO | None) -> None:
        self.file = file

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        if self.file is not None:
            self.file.write(text + "\n")
            self.file.flush()


def run_streamed(cmd: list[str], emit: Callable[[str], None], env: dict[str, str],
                 timeout: float) -> tuple[int, str]:
    """Run ``cmd`` in the repository root, echo its output line by line, return (rc, output)."""
    emit("$ " + " ".join(cmd))
    lines: list[str] = []
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    # A hung child (a capture that never ends) is killed even if it prints nothing.
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            emit(lines[-1])
        rc = proc.wait()
    finally:
        timer.cancel()
    if rc < 0:
        emit(f"(ended by signal {-rc}; the time limit is {timeout:.0f} s)")
    return rc, "\n".join(lines)


#: the compile backend in training on HF models and in training loops (the "training" group)
_TRAINING = ("test_compile_hf_training.py", "test_compile_training_loop.py")
#: ``--tests`` groups: each fits one device call (see the module docstring).
TEST_GROUPS = {
    "compile": lambda name: name.startswith("test_compile") and name not in _TRAINING,
    "training": lambda name: name in _TRAINING,
    "distributed": lambda name: name == "test_distributed.py",
}
TEST_GROUPS["core"] = lambda name: not any(g(name) for k, g in TEST_GROUPS.items() if k != "core")


def test_paths(tests: str | None) -> list[str]:
    """The pytest paths of ``--tests``: ``tests/gpu`` for none or ``all``, each group's files in
    name order, or the paths given."""
    if not tests or tests == "all":
        return ["tests/gpu"]
    files = sorted(p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    out: list[str] = []
    for part in tests.split(","):
        if part in TEST_GROUPS:
            out += [f"tests/gpu/{f}" for f in files if TEST_GROUPS[part](f)]
        else:
            out.append(part)
    return out


def pytest_counts(output: str) -> dict[str, int]:
    """Read ``N passed, M failed, K skipped, E errors`` from pytest's last summary line; without
    one (the run was cut off), count the results of its ``-v`` lines, or the marks of its
    ``-q`` progress lines."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)
               and re.search(r"\bin [\d.]+s", line)]
    if summary:
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b", summary[-1]):
            key = "errors" if word.startswith("error") else word
            counts[key] = counts.get(key, 0) + int(n)
        return counts
    verbose = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "errors"}
    for line in output.splitlines():
        result = re.match(r"\S+::.*? (PASSED|FAILED|SKIPPED|ERROR)\b", line)
        if result:
            counts[verbose[result.group(1)]] += 1
            continue
        marks = re.fullmatch(r"([.sFExX]+)(\s+\[\s*\d+%\])?", line.strip())
        if marks:
            for mark, key in ((".", "passed"), ("s", "skipped"), ("F", "failed"), ("E", "errors")):
                counts[key] += marks.group(1).count(mark)
    return counts


def environment_line() -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CUDA not available)"
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {gpu}, python {sys.version.split()[0]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated bench rows, `compile` for every compile-* "
                        "row (default: every row; with --no-compile, every row but compile-*)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true",
                        help="skip torch.compile: its methods in every row, and the compile-* rows")
    parser.add_argument("--tests", help="comma-separated groups of tests/gpu (core, compile, "
                        "training, distributed) or test paths (default: all of tests/gpu)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--timeout", type=float, default=540, help="seconds per subprocess")
    args = parser.parse_args()

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    log_file = open(out_dir / "gpu_test.log", "w") if out_dir else None
    emit = Log(log_file)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))

    emit("== environment")
    emit(environment_line())

    counts: dict[str, int] | None = None
    pytest_rc = 0
    if not args.skip_tests:
        paths = test_paths(args.tests)
        emit("\n== " + " ".join(paths))
        # (-v: a line as each test ends, so a run cut off by a time limit still says which
        # passed; -q's progress marks reach the log only at a full line of 72)
        pytest_rc, output = run_streamed([sys.executable, "-m", "pytest", *paths, "-v", "-rA"],
                                         emit, env, args.timeout)
        counts = pytest_counts(output)

    rows: list[dict[str, Any]] = []
    bench_status: dict[str, str] = {}
    doc: dict[str, Any] = {}
    if not args.skip_bench:
        emit("\n== benchmark rows (quick)")
        with tempfile.TemporaryDirectory() as tmp:
            for row in chosen_rows(args.rows, args.no_compile):
                path = Path(tmp) / f"{row}.json"
                cmd = [sys.executable, "-m", "torchreplay", "bench", "--model", row,
                       "--repeats", str(args.repeats), "--calls", str(args.calls), "--json", str(path)]
                if args.no_compile:
                    cmd.append("--no-compile")
                rc, _ = run_streamed(cmd, emit, env, args.timeout)
                if path.exists():
                    part = json.loads(path.read_text())
                    doc.setdefault("environment", part["environment"])
                    doc.setdefault("options", part["options"])
                    rows.extend(part["results"])
                    bench_status[row] = "ok" if rc == 0 else f"exit {rc}"
                else:
                    bench_status[row] = f"no results (exit {rc})"
        doc["results"] = rows
        if out_dir is not None:
            (out_dir / "bench.json").write_text(json.dumps(doc, indent=2) + "\n")

    # Summary
    emit("\n== summary")
    emit(environment_line())
    failed = False
    if counts is not None:
        emit("tests/gpu: " + ", ".join(f"{v} {k}" for k, v in counts.items())
             + f" (pytest exit {pytest_rc})")
        # 5: no tests collected, which is not a failure of the code.
        failed = counts["failed"] > 0 or counts["errors"] > 0 or pytest_rc not in (0, 5)
    if bench_status:
        emit("bench rows: " + ", ".join(f"{k}: {v}" for k, v in bench_status.items()))
    if rows:
        emit(render_table(rows))
    if out_dir is not None:
        emit(f"wrote {out_dir / 'gpu_test.log'}" + (f" and {out_dir / 'bench.json'}" if rows else ""))
    if log_file is not None:
        log_file.close()
    return 1 if failed else 0


def render_table(rows: list[dict[str, Any]]) -> str:
    """Return the benchmark table as plain text (the same table ``torchreplay bench`` prints)."""
    sys.path.insert(0, str(ROOT))
    from rich.console import Console

    from torchreplay.cli import results_table

    console = Console(width=160, record=True, file=io.StringIO())
    console.print(results_table(rows))
    return console.export_text().rstrip()


if __name__ == "__main__":
    sys.exit(main())
