"""The distributed context model code reads, like ``torch.is_grad_enabled()``
(SPEC section 7)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ._protocol import GraphPadder

__all__ = [
    "NOT_DISTRIBUTED",
    "DistributedContext",
    "GatherMeta",
    "HaloMeta",
    "activate_dd_context",
    "current_dd_context",
]


@dataclass(frozen=True)
class HaloMeta:
    """Halo (ghost-atom) layout of one rank's step under spatial decomposition.

    Parameters
    ----------
    n_owned
        Atoms this rank owns (its energy and forces are authoritative).
    n_padded
        Rows the model sees: owned + ghost + dead.
    send_sizes
        Atoms sent to each rank in the halo exchange (one entry per rank).
    n_global
        Atoms in the whole system.
    """

    n_owned: int
    n_padded: int
    send_sizes: tuple[int, ...] = ()
    n_global: int | None = None


@dataclass(frozen=True)
class GatherMeta:
    """Layout of a sharded (all-gathered) step: per-rank row counts.

    Parameters
    ----------
    n_owned
        Rows this rank contributes.
    n_padded
        Rows this rank's model sees after padding.
    counts
        Rows contributed by each rank, in rank order.
    n_global
        Sum of ``counts``.
    """

    n_owned: int
    n_padded: int
    counts: tuple[int, ...] = ()
    n_global: int | None = None


@dataclass
class DistributedContext:
    """Per-scope distributed state, built once and updated every step.

    Read it in model code through :func:`current_dd_context`. ``n_owned`` and
    ``n_padded`` change per step: read them only in eager code.
    """

    mesh: Any = None
    policy: Any = None
    halo_config: Any = None
    n_systems_global: int | None = None
    n_atoms_total: int | None = None
    halo_meta: HaloMeta | None = None
    gather_meta: GatherMeta | None = None
    strategy: str | None = None
    owned_offset: int = 0
    cap_state: dict[str, int] = field(default_factory=dict)
    graph_padder: GraphPadder | None = None
    cap_atoms: bool = True
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def is_halo(self) -> bool:
        """Halo metadata is present."""
        return self.halo_meta is not None

    @property
    def is_sharded(self) -> bool:
        """Gather metadata is present."""
        return self.gather_meta is not None

    @property
    def world_size(self) -> int:
        """Ranks in the mesh; 1 when unknown."""
        if self.mesh is None:
            return 1
        size = getattr(self.mesh, "size", None)
        return int(size() if callable(size) else size or 1)

    @property
    def rank(self) -> int:
        """This process's rank in the mesh; 0 when unknown."""
        if self.mesh is None:
            return 0
        get_rank = getattr(self.mesh, "get_rank", None)
        return int(get_rank()) if callable(get_rank) else 0

    @property
    def is_distributed(self) -> bool:
        """Halo or gather metadata present, or a mesh of more than one rank."""
        return self.is_halo or self.is_sharded or self.world_size > 1

    @property
    def n_owned(self) -> int | None:
        """Owned rows this step, ``None`` when unknown."""
        meta = self.halo_meta or self.gather_meta
        return None if meta is None else meta.n_owned

    @property
    def n_padded(self) -> int | None:
        """Rows the model sees this step, ``None`` when unknown."""
        meta = self.halo_meta or self.gather_meta
        return None if meta is None else meta.n_padded

    @property
    def compiling(self) -> bool:
        """True while ``torch.compile`` traces."""
        return bool(torch.compiler.is_compiling())

    def maybe_pad_graph(self, data: Any) -> Any:
        """Pad ``data`` with ``graph_padder`` against ``cap_state`` when a padder
        is set; return it unchanged otherwise."""
        if self.graph_padder is None:
            return data
        return self.graph_padder.pad(data, self.cap_state, cap_atoms=self.cap_atoms)


class _Inert(DistributedContext):
    """A read-only :class:`DistributedContext`: the shared default must never
    pick up a padder or caps from one caller and hand them to another."""

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_sealed", False):
            raise AttributeError(
                "NOT_DISTRIBUTED is read-only; build a DistributedContext and "
                "enter it with activate_dd_context(ctx)"
            )
        super().__setattr__(name, value)


NOT_DISTRIBUTED: DistributedContext = _Inert()
"""The inert context active outside any scope (``is_distributed`` is False)."""
object.__setattr__(NOT_DISTRIBUTED, "_sealed", True)

_CURRENT: contextvars.ContextVar[DistributedContext] = contextvars.ContextVar(
    "ddpad_dd_context", default=NOT_DISTRIBUTED
)


def current_dd_context() -> DistributedContext:
    """The active :class:`DistributedContext`, or :data:`NOT_DISTRIBUTED`."""
    return _CURRENT.get()


@contextlib.contextmanager
def activate_dd_context(ctx: DistributedContext) -> Iterator[DistributedContext]:
    """Make ``ctx`` active inside the block; the previous one comes back on
    exit, exceptions included. Re-entrant."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
