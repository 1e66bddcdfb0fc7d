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
