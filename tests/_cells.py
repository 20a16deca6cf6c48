"""Structures the adapter test modules share."""

from __future__ import annotations

from typing import Any

from ase.build import bulk


def small_hco_cells() -> list[Any]:
    """Rattled periodic H/C/O diamond cells of 4, 3 and 2 atoms (primitive
    cells, lost atoms), largest first. At a foundation model's r_max (6 A
    NequIP-OAM, 7 A Allegro-OAM: 150 to 250 neighbours an atom) an eager
    step costs seconds and a compile minutes on a CPU: the caps of the
    first call hold the rest (one graph a configuration) and the cells are
    the smallest bulk."""
    base = bulk("C", "diamond", a=3.57) * (2, 1, 1)
    base.numbers = [1, 6, 8, 6]
    cells = []
    for step, n in enumerate((4, 3, 2)):
        atoms = base[:n]
        atoms.rattle(0.08, seed=step)
        cells.append(atoms)
    return cells
