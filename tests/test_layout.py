"""The module map (docs/pages/architecture.md): every module of the core
imports only from modules below it, so there are no cycles, lazy imports
included. A new module must be placed in ``ORDER``, as in the map. The
runtime imports no adapter, and the adapters read only ddpad's public names.

The public tiers: ``ddpad`` (a model's user) and ``ddpad.padding`` (a padder,
adapter or framework author) export exactly the names below, the names
SPEC.md gives are importable from them, and docs/pages/api.md lists them as
``docs/gen_api.py`` writes it."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import subprocess
import sys

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
    "padding", "ase", "torchsim", "testing", "engines", "_bench", "cli", "__main__",
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
# the tiers: what ``import ddpad`` gives a model's user, and what ``ddpad.padding``
# gives whoever writes a padder, an adapter or a framework
USER_TIER = {
    "wrap", "PaddedModel", "Evaluator", "Stats", "CapEvent", "CompileEvent", "CompileStore", "default_store_dir",
    "load_caps", "save_caps", "TightPolicy", "ShrinkPolicy", "cap_agreement_group",
    "AgreementError", "CapacityError", "RecompileError",
}
PADDING_TIER = {
    "GraphPadder", "resolve_cap", "resolve_caps", "bucket", "CapPolicy", "CapResolution", "CapScope", "ScopedCaps",
    "Agreement", "cap_agreement_over", "COOPadder", "DensePadder", "DenseBatchPadder", "PadderBase", "Fill",
    "FillSpec", "DistributedContext", "NOT_DISTRIBUTED", "current_dd_context", "activate_dd_context", "HaloMeta",
    "GatherMeta", "Structures", "Composition", "NeighborList", "counting_backend",
}
# the public modules ``from ddpad import ...`` may name
PUBLIC_MODULES = {"adapters", "padding", "testing", "ase", "torchsim", "engines"}
# SPEC.md's names: the module it places them in, or None where it names no module
SPEC_NAMES = {
    "resolve_cap": None, "cap_agreement_group": None, "GraphPadder": None, "DistributedContext": None,
    "current_dd_context": None, "activate_dd_context": None, "NOT_DISTRIBUTED": None,
    "get": "ddpad.adapters", "available": "ddpad.adapters",
}
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
        tier = {"ddpad": USER_TIER | PUBLIC_MODULES, "ddpad.padding": PADDING_TIER}.get(module)
        if tier is not None:
            bad += [f"{module}.{n}" for n in names if n not in tier]
        elif len(parts) > 1 and parts[1].startswith("_"):
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
    core module, a sibling adapter's private name) and on a name read from
    the wrong tier, and passes public reads."""
    bad = tmp_path / "bad.py"
    bad.write_text("from ddpad._padders import EDGES_POLICY\nfrom ddpad.adapters.nequip import _dtype_name\n"
                   "import ddpad._noise\nfrom ddpad.padding import COOPadder\nfrom ddpad.adapters._common import detach\n"
                   "from ddpad import COOPadder, wrap, padding\nfrom ddpad.padding import PaddedModel\n")
    assert _private_reads(bad) == ["ddpad._padders", "ddpad.adapters.nequip._dtype_name", "ddpad._noise",
                                   "ddpad.COOPadder", "ddpad.padding.PaddedModel"]


def test_the_user_tier_is_what_a_models_user_needs() -> None:
    import ddpad

    assert set(ddpad.__all__) == USER_TIER, f"ddpad.__all__ changed: {set(ddpad.__all__) ^ USER_TIER}"
    assert len(ddpad.__all__) <= 20
    assert all(getattr(ddpad, name) is not None for name in ddpad.__all__)


def test_the_padding_tier_is_what_a_padder_author_needs() -> None:
    import ddpad
    import ddpad.padding

    assert set(ddpad.padding.__all__) == PADDING_TIER, f"ddpad.padding.__all__ changed: {set(ddpad.padding.__all__) ^ PADDING_TIER}"
    assert all(getattr(ddpad.padding, name) is not None for name in ddpad.padding.__all__)
    assert not set(ddpad.padding.__all__) & set(ddpad.__all__), "a name in both tiers"
    assert ddpad.padding is importlib.import_module("ddpad").padding  # ``import ddpad`` reaches it lazily


def test_a_name_of_the_padding_tier_is_not_read_from_ddpad() -> None:
    import ddpad

    assert not hasattr(ddpad, "COOPadder") and not hasattr(ddpad, "resolve_caps")


def test_specs_names_are_public_where_spec_puts_them() -> None:
    import ddpad
    import ddpad.adapters
    import ddpad.padding

    for name, module in SPEC_NAMES.items():
        homes = [importlib.import_module(module)] if module else [ddpad, ddpad.padding]
        assert any(name in getattr(home, "__all__", ()) for home in homes), f"{name} is not public in {module or 'a tier'}"
    assert importlib.import_module("ddpad.testing").AdapterTests


def test_import_ddpad_imports_no_torch() -> None:
    code = "import sys, ddpad; ddpad.__all__; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=CORE.parent / "tests")


def test_the_api_page_is_generated_from_the_tiers() -> None:
    res = subprocess.run([sys.executable, str(CORE.parent / "docs" / "gen_api.py"), "--check"],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


def _deprecations(path: pathlib.Path) -> list[str]:
    """Where ``path`` keeps an old name working: a ``DeprecationWarning`` (or
    ``FutureWarning``) of its own raised, or a ``.. deprecated::`` note."""
    text = path.read_text()
    found = [f"{path.name}:{text[:m.start()].count(chr(10)) + 1}" for m in re.finditer(r"\.\. deprecated::", text)]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "warn":
            kinds = [a for a in [*node.args, *(k.value for k in node.keywords)] if isinstance(a, ast.Name)]
            if any(a.id in ("DeprecationWarning", "FutureWarning", "PendingDeprecationWarning") for a in kinds):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_deprecation_shims() -> None:
    """0.1.0 is unreleased: nothing outside this repository uses an old
    name, so none is kept working beside the new one."""
    shims = [s for p in sorted([*CORE.rglob("*.py"), *ADAPTERS.rglob("*.py")]) for s in _deprecations(p)]
    assert not shims, f"deprecation shims: {shims}"


def test_the_shim_check_catches_one(tmp_path: pathlib.Path) -> None:
    shim = tmp_path / "shim.py"
    shim.write_text('import warnings\n\ndef old():\n    """.. deprecated:: use new"""\n'
                    '    warnings.warn("old is new", DeprecationWarning, stacklevel=2)\n')
    assert _deprecations(shim) == ["shim.py:4", "shim.py:5"]


# functions of ddpad_core/ and adapters/ may run to MAX_LINES lines of code (the
# docstring aside); these stay whole, and why
MAX_LINES = 60
LONG_FUNCTIONS = {
    "_padded.py:_forward": "the call path of every step, in one frame: split, the steady call pays a call per "
                           "part (its cost is measured, architecture.md)",
    "cli/_bench.py:add_parser": "a flat list of the bench command's argparse options",
    "_padders/coo.py:__init__": "one keyword per field name, layout, policy and key (SPEC section 6: each is "
                                "configuration), each checked and stored",
    "_bench/engines.py:_lammps": "two LAMMPS input decks written inline, one per stepper",
}


def _code_lines(path: pathlib.Path) -> dict[str, int]:
    """Each function's lines from its ``def`` to its end, its docstring aside."""
    lengths = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if isinstance(node.body[0], ast.Expr) and isinstance(
                getattr(node.body[0], "value", None), ast.Constant) and isinstance(node.body[0].value.value, str) else None
            skipped = doc.end_lineno - doc.lineno + 1 if doc is not None else 0
            lengths[node.name] = max(lengths.get(node.name, 0), node.end_lineno - node.lineno + 1 - skipped)
    return lengths


def test_no_function_is_over_60_lines() -> None:
    long = {}
    for root in (CORE, ADAPTERS):
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            long |= {f"{rel}:{name}": n for name, n in _code_lines(path).items() if n > MAX_LINES}
    unexplained = {name: n for name, n in long.items() if name not in LONG_FUNCTIONS}
    assert not unexplained, f"functions over {MAX_LINES} lines: {unexplained} (split them, or say why in LONG_FUNCTIONS)"
    stale = sorted(set(LONG_FUNCTIONS) - set(long))
    assert not stale, f"LONG_FUNCTIONS names functions no longer over {MAX_LINES} lines: {stale}"


def test_the_length_check_reads_code_not_docstrings(tmp_path: pathlib.Path) -> None:
    code = tmp_path / "f.py"
    code.write_text('def f():\n    """one\n    two\n    """\n    a = 1\n    return a\n')
    assert _code_lines(code) == {"f": 3}


def test_inspecting_ddpad_imports_no_optional_package() -> None:
    """The API reference's builder (griffe) lists a package with
    ``inspect.getmembers``, which reads every name ``dir()`` gives: the
    engines' modules were among them, and reading ``ddpad.torchsim`` without
    torch-sim raised, failing ``mkdocs build`` in the core session. They are
    imported when asked for, not listed before."""
    code = ("import inspect, sys\nsys.modules['torch_sim'] = None\nimport ddpad\ninspect.getmembers(ddpad)\n"
            "assert 'torchsim' not in dir(ddpad)\nprint('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
