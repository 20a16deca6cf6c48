"""Persistent cap-sized buffers and the padding plan (what every call writes).

Everything fixed by the caps, the real system count and the input's fields,
dtypes and trailing shapes (persistent cap-sized buffers, their views, fill
values, the list of copies) is a :class:`_Plan`, rebuilt only when one of
those changes; buffers are reallocated only when their own shape, dtype or
device changes, so the padded tensors keep their storage from call to call
(what CUDA-graph replay needs). Dead rows are rewritten only where they went
stale: when a real count drops from ``n`` to ``m`` rows ``m .. n`` become
dead, the others already are. A buffer someone else wrote into (its version
counter moved) is rewritten whole.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ._dead import Fill

__all__ = ["_Grid", "_Plan", "_Rows", "_write"]

_Value = Tensor | float | int | bool  # a resolved fill, broadcastable to one row (block)

# attribute reads over a list of tensors in C (map), not a Python loop: a
# steady call reads these for every field
_VERSION = operator.attrgetter("_version")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_NO_GRAD: frozenset[int] = frozenset()


def _write(view: Tensor, fill: _Value) -> None:
    if isinstance(fill, Tensor):
        view.copy_(fill)
    else:
        view.fill_(fill)


class _Rows:
    """A persistent cap-sized output buffer padded along its first dimension.

    Real rows are written every call; dead rows only where they went stale
    (:meth:`settle`). ``transposed`` buffers (a ``[2, E]`` edge index) are
    padded along their last dimension; a row may be a block of ``unit`` rows
    of the field (mace's per-system cell ``[S * 3, 3]``).
    """

    __slots__ = ("_last", "_n", "_real", "alias", "blocks", "buf", "extent", "fill", "flat", "transposed", "unit")

    def __init__(self, buf: Tensor, fill: _Value | Fill | None, *, unit: int = 1, transposed: bool = False) -> None:
        self.buf = buf
        self.flat = buf.t() if transposed else buf
        self.blocks = self.flat.view(-1, unit, *self.flat.shape[1:]) if unit > 1 else self.flat
        self.alias = buf.detach()  # what the model gets: flags it sets never reach ``buf``
        self.fill = fill
        self.unit = unit
        self.transposed = transposed
        self.extent = -1  # rows holding real data after the last write; -1: dead rows unknown
        self._n = -1
        self._real = buf
        self._last: tuple[int, Tensor, Tensor | None] | None = None

    @property
    def cap(self) -> int:
        return self.blocks.shape[0]

    def invalidate(self) -> None:
        self.extent = -1

    def real(self, n: int) -> Tensor:
        """Where ``n`` real rows (blocks) go, in the field's own layout."""
        if n != self._n:
            view = self.flat[: n * self.unit]
            self._real = view.t() if self.transposed else view
            self._n = n
        return self._real

    def settle(self, n: int) -> None:
        """Make rows ``n ..`` dead, writing only those that are not yet."""
        stop = self.cap if self.extent < 0 else self.extent
        if n < stop and not isinstance(self.fill, Fill):
            _write(self.blocks[n:stop], self.fill)  # type: ignore[arg-type]
        self.extent = n

    def copy_last(self, n: int) -> None:
        """:attr:`Fill.LAST_REAL`: every dead row is the last real one (zeros without one)."""
        if self._last is None or self._last[0] != n:
            self._last = (n, self.blocks[n:], self.blocks[n - 1] if n else None)
        _, dead, last = self._last
        if n < self.cap and last is not None:
            dead.copy_(last)
        elif n < self.cap:
            dead.zero_()

    def tail(self, n: int, src: Tensor) -> Tensor:
        """The dead rows after ``n`` real ones as a new tensor (for ``torch.cat``)."""
        fill = self.fill
        if fill is Fill.LAST_REAL:
            fill = src.detach().reshape(-1, *self.blocks.shape[1:])[-1] if n else 0
        blocks = torch.as_tensor(fill, dtype=self.buf.dtype, device=self.buf.device)
        blocks = blocks.expand(self.cap - n, *self.blocks.shape[1:])
        return blocks.reshape(-1, *self.flat.shape[1:]) if self.unit > 1 else blocks


class _Grid:
    """A persistent ``[n_cap, k_cap, ...]`` neighbour buffer: the real block
    ``[:n, :k]`` is written every call, the rest is ``fill``, rewritten only
    where it went stale."""

    __slots__ = ("_nk", "_real", "alias", "buf", "extent", "fill")

    def __init__(self, buf: Tensor, fill: _Value) -> None:
        self.buf = buf
        self.alias = buf.detach()
        self.fill = fill
        self.extent: tuple[int, int] | None = None  # the real block after the last write
        self._nk = (-1, -1)
        self._real = buf

    def invalidate(self) -> None:
        self.extent = None

    def real(self, n: int, k: int) -> Tensor:
        if (n, k) != self._nk:
            self._real = self.buf[:n, :k]
            self._nk = (n, k)
        return self._real

    def settle(self, n: int, k: int) -> None:
        """Make everything outside ``[:n, :k]`` dead, writing only stale parts."""
        if self.extent == (n, k):
            return
        n_cap, k_cap = self.buf.shape[:2]
        pn, pk = (n_cap, k_cap) if self.extent is None else self.extent
        # what held real data (or is unknown) and no longer does
        for r0, r1, c0, c1 in ((n, pn, 0, pk), (0, min(n, pn), k, pk)):
            if r0 < r1 and c0 < c1:
                _write(self.buf[r0:r1, c0:c1], self.fill)
        self.extent = (n, k)


class _Plan:
    """What a padder writes for one layout: the fields copied from the input
    each call, their buffers, the checks an input must pass to use it, the
    dead rows that follow the counts, and what the last write left behind."""

    # COO: positions, their dead offsets and bounding-box corner, the dead edge
    # pair and edge fills; dense: neighbour matrices and fields
    pos: _Rows
    offsets: Tensor
    far: Tensor
    pos_views: tuple[int, Tensor, Tensor]
    pair: Tensor
    edge_fill: dict[int, Tensor]
    edge_span: range
    n_atom_fields: int
    mats: list[tuple[str, _Grid, Tensor]]
    neighbors: list[tuple[str, str, _Grid, Tensor]]

    def __init__(self, key: tuple[Any, ...], config: tuple[dict[str, Any], ...]) -> None:
        self.key = key
        self.config = config  # the padder's field maps when built (they may be edited)
        self.names: list[str] = []  # fields copied from the input each call, in order
        self.dst: list[_Rows] = []
        self.dtypes: list[torch.dtype] = []
        self.layout: list[tuple[int, int, int, tuple[int, ...], tuple[int, ...]]] = []
        self.floats: list[int] = []  # fields that may require grad
        self.float_aliases: list[Tensor] = []  # their aliases, in that order
        self.aliases: dict[str, Tensor] = {}
        self.tracked: list[_Rows | _Grid] = []  # buffers whose dead rows are kept, not rewritten
        self._tracked_bufs: list[Tensor] = []
        self.versions: list[int] = []  # their version counters after the last write
        self.dims: tuple[int, ...] | None = None  # the real counts of the last write
        self.settle: list[tuple[_Rows, int]] = []  # (rows, dims index of its real count)
        self.last_real: list[tuple[_Rows, int]] = []
        self.count_rows: list[tuple[Tensor, int, int, bool]] = []  # (row, dims index, cap, add)
        self.ptr_mid: Tensor | None = None  # ptr entries of empty systems: n
        self.ptr_last: Tensor | None = None  # ptr[s] under "join": n_cap
        self.ptr_value = 0
        self.labels: tuple[int, str] | None = None  # (field index, source of the system count): checked
        self._shapes: list[tuple[int, ...]] = []
        self._views: list[Tensor] = []
        self._view_dims: tuple[int, ...] | None = None

    def add(self, name: str, rows: _Rows, src: Tensor, dim: int, *, view_dim: int | None = None,
            tracked: bool = True) -> None:
        """Copy ``src`` (``name``) into ``rows`` each call. Its padded dimension
        has ``dims[dim]`` rows (blocks of ``rows.unit``); ``dims[view_dim]``
        (default ``dim``) of them are real and copied."""
        shape = tuple(src.shape)
        axis = len(shape) - 1 if rows.transposed else 0
        self.names.append(name)
        self.dst.append(rows)
        self.dtypes.append(src.dtype)
        self.layout.append((dim, dim if view_dim is None else view_dim, rows.unit, shape[:axis], shape[axis + 1:]))
        if src.is_floating_point() or src.is_complex():
            self.floats.append(len(self.names) - 1)
            self.float_aliases.append(rows.alias)
        self.aliases[name] = rows.alias
        if tracked:
            self.tracked.append(rows)
            self.settle.append((rows, dim if view_dim is None else view_dim))

    def fits(self, srcs: list[Tensor], dims: tuple[int, ...]) -> bool:
        """Whether the input has the dtypes and shapes this plan was built for."""
        if dims != self.dims or not self._shapes:
            self._shapes = [(*before, dims[d] * unit, *after) for d, _, unit, before, after in self.layout]
        return list(map(_DTYPE, srcs)) == self.dtypes and list(map(_SHAPE, srcs)) == self._shapes

    def mismatch(self, srcs: list[Tensor], dims: tuple[int, ...]) -> str:
        """Why :meth:`fits` failed, for the error message."""
        self.fits(srcs, dims)
        for name, t, dtype, shape in zip(self.names, srcs, self.dtypes, self._shapes):
            if t.dtype != dtype or tuple(t.shape) != shape:
                return f"field {name!r} has shape {tuple(t.shape)}, expected {shape} from the real counts"
        return "input does not match its padding plan"

    def views(self, dims: tuple[int, ...]) -> list[Tensor]:
        """Where each field's real rows go."""
        if dims != self._view_dims:
            self._views = [rows.real(dims[d]) for rows, (_, d, *_) in zip(self.dst, self.layout)]
            self._view_dims = dims
        return self._views

    def check(self) -> bool:
        """Before a call's writes: whether dead rows may be stale beyond what
        the counts say (a new plan, or buffers someone else wrote into, whose
        dead rows are then rewritten whole)."""
        if self.dims is None:
            return True
        versions = self._versions()
        if versions == self.versions:
            return False
        for r, v, w in zip(self.tracked, versions, self.versions):
            if v != w:
                r.invalidate()
        return True

    def write_dead(self, dims: tuple[int, ...], stale: bool) -> None:
        """Write the dead rows that went stale since the last call (all of
        them when ``stale``), and those that follow the data
        (:attr:`Fill.LAST_REAL`, ``ptr`` and a joined system's count; the
        dead system's counts only when theirs changed)."""
        if stale or dims != self.dims:
            for rows, d in self.settle:
                rows.settle(dims[d])
            if self.ptr_mid is not None:
                self.ptr_mid.fill_(dims[0])
        for rows, d in self.last_real:
            rows.copy_last(dims[d])
        for row, d, cap, add in self.count_rows:
            if add:  # "join": the last real system, just copied
                row.add_(cap - dims[d])
            elif stale or self.dims is None or dims[d] != self.dims[d]:  # "own": the dead system's, kept
                row.fill_(cap - dims[d])
        if self.ptr_last is not None:
            self.ptr_last.fill_(self.ptr_value)

    def _versions(self) -> list[int]:
        if len(self._tracked_bufs) != len(self.tracked):  # (tracked is complete once planned)
            self._tracked_bufs = [r.buf for r in self.tracked]
        return list(map(_VERSION, self._tracked_bufs))

    def done(self, dims: tuple[int, ...]) -> None:
        self.versions = self._versions()
        self.dims = dims

    def finish(self, dims: tuple[int, ...], data: Mapping[str, Any], concat: dict[str, Tensor]) -> dict[str, Any]:
        """After a call's writes: record them, and the model's input: ``data``
        with the padded fields' aliases (and the concatenated ones)."""
        self.done(dims)
        self.fresh_aliases()
        out = dict(data)
        out.update(self.aliases)
        out.update(concat)
        return out

    def fresh_aliases(self) -> None:
        """Replace aliases the model marked as requiring grad (a ``.grad``
        can only have reached one that does)."""
        if not any(map(_REQUIRES_GRAD, self.float_aliases)):
            return
        for k, i in enumerate(self.floats):
            rows = self.dst[i]
            if rows.alias.requires_grad:
                rows.alias = self.aliases[self.names[i]] = self.float_aliases[k] = rows.buf.detach()
