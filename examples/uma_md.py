"""Langevin MD of periodic bulk with a compiled, padded UMA (fairchem).

    python examples/uma_md.py [--model uma.pt] [--steps 200] [--device cuda]

``--model`` takes a local fairchem checkpoint file (no download). Prints
steps/s, compiled graphs, cap growths and fill, and checks the first steps
against the plain eager model.
"""

from _common import md_example

md_example("uma", None, 600.0, __doc__.splitlines()[0])
