"""Langevin MD of a set of small molecules with a compiled, padded AIMNet2.

    python examples/aimnet2_md.py [--model aimnet2.pt] [--steps 200] [--device cuda]

The molecules share one ``ase.Atoms``; its ``mol_id`` array keeps them
separate molecules for AIMNet2 (own charge equilibration each).
"""

from __future__ import annotations

import numpy as np
from _common import max_deviation, model_for, parse, report, run
from ase import units
from ase.md.langevin import Langevin
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

import ddpad.adapters
from ddpad.ase import Calculator

args = parse(__doc__.splitlines()[0], steps=200)
adapter = ddpad.adapters.get("aimnet2")
model = model_for(adapter, args.model, None, args.device)
atoms = adapter.default_system()
atoms.calc = Calculator(model, "aimnet2", backend=args.backend)
eager = Calculator(model, "aimnet2", pad=False)  # the plain model: no padding, no compile

MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
dyn = Langevin(atoms, 0.5 * units.fs, temperature_K=300, friction=0.01 / units.fs, rng=np.random.default_rng(1))


def check() -> None:  # compiled + padded vs the plain eager model, first steps
    if dyn.nsteps < args.check:
        probe = atoms.copy()
        probe.calc = eager
        ref = {"energy": probe.get_potential_energy(), "forces": probe.get_forces()}
        got = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
        print(f"step {dyn.nsteps}: max |compiled - eager| = {max_deviation(got, ref, ('energy', 'forces')):.2e}")


dyn.attach(check, interval=1)
print(f"{len(atoms)} atoms in {len(set(atoms.arrays['mol_id']))} molecules on {args.device}")
report(atoms.calc, run(dyn, atoms, args.steps))
