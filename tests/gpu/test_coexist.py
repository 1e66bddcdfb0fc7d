"""Our graphs next to torch's own graph tools in one process.

``torch.compile(mode="reduce-overhead")`` clears torch's cached cuBLAS workspaces around each of
its recordings. A graph of ours whose matmuls used a workspace allocated outside its capture then
read freed memory at its next replay ("an illegal memory access", which ends the CUDA context).
Each scenario runs in a fresh process so that such a failure cannot take the test session down.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    sys.path.insert(0, {root!r})
    import torchreplay as tr

    def mlp():
        layers = []
        for _ in range(4):
            layers += [nn.Linear(1024, 1024), nn.GELU()]
        return nn.Sequential(*layers).cuda().eval()

    torch.manual_seed(0)
    ours_model, theirs_model = mlp(), mlp()
    x0 = torch.randn(8, 1024, device="cuda")
    ours = {{"graph": lambda: tr.graph(ours_model, x0), "compile": lambda: tr.compile(ours_model)}}[{which!r}]()
    with torch.no_grad():
        ours(x0)
        theirs = torch.compile(theirs_model, mode="reduce-overhead")
        for _ in range(4):  # warm-up and recording: torch clears the cuBLAS workspaces
            theirs(torch.randn(8, 1024, device="cuda"))
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        # Reuse the freed memory: a graph that still wrote there would change these.
        junk = [torch.full((1 << 20,), float(k), device="cuda") for k in range(64)]
        for i in range(20):
            x = torch.randn(8, 1024, device="cuda")
            y = theirs(x).clone() if i % 2 else None
            torch.testing.assert_close(ours(x).clone(), ours_model(x), rtol=2e-3, atol=2e-3)
            if y is not None:
                torch.testing.assert_close(y, theirs_model(x), rtol=2e-3, atol=2e-3)
        torch.cuda.synchronize()
        for k, t in enumerate(junk):
            assert bool((t == k).all()), f"memory freed under a graph was written (block {{k}})"
    print("EQUAL")
    """
)


@pytest.mark.parametrize("which", ["graph", "compile"])
def test_our_graphs_survive_reduce_overhead_in_the_same_process(which: str) -> None:
    script = _SCRIPT.format(root=str(ROOT), which=which)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0 and "EQUAL" in proc.stdout, tail


_COUNTER = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {root!r})
    import torchreplay as tr

    def step(x, cache, pos):  # a KV-cache write at a counter the call advances
        cache.index_copy_(0, pos, x)
        pos.add_(1)
        return cache.sum(0) * 2

    for which in ("compile", "graph"):
        cache, pos = torch.zeros(8, 4, device="cuda"), torch.tensor([6], device="cuda")
        ref_cache, ref_pos = cache.clone(), pos.clone()
        x = torch.randn(1, 4, device="cuda")
        g = tr.compile(step) if which == "compile" else tr.graph(step, x, cache, pos)
        for i in range(2):  # the first call captures at position 6: its warm-ups must not reach 8
            x = torch.randn(1, 4, device="cuda")
            want = step(x, ref_cache, ref_pos)
            got = g(x, cache, pos)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(cache, ref_cache)
            assert torch.equal(pos, ref_pos), (which, i, pos, ref_pos)
        torch.cuda.synchronize()
    print("EQUAL")
    """
)


def test_warm_ups_see_the_calls_state_not_their_own_writes() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _COUNTER.format(root=str(ROOT))], capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "EQUAL" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
