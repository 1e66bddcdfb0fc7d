"""Outputs out: the output policy of one graph (``checked``, ``clone``, ``static``).

Under ``checked`` (the default) each call hands out new tensors over the graph's output memory,
through an alias storage of their own that is marked stale when a later replay overwrites that
memory, so that reading an old output raises instead of returning another call's values. Making
those objects is most of what the policy costs per call, so the common case of a caller that
drops each output before the next call is cheaper: when nothing can reach the last call's
tensors, they are handed out again (:func:`_unheld`); when nothing holds the last call's storage,
it is used again (:func:`_free`).

Tensors are made in the caller's mode, as eager's outputs are: under ``torch.inference_mode``
they are inference tensors, handed out again only under it (and normal ones only outside it).
Inference tensors have no version counter, so :func:`_unheld_inference` looks at their layout
instead.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Sequence

import torch

from torchreplay import _compat
from torchreplay.core.io import byte_span

__all__ = ["Outputs"]

_Tensor = torch.Tensor
_getrefcount = sys.getrefcount
_getweakrefcount = weakref.getweakrefcount
_tensor_use_count = _compat.tensor_use_count
_storage_use_count = _compat.storage_use_count
_inference_mode = torch.is_inference_mode_enabled


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Outputs:
    """The outputs of one graph and the policy that hands them out.

    Each output leaf is one of: a constant (returned as is); an *external* tensor, one the graph
    did not allocate, like a module buffer it updates in place (returned as is, like eager); or a
    tensor in memory the graph owns (its pool or its static inputs), handed out per policy.

    Args:
        out: what ``fn`` returned during capture.
        policy: ``"checked"``, ``"clone"`` or ``"static"`` (see :class:`~torchreplay.config.GraphConfig`).
        name: the graph's name, for messages.
        owned: returns True for a tensor whose memory the graph owns.
        reuse: under ``checked``, hand the last call's tensors out again when nothing can reach
            them (see :func:`_unheld`). Only for outputs no autograd node is attached to: we
            would hold such a tensor, and with it the caller's autograd graph.
        watch: leaves whose handed tensors :meth:`held` looks at (a forward graph's saved
            activations); we keep the last call's, which holds no autograd graph (they are
            saved by the backward node, not outputs of it).
        watch_callers: leaves the caller gets that :meth:`held` looks at too (an eager
            autograd node after the graph may save one). Through weak references only: such a
            tensor carries its autograd graph, and a strong one would keep that graph, and the
            activations it saved, held for good.
        inputs: under ``checked``, the static input tensors by argument leaf (None for a
            non-tensor): an output that is one of them itself (``return x, mask``, ``x.add_(1);
            return x``) is handed out as the caller's tensor of that argument, as eagerly
            (:meth:`emit`'s ``inputs``), never as the graph's memory that the next call
            overwrites. One that is a view of one (``x[:, -1]``, ``x.view(-1)``) is the same
            view of the caller's tensor, where that tensor is laid out as the static one (else
            a view of the graph's copy, as before: checked, stale after the next call).
    """

    def __init__(
        self,
        out: Any,
        policy: str,
        name: str,
        owned: Callable[[torch.Tensor], bool],
        *,
        reuse: bool = False,
        watch: frozenset[int] = frozenset(),
        inputs: Sequence[Any] = (),
        watch_callers: frozenset[int] = frozenset(),
    ) -> None:
        leaves, spec = _compat.tree_flatten(out)
        at = {id(t): j for j, t in enumerate(inputs) if isinstance(t, _Tensor)} if policy == "checked" else {}
        #: (output leaf, argument leaf) of the outputs that are an argument itself
        self.passed = [(i, at[id(t)]) for i, t in enumerate(leaves) if id(t) in at]
        passed = {i for i, _ in self.passed}
        #: (output leaf, argument leaf, the static's dtype and strides, the view's size, stride
        #: and offset from the static's) of the outputs that are a view of an argument
        self.views = _views_of(leaves, inputs, passed) if at else []
        self.name = name
        self.static = leaves
        self.spec = spec
        if policy == "checked" and not _compat.HAS_CHECKED_OUTPUTS:
            policy = "clone"  # this torch cannot mark storages stale: fresh tensors are safe
        self.policy = policy
        self.owned_idx = [
            i for i, t in enumerate(leaves) if isinstance(t, _Tensor) and owned(t) and i not in passed
        ]
        self.is_leaf = _compat.is_leaf_treespec(spec)
        self._one_handed = self.is_leaf and not self.views  # emit returns the one handed tensor
        self._to_callers = bool(self.passed or self.views)  # (one test per call in emit)
        self._rebuild = _compat.unflattener(spec)
        # Checked policy: one alias storage per distinct owned storage, shared by the outputs
        # that view it (so y and y.view(-1) stay aliases of each other, as in eager).
        groups: dict[int, list[int]] = {}
        for i in self.owned_idx:
            groups.setdefault(_storage_key(leaves[i]), []).append(i)
        self.groups: list[tuple[int, int, list[tuple[int, dict[str, Any]]]]] = []
        #: The owned leaves' indices in the order emit makes their tensors (group by group).
        self.grouped_idx = [i for idxs in groups.values() for i in idxs]
        for ptr, idxs in groups.items():
            nbytes = leaves[idxs[0]].untyped_storage().nbytes()
            metas = [(i, _tensor_meta(leaves[i])) for i in idxs]
            self.groups.append((ptr, nbytes, metas))
        self._checked = policy == "checked" and bool(self.groups)
        # x * 1.0 copies a float exactly (an int would become a float): clones in one launch
        # Clones keep each output's strides: a saved activation Inductor laid out with padded
        # rows is asserted with them by the backward's code (``clone`` would make it dense)
        self._strided = {i for i in self.owned_idx if not _compat.dense(leaves[i])}
        self._one_launch = len(self.owned_idx) > 1 and not self._strided and all(
            leaves[i].is_floating_point() for i in self.owned_idx
        )
        self.device = leaves[self.owned_idx[0]].device if self.owned_idx else None
        self.live: list[torch.UntypedStorage] = []
        self._handles: list[int] = []  # their _compat.storage_handle, for the use counts
        self.watch = sorted(watch)
        self._watched: list[torch.Tensor] = []
        self.watch_callers = sorted(watch_callers - watch)
        self._watched_callers: list[weakref.ref[torch.Tensor]] = []
        self.reuse = reuse and _compat.HAS_USE_COUNTS
        #: Called whenever new tensors are handed out (the pool's :meth:`~Pool.on_live`).
        self.on_live: Callable[[], None] | None = None
        # With reuse: the tensors the last call handed out, and their storages' use counts when
        # nothing but those tensors and our storage object refer to them.
        self._handed: list[torch.Tensor] = []
        # They survived an invalidation because nobody could reach them: later invalidations
        # need no new look until an emit hands them out again (which tells the pool, on_live).
        self._kept = False
        self._versions: list[int] | None = []  # None: the handed tensors are inference tensors
        # What every handed tensor's layout is (they are made from the capture's metadata).
        self._layouts = [
            (meta["size"], tuple(meta["stride"]), meta["storage_offset"])
            for _, _, metas in self.groups for _, meta in metas
        ]
        self._uses = [1 + len(metas) for _, _, metas in self.groups]
        # One message per storage, naming the output (made once: invalidating costs nothing more)
        self._stale_messages = [
            f"StaleOutputError: this tensor is an output of the torchreplay graph '{name}' "
            f"({_which(metas, len(leaves), watch)}), and a later replay (of that graph, or of "
            "a graph sharing its memory pool) overwrote its memory. Call .clone() on outputs you "
            "keep across calls, or create the graph with outputs='clone' (torch.compile's "
            "backend: options={'outputs': 'clone'})."
            for _, _, metas in self.groups
        ]
        self.gone_message = (
            f"StaleOutputError: this tensor is an output of the torchreplay graph '{name}', "
            "which has been destroyed (nothing refers to it any more), and its memory was "
            "given back. Call .clone() on outputs you keep longer than the graph, or create the "
            "graph with outputs='clone'."
        )

    def invalidate(self) -> None:
        """Mark the outputs handed out by the last :meth:`emit` as stale. With ``reuse``, ones
        nobody can reach any more are kept instead, to be handed out again by the next
        :meth:`emit` (nobody can read what the overwrite left in them meanwhile)."""
        if self.live:
            if self._kept:
                return
            if self.reuse and self._unreachable():
                self._kept = True
                return
            for storage, message in zip(self.live, self._stale_messages):
                _compat.invalidate_storage(storage, message)
            self.live = []
            self._handed = []

    def _unreachable(self) -> bool:
        """:meth:`emit`'s test, in the same form (the reference counts it expects depend on it),
        in either mode."""
        handed = self._handed
        if not (handed and _getrefcount(handed[0]) == _FIRST_REFS):
            return False
        versions = self._versions
        if versions is None:
            return _unheld_inference(handed, self._layouts, self.live, self._handles, self._uses)
        return _unheld(handed, versions, self.live, self._handles, self._uses)

    def held(self) -> bool:
        """Is a tensor the last call handed out for a ``watch`` or ``watch_callers`` leaf still
        owned outside (by an autograd node that saved it, a view, ...)? Only that tensor counts,
        not others over the same memory, and not the caller's Python reference: a caller keeping
        a user output that the backward also saved does not block the next replay (that output
        is marked stale as usual). Without use counts: yes."""
        if not _compat.HAS_USE_COUNTS:
            return bool(self._watched or self._watched_callers)
        if any(_tensor_use_count(t) > 1 for t in self._watched):
            return True
        for ref in self._watched_callers:  # (a dropped tensor no C++ object holds is gone)
            t = ref()
            if t is not None and _tensor_use_count(t) > 1:
                return True
        return False

    def make_clones(self) -> None:
        """From now on hand out clones, not the pool's memory (the graph is called from
        several threads: :mod:`torchreplay.core.threads`); what was handed out is stale."""
        if self.policy == "checked":
            self.invalidate()
            self.policy = "clone"
            self._checked = False
            self._handed = []
            self._kept = False
            self.reuse = False

    def in_use(self) -> bool:
        """Does anyone else hold a tensor over the memory the last call handed out (the caller,
        an autograd node that saved it, a view)? For a graph about to go: while yes, retiring
        it would make a tensor still in use raise. Our own references to those tensors go
        first (the graph will not replay again). Without use counts: yes if any was handed."""
        if not self.live:
            return False
        if not _compat.HAS_USE_COUNTS:
            return True
        self._handed = []
        self._watched = []
        self._watched_callers = []
        return any(_storage_use_count(h) > 1 for h in self._handles)

    def retire(self, why: str | None = None) -> None:
        """The graph is being destroyed: make the outputs it handed out raise when read (their
        memory goes back to the allocator) instead of reading freed memory. ``why``: why it
        goes, for the message, when it is not that nothing refers to it any more."""
        message = self.gone_message
        if why is not None:
            message = (
                f"StaleOutputError: this tensor is an output of the torchreplay graph "
                f"'{self.name}', which was dropped ({why}). Call .clone() on outputs you keep "
                "across calls, or create the graph with outputs='clone'."
            )
        for storage in self.live:
            _compat.invalidate_storage(storage, message)
        self.live = []
        self._handed = []
        self._watched = []
        self._watched_callers = []
        # Our references to the capture's output tensors go too, so the pool's blocks are free
        # when the cache is emptied (outputs="static" callers keep theirs alive themselves).
        self.static = []
        self.groups = []
        self._checked = False

    def emit(self, inputs: Sequence[Any] = ()) -> Any:
        """Return this replay's outputs, in the captured structure, under the policy;
        ``inputs``: the call's argument leaves (the caller's tensors), for :attr:`passed`."""
        leaves = self.static
        if self._checked:
            handed = self._handed
            reuse = False
            if handed and _getrefcount(handed[0]) == _FIRST_REFS:  # the common "kept": fail fast
                versions = self._versions  # None: inference tensors, handed out under the mode
                if not _inference_mode():
                    reuse = versions is not None and _unheld(
                        handed, versions, self.live, self._handles, self._uses
                    )
                elif versions is None:
                    reuse = _unheld_inference(
                        handed, self._layouts, self.live, self._handles, self._uses
                    )
            if not reuse:
                handed = self._new_tensors()
            elif self._kept:  # kept through an invalidation: the pool counts them out again
                self._kept = False
                if self.on_live is not None:
                    self.on_live()
            if self._one_handed:  # (never watched: a runtime's outputs are a list)
                return handed[0]
            leaves = list(leaves)
            for i, t in zip(self.grouped_idx, handed):
                leaves[i] = t
        elif self.policy == "clone" and self.owned_idx:
            leaves = list(leaves)
            if self._one_launch:  # a backward's gradients: one multi-tensor launch, not one each
                for i, t in zip(self.owned_idx, _compat.foreach_clone([leaves[i] for i in self.owned_idx])):
                    leaves[i] = t
            elif self._strided:  # (Inductor's padded rows, an expansion: their very strides)
                for i in self.owned_idx:
                    leaves[i] = _compat.clone_strided(leaves[i]) if i in self._strided else leaves[i].clone()
            else:
                for i in self.owned_idx:
                    leaves[i] = leaves[i].clone()
        if self._to_callers and inputs:  # an argument returned: the caller's own tensor
            leaves = list(leaves)
            for i, j in self.passed:
                leaves[i] = inputs[j]
            for i, j, dtype, strides, size, stride, delta in self.views:  # ... or a view of it
                x = inputs[j]
                if x.dtype is dtype and x.stride() == strides:
                    leaves[i] = x.as_strided(size, stride, x.storage_offset() + delta)
        if self.watch and self.policy != "clone":  # clones are the caller's own memory
            self._watched = [leaves[i] for i in self.watch]
        if self.watch_callers and self.policy != "clone":
            self._watched_callers = [weakref.ref(leaves[i]) for i in self.watch_callers]
        if self.is_leaf:
            return leaves[0]
        return self._rebuild(leaves)

    def _new_tensors(self) -> list[torch.Tensor]:
        """New tensors over the output memory, group by group; a storage of the last call is
        used again if nothing holds it, else marked stale and replaced."""
        self._kept = False
        last = self.live
        # With reuse, our own reference to a handed tensor keeps its storage in use: only a
        # tensor someone else holds gets here, so there is no free storage to look for.
        free = _free(last, self._handles) if last and not self.reuse else ()
        live = []
        handed = []
        for k, (ptr, nbytes, metas) in enumerate(self.groups):
            if k < len(free) and free[k]:
                storage = last[k]  # no tensor over it is left: nothing to mark stale
            else:
                if k < len(last):
                    _compat.invalidate_storage(last[k], self._stale_messages[k])
                storage = _compat.alias_storage(ptr, self.device, nbytes)
            live.append(storage)
            for _, meta in metas:
                handed.append(_compat.tensor_from_storage(meta, storage))
        self.live = live
        if self.on_live is not None:
            self.on_live()
        if _storage_use_count is not None:
            self._handles = [_compat.storage_handle(s) for s in live]
        if self.reuse:
            self._handed = handed
            # Made under torch.inference_mode, as eager's would be: no version counters.
            self._versions = None if handed[0].is_inference() else [t._version for t in handed]
            if _HELD_STORAGE_REFS[0] < 0:
                del storage
                _HELD_STORAGE_REFS[0] = _loop_refcount(live)
        return handed


def _views_of(leaves: Sequence[Any], inputs: Sequence[Any], skip: set[int]) -> list[tuple[Any, ...]]:
    """:attr:`Outputs.views`: the output leaves (but ``skip``) that are views of an input."""
    by_storage = {_storage_key(t): j for j, t in enumerate(inputs) if isinstance(t, _Tensor)}
    out = []
    for i, t in enumerate(leaves):
        j = by_storage.get(_storage_key(t)) if isinstance(t, _Tensor) and i not in skip else None
        if j is not None and t.dtype is inputs[j].dtype and _within(t, inputs[j]):
            x = inputs[j]
            out.append((i, j, x.dtype, x.stride(), tuple(t.shape), t.stride(), t.storage_offset() - x.storage_offset()))
    return out


def _within(view: torch.Tensor, x: torch.Tensor) -> bool:
    """Does ``view`` read only elements of the dense ``x`` (so that it can be made over another
    tensor laid out as ``x``)?"""
    (lo, hi), (xlo, xhi) = byte_span(view), byte_span(x)
    return x.is_contiguous() and xlo <= lo and hi <= xhi


def _unheld(
    handed: list[torch.Tensor],
    versions: list[int],
    storages: list[torch.UntypedStorage],
    handles: list[int],
    uses: list[int],
) -> bool:
    """Can nobody but us reach the tensors the last call handed out, or tell them apart from
    new ones? Then they are handed out again (their memory holds this replay's values, as new
    tensors' would), which saves making a tensor and a storage and marking the old ones stale.

    For each tensor: only our list refers to its Python object (no variable, container or weak
    reference), only that object owns its TensorImpl (no autograd node saved it, no view has it
    as its base), no in-place op ran on it (its version counter, which in-place writes and
    in-place shape changes like ``unsqueeze_`` bump, is unchanged), and nothing was set on it
    (``requires_grad``, ``.grad``, an attribute). For each storage: no other tensor is over it
    (its use count is its Python object plus our tensors) and nobody else holds its Python
    object (``y.untyped_storage()`` returns it).
    """
    # One flat loop each, no zip or comprehension: this runs on every call of the common case,
    # and in Python the plain form costs a third of the general one.
    k = 0
    for t in handed:
        if (
            _getrefcount(t) != _FREE_REFS
            or t._version != versions[k]
            or _tensor_use_count(t) != 1
            or t.requires_grad
            or t.grad is not None
            or t.__dict__
            or _getweakrefcount(t)
        ):
            return False
        k += 1
    held = _HELD_STORAGE_REFS[0]
    k = 0
    for s in storages:
        if _getrefcount(s) != held or _storage_use_count(handles[k]) != uses[k]:
            return False
        k += 1
    return True


def _unheld_inference(
    handed: list[torch.Tensor],
    layouts: list[tuple[torch.Size, tuple[int, ...], int]],
    storages: list[torch.UntypedStorage],
    handles: list[int],
    uses: list[int],
) -> bool:
    """:func:`_unheld` for inference tensors (handed out under ``torch.inference_mode``), which
    have no version counter. What the counter shows there is seen otherwise: an in-place change
    of shape (``unsqueeze_``, ``t_``, ``as_strided_``) in the tensor's layout, a ``set_`` to
    other memory in the storage's use count; values written in place are the replay's to
    overwrite, as in new tensors over the same memory. The storages are :func:`_unheld`'s to
    look at (with no tensor to look at there)."""
    k = 0
    for t in handed:
        size, stride, offset = layouts[k]
        if (
            _getrefcount(t) != _FREE_REFS
            or _tensor_use_count(t) != 1
            or t.shape != size
            or t.stride() != stride
            or t.storage_offset() != offset
            or t.requires_grad  # allowed on an inference tensor under the mode
            or t.grad is not None
            or t.__dict__
            or _getweakrefcount(t)
        ):
            return False
        k += 1
    return _unheld([], [], storages, handles, uses)


def _loop_refcount(objs: list[Any]) -> int:
    """What ``sys.getrefcount`` says of the first of ``objs`` in the loops of :func:`_unheld`
    and :func:`_free` (it differs between Python versions)."""
    for o in objs:
        return _getrefcount(o)
    raise ValueError("no object to count")


def _free(storages: list[torch.UntypedStorage], handles: list[int]) -> list[bool]:
    """For each storage: does nothing but our list hold it? No tensor over its memory is left
    (its StorageImpl has one owner, its Python object) and nobody else holds that Python object
    (``y.untyped_storage()`` returns it). Then handing out a new tensor over it cannot be told
    apart from one over a new storage. A torch without use counts says no, always."""
    if not _compat.HAS_USE_COUNTS:
        return [False] * len(storages)
    free = []
    k = 0
    for s in storages:
        free.append(_getrefcount(s) == _FREE_REFS and _storage_use_count(handles[k]) == 1)
        k += 1
    return free


# What sys.getrefcount says in those loops of an object only its list holds; counted once, on a
# storage nothing else refers to.
_FREE_REFS = _loop_refcount([torch.UntypedStorage(0)])
_ONLY_IN_A_LIST = [torch.UntypedStorage(0)]
_FIRST_REFS = sys.getrefcount(_ONLY_IN_A_LIST[0])  # as emit counts handed[0]
del _ONLY_IN_A_LIST
# The same for an alias storage with tensors over it (torch may add a reference of its own to
# the Python object of a storage that tensors share): counted at the first tensors handed out.
_HELD_STORAGE_REFS = [-1]


def _which(metas: Sequence[tuple[int, dict[str, Any]]], n: int, saved: Sequence[int]) -> str:
    """Which output a storage's tensors are, for its stale message: "output 3 of 12, float32
    [2, 16, 64]" (and, for a training forward, whether autograd saved it for the backward)."""
    i, meta = metas[0]
    text = f"output {i} of {n}, {str(meta['dtype']).replace('torch.', '')} {list(meta['size'])}"
    if len(metas) > 1:
        text += f", and {len(metas) - 1} view(s) of its memory"
    if any(j in saved for j, _ in metas):
        text += ", saved for the backward"
    return text


def _tensor_meta(t: torch.Tensor) -> dict[str, Any]:
    storage = t.untyped_storage()
    return {
        "nbytes": storage.nbytes(),
        "data_ptr": storage.data_ptr(),
        "size": t.shape,
        "stride": t.stride(),
        "dtype": t.dtype,
        "device": t.device,
        "storage_offset": t.storage_offset(),
    }
