"""ASE: the ddpad calculator under ASE dynamics matches the plain model."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

pytest.importorskip("ase")
pytest.importorskip("ddpad_toy_plugin", reason="tests/plugin_pkg not installed (nox session core installs it)")

from ase import units  # noqa: E402
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution  # noqa: E402
from ase.md.verlet import VelocityVerlet  # noqa: E402
from ase.optimize import BFGS  # noqa: E402

import ddpad.adapters  # noqa: E402
from ddpad.ase import Calculator  # noqa: E402


def nve_energies(calc: Calculator, steps: int = 60) -> np.ndarray:
    atoms = ddpad.adapters.get("toy").tools.default_system()
    atoms.calc = calc
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
    dyn = VelocityVerlet(atoms, 2.0 * units.fs)
    energies = []
    dyn.attach(lambda: energies.append(atoms.get_total_energy()), interval=1)
    dyn.run(steps)
    return np.array(energies)


def test_nve_drift_equals_plain_calculator() -> None:
    adapter = ddpad.adapters.get("toy")
    model = adapter.tools.random_model(None, "cpu")
    padded = Calculator(model, "toy", backend="eager", on_recompile="raise")
    plain = Calculator(model, "toy", pad=False, compile=False)
    e_pad, e_plain = nve_energies(padded), nve_energies(plain)
    drift_pad, drift_plain = e_pad[-1] - e_pad[0], e_plain[-1] - e_plain[0]
    assert abs(drift_pad - drift_plain) < 1e-9
    np.testing.assert_allclose(e_pad, e_plain, rtol=0, atol=1e-9)
    stats = padded.wrapped.stats
    assert stats.calls == 61 and stats.max_graphs_per_frame == 1 + stats.growth_calls


def test_optimizer_runs_on_the_padded_model() -> None:
    adapter = ddpad.adapters.get("toy")
    atoms = adapter.tools.default_system()
    atoms.rattle(0.05, seed=1)
    atoms.calc = Calculator(adapter.tools.random_model(None, "cpu"), "toy", compile=False)
    start = atoms.get_potential_energy()
    BFGS(atoms, logfile=None).run(fmax=0.05, steps=100)
    assert atoms.get_potential_energy() < start
    assert np.abs(atoms.get_forces()).max() < 0.05


def test_energy_read_through_properties_and_atom_energies_through_atom_energy_key() -> None:
    """An adapter whose ``properties`` returns flat keys only (its native
    energy key differs) and which declares per-atom energies: the calculator
    reads both through the adapter, not through hard-coded keys."""
    import dataclasses

    toy = ddpad.adapters.get("toy")
    flat_only = dataclasses.replace(toy, energy_key="total_energy", engine=dataclasses.replace(
        toy.engine, atom_energy_key="atom_energy",
        properties=lambda out: {"energy": out["energy"], "forces": out["forces"], "atom_energy": out["atom_energy"]},
    ))
    model = toy.tools.random_model(None, "cpu")
    atoms = toy.tools.default_system()
    atoms.rattle(0.05, seed=2)
    atoms.calc = Calculator(model, flat_only, compile=False)
    reference = model(toy.engine.build_input(model, atoms))
    assert atoms.get_potential_energy() == pytest.approx(float(reference["energy"].detach().sum()), abs=1e-12)
    energies = atoms.get_potential_energies()
    np.testing.assert_allclose(energies, reference["atom_energy"].detach().numpy(), rtol=0, atol=1e-12)
    assert energies.sum() == pytest.approx(atoms.get_potential_energy(), abs=1e-12)


def test_a_compiled_calculator_keeps_its_graphs_in_the_compile_store_by_default(
        caplog: pytest.LogCaptureFixture) -> None:
    """As torch-sim's model and LAMMPS's ``Potential``: a padded calculator
    compiled by Inductor binds ddpad's compile store, so it runs on tight
    caps and the next process finds its graphs (before: head-room caps, and
    every process compiled again). ``compile_cache=None`` opts out; eager
    backends store nothing and get no store (and no warning saying so)."""
    from ddpad import default_store_dir

    model = ddpad.adapters.get("toy").tools.random_model(None, "cpu")
    default = Calculator(model, "toy").wrapped.manager  # nothing compiles before a call
    assert default.store_binding is not None and default.sizer is not None
    assert pathlib.Path(default.store_binding.store.root) == default_store_dir()
    without = Calculator(model, "toy", compile_cache=None).wrapped.manager
    assert without.store_binding is None and without.sizer is None
    with caplog.at_level("WARNING", logger="ddpad"):
        eager = Calculator(model, "toy", backend="aot_eager").wrapped.manager
    assert eager.store_binding is None and "compile store" not in caplog.text
