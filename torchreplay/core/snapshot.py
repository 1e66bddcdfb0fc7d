"""What a build's real calls change in a module's buffers and the RNG state, put back after.

Building a graph runs the callable for real: the warm-ups, the probe of ``sizes=``, a breakable
graph's sample call and its breaks. A KV-cache write or a BatchNorm statistics update would
otherwise happen ``num_warmup_iters`` extra times just because a graph was built.
:class:`StateSnapshot` puts the module's buffers and the RNG state back.

Buffers of up to 1 MiB (statistics, positions, masks) are copied whole. Larger ones (a KV cache
registered as a buffer, as gpt-fast's models do, sized to fill the device) are not: copying
them would double their memory for the build, and a cache that fills the device would not fit
twice. :class:`~torchreplay.core.rewind.Rewind` records, just before each write of the build's
calls into one, only what that write overwrites (the rows of an ``index_copy_``, the elements of
an ``index_put_``) and writes it back. What a ``torch.compile``d module writes, no dispatch mode
sees: a compiled module's buffers are copied whole, as they were before, and so are those of a
breakable graph's capture, which replays its segments for real. A write the recording
missed anyway (a compiled function inside a module, a kernel launched outside an aten op) shows
in the buffer's version counter, and a warning names the buffer.

A whole copy needs the memory of what it copies: one that does not fit in what the device has
free raises a :class:`~torchreplay.errors.CaptureError` before anything ran, naming the buffers
and ``restore_state=False``, never an out-of-memory error halfway through a build. With
``large="leave"`` (a breakable graph built with ``restore_state=False``) the large buffers are
neither copied nor recorded: the build's calls leave their writes there, as a serving engine's
capture writes its KV cache.

A breakable graph's capture copies whole only the large buffers its sample call wrote
(``copy_large``): a buffer the model only reads (a quantized model's packed weights) is not
copied. What the sample call wrote is told by the version counter and, for writes no counter
shows (a kernel launched outside an aten op in a break: flash-attention's KV-cache write), by
a :func:`checksum` of the contents taken before and after it (``sums``). A buffer left
uncopied whose contents the captures changed anyway is named in a warning.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Collection, Iterator

import torch

from torchreplay import _compat
from torchreplay.core.generators import Draws
from torchreplay.core.pystate import large_tensors
from torchreplay.errors import CaptureError
from torchreplay.core.rewind import Rewind

__all__ = ["GRAPH_FIX", "StateSnapshot", "check_fits", "copies"]

_GiB = float(1 << 30)

_module_pre_hook = torch.nn.modules.module.register_module_forward_pre_hook


class StateSnapshot:
    """Module buffers (and optionally parameters) and RNG state, saved to be put back.

    The calls the build makes for real run inside :meth:`running`: what they write into large
    buffers is recorded there. For a plain function (``module`` None, ``find``), which modules
    it runs is learned there too: torch's global forward pre-hook records each module the first
    time it is called (:attr:`called`, in order) and keeps its buffers then, before its first
    forward wrote them (not while a stream captures: nothing runs for real there). A compiled
    module found so is kept whole, submodules included: their hooks do not run inside compiled
    code. ``save`` False: only the finding (:meth:`restore` does nothing). ``large``: what
    becomes of the buffers over 1 MiB: ``"rewind"`` (default) records what the build's calls
    write into them; ``"copy"`` copies them whole, for a build whose calls write them where no
    mode sees (a breakable graph's capture replays its segments for real); ``"leave"`` does
    neither (``restore_state=False`` of a breakable graph): what the build writes there stays.
    """

    def __init__(
        self,
        module: torch.nn.Module | None,
        device: torch.device,
        params: bool = False,
        *,
        find: bool = False,
        save: bool = True,
        large: str = "rewind",
        sums: bool = False,
        copy_large: Collection[int] | None = None,
    ) -> None:
        self._params = params
        self._large = large
        self._sums_on = sums
        self._copy_large = copy_large
        # large buffers watched by checksum: name, tensor, version counter and checksum then
        self._sums: list[tuple[str, torch.Tensor, int | None, torch.Tensor | None]] = []
        self._save = save
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its copy)
        # every buffer kept, by name, with its version counter then (before a build call wrote
        # it; None: an inference tensor, which has none)
        self._kept_versions: list[tuple[str, torch.Tensor, int | None]] = []
        self._rewind = Rewind() if save else None  # the large buffers' writes
        self._kept: set[int] = set()  # the modules whose buffers are kept, by id
        #: with ``find``: the modules the callable ran inside :meth:`running`, each once, in order
        self.called: list[torch.nn.Module] | None = [] if find else None
        self._seen: set[int] = set()
        self._device = device
        if module is not None and save:
            self._keep(module, recurse=True)
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        #: the generators of the user's that the build's watched calls drew from, put back with
        #: the RNG state (core/generators.py)
        self.draws = Draws(device)

    @property
    def saved_bytes(self) -> int:
        """What the snapshot holds now: the copies of the small buffers, the large ones'
        records."""
        held = sum(c.nbytes for _, c in self._saved)
        return held + (self._rewind.saved_bytes if self._rewind is not None else 0)

    def _keep(self, module: torch.nn.Module, recurse: bool) -> None:
        if id(module) in self._kept:
            return
        compiled = _compat.compiled_module(module)
        modules = list(module.modules()) if recurse or compiled else [module]
        compiled = compiled or any(_compat.compiled_module(m) for m in modules)
        # qualified names under the module given (``layers.0.attention.k_cache``); its own and
        # those of a module found by itself, by its class (``Transformer.rope_cos``)
        prefixes = {id(m): f"{n}." for n, m in module.named_modules() if n} if recurse or compiled else {}
        named: list[tuple[str, torch.Tensor]] = []
        for m in modules:
            if id(m) in self._kept:
                continue
            self._kept.add(id(m))
            prefix = prefixes.get(id(m), f"{type(m).__name__}.")
            named += [(prefix + n, b) for n, b in m.named_buffers(recurse=False) if b is not None]
            if self._params:
                named += [(prefix + n, p) for n, p in m.named_parameters(recurse=False)]
        self._kept_versions += [(n, t, _compat.version_of(t)) for n, t in named]
        large = large_tensors([t for _, t in named])
        big = {id(t) for t in large}
        if self._sums_on:
            self._sums += [(n, t, _compat.version_of(t), checksum(t)) for n, t in named if id(t) in big]
        if self._large == "leave":
            named, large = [(n, t) for n, t in named if id(t) not in big], []
        elif compiled or self._large == "copy":  # (writes no mode sees: copied whole)
            if self._copy_large is not None:  # (but not one the sample call did not write)
                left = [(n, t, None, checksum(t)) for n, t in named if id(t) in big and id(t) not in self._copy_large]
                self._sums += [x for x in left if x[3] is not None]
                gone = {id(x[1]) for x in left if x[3] is not None}
                named = [(n, t) for n, t in named if id(t) not in gone]
            large = []
        big = {id(t) for t in large}
        self._saved += copies([(n, t) for n, t in named if id(t) not in big], self._device)
        if large:
            assert self._rewind is not None
            self._rewind.watch(large, [n for n, t in named if id(t) in big])

    def written_large(self, versions: bool = True) -> list[tuple[str, torch.Tensor]]:
        """The large buffers watched by checksum (``sums``, or left uncopied by ``copy_large``)
        whose contents changed since they were kept, or (``versions``) whose version counter
        moved; with ``sums``, also those whose checksum cannot be taken (written as far as
        anyone can tell)."""
        return [(n, t) for n, t, v, s in self._sums
                if s is None or versions and v is not None and _compat.version_of(t) != v
                or not torch.equal(s, checksum(t))]  # type: ignore[arg-type]

    def kept(self) -> list[tuple[str, torch.Tensor, int | None]]:
        """Every buffer kept (parameters too with ``params``): its name, the tensor, and its
        version counter when it was kept, before any build call wrote it (None: an inference
        tensor, whose writes no counter shows)."""
        return list(self._kept_versions)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around the calls the build makes for real: record what they write into the large
        buffers kept, and with ``find``, each module the callable runs (its buffers kept)."""
        rewind = self._rewind
        record = rewind is not None and (rewind.watching or self.called is not None)
        with rewind if record else contextlib.nullcontext():  # type: ignore[attr-defined]
            if self.called is None:
                yield
                return
            with self._finding():
                yield

    @contextlib.contextmanager
    def _finding(self) -> Iterator[None]:
        called, seen, cuda = self.called, self._seen, self._device.type == "cuda"
        assert called is not None
        thread = threading.get_ident()  # the hook is global: another thread's modules are not ours

        def first_call(module: torch.nn.Module, args: Any) -> None:
            if id(module) in seen or threading.get_ident() != thread:
                return
            seen.add(id(module))
            called.append(module)
            if self._save and not (cuda and torch.cuda.is_current_stream_capturing()):
                self._keep(module, recurse=False)  # each submodule reports itself

        with warnings.catch_warnings():
            # torch warns that a global hook fires once more for a compiled module's wrapper:
            # ours only records it, once
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
            handle = _module_pre_hook(first_call)
            try:
                yield
            finally:
                handle.remove()

    def restore(self, rng: bool = True) -> None:
        """Put every saved tensor and (``rng``) the RNG state back. An inference tensor (a
        buffer made under ``torch.inference_mode``) only under ``inference_mode``: outside it,
        nothing can have written it, and a copy into it would raise. Every copy is written back,
        changed or not: a graph replayed inside a build call (a breakable capture's segments, a
        graph the callable calls) writes without moving version counters."""
        if not self._save:
            return
        assert self._rewind is not None
        self._rewind.undo()
        self._rewind.warn_unseen()
        inference = torch.is_inference_mode_enabled()
        with torch.no_grad():
            for t, saved in self._saved:
                if inference or not t.is_inference():
                    _compat.copy_back(t, saved)
        if not rng:
            return
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state(self._cuda_rng, self._device)
        self.draws.put_back()


#: How to build without the copies, for :func:`check_fits`'s error (``tr.graph``'s words)
GRAPH_FIX = (
    "Pass config=torchreplay.config.GraphConfig(restore_state=False) to build without putting "
    "them back (the build's calls then leave their writes in them, as a serving engine's capture "
    "leaves its KV cache written), or build the graph before allocating them"
)


#: What :func:`copies` copies and why, by default (the error's words)
BUFFERS = "the module's buffers to put them back after the calls it makes (restore_state=True, the default)"
#: ... a breakable graph's copies of the caller's tensors, and their fix
SAMPLE_COPIES = "the sample's tensor arguments, to run the sample call on copies (yours stay as they are)"
WRITTEN_COPIES = "the arguments the model writes, once per size, to start each capture from their values"
BUILD_FIRST = "Build the graph before allocating other large tensors"


def copies(
    named: list[tuple[str, torch.Tensor]], device: torch.device, fix: str = GRAPH_FIX, what: str = BUFFERS,
    whole: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor of ``named`` (name, tensor) with a copy of it: of its values, an expanded
    dimension held once (:func:`_compat.unexpanded`; :func:`_compat.copy_back` writes it back),
    unless ``whole`` (a copy to run on, of the tensor's shape). Copies that do not fit in
    ``device``'s memory raise a :class:`CaptureError` naming the largest tensors and ``fix``
    (:func:`check_fits`), the copies made so far given back."""
    on_device = [(n, t) for n, t in named if t.is_cuda]
    check_fits(on_device, device, fix=fix, what=what)
    try:
        with torch.no_grad():
            return [(t, (t if whole else _compat.unexpanded(t)).detach().clone()) for _, t in named]
    except torch.OutOfMemoryError as exc:  # (the check counted memory no copy can have: a
        # graph pool's unused blocks; the copies made so far are gone with the unfinished list)
        error = exc  # (raised after the block: the CaptureError does not carry it as context)
    # (their memory back to the device: a graph's pool cannot take it from torch's cache while
    # it captures, and a build with restore_state=False may come next)
    torch.cuda.empty_cache()
    check_fits(on_device, device, failed=True, fix=fix, what=what)
    raise error


def check_fits(
    named: list[tuple[str, torch.Tensor]], device: torch.device, failed: bool = False, fix: str = GRAPH_FIX,
    what: str = BUFFERS,
) -> None:
    """Raise a :class:`CaptureError` when copies of ``named`` (name, CUDA tensor) would not fit
    in what ``device`` has free: the driver's free memory and what torch's allocator holds
    unused (some of which a graph's pool may hold: a copy this check lets through may still
    fail; ``failed``: it did, raise). One it refuses cannot succeed. ``fix``: the error's last
    sentence."""
    need = sum(t.untyped_storage().nbytes() for _, t in named)
    if not need or device.type != "cuda":
        return
    free = torch.cuda.mem_get_info(device)[0]
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if need <= free and not failed:
        return
    big = sorted(named, key=lambda nt: -nt[1].untyped_storage().nbytes())
    listed = ", ".join(f"{n} ({_size(t.untyped_storage().nbytes())})" for n, t in big[:4])
    more = f" and {len(big) - 4} more" if len(big) > 4 else ""
    held = ", some of it held unused by graphs' memory pools" if need <= free else ""
    raise CaptureError(
        f"building the graphs copies {what}: {listed}{more}, {_size(need)} in all, "
        f"and {device} has {_size(free)} free{held}. Nothing was captured and the "
        f"module's state is as it was. {fix}"
    )


_SUM_ROW = 4096  # words summed into one number of a checksum's rows
_SUM_ROWS = 1 << 18  # rows summed at a time


def checksum(t: torch.Tensor) -> torch.Tensor | None:
    """Two int64 numbers that change when ``t``'s bytes do: its memory read as 32-bit words,
    the sums of rows of 4096 words (in 32 bits: no widened copy of ``t``, and modular sums do
    not depend on the order of the additions), added up plainly and weighted by position (a row
    moved changes the second). Bits, not values: a NaN stays a NaN's bits and hides nothing.
    Not seen: a change within a row that keeps its sum. Temporaries: at most 7 MiB. None: not
    contiguous."""
    if not t.is_contiguous() or t.layout != torch.strided:
        return None
    data = t.detach().reshape(-1).view(torch.uint8)
    whole = data.numel() - data.numel() % 4
    words = data[:whole].view(torch.int32)
    n = words.numel() - words.numel() % _SUM_ROW
    total = words[n:].long().sum() + data[whole:].long().sum()
    weighted = torch.zeros_like(total)
    matrix = words[:n].view(-1, _SUM_ROW)
    for start in range(0, matrix.shape[0], _SUM_ROWS):  # (4 GiB at a time: 7 MiB of temporaries)
        rows = matrix[start:start + _SUM_ROWS].sum(1, dtype=torch.int32).long()
        total += rows.sum()
        weighted += (rows * torch.arange(start + 1, start + rows.numel() + 1, device=t.device)).sum()
    return torch.stack([total, weighted])


def _size(nbytes: int) -> str:
    """``1.50 GiB``, or ``12 MiB`` below a GiB."""
    return f"{nbytes / _GiB:.2f} GiB" if nbytes >= _GiB else f"{nbytes / (1 << 20):.0f} MiB"
