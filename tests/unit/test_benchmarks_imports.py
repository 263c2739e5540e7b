"""Every name a benchmark script imports from moekit exists: the scripts are not run by the tests, so a
module moved or renamed would otherwise break them unseen."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _has(module, name: str) -> bool:
    """A name defined in ``module``, or a submodule of it."""
    try:
        return hasattr(module, name) or bool(importlib.import_module(f"{module.__name__}.{name}"))
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_benchmark_imports_resolve(script: str) -> None:
    missing = []
    for node in ast.walk(ast.parse((BENCHMARKS / script).read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moekit"):
            module = importlib.import_module(node.module)
            missing += [f"{node.module}.{a.name}" for a in node.names if not _has(module, a.name)]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("moekit"):
                    importlib.import_module(alias.name)
    assert not missing, f"{script} imports names that do not exist: {missing}"
