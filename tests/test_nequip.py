"""NequIP adapter: the conformance kit plus nequip-specific checks (nequip environment)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("nequip")
from ase.build import bulk
from ddpad import adapters
from ddpad.adapters import nequip as nequip_adapter
from ddpad.ase import Calculator
from _cells import small_hco_cells  # noqa: E402
from ddpad.testing import AdapterTests, check_graphs

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


def trajectory_of(steps: int = 6, seed: int = 0) -> list[Any]:
    """Atom, edge and system counts change: every third step a batch of two."""
    rng = np.random.default_rng(seed)
    return [
        [structure(s, rng), structure(s + 50, rng, (1, 1, 1))] if s % 3 == 2 else structure(s, rng)
        for s in range(steps)
    ]


class TestNequIPConformance(AdapterTests):
    """ddpad's conformance kit (exactness, dead rows, graph count, call forms,
    autograd, empty input, ASE calculator) on a random float64 NequIP."""

    adapter = "nequip"
    atol = ATOL
    dtype = torch.float64

    @pytest.fixture
    def trajectory(self) -> list[Any]:
        return trajectory_of()

    @pytest.fixture
    def foundation_structures(self) -> list[Any]:
        """What NequIP-OAM-L and -XL (random weights, float32, r_max 6 A, ZBL) runs in the kit's check."""
        return small_hco_cells()


def assert_close(out: dict[str, Any], ref: dict[str, Any], atol: float = ATOL) -> float:
    worst = 0.0
    for key in ENERGY_KEYS:
        assert out[key].shape == ref[key].shape and out[key].dtype == ref[key].dtype, key
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=atol, msg=key)
        worst = max(worst, float((out[key] - ref[key]).abs().max()))
    return worst


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return nequip_adapter.random_model(torch.float64)


def test_native_output_unpadded_everywhere(model: torch.nn.Module) -> None:
    """Every per-atom, per-edge and per-system key of nequip's output (inputs
    echoed and intermediates too) comes back at the unpadded shape."""
    adapter = adapters.get("nequip")
    data = adapter.engine.build_input(model, structure(0, np.random.default_rng(0)))
    out = adapter.wrap(model, compile=False)(data)
    ref = adapter.reference(model, data)
    assert out.keys() == ref.keys()
    for key, value in ref.items():
        assert out[key].shape == value.shape, key
        torch.testing.assert_close(out[key], value, rtol=0, atol=ATOL, msg=key)


def test_dead_edges_beyond_cutoff_and_dead_system(model: torch.nn.Module) -> None:
    """Dead edges computed nequip's way (pos[j] - pos[i] + shift @ cell[batch[i]])
    are longer than r_max and never zero; dead atoms are all in the dead system."""
    adapter = adapters.get("nequip")
    data = adapter.engine.build_input(model, structure(0, np.random.default_rng(1)))
    padder = adapter.make_padder(model)
    padded = padder.pad(data, {})
    n, e = data["pos"].shape[0], data["edge_index"].shape[1]
    src, dst = padded["edge_index"]
    vec = padded["pos"][dst] - padded["pos"][src]
    vec = vec + torch.einsum("ei,eij->ej", padded["edge_cell_shift"], padded["cell"][padded["batch"][src]])
    length = vec[e:].norm(dim=-1)
    assert bool((length > 4.0).all()) and padder.self_loop
    dead_system = padded["cell"].shape[0] - 1
    assert bool((padded["batch"][n:] == dead_system).all())
    assert int(padded["num_atoms"][dead_system]) == padded["pos"].shape[0] - n
    assert int(padded["num_atoms"].sum()) == padded["pos"].shape[0]


def test_joined_dead_atoms_leak_energy(model: torch.nn.Module) -> None:
    """Why the dead system: joined to the real system, dead atoms add their
    per-type energy shift (PerTypeScaleShift) to its energy."""
    adapter = adapters.get("nequip")
    data = adapter.engine.build_input(model, structure(0, np.random.default_rng(2)))
    ref = adapter.reference(model, data)
    own = adapter.wrap(model, compile=False)(data)
    join = adapter.wrap(model, compile=False, padder=nequip_adapter.make_padder(model, placement="join"))(data)
    assert_close(own, ref)
    leak = float((join["total_energy"] - ref["total_energy"]).abs().max())
    assert leak > 0.1, f"join placement expected to leak, measured dE = {leak:g}"


def test_matches_nequip_own_ase_calculator(model: torch.nn.Module) -> None:
    """ddpad's ASE calculator (compiled, padded) gives what nequip's own
    NequIPCalculator gives: energy, per-atom energies, forces, stress."""
    from nequip.integrations.ase import NequIPCalculator
    from nequip.integrations.utils import basic_transforms
    from nequip.utils import torch_default_dtype

    meta = model.metadata
    names = meta["type_names"].split(" ")
    native = NequIPCalculator(model, "cpu", transforms=basic_transforms(meta, float(meta["r_max"]), names,
                                                                        {t: t for t in names}))
    ours = Calculator(model, "nequip", backend="aot_eager", on_recompile="raise")
    rng = np.random.default_rng(3)
    for step in range(3):
        atoms = structure(step, rng)
        a, b = atoms.copy(), atoms.copy()
        a.calc, b.calc = native, ours
        # nequip's processes run with its global float64 default dtype, which
        # its calculator's data pipeline relies on (ddpad scopes it)
        with torch_default_dtype(torch.float64):
            want = (a.get_potential_energy(), a.get_forces(), a.get_stress(), a.get_potential_energies())
        assert abs(b.get_potential_energy() - want[0]) < ATOL
        np.testing.assert_allclose(b.get_forces(), want[1], rtol=0, atol=ATOL)
        np.testing.assert_allclose(b.get_stress(), want[2], rtol=0, atol=ATOL)
        np.testing.assert_allclose(b.get_potential_energies(), want[3], rtol=0, atol=ATOL)
    check_graphs(ours.wrapped)


def test_energy_only_mode_is_differentiable(model: torch.nn.Module) -> None:
    """``do_derivatives=False`` (the adapter's energy_only_options, what the
    LAMMPS engine calls) returns atomic energies attached to ``pos``; their
    gradient is minus the forces of the full call."""
    adapter = adapters.get("nequip")
    wrapped = adapter.wrap(model, backend="aot_eager", on_recompile="raise")
    data = adapter.engine.build_input(model, structure(4, np.random.default_rng(4)))
    ref = adapter.reference(model, data)
    pos = data["pos"].detach().clone().requires_grad_(True)
    out = wrapped({**data, "pos": pos}, **adapter.engine.energy_only_options)
    assert out["atomic_energy"].shape == ref["atomic_energy"].shape
    (grad,) = torch.autograd.grad(out["atomic_energy"].sum(), pos)
    torch.testing.assert_close(-grad, ref["forces"], rtol=0, atol=ATOL)
    torch.testing.assert_close(out["total_energy"].detach(), ref["total_energy"], rtol=0, atol=ATOL)


def test_unknown_element_is_a_clear_error(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match=r"\['Si'\]"):
        adapters.get("nequip").engine.build_input(model, bulk("Si", "diamond", a=5.43))


def _write_checkpoint(path: pathlib.Path, config: dict[str, Any], model: torch.nn.Module) -> None:
    """A nequip training checkpoint as lightning writes one (the parts
    nequip's loader reads): the training module's hyper-parameters and
    state dict, with ``model``'s weights."""
    import lightning
    from nequip.train import NequIPLightningModule
    from nequip.utils.versions import get_current_code_versions

    info = {"versions": get_current_code_versions(verbose=False),
            "training_module": {"_target_": "nequip.train.NequIPLightningModule"}}
    with nequip_adapter.global_state():
        module = NequIPLightningModule(model=config, num_datasets={"train": 1, "val": 1, "test": 0, "predict": 0},
                                       info_dict=info)
    module.model["sole_model"].load_state_dict(model.state_dict())
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "pytorch-lightning_version": lightning.__version__}, path)


def test_load_model_from_nequip_checkpoint(tmp_path: pathlib.Path, model: torch.nn.Module) -> None:
    """A random model saved as a nequip checkpoint loads through
    ``adapter.tools.load_model`` and gives the same outputs; nequip.net IDs are refused."""
    adapter = adapters.get("nequip")
    path = tmp_path / "random.ckpt"
    _write_checkpoint(path, nequip_adapter.random_model_config(torch.float64), model)
    loaded = adapter.tools.load_model(str(path), "cpu")
    data = adapter.engine.build_input(model, structure(5, np.random.default_rng(5)))
    assert_close(adapter.reference(loaded, data), adapter.reference(model, data), atol=0.0)
    assert torch.get_default_dtype() == torch.float32  # nequip's global state stayed scoped
    with pytest.raises(ValueError, match="local files only"):
        adapter.tools.load_model("nequip.net:mir-group/NequIP-OAM-L:0.1", "cpu")


def test_cli_run_three_steps(tmp_path: pathlib.Path) -> None:
    res = subprocess.run([sys.executable, "-m", "ddpad", "run", "nequip", "--steps", "3", "--backend", "aot_eager"],
                         check=False, capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "steps/s" in res.stdout + res.stderr


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_one_graph(model: torch.nn.Module) -> None:
    adapter = adapters.get("nequip")
    rng = np.random.default_rng(6)
    steps = [adapter.engine.build_input(model, structure(i, rng)) for i in range(10)]
    caps: dict[str, int] = {}  # size the caps on the trajectory first: one inductor compile
    for data in steps:
        adapter.make_padder(model).pad(data, caps)
    wrapped = adapter.wrap(model, backend="inductor", on_recompile="raise", caps=caps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for data in steps:
            assert_close(wrapped(data), adapter.reference(model, data), atol=1e-9)
    assert wrapped.stats.graphs == 1 and wrapped.stats.growths == []


def test_message_layers_are_the_convolutions() -> None:
    """The LAMMPS engine checks ghost atoms ``message_layers x cutoff`` deep:
    NequIP passes messages once per convolution layer."""
    adapter = adapters.get("nequip")
    assert adapter.engine.message_layers(nequip_adapter.random_model(torch.float64, num_layers=2)) == 2
    assert adapter.engine.message_layers(nequip_adapter.random_model(torch.float64, num_layers=3)) == 3
