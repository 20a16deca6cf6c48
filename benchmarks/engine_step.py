"""ddpad's MD step inside an engine against the engine's own MACE model.

``python benchmarks/engine_step.py {torchsim,ase} {one,batch} [--blocks 8] [--steps 10] [--backend inductor] [--json FILE]``

One process, one random float64 MACE model, Langevin dynamics at 600 K,
1 fs. ``one`` is a 64-atom diamond cell, ``batch`` four rattled crystals of
different sizes (376 atoms) in one state (torch-sim only).

- ``torchsim``: torch-sim's ``nvt_langevin``; ``ddpad`` is
  ``ddpad.torchsim.Model(model, "mace", backend=...)`` with its defaults (the
  state's tensors, the compile store, tight caps), the baseline torch-sim's
  own eager ``MaceModel``.
- ``ase``: ASE's ``Langevin``; ``ddpad`` is ``ddpad.ase.Calculator`` (the
  tensor input path), ``ddpad (ASE pipeline)`` the same with
  ``tensor_input=False`` (mace's data pipeline and matscipy's neighbour list),
  the baseline mace's own eager ``MACECalculator``.

ddpad compiles into a temporary compile store (its caps are the tight fit).
Each variant steps its own copy of the same start; after a warm-up the
variants step in alternating blocks of ``--steps`` steps, so all see the same
machine load, and each ratio (variant / baseline) is taken per block.
"""

from __future__ import annotations

import argparse
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


def _torchsim(model: Any, kind: str, backend: str, store: str) -> tuple[dict[str, Callable[[], None]], Any, int]:
    """Steppers for torch-sim's loop: ddpad's model and torch-sim's ``MaceModel``."""
    import torch
    import torch_sim as ts
    from torch_sim.models.mace import MaceModel

    from ddpad.torchsim import Model

    device, dtype = torch.device("cpu"), torch.float64
    start = ts.io.atoms_to_state(_systems(kind), device=device, dtype=dtype)
    kT = torch.tensor(TEMPERATURE_K * 8.617333262e-5, dtype=dtype)
    dt = torch.tensor(TIMESTEP_FS * 1e-3, dtype=dtype)
    models = {"ddpad": Model(model, "mace", backend=backend, compile_cache=store),
              "torch-sim MaceModel": MaceModel(model, device=device, dtype=dtype)}
    steppers = {}
    for name, m in models.items():
        init, update = ts.nvt_langevin(m, dt=dt, kT=kT)
        box = {"state": init(start.clone(), seed=1)}

        def step(box: dict[str, Any] = box, update: Any = update) -> None:
            box["state"] = update(box["state"], dt=dt, kT=kT)

        steppers[name] = step
    return steppers, models["ddpad"].wrapped, int(start.n_atoms)


def _ase(model: Any, kind: str, backend: str, store: str) -> tuple[dict[str, Callable[[], None]], Any, int]:
    """Steppers for ASE's ``Langevin``: ddpad's calculator on both input paths and mace's ``MACECalculator``."""
    import numpy as np
    from ase import units
    from ase.md.langevin import Langevin
    from mace.calculators import MACECalculator

    from ddpad.ase import Calculator

    if kind != "one":
        raise SystemExit("engine_step.py: ASE steps one system; use 'one'")
    calculators = {
        "ddpad": Calculator(model, "mace", backend=backend, compile_cache=store),
        "ddpad (ASE pipeline)": Calculator(model, "mace", backend=backend, compile_cache=store, tensor_input=False),
        "MACECalculator": MACECalculator(models=model, device="cpu", default_dtype="float64"),
    }
    steppers = {}
    for name, calc in calculators.items():
        atoms = _systems(kind)[0]
        atoms.calc = calc
        dyn = Langevin(atoms, TIMESTEP_FS * units.fs, temperature_K=TEMPERATURE_K, friction=0.02,
                       rng=np.random.default_rng(1))
        steppers[name] = lambda dyn=dyn: dyn.run(1)
    return steppers, calculators["ddpad"].wrapped, len(_systems(kind)[0])


ENGINES = {"torchsim": (_torchsim, "torch-sim MaceModel"), "ase": (_ase, "MACECalculator")}


def measure(engine: str, kind: str, blocks: int, steps: int, backend: str, warmup: int = 12) -> dict[str, Any]:
    """Median step times and per-block ratios (see the module's docstring)."""
    import torch

    from ddpad.adapters.mace import random_model

    make, baseline = ENGINES[engine]
    model = random_model(torch.float64)
    with tempfile.TemporaryDirectory(prefix="ddpad-engine-") as store:
        steppers, wrapped, atoms = make(model, kind, backend, store)
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
        "engine": engine, "kind": kind, "atoms": atoms, "systems": len(SIZES[kind]), "backend": backend,
        "threads": torch.get_num_threads(), "blocks": blocks, "steps_per_block": steps, "baseline": baseline,
        "variants": variants, "ddpad_first_call_s": first_call, "caps": dict(wrapped.caps),
        "graphs": wrapped.stats.graphs, "growths": len(wrapped.stats.growths),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=sorted(ENGINES))
    parser.add_argument("kind", choices=sorted(SIZES))
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    row = measure(args.engine, args.kind, args.blocks, args.steps, args.backend)
    print(f"{row['engine']}, {row['atoms']} atoms in {row['systems']} system(s), {row['threads']} thread(s); "
          f"caps {row['caps']}, {row['graphs']} graph(s), {row['growths']} growth(s):")
    for name, v in row["variants"].items():
        print(f"  {name:<22} {v['ms']:8.1f} ms/step  x{v['ratio_median']:.2f} "
              f"({v['ratio_min']:.2f}-{v['ratio_max']:.2f}) of {row['baseline']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
