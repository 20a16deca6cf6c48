"""SevenNet adapter: exact, NaN-free, one compiled graph through MD (sevenn environment).

SevenNet is float32 only, and its CPU scatter sums are not bit-reproducible
from run to run with several threads (the same input twice differs by about
6e-8 in the forces, measured here). Exactness is asserted within ``ATOL``,
over a hundred times that noise and a few float32 ulps of the energies
these systems have; :func:`test_float32_noise_is_far_below_the_tolerance`
measures the noise and keeps it honest. Bit-identity is asserted on one
thread, where sevenn is deterministic.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pathlib
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("sevenn")
import ddpad  # noqa: E402
import ddpad.adapters as adapters  # noqa: E402
from ase.build import bulk, molecule  # noqa: E402
from ddpad.adapters import sevennet as sevennet_adapter  # noqa: E402
from ddpad.adapters.sevennet import make_padder  # noqa: E402
from ddpad.cli._report import checks_line  # noqa: E402
from ddpad.testing import AdapterTests  # noqa: E402

CUTOFF = 4.0
ZS = (1, 6, 8)
ATOL = 1e-5  # energies here are 20 to 100 eV: one float32 ulp is 2e-6 to 8e-6
RTOL = 1e-6
KEYS = ("inferred_total_energy", "inferred_force", "inferred_stress", "atomic_energy")


def random_model(seed: int = 0) -> torch.nn.Module:
    """A random SevenNet: float32, 3 elements, 2 interactions, random biases
    and non-zero species-wise shifts (a dead atom joined to a real system
    would leak)."""
    return sevennet_adapter.random_model(torch.float32, cutoff=CUTOFF, atomic_numbers=ZS, seed=seed)


def structure(step: int, rng: np.random.Generator, cells: tuple[int, int, int] = (1, 1, 2)) -> Any:
    """A rattled periodic 3-element crystal that loses a few atoms."""
    atoms = bulk("C", "diamond", a=3.57, cubic=True) * cells
    atoms.numbers[::3] = 1
    atoms.numbers[1::5] = 8
    keep = np.sort(rng.permutation(len(atoms))[: len(atoms) - int(rng.integers(0, 5))])
    atoms = atoms[keep]
    atoms.rattle(0.08, seed=step)
    return atoms


def assert_exact(out: dict[str, Any], ref: dict[str, Any], atol: float = ATOL, keys: tuple[str, ...] = KEYS) -> None:
    """Same keys, shapes and dtypes as the eager model's output; the
    predictions ``keys`` within ``atol``."""
    assert set(out) == set(ref)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert out[key].shape == value.shape and out[key].dtype == value.dtype, key
    for key in keys:
        torch.testing.assert_close(out[key].detach(), ref[key].detach(), rtol=RTOL, atol=atol, msg=key)


def check_compiles(stats: ddpad.Stats) -> None:
    growth_calls = {e.call for e in stats.growths}
    assert stats.graphs == 1 + len(growth_calls)
    assert set(stats.graphs_by_call) <= {0} | growth_calls
    assert stats.unexplained == []


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """sevenn's CPU scatter sums are bit-reproducible on one thread only."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_float32_noise_is_far_below_the_tolerance() -> None:
    """The tolerance's basis: the same input through the eager model twice,
    and with its edges in another order (what padding may change)."""
    model = random_model()
    adapter = adapters.get("sevennet")
    data = adapter.engine.build_input(model, structure(0, np.random.default_rng(0), (2, 2, 2)))
    first, again = adapter.reference(model, data), adapter.reference(model, data)
    perm = torch.randperm(data["edge_index"].shape[1], generator=torch.Generator().manual_seed(0))
    shuffled = dict(data, edge_index=data["edge_index"][:, perm], edge_vec=data["edge_vec"][perm])
    other = adapter.reference(model, shuffled)
    noise = max(float((first[k] - r[k]).detach().abs().max()) for k in KEYS for r in (again, other))
    assert noise < ATOL / 10, f"sevenn's float32 noise {noise:g} is too close to the tolerance {ATOL:g}"


class TestSevenNetConformance(AdapterTests):
    """ddpad's conformance kit: exactness and one graph per growth over a
    trajectory whose atom, edge and system counts change, dead rows, call
    forms, empty input, the ASE calculator."""
    aot_route = True  # compile_mode="aot": the fixed-size compile copy traces into one package

    adapter = "sevennet"
    dtype = torch.float32
    atol = ATOL
    rtol = RTOL

    @pytest.fixture
    def model(self) -> torch.nn.Module:
        return random_model()

    @pytest.fixture
    def trajectory(self) -> list[Any]:
        """Single structures and batches of 2 and 3, atoms removed and rattled."""
        rng = np.random.default_rng(0)
        shapes = [(1, 1, 1), (1, 1, 2), (2, 1, 1)]
        frames: list[Any] = []
        for step in range(12):
            count = (1, 2, 3, 1)[step % 4]
            batch = [structure(step, rng, shapes[(step + i) % 3]) for i in range(count)]
            frames.append(batch if count > 1 else batch[0])
        return frames

    def test_dead_rows_are_inert(self, resolved: Any, model: torch.nn.Module, trajectory: list[Any]) -> None:
        with one_thread():  # bit-identity holds on one thread only (see the module docstring)
            super().test_dead_rows_are_inert(resolved, model, trajectory)


def test_dead_rows_are_inert_and_nan_free() -> None:
    """Dead rows overwritten with large random values (positions, species,
    dead-system volume, dead edge vectors up to 40x the cutoff): real outputs
    bit-identical (one thread), nothing non-finite anywhere."""
    from ddpad.adapters.sevennet import _step, prepare_model

    model = prepare_model(random_model())
    data = adapters.get("sevennet").engine.build_input(model, structure(0, np.random.default_rng(1)))
    padder = make_padder(model)
    padded = padder.pad(data, {})
    n, s, e = data["pos"].shape[0], data["ptr"].shape[0] - 1, data["edge_index"].shape[1]
    assert padded["pos"].shape[0] > n and padded["edge_index"].shape[1] > e

    def run(inp: dict[str, torch.Tensor]) -> dict[str, Any]:
        return _step(model, {k: v.detach().clone() for k, v in inp.items()})

    dirty = {k: v.detach().clone() for k, v in padded.items()}
    gen = torch.Generator().manual_seed(0)
    dirty["pos"][n:] = torch.randn(dirty["pos"][n:].shape, generator=gen) * 1e3
    species = torch.tensor(ZS)
    for key in ("x", "node_attr", "atomic_numbers"):  # any valid species
        dirty[key][n:] = species[torch.randint(0, len(ZS), (dirty[key].shape[0] - n,), generator=gen)]
    dirty["cell_volume"][s:] = torch.rand(dirty["cell_volume"][s:].shape, generator=gen) * 1e3
    direction = torch.randn(dirty["edge_vec"][e:].shape, generator=gen)
    length = CUTOFF * (1.0 + 39.0 * torch.rand(direction.shape[0], 1, generator=gen))
    dirty["edge_vec"][e:] = direction / direction.norm(dim=-1, keepdim=True) * length
    with one_thread():
        clean, raw = run(padded), run(dirty)
    for key, value in raw.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert torch.isfinite(value).all(), key
    clean, raw = padder.unpad(clean), padder.unpad(raw)
    for key in KEYS:
        assert torch.equal(clean[key], raw[key]), key
    # every dead edge is a self-loop on a dead atom, as long as the cutoff (where sevenn's envelopes vanish)
    index = padded["edge_index"][:, e:]
    assert bool((index >= n).all()) and bool((padded["edge_vec"][e:].norm(dim=-1) == CUTOFF).all())


def test_compile_copy_takes_its_sizes_from_the_padded_shapes() -> None:
    """sevenn sizes its energy, force and stress buffers from the data
    (``batch.max() + 1``, ``num_atoms.sum()``): a fake trace of the step
    (``compile_mode="aot"``) failed on it ("data-dependent expression u0").
    The compile copy takes both from the padded shapes: it traces with no
    scalar read from the data, and on a padded input with an empty system
    between the real ones and the dead one it gives sevenn's own numbers
    bit for bit (one thread)."""
    from ddpad.adapters.sevennet import _step, prepare_model
    from torch.fx.experimental.proxy_tensor import make_fx

    model = prepare_model(random_model())
    fixed = {name: type(m) for name, m in model.named_modules() if type(m).__name__.startswith("FixedSize")}
    assert sorted(c.__name__ for c in fixed.values()) == ["FixedSizeAtomReduce", "FixedSizeForceStressOutputFromEdge"]
    sevenns = copy.deepcopy(model)  # the same copy with sevenn's own classes
    for module in sevenns.modules():
        if type(module).__name__.startswith("FixedSize"):
            module.__class__ = type(module).__bases__[0]
    rng = np.random.default_rng(2)
    data = adapters.get("sevennet").engine.build_input(model, [structure(0, rng), structure(1, rng, (1, 1, 1))])
    padded = make_padder(model).pad(data, {"systems": 4})
    assert padded["num_atoms"].shape[0] == 4 and int(padded["num_atoms"][2]) == 0  # an empty system

    def run(m: torch.nn.Module) -> dict[str, Any]:
        return _step(m, {k: v.detach().clone() for k, v in padded.items()})

    with one_thread():
        ours, theirs = run(model), run(sevenns)
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), key

    def step(*leaves: torch.Tensor) -> list[torch.Tensor]:
        out = _step(model, dict(zip(padded, leaves)))
        return [v.detach() for v in out.values() if isinstance(v, torch.Tensor)]

    with torch._dynamo.config.patch(**adapters.get("sevennet").dynamo_config):
        leaves = [v.detach().clone() for v in padded.values()]
        graph = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*leaves)
    reads = [n for n in graph.graph.nodes if "_local_scalar_dense" in str(n.target)]
    assert reads == [], reads


def test_precompile_aot_then_a_fresh_run_loads_and_checks_the_package(tmp_path: pathlib.Path) -> None:
    """A real AOTInductor build of SevenNet in the default run (about a
    minute on 2 cores): ``ddpad precompile sevennet --aot`` builds the fitted
    caps' package (before: "tracing the step failed", torch.compile), and a
    fresh ``ddpad run sevennet --aot`` loads it, checks its first call
    against the eager step and compiles nothing."""
    from _cli import check_precompiled_run

    # a package load and its check: a fraction of a second (benchmarks page), room for a busy machine
    check_precompiled_run("sevennet", tmp_path)


def test_huge_dead_edges_overflow_only_the_dead_system() -> None:
    """sevenn's polynomial envelope grows as r**8 beyond the cutoff: dead edge
    vectors hundreds of cutoffs long overflow float32 in the dead system. The
    dead system is its own: real outputs stay finite and exact (ddpad's dead
    edges are as long as the cutoff, where the envelope is zero:
    :func:`test_sevennet0_padded_step_is_finite_in_every_row`)."""
    from ddpad.adapters.sevennet import _step, prepare_model

    model = prepare_model(random_model())
    data = adapters.get("sevennet").engine.build_input(model, structure(0, np.random.default_rng(1)))
    padder = make_padder(model)
    padded = padder.pad(data, {})
    e = data["edge_index"].shape[1]
    dirty = {k: v.detach().clone() for k, v in padded.items()}
    dirty["edge_vec"][e:] = torch.randn(dirty["edge_vec"][e:].shape, generator=torch.Generator().manual_seed(1)) * 1e3
    with one_thread():
        clean = padder.unpad(_step(model, {k: v.clone() for k, v in padded.items()}))
        raw = padder.unpad(_step(model, dirty))
    for key in KEYS:
        assert torch.isfinite(raw[key]).all() and torch.equal(clean[key], raw[key]), key


def test_joined_dead_atoms_leak_energy() -> None:
    """Why the dead system: joined to the last real system (dead edges an
    anchor pair longer than the cutoff), the dead atoms add sevenn's
    species-wise energy shift to its energy."""
    model = random_model()
    data = adapters.get("sevennet").engine.build_input(model, structure(0, np.random.default_rng(2)))
    ref = adapters.get("sevennet").reference(model, data)
    own = ddpad.wrap(model, "sevennet", compile=False)(data)
    assert_exact(own, ref)
    join = make_padder(model, placement="join", edge_fields={"edge_vec": torch.tensor([2 * CUTOFF + 1, 0.0, 0.0])})
    joined = ddpad.wrap(model, "sevennet", compile=False, padder=join)(data)
    leak = float((joined["inferred_total_energy"] - ref["inferred_total_energy"]).abs().max())
    assert leak > 0.1, f"join placement expected to leak, measured dE = {leak:g}"


def test_unpadded_output_is_the_native_output() -> None:
    """Every field the native model returns comes back with the native shape,
    sevenn's pass-through fields (``edge_index``, ``ptr``) included; forces are
    detached as sevenn's evaluation mode returns them."""
    model = random_model()
    adapter = adapters.get("sevennet")
    data = adapter.engine.build_input(model, [structure(i, np.random.default_rng(i)) for i in range(2)])
    out = adapter.wrap(model, compile=False)(data)
    ref = adapter.reference(model, data)
    assert_exact(out, ref)
    assert torch.equal(out["edge_index"], ref["edge_index"]) and torch.equal(out["ptr"], ref["ptr"])
    assert not out["inferred_force"].requires_grad and not ref["inferred_force"].requires_grad
    # the flat properties: ASE's stress layout and sign, as sevenn's calculator gives it
    flat = adapter.flat(out)
    assert flat["energy"].shape == (2,) and flat["stress"].shape == (2, 3, 3) and flat["energies"].shape == (len(out["pos"]),)
    voigt = -out["inferred_stress"][0, [0, 1, 2, 4, 5, 3]]
    assert torch.equal(flat["stress"][0].flatten()[[0, 4, 8, 5, 2, 1]].detach(), voigt.detach())


def test_build_input_rejects_empty_and_unknown() -> None:
    model = random_model()
    adapter = adapters.get("sevennet")
    with pytest.raises(ValueError, match="at least one structure"):
        adapter.engine.build_input(model, [])
    empty = bulk("C", "diamond", a=3.57)[[]]
    with pytest.raises(ValueError, match="no atoms"):
        adapter.engine.build_input(model, empty)
    with pytest.raises(ValueError, match=r"the model does not know Si \(atomic number 14\); it knows H, C, O"):
        adapter.engine.build_input(model, bulk("Si", "diamond", a=5.43))
    with pytest.raises(ValueError, match="float32 only"):
        sevennet_adapter.random_model(torch.float64)


def test_checkpoint_round_trip(tmp_path: pathlib.Path) -> None:
    """A random model saved as a sevenn checkpoint loads through the adapter
    (and sevenn's own loader) and gives the same results."""
    from sevenn.util import load_checkpoint

    config = sevennet_adapter.random_config(cutoff=CUTOFF, atomic_numbers=ZS)
    model = random_model()
    path = tmp_path / "checkpoint_random.pth"
    sevennet_adapter.save_checkpoint(model, config, path)
    adapter = adapters.get("sevennet")
    loaded = adapter.tools.load_model(str(path), "cpu")
    assert load_checkpoint(str(path)).config["cutoff"] == CUTOFF
    data = adapter.engine.build_input(model, structure(0, np.random.default_rng(4)))
    assert_exact(adapter.reference(loaded, data), adapter.reference(model, data))
    with pytest.raises(FileNotFoundError, match="no sevenn checkpoint at"):
        adapter.tools.load_model(str(tmp_path / "missing.pth"), "cpu")


def test_ase_calculator_matches_sevenn_own_calculator() -> None:
    """``ddpad.ase.Calculator`` (padded, compiled) against sevenn's own
    ``SevenNetCalculator`` on the same model (unbatched, eager)."""
    from sevenn.calculator import SevenNetCalculator

    model = random_model()
    atoms = structure(0, np.random.default_rng(5), (2, 1, 1))
    atoms.calc = ddpad.ase.Calculator(model, "sevennet", backend="aot_eager", on_recompile="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        native = SevenNetCalculator(copy.deepcopy(model), file_type="model_instance", device="cpu")
    probe = atoms.copy()
    probe.calc = native
    for step in range(3):
        atoms.rattle(0.02, seed=10 + step)
        probe.positions = atoms.positions
        assert abs(atoms.get_potential_energy() - probe.get_potential_energy()) < 1e-4
        np.testing.assert_allclose(atoms.get_forces(), probe.get_forces(), rtol=0, atol=ATOL)
        np.testing.assert_allclose(atoms.get_stress(), probe.get_stress(), rtol=0, atol=ATOL)
        np.testing.assert_allclose(atoms.calc.results["energies"], probe.calc.results["energies"], rtol=0, atol=ATOL)
    check_compiles(atoms.calc.wrapped.stats)


def test_cli_runs_the_readme_job_on_sevennet0(tmp_path: pathlib.Path) -> None:
    """The README's first command (``ddpad run sevennet --model 7net-0``), three
    steps: the trained model by its name, one graph, compiled and checked
    (the random model runs in the install check)."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    res = subprocess.run(
        [sys.executable, "-m", "ddpad", "run", "sevennet", "--model", "7net-0", "--steps", "3", "--backend",
         "aot_eager"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600, check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "model 7net-0" in res.stdout and "RANDOMLY" not in res.stdout, res.stdout
    assert "compiled graphs: 1" in res.stdout and "0 disagreed" in res.stdout, res.stdout


def test_molecules_without_cell() -> None:
    """Non-periodic molecules batch and pad too (no stress: sevenn divides
    the virial by its clamped volume 1e-3, which magnifies the float32 noise
    a thousandfold in a number without meaning)."""
    model = random_model()
    adapter = adapters.get("sevennet")
    wrapped = adapter.wrap(model, compile=False)
    for batch in ([molecule("H2O"), molecule("CH4")], [molecule("C2H6")]):
        data = adapter.engine.build_input(model, batch)
        assert_exact(wrapped(data), adapter.reference(model, data), keys=KEYS[:2] + KEYS[3:])


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_20_steps_one_graph() -> None:
    model = random_model()
    adapter = adapters.get("sevennet")
    rng = np.random.default_rng(4)
    steps = [adapter.engine.build_input(model, structure(i, rng)) for i in range(20)]
    caps: dict[str, int] = {}  # size the caps on the trajectory first: one inductor compile
    for data in steps:
        make_padder(model).pad(data, caps)
    wrapped = adapter.wrap(model, backend="inductor", on_recompile="raise", caps=caps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for data in steps:
            assert_exact(wrapped(data), adapter.reference(model, data))
    assert wrapped.stats.graphs == 1 and wrapped.stats.growths == []


def test_message_layers_are_the_convolutions() -> None:
    """The LAMMPS engine checks ghost atoms ``message_layers x cutoff`` deep:
    SevenNet passes messages once per convolution."""
    adapter = adapters.get("sevennet")
    for n in (2, 3):
        assert adapter.engine.message_layers(adapter.tools.random_model(torch.float32, "cpu", num_convolutions=n)) == n


# --- the trained models sevenn ships (sevenn/pretrained_potentials/) ---------------------------------------


def silicon(seed: int = 0) -> Any:
    """64 atoms of rattled diamond silicon."""
    atoms = bulk("Si", "diamond", a=5.43, cubic=True) * (2, 2, 2)
    atoms.rattle(0.05, seed=seed)
    return atoms


def test_sevennet0_padded_step_is_finite_in_every_row() -> None:
    """Before: SevenNet-0's padded step had NaN in the dead system (its dead
    edges 2 cutoff + 1 long, where sevenn's polynomial envelope is -2726:
    five interactions over hundreds of dead edges overflowed the dead atom's
    features), so every first-use check refused the compiled graph. Dead
    edges at the cutoff, where the envelope is zero, leave every row finite,
    real rows as the unpadded model gives them."""
    from ddpad.adapters.sevennet import _step, prepare_model

    model = sevennet_adapter.load_model("7net-0")
    prepared = prepare_model(model)
    data = adapters.get("sevennet").engine.build_input(model, silicon())
    padder = make_padder(model)
    padded = padder.pad({k: v.clone() for k, v in data.items()}, {})
    assert padded["pos"].shape[0] > data["pos"].shape[0]
    out = _step(prepared, padded)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert torch.isfinite(value).all(), f"{key}: NaN or inf in the padded step"
    assert_exact(padder.unpad(out), adapters.get("sevennet").reference(model, data), atol=1e-4)


def test_pretrained_names_load_without_a_download() -> None:
    """The names sevenn resolves to the files its wheel ships load; before,
    every name was refused as "not a file". A name sevenn would download is
    one line saying so, and nothing is downloaded."""
    from sevenn.util import pretrained_name_to_path

    shipped = sevennet_adapter.shipped_models()
    assert {"7net-0", "7net-l3i5", "7net-mf-0"} <= set(shipped)
    model = sevennet_adapter.load_model("7net-0")
    same = sevennet_adapter.load_model("SevenNet-0_11July2024")
    from_file = sevennet_adapter.load_model(pretrained_name_to_path("7net-0"))  # (a shipped file: no download)
    for a, b, c in zip(model.parameters(), same.parameters(), from_file.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(FileNotFoundError, match="'nope'.*7net-0"):
        sevennet_adapter.load_model("nope")
    if not any(os.path.isfile(p) for p in sevennet_adapter._pretrained_paths("omat")):
        with pytest.raises(FileNotFoundError, match="not on this machine: sevenn would download it, ddpad never"):
            sevennet_adapter.load_model("7net-omat")
    if not any(os.path.isfile(p) for p in sevennet_adapter._pretrained_paths("omni")):
        from _cli import ddpad as cli

        done = cli("run", "sevennet", "--model", "7net-omni", "--steps", "1")
        assert done.returncode == 2 and done.stderr.count("ddpad: error:") == 1, done.stderr
        assert "'7net-omni' does not exist: '7net-omni' is a sevenn pretrained model that is not on this " \
               "machine: sevenn would download it, ddpad never does" in done.stderr


def test_multi_fidelity_model_runs_each_modality() -> None:
    """SevenNet-MF-0 through the padded step in each of its modalities equals
    sevenn's own calculator in that modality (before: the adapter did not
    feed ``modal_type``, and the model failed on sevenn's modality lookup);
    the two modalities differ; a modality the model lacks is one error."""
    from ddpad.ase import Calculator
    from sevenn.calculator import SevenNetCalculator

    atoms = silicon(3)
    energies = {}
    for modal in ("PBE", "R2SCAN"):
        model = sevennet_adapter.load_model("7net-mf-0", modal=modal)
        ours, theirs = atoms.copy(), atoms.copy()
        ours.calc = Calculator(model, "sevennet", compile=False)
        theirs.calc = SevenNetCalculator("7net-mf-0", modal=modal)
        energies[modal] = ours.get_potential_energy()
        assert abs(energies[modal] - theirs.get_potential_energy()) < 3e-4  # ~4 float32 ulps at 550 eV
        np.testing.assert_allclose(ours.get_forces(), theirs.get_forces(), atol=1e-5)
        np.testing.assert_allclose(ours.get_stress(), theirs.get_stress(), atol=1e-6)
    assert abs(energies["PBE"] - energies["R2SCAN"]) > 1.0
    assert sevennet_adapter.load_model("7net-mf-0").default_modal == "PBE"  # the checkpoint's default
    with pytest.raises(ValueError, match=r"modality 'HSE' is not one of .*\['PBE', 'R2SCAN'\]"):
        sevennet_adapter.load_model("7net-mf-0", modal="HSE")
    with pytest.raises(ValueError, match="not a multi-fidelity model"):
        sevennet_adapter.load_model("7net-0", modal="PBE")


@pytest.mark.slow
def test_sevennet0_compiled_by_inductor_exact_and_stable_in_nve() -> None:
    """SevenNet-0 as a user runs it: the ASE calculator compiled by Inductor,
    against sevenn's own ``SevenNetCalculator`` on a crystal and a molecule
    in a box (one compiled graph: the molecule fits the crystal's caps), the
    compiled route taken with every padded row finite, and 20 NVE steps
    whose energy drift is within twice sevenn's own over the same steps.
    Before: every graph was refused for NaN in its dead rows and ran eager."""
    from ase import units
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
    from ase.md.verlet import VelocityVerlet
    from sevenn.calculator import SevenNetCalculator

    model = sevennet_adapter.load_model("7net-0")
    calc = ddpad.ase.Calculator(model, "sevennet", backend="inductor", compile_cache=None, cap_policy="headroom")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        native = SevenNetCalculator("7net-0", device="cpu")
    in_box = molecule("CH3CH2OH")
    in_box.cell, in_box.pbc = [12.0, 12.0, 12.0], True
    in_box.center()
    for atoms in (silicon(1), silicon(2), in_box):
        ours, theirs = atoms.copy(), atoms.copy()
        ours.calc, theirs.calc = calc, native
        energy = theirs.get_potential_energy()  # within 8 float32 ulps of the total (sevenn sums it in float32)
        assert abs(ours.get_potential_energy() - energy) <= 8 * float(np.spacing(np.float32(abs(energy))))
        np.testing.assert_allclose(ours.get_forces(), theirs.get_forces(), rtol=0, atol=2e-5)
        np.testing.assert_allclose(ours.get_stress(), theirs.get_stress(), rtol=0, atol=2e-6)

    def drift(calculator: Any) -> float:
        atoms = silicon(3)
        MaxwellBoltzmannDistribution(atoms, temperature_K=600, rng=np.random.default_rng(0))
        atoms.calc = calculator
        start = atoms.get_total_energy()
        VelocityVerlet(atoms, timestep=1.0 * units.fs).run(20)
        return abs(atoms.get_total_energy() - start)

    ours, theirs = drift(calc), drift(native)
    assert ours <= 2 * theirs + 1e-4, f"NVE drift {ours:.3g} eV, sevenn's own {theirs:.3g} eV"
    stats = calc.wrapped.stats
    assert stats.eager_forms == 0 and stats.dead_nonfinite == 0 and stats.checks >= 1, checks_line(stats)
    check_compiles(stats)
