"""Allegro adapter: the conformance kit plus allegro-specific checks (allegro environment)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("allegro")
pytest.importorskip("nequip")
from ase.build import bulk
from ddpad import adapters
from ddpad.adapters import allegro as allegro_adapter
from ddpad.adapters import nequip as nequip_adapter
from _cells import small_hco_cells  # noqa: E402
from ddpad.testing import AdapterTests

ATOL = 1e-10
ENERGY_KEYS = ("total_energy", "forces", "stress", "virial", "atomic_energy")


def structure(step: int, rng: np.random.Generator, cells: tuple[int, int, int] = (1, 1, 2)) -> Any:
    """A rattled periodic H/C/O crystal (16 atoms per 1x1x2) that loses a few atoms."""
    atoms = bulk("C", "diamond", a=3.57, cubic=True) * cells
    atoms.numbers[::3] = 1
    atoms.numbers[1::5] = 8
    keep = np.sort(rng.permutation(len(atoms))[: len(atoms) - int(rng.integers(0, 4))])
    atoms = atoms[keep]
    atoms.rattle(0.08, seed=step)
    return atoms


class TestAllegroConformance(AdapterTests):
    """ddpad's conformance kit on a random float64 Allegro."""

    adapter = "allegro"
    atol = ATOL
    dtype = torch.float64

    @pytest.fixture
    def trajectory(self) -> list[Any]:
        rng = np.random.default_rng(0)
        return [
            [structure(s, rng), structure(s + 50, rng, (1, 1, 1))] if s % 3 == 2 else structure(s, rng)
            for s in range(6)
        ]

    @pytest.fixture
    def foundation_structures(self) -> list[Any]:
        """What Allegro-OAM-L (random weights, float32, r_max 7 A) runs in the kit's check."""
        return small_hco_cells()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return allegro_adapter.random_model(torch.float64)


def test_joined_dead_atoms_leak_energy(model: torch.nn.Module) -> None:
    """Why the dead system: joined to the real system, dead atoms add their
    per-type energy shift to its energy."""
    adapter = adapters.get("allegro")
    data = adapter.engine.build_input(model, structure(0, np.random.default_rng(2)))
    ref = adapter.reference(model, data)
    own = adapter.wrap(model, compile=False)(data)
    join = adapter.wrap(model, compile=False, padder=nequip_adapter.make_padder(model, placement="join"))(data)
    for key in ENERGY_KEYS:
        torch.testing.assert_close(own[key], ref[key], rtol=0, atol=ATOL, msg=key)
    leak = float((join["total_energy"] - ref["total_energy"]).abs().max())
    assert leak > 0.1, f"join placement expected to leak, measured dE = {leak:g}"


def test_owned_atomic_energies_differentiable(model: torch.nn.Module) -> None:
    """What a LAMMPS domain does: sum the atomic energies of the atoms it owns
    (``energy_only_options``) and differentiate; the sum over all atoms gives
    the full call's forces."""
    adapter = adapters.get("allegro")
    assert adapter.engine.atom_energy_key == "atomic_energy"
    wrapped = adapter.wrap(model, backend="aot_eager", on_recompile="raise")
    rng = np.random.default_rng(4)
    for step in range(3):
        data = adapter.engine.build_input(model, structure(step, rng))
        ref = adapter.reference(model, data)
        pos = data["pos"].detach().clone().requires_grad_(True)
        out = wrapped({**data, "pos": pos}, **adapter.engine.energy_only_options)
        (grad,) = torch.autograd.grad(out[adapter.engine.atom_energy_key].sum(), pos)
        torch.testing.assert_close(-grad, ref["forces"], rtol=0, atol=ATOL)
        torch.testing.assert_close(out["atomic_energy"].detach(), ref["atomic_energy"], rtol=0, atol=ATOL)
    assert wrapped.stats.unexplained == []


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_one_graph(model: torch.nn.Module) -> None:
    adapter = adapters.get("allegro")
    rng = np.random.default_rng(6)
    steps = [adapter.engine.build_input(model, structure(i, rng)) for i in range(10)]
    caps: dict[str, int] = {}  # size the caps on the trajectory first: one inductor compile
    for data in steps:
        adapter.make_padder(model).pad(data, caps)
    wrapped = adapter.wrap(model, backend="inductor", on_recompile="raise", caps=caps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for data in steps:
            out, ref = wrapped(data), adapter.reference(model, data)
            for key in ENERGY_KEYS:
                torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-9, msg=key)
    assert wrapped.stats.graphs == 1 and wrapped.stats.growths == []


def test_strictly_local() -> None:
    """Allegro's layers act on each atom's own edges: one cutoff of ghosts."""
    adapter = adapters.get("allegro")
    assert adapter.engine.message_layers(adapter.tools.random_model(torch.float64, "cpu")) == 1


def test_cli_run_three_steps(tmp_path: pathlib.Path) -> None:
    """``ddpad run allegro`` works without files: random model, built-in system."""
    res = subprocess.run([sys.executable, "-m", "ddpad", "run", "allegro", "--steps", "3", "--backend", "aot_eager"],
                         check=False, capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    # tight caps fitted on the last of the four calls (the window shortened to the run), compiled there once
    assert "compiled graphs: 1; growth calls: 0 (" in res.stdout, res.stdout[-2000:]
    assert "unexplained recompiles: 0" in res.stdout, res.stdout[-2000:]
