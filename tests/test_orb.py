"""Orb adapter: exact, NaN-free, one compiled graph through MD (orb environment)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("orb_models")
import ddpad
from ase.build import bulk, molecule
from ddpad import adapters
from ddpad.adapters import orb as orb_adapter
from ddpad.adapters.orb import make_padder
from ddpad.testing import AdapterTests

KEYS = {
    True: ("energy", "grad_forces", "grad_stress", "rotational_grad", "confidence"),
    False: ("energy", "forces", "stress", "confidence"),
}


def random_model(conservative: bool = True, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    """A small random Orb v3 (radius 6 A, 20 neighbours) with random biases,
    normaliser statistics and orb's reference energies (so a dead atom joined
    to a real system would leak)."""
    return orb_adapter.random_model(dtype, conservative=conservative, seed=seed)


def structure(step: int, rng: np.random.Generator, cells: tuple[int, int, int] = (1, 1, 2)) -> Any:
    """A rattled periodic 3-element crystal that loses a few atoms."""
    atoms = bulk("C", "diamond", a=3.57, cubic=True) * cells
    atoms.numbers[::3] = 1
    atoms.numbers[1::5] = 8
    keep = np.sort(rng.permutation(len(atoms))[: len(atoms) - int(rng.integers(0, 5))])
    atoms = atoms[keep]
    atoms.rattle(0.08, seed=step)
    return atoms


def assert_exact(out: dict[str, Any], ref: dict[str, Any], keys: tuple[str, ...], atol: float = 1e-10) -> None:
    for key in keys:
        assert out[key].shape == ref[key].shape and out[key].dtype == ref[key].dtype, key
        torch.testing.assert_close(out[key].detach(), ref[key].detach(), rtol=0, atol=atol, msg=key)
    assert set(out) == set(ref)


def check_compiles(stats: ddpad.Stats) -> None:
    growth_calls = {e.call for e in stats.growths}
    assert stats.graphs == 1 + len(growth_calls)
    assert set(stats.graphs_by_call) <= {0} | growth_calls
    assert stats.unexplained == []


def check_compiles_per_frame(stats: ddpad.Stats) -> None:
    """Orb's direct heads branch on data (net-torque removal, normaliser
    check) in Python: graph breaks of orb's own, counted per frame."""
    growth_calls = {e.call for e in stats.growths}
    assert stats.max_graphs_per_frame == 1 + len(growth_calls)
    assert set(stats.graphs_by_call) <= {0} | growth_calls
    assert stats.unexplained == []


@pytest.mark.parametrize("conservative", [True, False], ids=["conservative", "direct"])
def test_trajectory_exact_with_one_graph_per_growth(conservative: bool) -> None:
    model = random_model(conservative)
    adapter = adapters.get("orb")
    wrapped = adapter.wrap(model, backend="aot_eager", on_recompile="raise")
    rng = np.random.default_rng(0)
    atoms_seen, edges_seen = set(), set()
    for step in range(12):
        cells = (1, 1, 2) if step < 6 else (1, 2, 2)  # forces growth of atoms and edges
        data = adapter.engine.build_input(model, structure(step, rng, cells))
        atoms_seen.add(int(data.n_node.sum()))
        edges_seen.add(int(data.n_edge.sum()))
        out = wrapped(data)
        assert_exact(out, adapter.reference(model, data), KEYS[conservative])
    assert len(atoms_seen) >= 4 and len(edges_seen) >= 4
    assert wrapped.stats.growths, "the trajectory should grow the caps"
    if conservative:
        check_compiles(wrapped.stats)
    else:
        check_compiles_per_frame(wrapped.stats)


def test_batches_with_changing_system_count() -> None:
    model = random_model()
    adapter = adapters.get("orb")
    wrapped = adapter.wrap(model, backend="aot_eager", on_recompile="raise")
    rng = np.random.default_rng(3)
    mol = molecule("H2O")
    mol.center(vacuum=4.0)
    for step in range(6):
        count = (3, 2, 3, 1, 2, 3)[step]
        batch = [structure(step, rng) for _ in range(count - 1)] + [mol]
        data = adapter.engine.build_input(model, batch)
        out = wrapped(data)
        assert out["energy"].shape == (count,)
        assert_exact(out, adapter.reference(model, data), KEYS[True])
    check_compiles(wrapped.stats)
    assert wrapped.caps["systems"] >= 4


@pytest.mark.parametrize("conservative", [True, False], ids=["conservative", "direct"])
def test_dead_rows_are_inert_and_nan_free(conservative: bool) -> None:
    from ddpad.adapters.orb import _step, prepare_model

    model = random_model(conservative)
    prepared = prepare_model(model)
    data = adapters.get("orb").engine.build_input(model, structure(0, np.random.default_rng(1)))
    padder = make_padder(model)
    padded = padder.pad(data, {})
    n, s, e = int(data.n_node.sum()), data.n_node.shape[0], data.senders.shape[0]

    def run(graph: Any) -> dict[str, Any]:
        return _step(prepared, graph.clone().detach())

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # orb's CPU backward reassociates across threads (4e-19): bit-compare on one
    try:
        clean, raw = _clean_and_dirty(run, padded, n, s, e)
    finally:
        torch.set_num_threads(threads)
    for key, value in raw.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert torch.isfinite(value).all(), key
    clean, raw = padder.unpad(clean), padder.unpad(raw)
    for key in KEYS[conservative]:
        assert torch.equal(clean[key], raw[key]), key
    # every dead edge is longer than the cutoff, as stored and as recomputed
    vec = padded.node_features["positions"][padded.receivers] - padded.node_features["positions"][padded.senders]
    cells = padded.system_features["cell"][padded._get_per_edge_graph_indices()]
    recomputed = vec + torch.bmm(padded.edge_features["unit_shifts"].unsqueeze(1), cells).squeeze(1)
    cutoff = orb_adapter.ADAPTER.cutoff(model)
    assert bool((recomputed[e:].norm(dim=-1) > cutoff).all())
    torch.testing.assert_close(recomputed[e:], padded.edge_features["vectors"][e:], rtol=0, atol=1e-12)
    assert int(padded.n_node.sum()) == padded.node_features["positions"].shape[0]
    assert int(padded.n_edge.sum()) == padded.senders.shape[0]


def _clean_and_dirty(run: Any, padded: Any, n: int, s: int, e: int) -> tuple[Any, Any]:
    """The padded graph's outputs, and those with dead rows overwritten by large random values."""
    clean = run(padded)
    dirty = padded.clone().detach()
    gen = torch.Generator().manual_seed(0)
    pos = dirty.node_features["positions"]
    pos[n:] = torch.randn(pos[n:].shape, generator=gen, dtype=pos.dtype) * 1e3 + 1e4  # still far away
    emb = dirty.node_features["atomic_numbers_embedding"]
    emb[n:] = torch.randn(emb[n:].shape, generator=gen, dtype=emb.dtype) * 1e3
    dirty.system_features["cell"][s:] *= 1.0 + torch.rand(1, generator=gen, dtype=pos.dtype)  # still > cutoff
    dirty.edge_features["vectors"][e:] *= 1.0 + torch.rand(1, generator=gen, dtype=pos.dtype)
    return clean, run(dirty)


def test_joined_dead_atoms_leak_energy() -> None:
    """Why the dead system: joined to a real system, dead atoms add their
    energy-head output and reference energy to it."""
    model = random_model()
    adapter = adapters.get("orb")
    data = adapter.engine.build_input(model, structure(0, np.random.default_rng(2)))
    ref = adapter.reference(model, data)
    own = ddpad.wrap(model, "orb", compile=False)(data)
    join = ddpad.wrap(model, "orb", compile=False, padder=make_padder(model, placement="join"))(data)
    assert_exact(own, ref, KEYS[True])
    leak = float((join["energy"] - ref["energy"]).abs().max())
    assert leak > 0.1, f"join placement expected to leak, measured dE = {leak:g}"


def test_float32_noise_bound() -> None:
    """float32: padded vs eager within the eager model's own run-to-run
    reassociation noise (measured here: see docs/pages/adapters/orb.md)."""
    model = random_model(dtype=torch.float32)
    adapter = adapters.get("orb")
    wrapped = adapter.wrap(model, backend="aot_eager", on_recompile="raise")
    rng = np.random.default_rng(5)
    for step in range(4):
        data = adapter.engine.build_input(model, structure(step, rng))
        out = wrapped(data)
        ref = adapter.reference(model, data)
        for key in ("energy", "grad_forces", "grad_stress"):
            scale = float(ref[key].abs().max()) + 1.0
            torch.testing.assert_close(out[key], ref[key], rtol=0, atol=2e-5 * scale, msg=key)
    check_compiles(wrapped.stats)


def test_build_input_errors() -> None:
    from ase import Atoms

    model = random_model()
    adapter = adapters.get("orb")
    with pytest.raises(ValueError, match="at least one"):
        adapter.engine.build_input(model, [])
    with pytest.raises(ValueError, match="no atoms"):
        adapter.engine.build_input(model, Atoms())
    with pytest.raises(ValueError, match="outside orb's elements"):
        adapter.engine.build_input(model, Atoms("X", positions=[[0, 0, 0]]))


def test_properties_and_ase_calculator() -> None:
    from ase.stress import full_3x3_to_voigt_6_stress
    from ddpad.ase import Calculator

    model = random_model()
    atoms = structure(0, np.random.default_rng(6))
    atoms.calc = Calculator(model, "orb", backend="aot_eager", on_recompile="raise")
    energy, forces, stress = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
    adapter = adapters.get("orb")
    ref = adapter.reference(model, adapter.engine.build_input(model, atoms))
    assert abs(energy - float(ref["energy"].sum())) < 1e-10
    np.testing.assert_allclose(forces, ref["grad_forces"].detach().numpy(), rtol=0, atol=1e-10)
    # orb's own calculator reports grad_stress (Voigt) as ASE's stress
    np.testing.assert_allclose(stress, ref["grad_stress"][0].detach().numpy(), rtol=0, atol=1e-10)
    flat = adapter.flat(ref)
    np.testing.assert_allclose(full_3x3_to_voigt_6_stress(flat["stress"][0].detach().numpy()), stress, atol=1e-10)


def test_load_model_roundtrip(tmp_path: pathlib.Path) -> None:
    """A whole module (torch.save) and an orb state-dict checkpoint named after
    its architecture, loaded by orb's own loader."""
    adapter = adapters.get("orb")
    model = random_model()
    torch.save(model, tmp_path / "small.pt")
    loaded = adapter.tools.load_model(str(tmp_path / "small.pt"), "cpu")
    data = adapter.engine.build_input(model, structure(0, np.random.default_rng(7)))
    # orb's eager backward is not bit-reproducible run to run on CPU (4e-19 measured)
    assert_exact(adapter.reference(loaded, data), adapter.reference(model, data), KEYS[True], atol=1e-15)

    from orb_models.forcefield import pretrained

    big = pretrained.orb_v3_direct_architecture()  # the full architecture orb's loader builds
    path = tmp_path / "orb-v3-direct-20-omat-test.ckpt"
    torch.save(big.state_dict(), path)
    before = torch.get_default_dtype()
    again = adapter.tools.load_model(str(path), "cpu")
    assert type(again) is type(big)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), big.state_dict().values()))
    assert torch.get_default_dtype() == before  # orb's loader sets it globally: restored


def test_cli_run() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ddpad", "run", "orb", "--steps", "3", "--backend", "aot_eager"],
        check=False, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "graphs" in proc.stdout


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_one_graph() -> None:
    model = random_model()
    adapter = adapters.get("orb")
    rng = np.random.default_rng(4)
    steps = [adapter.engine.build_input(model, structure(i, rng)) for i in range(8)]
    caps: dict[str, int] = {}  # size the caps on the trajectory first: one inductor compile
    for data in steps:
        make_padder(model).pad(data, caps)
    wrapped = adapter.wrap(model, backend="inductor", on_recompile="raise", caps=caps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for data in steps:
            assert_exact(wrapped(data), adapter.reference(model, data), KEYS[True], atol=1e-9)
    assert wrapped.stats.graphs == 1 and wrapped.stats.growths == []


def _one_thread_run(**options: Any) -> ddpad.PaddedModel:
    """Three steps of the random conservative model compiled by Inductor at
    one thread, each held to the eager model's numbers (1e-9)."""
    model = random_model()
    adapter = adapters.get("orb")
    rng = np.random.default_rng(5)
    steps = [adapter.engine.build_input(model, structure(i, rng)) for i in range(3)]
    caps: dict[str, int] = {}
    for data in steps:
        make_padder(model).pad(data, caps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        wrapped = adapter.wrap(model, backend="inductor", caps=caps, **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for data in steps:
                assert_exact(wrapped(data), adapter.reference(model, data), KEYS[True], atol=1e-9)
    finally:
        torch.set_num_threads(threads)
    return wrapped


def test_inductor_at_one_thread_compiles_orb_right() -> None:
    """Inductor's CPU code at one thread put orb's ``scatter_mean`` count's
    ``where`` before its ``scatter_add_`` (every count one too high; torch
    2.13.0, energy 1e-3 relative off); the first-use check caught it and the
    caps ran eager (1.07-1.46x ORBCalculator's ASE step). The adapter's
    ``inductor_options`` (``cpp.dynamic_threads``) keep the scatter on
    ATen's kernel: the compiled graph passes its check and is used."""
    s = _one_thread_run().stats
    assert (s.graphs, s.checks, s.disagreements, s.eager_forms) == (1, 1, 0, 0)


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_at_one_thread_without_the_option_is_caught() -> None:
    """The caller's ``options=`` win over the adapter's: without
    ``cpp.dynamic_threads`` the graph is wrong, the check catches it, and
    the numbers are still the eager model's (one warning)."""
    s = _one_thread_run(options={"cpp.dynamic_threads": False}).stats
    assert s.checks == 1 and s.eager_forms == s.disagreements == 1


class TestOrbConformance(AdapterTests):
    """The conformance kit on the conservative model (float64)."""

    adapter = "orb"
    atol = 1e-10

    @pytest.fixture
    def model(self) -> torch.nn.Module:
        return random_model()

    @pytest.fixture
    def trajectory(self) -> list[Any]:
        rng = np.random.default_rng(11)
        return [structure(0, rng), structure(1, rng), [structure(2, rng), structure(3, rng)], structure(4, rng)]

    @pytest.fixture
    def foundation_structures(self) -> list[Any]:
        """Orb v3 conservative-inf and direct-20 (the published architectures,
        random weights) run two cells of the trajectory's crystal, one unit
        cell each (up to 120 neighbours
        within 6 A per atom, as in a larger cell), the larger first: both
        run at the first call's caps, so each model compiles once (a cap
        growth compiles the 25M-parameter conservative graph again: 13-21 s)."""
        rng = np.random.default_rng(11)
        cells = sorted((structure(step, rng, (1, 1, 1)) for step in range(2)), key=len, reverse=True)
        assert len(cells[0]) > len(cells[1])
        return cells
