"""Langevin MD of a set of small molecules with a compiled, padded AIMNet2.

    python examples/aimnet2_md.py [--model aimnet2.pt] [--steps 200] [--device cuda]

The molecules share one ``ase.Atoms``; its ``mol_id`` array keeps them
separate molecules for AIMNet2 (each its own charge equilibration). Prints
steps/s, compiled graphs, cap growths and fill, and checks the first steps
against the plain eager model.
"""

from __future__ import annotations

from _common import langevin, model_for, parse, report, run

import ddpad.adapters
from ddpad.ase import Calculator

args = parse(__doc__.splitlines()[0], steps=200)
adapter = ddpad.adapters.get("aimnet2")
model = model_for(adapter, args.model, None, args.device)
atoms = adapter.default_system()
atoms.calc = Calculator(model, "aimnet2", backend=args.backend)
dyn = langevin(atoms, Calculator(model, "aimnet2", pad=False), temperature_k=300, check=args.check)
print(f"{len(atoms)} atoms in {len(set(atoms.arrays['mol_id']))} molecules on {args.device}")
report(atoms.calc, run(dyn, atoms, args.steps))
