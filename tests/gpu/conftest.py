"""Fixtures shared by the GPU tests of the compile backend."""

from __future__ import annotations

import gc
import sys

import pytest
import torch


@pytest.fixture()
def fresh_dynamo():
    """Dynamo's caches reset around the test. An earlier test's model still alive (a failed
    test's traceback, a reference cycle) would share this test's backend (``tr.compile`` shares
    one per module class and options), and its graphs would count in ``c.backend.runtimes``:
    the traceback is dropped and garbage collected first."""
    torch._dynamo.reset()
    sys.last_type = sys.last_value = sys.last_traceback = None
    gc.collect()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def process_left_usable():
    """After each GPU test: the stream is not capturing and the CUDA RNG draws. A test whose
    capture left torch's RNG marked as capturing ("Offset increment outside graph capture")
    failed every random op of every test after it (12 failures in session 69, one cause):
    that test fails here, naming what it left, and the mark is cleared for the next."""
    yield
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    from torchreplay import _compat

    problems = []
    if torch.cuda.is_current_stream_capturing():
        problems.append("the current CUDA stream is still capturing")
    else:
        try:
            torch.empty(1, device="cuda").uniform_()
        except RuntimeError as exc:
            problems.append(f"a random op raises: {str(exc).splitlines()[0]}")
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                _compat.end_rng_capture()
    if problems:
        pytest.fail("this test left the process broken: " + "; ".join(problems), pytrace=False)
