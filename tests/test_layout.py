"""The module map (docs/pages/architecture.md): every module of the core
imports only from modules below it, so there are no cycles, lazy imports
included. A new module must be placed in ``ORDER``, as in the map. The
runtime imports no adapter, and the adapters read only ddpad's public names."""

from __future__ import annotations

import ast
import pathlib

import pytest

CORE = pathlib.Path(__file__).resolve().parents[1] / "ddpad_core"
ADAPTERS = CORE.parent / "adapters"

# bottom to top: a module may import only modules before it
ORDER = [
    "_version", "_noise", "_fs", "_protocol", "_adapter", "_registry", "_agreement", "_capacity", "_context",
    "_padders", "_structures",
    "_ladder", "_stats", "_caps_file", "_memory", "_shrink", "_weights", "_store_contents", "_store", "_strict", "_verify", "_compile",
    "_aot",
    "_warm", "_background", "_options", "_routes", "_manager", "_padded", "_wrap", "_evaluator", "_worker", "_prebuild",
    "ase", "torchsim", "testing", "engines", "_bench", "cli", "__main__",
]
# the package's public face: it imports everything, and what imports
# ``ddpad`` itself reads only its public names, lazily, from the top layers
PUBLIC = "__init__"
# (``_adapter``: ``Adapter.wrap`` calls ``ddpad.wrap``, which sits above the record)
PUBLIC_READERS = {"_adapter", "_bench", "cli", "testing"}
# ``ddpad.adapters``: the runtime finds adapters through the registry it owns
# (``_registry``) and imports none; only the wing on top names them
OUTSIDE = {"adapters"}
ADAPTER_READERS = {"_bench", "cli"}
# the registry's public face, ``ddpad.adapters``, re-exports the core's registry
REGISTRY_FACE = {"_adapter", "_registry"}


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
    targets = _targets(path)
    assert not (targets & OUTSIDE) or unit in ADAPTER_READERS, f"{path.name} ({unit}) imports ddpad.adapters"
    for target in targets - OUTSIDE - {unit}:
        if target == PUBLIC:
            assert unit in PUBLIC_READERS, f"{path.name} imports the ddpad package itself"
            continue
        assert target in ORDER, f"{path.name} imports {target}, which is not in the map"
        assert ORDER.index(target) < rank, f"{path.name} ({unit}) imports {target}, which sits above it"


def _private_reads(path: pathlib.Path) -> list[str]:
    """What ``path`` (an adapter's module) imports of ddpad that is not
    public: a private core module (``ddpad._x``), or a private name of an
    adapter module (``from ddpad.adapters.nequip import _x``). The
    adapters' own shared module (``ddpad.adapters._common``) is theirs."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # inside ddpad.adapters
                module = "ddpad.adapters" + (f".{module}" if module else "")
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            module, names = "", []
            bad += [a.name for a in node.names if a.name.startswith("ddpad.") and "._" in a.name
                    and not a.name.startswith("ddpad.adapters._common")]
            continue
        else:
            continue
        parts = module.split(".")
        if parts[0] != "ddpad":
            continue
        if len(parts) > 1 and parts[1].startswith("_"):
            if not (path == ADAPTERS / "__init__.py" and parts[1] in REGISTRY_FACE):
                bad.append(module)
        elif parts[1:2] == ["adapters"] and module != "ddpad.adapters._common":
            bad += [f"{module}.{n}" for n in names if n.startswith("_")]
    return bad


@pytest.mark.parametrize("path", sorted(ADAPTERS.rglob("*.py")), ids=lambda p: str(p.relative_to(ADAPTERS)))
def test_adapters_read_only_public_names(path: pathlib.Path) -> None:
    assert not _private_reads(path), f"{path.relative_to(ADAPTERS.parent)} imports private names: {_private_reads(path)}"


def test_the_adapter_check_catches_a_private_read(tmp_path: pathlib.Path) -> None:
    """The check above fails on what mattersim and allegro did (a private
    core module, a sibling adapter's private name) and passes public reads."""
    bad = tmp_path / "bad.py"
    bad.write_text("from ddpad._padders import EDGES_POLICY\nfrom ddpad.adapters.nequip import _dtype_name\n"
                   "import ddpad._noise\nfrom ddpad import COOPadder\nfrom ddpad.adapters._common import detach\n")
    assert _private_reads(bad) == ["ddpad._padders", "ddpad.adapters.nequip._dtype_name", "ddpad._noise"]
