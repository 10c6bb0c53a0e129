"""The LSE toolkit is a corner of its own (`ringlse/lse/`): nothing on the attention path imports it, and
its kernels take from the rest of ringlse only the shared host helpers and launch path. Read from the source (every
import, top-level or inside a function, and module names passed as strings), so that a lazy import
counts too."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORNER = REPO / "ringlse" / "lse"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes (they may name the toolkit without importing it)."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _named_modules(path: Path) -> set[str]:
    """Modules `path` imports, and every string in its code (not its docstrings) that starts with `ringlse.`."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if node.value.startswith("ringlse."):
                names.add(node.value)
    return names


def _is_toolkit(name: str) -> bool:
    return name == "ringlse.lse" or name.startswith("ringlse.lse.")


def test_attention_path_never_imports_the_toolkit():
    outside = [p for p in (REPO / "ringlse").rglob("*.py") if CORNER not in p.parents]
    outside += list((REPO / "kernels").rglob("*.py"))
    offenders = {}
    for path in outside:
        if path == REPO / "ringlse" / "__init__.py":
            continue  # the public names: `ringlse.softmax` etc. re-exported
        found = sorted(n for n in _named_modules(path) if _is_toolkit(n))
        if found:
            offenders[str(path.relative_to(REPO))] = found
    assert not offenders, offenders
    assert len(outside) > 30  # (the walk found the attention path)


def test_toolkit_kernels_take_only_the_shared_helpers():
    allowed = {"ringlse.kernels.host", "ringlse.kernels.launch"}
    offenders = {}
    for path in (CORNER / "kernels").rglob("*.py"):
        found = sorted(n for n in _named_modules(path) if n.startswith("ringlse.") and not _is_toolkit(n)
                       and not any(n == a or n.startswith(a + ".") for a in allowed))
        if found:
            offenders[str(path.relative_to(REPO))] = found
    assert not offenders, offenders
