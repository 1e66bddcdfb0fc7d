"""The command line, in process (``cli.main``) and as ``python -m torchreplay``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchreplay
from torchreplay import cli

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


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


def test_check_clean_factory_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "check", "cli_factories:clean")
    assert code == 0, out


def test_check_findings_exit_1_and_name_the_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "check", "cli_factories:item_sync")  # returns (fn, args, kwargs)
    assert code == 1
    line = line_of(HERE / "cli_factories.py", "# LINE: item")
    assert f"cli_factories.py:{line}" in out
    assert "host-sync" in out


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


def test_bench_without_cuda_says_so_and_checks_the_builtin_model(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, _ = run(capsys, "bench", "--json", "unused.json")
    assert code == 0
    assert out.startswith("CUDA is not available on this machine")
    assert f"Running `torchreplay check {cli.BUILTIN_FACTORY}` on the built-in model instead." in out
    assert "(no CUDA tensor)" in out  # the check report itself
    assert not Path("unused.json").exists()


def test_bench_without_cuda_checks_the_given_factory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, _ = run(capsys, "bench", "--factory", "cli_factories:item_sync")
    assert code == 0 and "torchreplay check cli_factories:item_sync" in out and "host-sync" in out
    code, _, err = run(capsys, "bench", "--factory", "cli_factories:missing")
    assert code == 2 and "has no attribute" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the benchmark")
def test_bench_subprocess_without_cuda_exits_0() -> None:
    # What `make demo` runs on a CPU machine.
    proc = run_subprocess("bench")
    assert proc.returncode == 0, proc.stderr
    assert "CUDA is not available" in proc.stdout
