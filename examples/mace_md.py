"""Langevin MD of periodic bulk with a compiled, padded MACE.

    python examples/mace_md.py [--model my.model] [--steps 200] [--device cuda]

Prints steps/s, compiled graphs, cap growths and fill, and checks the first
steps against the eager, unpadded model.
"""

from __future__ import annotations

import numpy as np
import torch
from _common import max_deviation, model_for, parse, report, run
from ase import units
from ase.md.langevin import Langevin
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

import ddpad.adapters
from ddpad.ase import Calculator

args = parse(__doc__.splitlines()[0], steps=200)
adapter = ddpad.adapters.get("mace")
model = model_for(adapter, args.model, torch.float64, args.device)
atoms = adapter.default_system()
atoms.calc = Calculator(model, "mace", backend=args.backend)
eager = Calculator(model, "mace", pad=False)  # the plain model: no padding, no compile

MaxwellBoltzmannDistribution(atoms, temperature_K=600, rng=np.random.default_rng(0))
dyn = Langevin(atoms, 0.5 * units.fs, temperature_K=600, friction=0.01 / units.fs, rng=np.random.default_rng(1))


def check() -> None:  # compiled + padded vs the plain eager model, first steps
    if dyn.nsteps < args.check:
        probe = atoms.copy()
        probe.calc = eager
        ref = {"energy": probe.get_potential_energy(), "forces": probe.get_forces()}
        got = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
        print(f"step {dyn.nsteps}: max |compiled - eager| = {max_deviation(got, ref, ('energy', 'forces')):.2e}")


dyn.attach(check, interval=1)
print(f"{len(atoms)} atoms on {args.device}")
report(atoms.calc, run(dyn, atoms, args.steps))
