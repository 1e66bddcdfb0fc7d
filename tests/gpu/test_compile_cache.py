"""The compile cache on the GPU: a cold start, then a warm start in a fresh process, of a model
with a Dynamo graph break, of HF BERT with a padding mask, and of a function that writes its
argument (the written-inputs fact loaded at the warm start). Both starts equal eager over many
calls with fresh inputs, give the same outputs as each other, and the warm one loads every piece
(a hit each) without one Inductor compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[2])
    import torchreplay as tr
    from inductor_counter import count_inductor_compiles
    from torchreplay.compile import backend
    calls = count_inductor_compiles()
    fake_runs = []  # the fake run that finds which inputs a graph writes
    real = backend.graph_writes
    backend.graph_writes = lambda *a: fake_runs.append(1) or real(*a)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if sys.argv[1] == "data-if":
        from torchreplay.models.blocks import DataDependentIf
        model = DataDependentIf().to(dev).eval()
        make = lambda n: (torch.randn(n, 1024, device=dev),)
        sizes = [2, 4, 8]
    elif sys.argv[1] == "writes":  # writes its argument, as a KV cache update does
        lin = torch.nn.Linear(64, 64).to(dev)
        def model(x, state):
            y = lin(x)
            state.add_(y.sum(0))
            return y * 2
        state, ref_state = torch.randn(64, device=dev), None
        ref_state = state.clone()
        sizes = None
    else:
        from torchreplay.models.blocks import bert_encoder
        model = bert_encoder().to(dev).eval()
        def make(n):
            ids = torch.randint(0, 30000, (n, 64), device=dev)
            mask = (torch.arange(64, device=dev) < torch.randint(1, 65, (n, 1), device=dev)).long()
            return ids, mask
        sizes = None
    c = tr.compile(model, sizes=sizes)
    if sys.argv[1] == "writes":
        with torch.no_grad():
            for i in range(20):
                x = torch.randn(4, 64, device=dev)
                torch.testing.assert_close(c(x, state), model(x, ref_state))
                torch.testing.assert_close(state, ref_state)  # the write reached the caller
        make = lambda n: (torch.randn(n, 64, device=dev), torch.zeros(64, device=dev))
    with torch.no_grad():
        for i in range(20 if sys.argv[1] != "writes" else 0):
            args = make(4 if sizes is None else (3, 8, 2)[i % 3])
            y = c(*args)
            torch.testing.assert_close(y, model(*args), rtol=2e-3, atol=2e-3)
        torch.manual_seed(7)
        x = make(4)
        fixed = c(*x).float().sum().item()
    outcomes = c.backend.cache.outcomes
    print("RESULT " + json.dumps({
        "inductor": len(calls), "fixed": fixed, "fake_runs": len(fake_runs),
        "statuses": [o.status for o in outcomes],
        "explain": tr.explain(c),
    }))
    """
)


def _start(model: str, folder: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHREPLAY_CACHE_DIR": str(folder)}
    tests = str(Path(__file__).parents[1])
    out = subprocess.run([sys.executable, "-c", CHILD, model, tests], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("model", ["data-if", "bert", "writes"])
def test_cold_then_warm_start_loads_every_piece_and_matches(model: str, tmp_path: Path) -> None:
    if model == "bert":
        pytest.importorskip("transformers")
    assert torch.cuda.is_available()
    cold = _start(model, tmp_path)
    warm = _start(model, tmp_path)
    assert cold["inductor"] > 0 and "miss" in cold["statuses"], cold
    assert "hit" not in cold["statuses"], cold
    assert warm["inductor"] == 0, warm["explain"]  # no Inductor compile at the warm start
    assert warm["statuses"] and set(warm["statuses"]) == {"hit"}, warm["explain"]
    assert len(warm["statuses"]) == len([s for s in cold["statuses"] if s == "miss"])
    assert "cache hit" in warm["explain"] and "instead of compiled" in warm["explain"]
    assert warm["fixed"] == pytest.approx(cold["fixed"], rel=1e-5, abs=1e-4)
    # Which inputs each graph writes is kept too: no fake run at the warm start (and the
    # "writes" model's write still reaches the caller's tensor there, checked in the child).
    assert cold["fake_runs"] > 0 and warm["fake_runs"] == 0, (cold, warm)
