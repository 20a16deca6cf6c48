"""Built-in test systems the adapters share (``ddpad run NAME`` without files)."""

from __future__ import annotations

from typing import Any


def diamond_carbon() -> Any:
    """Periodic bulk: a rattled 2x2x2 diamond-carbon supercell (64 atoms)."""
    from ase.build import bulk

    atoms = bulk("C", "diamond", a=3.57, cubic=True) * (2, 2, 2)
    atoms.rattle(0.05, seed=0)
    return atoms
