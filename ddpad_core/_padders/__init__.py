"""Built-in padders for plain ``dict[str, Tensor]`` inputs (SPEC section 6).

Every padder pads atoms, systems and (COO) edges or (dense) neighbour
columns to grow-only caps resolved in one :func:`resolve_caps` call, so an
active agreement group costs one collective per step. Dead atoms live in
their own dead system (``placement="own"``, the default) or are joined to
the last real system (``"join"``, only for frameworks that sum owned
per-atom energies under a mask).

Modules, bottom to top: :mod:`._dead` (fill markers; dead edges as
self-loops or an anchor pair, the dead rows that takes), :mod:`._policies`
(default cap policies), :mod:`._checks` (malformed input: shapes on every
device, index values on the CPU only, where reading one costs no
synchronisation), :mod:`._buffers` (persistent buffers, the plan),
:mod:`._base` (:class:`PadderBase`: ``pad`` / ``unpad`` and the public
hooks), :mod:`.coo` and :mod:`.dense` (the layouts).
"""

from ._base import PadderBase
from ._dead import Fill, FillSpec, Placement
from ._policies import (
    ATOMS_POLICY,
    BATCH_ATOMS_POLICY,
    DENSE_ATOMS_POLICY,
    EDGES_POLICY,
    NEIGHBORS_POLICY,
    SYSTEMS_POLICY,
)
from .coo import COOPadder
from .dense import DenseBatchPadder, DensePadder

__all__ = [
    "ATOMS_POLICY",
    "BATCH_ATOMS_POLICY",
    "COOPadder",
    "DENSE_ATOMS_POLICY",
    "DenseBatchPadder",
    "DensePadder",
    "EDGES_POLICY",
    "Fill",
    "FillSpec",
    "NEIGHBORS_POLICY",
    "PadderBase",
    "Placement",
    "SYSTEMS_POLICY",
]
