"""``torch.inference_mode`` on the CPU side of capture: our buffers are normal tensors in it
(static inputs, padded samples), version counters are read only where they exist, a put-back
leaves an inference tensor alone outside the mode, and the training front ends refuse to
capture in it. The graphs themselves, under the mode, are in tests/gpu/test_inference_mode.py."""

from __future__ import annotations

import pytest
import torch

import torchreplay as tr
from torchreplay import _compat
from torchreplay.core.args import CallArgs
from torchreplay.core.io import Inputs
from torchreplay.core.padding import pad_sample
from torchreplay.core.writes import WriteWatch
from torchreplay.errors import CaptureError

CPU = torch.device("cpu")


def test_static_buffers_made_under_inference_mode_are_normal_tensors() -> None:
    """A graph captured under inference_mode must take calls outside it: the copy into an
    inference tensor there would raise."""
    with torch.inference_mode():
        x = torch.randn(4, 3)
        inputs = Inputs(CallArgs(lambda t: t, (x,), {}), CPU)
    static = inputs.slots[0].static
    assert x.is_inference() and not static.is_inference()
    y = torch.randn(4, 3)
    inputs.copy_in((y,), {})  # outside the mode: would raise on an inference buffer
    assert torch.equal(static, y)
    with torch.inference_mode():
        z = torch.randn(4, 3)
        inputs.copy_in((z,), {})
    assert torch.equal(static, z)


def test_a_padded_sample_made_under_inference_mode_counts_writes() -> None:
    with torch.inference_mode():
        leaf = torch.randn(3, 2)
        padded = pad_sample(leaf, 0, 4, 0.0)
        before = padded._version  # an inference tensor would raise here
        padded.add_(1)
    assert not padded.is_inference() and padded._version == before + 1
    assert torch.equal(padded[:3], leaf + 1) and torch.equal(padded[3], torch.ones(2))


def test_versions_of_gives_none_for_an_inference_tensor() -> None:
    normal = torch.zeros(2)
    normal.add_(1)
    with torch.inference_mode():
        inference = torch.zeros(2)
        with _compat.normal_tensors():
            made_normal = torch.zeros(2)
    assert _compat.versions_of([normal, inference, made_normal]) == [1, None, 0]


def test_restore_unversioned_skips_inference_tensors_outside_the_mode() -> None:
    """Outside inference_mode nothing can have written an inference tensor, and a copy into it
    would raise; inside, its value is put back (it has no counter to set)."""
    normal = torch.zeros(3)
    with torch.inference_mode():
        inference = torch.zeros(3)
    saved = [(normal, normal.clone()), (inference, inference.clone())]
    versions = _compat.versions_of([normal, inference])
    normal.add_(5)
    _compat.restore_unversioned(saved, versions)
    assert torch.equal(normal, torch.zeros(3)) and normal._version == versions[0]
    with torch.inference_mode():
        inference.add_(5)
        _compat.restore_unversioned(saved, versions)
    assert torch.equal(inference, torch.zeros(3))


def test_the_write_watch_ignores_what_has_no_version_counter() -> None:
    """Buffers made under inference_mode: the dispatch-mode part of the watch still sees an
    in-place op on them; only the version-counter part has nothing to read."""
    with torch.inference_mode():
        a, b = torch.zeros(4), torch.zeros(4)
        watch = WriteWatch([a, b])
        with watch:
            b.add_(1)
    assert watch.written == [1]


def test_training_front_ends_refuse_to_capture_under_inference_mode() -> None:
    model = torch.nn.Linear(3, 3)
    with torch.inference_mode():
        with pytest.raises(CaptureError, match=r"make_graphed_callables.*inference_mode.*tr\.graph"):
            tr.make_graphed_callables(model, (torch.randn(2, 3),))
        with pytest.raises(CaptureError, match=r"graph_step.*inference_mode"):
            tr.graph_step(lambda x: model(x).sum().backward(), torch.randn(2, 3))
