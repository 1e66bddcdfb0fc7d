"""Run a function on N ranks (one spawned process each, a real process group) and collect what
each returned or raised. Bounded: a rank that does not finish within ``timeout`` seconds is
killed and reported as ``"hung"``, so a test of a hang fails instead of hanging.

Workers are module-level functions ``fn(rank, world, *args)`` of an importable module (this one,
or a test module on ``sys.path``); they run after ``init_process_group(backend)``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(
    rank: int, world: int, port: int, backend: str, fn: Callable[..., Any], args: tuple, q: Any,
    stderr_dir: str | None = None,
) -> None:
    if stderr_dir is not None:  # everything this process writes to fd 2, NCCL's C++ included
        fd = os.open(os.path.join(stderr_dir, f"rank{rank}.err"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        os.close(fd)
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
        )
        out = fn(rank, world, *args)
        q.put((rank, "ok", out))
    except BaseException as exc:  # reported to the parent, which asserts on it
        q.put((rank, "raised", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:  # a teardown test destroys (or keeps) the group itself
            if dist.is_initialized() and os.environ.get("TR_KEEP_GROUP") != "1":
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    exits: list[int | None] | None = None,
    stderr_dir: str | None = None,
) -> list[tuple[str, Any]]:
    """``[(status, value)]`` per rank: ``("ok", returned)``, ``("raised", "Type: message ...")``
    or ``("hung", None)``. ``exits`` receives each process's exit code (``None``: it did not
    exit within 30 s of reporting, and was killed). With ``stderr_dir``, each rank's standard
    error (to its exit) goes to ``rank<N>.err`` there."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_main, args=(r, world, port, backend, fn, args, q, stderr_dir), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = timeout
    try:
        while len(results) < world:
            rank, status, value = q.get(timeout=deadline)
            results[rank] = (status, value)
    except queue.Empty:
        pass
    for p in procs:
        p.join(timeout=30)
        code = p.exitcode
        if p.is_alive():
            code = None
            p.kill()
            p.join()
        if exits is not None:
            exits.append(code)
    return [results.get(r, ("hung", None)) for r in range(world)]
