"""torch-sim: batched optimisation and MD through ddpad.torchsim.Model (MACE)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("mace")
ts = pytest.importorskip("torch_sim")
from ase.build import bulk  # noqa: E402

from ddpad.adapters.mace import random_model  # noqa: E402
from ddpad.torchsim import Model  # noqa: E402

SHAPES = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 2, 1), (1, 2, 1), (2, 1, 2)]


def structures(shapes: list[tuple[int, int, int]], seed: int = 0) -> list[Any]:
    """Rattled periodic 2-element crystals of different sizes."""
    out = []
    for i, rep in enumerate(shapes):
        atoms = bulk("C", "diamond", a=3.57, cubic=True) * rep
        atoms.numbers[::3] = 1
        atoms.rattle(0.1, seed=seed + i)
        out.append(atoms)
    return out


def check_compiles(model: Model) -> None:
    stats = model.wrapped.stats
    growth_calls = {e.call for e in stats.growths}
    assert stats.graphs == 1 + len(growth_calls)
    assert set(stats.graphs_by_call) <= {0} | growth_calls
    assert stats.unexplained == []


def test_fire_optimize_six_systems_one_graph_and_exact() -> None:
    model = random_model(torch.float64, r_max=3.0)
    finals = {}
    for pad in (True, False):
        ts_model = Model(model, "mace", compute_stress=True, pad=pad, compile=pad, backend="aot_eager", on_recompile="raise")
        final = ts.optimize(system=structures(SHAPES), model=ts_model, optimizer=ts.optimizers.fire, max_steps=40)
        finals[pad] = (final, ts_model(final))
        if pad:
            check_compiles(ts_model)
            assert ts_model.wrapped.stats.calls > 20
    (state, out), (ref_state, ref) = finals[True], finals[False]
    assert out["energy"].shape == (6,)
    torch.testing.assert_close(state.positions, ref_state.positions, rtol=0, atol=1e-10)
    for key in ("energy", "forces", "stress"):
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-10, msg=key)


@pytest.mark.long  # a changing system count: test_mace's batch test; the torch-sim path: the FIRE test
def test_nvt_langevin_batch_changes_mid_run() -> None:
    model = random_model(torch.float64, r_max=3.0)
    first, second = structures(SHAPES[:3], seed=1), structures(SHAPES[2:], seed=2)
    results = {}
    for pad in (True, False):
        ts_model = Model(model, "mace", pad=pad, compile=pad, backend="aot_eager", on_recompile="raise")
        torch.manual_seed(0)
        a = ts.integrate(system=first, model=ts_model, integrator=ts.nvt_langevin, n_steps=15,
                         temperature=600.0, timestep=0.001)
        b = ts.integrate(system=second, model=ts_model, integrator=ts.nvt_langevin, n_steps=15,
                         temperature=600.0, timestep=0.001)
        results[pad] = (a, b, ts_model(b))
        if pad:
            check_compiles(ts_model)
            assert ts_model.wrapped.caps["systems"] >= 5
    for got, ref in zip(results[True][:2], results[False][:2]):
        torch.testing.assert_close(got.positions, ref.positions, rtol=0, atol=1e-10)
    for key in ("energy", "forces"):
        torch.testing.assert_close(results[True][2][key], results[False][2][key], rtol=0, atol=1e-10)
    assert np.isfinite(results[True][2]["energy"].numpy()).all()


def test_same_numbers_as_torch_sims_own_mace_model_without_ase(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state's tensors go straight to the model (``ts.io.state_to_atoms``
    is never called) and give torch-sim's own ``MaceModel``'s numbers."""
    from torch_sim.models.mace import MaceModel

    model = random_model(torch.float64, r_max=3.0)
    state = ts.io.atoms_to_state(structures(SHAPES[:4], seed=3), device=torch.device("cpu"), dtype=torch.float64)
    reference = MaceModel(model, device=torch.device("cpu"), dtype=torch.float64, compute_stress=True)(state)

    def no_atoms(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("ddpad.torchsim.Model converted the state to ase.Atoms")

    monkeypatch.setattr(ts.io, "state_to_atoms", no_atoms)
    ts_model = Model(model, "mace", compute_stress=True, backend="aot_eager", on_recompile="raise")
    out = ts_model(state)
    for key in ("energy", "forces", "stress"):
        torch.testing.assert_close(out[key], reference[key], rtol=0, atol=1e-10, msg=key)
    assert ts_model.wrapped.stats.calls == 1
