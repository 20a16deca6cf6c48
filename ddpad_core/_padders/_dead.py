"""Dead rows: the fill markers, and where dead edges go (SPEC section 5).

One module decides, sizes and writes what is dead in a padded graph: the
:class:`Fill` markers whose value depends on the padded graph, whether dead
edges (and sentinels) are self-loops on one dead atom or edges of a dead
anchor pair, how many dead atom rows that takes, where the dead atoms sit
and what the dead edges' shift fields hold. The padders only ask it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor

from .._capacity import CapPolicy

__all__ = ["DeadRows", "Fill", "FillSpec", "Placement", "coo_dead_rows", "dense_dead_rows"]


class Fill(enum.Enum):
    """Fill markers whose value depends on the padded graph."""

    #: The index of the system that holds the dead atoms (per-atom system labels).
    LAST_SYSTEM = "last_system"
    #: A cubic cell of the dead edge's length (per-system cell of dead systems).
    DEAD_CELL = "dead_cell"
    #: ``(length, 0, 0)``: the cartesian shift of a dead self-loop edge, the dead edge's length.
    DEAD_SHIFT = "dead_shift"
    #: ``(1, 0, 0)``: the lattice shift of a dead self-loop edge (with ``DEAD_CELL``).
    DEAD_UNIT_SHIFT = "dead_unit_shift"
    #: The last real entry (per-system fields that must hold a valid value, e.g. spin).
    LAST_REAL = "last_real"


FillSpec = int | float | bool | Tensor | Fill
"""A dead row's value for one field: a constant, a tensor, or a :class:`Fill` marker."""
Placement = Literal["own", "join"]


@dataclasses.dataclass(frozen=True)
class DeadRows:
    """Where a padder's dead edges go and what its dead rows hold.

    Attributes
    ----------
    self_loop
        Dead edges (and sentinels) are self-loops on the dead atom
        ``n_cap - 1``, made long by their shift fields; else edges of the
        anchor pair ``n_cap - 2 -> n_cap - 1``, ``dead_length`` apart, with
        zero shifts.
    rows_needed
        Dead atom rows every padded graph has beyond the real ones (COO: the
        self-loop atom or the anchor pair; dense: the sentinel row).
    dead_length
        How far out the dead atoms sit (beyond the model's cutoff).
    edge_length
        The length of a dead edge (the self-loop's shift, the anchor pair's
        separation, the dead system's cubic cell); None: ``dead_length``.
    """

    self_loop: bool
    rows_needed: int
    dead_length: float
    edge_length: float | None = None

    def __post_init__(self) -> None:
        if not self.dead_length > 0:
            raise ValueError(f"dead_length must be > 0, got {self.dead_length!r}")
        object.__setattr__(self, "dead_length", float(self.dead_length))
        edge = self.dead_length if self.edge_length is None else float(self.edge_length)
        if not edge > 0:
            raise ValueError(f"the dead edge length must be > 0, got {self.edge_length!r}")
        object.__setattr__(self, "edge_length", edge)

    def pair(self, n_cap: int) -> tuple[int, int]:
        """The dead edge's (sender, receiver)."""
        return (n_cap - 1, n_cap - 1) if self.self_loop else (n_cap - 2, n_cap - 1)

    def offsets(self, n_cap: int, like: Tensor) -> Tensor:
        """Dead positions relative to the largest real coordinate, ``[n_cap,
        *like.shape[1:]]``: ``dead_length`` out in every coordinate (out of
        every real atom's cutoff); the anchor pair's receiver ``edge_length``
        further along x."""
        offsets = torch.full((n_cap, *like.shape[1:]), self.dead_length, dtype=like.dtype, device=like.device)
        if not self.self_loop:
            offsets[n_cap - 1, 0] += self.edge_length
        return offsets

    def cell_fill(self, like: Tensor) -> Tensor:
        """A dead system's cell (:attr:`Fill.DEAD_CELL`): cubic, edge
        ``edge_length`` (a unit lattice shift through it is a dead edge)."""
        return torch.eye(3, dtype=like.dtype, device=like.device) * self.edge_length

    def shift_fill(self, spec: Fill, like: Tensor) -> Tensor:
        """One dead row of an edge shift field (:attr:`Fill.DEAD_SHIFT`,
        :attr:`Fill.DEAD_UNIT_SHIFT`): along x for a self-loop, else zero."""
        row = torch.zeros(like.shape[-1], dtype=like.dtype, device=like.device)
        if self.self_loop:
            row[0] = self.edge_length if spec is Fill.DEAD_SHIFT else 1
        return row

    def atoms_policy(self, policy: CapPolicy) -> CapPolicy:
        """``policy`` (one dead row: not strict) with slots for the other dead rows."""
        if self.rows_needed <= 1:
            return policy
        return dataclasses.replace(policy, extra=policy.extra + self.rows_needed - 1)


def coo_dead_rows(
    placement: Placement, edge_fields: Mapping[str, FillSpec], system_fields: Mapping[str, FillSpec],
    dead_length: float, *, vectors_from_cell: bool = False, edge_length: float | None = None,
) -> DeadRows:
    """The one rule for edge-list graphs: a self-loop when the dead atoms have
    their own system (``placement="own"``: joined to a real cell, maybe zero,
    a lattice image could be short) and an edge field makes the loop long,
    a cartesian :attr:`Fill.DEAD_SHIFT`, or (``vectors_from_cell``: the
    model builds edge vectors as ``unit_shift @ cell``, nequip) a
    :attr:`Fill.DEAD_UNIT_SHIFT` through the dead system's
    :attr:`Fill.DEAD_CELL`; else the anchor pair, which is long in any cell."""
    edge = set(map(_marker, edge_fields.values()))
    through_cell = vectors_from_cell and Fill.DEAD_UNIT_SHIFT in edge and Fill.DEAD_CELL in set(
        map(_marker, system_fields.values()))
    self_loop = placement == "own" and (Fill.DEAD_SHIFT in edge or through_cell)
    return DeadRows(self_loop=self_loop, rows_needed=1 if self_loop else 2, dead_length=dead_length,
                    edge_length=edge_length)


def dense_dead_rows(sentinel_row: bool, dead_length: float) -> DeadRows:
    """Dense neighbour matrices have no dead edges: the pad atom is the
    padded sentinel row ``n_cap - 1`` (one dead row), or the row the model
    appends (none)."""
    return DeadRows(self_loop=False, rows_needed=1 if sentinel_row else 0, dead_length=dead_length)


def _marker(spec: FillSpec) -> Fill | None:
    # a tensor fill is not hashable by value and never a marker
    return spec if isinstance(spec, Fill) else None
