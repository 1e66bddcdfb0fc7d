"""The benchmark harness without a GPU: ratios, factory results, options, the table, call counts."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import types

import pytest
import torch
from rich.console import Console

from torchreplay import bench
from torchreplay.bench import compile as compile_rows
from torchreplay.bench import compile_costs, inference, timing
from torchreplay.bench.inference import COMPILE, TR_GRAPH
from torchreplay.bench.timing import EAGER, FLOOR, BenchOptions, Measurement
from torchreplay.cli import results_table


def test_rows_registry() -> None:
    assert list(bench.ROWS) == [
        "mlp", "resnet50", "llama", "llama-sizes", "llama-breaks", "mlp-train", "resnet50-train",
        "compile-mlp", "compile-if", "compile-nonzero", "compile-bert", "compile-sweep",
        "compile-resnet50", "compile-memory", "compile-split-cost",
    ]
    assert bench.COMPILE_ROWS == tuple(bench.ROWS)[7:]
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


# -- interleaved timing and the compile rows ------------------------------------------------------


def test_time_interleaved_counts_calls_and_isolates_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    order: list[str] = []

    def failing() -> None:
        order.append("bad")
        if order.count("bad") > 4 + 5:  # the warm-up and the first sample work, the second fails
            raise RuntimeError("boom")

    opts = BenchOptions(repeats=3, calls=5, host_calls=2, warmup=4)
    out = timing.time_interleaved({"a": lambda: order.append("a"), "bad": failing,
                                   "b": lambda: order.append("b")}, opts)
    n_host = timing.host_samples(opts)
    assert order.count("a") == order.count("b") == 4 + 3 * 5 + n_host * 2
    assert order.count("bad") == 4 + 5 + 1
    assert out["bad"] == "failed: RuntimeError: boom"
    per_call, host, host_median = out["a"]
    assert per_call >= 0 and 0 <= host <= host_median
    # interleaved: each sample of a is followed by one of bad (while it works) or b
    first_sample = order[3 * 4:]
    assert first_sample[:5] == ["a"] * 5 and first_sample[5:10] == ["bad"] * 5
    assert first_sample[10:15] == ["b"] * 5 and first_sample[15:20] == ["a"] * 5
    # a sync before and after each warm-up and sample (only before the sample that failed), a
    # sync before each host sample, one at the end
    assert len(syncs) == 3 * 2 + (3 * 2 + (2 + 1 + 2) + 2 * 2) + 2 * n_host + 1


def test_results_table_shows_first_call_notes_and_skips() -> None:
    raw = [
        Measurement("r", "MLP b8", EAGER, 800.0, 790.0, first_call_s=0.01),
        Measurement("r", "MLP b8", "tr.compile", 100.0, 20.0, first_call_s=1.5,
                    note="0.97x reduce-overhead"),
        Measurement("r", "BERT", "every method", error=timing.skipped("transformers is not installed")),
    ]
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(results_table(dataclasses.asdict(m) for m in raw))
    text = console.export_text()
    assert "first call s" in text and "1.50" in text
    assert "0.97x reduce-overhead" in text
    assert "skipped: transformers is not installed" in text and "failed" not in text
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(results_table([dataclasses.asdict(Measurement("r", "w", EAGER, 800.0, 790.0))]))
    assert "first call s" not in console.export_text()  # rows that do not measure it


class _FakeCompiled:
    """What compile_summary reads of a tr.compile result: one Dynamo graph, two pieces, one of
    which failed to capture, two calls ungraphed."""

    def __init__(self) -> None:
        piece = types.SimpleNamespace(graphed=True)
        runtime = types.SimpleNamespace(program=types.SimpleNamespace(pieces=[piece, piece]),
                                        failures={1: "x"}, stats=types.SimpleNamespace(fallbacks=2))
        self.backend = types.SimpleNamespace(runtimes=[runtime], compiles=1)

    def __call__(self, *args: object) -> None:
        return None


def _fake_compile_env(monkeypatch: pytest.MonkeyPatch, timings: dict) -> list[str]:
    """Build fakes instead of compiling (backend="cudagraphs" fails), time nothing."""
    built: list[str] = []

    def build(method: str, w: object) -> object:
        built.append(method)
        if method == compile_rows.CUDAGRAPHS:
            raise RuntimeError("shape error")
        return _FakeCompiled() if method.startswith("tr.compile") else (lambda *args: None)

    monkeypatch.setattr(compile_rows, "_build", build)
    monkeypatch.setattr(compile_rows, "time_interleaved",
                        lambda calls, opts: {m: timings[m] for m in calls})
    monkeypatch.setattr(compile_rows, "release", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return built


def test_compile_workload_builds_each_method_times_them_and_notes_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    RO, OURS = compile_rows.REDUCE_OVERHEAD, compile_rows.TR_COMPILE
    timings = {EAGER: (400.0, 390.0, 395.0), RO: (150.0, 50.0, 60.0), OURS: (120.0, 30.0, 35.0),
               TR_GRAPH: "failed: CaptureError: .item()"}
    built = _fake_compile_env(monkeypatch, timings)
    w = compile_rows.CompileWorkload("compile-x", "w", torch.nn.Identity(), ((torch.ones(2),),))
    results = {m.method: m for m in compile_rows.measure_compile_workload(w, BenchOptions())}
    assert built == [EAGER, RO, compile_rows.CUDAGRAPHS, TR_GRAPH, OURS]
    assert list(results) == built
    assert results[compile_rows.CUDAGRAPHS].error == "failed: RuntimeError: shape error"
    assert results[compile_rows.CUDAGRAPHS].first_call_s is None
    assert results[TR_GRAPH].error == "failed: CaptureError: .item()"
    assert results[TR_GRAPH].first_call_s is not None
    ours = results[OURS]
    assert ours.speedup == pytest.approx(400 / 120) and ours.first_call_s is not None
    assert ours.values["vs_reduce_overhead"] == pytest.approx(0.8)
    assert ours.note == ("0.80x reduce-overhead (target <= 1.0x); 1 Dynamo graph(s), 2 piece(s), "
                         "1 graphed; 2 piece call(s) ran ungraphed")
    # --no-compile leaves out torch's compile methods, not ours
    built.clear()
    compile_rows.measure_compile_workload(w, BenchOptions(compile=False))
    assert built == [EAGER, TR_GRAPH, OURS]


def test_the_sweep_compares_ours_with_its_fixed_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    OURS, FIXED = compile_rows.TR_COMPILE, compile_rows.TR_COMPILE_FIXED
    timings = {EAGER: (400.0, 390.0, 395.0), OURS: (104.0, 30.0, 35.0), FIXED: (100.0, 28.0, 30.0)}
    _fake_compile_env(monkeypatch, timings)
    w = compile_rows.CompileWorkload(
        "compile-sweep", "w", torch.nn.Identity(), tuple((torch.ones(b),) for b in (1, 2, 3)),
        methods=(EAGER, OURS, FIXED), sizes=(1, 2, 4),
        fixed=tuple((compile_rows._padded(torch.ones(b, 2), (1, 2, 4)),) for b in (1, 2, 3)),
    )
    assert [args[0].shape[0] for args in w.fixed] == [1, 2, 4]
    assert w.fixed[2][0][3].eq(0).all() and w.fixed[2][0][:3].eq(1).all()
    results = compile_rows.measure_compile_workload(w, BenchOptions(compile=False))
    assert [m.method for m in results] == [EAGER, "tr.compile sizes=1,2,4",
                                          "tr.compile, fixed shape, one compile per size (1,2,4)"]
    assert results[1].values["vs_fixed_shape"] == pytest.approx(1.04)
    assert results[1].note.startswith("1.04x its fixed-shape time (target <= 1.05x); ")


def test_the_fixed_reference_compiles_each_shape_on_a_frame_of_its_own() -> None:
    torch._dynamo.reset()
    try:
        model = torch.nn.Linear(3, 2)
        fn = compile_rows._compile_per_shape(model)
        with torch.no_grad():
            for b in (1, 2, 1, 4):
                x = torch.randn(b, 3)
                torch.testing.assert_close(fn(x), model(x))
        compiled = fn.compiled
        assert sorted(s[0] for s in compiled) == [1, 2, 4]
        codes = {c.compiled._torchdynamo_orig_callable.__code__ for c in compiled.values()}
        assert len(codes) == 3  # a code object each: no shared cache, no dynamic recompile
        assert all(c.backend.compiles == 1 for c in compiled.values())
    finally:
        torch._dynamo.reset()


def test_split_cost_notes_are_per_split_over_one_piece() -> None:
    labels = {"k1": ("returns", 1), "k2": ("returns", 2), "k4": ("returns", 4), "w4": ("writes", 4)}
    op_labels = {"returns": "op alone", "writes": "out op alone"}
    raw = [Measurement("r", "w", "k4", 160.0, 70.0), Measurement("r", "w", "k1", 100.0, 10.0),
           Measurement("r", "w", "k2", 120.0, 30.0), Measurement("r", "w", "op alone", 5.0, 4.0),
           Measurement("r", "w", "w4", 130.0, 40.0), Measurement("r", "w", "out op alone", 3.0, 6.0)]
    built = {label: _FakeCompiled() for label in labels}
    alone = ["op alone", "out op alone"]
    out = {m.method: m for m in compile_costs._split_notes(raw, labels, built, op_labels, alone)}
    assert list(out) == ["k1", "k2", "k4", "w4", "op alone", "out op alone"]
    assert out["k2"].values["host_us_per_split"] == pytest.approx(20.0)
    assert out["k4"].values["host_us_per_split"] == pytest.approx(20.0)
    assert out["k4"].values["per_call_us_per_split"] == pytest.approx(20.0)
    assert out["k4"].values["ours_host_us_per_split"] == pytest.approx(16.0)
    assert out["k4"].note.startswith("+20.0 us host per split (target <= 20 us), +20.0 us synchronized; "
                                     "+16.0 us of it ours (the op alone: 4.0 us); ")
    assert out["w4"].values["host_us_per_split"] == pytest.approx(10.0)
    assert out["w4"].values["ours_host_us_per_split"] == pytest.approx(4.0)
    assert "per split" not in out["k1"].note and out["op alone"].note is None


def test_split_cost_notes_also_count_over_the_same_model_not_split() -> None:
    labels = {"k1": ("returns", 1), "k4": ("returns", 4)}
    unsplit = {"k4 whole": ("returns", 4)}
    raw = [Measurement("r", "w", "k1", 100.0, 10.0), Measurement("r", "w", "k4", 160.0, 70.0),
           Measurement("r", "w", "k4 whole", 110.0, 25.0), Measurement("r", "w", "op alone", 5.0, 4.0)]
    built = {label: _FakeCompiled() for label in [*labels, *unsplit]}
    out = {m.method: m for m in compile_costs._split_notes(
        raw, labels, built, {"returns": "op alone"}, ["op alone"], unsplit)}
    assert list(out) == ["k1", "k4", "k4 whole", "op alone"]
    assert out["k4"].values["host_us_per_split"] == pytest.approx(20.0)
    assert out["k4"].values["host_us_per_split_same_model"] == pytest.approx(15.0)
    assert out["k4"].values["per_call_us_per_split_same_model"] == pytest.approx(50.0 / 3)
    assert "+15.0 us host per split over the same model not split" in out["k4"].note
    assert "per split" not in out["k4 whole"].note and out["k4 whole"].note  # what was made


@pytest.mark.skipif(importlib.util.find_spec("transformers") is not None, reason="transformers is installed")
def test_bert_row_without_transformers_is_one_skipped_entry() -> None:
    (m,) = compile_rows.compile_bert_row(BenchOptions(), None)
    assert m.row == "compile-bert" and m.per_call_us is None
    assert m.error == "skipped: transformers is not installed (pip install transformers), so there is no BertModel"
