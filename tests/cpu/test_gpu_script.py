"""scripts/gpu_test.py (``make gpu-test``): the test groups that each fit one device call, and
the counts of a run cut off by its time limit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_test", ROOT / "scripts" / "gpu_test.py")
gpu_test = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_test)  # type: ignore[union-attr]


def test_the_groups_cover_every_gpu_test_file_once() -> None:
    files = sorted(f"tests/gpu/{p.name}" for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    groups = [gpu_test.test_paths(g) for g in ("core", "compile", "training", "distributed")]
    assert sorted(f for g in groups for f in g) == files
    training = ["tests/gpu/test_compile_hf_training.py", "tests/gpu/test_compile_training_loop.py"]
    assert groups[1] == [f for f in files if "/test_compile" in f and f not in training]
    assert groups[2] == training
    assert groups[3] == ["tests/gpu/test_distributed.py"]
    assert gpu_test.test_paths(None) == gpu_test.test_paths("all") == ["tests/gpu"]
    assert gpu_test.test_paths("compile,tests/gpu/test_graph.py")[-1] == "tests/gpu/test_graph.py"


def test_a_run_cut_off_is_counted_from_its_progress_lines() -> None:
    cut = "$ python -m pytest\n" + "." * 70 + "s." + " [ 38%]\n" + ".F..E.s\n(ended by signal 9)\n"
    assert gpu_test.pytest_counts(cut) == {"passed": 75, "failed": 1, "skipped": 2, "errors": 1}
    done = cut + "===== 3 failed, 10 passed, 1 skipped in 12.5s =====\n"
    assert gpu_test.pytest_counts(done) == {"passed": 10, "failed": 3, "skipped": 1, "errors": 0}


def test_a_verbose_run_cut_off_is_counted_from_its_result_lines() -> None:
    cut = "\n".join([
        "$ python -m pytest -v",
        "tests/gpu/test_a.py::test_one PASSED                                [  1%]",
        "tests/gpu/test_a.py::test_two[x-1] FAILED                           [  2%]",
        "tests/gpu/test_a.py::test_three SKIPPED (needs two GPUs)            [  3%]",
        "tests/gpu/test_b.py::test_four ERROR                                [  4%]",
        "tests/gpu/test_b.py::test_five[whole model] PASSED                  [  5%]",
        "FAILED tests/gpu/test_a.py::test_two[x-1] - AssertionError",  # (-rA's summary: not again)
        "(ended by signal 9)",
    ])
    assert gpu_test.pytest_counts(cut) == {"passed": 2, "failed": 1, "skipped": 1, "errors": 1}
