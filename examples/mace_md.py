"""Langevin MD of periodic bulk with a compiled, padded MACE.

    python examples/mace_md.py [--model my.model] [--steps 200] [--device cuda]

Prints steps/s, compiled graphs, cap growths and fill, and checks the first
steps against the plain eager model (no padding, no compile).
"""

from __future__ import annotations

import torch
from _common import langevin, model_for, parse, report, run

import ddpad.adapters
from ddpad.ase import Calculator

args = parse(__doc__.splitlines()[0], steps=200)
adapter = ddpad.adapters.get("mace")
model = model_for(adapter, args.model, torch.float64, args.device)
atoms = adapter.default_system()
atoms.calc = Calculator(model, "mace", backend=args.backend)
dyn = langevin(atoms, Calculator(model, "mace", pad=False), temperature_k=600, check=args.check)
print(f"{len(atoms)} atoms on {args.device}")
report(atoms.calc, run(dyn, atoms, args.steps))
