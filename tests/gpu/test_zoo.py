"""Models nobody here wrote (``scripts/zoo.py``: HF transformers of each family, timm,
torchvision, a peft LoRA), small and with random weights, each compared with eager over
several calls with fresh inputs: ``tr.graph`` at one shape, ``tr.graph(sizes=)`` at sizes
between and at the captured ones, ``tr.make_graphed_callables`` (loss and every gradient, with
dropout on: same seeds), and training with ``breaks="auto"`` on a MoE. A handful of families
that exercise different code (encoder-decoder, relative attention, state-space, windowed
attention, soft-capping, LoRA adapters); ``python scripts/zoo.py`` runs all forty."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("full_fp32_matmul"),  # (tests/conftest.py)
]

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import zoo  # noqa: E402

TOL = 1e-3
MODELS = ["T5", "Bart", "Gemma2", "Phi3", "GPTNeoX", "Mamba", "DebertaV2", "ModernBert", "Swin",
          "Llama+LoRA", "timm:efficientnet_b0"]


def _build(name: str):
    build = zoo.all_models().get(name)
    if build is None:
        pytest.skip(f"{name}: its package is not installed here")
    return build


@pytest.mark.parametrize("mode", ["infer", "sizes", "train"])
@pytest.mark.parametrize("name", MODELS)
def test_a_model_nobody_here_wrote_matches_eager(name: str, mode: str) -> None:
    build = _build(name)
    if mode == "train":
        assert zoo.run_train(name, build) <= TOL
    else:
        assert zoo.run_infer(name, build, sizes=mode == "sizes") <= TOL


def test_a_moe_trains_with_auto_breaks_at_its_experts() -> None:
    """HF Qwen2-MoE in float32: its experts' ``grouped_mm`` copies to the host inside its
    kernel; the trial capture of ``breaks="auto"`` finds it, and the rest is graphed."""
    report: list[str] = []
    assert zoo.run_train("Qwen2Moe", _build("Qwen2Moe"), breaks="auto", report=report) <= TOL
    # (equal to eager proves nothing alone: a break at the whole model is eager too)
    assert "3 segment(s)" in report[0] and report[0].count("break Qwen2MoeExperts") == 2, report[0]


@pytest.mark.parametrize("mode", ["infer", "sizes", "train"])
@pytest.mark.parametrize("name", ["Falcon", "Bloom", "GPTJ"])
def test_models_with_host_constants_graph_whole(name: str, mode: str) -> None:
    """HF Falcon indexes with a Python list, Bloom and GPT-J build their mask with
    ``torch.tensor(0.0, device=...)``: copies from the host, which failed their capture until
    fill kernels made those constants inside the graph (core/constants.py)."""
    build = _build(name)
    if mode == "train":
        assert zoo.run_train(name, build) <= TOL
    else:
        assert zoo.run_infer(name, build, sizes=mode == "sizes") <= TOL
