"""``tr.explain`` on what it can read without a GPU, and the preview of the split a GPU would get
(``compile/preview.py``), on models whose split is known: a custom splitting op, ``nonzero``
inside one Dynamo graph, a data-dependent ``if`` (a Dynamo graph break)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torchreplay as tr
from torchreplay.compile.preview import preview_split
from torchreplay.models import blocks
from torchreplay.models.blocks import SPLIT_MARK, DataDependentIf, NonzeroBetween, SplitMLP


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _lines(report: str) -> list[str]:
    return [" ".join(line.split()) for line in report.splitlines()]


def test_preview_of_a_custom_splitting_op() -> None:
    with torch.no_grad():
        report = preview_split(SplitMLP(3, depth=3, width=8).eval(), (torch.randn(2, 8),),
                               splitting_ops=[SPLIT_MARK])
    lines = _lines(report)
    assert lines[:3] == ["1 Dynamo graph(s)", "graph 0: 5 piece(s), 3 graphed, 2 eager",
                         "piece 0 2 node(s) graphed"]
    path = Path(blocks.__file__)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), start=1)
                if "x = torch.ops.torchreplay_bench.split_mark(x)" in text)
    assert lines[3] == (f"piece 1 1 node(s) eager: torchreplay_bench.split_mark at {path}:{line}: "
                        "is a splitting op (splitting_ops=)")
    assert len(lines) == 2 + 5


@pytest.mark.parametrize("style", ["writes", "clone"])
def test_preview_of_the_other_splitting_op_styles(style: str) -> None:
    """An op writing its out argument, and a C++ op named as a splitting op, cut the same way."""
    with torch.no_grad():
        report = preview_split(SplitMLP(3, depth=3, width=8, style=style).eval(), (torch.randn(2, 8),),
                               splitting_ops=[blocks.SPLIT_STYLES[style]])
    lines = _lines(report)
    assert lines[1] == "graph 0: 5 piece(s), 3 graphed, 2 eager"
    op = "torchreplay_bench.split_mark_out" if style == "writes" else "torch.clone"
    assert [line.split(" at ")[0] for line in lines if "eager:" in line] == [
        f"piece {k} 1 node(s) eager: {op}" for k in (1, 3)]


def test_preview_without_splitting_ops_is_one_graphed_piece() -> None:
    with torch.no_grad():
        report = preview_split(SplitMLP(3, depth=3, width=8).eval(), (torch.randn(2, 8),))
    assert _lines(report)[1:] == ["graph 0: 1 piece(s), 1 graphed, 0 eager", "piece 0 8 node(s) graphed"]


def test_preview_of_nonzero_inside_one_graph() -> None:
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), torch.no_grad():
        report = preview_split(NonzeroBetween(depth=1, width=8).eval(), (torch.randn(2, 8),))
    lines = _lines(report)
    assert lines[1] == "graph 0: 3 piece(s), 2 graphed, 1 eager"
    assert "eager: torch.nonzero at " in lines[3]
    assert "has an output size that depends on the data" in lines[3]


def test_preview_of_a_data_dependent_if_is_two_dynamo_graphs() -> None:
    with torch.no_grad():
        report = preview_split(DataDependentIf(depth=1, width=8).eval(), (torch.randn(2, 8),))
    lines = _lines(report)
    assert lines[0].startswith("2 Dynamo graph(s) (Dynamo broke the call between them")
    assert lines.count("graph 0: 1 piece(s), 1 graphed, 0 eager") == 1
    assert lines.count("graph 1: 1 piece(s), 1 graphed, 0 eager") == 1


def test_explain_before_the_first_call_and_on_the_cpu() -> None:
    c = tr.compile(torch.nn.Linear(4, 4), inductor=False)
    assert _lines(tr.explain(c)) == [
        "torchreplay: 0 graph(s) compiled in 0.00 s (options: sizes=None, splitting_ops=[], "
        "inductor=False)",
        "nothing compiled yet: call the compiled model once, then explain it",
    ]
    with torch.no_grad():
        c(torch.randn(2, 4))
    lines = _lines(tr.explain(c.backend))  # a Backend directly
    assert lines[0].startswith("torchreplay: 1 graph(s) compiled in ")
    assert lines[1].startswith("1 graph(s) without CUDA graphs: their inputs are on the CPU")
    with pytest.raises(TypeError, match="tr.explain takes"):
        tr.explain(object())


def test_explain_of_torch_compile_with_the_backend_by_name_on_the_cpu() -> None:
    from torchreplay.compile.backend import torchreplay_backend

    model = torch.nn.Linear(4, 4)
    cm = torch.compile(model, backend=torchreplay_backend)
    with torch.no_grad():
        torch.testing.assert_close(cm(torch.ones(2, 4)), model(torch.ones(2, 4)))
    lines = _lines(tr.explain(cm))
    assert lines[0].startswith("torch.compile(backend='torchreplay') of Linear: 0 graph(s)"), lines
    assert lines[1].startswith("none yet: call it once on CUDA inputs"), lines
    fn = torch.compile(lambda x: x * 2, backend=torchreplay_backend)
    assert "(a function: every graph of the process)" in tr.explain(fn)
