"""The benchmark harness without a GPU: ratios, factory results, options, the table, call counts."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from rich.console import Console

from torchreplay import bench
from torchreplay.bench import inference, timing
from torchreplay.bench.inference import COMPILE, TR_GRAPH
from torchreplay.bench.timing import EAGER, FLOOR, BenchOptions, Measurement
from torchreplay.cli import results_table


def test_rows_registry() -> None:
    assert list(bench.ROWS) == ["mlp", "resnet50", "llama", "llama-sizes", "mlp-train", "resnet50-train"]
    with pytest.raises(TypeError):
        bench.ROWS["x"] = None  # type: ignore[index]  # read-only: rows are defined in bench/__init__.py


def test_ratios_are_relative_to_floor_and_eager() -> None:
    raw = [
        Measurement("r", "w", EAGER, per_call_us=800.0, host_us=790.0),
        Measurement("r", "w", FLOOR, per_call_us=100.0, host_us=4.0),
        Measurement("r", "w", COMPILE, error="failed: RuntimeError: boom"),
        Measurement("r", "w", TR_GRAPH, per_call_us=104.0, host_us=7.5),
    ]
    out = {m.method: m for m in timing.with_ratios(raw)}
    assert out[FLOOR].vs_floor == 1.0 and out[FLOOR].speedup == 8.0 and out[FLOOR].host_delta_us == 0.0
    assert out[TR_GRAPH].vs_floor == pytest.approx(1.04)
    assert out[TR_GRAPH].speedup == pytest.approx(800 / 104)
    assert out[TR_GRAPH].host_delta_us == pytest.approx(3.5)
    assert out[EAGER].speedup == 1.0 and out[EAGER].vs_floor == 8.0
    assert out[COMPILE] == raw[2]


def test_ratios_without_a_floor_are_none() -> None:
    raw = [Measurement("r", "w", EAGER, 10.0, 9.0), Measurement("r", "w", FLOOR, error="failed: x")]
    eager = timing.with_ratios(raw)[0]
    assert eager.vs_floor is None and eager.host_delta_us is None and eager.speedup == 1.0


def test_short_reason_is_one_short_line() -> None:
    reason = timing.short_reason(RuntimeError("first line " + "x" * 300 + "\nsecond"))
    assert reason.startswith("failed: RuntimeError: first line") and len(reason) <= 128
    assert "\n" not in reason and reason.endswith("...")


def test_time_call_counts_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    calls = []
    opts = BenchOptions(repeats=3, calls=5, host_calls=2, warmup=4)
    per_call, host, host_median = timing.time_call(lambda: calls.append(1), opts)
    n_host = timing.host_samples(opts)
    assert n_host == 40
    assert len(calls) == 4 + 3 * 5 + n_host * 2
    # one sync after warm-up, one per synchronized sample, one before each host sample, one at the end
    assert len(syncs) == 1 + 3 + n_host + 1
    assert per_call >= 0 and 0 <= host <= host_median


@pytest.mark.parametrize("field", ["repeats", "calls", "host_calls"])
def test_options_validate(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BenchOptions(**{field: 0})
    assert dataclasses.replace(timing.QUICK, repeats=1).repeats == 1


@pytest.mark.parametrize(
    "result, message",
    [
        (None, "got NoneType"),
        ((len,), "got tuple of length 1"),
        ((3, ()), "not callable"),
        ((len, [1]), None),
        ((len, 1), "args of type int"),
        ((len, (), []), "kwargs of type list"),
    ],
)
def test_unpack_factory_result(result: object, message: str | None) -> None:
    if message is None:
        assert inference.unpack_factory_result(result, "f") == (len, (1,), {})
    else:
        with pytest.raises(TypeError, match=message.replace("(", r"\(")):
            inference.unpack_factory_result(result, "f")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_run_needs_cuda_and_known_rows() -> None:
    with pytest.raises(ValueError, match="unknown benchmark rows"):
        bench.run(["nope"])
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        bench.run(["mlp"])


def test_results_table_renders_numbers_and_failures() -> None:
    raw = [
        Measurement("r", "MLP b8", EAGER, 800.0, 790.0),
        Measurement("r", "MLP b8", FLOOR, 100.0, 4.0),
        Measurement("r", "MLP b8", COMPILE, error="failed: RuntimeError: boom"),
        Measurement("r", "MLP b8", TR_GRAPH, 104.0, 7.5),
    ]
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(results_table(dataclasses.asdict(m) for m in timing.with_ratios(raw)))
    text = console.export_text()
    assert "failed: RuntimeError: boom" in text
    assert "1.04x" in text and "7.69x" in text and "+3.5" in text
    assert text.count("MLP b8") == 1  # the workload is a heading, once per group


def test_one_shape_workloads_skip_the_sizes_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    monkeypatch.setattr(inference, "_build", lambda method, w: built.append(method) or (lambda: None))
    monkeypatch.setattr(inference, "time_call", lambda call, opts: (1.0, 1.0, 1.0))
    monkeypatch.setattr(inference, "release", lambda: None)
    w = inference.Workload("r", "w", lambda x: x, (1,))
    results = inference.measure_workload(w, BenchOptions(compile=False))
    assert built == [EAGER, FLOOR, TR_GRAPH, inference.TR_STATIC]
    assert [m.method for m in results] == built
    built.clear()
    inference.measure_workload(dataclasses.replace(w, sizes=(1, 2)), BenchOptions(compile=False))
    assert inference.TR_SIZES in built and inference.TR_SIZES_STATIC in built
