"""AIMNet2 adapter: exact, NaN-free, one compiled graph per growth (aimnet environment)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("aimnet")
ase_build = pytest.importorskip("ase.build")

import ddpad  # noqa: E402
import ddpad.adapters as adapters  # noqa: E402
from ddpad.adapters.aimnet2 import evaluate, make_padder, random_model  # noqa: E402
from ddpad.testing import AdapterTests  # noqa: E402

MOLECULES = ("H2O", "CH4", "NH3", "C2H6", "CH3OH", "C6H6", "CH3CHO", "HCOOH")
# float32: per-row arithmetic is identical, only the autograd reductions
# reassociate; measured max |dF| ~1e-5 for forces of O(1-10).
TOL = {torch.float32: 5e-5, torch.float64: 1e-10}


def trajectory(model: torch.nn.Module, steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Batches of 2-5 rattled molecules: molecule count and atom count change."""
    from aimnet.calculators import AIMNet2Calculator

    calc = AIMNet2Calculator(model=model, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        k = 2 + int(torch.randint(0, 4, (1,), generator=gen))
        names = [MOLECULES[int(i)] for i in torch.randint(0, len(MOLECULES), (k,), generator=gen)]
        mols = []
        for i, name in enumerate(names):
            m = ase_build.molecule(name)
            m.positions += torch.randn(len(m), 3, generator=gen, dtype=torch.float64).numpy() * 0.08
            m.positions[:, 0] += 12.0 * i
            m.info["charge"] = float(int(torch.randint(-1, 2, (1,), generator=gen))) if step % 3 == 0 else 0.0
            mols.append(m)
        out.append(adapters.get("aimnet2").engine.build_input(model, mols, calculator=calc))
    return out


def assert_close(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float) -> None:
    assert out.keys() == ref.keys()
    for key in ref:
        assert out[key].shape == ref[key].shape and out[key].dtype == ref[key].dtype, key
        assert torch.isfinite(out[key]).all(), key
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=tol, msg=key)


def run_exactness(steps: int = 50) -> dict[str, Any]:
    dtype = torch.get_default_dtype()
    model = random_model()
    wrapped = adapters.get("aimnet2").wrap(model, backend="aot_eager", on_recompile="raise")
    worst = 0.0
    batches = trajectory(model, steps)
    assert len({d["charge"].shape[0] for d in batches}) > 1 and len({d["coord"].shape[0] for d in batches}) > 5
    for data in batches:
        ref = evaluate(model, data)
        out = wrapped(data)
        assert_close(out, ref, TOL[dtype])
        worst = max(worst, max(float((out[k] - ref[k]).detach().abs().max()) for k in ref))
    stats = wrapped.stats
    growth_calls = {e.call for e in stats.growths}
    assert stats.graphs == 1 + len(growth_calls)  # fullgraph model: one graph per growth
    assert set(stats.graphs_by_call) <= {0} | growth_calls
    return {"worst": worst, "graphs": stats.graphs, "growths": len(stats.growths)}


def test_exact_over_50_steps_float32() -> None:
    result = run_exactness(50)
    assert result["graphs"] >= 1


@pytest.mark.parametrize("config", ["aimnet2_dftd3_wb97m.yaml", "aimnet2_rxn.yaml"])
def test_long_range_variants_exact(config: str) -> None:
    """The packaged D3-dispersion and reaction configs: the dead molecule has
    zero charge and no neighbours in any matrix (Coulomb, D3)."""
    model = random_model(config=config)
    wrapped = adapters.get("aimnet2").wrap(model, backend="aot_eager", on_recompile="raise")
    for data in trajectory(model, 8, seed=7):
        assert_close(wrapped(data), evaluate(model, data), TOL[torch.float32])
    stats = wrapped.stats
    growth_calls = {e.call for e in stats.growths}
    # the D3 module has graph breaks of its own (and frames called at two
    # sites with different shapes): compiles happen on call 0 and on growth
    # calls only, and a growth recompiles no more than the first call compiled
    assert set(stats.graphs_by_call) <= {0} | growth_calls
    assert all(stats.graphs_by_call[c] <= stats.graphs_by_call[0] for c in growth_calls & set(stats.graphs_by_call))
    assert stats.unexplained == []


@pytest.mark.slow
def test_exact_float64_in_its_own_process() -> None:
    """aimnet fixes its input dtype from torch's default dtype at import: float64
    needs the default set before aimnet is imported, so a fresh process."""
    code = (
        "import sys, torch; torch.set_default_dtype(torch.float64); sys.path.insert(0, 'tests');"
        "import test_aimnet2 as t; r = t.run_exactness(20); print('worst', r['worst'])"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=_root(), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    worst = float(res.stdout.split("worst")[-1])
    assert worst < 1e-10


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dead_rows_are_inert() -> None:
    """Overwrite every dead row (positions, species, molecule charge) with large
    random values: real outputs stay bit-identical, nothing is NaN."""
    from ddpad.adapters.aimnet2 import _step

    model = random_model()
    data = trajectory(model, 1, seed=3)[0]
    padder = make_padder()
    padded = padder.pad(data, {})
    n = data["coord"].shape[0] - 1
    s = data["charge"].shape[0]
    clean = padder.unpad(_step(model, {k: v.clone() for k, v in padded.items()}))
    dirty_in = {k: v.clone() for k, v in padded.items()}
    gen = torch.Generator().manual_seed(0)
    dead = dirty_in["coord"].shape[0] - n
    dirty_in["coord"][n:] = torch.randn(dead, 3, generator=gen) * 1e3
    dirty_in["numbers"][n:-1] = torch.randint(1, 9, (dead - 1,), generator=gen).to(dirty_in["numbers"].dtype)
    dirty_in["charge"][s:] = 7.0
    raw = _step(model, dirty_in)
    assert all(torch.isfinite(v).all() for v in raw.values())
    dirty = padder.unpad(raw)
    for key in clean:
        assert torch.equal(clean[key], dirty[key]), key


def test_joined_dead_atoms_leak_own_dead_molecule_does_not() -> None:
    """Why the dead molecule: joined to a real molecule, dead atoms take part in
    its charge equilibration and change real forces."""
    model = random_model()
    data = trajectory(model, 1, seed=4)[0]
    ref = evaluate(model, data)
    own = ddpad.wrap(model, "aimnet2", compile=False)(data)
    join = ddpad.wrap(model, "aimnet2", compile=False, padder=make_padder(placement="join", systems_policy=None))(data)
    assert_close(own, ref, TOL[torch.float32])
    leak = float((join["forces"] - ref["forces"]).detach().abs().max())
    assert leak > 1e-3, f"join placement expected to leak, measured {leak:g}"


def test_inductor_one_graph() -> None:
    """A real inductor compile in the default run, its first call checked
    against the eager step."""
    model = random_model()
    batches = trajectory(model, 6, seed=5)
    wrapped = adapters.get("aimnet2").wrap(
        model, backend="inductor", on_recompile="raise",
        caps={"atoms": 128, "systems": 8, "neighbors": 32, "neighbors_nbmat_lr": 32},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for data in batches:
            assert_close(wrapped(data), evaluate(model, data), 1e-4)
    assert wrapped.stats.graphs == 1 and wrapped.stats.growths == []
    assert (wrapped.stats.checks, wrapped.stats.disagreements) == (1, 0)


@pytest.mark.parametrize("config", ["aimnet2.yaml", "aimnet2_rxn.yaml", "aimnet2_dftd3_wb97m.yaml"])
def test_fake_trace_of_the_step_is_exact(config: str) -> None:
    """The ahead-of-time route's trace (``make_fx`` in fake mode) takes
    aimnet's own tracing path, and the traced graph gives the eager step's
    numbers bit for bit. Before: eager aimnet read ``data_ptr()`` of a fake
    tensor and every build was refused ("Cannot access data pointer"); with
    D3, its molecule count was a data-dependent size."""
    from ddpad.adapters.aimnet2 import _step
    from torch.fx.experimental.proxy_tensor import make_fx

    model = random_model(config=config)
    padded = make_padder().pad(trajectory(model, 1, seed=8)[0], {})
    keys = list(padded)

    def step(*tensors: torch.Tensor) -> list[torch.Tensor]:
        return [v.detach() for v in _step(model, dict(zip(keys, tensors))).values()]

    graph = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*padded.values())
    ref = _step(model, {k: v.clone() for k, v in padded.items()})
    got = graph(*(v.clone() for v in padded.values()))
    assert len(got) == len(ref) == 3
    for (key, want), have in zip(ref.items(), got):
        assert torch.equal(want.detach(), have), key


def test_precompile_aot_then_a_fresh_run_loads_and_checks_the_package(tmp_path: pathlib.Path) -> None:
    """A real AOTInductor build of AIMNet2 in the default run: ``ddpad
    precompile aimnet2 --aot`` builds the fitted caps' package in a worker,
    and a fresh ``ddpad run aimnet2 --aot`` loads it, checks its first call
    against the eager step and compiles nothing; no lock file is left in the
    store. Before: the trace was refused and the run compiled with torch.compile."""
    from _cli import check_precompiled_run

    # a package load and its check: a fraction of a second (benchmarks page), room for a busy machine
    check_precompiled_run("aimnet2", tmp_path)


@pytest.mark.inductor
@pytest.mark.parametrize("config", ["aimnet2_rxn.yaml", "aimnet2_dftd3_wb97m.yaml"])
def test_long_range_configs_take_the_route(config: str, tmp_path: pathlib.Path) -> None:
    """The reaction config (long-range Coulomb on its own matrix,
    ``nbmat_lr``) and the D3 config (nvalchemiops' DFT-D3 custom ops, its
    molecule count from ``charge``'s length) through the package, exact
    against eager; a fresh process loads the package (the D3 ops included)
    and compiles nothing."""
    from ddpad.testing import check_aot

    model = random_model(config=config)
    adapter = adapters.get("aimnet2")
    systems = [adapter.tools.default_system(), ase_build.molecule("C6H6")]
    result = check_aot(adapter, model, systems, atol=TOL[torch.float32], forms=False, store=tmp_path)
    sizing = adapter.wrap(model, compile=False, cap_policy="headroom")  # the caps check_aot ran at
    for atoms in systems:
        sizing(adapter.engine.build_input(model, atoms))
    assert result["refused"] == {} and result["checked"] >= 2 and result["loaded_by_second"] == 1, result
    code = (
        "import sys, json, warnings, torch; warnings.simplefilter('ignore'); sys.path.insert(0, 'tests');"
        "import ddpad.adapters as a; from ddpad.adapters.aimnet2 import random_model, evaluate;"
        "import test_aimnet2 as t;"
        f"m = random_model(config={config!r}); ad = a.get('aimnet2'); data = ad.engine.build_input(m, ad.tools.default_system());"
        f"w = ad.wrap(m, compile_mode='aot', compile_cache={str(tmp_path)!r}, caps={sizing.caps!r},"
        " cap_policy='headroom', aot_build='foreground');"
        "t.assert_close(w(data), evaluate(m, data), t.TOL[torch.float32]); s = w.stats;"
        "print(json.dumps([s.aot_loaded, s.aot_compiled, s.aot_checked, s.aot_refused, s.graphs]))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=_root(), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[1, 0, 1, 0, 0]", res.stdout


def test_compile_mode_aot_falls_back_with_the_eager_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without aimnet's tracing path (an aimnet older than its
    ``_symbolic_trace_context``) the route refuses the trace and falls back
    to torch.compile, whose first call is checked. Before: the check handed
    the compiled step's input dict, which aimnet writes its intermediates
    into, to the eager step, and the call raised ``Trying to backward
    through the graph a second time``."""
    from aimnet import nbops

    monkeypatch.delattr(nbops, "_symbolic_trace_context")
    model = random_model()
    wrapped = adapters.get("aimnet2").wrap(model, compile_mode="aot", aot_build="foreground", backend="aot_eager",
                                           cap_policy="headroom")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for data in trajectory(model, 3, seed=6):
            assert_close(wrapped(data), evaluate(model, data), 1e-4)
    s = wrapped.stats
    assert s.aot_refused == 1 and s.aot_compiled == 0 and s.checks >= 1 and s.disagreements == 0
    assert all("Cannot access data pointer" in why for why in wrapped.manager.refused.values()), wrapped.manager.refused


def test_build_input_rejects_periodic() -> None:
    model = random_model()
    bulk = ase_build.bulk("Cu", cubic=True)
    with pytest.raises(ValueError, match="pbc"):
        adapters.get("aimnet2").engine.build_input(model, bulk)


def test_energy_stays_differentiable_by_the_caller() -> None:
    """How the raw aimnet model is used: coord requires grad, forces by autograd
    of the returned energy. The wrapped model keeps that connection."""
    model = random_model()
    wrapped = adapters.get("aimnet2").wrap(model, backend="aot_eager")
    for data in trajectory(model, 3, seed=5):
        ref = evaluate(model, data)
        coord = data["coord"].detach().clone().requires_grad_(True)
        out = wrapped(dict(data, coord=coord))
        (grad,) = torch.autograd.grad(out["energy"].sum(), coord)
        n = ref["forces"].shape[0]
        torch.testing.assert_close(-grad[:n], ref["forces"], rtol=0, atol=TOL[torch.get_default_dtype()])
        torch.testing.assert_close(out["forces"], ref["forces"], rtol=0, atol=TOL[torch.get_default_dtype()])


def test_unknown_elements_and_empty_input_are_clear_errors() -> None:
    model = random_model()
    build = adapters.get("aimnet2").input_builder(model)
    water = ase_build.molecule("H2O")
    water.numbers[0] = 99  # past the model's per-element tables: SIGABRT under inductor
    with pytest.raises(ValueError, match=r"atomic numbers \[99\] are not known to this AIMNet2 model \(atomic numbers 1\.\.\d+\)"):
        build(water)
    with pytest.raises(ValueError, match="at least one molecule"):
        build([])
    with pytest.raises(ValueError, match="at least one atom"):
        build(ase_build.molecule("H2O")[[]])


def _molecules_with_charges() -> list[Any]:
    """The default system (eight molecules by ``mol_id``, neutral) and a
    charged water and ammonia: ten molecules in two ``Atoms``."""
    mols = adapters.get("aimnet2").tools.default_system()
    ions = ase_build.molecule("H2O") + ase_build.molecule("NH3")
    ions.positions[3:] += (8.0, 0.0, 0.0)
    ions.set_array("mol_id", torch.tensor([0, 0, 0, 1, 1, 1, 1]).numpy())
    ions.info["charge"] = -1.0  # each molecule's, as the pipeline reads it
    return [mols, ions]


def test_tensor_input_gives_the_pipelines_input_and_numbers() -> None:
    """``Structures`` (one system per molecule, ``charge`` per system) ->
    aimnet's input: the same tensors as ``build_input`` from the same
    ``Atoms`` (before: AIMNet2 had no tensor path; the engines went through
    ``ase.Atoms``)."""
    model = random_model()
    adapter = adapters.get("aimnet2")
    parts = _molecules_with_charges()
    structures = ddpad.padding.Structures.from_atoms(parts, molecules=True)
    assert structures.charge is not None and structures.charge.tolist() == [0.0] * 8 + [-1.0, -1.0]
    got, want = adapter.engine.tensor_input(model)(structures), adapter.input_builder(model)(parts)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    out = ddpad.Evaluator(model, adapter, backend="aot_eager", compile_cache=None)(structures)
    ref = evaluate(model, want)
    assert out["energy"].shape == (10,)
    for key in ("energy", "forces", "charges"):
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=TOL[torch.float32], msg=key)
    neutral = ddpad.padding.Structures.from_atoms(parts, molecules=True)
    neutral.charge = None  # the charge is read: neutral ions are other numbers
    assert not torch.allclose(ddpad.Evaluator(model, adapter, pad=False, compile=False)(neutral)["energy"][8:],
                              ref["energy"][8:])


def test_a_list_of_atoms_with_mol_id_is_split_into_its_molecules() -> None:
    """The ASE pipeline splits every ``Atoms`` of a list by its ``mol_id``
    (before: only a single ``Atoms``; each of a list was one molecule, its
    molecules charge-equilibrated together)."""
    model = random_model()
    data = adapters.get("aimnet2").input_builder(model)(_molecules_with_charges())
    assert data["charge"].tolist() == [0.0] * 8 + [-1.0, -1.0]


def test_the_ase_calculator_takes_the_tensor_path_for_molecules() -> None:
    """``ddpad.ase.Calculator`` on AIMNet2 builds from tensors, one system per
    molecule of the ``mol_id`` array: the pipeline's numbers over a short
    Langevin run, the composition checked once."""
    import numpy as np
    from ase import units
    from ase.md.langevin import Langevin

    from ddpad.ase import Calculator

    model = random_model()
    runs = {}
    for tensors in (True, False):
        atoms = adapters.get("aimnet2").tools.default_system()
        atoms.info["charge"] = 0.0
        atoms.calc = Calculator(model, "aimnet2", backend="aot_eager", compile_cache=None, tensor_input=tensors)
        assert atoms.calc.tensor_input is tensors
        dyn = Langevin(atoms, 0.5 * units.fs, temperature_K=300, friction=0.02, rng=np.random.default_rng(0))
        energies: list[float] = []
        dyn.attach(lambda: energies.append(atoms.get_potential_energy()), interval=1)
        dyn.run(4)
        runs[tensors] = (np.array(energies), atoms.get_forces())
        if tensors:
            first = atoms.calc.structures(atoms)
            assert first.system is not None and int(first.system.max()) == 7
            assert atoms.calc.structures(atoms).numbers is first.numbers  # the composition's tensors, reused
    for got, want in zip(runs[True], runs[False]):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL[torch.float32])


@pytest.mark.parametrize("kind", ["unknown species", "NaN position", "periodic", "empty system"])
def test_tensor_input_bad_input_names_the_molecule_before_any_compile(kind: str) -> None:
    model = random_model()
    s = ddpad.padding.Structures.from_atoms(_molecules_with_charges()[0], molecules=True)
    if kind == "unknown species":
        s.numbers[3] = 99
    elif kind == "NaN position":
        s.positions[4, 1] = float("nan")
    elif kind == "periodic":
        s.cell[1] = torch.eye(3) * 10.0
        s.pbc = s.pbc.clone()
        s.pbc[1] = True
    elif kind == "empty system":
        s.system = torch.where(s.system == 1, 2, s.system)
    evaluate_ = ddpad.Evaluator(model, "aimnet2", backend="aot_eager", compile_cache=None)
    with pytest.raises(ValueError, match="system 1|system\\(s\\) \\[1\\]") as info:
        evaluate_(s)
    assert info.value.args[0].startswith("ddpad: ")
    assert evaluate_.stats.graphs == 0 and evaluate_.stats.calls == 0


@pytest.mark.parametrize("engine, kind, own, atoms", [("ase", "one", "AIMNet2ASE", 63),
                                                      ("torchsim", "batch", "torch-sim AIMNet2TorchSim", 219)])
def test_bench_engines_steps_beside_aimnets_own_calculator_and_torchsim_model(engine: str, kind: str, own: str,
                                                                              atoms: int) -> None:
    """``ddpad bench aimnet2 --engines`` has rows for AIMNet2: water clusters
    (molecules, no cell), against aimnet's ``AIMNet2ASE`` and
    ``AIMNet2TorchSim`` (before: "declares no ASE calculator to compare
    with", and crystals the adapter refuses)."""
    if engine == "torchsim":
        pytest.importorskip("torch_sim")
    from ddpad._bench.engines import measure

    row = measure(engine, kind, adapters.get("aimnet2"), random_model(), blocks=1, steps=2, warmup=2,
                  backend="eager")
    assert (row["baseline"], row["atoms"], row["disagreements"]) == (own, atoms, 0)
    assert set(row["variants"]) >= {"ddpad", own} and all(v["ms"] > 0 for v in row["variants"].values())


def test_loaded_wb97m_d3_file_gives_aimnets_calculator_energy(tmp_path: pathlib.Path) -> None:
    """A file as aimnet's registry ships wB97M-D3 leaves its long-range
    Coulomb and D3 terms to ``AIMNet2Calculator``: ``load_model`` puts them
    in the model, so ddpad's numbers are the calculator's (before: the model
    alone, 0.056 eV off on the first of these molecules)."""
    from aimnet.calculators import AIMNet2Calculator
    from aimnet.models.base import load_model as aimnet_load
    from ddpad.adapters.aimnet2 import _export_wb97m_d3, load_model

    path = _export_wb97m_d3(str(tmp_path), seed=1)
    calculator = AIMNet2Calculator(model=aimnet_load(str(path), device="cpu")[0], device="cpu")
    adapter = adapters.get("aimnet2")
    model = load_model(str(path))
    atoms = adapter.tools.default_system()
    ours = adapter.reference(model, adapter.engine.build_input(model, atoms))
    start = 0
    for index in range(int(atoms.arrays["mol_id"].max()) + 1):
        molecule = atoms[atoms.arrays["mol_id"] == index]
        theirs = calculator.eval({"coord": torch.tensor(molecule.positions, dtype=torch.float32),
                                  "numbers": torch.tensor(molecule.numbers), "charge": torch.tensor([0.0])},
                                 forces=True)
        torch.testing.assert_close(ours["energy"][index].double(), theirs["energy"].double().reshape(()),
                                   atol=1e-4, rtol=0.0)
        torch.testing.assert_close(ours["forces"][start:start + len(molecule)], theirs["forces"].reshape(-1, 3),
                                   atol=TOL[torch.float32], rtol=0.0)
        start += len(molecule)


class TestAIMNet2Conformance(AdapterTests):
    aot_route = True  # compile_mode="aot": aimnet's own tracing path (docs/pages/compile-store.md)
    adapter = "aimnet2"
    atol = 5e-5  # float32: see TOL

    @pytest.fixture
    def model(self) -> torch.nn.Module:
        return random_model()

    def test_foundation_configurations(self, resolved: Any, foundation_models: Any,
                                       foundation_structures: list[Any]) -> None:
        """In the default run (the kit marks it long; here it takes ~25 s):
        wB97M-D3 as the registry ships it, its external D3 term included, is
        one graph (before: D3's molecule count read on the host, 15 graphs
        on the kit's three structures)."""
        super().test_foundation_configurations(resolved, foundation_models, foundation_structures)
