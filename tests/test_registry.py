"""Adapter registry: lazy listing, errors, plugins (SPEC section 8)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

import ddpad
import ddpad.adapters as adapters
from ddpad.adapters import Adapter, AdapterNotFound, AdapterUnavailable, EngineHooks

HAS_PLUGIN = importlib.util.find_spec("ddpad_toy_plugin") is not None
needs_plugin = pytest.mark.skipif(not HAS_PLUGIN, reason="tests/plugin_pkg not installed (nox session core installs it)")

MODEL_PACKAGES = ("mace", "e3nn", "fairchem", "aimnet", "ase", "ddpad_toy_plugin")


def test_listing_is_lazy() -> None:
    code = (
        "import sys, json, ddpad, ddpad.adapters as a\n"
        "names = a.available()\n"
        f"heavy = [m for m in sys.modules if m.split('.')[0] in {MODEL_PACKAGES!r}]\n"
        "print(json.dumps({'names': names, 'heavy': heavy}))\n"
    )
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True)
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert {"mace", "uma", "aimnet2"} <= set(doc["names"])
    assert doc["heavy"] == []


def test_unknown_name_lists_known() -> None:
    with pytest.raises(AdapterNotFound, match=r"unknown ddpad adapter 'nope'; known adapters: .*aimnet2.*mace.*uma"):
        adapters.get("nope")


@pytest.mark.parametrize("name", ["mace", "uma", "aimnet2", "sevennet", "nequip", "allegro", "orb", "mattersim"])
def test_builtin_missing_package_names_the_extra(name: str) -> None:
    try:
        adapters.get(name)
    except AdapterUnavailable as exc:
        message = str(exc)
        assert (f"pip install torch==2.13.0 -e '.[{name}]'" in message) or "not implemented" in message
    # installed (in that adapter's own environment): get() works and is cached
    else:
        assert adapters.get(name) is adapters.get(name)


def test_every_builtin_adapter_builds_from_tensors() -> None:
    """The README's "every adapter has a tensor path": each built-in record
    declares ``tensor_input`` (read from its module, without its package)."""
    names = ["mace", "uma", "aimnet2", "sevennet", "nequip", "allegro", "orb", "mattersim"]
    missing = [n for n in names if importlib.import_module(f"ddpad.adapters.{n}").ADAPTER.engine.tensor_input is None]
    assert missing == []


def _toy_adapter(name: str) -> Adapter:
    return Adapter(
        name=name, make_padder=lambda m: ddpad.padding.COOPadder(1.0), energy_key="energy", atom_outputs=("forces",),
        cutoff=lambda m: 1.0, engine=EngineHooks(build_input=lambda m, atoms: atoms), install_hint="(in-process)",
    )


def test_register_in_process() -> None:
    adapters.register(_toy_adapter("inproc"))
    assert "inproc" in adapters.available()
    assert adapters.get("inproc").name == "inproc"
    with pytest.raises(ValueError, match="already registered"):
        adapters.register(_toy_adapter("inproc"))
    adapters.register(_toy_adapter("inproc"), replace_existing=True)
    with pytest.raises(ValueError, match="built-in"):
        adapters.register(_toy_adapter("mace"))
    with pytest.raises(TypeError, match="Adapter"):
        adapters.register("inproc")  # type: ignore[arg-type]


@needs_plugin
def test_plugin_is_listed_and_loaded() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = adapters.available()
    assert "toy" in names and "broken" in names
    assert any("clashes with the built-in" in str(w.message) for w in caught)
    toy = adapters.get("toy")
    assert toy.name == "toy" and toy.energy_key == "energy"
    assert adapters.get("toy") is toy


@needs_plugin
def test_broken_plugin_is_reported_not_fatal() -> None:
    assert "broken" in adapters.available()
    with pytest.raises(AdapterUnavailable, match="'broken'.*failed to import.*broken on purpose"):
        adapters.get("broken")
    info = adapters.status("broken")
    assert info["ok"] is False and "broken on purpose" in info["error"]
    assert adapters.status("toy")["ok"] is True


@needs_plugin
def test_clashing_plugin_loses_to_builtin() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            got = adapters.get("mace")
        except AdapterUnavailable as exc:  # the built-in (or its install hint), never the plugin
            assert "-e '.[mace]'" in str(exc) or "not implemented" in str(exc)
        else:
            assert got.install_hint == "pip install torch==2.13.0 -e '.[mace]'"


@needs_plugin
def test_plugin_adapter_wraps_its_model() -> None:
    from ddpad_toy_plugin import Morse

    model = Morse()
    wrapped = ddpad.wrap(model, "toy", compile=False)
    pos = torch.rand(12, 3, dtype=torch.float64) * 3

    class Atoms:
        def get_positions(self) -> torch.Tensor:
            return pos.numpy()

        def __len__(self) -> int:
            return pos.shape[0]

    data = adapters.get("toy").engine.build_input(model, Atoms())
    ref = model({k: v.clone() for k, v in data.items()})
    out = wrapped(data)
    assert out.keys() == ref.keys()
    for key in ref:
        assert out[key].shape == ref[key].shape
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-12)


@needs_plugin
def test_plugin_missing_its_package_shows_its_install_hint() -> None:
    info = adapters.status("toymissing")
    assert info["kind"] == "plugin" and not info["ok"]
    assert info["install_hint"] == "pip install toy-missing-extra"
    assert "no_such_model_package" in info["error"] and "pip install toy-missing-extra" in info["error"]
    with pytest.raises(AdapterUnavailable) as exc:
        adapters.get("toymissing")
    assert exc.value.install_hint == "pip install toy-missing-extra"


def test_flat_energy_key_follows_properties() -> None:
    native = _toy_adapter("native")
    assert native.flat_energy_key == "energy"
    renamed = dataclasses.replace(native, energy_key="total_energy")
    assert renamed.flat_energy_key == "total_energy"
    flattened = dataclasses.replace(renamed, engine=dataclasses.replace(
        renamed.engine, properties=lambda out: {"energy": out["total_energy"]}))
    assert flattened.flat_energy_key == "energy"


def _broken_site(root: pathlib.Path, package: str) -> pathlib.Path:
    """A ``site-packages`` folder holding ``package``, which imports an
    installed distribution ``fakevision 0.1`` whose import raises as a
    torchvision built for another torch does (issue 28)."""
    site = root / "site-packages"
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text("import fakevision\n")
    (site / "fakevision").mkdir()
    (site / "fakevision" / "__init__.py").write_text(
        "raise RuntimeError('while registering fakes\\noperator fakevision::nms does not exist')\n"
    )
    info = site / "fakevision-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakevision\nVersion: 0.1\n")
    (info / "top_level.txt").write_text("fakevision\n")
    return site


def _ddpad(site: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ddpad", *args], capture_output=True, text=True, env=env, timeout=300)


def test_model_package_that_fails_to_import_is_broken_not_installed(tmp_path: pathlib.Path) -> None:
    """A model package that is present but fails to import (issue 28:
    mattersim beside a torchvision built for another torch) is listed as
    ``broken`` with the failure's last line, the package it came from and
    the fix, never as ``installed``; ``get`` raises (reason ``broken``)."""
    site = _broken_site(tmp_path, "mattersim")  # shadows a real mattersim too
    res = _ddpad(site, "list", "--json")
    assert res.returncode == 0, res.stderr
    (row,) = [r for r in json.loads(res.stdout[res.stdout.index("["):]) if r["name"] == "mattersim"]
    assert row["status"] == "broken"
    assert "RuntimeError: operator fakevision::nms does not exist" in row["error"]
    assert "fakevision 0.1" in row["error"] and "pip install torch==2.13.0 -e '.[mattersim]'" in row["error"]
    code = (
        "import ddpad.adapters as a\n"
        "try:\n    a.get('mattersim')\n"
        "except a.AdapterUnavailable as exc:\n    print(exc.reason, exc.install_hint)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "broken pip install torch==2.13.0 -e '.[mattersim]'"


def test_run_on_a_broken_model_package_is_one_error_line(tmp_path: pathlib.Path) -> None:
    """``ddpad run`` on an adapter whose model package fails to import: one
    ``ddpad: error:`` line naming the failure and the fix, exit 2, no traceback."""
    site = _broken_site(tmp_path, "mattersim")
    res = _ddpad(site, "run", "mattersim", "--steps", "2", "--backend", "aot_eager")
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip() and not line.startswith("ddpad: warning:")]
    assert len(lines) == 1 and lines[0].startswith("ddpad: error: ddpad adapter 'mattersim' is broken"), lines
    assert "operator fakevision::nms does not exist" in lines[0] and "pip install torch==2.13.0 -e '.[mattersim]'" in lines[0]
    assert "Traceback" not in res.stderr + res.stdout


BUILTINS = ("mace", "uma", "aimnet2", "sevennet", "nequip", "allegro", "orb", "mattersim")


def test_every_install_hint_names_the_torch_pin() -> None:
    """The hints said ``pip install 'ddpad[X]'`` while the README installs
    ``torch==2.13.0`` with every extra (a model package's own torch
    requirement pulls another release): every hint ddpad prints names the
    pin, built by the one function, and the README installs that pin."""
    import re

    from ddpad._version import TORCH_PIN, install_command
    from ddpad.engines import lammps, nvalchemi

    assert install_command("mace") == f"pip install {TORCH_PIN} -e '.[mace]'"
    hints = [adapters.status(name)["install_hint"] for name in BUILTINS]
    for hint in [*hints, nvalchemi.INSTALL_HINT, lammps.INSTALL_HINT]:
        assert hint.startswith(f"pip install {TORCH_PIN} -e '.["), hint
    root = pathlib.Path(__file__).resolve().parents[1]
    for path in [*(root / "ddpad_core").rglob("*.py"), *(root / "adapters").rglob("*.py")]:
        written = re.findall(r"pip install[^\n\"]*ddpad\[", path.read_text(encoding="utf-8"))
        assert not [w for w in written if TORCH_PIN not in w and "{" not in w], (path, written)
    assert TORCH_PIN in (root / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_are_entry_points_of_ddpad_itself(name: str) -> None:
    """The built-ins are found as plugins are, through the entry-point group
    (declared by ddpad's own distribution); each declares what it requires
    (import names, its model package's first) and the registry gives it
    ddpad's extra of its name as the install hint, installed or not."""
    import importlib.metadata

    eps = [ep for ep in importlib.metadata.entry_points(group=adapters.ENTRY_POINT_GROUP) if ep.name == name]
    assert [ep.value for ep in eps if ep.dist is not None and ep.dist.name == "ddpad"] == [
        f"ddpad.adapters.{name}:ADAPTER"]
    info = adapters.status(name)
    assert info["kind"] == "built-in" and info["install_hint"] == f"pip install torch==2.13.0 -e '.[{name}]'"
    first = {"sevennet": "sevenn", "orb": "orb_models", "uma": "fairchem.core", "aimnet2": "aimnet"}.get(name, name)
    assert info["requires"] and info["requires"][0] == first, info


def test_a_registration_is_seen_from_every_thread() -> None:
    """The registry lived in a context variable: an adapter registered in one
    thread was unknown in another (and a registration in a worker thread
    was lost to the main one)."""
    import threading

    seen: dict[str, object] = {}
    adapters.register(_toy_adapter("fromhere"), replace_existing=True)

    def other() -> None:
        seen["main's"] = adapters.get("fromhere").name
        adapters.register(_toy_adapter("fromthere"), replace_existing=True)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == {"main's": "fromhere"}
    assert adapters.get("fromthere").name == "fromthere" and "fromthere" in adapters.available()


def test_building_a_model_is_quiet_for_every_adapter() -> None:
    """``random_model`` / ``load_model`` run with the model packages' known
    warnings silenced, whoever declared the adapter (built-ins did so
    themselves, plugins did not); a record built again keeps one wrapper."""
    def noisy(dtype: object, device: object) -> str:
        warnings.warn("The TorchScript type system doesn't support instance-level annotations on empty "
                      "non-base types", UserWarning)  # one of ddpad's known noises (e3nn's)
        return "model"

    adapter = dataclasses.replace(_toy_adapter("noisy"), tools=ddpad.adapters.ToolHooks(random_model=noisy))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert adapter.tools.random_model(None, "cpu") == "model"
    assert not caught, [str(w.message) for w in caught]
    again = dataclasses.replace(adapter, name="again")
    assert again.tools.random_model is adapter.tools.random_model


def test_the_record_splits_into_runtime_engine_and_tool_parts() -> None:
    """``Adapter`` holds what the runtime reads; what engines read is in
    ``engine`` (``EngineHooks``), what the command line, bench and kit read is
    in ``tools`` (``ToolHooks``), and nowhere else: those fields passed or
    read flat, or an unknown field, are refused by name."""
    from ddpad.adapters import ToolHooks

    def build(m: object, atoms: object) -> object:
        return atoms

    def random(dtype: object = None, device: str = "cpu") -> torch.nn.Module:
        return torch.nn.Linear(1, 1)

    new = Adapter(name="split", make_padder=lambda m: ddpad.padding.COOPadder(1.0), energy_key="energy",
                  cutoff=lambda m: 1.0, engine=EngineHooks(build_input=build, stress_option="stress"),
                  tools=ToolHooks(random_model=random))
    assert new.engine.build_input is build and new.call_options(True) == {"stress": True}
    assert isinstance(new.tools.random_model(None, "cpu"), torch.nn.Linear)
    with pytest.raises(TypeError, match="build_input"):
        Adapter(name="split", make_padder=new.make_padder, energy_key="energy", cutoff=new.cutoff,
                engine=new.engine, build_input=build)
    with pytest.raises(AttributeError, match="build_input"):
        new.build_input  # noqa: B018
    with pytest.raises(AttributeError, match="no_such_field"):
        new.no_such_field  # noqa: B018
    with pytest.raises(TypeError, match="buld_input"):
        Adapter(name="typo", make_padder=new.make_padder, energy_key="energy", cutoff=new.cutoff,
                engine=new.engine, buld_input=build)
    with pytest.raises(TypeError, match="engine"):
        Adapter(name="bare", make_padder=new.make_padder, energy_key="energy", cutoff=new.cutoff)
    with pytest.raises(TypeError, match="needs engine=EngineHooks"):  # build_input where engine goes
        Adapter("bare", new.make_padder, "energy", new.cutoff, build)
    assert dataclasses.replace(new, name="again").engine is new.engine  # replace() builds the record again


def test_a_package_whose_pinned_dependency_another_extra_moved_is_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    """mace after ``.[sevennet]`` moved e3nn from 0.4.4 to 0.6: mace imports,
    so ``ddpad list`` said ``installed``; it now says ``broken`` and why."""
    import dataclasses
    import importlib.metadata

    adapters.register(dataclasses.replace(_toy_adapter("pinned"), requires=("json",)), replace_existing=True)
    versions = {"e3nn": "0.6.0", "numpy": "2.0.0"}

    def version(name: str) -> str:
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"json": ["fake-model"]})
    monkeypatch.setattr(importlib.metadata, "requires", lambda dist: [
        "e3nn==0.4.4", "numpy>=1.20", "pytest>=99 ; extra == 'dev'", "absent-optional>=1"])
    monkeypatch.setattr(importlib.metadata, "version", version)
    info = adapters.status("pinned")
    assert info["state"] == "broken" and not info["ok"]
    assert info["error"].startswith("fake-model needs e3nn==0.4.4, 0.6.0 is installed: reinstall its extra")
    versions["e3nn"] = "0.4.4"
    assert adapters.status("pinned")["state"] == "installed"
