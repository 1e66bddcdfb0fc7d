"""The compile backend's split, on FX graphs of toy functions traced on the meta device (no GPU):
which nodes go where and why, order kept around an in-place write; options; the entry point; the
backend on CPU tensors equals eager."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import torchreplay as tr
from torchreplay import _compat
from torchreplay.compile.split import node_value, split_graph
from torchreplay.config import CompileConfig

META = torch.device("meta")


def _traced(fn, *shapes):
    gm = torch.fx.symbolic_trace(fn)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    with mode:
        args = [torch.empty(s, device=META) for s in shapes]
    FakeTensorProp(gm, mode).propagate(*args)
    return gm


def _layout(segments):
    return [(s.graphed, [n.name for n in s.nodes]) for s in segments]


def test_nonzero_and_item_are_eager_steps_and_order_is_kept() -> None:
    def f(x, w):
        y = (x @ w).relu()
        i = torch.nonzero(y)
        v = y.sum().item()
        x.add_(1)
        return y * 2, i, v

    segs = split_graph(_traced(f, (4, 4), (4, 4)), device=META)
    assert _layout(segs) == [
        (True, ["matmul", "relu"]),
        (False, ["nonzero"]),
        (True, ["sum_1"]),
        (False, ["item"]),
        (True, ["add_", "mul"]),
    ]
    assert "depends on the data" in segs[1].splits[0].reason
    assert "on the host" in segs[3].splits[0].reason
    # the write to x stays after every read of x that came before it
    assert [a.name for a in segs[4].inputs] == ["x", "relu"]
    assert [o.name for o in segs[0].outputs] == ["relu"]


def test_a_slice_by_a_size_traced_as_unknown_is_an_eager_view_not_data() -> None:
    """``buf[:n]`` with ``n`` a traced size, whose length torch 2.11 traces as an unbacked
    size: an eager step, but not reported as data-dependent (its fix is not a fixed size)."""
    import operator

    mode = FakeTensorMode(shape_env=ShapeEnv())
    graph = torch.fx.Graph()
    buf, n = graph.placeholder("buf"), graph.placeholder("n")
    view = graph.call_function(operator.getitem, (buf, slice(None, n, None)))
    graph.output((graph.call_function(torch.mul, (view, 2)),))
    with mode:
        buf.meta["val"] = torch.empty(8, 4, device=META)
        n.meta["val"] = mode.shape_env.create_unbacked_symint()
        u = mode.shape_env.create_unbacked_symint()  # the slice's own size, as torch 2.11 has it
        view.meta["val"] = torch.empty(u, 4, device=META)
        list(graph.nodes)[3].meta["val"] = torch.empty(u, 4, device=META)
    segs = split_graph(torch.fx.GraphModule({}, graph), device=META)
    assert _layout(segs) == [(False, ["getitem"]), (True, ["mul"])]
    assert "slice by a size" in segs[0].splits[0].reason, segs[0].splits[0]
    assert "depends on the data" not in segs[0].splits[0].reason


def test_a_user_splitting_op_is_an_eager_step_of_its_own() -> None:
    def f(x):
        return torch.sigmoid(torch.tanh(x).exp()) + 1

    segs = split_graph(_traced(f, (3,)), splitting_ops=["torch.sigmoid"], device=META)
    assert _layout(segs) == [(True, ["tanh", "exp"]), (False, ["sigmoid"]), (True, ["add"])]
    assert "splitting op" in segs[1].splits[0].reason


def test_a_cpu_tensor_op_is_eager() -> None:
    def f(x):
        y = x * 2
        z = x.cpu() + 1  # a copy to the host, then CPU work
        return y, z

    segs = split_graph(_traced(f, (3,)), device=META)
    assert _layout(segs) == [(True, ["mul"]), (False, ["cpu", "add"])]
    assert "on the host" in segs[1].splits[0].reason
    assert "CPU" in segs[1].splits[1].reason


def test_each_segment_module_computes_its_part() -> None:
    def f(x):
        a = x.sin()
        b = torch.nonzero(a > 0)
        return a.cos(), b

    gm = _traced(f, (5,))
    segs = split_graph(gm, device=META)
    x = torch.randn(5)
    env = {"x": x}
    for seg in segs:
        outs = seg.module(*[env[a.name] for a in seg.inputs])
        env.update({o.name: v for o, v in zip(seg.outputs, outs)})
    torch.testing.assert_close(env["cos"], x.sin().cos())
    assert torch.equal(env["nonzero"], torch.nonzero(x.sin() > 0))


def test_compile_config_validates() -> None:
    assert CompileConfig(sizes=[8, 1, 4, 4]).sizes == (1, 4, 8)
    assert CompileConfig(splitting_ops="mylib.attn").splitting_ops == ("mylib.attn",)
    for bad in ({"sizes": []}, {"outputs": "fresh"}, {"dim": -1}, {"max_graphs": 0}, {"restore_state": "no"}):
        with pytest.raises(ValueError):
            CompileConfig(**bad)
    assert CompileConfig().graph_config().restore_state  # the captures' writes put back
    assert not CompileConfig(restore_state=False).graph_config().restore_state


def test_the_entry_point_resolves_in_a_fresh_process(installed_env) -> None:
    """As installed (pyproject.toml's entry point as package metadata), in a process that never
    imports torchreplay itself: the name resolves to our backend, which compiles."""
    code = (
        "import sys, torch, torch._dynamo\n"
        "assert 'torchreplay' in torch._dynamo.list_backends(), torch._dynamo.list_backends()\n"
        "assert 'torchreplay' not in sys.modules\n"
        "f = torch.compile(lambda x: x * 2 + 1, backend='torchreplay')\n"
        "x = torch.randn(4)\n"
        "torch.testing.assert_close(f(x), x * 2 + 1)\n"
        "assert 'torchreplay.compile.backend' in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=installed_env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_torch_compile_hands_options_and_mode_to_the_backend_by_name(caplog) -> None:
    """``torch.compile(model, backend="torchreplay", options={...})`` (the documented form):
    torch passes ``options=`` as one keyword, which the backend once took for an option's name
    (a TypeError at the first call). A mode or an option it does not have is named."""
    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2 + 1, backend="torchreplay", options={"inductor": False})
    x = torch.randn(4)
    with caplog.at_level(logging.INFO, logger="torchreplay"):
        torch.testing.assert_close(f(x), x * 2 + 1)
    assert "compiled as FX code" in caplog.text, caplog.text  # inductor=False reached it
    for how, message in [
        (dict(mode="max-autotune"), "no mode 'max-autotune'"),
        (dict(options={"sizez": [1, 2]}), "no option 'sizez'; its options (torchreplay.CompileConfig): "),
    ]:
        torch._dynamo.reset()
        g = torch.compile(lambda x: x - 1, backend="torchreplay", **how)
        with pytest.raises(Exception, match=re.escape(message)):
            g(x)
    torch._dynamo.reset()


class _Drop(torch.nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.lin(x))


def test_a_float_dynamo_made_an_input_is_compiled_by_inductor(caplog) -> None:
    """Two models whose ``nn.Dropout`` differ in ``p`` (HF ALBERT then DistilBERT in one
    process): Dynamo makes ``p`` of the second a 0-dim tensor input with an ``.item()``. Its
    traced value is of another fake mode than the compile's; AOT autograd made a fake of it
    anew that no longer knew the ``.item()``, and Inductor failed (the graph ran as FX code,
    without Inductor's kernels). Now Inductor compiles it, as with Dynamo's own backend."""
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for p in (0.0, 0.1):
            model = _Drop(p).eval()
            c = torch.compile(model, backend="torchreplay")
            with torch.no_grad():
                for _ in range(2):
                    x = torch.randn(4, 8)
                    torch.testing.assert_close(c(x), model(x))
    torch._dynamo.reset()
    assert "could not compile" not in caplog.text, caplog.text


def test_the_dropout_seeds_of_an_attentions_backward_are_found_and_go_to_the_host() -> None:
    """An attention's backward outside a capture reads its dropout seed and offset on the host;
    made by a forward's graph they are on the GPU, and the backward's warm-up (or an ungraphed
    call) was a segmentation fault (HF BERT trained through the backend, on an H200). The
    positions are found from the op's schema; cuDNN's backward, which reads them on the GPU,
    is left alone; arguments on the host pass as they are."""
    from torchreplay.compile.split import host_seeds, seed_inputs

    def graph_of(op):
        g = torch.fx.Graph()
        args = [g.placeholder(f"a{i}") for i in range(len(op._schema.arguments))]
        g.output(g.call_function(op, tuple(args)))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    aten = torch.ops.aten
    for op in (aten._scaled_dot_product_efficient_attention_backward.default,
               aten._efficient_attention_backward.default,
               aten._scaled_dot_product_flash_attention_backward.default):
        names = [a.name for a in op._schema.arguments]
        want = (names.index("philox_seed"), names.index("philox_offset"))
        assert seed_inputs(graph_of(op)) == want, op
    assert seed_inputs(graph_of(aten._scaled_dot_product_cudnn_attention_backward.default)) == ()
    seen = []
    fn = host_seeds(lambda *a: seen.append(a) or "out", (1,))
    seed = torch.tensor(7)
    assert fn("x", seed) == "out" and seen == [("x", seed)] and seen[0][1] is seed


def test_the_backend_on_cpu_equals_eager() -> None:
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def f(x, cache):
        cache.add_(1)
        return model(x) + cache.sum()

    c = tr.compile(f, inductor=False)
    with torch.no_grad():
        for _ in range(3):
            x, cache = torch.randn(4, 8), torch.randn(2)
            want_cache = cache.clone()
            want = f(x, want_cache)
            torch.testing.assert_close(c(x, cache), want)
            torch.testing.assert_close(cache, want_cache)
    assert "compiled" in tr.explain(c)
    torch._dynamo.reset()


def _custom(name: str, tags: tuple = ()):
    lib_op = f"trsplit::{name}"
    ns = torch.ops.trsplit
    if not hasattr(ns, name):
        @torch.library.custom_op(lib_op, mutates_args=(), tags=tags)
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @op.register_fake
        def _(x):
            return torch.empty_like(x)

    return getattr(ns, name)


@pytest.mark.parametrize("spelling", ["dotted", "qualified", "overload_name", "packet", "overload"])
def test_a_splitting_op_matches_in_every_spelling(spelling: str) -> None:
    op = _custom("mark")

    def f(x):
        return op(x.relu()) * 2

    names = {
        "dotted": "trsplit.mark",
        "qualified": "trsplit::mark",
        "overload_name": "trsplit.mark.default",
        "packet": op,
        "overload": op.default,
    }
    segs = split_graph(_traced(f, (4, 4)), [names[spelling]], device=META)
    assert [s.graphed for s in segs] == [True, False, True]
    assert "splitting op" in segs[1].splits[0].reason


def test_an_op_tagged_cudagraph_unsafe_is_an_eager_step() -> None:
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None:
        pytest.skip("this torch has no Tag.cudagraph_unsafe")
    op = _custom("unsafe", tags=(tag,))

    def f(x):
        return op(x.relu()) * 2

    segs = split_graph(_traced(f, (4, 4)), device=META)
    assert [s.graphed for s in segs] == [True, False, True]
    assert "cudagraph_unsafe" in segs[1].splits[0].reason


def test_a_cpu_scalar_argument_is_read_eagerly_a_graph_would_keep_its_value() -> None:
    def f(x, s):
        return (x * s).relu()

    gm = torch.fx.symbolic_trace(f)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    with mode:
        args = [torch.empty(4, 4, device=META), torch.empty((), device="cpu")]
    FakeTensorProp(gm, mode).propagate(*args)
    segs = split_graph(gm, device=META)
    assert _layout(segs) == [(False, ["mul"]), (True, ["relu"])]
    assert "CPU scalar tensor (s)" in segs[0].splits[0].reason


def test_what_each_segment_writes_in_place_is_found_through_views() -> None:
    """A value an eager step made and a later graphed piece writes through a view (a KV cache's
    length counter moved to the GPU, then advanced in place), and a written input: both found,
    and named against the piece that writes them."""
    from torchreplay.compile.backend import _written_by, graph_writes

    def f(x, s):
        c = x * s  # eager: reads a CPU scalar
        y = c.relu()
        c.view(-1).add_(1)
        x.add_(2)
        return y, c

    gm = torch.fx.symbolic_trace(f)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    with mode:
        args = [torch.empty(4, 4, device=META), torch.empty((), device="cpu")]
    FakeTensorProp(gm, mode).propagate(*args)
    wrote = graph_writes(gm)
    assert wrote == {("add_", "mul"), ("add_", "view"), ("add__1", "x")}, wrote
    segs = split_graph(gm, device=META)
    assert _layout(segs) == [(False, ["mul"]), (True, ["relu", "view", "add_", "add__1"])]
    assert _written_by(segs[0], wrote) == ()
    inputs = [a.name for a in segs[1].inputs]
    assert sorted(inputs[j] for j in _written_by(segs[1], wrote)) == ["mul", "x"]
    assert _written_by(segs[1], None) == tuple(range(len(inputs)))  # unknown: all


def test_a_graph_the_fake_run_cannot_run_counts_everything_written() -> None:
    from torchreplay.compile.backend import graph_writes

    gm = torch.fx.symbolic_trace(lambda x: x + 1)  # no example values: no fake mode
    assert graph_writes(gm) is None


def test_the_padded_dimension_is_found_past_a_closure_weight() -> None:
    """A function reading a closure tensor before its argument gets that tensor as its first
    input: the padded size is the argument's dynamic dimension, not the weight's first."""
    from torchreplay.compile.backend import build_program

    w = torch.randn(8, 4)
    found = []

    def fn(x):
        return (x @ w.t()) * 2  # w is read first: an input before x

    def backend(gm, example_inputs):
        program, _, sized = build_program(gm, example_inputs, CompileConfig(sizes=(1, 2, 4)),
                                          torch.device("cpu"), None)
        found.append((sized, [(i.kind, i.dim) for i in program.inputs]))
        return gm.forward

    torch._dynamo.reset()
    try:
        x = torch.randn(3, 4)
        torch._dynamo.mark_dynamic(x, 0)
        torch.compile(fn, backend=backend)(x)
    finally:
        torch._dynamo.reset()
    ((sized, inputs),) = found
    assert sized
    assert ("tensor", 0) in inputs and ("tensor", None) in inputs, inputs  # x padded, w not


def test_an_input_with_a_symbol_of_its_own_and_as_many_rows_is_padded_alongside() -> None:
    """HF BERT's ``attention_mask`` next to its ``input_ids``: Dynamo, tracing again after a
    new batch size, gives each a symbol of its own. Only the ids were padded, so every captured
    size indexed the mask by the padded rows: a device-side assert (the zoo's ``compilesizes``
    mode, on an H200). Both are padded now, and their sizes given as ints too; a call whose rows
    differ between them runs ungraphed, named."""
    from types import SimpleNamespace

    from torchreplay.compile.backend import build_program
    from torchreplay.pieces.padding import rows_differ

    emb = torch.randn(16, 4)
    found = []

    def f(ids, mask):
        return emb[ids] * mask[torch.arange(ids.shape[0])][:, :, None]

    def backend(gm, example_inputs):
        program, _, sized = build_program(gm, example_inputs, CompileConfig(sizes=(1, 2, 4, 8)),
                                          torch.device("cpu"), None)
        found.append((sized, program.inputs))
        return gm.forward

    torch._dynamo.reset()
    try:
        c = torch.compile(f, backend=backend)
        for b in (2, 3):  # the second traces both dimensions dynamic, one symbol each
            ids, mask = torch.randint(0, 16, (b, 5)), torch.rand(b, 5)
            torch.testing.assert_close(c(ids, mask), f(ids, mask))
    finally:
        torch._dynamo.reset()
    sized, inputs = found[-1]
    assert sized
    dims = {x.name: (x.kind, x.dim, x.is_size) for x in inputs}
    assert dims["ids"][:2] == ("tensor", 0) and dims["mask"][:2] == ("tensor", 0), dims
    assert [n for n, (k, _, is_size) in dims.items() if k == "int"] == [
        n for n, (k, _, is_size) in dims.items() if k == "int" and is_size], dims

    rt = SimpleNamespace(sizes=[1, 2, 4, 8], _inputs=inputs,
                         _sized=[i for i, x in enumerate(inputs) if x.kind == "tensor" and x.dim is not None],
                         _size_ints=[i for i, x in enumerate(inputs) if x.kind == "int" and x.is_size])

    def call(b_ids, b_mask):
        args = []
        for x in inputs:
            rows = b_mask if x.name.startswith("mask") else b_ids
            args.append(rows if x.kind == "int" else torch.zeros(rows, 5) if x.dim is not None else emb)
        return rows_differ(rt, b_ids, tuple(args))

    assert call(3, 3) is None
    assert "has 2 rows along dim 0, the call 3" in call(3, 2)


def _programs(fn, x, sizes=(1, 2, 4, 8)):
    """Each Dynamo graph of ``fn(x)`` (dim 0 of ``x`` dynamic, traced size-oblivious as
    tr.compile traces a first call) with its program and whether it pads: ``(gm, program,
    sized)``."""
    from torchreplay.compile.backend import build_program

    found = []

    def backend(gm, example_inputs):
        program, _, sized = build_program(gm, example_inputs, CompileConfig(sizes=sizes),
                                          torch.device("cpu"), None)
        found.append((gm, program, sized))
        return gm.forward

    torch._dynamo.reset()
    try:
        torch._dynamo.mark_dynamic(x, 0)
        with _compat.backed_size_oblivious(), torch.no_grad():
            torch.compile(fn, backend=backend)(x)
    finally:
        torch._dynamo.reset()
    return found


class _Rows(torch.nn.Module):
    """Writes the leading rows of a fixed-size buffer (``buf[: x.shape[0]]``) and returns them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("rows", torch.zeros(8, 4))

    def forward(self, x):
        y = self.lin(x)
        self.rows[: x.shape[0]].copy_(y)
        return y, self.rows[: x.shape[0]] * 2


def test_the_leading_rows_of_a_buffer_are_sliced_to_the_call() -> None:
    """``buf[:n]`` of an 8-row buffer, n the padded size, traced as tr.compile traces a first
    call (size-oblivious): its size is ``Min(8, s0)`` (torch 2.13) or an unbacked symbol of its
    own (torch 2.11, which then breaks the graph before the copy_ and returns the slice). Either
    way each output that has it is sliced back to the call's rows along dim 0, and the graph
    stays paddable. (Before: torch 2.11 handed out the padded rows' slice, and the model's
    ``copy_`` of the call's rows into it raised a size mismatch.)"""
    gm, program, sized = _programs(_Rows(), torch.randn(3, 4))[0]
    shapes = [tuple(node_value(n).shape) for n in _outputs(gm)]
    assert sized, shapes
    assert program.output_dims == (0,) * len(shapes), (program.output_dims, shapes)  # dim 0 each


def test_a_graph_that_takes_only_the_size_pads_it() -> None:
    """After a graph break, Dynamo's next graph may read the caller's rows only as an int
    (``x.shape[0]``, source ``L['x'].size()[0]``), with no tensor of that many rows among its
    inputs: that int is the padded size, and the buffer's leading rows are cut back to it."""
    rows = torch.randn(8, 4)

    def fn(x):
        y = x * 2
        torch._dynamo.graph_break()
        return rows[: x.shape[0]] + 1, y

    found = _programs(fn, torch.randn(3, 4))
    _, program, sized = found[-1]  # the graph after the break
    inputs = [(i.name, i.kind, i.is_size) for i in program.inputs]
    assert sized and ("x.size()[0]", "int", True) in inputs and program.output_dims == (0,), inputs


def test_a_static_recompile_after_a_sized_graph_is_not_warned(caplog) -> None:
    """sizes= with a graph that has no dynamic size: a warning for the first (the user's
    compile is static: the fix is to mark it dynamic), an INFO line where the backend already
    padded a graph (Dynamo specialised a later graph to one shape: nothing to fix)."""
    from torchreplay.compile.backend import build_program

    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(lambda x: x * 2, backend=backend, dynamic=False)(torch.randn(1, 4))
    finally:
        torch._dynamo.reset()
    ((gm, example_inputs),) = graphs
    caplog.set_level(logging.INFO, logger="torchreplay")
    for seen_sized, level in ((False, logging.WARNING), (True, logging.INFO)):
        caplog.clear()
        _, _, sized = build_program(gm, example_inputs, CompileConfig(sizes=(1, 2)), torch.device("cpu"),
                                    None, seen_sized=seen_sized)
        assert not sized
        assert [r.levelno for r in caplog.records if "torchreplay" in r.name] == [level], caplog.text


def test_an_output_is_cut_to_the_call_rows_clamped() -> None:
    """A padded call of 10 rows to 16 hands out a 16-row output's first 10 rows, and an 8-row
    output (the leading rows of an 8-row buffer) whole: eager's ``buf[:10]`` has 8 rows."""
    from torchreplay.pieces.entries import Entry, hand_out
    from torchreplay.pieces.program import Input, Program

    big, buf = torch.randn(16, 3), torch.randn(8, 3)
    program = Program((Input("a", "tensor"), Input("b", "tensor")), [], (0, 1), (0, 0))
    entry = Entry(16)
    entry.sources = [("env", 0), ("env", 1)]
    out = hand_out(entry, [big, buf], (), program, 10, False, lambda t: False)
    assert out[0].shape == (10, 3) and out[1].shape == (8, 3)
    assert out[1].data_ptr() == buf.data_ptr()


def test_inputs_are_named_as_the_users_code_names_them() -> None:
    """The names messages use (written inputs, the padding check's state) are the user's:
    ``self.rows``, ``self.lin.weight``, ``x``, ``extra['k']``, not Dynamo's placeholders."""
    from torchreplay.compile.backend import build_program

    class M(_Rows):
        def forward(self, x, extra):
            return super().forward(x)[0] + extra["k"]

    found = []

    def backend(gm, example_inputs):
        program, _, _ = build_program(gm, example_inputs, CompileConfig(), torch.device("cpu"), None)
        found.append([i.name for i in program.inputs])
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(M(), backend=backend)(torch.randn(3, 4), {"k": torch.randn(4)})
    finally:
        torch._dynamo.reset()
    names = set(found[0])
    assert {"self.rows", "self.lin.weight", "self.lin.bias", "x", "extra['k']"} <= names, names


def _outputs(gm):
    (leaves,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    return [leaf for leaf in (leaves if isinstance(leaves, (tuple, list)) else (leaves,))
            if isinstance(leaf, torch.fx.Node)]


def test_a_first_call_of_more_rows_then_one_row_is_one_compile() -> None:
    """With 1 among the sizes, a first call of 4 rows is traced size-oblivious: no guard
    ``>= 2``, so 1-row calls reuse the compile (on the CPU: no graphs, the same Dynamo)."""
    torch._dynamo.reset()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()).eval()
        c = tr.compile(model, sizes=[1, 2, 4, 8], cache_dir=None)
        with torch.no_grad():
            for b in (4, 1, 3, 8, 2, 1):
                x = torch.randn(b, 4)
                torch.testing.assert_close(c(x), model(x))
        assert c.backend.compiles == 1
    finally:
        torch._dynamo.reset()


def test_instances_of_one_class_compiled_each_share_one_backend_and_one_compile() -> None:
    """tr.compile of each of twelve blocks in eval mode (past Dynamo's recompile limit of 8):
    one backend per class and options, so Dynamo compiles once and every block runs compiled;
    another class or other options get a backend of their own. In training mode too: one more
    compile (the training graph) for the twelve, gradients equal eager's."""
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()).eval() for _ in range(12)]
        compiled = [tr.compile(b, cache_dir=None) for b in blocks]
        assert len({id(c.backend) for c in compiled}) == 1
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(2, 4)
                for b, c in zip(blocks, compiled):
                    torch.testing.assert_close(c(x), b(x))
        assert compiled[0].backend.compiles == 1
        other_class = tr.compile(torch.nn.Linear(4, 4).eval(), cache_dir=None)
        other_options = tr.compile(blocks[0], cache_dir=None, max_graphs=3)
        assert other_class.backend is not compiled[0].backend
        assert other_options.backend is not compiled[0].backend
        import copy

        refs = [copy.deepcopy(b).train() for b in blocks]
        for b in blocks:
            b.train()
        for _ in range(2):
            x = torch.randn(2, 4, requires_grad=True)
            x_ref = x.detach().clone().requires_grad_()
            y, y_ref = x, x_ref
            for b, c, r in zip(blocks, compiled, refs):
                y, y_ref = c(y), r(y_ref)
            y.square().sum().backward()
            y_ref.square().sum().backward()
            torch.testing.assert_close(x.grad, x_ref.grad)
            for b, r in zip(blocks, refs):
                for p, q in zip(b.parameters(), r.parameters()):
                    torch.testing.assert_close(p.grad, q.grad)
                    p.grad = q.grad = None
        assert compiled[0].backend.compiles == 2  # the eval graph, then the training graph
    finally:
        torch._dynamo.reset()


def test_the_first_call_outputs_that_follow_the_rows_are_traced_dynamic_by_the_next_frame() -> None:
    """What the backend does to a sized graph's first outputs (``_rows_dynamic``): the frame
    Dynamo resumes after a graph break takes them as inputs and traces the rows symbolic at
    once, one compile for every size; unmarked, it compiles static, then again dynamic. An
    output whose rows are not the padded size is left alone."""
    from torchreplay.compile.backend import _rows_dynamic

    def compiles(mark: bool, n: int = 3, dims=(0,)) -> int:
        torch._dynamo.reset()
        seen: list[int] = []

        def count(gm, example_inputs):
            seen.append(1)
            return gm.forward

        after = torch.compile(lambda h: (h * 2).sum(-1), backend=count)
        try:
            for k, rows in enumerate((n, 5, 7, 6)):
                h = torch.randn(rows, 4)
                if k == 0 and mark:
                    _rows_dynamic((h,), rows, dims)
                torch.testing.assert_close(after(h), (h * 2).sum(-1))
            return len(seen)
        finally:
            torch._dynamo.reset()

    assert compiles(mark=False) == 2
    assert compiles(mark=True) == 1
    assert compiles(mark=True, dims=(None,)) == 2


def test_the_inputs_an_aot_graph_writes_are_found_through_views() -> None:
    """What a training piece puts back after capture (``written_inputs``): the BatchNorm
    statistics AOT autograd's forward graph writes with ``copy_`` (not its weights, not the
    input), and an input written through a view of it (``a[0].add_``), as make_fx records it."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchreplay.compile.training import written_inputs

    torch._dynamo.reset()
    graphs = []

    def forward(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
        backend = aot_autograd(fw_compiler=forward, bw_compiler=lambda gm, ex: make_boxed_func(gm.forward),
                               keep_inference_input_mutations=True)
        torch.compile(model, backend=backend)(torch.randn(8, 4, requires_grad=True)).sum().backward()
    finally:
        torch._dynamo.reset()
    places = [n for n in graphs[0].graph.nodes if n.op == "placeholder"]
    written = written_inputs(graphs[0])
    assert written is not None
    shapes = sorted(tuple(places[i].meta["val"].shape) for i in written)
    assert shapes == [(), (4,), (4,)], shapes  # the count, the mean, the variance: no weight, no input

    def f(a, b):
        a[0].add_(b)
        return a * 2

    gm = make_fx(f)(torch.randn(3, 4), torch.randn(4))
    assert written_inputs(gm) == {0}


def test_dynamos_request_to_trace_again_goes_through_the_backend(caplog) -> None:
    """Inductor asks Dynamo to trace again (``TensorifyScalarRestartAnalysis``) when a float
    Dynamo made an input is not in the graph it compiles: a piece without the module's ``eps``
    of a model compiled after one with another ``eps``. Dynamo's call of the backend lets it
    through and makes the float a constant. Caught as an Inductor failure, the pieces after it
    got a symbolic float Inductor could not compile ("zf33 is not defined", H200) and ran as FX
    code. Inductor's own errors still leave the FX code, with a warning."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis

    from torchreplay.compile.backend import _inductor_or_fx

    gm = torch.fx.symbolic_trace(lambda x: x * 2)

    def restart(m, ex):
        raise TensorifyScalarRestartAnalysis

    def broken(m, ex):
        raise RuntimeError("Triton: NameError('zf33 is not defined')")

    with pytest.raises(TensorifyScalarRestartAnalysis):
        _inductor_or_fx(gm, [], "graph 0 piece 0", restart)
    with caplog.at_level(logging.WARNING):
        assert _inductor_or_fx(gm, [], "graph 0 piece 2", broken) == gm.forward
    assert "Inductor could not compile graph 0 piece 2" in caplog.text


def test_a_training_piece_is_compiled_without_donated_buffers() -> None:
    """With donated buffers, Inductor's backward may write a gradient into the memory of a saved
    activation it read last. Our backward graph reads the saved activations in the forward's
    pool, so that gradient would lie where the next forward replay writes (HF Gemma2 and BART
    trained through the backend: StaleOutputError in the backward). The training compile (an
    ``inner_compile`` hook, as ``compile/training.py`` passes) must leave none to the backward."""
    seen: list[tuple[bool, object]] = []

    def inner(gm, example_inputs, **kwargs):
        context = torch._guards.TracingContext.try_get()
        meta = getattr(context, "fw_metadata", None)
        seen.append((bool(kwargs.get("is_backward")), getattr(meta, "bw_donated_idxs", None)))
        return _compat.compile_fx_inner(gm, example_inputs, donate=False, **kwargs)

    def f(x, w):
        return (x @ w).relu().sin().sum()  # saves activations used once by the backward

    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    fn = _compat.inductor_compile(torch.fx.symbolic_trace(f), [x, w], inner)
    out = fn(x, w)
    (out[0] if isinstance(out, (list, tuple)) else out).backward()
    torch.testing.assert_close(w.grad, torch.autograd.grad(f(x, w), w)[0])
    assert [b for b, _ in seen] == [False, True], seen
    assert not any(donated for _, donated in seen), seen
