"""How often ``"checked"`` outputs were made anew (a tensor and a storage) rather than handed out
again, by the name of the graph whose outputs they are: a benchmark helper."""
import collections
from typing import Callable

import torch

from torchreplay.core import outputs as outputs_mod


def new_tensor_counts(step: Callable[[], object], n: int = 100) -> dict:
    made: collections.Counter = collections.Counter()
    original = outputs_mod.Outputs._new_tensors

    def counted(self):
        made[self.name] += 1
        return original(self)

    outputs_mod.Outputs._new_tensors = counted
    try:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    finally:
        outputs_mod.Outputs._new_tensors = original
    return dict(made)
