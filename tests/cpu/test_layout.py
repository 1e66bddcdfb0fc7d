"""The package's architecture, checked: layers import only downwards (lazy imports included), no
import circle, no module over ~600 lines, and the library never imports the benchmarks.

Read from the source with ``ast``: every ``import`` statement counts, wherever it is (a function
body, an ``if``), because a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "torchreplay"

# The layers, lowest first. A module may import its own layer (inside one package) or lower ones.
# sizes/, training/ and pieces/ are side by side: none imports another. compile/ builds on pieces/.
LAYERS: list[tuple[str, ...]] = [
    ("torchreplay._version", "torchreplay._compat", "torchreplay.errors", "torchreplay.config", "torchreplay.stats",
     "torchreplay.findings"),
    ("torchreplay.check",),
    ("torchreplay.distributed",),  # collectives and rank agreement: no graphs in here
    ("torchreplay.core",),
    ("torchreplay.sizes", "torchreplay.training", "torchreplay.pieces"),
    ("torchreplay.compile", "torchreplay.breaks"),
    ("torchreplay.api",),  # tr.graph: one shape, sizes or breaks
    ("torchreplay",),  # __init__: the public names
    ("torchreplay.bench",),
    ("torchreplay.cli",),
    ("torchreplay.__main__",),
]
# Built-in models are example user code: they import nothing of the library.
STANDALONE = ("torchreplay.models",)
MAX_LINES = 610


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _module_names() -> set[str]:
    return set(MODULES) if "MODULES" in globals() else set(_modules())


def _imports(name: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from torchreplay import training` imports the subpackage torchreplay.training;
            # `from torchreplay.core.io import Inputs` imports the module torchreplay.core.io.
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in _module_names() else mod)
    return {m for m in found if m == "torchreplay" or m.startswith("torchreplay.")}


MODULES = _modules()


def _resolve(target: str) -> str | None:
    """The module that ``target`` names (a name imported from a module resolves to the module)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _layer(module: str) -> tuple[int, str]:
    best: tuple[int, str] | None = None
    for rank, group in enumerate(LAYERS):
        for prefix in group:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (rank, prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


GRAPH = {
    name: {r for t in _imports(name, path) if (r := _resolve(t)) and r != name}
    for name, path in MODULES.items()
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_go_down(module: str) -> None:
    if module.startswith(STANDALONE):
        others = {t for t in GRAPH[module] if not t.startswith(STANDALONE)}
        assert not others, f"{module} (a built-in model) imports the library: {others}"
        return
    rank, group = _layer(module)
    for target in GRAPH[module]:
        if target.startswith(STANDALONE):
            continue
        trank, tgroup = _layer(target)
        assert trank < rank or tgroup == group, (
            f"{module} (layer {rank}: {group}) imports {target} (layer {trank}: {tgroup})"
        )


def test_library_never_imports_bench() -> None:
    library = [m for m in MODULES if _layer(m)[0] < _layer("torchreplay.bench")[0]]
    offenders = {m: t for m in library for t in GRAPH[m] if t.startswith("torchreplay.bench")}
    assert not offenders


def test_no_import_circle() -> None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH[m]):
            # A package's __init__ importing its own submodules is how packages work, not a circle.
            if m != "torchreplay" and t.startswith(m + "."):
                continue
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if t not in state and not t.startswith(m + "."):
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state and m != "torchreplay":
            visit(m)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines; split it (about 600 at most)"


def _private_torch_names(tree: ast.AST) -> list[tuple[int, str]]:
    """``torch._x`` (an attribute chain from ``torch`` through a ``_private`` name, dunders and
    ``torch.ops`` op names aside) and ``import torch._x`` / ``from torch._x import``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(part.startswith("_") for part in node.module.split(".")):  # type: ignore[union-attr]
                found.append((node.lineno, f"from {node.module} import"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name.split(".")[0] == "torch" and any(p.startswith("_") for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            chain.reverse()
            if isinstance(value, ast.Name) and value.id == "torch" and chain[0] != "ops":
                private = [c for c in chain if c.startswith("_") and not c.startswith("__")]
                if private and private[0] == node.attr:  # (reported once, at the first private name)
                    found.append((node.lineno, "torch." + ".".join(chain)))
    return found


def test_private_torch_names_only_in_compat() -> None:
    """DESIGN: private torch APIs are reached only through ``_compat`` (one place to follow them
    across versions)."""
    bad = []
    for name, path in sorted(_modules().items()):
        if name.startswith("torchreplay._compat"):
            continue
        bad += [f"{path.relative_to(PKG.parent)}:{line}: {what}" for line, what in _private_torch_names(ast.parse(path.read_text()))]
    assert not bad, "\n".join(bad)


def test_the_private_name_check_finds_what_it_should() -> None:
    found = _private_torch_names(ast.parse(
        "import torch._dynamo\nfrom torch._ops import OpOverload\nx = torch._foreach_zero_\n"
        "y = torch._ops.OpOverload\nz = torch.cuda._sleep\nok = torch.ops.aten._local_scalar_dense\n"
        "v = torch.__version__\nw = torch.nn.functional.relu\n"
    ))
    assert sorted(found) == [
        (1, "import torch._dynamo"), (2, "from torch._ops import"), (3, "torch._foreach_zero_"),
        (4, "torch._ops"), (5, "torch.cuda._sleep"),
    ]
