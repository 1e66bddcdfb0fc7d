"""The persistent compile cache of the backend: Inductor's code for each piece, saved on disk and
loaded by the next process instead of compiled again.

CUDA graphs cannot be saved (their addresses belong to one process), so what is saved is the
compiled code of every capturable piece: the expensive part of a start. Dynamo's trace and the
split run again at every start (seconds at most), and so does the capture.

**Entries.** One folder per key, ``<cache_dir>/entries/<key>/``, holding ``artifact.bin`` (a
``CompiledArtifact`` of ``torch._inductor.standalone_compile``) and ``meta.json`` (the versions it
was made with, its size and SHA-256, the piece's name and what its compile cost). An entry is
written in a temporary folder and renamed into place: a reader sees a whole entry or none. An
entry may instead hold ``fact.json``: a small value the backend works out from a whole Dynamo
graph before splitting it (which inputs it writes: a run on fake tensors, seconds on a large
model), keyed like a piece.

**The key** is a SHA-256 of everything the compiled code depends on: the piece's FX code (not
file paths) and the shape, stride, dtype and device of every input with the value range of each
dynamic size (a loaded artifact checks no shape guards), tensor constants by content, the
backend's options, the versions of torchreplay, torch (with its commit), CUDA and Triton,
Inductor's configuration, the GPU's compute capability, the rank where the piece holds a
collective, and what the compile bakes in from its context (``_compat.ambient``): grad mode, each
device's autocast dtype (a model run under ``torch.autocast`` has no casts in Dynamo's graph, only
in the code: without it, a bf16 entry was loaded with autocast off), the float32 matmul precision
and deterministic algorithms.

**Concurrent starts.** A miss takes a per-key file lock (``fcntl.flock``, released by the kernel
if the process dies) before compiling, then looks again: N ranks starting at once on an empty
cache compile each piece once; the others wait and load. A lock not had within
``LOCK_TIMEOUT`` seconds is given up with a warning, and the piece is compiled anyway.

**Bad entries** (truncated, random bytes, another version's, a missing artifact, a directory that
cannot be read or written, a full disk) give one warning naming the entry and what was wrong,
and the piece is compiled as if there were no cache (the entry rewritten where possible). With
``strict=True`` they raise :class:`~torchreplay.errors.CacheError` instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx

from torchreplay import _compat
from torchreplay._version import __version__
from torchreplay.errors import CacheError

__all__ = [
    "ENV_VAR",
    "CompileCache",
    "Entry",
    "Outcome",
    "clear",
    "default_dir",
    "entries",
    "parse_age",
    "piece_key",
]

log = logging.getLogger(__name__)

#: The environment variable that overrides the default cache folder (read only in default_dir).
ENV_VAR = "TORCHREPLAY_CACHE_DIR"
#: The layout of an entry; a change makes every old key a miss.
FORMAT = 1
#: Seconds a miss waits for another process compiling the same piece.
LOCK_TIMEOUT = 600.0
ARTIFACT = "artifact.bin"  # a piece's compiled code
FACT = "fact.json"  # a small value worked out from a graph (which inputs it writes)
_COLLECTIVES = ("c10d", "_c10d_functional", "torch.distributed")
_UNREADABLE = "cannot be read"


def software_versions() -> dict[str, str]:
    """torch (with its git commit), CUDA and Triton versions, for the cache key. Triton's is
    read from the installed package's metadata (importing Triton costs a second)."""
    from importlib import metadata

    triton = ""
    for dist in ("triton", "pytorch-triton"):
        try:
            triton = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    return {
        "torch": torch.__version__,
        "torch_git": str(getattr(torch.version, "git_version", "")),
        "cuda": str(torch.version.cuda),
        "triton": triton,
    }


def default_dir() -> Path:
    """``$TORCHREPLAY_CACHE_DIR``, else ``torchreplay`` under the user's cache folder
    (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchreplay"


@dataclasses.dataclass
class Outcome:
    """What the cache did for one piece, for ``tr.explain``.

    ``status``: ``"hit"`` (loaded, not compiled), ``"miss"`` (compiled and saved), ``"unsaved"``
    (compiled; nothing saved: the reason says why), ``"bad"`` (an entry was there but unusable;
    compiled again and rewritten where possible).
    """

    name: str
    status: str
    key: str
    seconds: float
    saved_seconds: float = 0.0
    reason: str = ""

    def line(self) -> str:
        what = {
            "hit": f"cache hit: loaded in {self.seconds:.2f} s (its compile took "
            f"{self.saved_seconds:.2f} s)",
            "miss": f"cache miss: compiled in {self.seconds:.2f} s, saved",
            "unsaved": f"compiled in {self.seconds:.2f} s, not cached: {self.reason}",
            "bad": f"bad cache entry ({self.reason}): compiled again in {self.seconds:.2f} s",
        }[self.status]
        return f"{self.name}: {what} [{self.key[:12]}]"


@dataclasses.dataclass(frozen=True)
class Entry:
    """An entry on disk, for ``torchreplay cache list``."""

    key: str
    path: Path
    meta: Mapping[str, Any]
    bytes: int
    created: float

    def line(self, now: float) -> str:
        """``"3f2a...  graph 0 piece 1  1.2 MB  2.0 h old  torch 2.11.0  compile 8.31 s"``."""
        m = self.meta
        if not m:
            return f"{self.key[:16]}  (no readable meta.json: a bad entry)  {self.bytes / 1e6:.1f} MB"
        return (
            f"{self.key[:16]}  {m.get('name', '?')}  {self.bytes / 1e6:.1f} MB  "
            f"{(now - self.created) / 3600:.1f} h old  torch {m.get('torch', '?')}  "
            f"compile {float(m.get('compile_seconds', 0)):.2f} s"
        )


def piece_key(
    module: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any],
    device: torch.device | None,
    contents: bool = True,
) -> str:
    """The cache key of one piece: a SHA-256 over everything its compiled code depends on.
    ``contents=False``: tensor constants by description only, not by content (for a fact that
    does not depend on their values)."""
    code = module.code
    parts: dict[str, Any] = {
        "format": FORMAT,
        "torchreplay": __version__,
        "software": software_versions(),
        "inductor_config": _compat.inductor_config_hash(),
        "options": {k: _plain(v) for k, v in sorted(options.items())},
        "code": code,
        "inputs": [_describe(v) for v in example_inputs],
        "ranges": _compat.shape_ranges(example_inputs),
        "constants": _constants(module, contents),
        "device": _device(device),
        "ambient": _compat.ambient(),  # (grad mode, autocast, matmul precision: in the code)
    }
    if any(c in code for c in _COLLECTIVES) and torch.distributed.is_available() \
            and torch.distributed.is_initialized():
        parts["rank"] = torch.distributed.get_rank()
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # an op object: its qualified name


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {
            "shape": [str(s) for s in value.shape],
            "stride": [str(s) for s in value.stride()],
            "dtype": str(value.dtype),
            "device": value.device.type,
            "requires_grad": value.requires_grad,
            "static": _compat.is_static_input(value),
        }
    if isinstance(value, torch.SymInt):
        return f"SymInt {_compat.symbol_of(value)}"
    return _plain(value)


def _constants(module: fx.GraphModule, contents: bool = True) -> list[Any]:
    """Tensor attributes the graph reads (``get_attr``), by content: Inductor may bake them in."""
    out = []
    for node in module.graph.nodes:
        if node.op != "get_attr":
            continue
        value: Any = module
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        if isinstance(value, torch.Tensor):
            digest = ""
            if contents and value.numel():
                data = value.detach().contiguous().cpu()
                digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()
            out.append([str(node.target), _describe(value), digest])
        elif isinstance(value, fx.GraphModule):
            out.append([str(node.target), value.code])
        else:
            out.append([str(node.target), _plain(value)])
    return out


def _device(device: torch.device | None) -> Any:
    if device is None or device.type != "cuda":
        return device.type if device is not None else None
    return {"type": "cuda", "capability": list(torch.cuda.get_device_capability(device))}


class CompileCache:
    """The cache in one folder. ``compile(...)`` loads a piece's code or compiles and saves it.

    Args:
        directory: the cache folder (created on first write).
        strict: a bad entry or an unusable folder raises :class:`CacheError` instead of a
            warning and a compile.
    """

    def __init__(self, directory: str | os.PathLike[str], strict: bool = False) -> None:
        self.directory = Path(directory).expanduser()
        self.strict = strict
        self.outcomes: list[Outcome] = []
        #: why reading or writing stopped (an unreadable or read-only folder, a full disk):
        #: said once, then not tried again in this process
        self.read_failure = ""
        self.write_failure = ""

    def __repr__(self) -> str:
        return f"CompileCache({str(self.directory)!r}, strict={self.strict})"

    def compile(
        self,
        module: fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        name: str,
        options: Mapping[str, Any],
        device: torch.device | None,
    ) -> Callable[..., Any]:
        """Inductor's code for ``module``: loaded from the cache, or compiled (then saved).
        Inductor's own errors propagate (the caller decides what runs instead)."""
        start = time.perf_counter()
        key = piece_key(module, example_inputs, options, device)
        if self.read_failure:
            return self._compile(module, example_inputs, name, key, start, None)
        fn, problem = self._load(key)
        if fn is None and problem is None:
            with self._locked(key):  # another process may be writing it: wait, look again
                fn, problem = self._load(key)
                if fn is None:
                    return self._compile(module, example_inputs, name, key, start, problem)
        if fn is None:
            return self._compile(module, example_inputs, name, key, start, problem)
        meta = _read_meta(self._entry(key)) or {}
        saved = float(meta.get("compile_seconds", 0.0))
        seconds = time.perf_counter() - start
        self.outcomes.append(Outcome(name, "hit", key, seconds, saved_seconds=saved))
        log.info("torchreplay: %s loaded from the compile cache (%s)", name, key[:12])
        return fn

    def _compile(
        self, module: fx.GraphModule, example_inputs: Sequence[Any], name: str, key: str,
        start: float, problem: str | None,
    ) -> Callable[..., Any]:
        if problem:
            problem = self._bad(key, problem)
        artifact = _compat.standalone_compile(module, example_inputs)
        seconds = time.perf_counter() - start
        reason = self._save(key, artifact, name, seconds)
        status = "bad" if problem else ("unsaved" if reason else "miss")
        self.outcomes.append(Outcome(name, status, key, seconds, reason=problem or reason))
        return artifact

    def _entry(self, key: str) -> Path:
        return self.directory / "entries" / key

    def _load(self, key: str) -> tuple[Any, str | None]:
        """``(artifact, None)``; ``(None, None)`` for no entry; ``(None, what is wrong)``."""
        artifact, problem = self._read(key, ARTIFACT)
        if artifact is None:
            return None, problem
        try:
            return _compat.load_artifact(str(artifact)), None
        except Exception as exc:  # torch's loader: any error means "not usable"
            return None, f"torch could not load the artifact: {type(exc).__name__}: {exc}"

    def _read(self, key: str, filename: str) -> tuple[Path | None, str | None]:
        """The entry's ``filename``, checked against its ``meta.json`` (versions, byte count,
        SHA-256): ``(path, None)``; ``(None, None)`` for no entry; ``(None, what is wrong)``."""
        path = self._entry(key)
        try:
            if not path.exists():
                return None, None
            meta_path = path / "meta.json"
            try:
                meta = json.loads(meta_path.read_text())
            except FileNotFoundError:
                return None, "meta.json is missing"
            except (ValueError, UnicodeDecodeError) as exc:
                return None, f"meta.json is not valid JSON ({exc})"
            wrong = _incompatible(meta, key)
            if wrong:
                return None, wrong
            target = path / filename
            try:
                data = target.read_bytes()
            except FileNotFoundError:
                return None, f"{filename} is missing"
            if len(data) != meta.get("bytes"):
                return None, f"{filename} is truncated or grown: {len(data)} bytes, " \
                    f"{meta.get('bytes')} written"
            if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
                return None, f"{filename} is corrupt: its SHA-256 differs from the one written"
        except OSError as exc:
            return None, f"{_UNREADABLE}: {exc}"
        return target, None

    def _bad(self, key: str, problem: str) -> str | None:
        """Say once what is wrong (or raise, when strict); return the problem, or None when it
        is the folder's (unreadable: the cache is off for the rest of the process)."""
        if problem.startswith(_UNREADABLE):
            message = f"torchreplay: compile cache folder {self.directory} {problem}"
            if self.strict:
                raise CacheError(message)
            log.warning("%s; running without the cache in this process", message)
            self.read_failure = self.write_failure = problem
            return None
        message = f"torchreplay: compile cache entry {self._entry(key)}: {problem}"
        if self.strict:
            raise CacheError(message + " (cache_strict=True; clear it with `torchreplay cache clear`)")
        log.warning("%s; computing it again and rewriting the entry", message)
        return problem

    def _save(self, key: str, artifact: Any, name: str, seconds: float) -> str:
        """Write the entry atomically; return why nothing was saved ("" when saved)."""
        if not _compat.artifact_saveable(artifact):
            return "torch left nothing to save (a graph it cannot serialise; Inductor's caches off?)"
        return self._write(key, ARTIFACT, lambda path: _compat.save_artifact(artifact, str(path)),
                           name, seconds)

    def _write(self, key: str, filename: str, write: Callable[[Path], None], name: str,
               seconds: float) -> str:
        """Write ``filename`` (by ``write(path)``) and its ``meta.json`` in a temporary folder
        and rename it into place; return why nothing was saved ("" when saved)."""
        if self.write_failure:
            return self.write_failure
        tmp = self.directory / "tmp" / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            write(tmp / filename)
            data = (tmp / filename).read_bytes()
            meta = {
                "format": FORMAT,
                "key": key,
                "name": name,
                "torchreplay": __version__,
                **software_versions(),
                "compile_seconds": round(seconds, 3),
                "created": time.time(),
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
            _write(tmp / "meta.json", json.dumps(meta, indent=1).encode())
            _publish(tmp, self._entry(key))
            return ""
        except Exception as exc:  # a full disk, a read-only folder, torch's save
            message = f"torchreplay: cannot write compile cache entry {self._entry(key)}: {exc}"
            if self.strict:
                raise CacheError(message) from exc
            log.warning(
                "%s; running without saving (nothing more is written to %s in this process)",
                message, self.directory,
            )
            self.write_failure = f"the cache folder cannot be written: {exc}"
            return self.write_failure
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def fact(
        self,
        module: fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        kind: str,
        name: str,
        device: torch.device | None,
        compute: Callable[[], Any],
        valid: Callable[[Any], bool] = lambda value: True,
    ) -> Any:
        """A small JSON value worked out from ``module`` (``kind`` names what: which inputs it
        writes), loaded from its entry or computed by ``compute()`` and saved. Keyed like a
        piece, with ``kind`` among the options; a bad entry (or a value ``valid`` refuses) is
        said once and computed again, as for compiled code."""
        start = time.perf_counter()
        key = piece_key(module, example_inputs, {"fact": kind}, device, contents=False)
        problem = None
        if not self.read_failure:
            path, problem = self._read(key, FACT)
            if path is not None:
                try:
                    value = json.loads(path.read_text())
                    if valid(value):
                        return value
                    problem = f"{FACT} holds a value torchreplay cannot use: {value!r:.80}"
                except (OSError, ValueError, UnicodeDecodeError) as exc:
                    problem = f"{FACT} cannot be read: {exc}"
            if problem:
                self._bad(key, problem)
        value = compute()
        self._write(key, FACT, lambda p: p.write_text(json.dumps(value)), name,
                    time.perf_counter() - start)
        return value

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        """Hold the key's file lock, where the folder and the platform allow one."""
        try:
            import fcntl
        except ImportError:  # no flock (Windows): concurrent writers still end with one entry
            yield
            return
        locks = self.directory / "locks"
        try:
            locks.mkdir(parents=True, exist_ok=True)
            fd = os.open(locks / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield  # a read-only folder: the write will say so
            return
        held = False
        try:
            deadline = time.monotonic() + LOCK_TIMEOUT
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning(
                            "torchreplay: waited %.0f s for another process compiling cache "
                            "entry %s; compiling it here too", LOCK_TIMEOUT, key[:12],
                        )
                        break
                    time.sleep(0.05)
                except OSError:  # a file system without locks
                    break
            yield
        finally:
            if held:
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _incompatible(meta: Any, key: str) -> str:
    if not isinstance(meta, dict):
        return "meta.json holds no entry description"
    here = {"format": FORMAT, "torchreplay": __version__, **software_versions()}
    for name in ("format", "torchreplay", "torch", "torch_git", "cuda", "triton"):
        if meta.get(name) != here[name]:
            return (
                f"made with {name} {meta.get(name)!r}, this process has {here[name]!r} "
                "(an entry from another version)"
            )
    if meta.get("key") != key:
        return f"it describes key {str(meta.get('key'))[:12]}, not this one"
    return ""


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished folder ``tmp`` into place. An existing entry (a bad one, or one another
    process just wrote) is moved aside first; if another writer wins the race, theirs stays."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, final)
        return
    except OSError:
        if not final.exists():
            raise
    aside = final.parent.parent / "tmp" / f"old.{final.name}.{uuid.uuid4().hex[:8]}"
    with contextlib.suppress(OSError):
        os.rename(final, aside)
    with contextlib.suppress(OSError):
        os.rename(tmp, final)  # lost to a concurrent writer: theirs is as good
    shutil.rmtree(aside, ignore_errors=True)


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def entries(directory: str | os.PathLike[str]) -> list[Entry]:
    """The entries in a cache folder, oldest first (unreadable ones included, with empty meta)."""
    root = Path(directory).expanduser() / "entries"
    out = []
    if not root.is_dir():
        return out
    for path in root.iterdir():
        meta = _read_meta(path) or {}
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if path.is_dir() else 0
        created = float(meta.get("created", path.stat().st_mtime))
        out.append(Entry(path.name, path, meta, size, created))
    return sorted(out, key=lambda e: e.created)


def parse_age(text: str) -> float:
    """``"30s"``, ``"15m"``, ``"12h"``, ``"7d"`` (or plain seconds) -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    scale = units.get(text[-1:], None)
    number = text[:-1] if scale else text
    try:
        value = float(number) * (scale or 1)
    except ValueError:
        raise ValueError(f"expected an age such as 30s, 15m, 12h or 7d, got {text!r}") from None
    if value < 0:
        raise ValueError(f"an age cannot be negative, got {text!r}")
    return value


def clear(directory: str | os.PathLike[str], older_than: float | None = None) -> list[Entry]:
    """Remove entries (those made more than ``older_than`` seconds ago, or all), leftovers of
    interrupted writes, and unused locks. Each entry is renamed aside before it is deleted, so
    a process reading it at that moment sees it whole or not at all. Returns what was removed."""
    root = Path(directory).expanduser()
    now = time.time()
    removed = []
    for entry in entries(root):
        if older_than is not None and now - entry.created < older_than:
            continue
        aside = root / "tmp" / f"old.{entry.key}.{uuid.uuid4().hex[:8]}"
        aside.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(entry.path, aside)
        except OSError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
        removed.append(entry)
    if older_than is None:
        shutil.rmtree(root / "tmp", ignore_errors=True)
    return removed
