"""Batched FIRE relaxation under torch-sim: ddpad's padded model vs the
unpadded compiled model, on the same structures.

    python examples/torchsim_batched.py [--model my.model] [--device cuda] [--backend inductor]

Reports wall time and compiled graphs for both. Systems of different sizes
share one batch; their edge counts change every step of the relaxation.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch_sim as ts
from ase.build import bulk

import ddpad.adapters
from ddpad.torchsim import Model

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", help="local mace checkpoint (default: randomly initialised)")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--backend", default="inductor")
parser.add_argument("--steps", type=int, default=60)
args = parser.parse_args()

adapter = ddpad.adapters.get("mace")
model = adapter.tools.load_model(args.model, args.device) if args.model else adapter.tools.random_model(torch.float64, args.device)
structures = []
for i, rep in enumerate([(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 2, 1), (1, 2, 1), (2, 1, 2)]):
    atoms = bulk("C", "diamond", a=3.57, cubic=True) * rep
    atoms.rattle(0.1, seed=i)
    structures.append(atoms)

for label, pad in (("unpadded torch.compile", False), ("ddpad", True)):
    ts_model = Model(model, "mace", pad=pad, backend=args.backend)
    t0 = time.perf_counter()
    final = ts.optimize(system=structures, model=ts_model, optimizer=ts.optimizers.fire, max_steps=args.steps)
    wall = time.perf_counter() - t0
    stats = ts_model.evaluate.stats
    print(f"{label:<24} {wall:8.1f} s  compiled graphs {stats.graphs:3d}  calls {stats.calls}")
