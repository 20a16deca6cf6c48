"""Langevin MD of periodic bulk with a compiled, padded Allegro.

    python examples/allegro_md.py [--model my.ckpt|my.nequip.zip] [--steps 200] [--device cuda]

Prints steps/s, compiled graphs, cap growths and fill, and checks the first
steps against the plain eager model (no padding, no compile).
"""

import torch
from _common import md_example

md_example("allegro", torch.float64, 600.0, __doc__.splitlines()[0])
