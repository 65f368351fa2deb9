"""Rules of the code's shape that a reviewer would otherwise have to re-check by hand:
modules talk through public names only, and ``ranmt.config`` reads no corpora."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "ranmt"


def _imports(path: Path):
    """(line, module, name) of every ``from ranmt... import name`` in a source file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ranmt"):
            for alias in node.names:
                yield node.lineno, node.module, alias.name


def test_no_private_name_is_imported_across_modules():
    """A name starting with ``_`` is its module's own: another module that needs it means
    the name is part of an interface and should say so."""
    offenders = [f"{path.relative_to(SRC)}:{line}: from {module} import {name}"
                 for path in sorted(SRC.rglob("*.py")) for line, module, name in _imports(path)
                 if name.startswith("_") and not name.startswith("__")]
    assert offenders == []


def test_the_config_reads_no_corpora():
    """``ranmt.config`` describes settings; filling them from prepared data is the job of
    the code that has the data."""
    modules = {module for _, module, _ in _imports(SRC / "config.py")}
    assert not any(module.startswith("ranmt.data") for module in modules), modules
