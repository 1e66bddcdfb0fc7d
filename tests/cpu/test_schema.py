"""What ``_compat.schema.written_tensors`` reads from an op's schema: each call's own arguments,
though the schema is read once per op."""

from __future__ import annotations

import torch

from torchreplay._compat.schema import written_arguments, written_tensors

aten = torch.ops.aten


def _ids(ts: list[torch.Tensor]) -> list[int]:
    return [id(t) for t in ts]


def test_each_call_reports_its_own_tensors_though_the_schema_is_read_once() -> None:
    for _ in range(3):  # (the first call reads the schema; the later ones must not reuse values)
        x, y = torch.randn(3), torch.randn(3)
        assert _ids(written_tensors(aten.add_.Tensor, (x, y), {})) == [id(x)]
        assert written_tensors(aten.add.Tensor, (x, y), {}) == []


def test_out_arguments_and_lists_of_tensors() -> None:
    x, y, out = torch.randn(3), torch.randn(3), torch.empty(3)
    assert _ids(written_tensors(aten.add.out, (x, y), {"out": out})) == [id(out)]
    a, b = [torch.randn(2), torch.randn(2)], [torch.randn(2), torch.randn(2)]
    assert _ids(written_tensors(aten._foreach_add_.List, (a, b), {})) == _ids(a)
    # (arguments after self, written as its schema says: a fused Adam step writes its gradients
    # and moments, not its step counts)
    ps, gs, m1, m2, steps = ([torch.randn(2)] for _ in range(5))
    fused = written_tensors(aten._fused_adam_.default, (ps, gs, m1, m2, [], steps), {
        "lr": 0.1, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "eps": 1e-8, "amsgrad": False,
        "maximize": False})
    assert _ids(fused) == _ids(ps + gs + m1 + m2)


def test_batch_norm_statistics_are_written_in_training_only() -> None:
    x, mean, var = torch.randn(4, 3), torch.zeros(3), torch.ones(3)
    op = aten.native_batch_norm.default
    assert _ids(written_tensors(op, (x, None, None, mean, var, True, 0.1, 1e-5), {})) == [id(mean), id(var)]
    assert written_tensors(op, (x, None, None, mean, var, False, 0.1, 1e-5), {}) == []


def test_any_kind_of_value_and_callables_without_a_schema() -> None:
    x = torch.randn(3)
    assert written_arguments(aten.add_.Tensor, ("node x", "node y"), {}) == ["node x"]
    assert written_tensors(lambda t: t, (x,), {}) == []

    class Unhashable:  # (read each time: no cache entry)
        __hash__ = None  # type: ignore[assignment]
        _schema = aten.add_.Tensor._schema

    assert _ids(written_tensors(Unhashable(), (x, x), {})) == [id(x)]
