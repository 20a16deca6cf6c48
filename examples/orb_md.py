"""Langevin MD of periodic bulk with a compiled, padded Orb v3 (orb-models).

    python examples/orb_md.py [--model orb-v3-conservative-20-omat.ckpt] [--steps 200] [--device cuda]

``--model`` takes a local orb checkpoint (a state dict named after its
architecture, or a whole module saved with ``torch.save``; no download).
Without it a small random conservative Orb v3 in float64 runs. Prints
steps/s, compiled graphs, cap growths and fill, and checks the first steps
against the plain eager model.
"""

import torch
from _common import md_example

md_example("orb", torch.float64, 600.0, __doc__.splitlines()[0])
