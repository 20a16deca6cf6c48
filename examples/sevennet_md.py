"""Langevin MD of periodic bulk with a compiled, padded SevenNet (float32).

    python examples/sevennet_md.py [--model checkpoint.pth] [--steps 200] [--device cuda]

Prints steps/s, compiled graphs, cap growths and fill, and checks the first
steps against the plain eager model (no padding, no compile). SevenNet runs
in float32 only; ``--model`` takes a local sevenn checkpoint file.
"""

import torch
from _common import md_example

md_example("sevennet", torch.float32, 600.0, __doc__.splitlines()[0])
