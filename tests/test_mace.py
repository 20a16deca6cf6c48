"""MACE adapter: exact, NaN-free, one compiled graph through MD (mace environment)."""

from __future__ import annotations

import json
import pathlib
import warnings
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("mace")
from ase.build import bulk  # noqa: E402

import ddpad  # noqa: E402
import ddpad.adapters as adapters  # noqa: E402
from _spawn import run_ranks  # noqa: E402
from ddpad.adapters import mace as mace_adapter  # noqa: E402
from ddpad.adapters.mace import make_padder  # noqa: E402
from ddpad.testing import AdapterTests  # noqa: E402

R_MAX = 3.0
ZS = (1, 6, 8)


def random_model(seed: int = 0) -> torch.nn.Module:
    """A random ScaleShiftMACE: float64, 3 elements, 2 interactions, non-zero
    per-atom shift and E0s (so a dead atom joined to a real graph would leak)."""
    return mace_adapter.random_model(torch.float64, r_max=R_MAX, atomic_numbers=ZS, seed=seed)


def structure(step: int, rng: np.random.Generator, cells: tuple[int, int, int] = (2, 2, 2)) -> Any:
    """A rattled periodic 3-element crystal that loses or gains a few atoms."""
    atoms = bulk("C", "diamond", a=3.57, cubic=True) * cells
    atoms.numbers[::3] = 1
    atoms.numbers[1::5] = 8
    keep = np.sort(rng.permutation(len(atoms))[: len(atoms) - int(rng.integers(0, 5))])
    atoms = atoms[keep]
    atoms.rattle(0.08, seed=step)
    return atoms


def reference(model: torch.nn.Module, data: dict[str, torch.Tensor], **kw: Any) -> dict[str, Any]:
    inp = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
    return model(inp, compute_stress=True, **kw)


def assert_exact(out: dict[str, Any], ref: dict[str, Any], atol: float = 1e-10) -> None:
    for key in ("energy", "forces", "stress", "node_energy", "virials"):
        assert out[key].shape == ref[key].shape and out[key].dtype == ref[key].dtype, key
        torch.testing.assert_close(out[key].detach(), ref[key].detach(), rtol=0, atol=atol, msg=key)
    assert {k for k, v in out.items() if v is not None} == {k for k, v in ref.items() if v is not None}


def check_compiles(stats: ddpad.Stats) -> None:
    growth_calls = {e.call for e in stats.growths}
    assert stats.graphs == 1 + len(growth_calls)
    assert set(stats.graphs_by_call) <= {0} | growth_calls
    assert stats.unexplained == []


def test_100_steps_exact_with_one_graph_per_growth() -> None:
    model = random_model()
    adapter = adapters.get("mace")
    wrapped = adapter.wrap(model, backend="aot_eager", on_recompile="raise")
    rng = np.random.default_rng(0)
    sizes = set()
    for step in range(100):
        data = adapter.engine.build_input(model, structure(step, rng))
        sizes.add(data["positions"].shape[0])
        out = wrapped(data, compute_stress=True)
        assert_exact(out, reference(model, data))
    assert len(sizes) >= 4
    check_compiles(wrapped.stats)
    assert wrapped.stats.fill["edges"] > 0.5


def test_dead_rows_are_inert_and_nan_free() -> None:
    from ddpad.adapters.mace import _step, prepare_model

    model = prepare_model(random_model())
    data = adapters.get("mace").engine.build_input(model, structure(0, np.random.default_rng(1)))
    padder = make_padder(model)
    padded = padder.pad(data, {})
    n, s, e = data["positions"].shape[0], data["ptr"].shape[0] - 1, data["edge_index"].shape[1]

    def run(inp: dict[str, torch.Tensor]) -> dict[str, Any]:
        return _step(model, {k: v.detach().clone() for k, v in inp.items()}, compute_stress=True)

    clean = run(padded)
    dirty = {k: v.detach().clone() for k, v in padded.items()}
    gen = torch.Generator().manual_seed(0)
    dirty["positions"][n:] = torch.randn(dirty["positions"][n:].shape, generator=gen, dtype=torch.float64) * 1e3
    dirty["node_attrs"][n:] = torch.randn(dirty["node_attrs"][n:].shape, generator=gen, dtype=torch.float64) * 1e3
    dirty["cell"][3 * s:] *= 1.0 + torch.rand(1, generator=gen, dtype=torch.float64)  # still > r_max
    raw = run(dirty)
    for key, value in raw.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert torch.isfinite(value).all(), key
    clean, raw = padder.unpad(clean), padder.unpad(raw)
    for key in ("energy", "forces", "stress", "node_energy"):
        assert torch.equal(clean[key], raw[key]), key
    # every dead edge is longer than the cutoff, the way mace computes it
    vec = padded["positions"][padded["edge_index"][1]] - padded["positions"][padded["edge_index"][0]]
    assert bool(((vec + padded["shifts"])[e:].norm(dim=-1) > R_MAX).all())


def test_prepared_copy_keeps_float64_weights() -> None:
    """``prepare_model`` rebuilds the model from its config and loads its
    weights: the copy is built in the model's dtype. Before: in torch's
    default float32, so a float64 model's weights were rounded to float32
    (1.5e-6 eV on a MACE-OFF23 configuration, 1e-12 now); ``random_model``
    hid it, its float64 weights being float32 numbers cast up."""
    model = random_model()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.rand(param.shape, generator=torch.Generator().manual_seed(0), dtype=param.dtype) * 1e-6)
    data = adapters.get("mace").engine.build_input(model, structure(0, np.random.default_rng(5)))
    ref, out = reference(model, data), reference(mace_adapter.prepare_model(model), data)
    assert_exact(out, ref, atol=1e-12)


def test_joined_dead_atoms_leak_energy() -> None:
    """Why the dead graph: joined to the real graph, dead atoms add the
    per-atom scale-shift to its energy."""
    model = random_model()
    data = adapters.get("mace").engine.build_input(model, structure(0, np.random.default_rng(2)))
    ref = reference(model, data)
    own = ddpad.wrap(model, "mace", compile=False)(data, compute_stress=True)
    join = ddpad.wrap(model, "mace", compile=False, padder=make_padder(model, placement="join"))(data, compute_stress=True)
    assert_exact(own, ref)
    leak = float((join["energy"] - ref["energy"]).abs().max())
    assert leak > 0.1, f"join placement expected to leak, measured dE = {leak:g}"


def test_batch_of_three_sizes_with_changing_system_count() -> None:
    model = random_model()
    adapter = adapters.get("mace")
    wrapped = adapter.wrap(model, backend="aot_eager", on_recompile="raise")
    rng = np.random.default_rng(3)
    shapes = [(1, 1, 1), (2, 1, 1), (2, 2, 1)]
    for step in range(12):
        count = (3, 2, 3, 1)[step % 4]
        batch = [structure(step, rng, shapes[i]) for i in range(count)]
        data = adapter.engine.build_input(model, batch)
        out = wrapped(data, compute_stress=True)
        assert out["energy"].shape == (count,)
        assert_exact(out, reference(model, data))
    check_compiles(wrapped.stats)
    assert wrapped.caps["systems"] >= 4


def _agreement_worker(rank: int, world: int) -> dict[str, Any]:
    model = random_model()
    adapter = adapters.get("mace")
    wrapped = adapter.wrap(model, compile=False)
    rng = np.random.default_rng(10 + rank)
    caps = []
    with ddpad.cap_agreement_group(None, "cpu") as agreement:
        for step in range(6):
            count = 1 + rank + step % 2  # uneven systems per rank
            data = adapter.engine.build_input(model, [structure(step, rng, (1, 1, 1 + rank)) for _ in range(count)])
            out = wrapped(data, compute_stress=True)
            assert_exact(out, reference(model, data))
            caps.append(wrapped.caps)
    return {"caps": caps, "collectives": agreement.collectives}


@pytest.mark.slow
def test_two_rank_agreement_identical_caps(tmp_path: pathlib.Path) -> None:
    results = run_ranks(_agreement_worker, 2, tmp_path, timeout=400)
    assert results[0]["caps"] == results[1]["caps"]
    assert results[0]["collectives"] == results[1]["collectives"] == 6


def test_inductor_20_steps_one_graph() -> None:
    """A real inductor compile in the default run, its first call checked
    against the eager step (the check is what guards Inductor's numbers)."""
    model = random_model()
    adapter = adapters.get("mace")
    rng = np.random.default_rng(4)
    steps = [adapter.engine.build_input(model, structure(i, rng, (1, 1, 2))) for i in range(20)]
    caps: dict[str, int] = {}  # size the caps on the trajectory first: one inductor compile
    for data in steps:
        make_padder(model).pad(data, caps)
    wrapped = adapter.wrap(model, backend="inductor", on_recompile="raise", caps=caps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for data in steps:
            assert_exact(wrapped(data, compute_stress=True), reference(model, data), atol=1e-9)
    assert wrapped.stats.graphs == 1 and wrapped.stats.growths == []
    assert (wrapped.stats.checks, wrapped.stats.disagreements) == (1, 0)


def test_a_worker_rebuilds_the_model_under_the_runs_store_key(tmp_path: pathlib.Path) -> None:
    """A worker (background compile, package build) must rebuild the very
    model the run holds. Before: it unpickled the prepared model, and e3nn
    pickles its code-generated fx modules as TorchScript: another store key
    (a second copy of every package, which the next run did not find) and a
    fake trace that failed (``DataDependentOutputException: aten.equal``).
    Now it prepares the model again from the one ``wrap`` prepared, with the
    run's weights loaded (changed after wrapping, here)."""
    from ddpad._background import PACKAGE_BUILD, expected_key, write_spec
    from ddpad._store import model_fingerprint
    from ddpad._weights import weights_digest
    from ddpad._worker import _prepared

    adapter = adapters.get("mace")
    wrapped = adapter.wrap(random_model(), compile=False)
    with torch.no_grad():
        next(wrapped.model.parameters()).mul_(1.5)  # fine-tuned after wrapping
    data = adapter.engine.build_input(wrapped.model, structure(0, np.random.default_rng(0)))
    spec = write_spec(tmp_path / "background", wrapped, {"atoms": 48}, tmp_path, {}, data, (), {}, PACKAGE_BUILD)
    rebuilt = _prepared(torch.load(spec, weights_only=False), adapter)
    assert model_fingerprint(rebuilt) == model_fingerprint(wrapped.model)
    assert weights_digest(rebuilt) == weights_digest(wrapped.model)
    key = expected_key(wrapped, tmp_path, {}, PACKAGE_BUILD)
    assert key is not None and key.endswith(weights_digest(wrapped.model))
    out = adapter.call(rebuilt, {k: v.clone() for k, v in data.items()})
    ref = adapter.call(wrapped.model, {k: v.clone() for k, v in data.items()})
    torch.testing.assert_close(out["energy"], ref["energy"], rtol=0, atol=0)


def test_random_model_in_a_fresh_process() -> None:
    """``random_model`` imports mace before e3nn: e3nn 0.4's ``torch.load`` of
    its constants fails on torch >= 2.6 unless mace came first (before: a
    process whose first mace use was ``random_model`` stopped there)."""
    import os
    import subprocess
    import sys

    code = "import torch; from ddpad.adapters.mace import random_model; print(random_model().r_max)"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}  # mace set it here
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]


def test_precompile_aot_then_a_fresh_run_loads_and_checks_the_package(tmp_path: pathlib.Path) -> None:
    """A real AOTInductor build of MACE in the default run: ``ddpad precompile
    mace --aot`` builds the fitted caps' package in a worker (before: every
    build failed there), and a fresh ``ddpad run mace --aot`` loads it,
    checks its first call against the eager step and compiles nothing; no
    lock file is left in the store."""
    from _cli import check_precompiled_run

    # a package load and its check: a fraction of a second (benchmarks page), room for a busy machine
    check_precompiled_run("mace", tmp_path)


def test_bench_includes_mace_own_padding() -> None:
    """`ddpad bench mace` runs mace's own padding beside ddpad. Its targets are
    fixed at the first structure, so a larger one changes the shape again
    (and when only edges need padding it adds one fake atom): more graphs."""
    from ddpad._bench.trajectory import run_bench

    model = random_model()
    frames = []
    for step, removed in enumerate((2, 2, 0, 1, 0, 2)):
        atoms = bulk("C", "diamond", a=3.57, cubic=True) * (2, 2, 2)
        atoms.numbers[::3] = 1
        atoms = atoms[removed:]
        atoms.rattle(0.05, seed=step)
        frames.append(atoms)
    result = run_bench(adapters.get("mace"), model, frames, backend="eager", variants=("native-padding", "ddpad"))
    native, ours = result["variants"]["native-padding"], result["variants"]["ddpad"]
    assert ours["graphs"] == 1
    assert native["graphs"] >= 2
    assert len(native["cumulative_s"]) == len(frames) and result["ddpad_speedup"]["native-padding"]["total"] > 0


class TestMACEConformance(AdapterTests):
    """The conformance kit, as a plugin author would run it."""

    adapter = "mace"
    atol = 1e-10

    @pytest.fixture
    def model(self) -> torch.nn.Module:
        return random_model()

    @pytest.fixture
    def trajectory(self) -> list[Any]:
        rng = np.random.default_rng(7)
        steps: list[Any] = [structure(s, rng) for s in range(5)]
        steps.insert(3, [structure(10, rng, (1, 1, 1)), structure(11, rng)])  # a batch: systems change
        return steps

    @pytest.fixture
    def foundation_structures(self) -> list[Any]:
        """MACE-MP-0 and MACE-OFF23 (small, medium) run three single cubic
        cells of 6-8 atoms: at r_max 5-6 A each atom still has ~100-200
        edges, most through periodic images, and the compiles dominate (the
        64-atom cells of ``trajectory`` took 435 s against ~240 s, no
        stricter). The float64 configurations (MACE-OFF23) are held to the
        float64 tolerance: at the kit's float32 one, 1e-4, a compile copy
        with weights rounded to float32 passed (1.5e-6 eV off)."""
        rng = np.random.default_rng(7)
        return [structure(step, rng, (1, 1, 1)) for step in range(3)]


def test_a_restarted_compile_is_still_timed_and_stored(tmp_path: pathlib.Path) -> None:
    """MACE's energy-only call (forces by the caller's autograd, as the LAMMPS
    engine calls it) makes AOTAutograd restart Dynamo's analysis from inside
    the backend; the retried compile must still be timed and go through the
    compile store (it was counted as neither compiled nor loaded)."""
    model = random_model()
    adapter = adapters.get("mace")
    evaluator = ddpad.Evaluator(model, adapter, backend="aot_eager", compile_cache=tmp_path)
    data = evaluator.build(structure(0, np.random.default_rng(0)))
    data["positions"] = data["positions"].detach().requires_grad_(True)
    assert evaluator.wrapped is not None
    evaluator.wrapped(data, **adapter.engine.energy_only_options)
    stats = evaluator.wrapped.stats
    # aot_eager leaves nothing in torch's caches: the store says so once and counts no miss (issue 27)
    assert stats.graphs == 1 and stats.graphs_compiled == 1 and stats.store_misses == 0


@pytest.mark.inductor
def test_maces_own_compiled_calculator_is_the_bench_s_peer() -> None:
    """``ToolHooks.compiled_ase_calculator``: mace's ``compile_mode="default"``
    route, the row ``ddpad bench --engines`` measures ddpad's ASE step
    against beside the eager calculator (issue 53). It compiles (minutes)
    and gives mace's numbers, in the model's dtype."""
    import copy

    from ddpad._bench.engines import systems

    adapter = adapters.get("mace")
    model = adapter.tools.random_model(torch.float64, "cpu")
    atoms = systems("one")[0]
    atoms.calc = adapter.tools.ase_calculator(copy.deepcopy(model))
    energy, forces = atoms.get_potential_energy(), atoms.get_forces()
    calc = adapter.tools.compiled_ase_calculator(copy.deepcopy(model))
    inner = getattr(calc.models[0], "_orig_mod", calc.models[0])
    # (mace's route rebuilt a float64 model in torch's default float32: 4e-5 eV off; the hook builds it in float64)
    assert calc.use_compile and next(inner.parameters()).dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32  # restored
    atoms.calc = calc
    assert abs(atoms.get_potential_energy() - energy) < 1e-9 and abs(atoms.get_forces() - forces).max() < 1e-9


def test_bench_engines_one_table_against_maces_own_models(tmp_path: pathlib.Path) -> None:
    """``ddpad bench mace --engines``: ASE and torch-sim (one system and a
    batch of four) each against mace's own ``MACECalculator`` and
    torch-sim's ``MaceModel``, in alternating blocks of one process."""
    from ddpad import cli

    out = tmp_path / "engines.json"
    assert cli.main(["bench", "mace", "--engines", "--blocks", "1", "--backend", "aot_eager",
                     "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {(r["engine"], r["kind"]): r for r in report["engines"]}
    assert set(rows) == {("ase", "one"), ("torchsim", "one"), ("torchsim", "batch")}, report["not_measured"]
    assert rows["ase", "one"]["baseline"] == "MACECalculator"
    assert rows["torchsim", "batch"]["baseline"] == "torch-sim MaceModel" and rows["torchsim", "batch"]["systems"] == 4
    assert set(rows["ase", "one"]["variants"]) == {"ddpad", "ddpad (ASE pipeline)", "MACECalculator"}
    for row in rows.values():
        assert row["disagreements"] == 0 and row["graphs"] >= 1
        for variant in row["variants"].values():
            assert variant["ms"] > 0 and variant["ratio_median"] > 0
        assert row["variants"][row["baseline"]]["ratio_median"] == 1.0
