"""Shared by the examples: model loading, a timed MD loop, the report."""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch


def parse(description: str, steps: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", help="local checkpoint (default: randomly initialised)")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--check", type=int, default=3, help="first steps compared with the eager model")
    return parser.parse_args()


def model_for(adapter: Any, path: str | None, dtype: torch.dtype | None, device: str) -> torch.nn.Module:
    if path:
        return adapter.tools.load_model(path, device)
    print("model: randomly initialised (pass --model PATH for a checkpoint)")
    return adapter.tools.random_model(dtype, device)


def run(dyn: Any, atoms: Any, steps: int) -> float:
    """Run ``steps`` MD steps; return steady-state steps/s (first call excluded)."""
    t0 = time.perf_counter()
    atoms.get_potential_energy()  # the first call compiles
    print(f"first call (compile): {time.perf_counter() - t0:.1f} s")
    t1 = time.perf_counter()
    dyn.run(steps)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - t1)


def report(calc: Any, rate: float) -> None:
    stats = calc.wrapped.stats
    print(f"steps/s: {rate:.2f}")
    print(f"compiled graphs: {stats.graphs} (growth calls: {stats.growth_calls}, caps grown: {len(stats.growths)})")
    for event in stats.growths:
        print(f"  call {event.call}: {event.key} {event.old} -> {event.new} (real {event.real})")
    print("fill: " + ", ".join(f"{k} {v:.2f} of {stats.caps[k]}" for k, v in sorted(stats.fill.items())))


def max_deviation(a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...]) -> float:
    return max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in keys)


def langevin(atoms: Any, eager: Any, temperature_k: float, check: int) -> Any:
    """Langevin dynamics that also compares the first ``check`` steps with
    ``eager`` (a plain-model calculator): compiled + padded vs eager."""
    from ase import units
    from ase.constraints import FixCom
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    atoms.set_constraint([*atoms.constraints, FixCom()])  # ASE's own fixcm flag is deprecated
    MaxwellBoltzmannDistribution(atoms, temperature_K=temperature_k, rng=np.random.default_rng(0))
    dyn = Langevin(atoms, 0.5 * units.fs, temperature_K=temperature_k, friction=0.01 / units.fs,
                   fixcm=False, rng=np.random.default_rng(1))

    def compare() -> None:
        if dyn.nsteps < check:
            probe = atoms.copy()
            probe.calc = eager
            ref = {"energy": probe.get_potential_energy(), "forces": probe.get_forces()}
            got = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
            print(f"step {dyn.nsteps}: max |compiled - eager| = {max_deviation(got, ref, ('energy', 'forces')):.2e}")

    dyn.attach(compare, interval=1)
    return dyn


def md_example(name: str, dtype: torch.dtype | None, temperature_k: float, description: str) -> None:
    """The MD example for adapter ``name``: its built-in system under Langevin
    dynamics with the compiled, padded model, first steps checked against the
    plain eager model."""
    import ddpad.adapters
    from ddpad.ase import Calculator

    args = parse(description, steps=200)
    adapter = ddpad.adapters.get(name)
    model = model_for(adapter, args.model, dtype, args.device)
    atoms = adapter.tools.default_system()
    atoms.calc = Calculator(model, name, backend=args.backend)
    dyn = langevin(atoms, Calculator(model, name, pad=False, compile=False), temperature_k, args.check)
    molecules = len(set(atoms.arrays["mol_id"])) if "mol_id" in atoms.arrays else None
    print(f"{len(atoms)} atoms" + (f" in {molecules} molecules" if molecules else "") + f" on {args.device}")
    report(atoms.calc, run(dyn, atoms, args.steps))
