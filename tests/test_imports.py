"""The package's imports flow one way: no import circles between its modules (imports inside functions count),
and each layer imports only the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "bitnetlm"

# layer -> the packages it must never import (directly or inside a function)
NEVER = {
    "quant": ("kernels", "models", "runtime", "engine", "generate", "serve", "formats", "commands"),
    "models": ("kernels", "runtime", "engine", "generate", "serve", "formats", "commands"),
    "kernels": ("models", "runtime", "engine", "generate", "serve", "formats", "commands", "sampling"),
    "sampling": ("models", "runtime", "engine", "generate", "serve", "commands"),
    "text": ("kernels", "models", "runtime", "engine", "generate", "serve", "commands"),
    "parallel": ("runtime", "engine", "generate", "serve", "commands", "formats", "train", "sampling"),
    "runtime": ("engine", "generate", "serve", "commands", "formats", "train"),
    "engine": ("generate", "serve", "commands", "formats", "train"),
    "generate": ("serve", "commands", "train"),
    "serve": ("commands", "train"),
}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """bitnetlm modules `path` imports anywhere in it (a `from pkg import name` counts name when it is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    me = _module(path).split(".")
    pkg = me if path.name == "__init__.py" else me[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("bitnetlm"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            if base.startswith("bitnetlm"):  # (a name that is no module counts as its package, below)
                out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        deps = set()
        for name in _imports(path):
            while name and name not in files:  # `from pkg import function`: the module is pkg
                name = name.rpartition(".")[0]
            if name and name != mod:
                deps.add(name)
        graph[mod] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _within(mod: str, pkg: str) -> bool:
    return mod == f"bitnetlm.{pkg}" or mod.startswith(f"bitnetlm.{pkg}.")


def test_no_import_circles():
    # a package's __init__ that re-exports its own modules is not a circle of the code's layers
    graph = {
        m: {d for d in deps if not (m.startswith(d + ".") and d != "bitnetlm")}
        for m, deps in _graph().items()
    }
    assert _cycles(graph) == []


def test_layers_import_only_what_is_below_them():
    bad = []
    for mod, deps in _graph().items():
        for layer, never in NEVER.items():
            if not _within(mod, layer):
                continue
            bad += [f"{mod} -> {d}" for d in sorted(deps) if any(_within(d, x) for x in never)]
    assert bad == []


def test_the_graph_is_read():
    graph = _graph()
    assert "bitnetlm.runtime.cpu" in graph["bitnetlm.serve.engine"] | graph["bitnetlm.runtime"]
    assert "bitnetlm.quant.bitlinear" in graph["bitnetlm.models.transformer"]
