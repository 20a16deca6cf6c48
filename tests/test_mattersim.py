"""MatterSim adapter: exact, NaN-free, one compiled graph through MD (mattersim environment).

mattersim runs in float32 only. Its CPU scatter sums are not bit-reproducible
from run to run with several threads: the same input twice differs by up to
about 1e-8 eV/A in the forces (~0.02 eV/A here) and 5e-7 GPa in the
stresses (~1 GPa) of these systems (measured by
:func:`test_float32_noise_is_far_below_the_tolerance`, which keeps ``ATOL``
honest). Energies (about 50 eV) repeat bit for bit.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("mattersim")
import ddpad
from ase.build import bulk, molecule
from ddpad import adapters
from ddpad.adapters import mattersim as mattersim_adapter
from ddpad.adapters.mattersim import make_padder
from ddpad.testing import AdapterTests, default_trajectory

CUTOFF, THREEBODY_CUTOFF = 4.0, 3.0  # smaller than mattersim's 5 / 4 A: fewer triplets, quicker tests
# float32 run-to-run noise of the eager model (measured below): forces <= 1e-8 eV/A,
# stresses <= 5e-7 GPa (~1 GPa: a few ulps); energies (~50 eV) repeat bit for bit
ATOL = 1e-5
RTOL = 1e-6
KEYS = ("total_energy", "forces", "stresses")


def random_model(seed: int = 0) -> torch.nn.Module:
    """A small random mattersim Potential (2 blocks, 32 units) with random
    biases and normaliser shift / scale (a dead atom joined to a real system
    would leak)."""
    return mattersim_adapter.random_model(
        torch.float32, cutoff=CUTOFF, threebody_cutoff=THREEBODY_CUTOFF, units=32, seed=seed,
    )


def structure(step: int, rng: np.random.Generator, cells: tuple[int, int, int] = (1, 1, 2)) -> Any:
    """A rattled periodic 3-element crystal that loses a few atoms."""
    atoms = bulk("C", "diamond", a=3.57, cubic=True) * cells
    atoms.numbers[::3] = 14
    atoms.numbers[1::5] = 8
    keep = np.sort(rng.permutation(len(atoms))[: len(atoms) - int(rng.integers(0, 4))])
    atoms = atoms[keep]
    atoms.rattle(0.08, seed=step)
    return atoms


def assert_exact(out: dict[str, Any], ref: dict[str, Any], keys: tuple[str, ...] = KEYS, atol: float = ATOL) -> None:
    assert set(out) == set(ref)
    for key in keys:
        assert out[key].shape == ref[key].shape and out[key].dtype == ref[key].dtype, key
        assert torch.isfinite(out[key]).all(), key
        torch.testing.assert_close(out[key].detach(), ref[key].detach(), rtol=RTOL, atol=atol, msg=key)


def check_compiles(stats: ddpad.Stats) -> None:
    growth_calls = {e.call for e in stats.growths}
    assert stats.graphs == 1 + len(growth_calls), (stats.graphs, stats.growths)
    assert set(stats.graphs_by_call) <= {0} | growth_calls
    assert stats.unexplained == []


class TestMatterSim(AdapterTests):
    """The conformance kit (float32, within the model's own noise)."""
    aot_route = True  # compile_mode="aot": every call form takes a package (docs/pages/compile-store.md)

    adapter = "mattersim"
    dtype = torch.float32
    atol = ATOL
    rtol = RTOL

    @pytest.fixture
    def model(self) -> torch.nn.Module:
        return random_model()

    @pytest.fixture
    def trajectory(self, resolved: Any) -> list[Any]:
        # 64-atom diamond losing atoms, a batch of two at step 2: atom, edge,
        # triplet and system counts all change, and the caps grow once
        return default_trajectory(resolved, steps=5)

    @pytest.fixture
    def foundation_structures(self) -> list[Any]:
        """MatterSim 1M and 5M run three 5-8 atom C/Si/O crystals, not the
        64-atom diamond: each model's aot_eager compile (~15 s of CPU) is
        most of the time, and the diamond's 100k triplets
        added ~10 s more per model. Largest first: the caps fit all three, one
        compile per model (a growth would compile the same model again)."""
        rng = np.random.default_rng(6)
        return sorted((structure(step, rng, (1, 1, 1)) for step in range(3)), key=len, reverse=True)


def test_padded_graph_is_consistent_and_dead_triplets_are_inert() -> None:
    """Dead triplets reference the last edge row, a dead edge of the dead
    anchor pair longer than both cutoffs: mattersim's three-body envelope is
    exactly 0 there. Every count field adds up to the padded sizes."""
    from mattersim.forcefield.m3gnet.modules.message_passing import polynomial

    model = random_model()
    adapter = adapters.get("mattersim")
    data = adapter.engine.build_input(model, [structure(0, np.random.default_rng(0)), structure(1, np.random.default_rng(1))])
    n, e, t, s = (data["atom_pos"].shape[0], data["edge_index"].shape[1], data["three_body_indices"].shape[0],
                  data["num_atoms"].shape[0])
    padder = make_padder(model)
    caps: dict[str, int] = {}
    padded = padder.pad(data, caps)
    n_cap, e_cap, t_cap, s_cap = caps["atoms"], caps["edges"], caps["triplets"], caps["systems"]
    assert n < n_cap and e < e_cap and t < t_cap and s < s_cap
    assert padded["atom_pos"].shape[0] == n_cap and padded["edge_index"].shape[1] == e_cap
    assert padded["three_body_indices"].shape == (t_cap, 2)
    assert (padded["total_num_atoms"], padded["total_num_bonds"], padded["num_graphs"]) == (n_cap, e_cap, s_cap)
    assert int(padded["num_atoms"].sum()) == n_cap and int(padded["num_bonds"].sum()) == e_cap
    assert int(padded["num_three_body"].sum()) == t_cap and int(padded["num_triple_ij"].sum()) == t_cap
    # the edge map is what mattersim would compute from num_triple_ij
    expected_map = torch.repeat_interleave(torch.arange(e_cap), padded["num_triple_ij"].view(-1))
    assert torch.equal(padded["three_body_edge_map"], expected_map)
    # dead triplets: both edges are the last (dead) edge; real ones are untouched
    index = padded["three_body_indices"] + padded["bond_index_bias"]
    assert bool((index[t:] == e_cap - 1).all())
    assert torch.equal(index[:t], data["three_body_indices"] + data["bond_index_bias"])
    # dead edges join dead atoms only, are longer than both cutoffs, and the
    # three-body envelope is exactly zero on them (and its gradient too)
    ei = padded["edge_index"]
    assert bool((ei[:, e:] >= n).all()) and bool((ei[:, :e] < n).all())
    pos, cell = padded["atom_pos"], padded["cell"]
    vec = pos[ei[0]] - (pos[ei[1]] + torch.einsum("bi, bij->bj", padded["pbc_offsets"], cell[padded["batch"][ei[0]]]))
    length = vec.norm(dim=-1)[e:].clone().requires_grad_(True)
    assert bool((length > CUTOFF).all())
    envelope = polynomial(length, THREEBODY_CUTOFF)
    assert bool((envelope == 0).all())
    (grad,) = torch.autograd.grad(envelope.sum(), length)
    assert bool((grad == 0).all())
    # outputs are finite everywhere, dead rows included
    out = mattersim_adapter._step(mattersim_adapter.prepare_model(model), padded)
    for key, value in out.items():
        assert torch.isfinite(value).all(), key
    assert_exact(padder.unpad(out), adapter.reference(model, data))


def test_triplet_growth_alone_recompiles_once() -> None:
    """With atoms, edges and systems preset large, a trajectory whose triplet
    count climbs grows only the triplets cap: one graph plus one for it."""
    model = random_model()
    adapter = adapters.get("mattersim")
    rng = np.random.default_rng(2)
    steps = [structure(0, rng), structure(1, rng, (1, 2, 2)), structure(2, rng)]  # twice the atoms in step 1
    data = [adapter.engine.build_input(model, s) for s in steps]
    triplets = [d["three_body_indices"].shape[0] for d in data]
    caps: dict[str, int] = {}
    make_padder(model).pad(data[0], caps)
    preset = {**caps, "atoms": 4 * caps["atoms"], "edges": 4 * caps["edges"], "systems": caps["systems"]}
    wrapped = adapter.wrap(model, backend="aot_eager", on_recompile="raise", caps=preset)
    for d in data:
        assert_exact(wrapped(d), adapter.reference(model, d))
    assert triplets[1] > caps["triplets"], triplets
    assert [e.key for e in wrapped.stats.growths] == ["triplets"]
    check_compiles(wrapped.stats)


def test_joined_dead_atoms_leak_energy() -> None:
    """Why the dead system: joined to a real system, dead atoms (Z = 0) add
    their per-atom energy (random normaliser shift) to it."""
    model = random_model()
    adapter = adapters.get("mattersim")
    data = adapter.engine.build_input(model, structure(0, np.random.default_rng(3)))
    ref = adapter.reference(model, data)
    own = ddpad.wrap(model, "mattersim", compile=False)(data)
    join = ddpad.wrap(model, "mattersim", compile=False, padder=make_padder(model, placement="join"))(data)
    assert_exact(own, ref)
    leak = float((join["total_energy"] - ref["total_energy"]).detach().abs().max())
    assert leak > 0.1, f"join placement expected to leak, measured dE = {leak:g}"
    torch.testing.assert_close(join["forces"], ref["forces"], rtol=RTOL, atol=ATOL)  # no edge reaches them


def test_float32_noise_is_far_below_the_tolerance() -> None:
    """The eager model's own run-to-run noise (the same input three times)
    and the padded model's deviation from it, on the conformance trajectory."""
    model = random_model()
    adapter = adapters.get("mattersim")
    plain = adapter.wrap(model, compile=False)
    worst_noise, worst_dev = 0.0, 0.0
    for structure_ in default_trajectory(adapter, steps=3):
        data = adapter.engine.build_input(model, structure_)
        runs = [adapter.reference(model, data) for _ in range(3)]
        out = plain(data)
        for key in KEYS:
            want = runs[0][key].detach()
            worst_noise = max(worst_noise, *(float((r[key].detach() - want).abs().max()) for r in runs))
            worst_dev = max(worst_dev, float((out[key].detach() - want).abs().max()))
        assert float(runs[0]["forces"].abs().max()) > 5e-3  # forces large enough for a leak to show
    assert worst_noise < ATOL / 10 and worst_dev < ATOL / 10, (worst_noise, worst_dev)


def test_molecules_without_cell() -> None:
    """Non-periodic molecules (mattersim boxes them in a large cubic cell) batch and pad too."""
    model = random_model()
    adapter = adapters.get("mattersim")
    wrapped = adapter.wrap(model, compile=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mattersim: "No PBC detected, using a large supercell"
        for batch in ([molecule("H2O"), molecule("CH4")], [molecule("C2H6")]):
            data = adapter.engine.build_input(model, batch)
            assert_exact(wrapped(data), adapter.reference(model, data))


def test_build_input_errors() -> None:
    from ase import Atoms

    model = random_model()
    adapter = adapters.get("mattersim")
    with pytest.raises(ValueError, match="at least one"):
        adapter.engine.build_input(model, [])
    with pytest.raises(ValueError, match="no atoms"):
        adapter.engine.build_input(model, Atoms())
    with pytest.raises(ValueError, match="outside the model's elements"):
        adapter.engine.build_input(model, Atoms("X", positions=[[0, 0, 0]], cell=[5, 5, 5], pbc=True))
    with pytest.raises(ValueError, match="float32 only"):
        mattersim_adapter.random_model(torch.float64)
    with pytest.raises(TypeError, match="mattersim Potential"):
        make_padder(torch.nn.Linear(2, 2))


def test_checkpoint_round_trip(tmp_path: pathlib.Path) -> None:
    """A random model saved by mattersim's own ``Potential.save`` (and its
    M3GNet as a whole module) loads through the adapter and gives the same results."""
    model = random_model()
    path = tmp_path / "random_mattersim.pth"
    model.save(str(path))
    torch.save(model.model, tmp_path / "whole.pt")
    adapter = adapters.get("mattersim")
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        loaded = adapter.tools.load_model(str(path), "cpu")
        assert torch.backends.cuda.matmul.allow_tf32 is True  # mattersim's Potential sets it globally: restored
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    whole = adapter.tools.load_model(str(tmp_path / "whole.pt"), "cpu")
    data = adapter.engine.build_input(model, structure(0, np.random.default_rng(4)))
    for other in (loaded, whole):
        assert_exact(adapter.reference(other, data), adapter.reference(model, data))
    with pytest.raises(FileNotFoundError):
        adapter.tools.load_model("mattersim-v1.0.0-1M", "cpu")  # a pretrained name, not a file: never downloaded


def test_ase_calculator_matches_mattersim_own_calculator() -> None:
    """``ddpad.ase.Calculator`` (padded) against mattersim's own
    ``MatterSimCalculator`` on the same model: energy, forces, stress (ASE's
    Voigt order, sign and units)."""
    from mattersim.forcefield.potential import MatterSimCalculator

    model = random_model()
    atoms = structure(0, np.random.default_rng(5), (2, 1, 1))
    atoms.calc = ddpad.ase.Calculator(model, "mattersim", compile=False)
    probe = atoms.copy()
    probe.calc = MatterSimCalculator(potential=model, device="cpu")
    for step in range(2):
        atoms.rattle(0.02, seed=10 + step)
        probe.positions = atoms.positions
        assert abs(atoms.get_potential_energy() - probe.get_potential_energy()) < 1e-4
        np.testing.assert_allclose(atoms.get_forces(), probe.get_forces(), rtol=0, atol=ATOL)
        np.testing.assert_allclose(atoms.get_stress(), probe.get_stress(), rtol=0, atol=ATOL)


def test_cli_run_three_steps(tmp_path: pathlib.Path) -> None:
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    res = subprocess.run(
        [sys.executable, "-m", "ddpad", "run", "mattersim", "--steps", "3", "--backend", "aot_eager"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900, check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "RANDOMLY INITIALISED" in res.stdout and "compiled graphs: 1" in res.stdout, res.stdout


def test_fake_trace_of_the_step_reads_no_size_from_the_data() -> None:
    """The ahead-of-time route traces the step with ``make_fx`` in fake mode.
    mattersim's ``int(num_atoms.sum())`` (the unused default of
    ``input.get("total_num_atoms", ...)``) made it fail ("data-dependent
    expression u0"); the step gives mattersim one-element host counts
    instead. The trace reads no scalar from the data and gives the eager
    step's numbers."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils import _pytree as pytree

    model = random_model()
    forward = mattersim_adapter.prepare_model(model)
    adapter = adapters.get("mattersim")
    rng = np.random.default_rng(7)
    data = adapter.engine.build_input(model, [structure(0, rng), structure(1, rng)])
    padded = make_padder(model).pad(data, {})
    flat, spec = pytree.tree_flatten(padded)

    def rebuilt(leaves: Any) -> dict[str, Any]:
        it = iter(leaves)
        return pytree.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in flat], spec)

    def step(*leaves: torch.Tensor) -> list[torch.Tensor]:
        return [v.detach() for v in mattersim_adapter._step(forward, rebuilt(leaves)).values()]

    tensors = [x.detach().clone() for x in flat if isinstance(x, torch.Tensor)]
    graph = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*tensors)
    reads = [n for n in graph.graph.nodes if "_local_scalar_dense" in str(n.target)]
    assert reads == [], reads
    got = graph(*(t.clone() for t in tensors))
    ref = mattersim_adapter._step(forward, rebuilt([t.clone() for t in tensors]))
    assert len(got) == len(ref) == 3
    for (key, want), have in zip(ref.items(), got):
        torch.testing.assert_close(have, want.detach(), rtol=RTOL, atol=ATOL, msg=key)


def test_models_built_here_pickle_for_a_worker(tmp_path: pathlib.Path) -> None:
    """A background build's worker gets the model pickled; mattersim's
    ``Potential`` holds torch_ema's EMA, whose weak references do not pickle
    ("cannot pickle 'weakref.ReferenceType'": every ``ddpad precompile
    mattersim --aot`` build failed). The potentials the adapter builds
    (``random_model``, ``load_model``) carry an EMA that pickles, with its
    state, and ``Potential.save`` still works on the copy."""
    import io

    model = random_model()
    model.save(str(tmp_path / "saved.pth"))
    for potential in (model, adapters.get("mattersim").tools.load_model(str(tmp_path / "saved.pth"), "cpu")):
        buffer = io.BytesIO()
        torch.save(potential, buffer)
        buffer.seek(0)
        copy_ = torch.load(buffer, weights_only=False)
        params = list(copy_.model.parameters())
        assert [ref() for ref in copy_.ema._params_refs] == params  # the copy's own parameters
        for shadow, want in zip(copy_.ema.shadow_params, potential.ema.shadow_params):
            assert torch.equal(shadow, want)
        copy_.save(str(tmp_path / "copy.pth"))
        data = adapters.get("mattersim").engine.build_input(model, structure(0, np.random.default_rng(9)))
        assert_exact(adapters.get("mattersim").reference(copy_, data), adapters.get("mattersim").reference(model, data))


def test_precompile_aot_then_a_fresh_run_loads_and_checks_the_package(tmp_path: pathlib.Path) -> None:
    """A real AOTInductor build of MatterSim in the default run (about 50 s
    of build, 70 s in all, on 2 cores): ``ddpad precompile mattersim --aot``
    builds the fitted caps' package in a worker (before: the trace failed on
    a data-dependent size, and the model did not pickle for the worker), and
    a fresh ``ddpad run mattersim --aot`` loads it, checks its first call
    against the eager step and compiles nothing."""
    from _cli import check_precompiled_run

    # a package load (0.03 s) and its eager check (2 s: 131k triplets): room for a busy machine
    check_precompiled_run("mattersim", tmp_path, first_call_limit=10.0)


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_one_graph() -> None:
    model = random_model()
    adapter = adapters.get("mattersim")
    rng = np.random.default_rng(6)
    steps = [adapter.engine.build_input(model, structure(i, rng)) for i in range(4)]
    caps: dict[str, int] = {}  # size the caps on the trajectory first: one inductor compile
    for data in steps:
        make_padder(model).pad(data, caps)
    wrapped = adapter.wrap(model, backend="inductor", on_recompile="raise", caps=caps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for data in steps:
            assert_exact(wrapped(data), adapter.reference(model, data), atol=1e-5)
    assert wrapped.stats.graphs == 1 and wrapped.stats.growths == []
