"""Hugging Face's ``Trainer`` over a model graphed by ``tr.make_graphed_callables`` and over its
eager twin (tests/cpu and tests/gpu ``test_eager_form.py``): the Trainer keeps the dataset
columns the forward's signature names, and passes a forward that takes ``**kwargs`` what the
sample must then hold (``num_items_in_batch``: int64 in transformers 5.17, float32 in 5.24)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import torchreplay as tr


def train_graphed_and_eager(device: str, out_dir: str, steps: int, hidden: int) -> tuple[Any, Any, float, float]:
    """A small BERT classifier and its eager copy, each trained ``steps`` steps by the Trainer
    from the same weights and batches, the first through its graphs: (model, ref, loss, ref's)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * hidden, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).to(device)
    ref = copy.deepcopy(model)
    sample = {"input_ids": torch.randint(0, 100, (4, 8), device=device),
              "attention_mask": torch.ones(4, 8, dtype=torch.long, device=device),
              "labels": torch.zeros(4, dtype=torch.long, device=device)}

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4 * steps

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randint(0, 100, (8,), generator=g), "attention_mask": torch.ones(8, dtype=torch.long),
                    "labels": torch.tensor(i % 2), "note": "a column the forward does not take"}

    def train(m: torch.nn.Module) -> float:
        args = transformers.TrainingArguments(
            output_dir=out_dir, per_device_train_batch_size=4, max_steps=steps, report_to=[],
            use_cpu=device == "cpu", save_strategy="no", seed=0, data_seed=0, learning_rate=1e-3,
        )
        return transformers.Trainer(model=m, args=args, train_dataset=Rows()).train().training_loss

    seen: dict = {}  # what the Trainer passes besides the batch (its type depends on its version)
    ref.register_forward_pre_hook(lambda m, a, k: seen.setdefault("kw", k) and None, with_kwargs=True)
    want = train(ref)
    n = seen["kw"].get("num_items_in_batch")
    if n is not None:
        sample["num_items_in_batch"] = torch.full_like(n, 4)
    tr.make_graphed_callables(model, (), sample_kwargs=sample)
    return model, ref, train(model), want
