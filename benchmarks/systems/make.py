"""Write the structures the benchmarks page measures trained models on
(``python benchmarks/systems/make.py``; the files beside it are its output).

- ``si64.extxyz``: diamond silicon, 2x2x2 conventional cells, rattled 0.05 A;
- ``mgo64.extxyz``: rock-salt MgO, 2x2x2 conventional cells (a = 4.21 A), rattled 0.05 A;
- ``water96.extxyz``: 32 water molecules in a periodic 9.86 A box (1.0 g/cm3),
  on a jittered lattice with random orientations, no two molecules' atoms
  closer than 1.7 A: a liquid-density box, not an equilibrated liquid.
"""

from __future__ import annotations

import pathlib

import numpy as np
from ase import Atoms
from ase.build import bulk, molecule

HERE = pathlib.Path(__file__).resolve().parent


def crystal(symbol: str, structure: str, a: float, seed: int) -> Atoms:
    atoms = bulk(symbol, structure, a=a, cubic=True) * (2, 2, 2)
    atoms.rattle(0.05, seed=seed)
    return atoms


def water_box(molecules: int = 32, density: float = 1.0, seed: int = 0) -> Atoms:
    """``molecules`` waters at ``density`` g/cm3 in a cubic periodic box."""
    rng = np.random.default_rng(seed)
    mass = molecules * 18.015 / 6.02214076e23  # g
    side = (mass / density) ** (1 / 3) * 1e8  # A
    per_side = int(np.ceil((2 * molecules) ** (1 / 3)))
    spacing = side / per_side
    water = molecule("H2O")
    water.positions -= water.get_center_of_mass()
    box = Atoms(cell=[side] * 3, pbc=True)
    # the even sites of a grid (rock-salt's one sublattice): neighbours sqrt(2) spacings apart
    sites = [(i, j, k) for i in range(per_side) for j in range(per_side) for k in range(per_side)
             if (i + j + k) % 2 == 0]
    for site in rng.permutation(len(sites))[:molecules]:
        for _ in range(100):  # a random orientation and jitter that keeps 1.7 A from every other molecule
            w = water.copy()
            w.rotate(rng.uniform(0, 360), rng.normal(size=3), center=(0, 0, 0))
            w.positions += (np.array(sites[site]) + 0.5) * spacing + rng.uniform(-0.3, 0.3, 3)
            trial = box + w
            if len(box) == 0:
                break
            dist = np.min([trial.get_distances(i, range(len(box)), mic=True).min() for i in range(len(box), len(trial))])
            if dist > 1.7:
                break
        else:
            raise RuntimeError("no place for a water molecule: lower the density")
        box += w
    box.wrap()
    return box


def main() -> None:
    for name, atoms in (("si64", crystal("Si", "diamond", 5.43, 1)),
                        ("mgo64", crystal("MgO", "rocksalt", 4.21, 2)),
                        ("water96", water_box())):
        atoms.write(HERE / f"{name}.extxyz", format="extxyz")
        print(f"{name}.extxyz: {atoms.get_chemical_formula()}, {len(atoms)} atoms")


if __name__ == "__main__":
    main()
