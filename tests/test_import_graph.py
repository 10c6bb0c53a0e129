"""The package's layers: no import cycle among ringlse's modules (every import counts, at the top or
inside a function), and the Triton kernels (`kernels/`, installed as `ringlse.kernels`) import nothing
of the package above them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"ringlse": ROOT / "ringlse", "ringlse.kernels": ROOT / "kernels"}


def _modules() -> dict[str, Path]:
    mods = {}
    for package, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = [p for p in f.relative_to(folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([package, *parts])] = f
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports (a module's own ancestor packages are not edges)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(parent[: len(parent) - node.level + 1] + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [t for t in subs if t in mods] or [base]
            if any(t not in mods for t in subs):
                targets.append(base)
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
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

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    mods = _modules()
    graph = {m: _imports(m, f, mods) for m, f in mods.items()}
    assert _cycles(graph) == []


def test_kernels_import_nothing_above_them():
    mods = _modules()
    for name, path in mods.items():
        if name.startswith("ringlse.kernels"):
            above = {t for t in _imports(name, path, mods) if not t.startswith("ringlse.kernels")}
            assert not above, f"{name} imports {sorted(above)}"
