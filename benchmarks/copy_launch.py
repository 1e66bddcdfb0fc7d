"""Host cost of the copies and clones around a replay, one launch each way (RESULTS.md, session
28): ``copy_`` per tensor against ``torch._foreach_copy_``, and ``clone`` per tensor against
``torch._foreach_mul(ts, 1.0)``, for one to eight tensors of the shapes a training block moves
(an 8 x 1024 activation; a 2048 x 1024 block's gradients). Needs CUDA.

Usage: ``PYTHONPATH=. python benchmarks/copy_launch.py``
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from torchreplay.bench.timing import host_loop_us  # noqa: E402


def main() -> None:
    dev = "cuda"
    print(torch.cuda.get_device_name(), torch.__version__)
    act = [(torch.randn(8, 1024, device=dev), torch.randn(8, 1024, device=dev)) for _ in range(8)]
    grads = [torch.randn(s, device=dev) for s in [(2048, 1024), (2048,), (1024, 2048), (1024,), (8, 1024)]]
    rows = {}
    for k in (1, 2, 4, 8):
        dsts = [d for d, _ in act[:k]]
        srcs = [s for _, s in act[:k]]

        def per_tensor(dsts=dsts, srcs=srcs):
            for d, s in zip(dsts, srcs):
                d.copy_(s)

        rows[f"copy {k} x 8x1024: copy_ each"] = per_tensor
        rows[f"copy {k} x 8x1024: _foreach_copy_"] = lambda dsts=dsts, srcs=srcs: torch._foreach_copy_(dsts, srcs)
    for shape, dtype in [((1, 3, 224, 224), torch.float32), ((1, 1), torch.int64), ((32, 4096), torch.bfloat16)]:
        d, src = torch.zeros(shape, dtype=dtype, device=dev), torch.ones(shape, dtype=dtype, device=dev)
        tag = f"copy 1 x {'x'.join(map(str, shape))} {str(dtype)[6:]}"
        rows[f"{tag}: copy_"] = lambda d=d, src=src: d.copy_(src)
        rows[f"{tag}: _foreach_copy_"] = lambda d=d, src=src: torch._foreach_copy_([d], [src])
    small = [t for _, t in act[:4]]
    rows["clone 4 x 8x1024: clone each"] = lambda: [t.clone() for t in small]
    rows["clone 4 x 8x1024: _foreach_mul 1.0"] = lambda: torch._foreach_mul(small, 1.0)
    rows["clone a block's 5 grads: clone each"] = lambda: [t.clone() for t in grads]
    rows["clone a block's 5 grads: _foreach_mul 1.0"] = lambda: torch._foreach_mul(grads, 1.0)
    x = torch.randn(8, 1024, device=dev)
    rows["x * 2 (one plain launch)"] = lambda: x * 2
    for _ in range(2):  # twice: the second pass is the one to read
        for name, fn in rows.items():
            med, lo = host_loop_us(fn, n=500 if "grads" in name else 2000)
            print(f"{name:45s} median {med:6.2f} us  min {lo:6.2f} us")
        print()


if __name__ == "__main__":
    main()
