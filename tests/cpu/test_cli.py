"""The command line, in process (``cli.main``) and as ``python -m torchreplay``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchreplay
from torchreplay import bench, cli
from torchreplay.models import factories

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FACTORIES = Path(factories.__file__)

EXIT_0_NO_CUDA = ("exit 0: the only finding, (no CUDA tensor), is expected on a machine without "
                  "CUDA; every other finding would break capture on a GPU")
EXIT_1_NO_CUDA = ("exit 1: 1 finding would break capture on a GPU; the (no CUDA tensor) finding is "
                  "expected on a machine without CUDA and is not counted")


def line_of(path: Path, marker: str) -> int:
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if marker in line:
            return i
    raise AssertionError(marker)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the CLI in process; return (exit code, stdout with whitespace collapsed, stderr)."""
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, " ".join(captured.out.split()), " ".join(captured.err.split())


def run_subprocess(*argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    return subprocess.run([sys.executable, "-m", "torchreplay", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


# -- --version ---------------------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"torchreplay {torchreplay.__version__} (torch {torch.__version__})"


def test_python_m_torchreplay_version() -> None:
    proc = run_subprocess("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"torchreplay {torchreplay.__version__} ")


def test_a_command_is_required_and_unknown_rows_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["bench", "--model", "nope"], ["bench", "--repeats", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


# -- check -------------------------------------------------------------------------------------


def no_cuda_finding(spec: str, path: Path, factory: str, called: str) -> str:
    """The ``(no CUDA tensor)`` row of the plain report: at the factory's ``def`` line."""
    return (f"(no CUDA tensor) cpu-tensor {path}:{line_of(path, f'def {factory}(')} "
            f"code: the whole call of {called}(...)")


def test_check_clean_factory_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "check", "cli_factories:clean")
    assert code == 0, out


def test_check_without_cuda_points_at_the_factory_and_explains_exit_0(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, _ = run(capsys, "check", "cli_factories:clean")
    assert code == 0, out
    assert no_cuda_finding("clean", HERE / "cli_factories.py", "clean", "<lambda>") in out
    assert out.endswith(EXIT_0_NO_CUDA)


def test_check_builtin_model_points_at_its_factory_not_the_model_class(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, _ = run(capsys, "check", cli.BUILTIN_FACTORY)
    assert code == 0, out
    assert out.startswith("torchreplay.check: 1 finding that would break CUDA graph capture")
    assert no_cuda_finding(cli.BUILTIN_FACTORY, FACTORIES, "mlp_factory", "MLP") in out
    assert out.endswith(EXIT_0_NO_CUDA)


def test_check_findings_exit_1_and_name_the_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, _ = run(capsys, "check", "cli_factories:item_sync")  # returns (fn, args, kwargs)
    assert code == 1
    line = line_of(HERE / "cli_factories.py", "# LINE: item")
    assert f"Tensor.item host-sync {HERE / 'cli_factories.py'}:{line}" in out
    assert no_cuda_finding("item_sync", HERE / "cli_factories.py", "item_sync", "fn") in out
    assert out.endswith(EXIT_1_NO_CUDA)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("cli_factories", "expected MODULE:FACTORY"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("cli_factories:missing", "has no attribute 'missing'"),
        ("cli_factories:NOT_CALLABLE", "not a callable factory"),
        ("cli_factories:not_a_pair", "must return (fn, args) or (fn, args, kwargs), got int"),
        ("cli_factories:raises", "raised RuntimeError: factory exploded"),
        ("cli_factories:fn_raises", "raised ValueError"),
    ],
)
def test_check_bad_factory_exits_2_with_the_reason(
    capsys: pytest.CaptureFixture[str], spec: str, message: str
) -> None:
    code, _, err = run(capsys, "check", spec)
    assert code == 2
    assert message in err


def test_check_subprocess() -> None:
    proc = run_subprocess("check", "cli_factories:item_sync")
    assert proc.returncode == 1, proc.stderr
    assert f"cli_factories.py:{line_of(HERE / 'cli_factories.py', '# LINE: item')}" in proc.stdout


# -- bench without CUDA ------------------------------------------------------------------------


def test_every_bench_row_has_a_factory_but_the_compile_rows() -> None:
    assert list(factories.ROW_FACTORIES) == [r for r in bench.ROWS if r not in bench.COMPILE_ROWS]
    assert bench.COMPILE_ROWS and all(r.startswith("compile-") for r in bench.COMPILE_ROWS)
    for spec in factories.ROW_FACTORIES.values():
        assert callable(cli.load_factory(spec))


def test_bench_help_lists_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "{" + ",".join([*bench.ROWS, "compile", "all"]) + "}" in out.replace(" ", "")
    for row in bench.COMPILE_ROWS:
        cli.build_parser().parse_args(["bench", "--model", row])  # accepted


def test_bench_without_cuda_skips_a_compile_row_and_says_why(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "bench.json"
    code, out, _ = run(capsys, "bench", "--model", "compile-if", "--json", str(path))
    assert code == 0
    assert out.startswith(
        f"CUDA is not available on this machine (torch {torch.__version__}), so there is nothing "
        "to time: `torchreplay bench` compares CUDA graphs on a GPU. skipped without CUDA: "
        "compile-if: they time torch.compile backends as CUDA graphs and have no CPU stand-in; "
        "`torchreplay explain MODULE:FACTORY` shows how tr.compile would split a model"
    )
    assert "Running" not in out and "torchreplay.check" not in out
    (entry,) = json.loads(path.read_text())["checks"]
    assert entry["row"] == "compile-if" and entry["skipped"].startswith("they time torch.compile")


def test_bench_without_cuda_compile_group_skips_every_compile_row(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, _ = run(capsys, "bench", "--model", "compile")
    assert code == 0
    assert f"skipped without CUDA: {', '.join(bench.COMPILE_ROWS)}: " in out


def test_bench_without_cuda_checks_the_model_of_the_row_asked_for(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, _ = run(capsys, "bench", "--model", "llama")
    assert code == 0
    spec = factories.ROW_FACTORIES["llama"]
    assert out.startswith(
        f"CUDA is not available on this machine (torch {torch.__version__}), so there is nothing "
        "to time: `torchreplay bench` compares CUDA graphs on a GPU. Running `torchreplay check` "
        f"on the model of the llama row instead. llama: torchreplay check {spec} "
        "torchreplay.check: 1 finding"
    )
    assert no_cuda_finding(spec, FACTORIES, "llama_factory", "Llama") in out
    assert out.endswith("llama: " + EXIT_0_NO_CUDA.removeprefix("exit 0: "))
    assert "MLP" not in out and "wrote" not in out


def test_bench_without_cuda_checks_a_training_row_with_its_train_step(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, _ = run(capsys, "bench", "--model", "mlp-train")
    assert code == 0
    spec = factories.ROW_FACTORIES["mlp-train"]
    # The fused AdamW step reads nothing on the host: the only finding is the expected one.
    assert "torchreplay.check: 1 finding" in out
    assert no_cuda_finding(spec, FACTORIES, "mlp_train_factory", "train_step") in out


def test_bench_without_cuda_writes_the_findings_to_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "bench.json"
    code, out, _ = run(capsys, "bench", "--model", "llama", "--json", str(path))
    assert code == 0
    assert f"wrote {path}" in out
    doc = json.loads(path.read_text())
    assert doc["cuda"] is False
    assert doc["environment"]["torch"] == torch.__version__
    spec = factories.ROW_FACTORIES["llama"]
    (check,) = doc["checks"]
    assert (check["row"], check["factory"]) == ("llama", spec)
    (finding,) = check["findings"]
    assert finding["op"] == "(no CUDA tensor)" and finding["kind"] == "cpu-tensor"
    assert finding["location"] == f"{FACTORIES}:{line_of(FACTORIES, 'def llama_factory(')}"
    assert finding["reason"].startswith("the call touched no CUDA tensor")
    assert finding["fix"].startswith("pass CUDA tensors")


def test_bench_without_cuda_checks_the_given_factory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, _ = run(capsys, "bench", "--factory", "cli_factories:item_sync")
    assert code == 0
    assert "Running `torchreplay check cli_factories:item_sync` instead." in out
    assert "built-in" not in out
    line = line_of(HERE / "cli_factories.py", "# LINE: item")
    assert f"Tensor.item host-sync {HERE / 'cli_factories.py'}:{line}" in out
    assert out.endswith("exit 0: without CUDA `torchreplay bench` only checks and does not count "
                        "findings; `torchreplay check MODULE:FACTORY` exits 1 on them")
    path = tmp_path / "bench.json"
    code, _, err = run(capsys, "bench", "--factory", "cli_factories:missing", "--json", str(path))
    assert code == 2 and "has no attribute" in err
    (check,) = json.loads(path.read_text())["checks"]
    assert check == {"row": "cli_factories:missing", "factory": "cli_factories:missing",
                     "error": "'cli_factories' has no attribute 'missing'"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the benchmark")
def test_bench_subprocess_without_cuda_checks_every_row() -> None:
    # What `make demo` runs on a CPU machine.
    proc = run_subprocess("bench")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("CUDA is not available")
    for row, spec in factories.ROW_FACTORIES.items():
        assert f"\n{row}: torchreplay check {spec}\n" in proc.stdout
        if row == "llama-breaks":  # host-side lengths: what breakable graphs are for
            assert "\nllama-breaks: 1 finding would break capture on a GPU" in proc.stdout
            assert "code: span = int(lens.max())" in proc.stdout
            continue
        # Every other built-in row is clean: its only finding is the one expected without CUDA.
        assert f"\n{row}: {EXIT_0_NO_CUDA.removeprefix('exit 0: ')}\n" in proc.stdout
    assert "compile-" not in proc.stdout  # `all` leaves the compile rows out
    proc = run_subprocess("bench", "--model", "compile")
    assert proc.returncode == 0, proc.stderr
    assert f"\nskipped without CUDA: {', '.join(bench.COMPILE_ROWS)}: " in proc.stdout


# -- explain -----------------------------------------------------------------------------------


def split_line() -> str:
    """The eager piece of ``cli_factories:pieces``, with the user's file:line."""
    path = HERE / "cli_factories.py"
    return (f"piece 1 1 node(s) eager: cli_factories.halve at {path}:{line_of(path, '# LINE: split')}: "
            "is a splitting op (splitting_ops=)")


def test_explain_without_cuda_reports_the_split_a_gpu_would_get(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, "explain", "cli_factories:pieces", "--sizes", "1,2,4",
                         "--splitting-ops", "cli_factories.halve", "--no-inductor")
    assert code == 0, err
    assert out.startswith("torchreplay: 1 graph(s) compiled in ")
    assert ("(options: sizes=[1, 2, 4], splitting_ops=['cli_factories.halve'], inductor=False) "
            "1 graph(s) without CUDA graphs: their inputs are on the CPU") in out
    assert ("CUDA is not available on this machine, so tr.compile ran without CUDA graphs. The "
            "split a GPU would get") in out
    assert out.endswith(
        "1 Dynamo graph(s) graph 0: 3 piece(s), 2 graphed, 1 eager "
        f"piece 0 2 node(s) graphed {split_line()} piece 2 1 node(s) graphed"
    )


def test_explain_without_splitting_ops_is_one_piece(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, "explain", "cli_factories:pieces", "--no-inductor")
    assert code == 0, err
    assert out.endswith("graph 0: 1 piece(s), 1 graphed, 0 eager piece 0 4 node(s) graphed")


def test_explain_subprocess_with_inductor() -> None:
    # On a GPU this is the real report (graphs captured); without one, the preview: the pieces
    # are the same either way.
    proc = run_subprocess("explain", "cli_factories:pieces", "--splitting-ops", "cli_factories.halve")
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "inductor=True)" in out
    assert "graph 0: 3 piece(s), 2 graphed, 1 eager" in out
    assert split_line() in out


@pytest.mark.parametrize(
    "spec, message",
    [
        ("cli_factories", "expected MODULE:FACTORY"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("cli_factories:missing", "has no attribute 'missing'"),
        ("cli_factories:not_a_pair", "must return (fn, args) or (fn, args, kwargs), got int"),
        ("cli_factories:raises", "raised RuntimeError: factory exploded"),
    ],
)
def test_explain_bad_factory_exits_2_with_the_reason(
    capsys: pytest.CaptureFixture[str], spec: str, message: str
) -> None:
    code, out, err = run(capsys, "explain", spec)
    assert code == 2 and out == ""
    assert err.startswith("torchreplay explain: ") and message in err


def test_explain_a_call_that_raises_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run(capsys, "explain", "cli_factories:fn_raises", "--no-inductor")
    assert code == 1
    assert ("torchreplay explain: the call from cli_factories:fn_raises raised ValueError while "
            "compiling and calling it: fn exploded; `torchreplay check cli_factories:fn_raises` "
            "shows what a CUDA graph cannot hold") in err


@pytest.mark.parametrize("argv", [["--sizes", "0,2"], ["--sizes", "a"], []])
def test_explain_needs_a_target_and_valid_sizes(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["explain", *argv] + (["cli_factories:pieces"] if argv else []))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "expected sizes" in err if argv else "MODULE:FACTORY" in err


def test_explain_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["explain", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--sizes", "--splitting-ops", "--dim", "--no-inductor", "MODULE:FACTORY"):
        assert flag in out
