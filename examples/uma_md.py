"""Langevin MD of periodic bulk with a compiled, padded UMA (fairchem).

    python examples/uma_md.py [--model uma.pt] [--steps 200] [--device cuda]

``--model`` takes a local fairchem checkpoint file (no download). Prints
steps/s, compiled graphs, cap growths and fill, and checks the first steps
against the plain eager model.
"""

from __future__ import annotations

from _common import langevin, model_for, parse, report, run

import ddpad.adapters
from ddpad.ase import Calculator

args = parse(__doc__.splitlines()[0], steps=200)
adapter = ddpad.adapters.get("uma")
model = model_for(adapter, args.model, None, args.device)
atoms = adapter.default_system()
atoms.calc = Calculator(model, "uma", backend=args.backend)
dyn = langevin(atoms, Calculator(model, "uma", pad=False), temperature_k=600, check=args.check)
print(f"{len(atoms)} atoms on {args.device}")
report(atoms.calc, run(dyn, atoms, args.steps))
