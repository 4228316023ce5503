"""The package tree is the architecture: each package imports only the layers below it.

An ``ast`` walk of ``calc/``, ``verify/`` and ``webapp/`` (no import is executed). Three rules:

1. a module imports first-party modules only from its own layer or a lower one (``LAYERS``);
2. no first-party import inside a function: deferred imports hid cycles; only an optional
   third-party dependency (torch in ``verify``, streamlit in ``webapp``) may be imported late;
3. no import cycle between modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("calc", "verify", "webapp")

LAYERS: dict[str, tuple[str, ...]] = {
    "calc": (
        "calc.units",
        "calc.symbols",
        "calc.config",
        "calc.data",
        "calc.replay",
        "calc.parallel",
        "calc.models",
        "calc.derive",
        "calc.compress",
        "calc.step",
        "calc.estimate",
        "calc.serving",
        "calc.plan",
        "calc.present",
        "calc.cli",
        "calc",
    ),
    "verify": (
        "verify.measure",
        "verify.cases",
        "verify.models",
        "verify.run",
        "verify.dist",
        "verify",
    ),
    "webapp": ("webapp", "webapp.pages"),
}
"""Each top package's layers, lowest first. A module belongs to the longest prefix it matches;
``calc`` itself (its ``__init__`` and ``__main__``) is the top of ``calc``."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> Iterator[tuple[str, Path]]:
    for top in FIRST_PARTY:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield module_name(path), path


def _resolve(name: str, known: set[str]) -> str:
    """``calc.config.jobs.Training`` -> ``calc.config.jobs`` (the longest known module)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def imports(path: Path, module: str, known: set[str]) -> Iterator[tuple[str, bool]]:
    """(imported first-party module, at module level?) for every import in the file."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` blocks count as module level
        if isinstance(node, ast.If):
            top_level |= {id(n) for n in node.body}
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts if is_package else parts[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            if target.split(".")[0] in FIRST_PARTY:
                resolved = _resolve(target, known)
                if resolved and resolved != module:
                    yield resolved, id(node) in top_level


def layer_of(module: str) -> tuple[str, int]:
    top = module.split(".")[0]
    layers = LAYERS[top]
    best = max(
        (
            i
            for i, prefix in enumerate(layers)
            if module == prefix or module.startswith(prefix + ".")
        ),
        key=lambda i: len(layers[i]),
    )
    return top, best


def graph() -> dict[str, dict[str, bool]]:
    files = dict(sources())
    known = set(files)
    out: dict[str, dict[str, bool]] = {}
    for module, path in files.items():
        edges: dict[str, bool] = {}
        for target, at_top in imports(path, module, known):
            edges[target] = edges.get(target, False) or at_top
        out[module] = edges
    return out


def test_every_module_has_a_layer() -> None:
    for module in graph():
        _top, index = layer_of(module)
        assert index >= 0, module


def test_imports_go_only_downward() -> None:
    upward = []
    for module, edges in graph().items():
        top, mine = layer_of(module)
        for target in edges:
            ttop, theirs = layer_of(target)
            if ttop != top:
                if (top, ttop) not in {
                    ("verify", "calc"),
                    ("webapp", "calc"),
                    ("webapp", "verify"),
                }:
                    upward.append((module, target))
            elif theirs > mine:
                upward.append((module, target))
    assert not upward, "upward imports:\n" + "\n".join(f"  {a} -> {b}" for a, b in upward)


def test_no_first_party_import_inside_functions() -> None:
    late = [
        (module, target)
        for module, edges in graph().items()
        for target, at_top in edges.items()
        if not at_top
    ]
    assert not late, "imports inside functions:\n" + "\n".join(f"  {a} -> {b}" for a, b in late)


def test_no_import_cycles() -> None:
    g = {m: {t for t in edges if t != m} for m, edges in graph().items()}
    # a package's __init__ importing its own submodules is not a cycle of the tree
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(g.get(m, ())):
            if state.get(t) == 1:
                cycles.append([*stack[stack.index(t) :], t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", ["calc.replay.tape", "calc.config.jobs"])
def test_layer_of_names_the_package(module: str) -> None:
    top, index = layer_of(module)
    assert LAYERS[top][index] == module.rsplit(".", 1)[0]


def test_the_walk_sees_the_imports_it_judges() -> None:
    """The rules above would pass vacuously on an empty graph: the walk finds every module and
    the imports a reader can see in the source (estimate's core imports the training replay at
    module level; the tracker's torch is third-party and not an edge)."""
    g = graph()
    assert len(g) > 100
    assert g["calc.estimate.core"]["calc.step.training"] is True
    assert all(t.split(".")[0] in FIRST_PARTY for t in g["verify.measure.tracker"])
