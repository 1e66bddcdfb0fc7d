"""Which inputs a callable writes, found while it is captured.

Eager semantics: an in-place write to an argument (``x.add_(1)``, a KV cache's ``index_copy_``, a
running statistic passed in, an ``out=`` argument, a write through a view of an argument) reaches
the caller's tensor. A graph writes its static input buffer instead, so after each replay the
written buffers are copied back into the caller's tensors (:meth:`torchreplay.core.io.Inputs.copy_back`).

:class:`WriteWatch` is a dispatch mode that sees every aten op of the captured call and records the
static input buffers whose memory an op's schema marks as written. It runs once, on the capture
call (the call the graph replays), so replays pay nothing for it.

A ``torch.compile``d region called inside the capture runs its compiled code, as it does outside
one (the mode says ``ignore_compile_internals``: under any other mode torch recompiles such a
frame, and a compile inside a capture fails, so a function that calls a compiled model could not be
graphed). The mode does not see that region's ops; a write there to a watched buffer is found by
the buffer's version counter, which torch bumps for every input a compiled graph mutates.

A write that neither shows cannot be seen: a raw Triton or CUDA kernel launched outside an aten
op, or a custom op registered without ``mutates_args``. Register such ops with
``torch.library.custom_op(..., mutates_args=(...))``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from torchreplay._compat import LightDispatchMode, versions_of, written_tensors

__all__ = ["WriteWatch"]


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` of the bytes a tensor's storage covers."""
    storage = t.untyped_storage()
    start = storage.data_ptr()
    return start, start + storage.nbytes()


class WriteWatch(LightDispatchMode):
    """Record which of ``buffers`` (the static inputs) the ops run inside it write.

    Args:
        buffers: the tensors to watch, by position.

    Attributes:
        written: positions in ``buffers`` that some op wrote, in first-write order.
    """

    def __init__(self, buffers: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._buffers = list(buffers)
        self._spans = [(_span(b), i) for i, b in enumerate(buffers)]
        self._versions: list[int | None] = []
        self.written: list[int] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled regions run their compiled code inside the capture (see above)

    def __enter__(self) -> WriteWatch:
        self._versions = versions_of(self._buffers)  # None: an inference tensor has no counter
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for i, (b, version) in enumerate(zip(self._buffers, self._versions)):
            if version is not None and b._version != version and i not in self.written:
                self.written.append(i)  # a compiled region wrote it

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        for t in written_tensors(func, args, kwargs):
            if t.device.type == "meta":
                continue
            ptr = t.untyped_storage().data_ptr()
            for (lo, hi), i in self._spans:
                if lo <= ptr < hi and i not in self.written:
                    self.written.append(i)
        return func(*args, **kwargs)
