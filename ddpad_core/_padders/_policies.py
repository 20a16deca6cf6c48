"""The built-in padders' default cap policies (SPEC section 6 numbers), in
one place: adapters import these rather than re-typing them."""

from __future__ import annotations

from .._capacity import CapPolicy

__all__ = [
    "ATOMS_POLICY", "BATCH_ATOMS_POLICY", "DENSE_ATOMS_POLICY", "EDGES_POLICY", "NEIGHBORS_POLICY",
    "SYSTEMS_POLICY",
]

#: COO atoms with one dead row (a dead self-loop atom at ``n_cap - 1``: not
#: strict); the anchor pair adds a slot (:meth:`DeadRows.atoms_policy`).
ATOMS_POLICY = CapPolicy(initial_factor=1.15, grow_factor=1.30, stride=16, strict_gt=False)
#: COO edges: edge counts climb about 25 % through equilibration.
EDGES_POLICY = CapPolicy(initial_factor=1.35, grow_factor=1.30, stride=16)
#: Systems (a batched simulation's system count).
SYSTEMS_POLICY = CapPolicy(initial_factor=1.0, grow_factor=1.5, stride=4)
#: :class:`DensePadder` atoms (the sentinel row at ``n_cap - 1``: not strict).
DENSE_ATOMS_POLICY = CapPolicy(initial_factor=1.15, grow_factor=1.15, stride=16, strict_gt=False)
#: :class:`DenseBatchPadder` atoms (the model appends the pad atom).
BATCH_ATOMS_POLICY = CapPolicy(initial_factor=1.15, grow_factor=1.30, stride=16)
#: The width ``K`` of a dense neighbour matrix.
NEIGHBORS_POLICY = CapPolicy(initial_factor=1.0, grow_factor=1.25, stride=8)
