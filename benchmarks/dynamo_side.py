"""What Dynamo itself adds per call when the compiled graph holds custom ops: the backend
returns a callable that hands back precomputed outputs, so the time per call is Dynamo's frame,
its guards and its call of the backend's result, nothing of ours. A model of 12 Linear layers
with no custom op, with one (issue 10's k = 2: one split) and with eleven (k = 12), best of
20 x 1000 calls, us per call. Runs anywhere (CPU by default; ``--device cuda`` to place the
model on the GPU; nothing is launched but the first, traced call).

Session 64 found "Dynamo's side" (``tr.compile`` per call minus the runtime called alone) to
grow by 7.3 us with one split; this measures whether Dynamo's own part does.

Usage: ``python benchmarks/dynamo_side.py [--device cpu|cuda]``."""
import argparse
import time

import torch
import torch.nn as nn

torch.library.define("dynside::ident", "(Tensor x) -> Tensor")


@torch.library.impl("dynside::ident", "CompositeExplicitAutograd")
def _ident(x):
    return x.clone()


@torch.library.register_fake("dynside::ident")
def _fake(x):
    return torch.empty_like(x)


class Layers(nn.Module):
    def __init__(self, ops: int) -> None:
        super().__init__()
        self.ops = ops
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(12))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < self.ops:
                x = torch.ops.dynside.ident(x)
        return x


def constant_backend(gm, example_inputs):
    with torch.no_grad():
        outs = gm(*example_inputs)
    return lambda *args: outs


def per_call(ops: int, device: str) -> float:
    model = Layers(ops).to(device).eval()
    compiled = torch.compile(model, backend=constant_backend)
    x = torch.randn(8, 16, device=device)
    with torch.no_grad():
        for _ in range(1000):
            compiled(x)
        best = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            for _ in range(1000):
                compiled(x)
            best = min(best, (time.perf_counter() - t0) / 1000 * 1e6)
    return best


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    device = parser.parse_args().device
    base = per_call(0, device)
    print(f"torch {torch.__version__}, {device}: no custom op {base:.2f} us per call")
    for ops in (1, 11):
        t = per_call(ops, device)
        print(f"  {ops:2d} custom op(s): {t:.2f} us (+{t - base:.2f}, +{(t - base) / ops:.2f} per op)")
