"""ddpad's MD step inside an engine against the engine's own model wrapper.

``python benchmarks/engine_step.py {torchsim,ase} {one,batch} [--adapter mace] [--blocks 8] [--steps 10] [--backend inductor] [--json FILE]``

One process, one random model (MACE in float64, SevenNet, Orb and MatterSim
in float32: SevenNet's and MatterSim's only dtype, Orb's calculator's default), Langevin dynamics at 600 K, 1 fs. ``one`` is a 64-atom diamond
cell, ``batch`` four rattled crystals of different sizes (376 atoms) in one
state (torch-sim only).

- ``torchsim``: torch-sim's ``nvt_langevin``; ``ddpad`` is
  ``ddpad.torchsim.Model(model, ADAPTER, backend=...)`` with its defaults (the
  state's tensors, the compile store, tight caps), the baseline torch-sim's
  own eager model (``MaceModel``, ``SevenNetModel``).
- ``ase``: ASE's ``Langevin``; ``ddpad`` is ``ddpad.ase.Calculator`` (the
  tensor input path), ``ddpad (ASE pipeline)`` the same with
  ``tensor_input=False`` (the adapter's pipeline: the package's data pipeline
  and CPU neighbour list), the baseline the package's own eager calculator
  (``MACECalculator``, ``SevenNetCalculator``, ``ORBCalculator``).

The baselines get their own copies of the model (the packages' wrappers set
flags on the model they are given).

ddpad compiles into a temporary compile store (its caps are the tight fit).
Each variant steps its own copy of the same start; after a warm-up the
variants step in alternating blocks of ``--steps`` steps, so all see the same
machine load, and each ratio (variant / baseline) is taken per block.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

SIZES = {"one": [(2, 2, 2)], "batch": [(2, 2, 2), (3, 2, 2), (3, 3, 2), (3, 3, 1)]}
TEMPERATURE_K, TIMESTEP_FS = 600.0, 1.0


def _systems(kind: str) -> list[Any]:
    from ase.build import bulk

    out = []
    for i, rep in enumerate(SIZES[kind]):
        atoms = bulk("C", "diamond", a=3.57, cubic=True) * rep
        atoms.numbers[::3] = 1
        atoms.rattle(0.05, seed=i)
        out.append(atoms)
    return out


def _torchsim_baseline(adapter: str, model: Any) -> tuple[str, Any]:
    import torch

    device, dtype = torch.device("cpu"), next(model.parameters()).dtype
    if adapter == "mace":
        from torch_sim.models.mace import MaceModel

        return "torch-sim MaceModel", MaceModel(copy.deepcopy(model), device=device, dtype=dtype)
    if adapter == "mattersim":  # torch-sim 0.3.0's MatterSimModel builds its batch on mattersim's default device
        raise SystemExit("engine_step.py: torch-sim's MatterSimModel does not run on a CPU: it calls mattersim's "
                         "batch_to_dict without a device, whose default is 'cuda'")
    if adapter == "orb":  # torch-sim 0.3.0's OrbModel imports a module orb-models 0.5 does not have
        raise SystemExit("engine_step.py: torch-sim's OrbModel does not load here: it imports "
                         "orb_models.forcefield.graph_regressor, which orb-models 0.5.5 does not have")
    from torch_sim.models.sevennet import SevenNetModel

    try:  # torch-sim 0.3.0's wrapper imports names sevenn 0.13 no longer has (it fails when built)
        return "torch-sim SevenNetModel", SevenNetModel(copy.deepcopy(model), device=device, dtype=dtype)
    except ImportError as exc:
        raise SystemExit(f"engine_step.py: torch-sim's SevenNetModel does not load here: {exc}") from exc


def _ase_baseline(adapter: str, model: Any) -> tuple[str, Any]:
    if adapter == "mace":
        from mace.calculators import MACECalculator

        return "MACECalculator", MACECalculator(models=copy.deepcopy(model), device="cpu", default_dtype="float64")
    if adapter == "mattersim":
        from mattersim.forcefield import MatterSimCalculator

        return "MatterSimCalculator", MatterSimCalculator(potential=copy.deepcopy(model), device="cpu")
    if adapter == "orb":
        from orb_models.forcefield.calculator import ORBCalculator

        return "ORBCalculator", ORBCalculator(copy.deepcopy(model), device="cpu")
    from sevenn.calculator import SevenNetCalculator

    return "SevenNetCalculator", SevenNetCalculator(copy.deepcopy(model), device="cpu")


def _torchsim(adapter: str, model: Any, kind: str, backend: str, store: str,
              ) -> tuple[dict[str, Callable[[], None]], Any, int, str]:
    """Steppers for torch-sim's loop: ddpad's model and torch-sim's own."""
    import torch
    import torch_sim as ts

    from ddpad.torchsim import Model

    device, dtype = torch.device("cpu"), next(model.parameters()).dtype
    start = ts.io.atoms_to_state(_systems(kind), device=device, dtype=dtype)
    kT = torch.tensor(TEMPERATURE_K * 8.617333262e-5, dtype=dtype)
    dt = torch.tensor(TIMESTEP_FS * 1e-3, dtype=dtype)
    baseline, own = _torchsim_baseline(adapter, model)
    models = {"ddpad": Model(model, adapter, backend=backend, compile_cache=store), baseline: own}
    steppers = {}
    for name, m in models.items():
        init, update = ts.nvt_langevin(m, dt=dt, kT=kT)
        box = {"state": init(start.clone(), seed=1)}

        def step(box: dict[str, Any] = box, update: Any = update) -> None:
            box["state"] = update(box["state"], dt=dt, kT=kT)

        steppers[name] = step
    return steppers, models["ddpad"].wrapped, int(start.n_atoms), baseline


def _ase(adapter: str, model: Any, kind: str, backend: str, store: str,
         ) -> tuple[dict[str, Callable[[], None]], Any, int, str]:
    """Steppers for ASE's ``Langevin``: ddpad's calculator on both input paths and the package's own."""
    import numpy as np
    from ase import units
    from ase.md.langevin import Langevin

    from ddpad.ase import Calculator

    if kind != "one":
        raise SystemExit("engine_step.py: ASE steps one system; use 'one'")
    baseline, own = _ase_baseline(adapter, model)
    calculators = {
        "ddpad": Calculator(model, adapter, backend=backend, compile_cache=store),
        "ddpad (ASE pipeline)": Calculator(model, adapter, backend=backend, compile_cache=store, tensor_input=False),
        baseline: own,
    }
    steppers = {}
    for name, calc in calculators.items():
        atoms = _systems(kind)[0]
        atoms.calc = calc
        dyn = Langevin(atoms, TIMESTEP_FS * units.fs, temperature_K=TEMPERATURE_K, friction=0.02,
                       rng=np.random.default_rng(1))
        steppers[name] = lambda dyn=dyn: dyn.run(1)
    return steppers, calculators["ddpad"].wrapped, len(_systems(kind)[0]), baseline


ENGINES = {"torchsim": _torchsim, "ase": _ase}
ADAPTERS = ("mace", "sevennet", "orb", "mattersim")


def measure(engine: str, kind: str, blocks: int, steps: int, backend: str, adapter: str = "mace",
            warmup: int = 12) -> dict[str, Any]:
    """Median step times and per-block ratios (see the module's docstring)."""
    import torch

    from ddpad.adapters import get

    model = get(adapter).tools.random_model(*((torch.float64,) if adapter == "mace" else ()))
    with tempfile.TemporaryDirectory(prefix="ddpad-engine-") as store:
        steppers, wrapped, atoms, baseline = ENGINES[engine](adapter, model, kind, backend, store)
        t0 = time.perf_counter()
        steppers["ddpad"]()  # the first call: compiles
        first_call = time.perf_counter() - t0
        for step in steppers.values():
            for _ in range(warmup):  # the tight fit (call 10) and its compile
                step()
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
                          "ratio_min": min(ratios), "ratio_max": max(ratios)}
    return {
        "engine": engine, "adapter": adapter, "kind": kind, "atoms": atoms, "systems": len(SIZES[kind]), "backend": backend,
        "threads": torch.get_num_threads(), "blocks": blocks, "steps_per_block": steps, "baseline": baseline,
        "variants": variants, "ddpad_first_call_s": first_call, "caps": dict(wrapped.caps),
        "graphs": wrapped.stats.graphs, "growths": len(wrapped.stats.growths),
        "disagreements": wrapped.stats.disagreements,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=sorted(ENGINES))
    parser.add_argument("kind", choices=sorted(SIZES))
    parser.add_argument("--adapter", choices=ADAPTERS, default="mace")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    row = measure(args.engine, args.kind, args.blocks, args.steps, args.backend, args.adapter)
    print(f"{row['adapter']} in {row['engine']}, {row['atoms']} atoms in {row['systems']} system(s), {row['threads']} thread(s); "
          f"caps {row['caps']}, {row['graphs']} graph(s), {row['growths']} growth(s), "
          f"{row['disagreements']} compiled graph(s) disagreeing with eager (run eager):")
    for name, v in row["variants"].items():
        print(f"  {name:<22} {v['ms']:8.1f} ms/step  x{v['ratio_median']:.2f} "
              f"({v['ratio_min']:.2f}-{v['ratio_max']:.2f}) of {row['baseline']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
