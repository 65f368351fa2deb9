"""Rules of the code's shape that a reviewer would otherwise have to re-check by hand:
the packages import downwards only, modules talk through public names only, and
``ranmt.config`` reads no corpora."""

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


# Each part of src/ranmt and its layer: a part imports from its own and lower layers only
# (imports under ``if TYPE_CHECKING:`` are for type names and not counted). The config sits
# above the attention variants because it reads their registry (option sections, presets).
LAYERS = {
    "runtime": 0, "data": 0, "evaluate": 0,
    "attention": 1,
    "config": 2,
    "model": 3,
    "checkpoint": 4,
    "inference": 5,
    "training": 6, "analysis": 6,
    "serving": 7, "experiment": 7, "benchmark": 7,
    "cli": 8,
    "__main__": 9, "__init__": 9,
}


def _part(module: str) -> str:
    """``ranmt.inference.decode`` -> ``inference``; ``ranmt`` itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _runtime_imports(tree: ast.AST):
    """(line, module) of the ranmt imports of a module, skipping ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ranmt"):
            if node.module == "ranmt":
                yield from ((node.lineno, f"ranmt.{alias.name}") for alias in node.names)
            else:
                yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names
                        if alias.name.startswith("ranmt."))
        else:
            yield from _runtime_imports(node)


def test_packages_import_downwards_only():
    offenders, parts = [], set()
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(("ranmt", *path.relative_to(SRC).with_suffix("").parts))
        part = _part(module.removesuffix(".__init__"))
        parts.add(part)
        for line, target in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            other = _part(target)
            if other not in ("__version__", part) and LAYERS[other] >= LAYERS[part]:
                offenders.append(f"{path.relative_to(SRC)}:{line} ({part}, layer "
                                 f"{LAYERS[part]}) imports {target} (layer {LAYERS[other]})")
    assert parts <= set(LAYERS), f"parts without a layer: {sorted(parts - set(LAYERS))}"
    assert offenders == []


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


def _module_graph() -> dict[str, set[str]]:
    """Module -> the ranmt modules it imports (at module level or inside functions; not
    under ``if TYPE_CHECKING:``), ``from ranmt.pkg import module`` counted as the module."""
    modules = {".".join(("ranmt", *path.relative_to(SRC).with_suffix("").parts))
               .removesuffix(".__init__"): path for path in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("ranmt"):
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    targets.add(name if name in modules else node.module)
        targets |= {target for _, target in _runtime_imports(tree)}
        graph[module] = {target for target in targets if target in modules and target != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_between_modules():
    """No module imports, even lazily inside a function, a module that imports it back
    (directly or round a longer circle): inside a package too, where the layers above do
    not look (``serving.worker`` once imported ``serving.app``, the server that starts
    it). The package ``__init__`` files re-export and are left out."""
    graph = {module: {target for target in targets if not _is_package(target)}
             for module, targets in _module_graph().items() if not _is_package(module)}
    assert _cycles(graph) == []


def _is_package(module: str) -> bool:
    return (SRC.joinpath(*module.split(".")[1:]) / "__init__.py").is_file() or module == "ranmt"
