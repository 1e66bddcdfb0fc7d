"""The copy into a static input as the graph's own first node, its source set per call.

A replay of a hand-written graph launches a copy (``static.copy_(x)``), then the graph: on an
H200 the copy's launch costs 6 us of host time, more than the graph's. Recorded instead as a
device-to-device memcpy at the start of the capture, the copy is part of the graph, and each
call only points the node at the caller's tensor (``cuGraphExecMemcpyNodeSetParams``: 1.5 us,
and nothing when the caller passes the same tensor again). A launch already queued keeps the
source it was launched with (the driver's contract for updating an executable graph), so the
next call may repoint the node while the last replay still runs.

Torch has no way to change a node of an instantiated graph, so this calls the CUDA driver
through ``ctypes``: ``libcuda.so.1``, which every CUDA process has loaded, and whose symbols and
structures are stable across CUDA versions (the ``_v2`` names are the ones its headers map to).
The node is found in the graph's template, which torch keeps only for a graph made with
``CUDAGraph(keep_graph=True)`` (torch >= 2.8, with ``raw_cuda_graph`` and ``instantiate``; pytorch#155164).
Where any of this is missing, :func:`available` is False and callers copy with a launch, as
before: correct, a few microseconds slower.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import torch

__all__ = ["CopyNode", "available", "bind", "graph", "node_count", "record"]

_MEMORYTYPE_DEVICE = 2  # CU_MEMORYTYPE_DEVICE
_NODE_MEMCPY = 1  # CU_GRAPH_NODE_TYPE_MEMCPY
_vp, _size = ctypes.c_void_p, ctypes.c_size_t


class _Memcpy3D(ctypes.Structure):
    """``CUDA_MEMCPY3D`` (cuda.h), the parameters of a memcpy node."""

    _fields_ = [
        ("srcXInBytes", _size), ("srcY", _size), ("srcZ", _size), ("srcLOD", _size),
        ("srcMemoryType", ctypes.c_int), ("srcHost", _vp), ("srcDevice", ctypes.c_uint64),
        ("srcArray", _vp), ("reserved0", _vp), ("srcPitch", _size), ("srcHeight", _size),
        ("dstXInBytes", _size), ("dstY", _size), ("dstZ", _size), ("dstLOD", _size),
        ("dstMemoryType", ctypes.c_int), ("dstHost", _vp), ("dstDevice", ctypes.c_uint64),
        ("dstArray", _vp), ("reserved1", _vp), ("dstPitch", _size), ("dstHeight", _size),
        ("WidthInBytes", _size), ("Height", _size), ("Depth", _size),
    ]


_driver: list[Any] = []  # [libcuda or None], loaded at the first :func:`available`


def _load() -> Any:
    """``libcuda.so.1`` with the signatures used here, or None."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, _size, _vp]
        cu.cuGraphGetNodes.argtypes = [_vp, ctypes.POINTER(_vp), ctypes.POINTER(_size)]
        cu.cuGraphNodeGetType.argtypes = [_vp, ctypes.POINTER(ctypes.c_int)]
        cu.cuGraphMemcpyNodeGetParams.argtypes = [_vp, ctypes.POINTER(_Memcpy3D)]
        cu.cuGraphExecMemcpyNodeSetParams.argtypes = [_vp, _vp, ctypes.POINTER(_Memcpy3D), _vp]
        cu.cuGraphNodeSetEnabled.argtypes = [_vp, _vp, ctypes.c_uint]
        cu.cuCtxGetCurrent.argtypes = [ctypes.POINTER(_vp)]
    except (OSError, AttributeError):  # no driver library, or one without these calls
        return None
    return cu


def available() -> bool:
    """Can a graph's copy-in be its own node here: a CUDA driver with the calls, and a torch
    that keeps a graph's template (``keep_graph=True``) and hands out its handles?"""
    if not _driver:
        graphs = torch.cuda.CUDAGraph
        keeps = all(hasattr(graphs, n) for n in ("raw_cuda_graph", "raw_cuda_graph_exec", "instantiate"))
        _driver.append(_load() if keeps and torch.cuda.is_available() else None)
    return _driver[0] is not None


def graph(keep: bool) -> torch.cuda.CUDAGraph:
    """A new graph; with ``keep``, one whose template outlives its instantiation (the copy
    nodes are found in it, and their handles stay valid while the graph lives)."""
    return torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()


def record(statics: Sequence[torch.Tensor], spares: Sequence[torch.Tensor], stream: torch.cuda.Stream) -> None:
    """During a capture, before anything else: record a copy of each static buffer into its
    spare (dense, same size) on the capturing ``stream``: the graph's first nodes. Recorded
    from the buffer, not into it, so that a node :func:`bind` could not find does no harm (it
    copies the buffer into a spare nobody reads); a bound one is pointed into the buffer."""
    cu = _driver[0]
    for static, spare in zip(statics, spares, strict=True):
        rc = cu.cuMemcpyDtoDAsync_v2(spare.data_ptr(), static.data_ptr(), static.nbytes, stream.cuda_stream)
        if rc:
            raise RuntimeError(f"cuMemcpyDtoDAsync failed while capturing (CUresult {rc})")


def _count(template: int) -> int:
    n = _size(0)
    return 0 if _driver[0].cuGraphGetNodes(template, None, ctypes.byref(n)) else n.value


def _nodes(template: int) -> Any:
    """The template's nodes (in the order they were made, the driver's, which :func:`bind`
    only takes as a hint)."""
    n = _size(_count(template))
    nodes = (_vp * n.value)()
    if not n.value or _driver[0].cuGraphGetNodes(template, nodes, ctypes.byref(n)):
        return ()
    return nodes[: n.value]


def node_count(g: torch.cuda.CUDAGraph) -> int:
    """How many nodes the ended capture of ``g`` (made with ``keep=True``) recorded."""
    return _count(g.raw_cuda_graph())


class CopyNode:
    """One recorded copy of an instantiated graph: off until :meth:`point` gives it a source.

    Off, the graph reads the static buffer as it stands (the caller copied into it, or passed
    it); on, each launch first copies ``nbytes`` from the last source pointed at. The caller
    keeps one rule: before every launch, each node is pointed at this call's tensor or turned
    off, so that no launch reads a tensor of an earlier call.
    """

    __slots__ = ("_exec", "_node", "_params", "_ref", "_ctx", "_set", "_enable", "dst", "width", "source")

    def __init__(self, exe: int, node: int, params: _Memcpy3D, ctx: int, static: int) -> None:
        cu = _driver[0]
        self._exec, self._node, self._ctx = exe, node, ctx
        self._params = params
        params.dstDevice = static  # (recorded into a spare: pointed, it copies into the buffer)
        self._ref = ctypes.byref(params)
        self._set = cu.cuGraphExecMemcpyNodeSetParams
        self._enable = cu.cuGraphNodeSetEnabled
        #: the static buffer's address, and the bytes recorded (what a call copies by default)
        self.dst = static
        self.width: int = params.WidthInBytes
        #: the address the node copies from, 0 while it is off (as :func:`bind` hands it out)
        self.source = 0

    def point(self, ptr: int, nbytes: int = 0) -> bool:
        """Make the next launches copy from device address ``ptr`` (a dense tensor on the static
        buffer's device): ``nbytes`` of it (a call's rows of a size's buffer; default: what was
        recorded). False when the driver refused: the node is off and the caller copies."""
        if not ptr:  # (no memory: a zero-size or efficient-zero tensor) copied by the caller
            self.off()
            return False
        params = self._params
        width = nbytes or self.width
        if ptr == self.source and width == params.WidthInBytes:
            return True
        if ptr == self.dst:  # the static buffer itself (or a view of its start): nothing to copy
            self.off()
            return True
        params.srcDevice = ptr
        params.WidthInBytes = width
        if self._set(self._exec, self._node, self._ref, self._ctx):
            self.off()
            return False
        if not self.source and self._enable(self._exec, self._node, 1):
            return False  # (still off)
        self.source = ptr
        return True

    def off(self) -> None:
        """Launch without the copy: the static buffer holds the call's values already."""
        if self.source:
            rc = self._enable(self._exec, self._node, 0)
            if rc:  # the node would copy an old call's tensor: no replay may run
                raise RuntimeError(f"cuGraphNodeSetEnabled failed (CUresult {rc}): the graph cannot be replayed")
            self.source = 0


def bind(
    g: torch.cuda.CUDAGraph, statics: Sequence[torch.Tensor], spares: Sequence[torch.Tensor]
) -> list[CopyNode] | None:
    """The :class:`CopyNode` of each copy :func:`record` put into ``g`` (instantiated, made
    with ``keep=True``), each off; None when one is not found: the graph then copies each
    static buffer into its spare at every replay, and the spares must live as long as it."""
    cu = _driver[0]
    wanted = {(t.data_ptr(), s.data_ptr(), t.nbytes) for t, s in zip(statics, spares, strict=True)}
    found: dict[tuple[int, int, int], tuple[int, _Memcpy3D]] = {}
    for node in _nodes(g.raw_cuda_graph()):  # (the copies were made first: found first)
        kind = ctypes.c_int(-1)
        if cu.cuGraphNodeGetType(node, ctypes.byref(kind)) or kind.value != _NODE_MEMCPY:
            continue
        params = _Memcpy3D()
        if cu.cuGraphMemcpyNodeGetParams(node, ctypes.byref(params)):
            continue
        key = (params.srcDevice, params.dstDevice, params.WidthInBytes)
        if key in wanted and params.srcMemoryType == params.dstMemoryType == _MEMORYTYPE_DEVICE:
            found[key] = (node, params)
            if len(found) == len(wanted):
                break
    ctx = _vp()  # the graph's device's context, whichever device is current (several GPUs)
    with torch.cuda.device(statics[0].device):
        if cu.cuCtxGetCurrent(ctypes.byref(ctx)) or not ctx.value:
            return None
    exe = g.raw_cuda_graph_exec()
    hits = [found.get((t.data_ptr(), s.data_ptr(), t.nbytes)) for t, s in zip(statics, spares, strict=True)]
    if any(hit is None for hit in hits):
        return None
    nodes = []
    for (node, params), static in zip(hits, statics):  # type: ignore[misc]
        if cu.cuGraphNodeSetEnabled(exe, node, 0):
            return None  # (this one and the next still copy into their spares)
        nodes.append(CopyNode(exe, node, params, ctx.value, static.data_ptr()))
    return nodes
