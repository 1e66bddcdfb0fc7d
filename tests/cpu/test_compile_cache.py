"""The persistent compile cache (``compile/cache.py``) on the CPU, where Inductor compiles C++:
the key (stable across processes, changed by each ingredient), the atomic write, every kind of
bad entry (the bad bytes written here), an unusable folder, a full disk, 8 processes on one key
at once, ``tr.compile`` cold then warm in fresh processes, and ``torchreplay cache``."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx

from torchreplay import _compat
from torchreplay.cli import main
from torchreplay.compile import cache as cache_mod
from torchreplay.compile.cache import CompileCache, clear, entries, piece_key
from torchreplay.errors import CacheError

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * 3 + 1


def _traced(
    fn: Any, *args: Any, dynamic: bool | None = None, real: bool = False
) -> tuple[fx.GraphModule, list[Any]]:
    """The FX graph Dynamo hands a backend, and its example inputs: fake, with symbolic sizes,
    as the backend's pieces see them, or (``real``) the tensors Dynamo passes."""
    seen: list[tuple[fx.GraphModule, list[Any]]] = []

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        seen.append((gm, list(example_inputs) if real else values))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    return seen[0]


def _key(fn: Any, *args: Any, options: dict[str, Any] | None = None, **kw: Any) -> str:
    gm, values = _traced(fn, *args, **kw)
    return piece_key(gm, values, options or {"sizes": None}, CPU)


# --- the key ---------------------------------------------------------------------------------


KEY_SCRIPT = textwrap.dedent(
    """
    import torch
    import sys
    sys.path.insert(0, {tests!r})
    from test_compile_cache import Toy, _key
    torch.manual_seed(0)
    print("KEY", _key(Toy(), torch.randn(4, 8), dynamic=True))
    """
)


def test_the_key_is_the_same_in_every_process() -> None:
    torch.manual_seed(0)
    here = _key(Toy(), torch.randn(4, 8), dynamic=True)
    script = KEY_SCRIPT.format(tests=str(Path(__file__).parent))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "random"}
    keys = set()
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        keys |= {line.split()[1] for line in out.stdout.splitlines() if line.startswith("KEY")}
    assert keys == {here}


def test_each_ingredient_changes_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    toy = Toy()
    x = torch.randn(4, 8)
    base = _key(toy, x, dynamic=True)
    assert _key(toy, x, dynamic=True) == base  # same inputs, same key
    # Every entry below must differ from the base and from each other.
    variants = {
        "another graph": _key(lambda t: torch.relu(toy.lin(t)) * 3 + 2, x, dynamic=True),
        "a static shape": _key(toy, x, dynamic=False),
        "another width": _key(torch.nn.Linear(8, 6), x, dynamic=True),
        "another dtype": _key(toy.double(), x.double(), dynamic=True),
        "another option": _key(toy.float(), x, dynamic=True, options={"sizes": (1, 2, 4)}),
    }
    toy.float()
    gm, values = _traced(toy, x, dynamic=True)
    options = {"sizes": None}
    assert piece_key(gm, values, options, CPU) == base
    with torch._inductor.config.patch(max_autotune=True):
        variants["Inductor's config"] = piece_key(gm, values, options, CPU)
    versions = cache_mod.software_versions()
    for name in ("torch", "torch_git", "cuda", "triton"):
        monkeypatch.setattr(cache_mod, "software_versions", lambda n=name: {**versions, n: "other"})
        variants[f"another {name}"] = piece_key(gm, values, options, CPU)
    monkeypatch.setattr(cache_mod, "software_versions", lambda: versions)
    monkeypatch.setattr(cache_mod, "__version__", "9.9.9")
    variants["another torchreplay"] = piece_key(gm, values, options, CPU)
    monkeypatch.setattr(cache_mod, "__version__", cache_mod.__version__)
    monkeypatch.undo()
    for capability in ((8, 0), (9, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        variants[f"GPU {capability}"] = piece_key(gm, values, options, torch.device("cuda", 0))
    monkeypatch.undo()

    # what the compile bakes in from its context (Dynamo's graph is the same under each)
    for name, context in (
        ("bf16 autocast", lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
        ("fp16 autocast", lambda: torch.autocast("cpu", dtype=torch.float16)),
        ("no_grad", torch.no_grad),
    ):
        with context():
            variants[name] = piece_key(gm, values, options, CPU)
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 in Inductor's matmul templates
        variants["TF32 matmuls"] = piece_key(gm, values, options, CPU)
    finally:
        torch.set_float32_matmul_precision(precision)
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        variants["deterministic algorithms"] = piece_key(gm, values, options, CPU)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert piece_key(gm, values, options, CPU) == base  # (all put back)

    const = torch.tensor([1.0, 2.0])

    def with_constant(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    cgm = fx.symbolic_trace(with_constant)
    cgm.register_buffer("c", const.clone())
    with cgm.graph.inserting_before(next(iter(reversed(cgm.graph.nodes)))):
        attr = cgm.graph.get_attr("c")
    out = next(iter(reversed(cgm.graph.nodes)))
    out.args = (attr,)
    cgm.recompile()
    k1 = piece_key(cgm, [x], options, CPU)
    cgm.c.add_(1)
    variants["a constant's value"] = piece_key(cgm, [x], options, CPU)
    assert k1 != variants["a constant's value"]

    keys = list(variants.values())
    assert base not in keys, [n for n, k in variants.items() if k == base]
    assert len(set(keys)) == len(keys), variants


# --- one cache, in this process --------------------------------------------------------------


def _module() -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """The toy's Dynamo graph (static shapes) and the real tensors it takes."""
    torch.manual_seed(0)
    gm, args = _traced(Toy(), torch.randn(4, 8), dynamic=False, real=True)
    return gm, [a.detach() for a in args]


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder with the toy's entry, made once (Inductor's C++ compile takes seconds)."""
    folder = tmp_path_factory.mktemp("filled")
    gm, args = _module()
    c = CompileCache(folder)
    c.compile(gm, args, name="toy", options={}, device=CPU)
    assert [o.status for o in c.outcomes] == ["miss"]
    return folder


def _copy(filled: Path, tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "cache"
    shutil.copytree(filled, folder)
    (entry,) = (folder / "entries").iterdir()
    return folder, entry


def _run(folder: Path, strict: bool = False) -> CompileCache:
    gm, args = _module()
    c = CompileCache(folder, strict=strict)
    fn = c.compile(gm, args, name="toy", options={}, device=CPU)
    torch.testing.assert_close(fn(*args)[0], gm(*args)[0], rtol=1e-5, atol=1e-5)
    return c


def test_a_hit_loads_and_computes_the_same(filled: Path, tmp_path: Path) -> None:
    folder, _ = _copy(filled, tmp_path)
    c = _run(folder)
    (o,) = c.outcomes
    assert o.status == "hit" and o.saved_seconds > 0
    assert "cache hit" in o.line()


def test_the_write_is_atomic_and_leaves_nothing_behind(filled: Path) -> None:
    (entry,) = (filled / "entries").iterdir()
    assert sorted(p.name for p in entry.iterdir()) == ["artifact.bin", "meta.json"]
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["key"] == entry.name and meta["bytes"] == (entry / "artifact.bin").stat().st_size
    assert list((filled / "tmp").iterdir()) == []  # the temporary folder was renamed away


def test_an_interrupted_write_is_ignored_and_cleared(filled: Path, tmp_path: Path) -> None:
    folder, entry = _copy(filled, tmp_path)
    half = folder / "tmp" / f"{entry.name}.12345.deadbeef"
    half.mkdir(parents=True)
    (half / "artifact.bin").write_bytes(b"half an artifact")
    assert [o.status for o in _run(folder).outcomes] == ["hit"]
    clear(folder)
    assert not (folder / "tmp").exists() and entries(folder) == []


def _corrupt(case: str, entry: Path) -> str:
    """Damage ``entry`` as ``case`` says; return what the warning must say."""
    artifact, meta = entry / "artifact.bin", entry / "meta.json"
    data = artifact.read_bytes()
    if case == "truncated":
        artifact.write_bytes(data[: len(data) // 2])
        return "truncated"
    if case == "random bytes":
        artifact.write_bytes(os.urandom(len(data)))
        return "corrupt"
    if case == "random meta":
        meta.write_bytes(os.urandom(64))
        return "meta.json"
    if case == "another torch":
        m = json.loads(meta.read_text())
        m["torch"] = "1.0.0"
        meta.write_text(json.dumps(m))
        return "another version"
    if case == "another torchreplay":
        m = json.loads(meta.read_text())
        m["torchreplay"] = "0.0.1"
        meta.write_text(json.dumps(m))
        return "another version"
    if case == "missing artifact":
        artifact.unlink()
        return "artifact.bin is missing"
    if case == "bytes torch cannot load":
        # a whole, checksummed entry whose artifact is not one: torch's loader fails on it
        junk = b"not a CompiledArtifact" * 10
        artifact.write_bytes(junk)
        m = json.loads(meta.read_text())
        import hashlib

        m["bytes"], m["sha256"] = len(junk), hashlib.sha256(junk).hexdigest()
        meta.write_text(json.dumps(m))
        return "torch could not load"
    raise AssertionError(case)


CASES = [
    "truncated", "random bytes", "random meta", "another torch", "another torchreplay",
    "missing artifact", "bytes torch cannot load",
]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_entry_warns_once_compiles_and_is_rewritten(
    case: str, filled: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder, entry = _copy(filled, tmp_path)
    said = _corrupt(case, entry)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        c = _run(folder)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(entry) in warnings[0] and said in warnings[0], warnings[0]
    assert [o.status for o in c.outcomes] == ["bad"]
    assert [o.status for o in _run(folder).outcomes] == ["hit"]  # rewritten


@pytest.mark.parametrize("case", ["truncated", "another torch"])
def test_strict_raises_cache_error_on_a_bad_entry(case: str, filled: Path, tmp_path: Path) -> None:
    folder, entry = _copy(filled, tmp_path)
    said = _corrupt(case, entry)
    with pytest.raises(CacheError, match=said) as info:
        _run(folder, strict=True)
    assert str(entry) in str(info.value)


def test_a_folder_that_cannot_be_written_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "entries").write_text("a file where the entries folder should be")
    gm, args = _module()
    c = CompileCache(folder)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        for name in ("a", "b"):  # two pieces: one warning
            fn = c.compile(gm, args, name=name, options={}, device=CPU)
            torch.testing.assert_close(fn(*args)[0], gm(*args)[0], rtol=1e-5, atol=1e-5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot write" in warnings[0], warnings
    assert [o.status for o in c.outcomes] == ["unsaved", "unsaved"]
    with pytest.raises(CacheError, match="cannot write"):
        CompileCache(folder, strict=True).compile(gm, args, name="c", options={}, device=CPU)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root reads and writes a chmod-ed folder; the test above covers it")
def test_a_read_only_folder_warns_once(filled: Path, tmp_path: Path,
                                       caplog: pytest.LogCaptureFixture) -> None:
    folder, entry = _copy(filled, tmp_path)
    shutil.rmtree(entry)
    for p in (folder, folder / "entries", folder / "tmp", folder / "locks"):
        p.chmod(0o555)
    try:
        with caplog.at_level(logging.WARNING, logger="torchreplay"):
            c = _run(folder)
    finally:
        for p in (folder, folder / "entries", folder / "tmp", folder / "locks"):
            p.chmod(0o755)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert [o.status for o in c.outcomes] == ["unsaved"]


def test_a_full_disk_warns_and_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(artifact: Any, path: str) -> None:
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_compat, "save_artifact", full)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        c = _run(tmp_path / "cache")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "No space left" in warnings[0], warnings
    assert [o.status for o in c.outcomes] == ["unsaved"]
    assert entries(tmp_path / "cache") == []
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []


WRITER = textwrap.dedent(
    """
    import sys, time, torch, torch.fx as fx
    sys.path.insert(0, {tests!r})
    from test_compile_cache import _module, CPU
    from torchreplay.compile.cache import CompileCache
    gm, args = _module()
    while time.time() < {start}:
        time.sleep(0.005)
    c = CompileCache({folder!r})
    fn = c.compile(gm, args, name="toy", options={{}}, device=CPU)
    torch.testing.assert_close(fn(*args)[0], gm(*args)[0], rtol=1e-5, atol=1e-5)
    print("STATUS", c.outcomes[0].status)
    """
)


def test_eight_processes_on_one_key_at_once(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    script = WRITER.format(tests=str(Path(__file__).parent), start=time.time() + 8, folder=str(folder))
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(8)
    ]
    statuses = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        statuses += [line.split()[1] for line in out.splitlines() if line.startswith("STATUS")]
    assert sorted(statuses) == ["hit"] * 7 + ["miss"], statuses  # the lock: one compile
    (entry,) = entries(folder)
    assert list((folder / "tmp").iterdir()) == []
    assert [o.status for o in _run(folder).outcomes] == ["hit"]
    assert entry.meta["sha256"]


def test_a_fact_is_computed_once_then_loaded_and_a_bad_one_recomputed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # What the backend keeps per Dynamo graph (which inputs it writes): computed at the cold
    # start, read at the warm one, recomputed (one warning) when its entry is bad.
    gm, args = _module()
    folder = tmp_path / "cache"
    computed: list[int] = []

    def fact(c: CompileCache, valid=lambda v: isinstance(v, list)) -> Any:
        return c.fact(gm, args, kind="written_inputs", name="toy written", device=CPU,
                      compute=lambda: computed.append(1) or [0, 2], valid=valid)

    assert fact(CompileCache(folder)) == [0, 2] and computed == [1]
    assert fact(CompileCache(folder)) == [0, 2] and computed == [1]  # a new process's view
    (entry,) = [e for e in (folder / "entries").iterdir() if (e / cache_mod.FACT).exists()]
    assert not (entry / cache_mod.ARTIFACT).exists()
    assert [e.meta["name"] for e in entries(folder)] == ["toy written"]
    # the fact's key is not a piece's: the same graph's compiled code is another entry
    assert entry.name != piece_key(gm, args, {}, CPU)
    caplog.set_level(logging.WARNING)
    (entry / cache_mod.FACT).write_text("[9]")  # bytes no longer match meta.json
    assert fact(CompileCache(folder)) == [0, 2] and computed == [1, 1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(entry) in warnings[0] and "truncated" in warnings[0]
    caplog.clear()
    # a well-formed entry holding a value the caller refuses: recomputed, said once
    assert fact(CompileCache(folder), valid=lambda v: v == "never") == [0, 2]
    assert computed == [1, 1, 1]
    assert any("cannot use" in r.getMessage() for r in caplog.records)
    with pytest.raises(CacheError, match="truncated"):
        (entry / cache_mod.FACT).write_text("[0, 2, 7]")
        fact(CompileCache(folder, strict=True))


# --- tr.compile, cold then warm in fresh processes -------------------------------------------


START = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import torchreplay as tr
    from inductor_counter import count_inductor_compiles
    calls = count_inductor_compiles()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    def f(x):
        y = model(x)
        if y.sum() > 0:          # a Dynamo graph break: two graphs
            return y * 2
        return y - 1
    c = tr.compile(f, cache_dir={folder!r})
    with torch.no_grad():  # inference graphs: the ones the cache holds
        for n in (3, 5, 3, 5):
            x = torch.randn(n, 8)
            torch.testing.assert_close(c(x), f(x))
    print("INDUCTOR", len(calls))
    print(tr.explain(c))
    """
)


def test_tr_compile_cold_then_warm_start(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    script = START.format(folder=str(folder), tests=str(Path(__file__).parents[1]))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(out.stdout)
    cold, warm = runs
    assert "INDUCTOR 0" not in cold and "cache miss" in cold and "0 hit(s)" in cold
    assert "INDUCTOR 0" in warm, warm  # no Inductor compile at the warm start
    hits = [line for line in warm.splitlines() if "cache hit" in line]
    assert len(hits) >= 2 and "cache miss" not in warm, warm


AUTOCAST = textwrap.dedent(
    """
    import contextlib, sys, torch
    sys.path.insert(0, {tests!r})
    import torchreplay as tr
    from inductor_counter import count_inductor_compiles
    calls = count_inductor_compiles()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    c = tr.compile(model, cache_dir={folder!r})
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if {autocast!r} else contextlib.nullcontext()
    with torch.no_grad(), cast:
        for _ in range(3):
            x = torch.randn(3, 8)
            got, want = c(x), model(x)
            assert got.dtype == want.dtype, (got.dtype, want.dtype)
            torch.testing.assert_close(got, want)
    print("INDUCTOR", len(calls))
    print(tr.explain(c))
    """
)


def test_an_entry_compiled_under_autocast_is_not_loaded_without_it(tmp_path: Path) -> None:
    """A model run under bf16 autocast, then (a fresh process) without it, then under it again:
    Dynamo's graph is the same each time (autocast casts are not in it, only in the compiled
    code), so the key must say which autocast the code was compiled under: the second start
    compiles (its outputs are fp32, as eager's), the third loads the first's entry."""
    folder = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = []
    for autocast in (True, False, True):
        script = AUTOCAST.format(folder=str(folder), tests=str(Path(__file__).parents[1]), autocast=autocast)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(out.stdout)
    bf16, fp32, again = runs
    assert "cache miss" in bf16 and "cache hit" not in bf16, bf16
    assert "cache miss" in fp32 and "cache hit" not in fp32, fp32
    assert "INDUCTOR 0" in again and "cache hit" in again and "cache miss" not in again, again


def test_torchs_aot_autograd_cache_is_off_under_autocast_where_its_key_lacks_the_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11's AOT autograd cache keys only whether autocast is on: under autocast our
    Inductor compiles turn it off there (``_compat.safe_aot_cache``), and only there."""
    import torch._functorch.config as functorch_config

    from torchreplay._compat import amp

    before = functorch_config.enable_autograd_cache
    for keyed in (True, False):
        monkeypatch.setattr(amp, "_aot_cache_keys_autocast_dtype", lambda k=keyed: k)
        with amp.safe_aot_cache():
            assert functorch_config.enable_autograd_cache == before  # autocast off: as it was
        with torch.autocast("cpu", dtype=torch.bfloat16), amp.safe_aot_cache():
            assert functorch_config.enable_autograd_cache == (before and keyed)
        assert functorch_config.enable_autograd_cache == before


# --- the command line ------------------------------------------------------------------------


def test_cache_list_and_clear(filled: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, entry = _copy(filled, tmp_path)
    assert main(["cache", "list", "--dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "1 entry" in out and entry.name[:16] in out and "toy" in out
    assert main(["cache", "clear", "--dir", str(folder), "--older-than", "1d"]) == 0
    assert "removed 0 entries" in capsys.readouterr().out and entries(folder)
    assert main(["cache", "clear", "--dir", str(folder), "--older-than", "soon"]) == 2
    assert "30s, 15m" in capsys.readouterr().err
    assert main(["cache", "clear", "--dir", str(folder)]) == 0
    assert "removed 1 entry" in capsys.readouterr().out and entries(folder) == []


def test_the_default_folder_is_read_from_one_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(cache_mod.ENV_VAR, str(tmp_path / "here"))
    assert cache_mod.default_dir() == tmp_path / "here"
    monkeypatch.delenv(cache_mod.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_mod.default_dir() == tmp_path / "torchreplay"


def test_cache_dir_none_turns_it_off_and_bad_values_are_refused() -> None:
    import torchreplay as tr
    from torchreplay.compile.backend import Backend
    from torchreplay.config import CompileConfig

    assert Backend(CompileConfig(cache_dir=None)).cache is None
    assert Backend(CompileConfig(inductor=False)).cache is None
    assert "compile cache: off" in tr.explain(Backend(CompileConfig(cache_dir=None)))
    with pytest.raises(ValueError, match="cache_dir"):
        CompileConfig(cache_dir=3)  # type: ignore[arg-type]
