"""Langevin MD of a set of small molecules with a compiled, padded AIMNet2.

    python examples/aimnet2_md.py [--model aimnet2.pt] [--steps 200] [--device cuda]

The molecules share one ``ase.Atoms``; its ``mol_id`` array keeps them
separate molecules for AIMNet2 (each its own charge equilibration). Prints
steps/s, compiled graphs, cap growths and fill, and checks the first steps
against the plain eager model.
"""

from _common import md_example

md_example("aimnet2", None, 300.0, __doc__.splitlines()[0])
