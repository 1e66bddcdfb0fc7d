"""Host constants made by kernels under capture (core/constants.py), on the CPU: with the mode
acting for CPU tensors, every call gives what it gives without it (values, dtype, shape,
``requires_grad``), made by fill kernels; what is not a small plain host constant is left
alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchreplay.core import constants
from torchreplay.core.constants import MAX_ELEMENTS, DeviceConstants


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


X = torch.arange(24.0).reshape(2, 3, 4)

CASES = {
    "scalar float": lambda: torch.tensor(0.0, device="cpu"),
    "scalar int": lambda: torch.tensor(3, device="cpu"),
    "scalar bool": lambda: torch.tensor(True, device="cpu"),
    "list": lambda: torch.tensor([1, 2, 3], device="cpu"),
    "nested, dtype": lambda: torch.tensor([[1.5, 2.5], [3.5, 4.5]], dtype=torch.float16, device="cpu"),
    "same values": lambda: torch.tensor([[7, 7], [7, 7]], device="cpu"),
    "signed zeros": lambda: torch.tensor([0.0, -0.0], device="cpu"),
    "empty": lambda: torch.tensor([], device="cpu"),
    "as_tensor": lambda: torch.as_tensor([1, 2], device="cpu"),
    "as_tensor dtype": lambda: torch.as_tensor([1, 2], dtype=torch.float64, device="cpu"),
    "new_tensor": lambda: X.new_tensor([1, 2]),
    "new_tensor dtype": lambda: X.new_tensor([1, 2], dtype=torch.int32),
    "new_tensor dtype None": lambda: X.new_tensor([1, 2], dtype=None, device=None),
    "index a list (Falcon)": lambda: X[..., [-2], :],
    "index a list alone": lambda: X[[1, 0, 1]],
    "index two lists": lambda: X[:, [0, 2], [1, 3]],
    "index a list after an int": lambda: X[0, [1, 2], :],
    "index lists in a tuple": lambda: X[[1], [2], [3]],
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_host_constant_is_made_by_kernels_and_equals_eager(name: str) -> None:
    make = CASES[name]
    want = make()
    ops = _Ops()
    with DeviceConstants(kind="cpu"), ops:
        got = make()
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    if got.is_floating_point():  # (equal does not tell -0.0 from 0.0)
        assert torch.equal(torch.signbit(got), torch.signbit(want))
    assert "aten.full" in ops.names or "aten.fill_" in ops.names or name == "empty", ops.names


def test_requires_grad_and_written_values() -> None:
    with DeviceConstants(kind="cpu"):
        leaf = torch.tensor(1.5, device="cpu", requires_grad=True)
        y = X.clone()
        y[[0, 1], 0] = [[9.0] * 4, [8.0] * 4]
    assert leaf.requires_grad and leaf.is_leaf and leaf.item() == 1.5
    want = X.clone()
    want[[0, 1], 0] = torch.tensor([[9.0] * 4, [8.0] * 4])
    assert torch.equal(y, want)


@pytest.mark.parametrize("name,make", [
    ("a tensor inside", lambda: torch.tensor([torch.tensor(1.0), 2.0], device="cpu")),
    ("a bool mask", lambda: X[[True, False]]),
    ("a tensor index", lambda: X[torch.tensor([0])]),
    ("a list of lists (read as a tuple)", lambda: X[[[0, 1]]]),
    ("a list of lists in a tuple", lambda: X[:, [[0, 1], [1, 0]]]),
    ("too many elements", lambda: torch.tensor(list(range(MAX_ELEMENTS + 1)), device="cpu")),
])
def test_what_is_no_small_plain_constant_is_left_alone(name, make) -> None:
    want = make()
    ops = _Ops()
    with DeviceConstants(kind="cpu"), ops:
        got = make()
    assert torch.equal(got, want)
    assert "aten.fill_" not in ops.names and "aten.full" not in ops.names, ops.names


def test_a_float_list_index_is_left_alone_and_gives_what_eager_gives() -> None:
    ops = _Ops()
    with DeviceConstants(kind="cpu"), ops:
        got = X[[0.5]]
    assert torch.equal(got, X[[0.5]]) and "aten.fill_" not in ops.names


def test_a_warm_up_that_made_one_turns_the_mode_on_for_the_callables_later_captures() -> None:
    class Masked(torch.nn.Module):
        def forward(self, x):
            return x + torch.tensor([0.0, 1.0], device=x.device)

    model, plain = Masked(), torch.nn.Linear(2, 2)
    with constants.watching(model, kind="cpu"):
        model(torch.ones(2))
    with constants.watching(plain.forward, kind="cpu"):  # (a bound method: its module)
        plain(torch.ones(2))
    with constants.watching(model, on=False, kind="cpu"):  # (not the last warm-up: unchanged)
        pass
    assert constants.remembered(model) and constants.remembered(model.forward)
    assert not constants.remembered(plain)


#: models whose eager attention mask was made with torch.tensor(..., device=) in the transformers
#: the GPU machine has (5.17) and is not in 5.24 (the dev machine's, where they make none)
_EAGER_MASK_IN = {"Bloom": "5.17", "GPTJ": "5.17"}


@pytest.mark.parametrize("name,makes", [("Falcon", True), ("Bloom", True), ("GPTJ", True), ("Llama", False), ("T5", False)])
def test_hf_models_watch_and_mode(name: str, makes: bool) -> None:
    """On real models (scripts/zoo.py, small, random weights): the warm-up watch flags those
    that make a host constant (Falcon's list index, Bloom's and GPT-J's eager mask), and only
    them; under the mode every output is what eager gives, bit for bit."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import zoo

    torch.manual_seed(0)
    model = zoo.all_models()[name]().eval()
    gen = torch.Generator().manual_seed(0)
    old, zoo.DEV = zoo.DEV, "cpu"
    try:
        a, kw = zoo.inputs(name, 3, gen)
    finally:
        zoo.DEV = old
    kw["use_cache"] = False
    with torch.no_grad():
        want = model(*a, **kw)
        with constants.watching(model, kind="cpu"):
            model(*a, **kw)
        with DeviceConstants(kind="cpu"):
            got = model(*a, **kw)
    if makes and not constants.remembered(model) and name in _EAGER_MASK_IN:
        import transformers

        pytest.skip(f"transformers {transformers.__version__}'s {name} makes no host constant (its "
                    f"eager mask did in {_EAGER_MASK_IN[name]}): nothing to watch")
    assert constants.remembered(model) == makes
    assert zoo.maxdiff(got, want) == 0.0
