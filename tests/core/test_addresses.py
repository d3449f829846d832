"""Each name of acb.core has one address: whoever imports it from an ``acb.core`` module
imports it from the module that defines it (no re-exports, issue 38)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def defined_in(module: str) -> set[str]:
    """The names a module binds at its top level other than by importing them."""
    tree = ast.parse(Path(importlib.import_module(module).__file__ or "").read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_core_names_are_imported_from_where_they_are_defined():
    files = [*(ROOT / "acb").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    wrong = []
    cache: dict[str, set[str]] = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if not (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and node.module
                and node.module.startswith("acb.core.")
            ):
                continue
            if node.module not in cache:
                cache[node.module] = defined_in(node.module)
            for alias in node.names:
                if alias.name not in cache[node.module]:
                    wrong.append(f"{f.relative_to(ROOT)}:{node.lineno}: {alias.name} from {node.module}")
    assert not wrong, wrong


def test_engine_core_exports_only_its_own():
    from acb.core import engine_core

    assert set(engine_core.__all__) <= defined_in("acb.core.engine_core")
