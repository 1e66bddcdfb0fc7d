"""check.py on CPU tensors: every finding with its exact file:line, the report, and cleanup.

Each function under test marks the line a finding must point at with a ``# at:<name>`` comment;
:func:`line_of` finds it, so the tests survive edits above them.
"""

from __future__ import annotations

import collections.abc
import io
import sys

import pytest
import torch

import torchreplay as tr
from torchreplay.check import KINDS, NO_CUDA_OP, Finding, Report, check, check_call, diagnose

with open(__file__, encoding="utf-8") as _f:
    _SOURCE = _f.read().splitlines()


def line_of(name: str) -> int:
    """Return the 1-based line of this file that ends with the marker ``# at:<name>``."""
    marker = f"# at:{name}"
    hits = [i for i, line in enumerate(_SOURCE, 1) if line.rstrip().endswith(marker)]
    assert len(hits) == 1, f"marker {marker!r} found on lines {hits}"
    return hits[0]


def only(report: Report, kind: str) -> Finding:
    """Return the single finding of ``kind`` in ``report``."""
    found = [f for f in report if f.kind == kind]
    assert len(found) == 1, str(report)
    return found[0]


def assert_at(finding: Finding, name: str, *, kind: str, op: str) -> None:
    assert (finding.kind, finding.op) == (kind, op), str(finding)
    assert finding.filename == __file__
    assert finding.lineno == line_of(name)
    assert finding.code == _SOURCE[finding.lineno - 1].strip()
    assert finding.location == f"{__file__}:{line_of(name)}"


def assert_whole_call(finding: Finding, name: str, called: str) -> None:
    """The ``(no CUDA tensor)`` finding: at the marked line that made the call, not inside it."""
    assert (finding.kind, finding.op) == ("cpu-tensor", NO_CUDA_OP), str(finding)
    assert finding.location == f"{__file__}:{line_of(name)}"
    assert finding.code == f"the whole call of {called}(...)"


def x4() -> torch.Tensor:
    return torch.tensor([1.0, -2.0, 3.0, -4.0])


# --- host syncs -----------------------------------------------------------------------------------


def f_item(x):
    y = x * 2
    return y.sum().item()  # at:item


def f_tolist(x):
    return x.tolist()  # at:tolist


def f_cpu(x):
    return x.cpu()  # at:cpu


def f_numpy(x):
    return x.numpy()  # at:numpy


def f_print(x):
    print(x)  # at:print
    return x


def f_repr(x):
    return repr(x)  # at:repr


def f_bool(x):
    if x.sum() > 0:  # at:bool
        return x
    return -x


def f_float(x):
    return float(x.max())  # at:float


@pytest.mark.parametrize(
    "fn, name, op",
    [
        (f_item, "item", "Tensor.item"),
        (f_tolist, "tolist", "Tensor.tolist"),
        (f_cpu, "cpu", "Tensor.cpu"),
        (f_numpy, "numpy", "Tensor.numpy"),
        (f_print, "print", "Tensor.__repr__"),
        (f_repr, "repr", "Tensor.__repr__"),
        (f_bool, "bool", "aten._local_scalar_dense"),
        (f_float, "float", "aten._local_scalar_dense"),
    ],
)
def test_host_sync(fn, name, op):
    report = check(fn, x4())
    assert_at(only(report, "host-sync"), name, kind="host-sync", op=op)


def f_cuda_sync(x):
    y = x + 1
    torch.cuda.synchronize()  # at:cuda-sync
    return y


def test_cuda_synchronize_is_seen_before_it_fails_without_cuda():
    # torch.cuda.synchronize raises on a machine without CUDA; diagnose keeps what it saw.
    report = diagnose(f_cuda_sync, (x4(),), {})
    assert_at(report[0], "cuda-sync", kind="host-sync", op="torch.cuda.synchronize")


# --- data-dependent shapes ------------------------------------------------------------------------


def f_nonzero(x):
    return x.nonzero()  # at:nonzero


def f_mask(x):
    mask = x > 0
    return x[mask]  # at:mask


def f_masked_select(x):
    return torch.masked_select(x, x > 0)  # at:masked-select


def f_unique(x):
    return torch.unique(x)  # at:unique


def f_unique_consecutive(x):
    return torch.unique_consecutive(x)  # at:unique-consecutive


def f_where_one_arg(x):
    return torch.where(x > 0)  # at:where


def f_repeat_interleave(x, repeats):
    return torch.repeat_interleave(x, repeats)  # at:repeat


def f_mask_assign(x):
    x = x.clone()
    x[x > 0] = torch.zeros(2)  # at:mask-assign
    return x


@pytest.mark.parametrize(
    "fn, name, op",
    [
        (f_nonzero, "nonzero", "aten.nonzero"),
        (f_mask, "mask", "aten.index"),
        (f_masked_select, "masked-select", "aten.masked_select"),
        (f_unique, "unique", "aten._unique2"),
        (f_unique_consecutive, "unique-consecutive", "aten.unique_consecutive"),
        (f_where_one_arg, "where", "aten.nonzero"),
        (f_mask_assign, "mask-assign", "aten.index_put_"),
    ],
)
def test_dynamic_shape(fn, name, op):
    report = check(fn, x4())
    assert_at(only(report, "dynamic-shape"), name, kind="dynamic-shape", op=op)


def test_repeat_interleave_with_tensor_repeats():
    report = check(f_repeat_interleave, x4(), torch.tensor([1, 2, 1, 1]))
    assert_at(only(report, "dynamic-shape"), "repeat", kind="dynamic-shape",
              op="aten.repeat_interleave")


def test_fixed_shape_forms_are_clean():
    def fn(x):
        mask = x > 0
        y = torch.where(mask, x, 0.0) + x.masked_fill(~mask, 0.0)
        x = x.clone()
        x[mask] = 0.0  # one value through a mask becomes masked_fill_: no sync
        return y.repeat_interleave(2) + x.repeat_interleave(2)

    report = check(fn, x4())
    assert [f.op for f in report] == [NO_CUDA_OP]


# --- host-to-device copies, devices ---------------------------------------------------------------


def f_tensor_from_list(x):
    scale = torch.tensor(0.5)  # 0-dim CPU constant: torch passes it by value, not reported
    offsets = torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)  # at:tensor-list
    return x * scale + offsets


def test_tensor_from_python_list_is_a_per_call_copy():
    # Reported on CPU too: the code is meant for CUDA, where it copies to the device every call,
    # and a graph would freeze the values it saw at capture.
    report = check(f_tensor_from_list, x4())
    assert_at(only(report, "host-to-device"), "tensor-list", kind="host-to-device",
              op="aten.lift_fresh")


def f_to_cuda(x):
    return x.cuda()  # at:to-cuda


def test_cpu_tensor_moved_to_cuda_inside():
    # Without CUDA .cuda() raises after the call was seen; with CUDA it is a per-call copy.
    report = diagnose(f_to_cuda, (x4(),), {})
    assert_at(report[0], "to-cuda", kind="host-to-device", op="Tensor.cuda")


def test_clean_cpu_function_has_only_the_no_cuda_finding_at_the_line_that_called_check():
    def fn(x, *, bias):
        return torch.relu(x * 2 + bias)  # the first op: not where the whole-call finding points

    report = check(fn, x4(), bias=torch.ones(4))  # at:clean-call
    assert len(report) == 1
    assert_whole_call(report[0], "clean-call", "fn")


def test_no_op_at_all_points_at_the_caller():
    report = check(lambda: None)  # at:no-op
    assert_whole_call(report[0], "no-op", "<lambda>")


def test_no_cuda_finding_of_a_torch_module_names_its_class():
    report = check(torch.nn.Linear(4, 4), torch.randn(2, 4))  # at:linear-call
    assert len(report) == 1
    assert_whole_call(report[0], "linear-call", "Linear")


def test_no_cuda_finding_after_other_findings_points_at_the_call():
    report = diagnose(f_raises, (x4(),), {})  # at:diagnose-call
    assert_at(report[0], "before-raise", kind="host-sync", op="Tensor.item")
    assert_whole_call(report[1], "diagnose-call", "f_raises")


def test_check_call_points_the_whole_call_finding_at_its_origin():
    # What the command line does: the origin is the factory; other findings keep their own line.
    report = check_call(f_item, (x4(),), {}, origin=("/src/factories.py", 12))
    assert_at(report[0], "item", kind="host-sync", op="Tensor.item")
    assert (report[1].op, report[1].location) == (NO_CUDA_OP, "/src/factories.py:12")
    assert report[1].code == "the whole call of f_item(...)"
    with pytest.raises(Boom):
        check_call(f_raises, (x4(),), {}, origin=("/src/factories.py", 12))
    swallowed = check_call(f_raises, (x4(),), {}, origin=("/src/factories.py", 12), swallow=True)
    assert [f.location for f in swallowed] == [f"{__file__}:{line_of('before-raise')}",
                                              "/src/factories.py:12"]


# --- RNG, pinned memory ---------------------------------------------------------------------------


def f_get_rng(x):
    state = torch.get_rng_state()  # at:get-rng
    return x, state


def f_set_rng(x, state):
    torch.set_rng_state(state)  # at:set-rng
    return x


def f_manual_seed(x):
    torch.manual_seed(0)  # at:manual-seed
    return x + torch.randn(4)


def f_generator(x):
    g = torch.Generator()
    return x + torch.randn(4, generator=g)  # at:generator


def f_generator_seed(x, g):
    g.manual_seed(1)  # at:generator-seed
    return x


@pytest.mark.parametrize(
    "fn, extra, name, op",
    [
        (f_get_rng, (), "get-rng", "torch.get_rng_state"),
        (f_set_rng, (torch.get_rng_state(),), "set-rng", "torch.set_rng_state"),
        (f_manual_seed, (), "manual-seed", "torch.manual_seed"),
        (f_generator, (), "generator", "torch.Generator"),
        (f_generator_seed, (torch.Generator(),), "generator-seed", "Generator.manual_seed"),
    ],
)
def test_rng(fn, extra, name, op):
    state = torch.get_rng_state()
    try:
        report = check(fn, x4(), *extra)
    finally:
        torch.set_rng_state(state)
    assert_at(only(report, "rng"), name, kind="rng", op=op)


def f_layerdrop(x, training, layerdrop=0.5):
    for _ in range(3):
        p = torch.rand([])  # (Wav2Vec2's form: drawn in eval mode too)
        if training and p < layerdrop:  # at:layerdrop
            continue
        x = x * 2
    return x


def host_draws(fn, *args):
    """The findings of ``fn(*args)`` watched as after a call's first CUDA op: CI has no CUDA."""
    from torchreplay.check import _CheckMode, _Recorder

    recorder = _Recorder(("?", 0), None)
    recorder.saw_cuda = True
    with _CheckMode(recorder):
        fn(*args)
    return Report(recorder.findings)


def test_a_number_drawn_on_the_host_is_a_finding_where_a_call_on_cuda_reads_it():
    """LayerDrop's ``torch.rand([]) < p`` in a model on the GPU is a CPU tensor, so no sync: the
    graph keeps the capture's draw at every replay. The finding is where the ``if`` reads it,
    in place of the host-sync one; drawn and not read (eval mode) is none. In a call that never
    touched CUDA (CI's CPU check) it stays what it was: the value read on the host."""
    finding = only(host_draws(f_layerdrop, x4(), True), "rng")
    assert_at(finding, "layerdrop", kind="rng", op="aten._local_scalar_dense")
    assert "drawn on the host" in finding.reason and "LayerDrop" in finding.reason
    assert not host_draws(f_layerdrop, x4(), False)
    # LayerDrop off (Hugging Face's default 0.0): no draw changes the answer, so no rng finding
    # (the host-sync one stays: a value read on the host, as for any CPU tensor in CI's check).
    for off in (0.0, -1, 1.0, 2):
        assert [f.kind for f in host_draws(f_layerdrop, x4(), True, off)] == ["host-sync"], off
    assert only(host_draws(f_layerdrop, x4(), True, 1e-3), "rng").lineno == line_of("layerdrop")
    assert only(host_draws(lambda x: x * 2 if torch.rand([]) * 2 < 1.5 else x, x4()), "rng")
    assert only(check(f_layerdrop, x4(), True), "host-sync").lineno == line_of("layerdrop")
    assert not [f for f in check(f_layerdrop, x4(), True) if f.kind == "rng"]


class HostCounter:
    """Counts its calls in a CPU tensor (a plain attribute stays on the CPU at ``.to("cuda")``),
    and refills a CPU scratch tensor with the same values at every call."""

    def __init__(self) -> None:
        self.calls = torch.zeros((), dtype=torch.long)
        self.scratch = torch.zeros(3)

    def __call__(self, x, count=True):
        if count:
            self.calls += 1  # at:host-counter
        torch.mul(torch.arange(3.0), 2, out=self.scratch)
        own = torch.zeros(2)
        own.add_(1)  # (a tensor of the call's own: fine)
        return x * 2


def test_a_write_into_a_cpu_tensor_the_call_did_not_make_is_a_finding_in_a_call_on_cuda():
    """A graph replays only the device's work: a counter kept on the CPU would be written at
    capture only (the capture refuses it too: core/effects.py). A scratch tensor refilled with
    the values it held, and a tensor the call made, are fine; a call that never touched CUDA
    (CI's CPU check) says nothing of it."""
    counter = HostCounter()
    counter(x4())  # (the scratch holds its values from here on)
    finding = only(host_draws(counter, x4()), "cpu-tensor")
    assert_at(finding, "host-counter", kind="cpu-tensor", op="aten.add_")
    assert "did not make" in finding.reason and "register_buffer" in finding.fix
    assert not host_draws(counter, x4(), False)
    assert not [f for f in check(counter, x4()) if f.op != NO_CUDA_OP]


def f_cpu_branch(x, limit):
    if limit.item() > 0:  # at:cpu-branch
        return x * 2
    return x


def test_a_cpu_value_read_in_a_call_on_cuda_is_said_to_be_kept_not_waited_for():
    """``.item()`` of a CPU tensor in a call on CUDA waits for nothing; what a graph does is keep
    the value (and the branch) of the capture. The finding says so, still of kind host-sync
    (``breaks="auto"``'s trial capture drops it, as before); without CUDA, as before."""
    finding = only(host_draws(f_cpu_branch, x4(), torch.tensor(1.0)), "host-sync")
    assert finding.lineno == line_of("cpu-branch") and "keeps the value" in finding.reason
    plain = only(check(f_cpu_branch, x4(), torch.tensor(1.0)), "host-sync")
    assert "waits for the GPU" in plain.reason


def f_cuda_then_cpu_branch(x, limit):
    h = x * 2
    if limit.item() > 0:  # at:cuda-cpu-branch
        return h
    return x


def test_a_cpu_value_read_after_fake_cuda_work_through_check(fake_cuda):
    report = diagnose(f_cuda_then_cpu_branch, (fake_cuda(4), torch.tensor(1.0)), {})
    finding = only(report, "host-sync")
    assert finding.lineno == line_of("cuda-cpu-branch") and "keeps the value" in finding.reason, report


def f_layerdrop_on_cuda(x):
    h = x * 2  # (the call runs on CUDA from here)
    if torch.rand([]) < 0.5:  # at:layerdrop-cuda
        h = h + 1
    return h


def test_a_number_drawn_on_the_host_in_a_call_on_fake_cuda_tensors(fake_cuda):
    """The same finding through ``diagnose`` on fake CUDA tensors: the value cannot be read
    there (no data), so the call stops at the ``if``, after the finding was made."""
    report = diagnose(f_layerdrop_on_cuda, (fake_cuda(4),), {})
    assert_at(only(report, "rng"), "layerdrop-cuda", kind="rng", op="aten._local_scalar_dense")
    assert not [f for f in report if f.kind == "host-sync"]


def f_pin(x):
    return x.pin_memory()  # at:pin


def f_empty_pinned(x):
    return torch.empty(4, pin_memory=True)  # at:empty-pinned


@pytest.mark.parametrize(
    "fn, name, op",
    [(f_pin, "pin", "Tensor.pin_memory"), (f_empty_pinned, "empty-pinned", "aten.empty")],
)
def test_pinned_memory(fn, name, op):
    # Pinning needs an accelerator; without one it raises, after the op was recorded.
    report = diagnose(fn, (x4(),), {})
    assert_at(only(report, "pinned-memory"), name, kind="pinned-memory", op=op)


# --- locations, order, dedupe ---------------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, y.sum().item()  # at:module


def test_module_forward_is_located_past_torch_frames():
    report = check(Net(), torch.randn(2, 4))  # at:net-call
    assert_at(report[0], "module", kind="host-sync", op="Tensor.item")
    assert_whole_call(report[1], "net-call", "Net")


def f_loop(x):
    total = 0.0
    for row in x:
        total += row.item()  # at:loop
    return total


def test_one_line_is_reported_once():
    report = check(f_loop, x4())
    assert [f.kind for f in report] == ["host-sync", "cpu-tensor"]
    assert_at(report[0], "loop", kind="host-sync", op="Tensor.item")


def f_several(x):
    n = x.nonzero()  # at:several-1
    torch.manual_seed(3)  # at:several-2
    return n, x.tolist()  # at:several-3


def test_findings_come_in_the_order_they_happened():
    report = check(f_several, x4())
    assert [(f.kind, f.lineno) for f in report[:3]] == [
        ("dynamic-shape", line_of("several-1")),
        ("rng", line_of("several-2")),
        ("host-sync", line_of("several-3")),
    ]
    assert report[-1].op == NO_CUDA_OP
    assert {f.kind for f in report} <= set(KINDS)


# --- errors and cleanup ---------------------------------------------------------------------------


class Boom(Exception):
    pass


def f_raises(x):
    x.sum().item()  # at:before-raise
    raise Boom("user error")


def dispatch_modes() -> int:
    return torch._C._len_torch_dispatch_stack()


def test_check_reraises_and_cleans_up():
    profiler, modes = sys.getprofile(), dispatch_modes()
    with pytest.raises(Boom, match="user error"):
        check(f_raises, x4())
    assert sys.getprofile() is profiler
    assert dispatch_modes() == modes
    assert_at(check(f_item, x4())[0], "item", kind="host-sync", op="Tensor.item")


def test_diagnose_swallows_and_keeps_findings_seen_before():
    modes = dispatch_modes()
    report = diagnose(f_raises, (x4(),), {})
    assert dispatch_modes() == modes
    assert_at(report[0], "before-raise", kind="host-sync", op="Tensor.item")


def test_a_python_profiler_already_set_keeps_running_and_is_restored():
    seen = []

    def profiler(frame, event, arg):
        seen.append(event)

    sys.setprofile(profiler)
    try:
        report = check(f_tolist, x4())
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(None)
    assert "c_call" in seen
    assert_at(report[0], "tolist", kind="host-sync", op="Tensor.tolist")


def test_check_passes_keyword_arguments_named_fn():
    def fn(x, *, fn):
        return fn(x)

    assert len(check(fn, x4(), fn=torch.relu)) == 1


# --- the report -----------------------------------------------------------------------------------


def test_report_is_a_sequence():
    report = check(f_several, x4())
    assert isinstance(report, collections.abc.Sequence)
    assert report and len(report) == 4 and len(report.findings) == 4
    assert list(report) == report.findings
    assert report.first() is report[0]
    assert isinstance(report[1:], Report) and len(report[1:]) == 3
    assert report[0] in report
    empty = Report()
    assert not empty and len(empty) == 0 and empty.first() is None


def test_report_prints_op_location_and_fix():
    report = check(f_mask, x4())
    text = str(report)
    finding = report[0]
    for part in (finding.op, finding.kind, finding.location, finding.fix, finding.reason,
                 finding.code):
        assert part in text
    assert "no findings" in str(Report())


def test_report_renders_with_rich():
    rich_console = pytest.importorskip("rich.console")
    out = io.StringIO()
    rich_console.Console(file=out, width=200).print(check(f_mask, x4()))
    assert "aten.index" in out.getvalue() and "x[mask]" in out.getvalue()


def test_public_names():
    assert tr.check is check and tr.Report is Report and tr.Finding is Finding


# --- CUDA-only paths, on fake CUDA tensors (no GPU needed) ----------------------------------------


@pytest.fixture
def fake_cuda():
    """Yield a function making fake CUDA tensors (metadata only, no GPU), or skip."""
    fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")
    mode = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        try:
            torch.empty(1, device="cuda")
        except Exception as exc:  # pragma: no cover - depends on the torch build
            pytest.skip(f"fake CUDA tensors unavailable: {exc}")
        yield lambda *shape, device="cuda:0": torch.empty(*shape, device=device)


def f_to_host(x):
    return x.to("cpu")  # at:to-host


def f_mix(x, c):
    return x + c  # at:mix


def f_cuda_scalar(x):
    return x * torch.tensor(2.0)


def f_cuda_list(x):
    return x + torch.tensor([1.0, 2.0, 3.0, 4.0], device="cuda")  # at:cuda-list


def test_fake_cuda_device_to_host_copy(fake_cuda):
    report = check(f_to_host, fake_cuda(4))
    assert len(report) == 1
    assert_at(report[0], "to-host", kind="host-sync", op="aten._to_copy")


def test_fake_cuda_cpu_tensor_in_a_cuda_op(fake_cuda):
    # Fake tensors raise on the device mismatch, after the op was recorded.
    report = diagnose(f_mix, (fake_cuda(4), torch.ones(4)), {})
    assert_at(report[0], "mix", kind="cpu-tensor", op="aten.add")
    assert len(report) == 1


def test_fake_cuda_several_devices(fake_cuda):
    try:
        other = fake_cuda(4, device="cuda:1")
    except Exception as exc:  # a machine with one real GPU validates the index
        pytest.skip(f"no fake cuda:1 here: {exc}")
    report = diagnose(f_mix, (fake_cuda(4), other), {})
    assert_at(report[0], "mix", kind="multi-device", op="aten.add")


class Elsewhere(torch.nn.Module):
    """Works on cuda:0 and adds to a counter on cuda:1: no op mixes the devices."""

    def __init__(self, counter: torch.Tensor) -> None:
        super().__init__()
        self.counter = counter

    def forward(self, x):
        self.counter.add_(1)  # at:elsewhere
        return x * 2


def test_fake_cuda_an_op_wholly_on_another_gpu_than_the_calls(fake_cuda):
    """A graph captured on the call's device (its CUDA argument's) records none of cuda:1's
    kernels: the counter's add is one multi-device finding; the call's own op none."""
    try:
        counter = fake_cuda(1, device="cuda:1")
    except Exception as exc:  # a machine with one real GPU validates the index
        pytest.skip(f"no fake cuda:1 here: {exc}")
    report = check(Elsewhere(counter), fake_cuda(4))
    assert len(report) == 1, report
    assert_at(report[0], "elsewhere", kind="multi-device", op="aten.add_")
    assert len(check(Elsewhere(fake_cuda(1)), fake_cuda(4))) == 0  # (all on cuda:0)


def test_fake_cuda_cpu_scalar_and_tensor_from_list(fake_cuda):
    assert len(check(f_cuda_scalar, fake_cuda(4))) == 0
    report = check(f_cuda_list, fake_cuda(4))
    assert len(report) == 1
    assert report[0].kind == "host-to-device" and report[0].lineno == line_of("cuda-list")
