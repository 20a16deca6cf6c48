"""The module map (docs/pages/architecture.md): every module of the core
imports only from modules below it, so there are no cycles, lazy imports
included. A new module must be placed in ``ORDER``, as in the map."""

from __future__ import annotations

import ast
import pathlib

import pytest

CORE = pathlib.Path(__file__).resolve().parents[1] / "ddpad_core"

# bottom to top: a module may import only modules before it
ORDER = [
    "_version", "_noise", "_fs", "_protocol", "_agreement", "_capacity", "_context",
    "_padders", "_structures",
    "_ladder", "_stats", "_caps_file", "_memory", "_shrink", "_weights", "_store", "_strict", "_compile", "_verify",
    "_aot",
    "_warm", "_background", "_options", "_padded", "_wrap", "_evaluator", "_worker", "_prebuild",
    "ase", "torchsim", "testing", "engines", "_bench", "cli", "__main__",
]
# the package's public face: it imports everything, and what imports
# ``ddpad`` itself reads only its public names, lazily, from the top layers
PUBLIC = "__init__"
PUBLIC_READERS = {"_bench", "cli", "testing"}
# ``ddpad.adapters`` is looked up by name through its registry (lazily)
OUTSIDE = {"adapters"}


def _unit(path: pathlib.Path) -> str:
    rel = path.relative_to(CORE)
    return rel.parts[0].removesuffix(".py") if rel.parts[0] != "__init__.py" else PUBLIC


def _targets(path: pathlib.Path) -> set[str]:
    """The core units ``path`` imports (module level and inside functions)."""
    package = list(path.relative_to(CORE).parent.parts)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                parts = [*base, *(node.module or "").split(".")] if node.module else base
                names = [a.name for a in node.names] if not node.module else []
            elif node.module and (node.module == "ddpad" or node.module.startswith("ddpad.")):
                parts = node.module.split(".")[1:]
                names = [a.name for a in node.names] if not parts else []
            else:
                continue
            parts = [p for p in parts if p]
            if parts:
                found.add(parts[0])
            else:  # from . import x / from ddpad import x
                found.update(n if (CORE / n).exists() or (CORE / f"{n}.py").exists() or n in OUTSIDE else PUBLIC
                             for n in names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "ddpad":
                    found.add(PUBLIC)
                elif alias.name.startswith("ddpad."):
                    found.add(alias.name.split(".")[1])
    return found


def _sources() -> list[pathlib.Path]:
    return sorted(p for p in CORE.rglob("*.py") if p.name != "__init__.py" or p.parent != CORE)


def test_every_core_module_is_placed_in_the_map() -> None:
    units = {_unit(p) for p in _sources()}
    assert units <= set(ORDER), f"modules missing from ORDER (and the architecture page): {sorted(units - set(ORDER))}"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(CORE)))
def test_imports_run_one_way(path: pathlib.Path) -> None:
    unit = _unit(path)
    rank = ORDER.index(unit)
    for target in _targets(path) - OUTSIDE - {unit}:
        if target == PUBLIC:
            assert unit in PUBLIC_READERS, f"{path.name} imports the ddpad package itself"
            continue
        assert target in ORDER, f"{path.name} imports {target}, which is not in the map"
        assert ORDER.index(target) < rank, f"{path.name} ({unit}) imports {target}, which sits above it"
