"""Which ``nn.DataParallel`` replica of a module is calling the module's forward.

``nn.DataParallel`` (and Hugging Face's ``Trainer`` on a machine with several GPUs when not
launched by ``torchrun``) makes a replica of every module at each call
(``Module._replicate_for_data_parallel``: a new module sharing the original's ``__dict__`` shallowly,
marked ``_is_replica``, its weights copies on the replica's GPU). A forward the module holds as an
attribute (a graph: ``tr.make_graphed_callables`` puts one there, as torch's tool does) is therefore
the replica's forward too, and a call of it does not say which module called. torch passes the
module only as the ``self`` of ``Module._call_impl``, so that frame is read: a private detail. A torch whose ``_call_impl`` has another
shape finds no replica, and the call goes on as the original module's.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

__all__ = ["replica_calling"]

#: the code of ``_call_impl`` (with hooks it runs the forward from ``inner``, which it defines and
#: calls: its own frame is then one further up)
_CALL = torch.nn.Module._call_impl.__code__
_DEPTH = 12  # frames looked at: a graph's eager path is a few calls below the module's call


def replica_calling(forward: Any) -> torch.nn.Module | None:
    """The replica (``_is_replica``) whose call is running ``forward`` as its own forward: the first
    ``Module.__call__`` up the stack, when that module is a replica holding ``forward``; else None."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(_DEPTH):
        if frame is None:
            return None
        if frame.f_code is _CALL:
            module = frame.f_locals.get("self")
            if (isinstance(module, torch.nn.Module) and getattr(module, "_is_replica", False)
                    and module.__dict__.get("forward") is forward):
                return module
            return None
        frame = frame.f_back
    return None
