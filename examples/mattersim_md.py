"""Langevin MD of periodic bulk with a compiled, padded MatterSim (M3GNet, float32).

    python examples/mattersim_md.py [--model mattersim-v1.0.0-1M.pth] [--steps 200] [--device cuda]

``--model`` takes a local mattersim checkpoint (``Potential.save`` format,
e.g. a downloaded ``mattersim-v1.0.0-1M.pth``; nothing is downloaded).
Without it a small random M3GNet (mattersim's 5 A / 4 A cutoffs) runs.
Prints steps/s, compiled graphs, cap growths and fill (atoms, edges,
triplets, systems), and checks the first steps against the plain eager
model. MatterSim runs in float32 only.
"""

import torch
from _common import md_example

md_example("mattersim", torch.float32, 600.0, __doc__.splitlines()[0])
