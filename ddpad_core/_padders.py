"""Built-in padders for plain ``dict[str, Tensor]`` inputs (SPEC section 6).

Every padder pads atoms, systems and (COO) edges or (dense) neighbour
columns to grow-only caps resolved in one :func:`resolve_caps` call, so an
active agreement group costs one collective per step. Dead atoms live in
their own dead system (``placement="own"``, the default) or are joined to
the last real system (``"join"``, only for frameworks that sum owned
per-atom energies under a mask).

The per-call cost is kept to what the data needs. Everything fixed by the
caps, the real system count and the input's fields, dtypes and trailing
shapes (persistent cap-sized buffers, their views, fill values, the list of
copies) is a *plan*, rebuilt only when one of those changes; buffers are
reallocated only when their own shape, dtype or device changes, so the
padded tensors keep their storage from call to call (what CUDA-graph replay
needs). A steady-state call checks the input against the plan, copies every
real row in one ``torch._foreach_copy_``, writes the dead positions (they
follow the largest real coordinate) and reroutes sentinel neighbours. Dead
rows are rewritten only where they went stale: when a real count drops from
``n`` to ``m`` rows ``m .. n`` become dead, the others already are. A buffer
someone else wrote into (its version counter moved) is rewritten whole. No
device value is read on the host, except on the CPU, where whether any edge
is a sentinel is read to skip the masked copies (no device to synchronise).
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from ._capacity import CapPolicy, resolve_caps

__all__ = ["COOPadder", "DenseBatchPadder", "DensePadder", "Fill", "FillSpec"]


class Fill(enum.Enum):
    """Fill markers whose value depends on the padded graph."""

    #: The index of the system that holds the dead atoms (per-atom system labels).
    LAST_SYSTEM = "last_system"
    #: A cubic cell of edge ``dead_length`` (per-system cell of dead systems).
    DEAD_CELL = "dead_cell"
    #: ``(dead_length, 0, 0)``: the cartesian shift of a dead self-loop edge.
    DEAD_SHIFT = "dead_shift"
    #: ``(1, 0, 0)``: the lattice shift of a dead self-loop edge (with ``DEAD_CELL``).
    DEAD_UNIT_SHIFT = "dead_unit_shift"
    #: The last real entry (per-system fields that must hold a valid value, e.g. spin).
    LAST_REAL = "last_real"


FillSpec = int | float | bool | Tensor | Fill
Placement = Literal["own", "join"]
_Value = Tensor | float | int | bool  # a resolved fill, broadcastable to one row (block)

# devices whose values the host reads without a synchronisation
_HOST_DEVICES = frozenset({"cpu"})
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

    def fresh_aliases(self) -> None:
        """Replace aliases the model marked as requiring grad (a ``.grad``
        can only have reached one that does)."""
        if not any(map(_REQUIRES_GRAD, self.float_aliases)):
            return
        for k, i in enumerate(self.floats):
            rows = self.dst[i]
            if rows.alias.requires_grad:
                rows.alias = self.aliases[self.names[i]] = self.float_aliases[k] = rows.buf.detach()


class _PadderBase:
    """Systems, placement, fills, persistent buffers and ``unpad``: what every
    built-in padder shares. Subclasses implement ``_count`` and ``_pad_to``."""

    self_loop = False  # dead edges as self-loops through the dead cell (COO only)

    def __init__(
        self,
        *,
        atom_fields: Mapping[str, FillSpec],
        system_fields: Mapping[str, FillSpec],
        ptr: str | None,
        system_count: str | None,
        placement: Placement,
        atom_outputs: Sequence[str],
        system_outputs: Sequence[str],
        atoms_policy: CapPolicy,
        systems_policy: CapPolicy | None,
        atoms_key: str,
        systems_key: str,
        dead_length: float,
    ) -> None:
        if placement not in ("own", "join"):
            raise ValueError(f"placement must be 'own' or 'join', got {placement!r}")
        if not dead_length > 0:
            raise ValueError(f"dead_length must be > 0, got {dead_length!r}")
        self.atom_fields = dict(atom_fields)
        self.system_fields = dict(system_fields)
        self.ptr = ptr
        self.system_count = system_count
        self.placement: Placement = placement
        self.atom_outputs = tuple(atom_outputs)
        self.system_outputs = tuple(system_outputs)
        self.atoms_policy = atoms_policy
        self.systems_policy = systems_policy
        self.atoms_key = atoms_key
        self.systems_key = systems_key
        self.dead_length = float(dead_length)
        self.n_atoms: int | None = None
        self.n_systems: int | None = None
        self.caps: dict[str, int] = {}
        self._buffers: dict[str, Tensor] = {}
        self._plan: _Plan | None = None
        self._row_cache: tuple[tuple[int, ...], dict[str, int]] | None = None
        self.allocations = 0  # cap-sized buffers allocated so far (steady state: none)

    # -- the protocol ---------------------------------------------------------

    def pad(self, data: Any, cap_state: dict[str, int], cap_atoms: bool = True) -> Any:
        """Resolve caps (one collective under an agreement group) and pad.

        Parameters
        ----------
        data
            The model's input dict; not modified. ``None`` is returned as is.
        cap_state
            The caller's caps, grown in place.
        cap_atoms
            False when the atom set is fixed: only edges / neighbour columns
            are capped, atoms get just the dead rows the padder needs.

        Returns
        -------
        dict
            ``data`` with its padded fields replaced by cap-sized tensors that
            share storage with the padder's buffers from call to call (a field
            that requires grad is concatenated instead, so gradients reach
            it). Valid until the next ``pad``.
        """
        if data is None:
            return None
        counts = self._count(data)
        requests: dict[str, tuple[int, CapPolicy]] = {}
        if cap_atoms:
            requests[self.atoms_key] = (counts[self.atoms_key], self.atoms_policy)
        if self.systems_policy is not None:
            requests[self.systems_key] = (
                self._system_need(counts[self.systems_key]),
                self.systems_policy,
            )
        requests.update(self._extra_requests(counts))
        caps = resolve_caps(cap_state, requests)
        if not cap_atoms:
            caps[self.atoms_key] = counts[self.atoms_key] + self._dead_rows_needed()
        if self.systems_policy is None:
            caps[self.systems_key] = self._system_need(counts[self.systems_key])
        return self._pad_counted(data, counts, caps)

    def pad_to(self, data: Any, caps: Mapping[str, int]) -> Any:
        """Pad ``data`` to the given caps without resolving or growing them.

        Raises
        ------
        RuntimeError
            When a real count overflows its cap; names the key, count and cap.
        """
        if data is None:
            return None
        return self._pad_counted(data, self._count(data), caps)

    def _pad_counted(self, data: Any, counts: dict[str, int], caps: Mapping[str, int]) -> Any:
        self._check_fits(counts, caps)
        self.n_atoms = counts[self.atoms_key]
        self.n_systems = counts[self.systems_key]
        self.caps = dict(caps)
        try:
            return self._pad_to(data, counts, caps)
        except BaseException:
            self._plan = None  # the buffers may be half written: the next call rewrites them whole
            raise

    def unpad(self, output: Any, n_real: int | None = None) -> Any:
        """Slice per-atom outputs to the real atoms and per-system outputs to
        the real systems. A bare tensor is treated as per-atom."""
        n_atoms = self.n_atoms if n_real is None else n_real
        if n_atoms is None:
            raise RuntimeError("unpad() before any pad(): pass n_real explicitly")
        if isinstance(output, Tensor):
            return output[:n_atoms]
        if output is None or not isinstance(output, Mapping):
            return output
        return self._unpad_mapping(output, self._rows_of(n_atoms))

    def _rows_of(self, n_atoms: int) -> dict[str, int]:
        """:meth:`_row_counts`, cached while the counts stay the same."""
        key = (n_atoms, self.n_systems, getattr(self, "n_edges", None))
        if self._row_cache is None or self._row_cache[0] != key:
            self._row_cache = (key, self._row_counts(n_atoms))
        return self._row_cache[1]

    def _row_counts(self, n_atoms: int) -> dict[str, int]:
        """Output key -> real rows."""
        rows = {key: n_atoms for key in self.atom_outputs}
        if self.n_systems is not None:
            rows.update({key: self.n_systems for key in self.system_outputs})
        return rows

    def _unpad_mapping(self, output: Mapping[str, Any], rows: Mapping[str, int]) -> dict[str, Any]:
        """Slice known output keys, at any depth of nested dicts (fairchem
        nests them per head and property)."""
        unpadded = {}
        for key, value in output.items():
            if isinstance(value, Tensor):  # first: a Mapping check is an ABC lookup
                if key in rows:
                    value = value[: rows[key]]
            elif isinstance(value, Mapping):
                value = self._unpad_mapping(value, rows)
            unpadded[key] = value
        return unpadded

    def restore(self) -> None:
        """Hand out fresh aliases for buffers the model flagged.

        The model gets aliases of the buffers (never the buffers), so flags it
        sets on its inputs (mace and UMA call ``requires_grad_``) never reach
        the buffers; an alias that requires grad is replaced before the next
        call. Frameworks call this after every padded
        forward (nvalchemi's protocol expects it); ``pad`` checks it too."""
        if self._plan is not None:
            self._plan.fresh_aliases()

    # -- hooks ----------------------------------------------------------------

    def _count(self, data: Mapping[str, Tensor]) -> dict[str, int]:
        raise NotImplementedError

    def _pad_to(self, data: Mapping[str, Tensor], counts: dict[str, int], caps: Mapping[str, int]) -> dict[str, Any]:
        raise NotImplementedError

    def _extra_requests(self, counts: dict[str, int]) -> dict[str, tuple[int, CapPolicy]]:
        return {}

    def _dead_rows_needed(self) -> int:
        return 0

    # -- shared helpers -------------------------------------------------------

    def _config(self) -> tuple[dict[str, Any], ...]:
        """The editable field maps a plan depends on (nvalchemi's engine adds fields)."""
        return (self.atom_fields, self.system_fields)

    def _plan_for(self, key: tuple[Any, ...]) -> _Plan | None:
        """The current plan if it was built for ``key`` and the field maps did not change."""
        plan = self._plan
        if plan is None or plan.key != key:
            return None
        try:
            if plan.config != self._config():
                return None
        except RuntimeError:  # a tensor fill replaced by another: compared elementwise
            return None
        return plan

    def _fitting_plan(self, data: Mapping[str, Tensor], key: tuple[Any, ...], dims: tuple[int, ...],
                      build: Callable[[], _Plan]) -> tuple[_Plan, list[Tensor]]:
        """The current plan if ``key`` and the input's dtypes and shapes fit
        it, else a new one from ``build``; with the input's fields in the
        plan's order."""
        plan = self._plan_for(key)
        srcs = list(map(data.__getitem__, plan.names)) if plan is not None else []
        if plan is None or not plan.fits(srcs, dims):
            plan = build()
            srcs = list(map(data.__getitem__, plan.names))
            if not plan.fits(srcs, dims):
                raise ValueError(f"ddpad: {plan.mismatch(srcs, dims)}")
        return plan, srcs

    def _new_plan(self, key: tuple[Any, ...]) -> _Plan:
        self._plan = None
        return _Plan(key, tuple(dict(m) for m in self._config()))

    def _system_need(self, n_systems: int) -> int:
        """Systems the padded graph needs: one more for an own dead system."""
        return n_systems + (1 if self.placement == "own" else 0)

    def _check_fits(self, counts: Mapping[str, int], caps: Mapping[str, int]) -> None:
        need = {
            self.atoms_key: counts[self.atoms_key] + self._dead_rows_needed(),
            self.systems_key: self._system_need(counts[self.systems_key]),
        }
        for key, (value, _) in self._extra_requests(counts).items():
            need[key] = value
        for key, value in need.items():
            cap = caps.get(key)
            if cap is None:
                raise RuntimeError(f"ddpad: no cap given for key {key!r}")
            if value > cap:
                raise RuntimeError(
                    f"ddpad: {key!r} overflows its cap: real {counts[key]} "
                    f"(needs {value} with dead slots) > cap {cap}; grow the cap "
                    "(pad() resolves and grows it) or preset a larger one"
                )
        if self.placement == "join" and counts[self.systems_key] == 0 and counts[self.atoms_key] == 0:
            raise RuntimeError(
                "ddpad: placement='join' needs a real system to join dead atoms to; "
                "use placement='own' for empty inputs"
            )

    def _n_systems(self, data: Mapping[str, Tensor], system_index: str | None) -> int:
        """Real systems: from ``ptr``, a per-system field, or the largest label."""
        if self.ptr is not None and self.ptr in data:
            return int(data[self.ptr].shape[0]) - 1
        if self.system_count is not None:
            return int(_require(data, self.system_count).shape[0])
        if system_index is not None and system_index in data:
            labels = data[system_index]
            return int(labels.amax()) + 1 if labels.numel() else 0  # a count: read once
        return 1

    def _dead_system(self, n_systems: int, s_cap: int) -> int:
        """Index of the system the dead atoms belong to."""
        return s_cap - 1 if self.placement == "own" else max(n_systems - 1, 0)

    def _buffer(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A persistent buffer, reallocated only when shape, dtype or device change."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
            self.allocations += 1
        return buf

    def _fill_value(self, spec: FillSpec, like: Tensor, dead_system: int) -> _Value | Fill:
        """Resolve a fill marker to a value broadcastable to one row (block) of
        ``like``; :attr:`Fill.LAST_REAL` stays a marker (it follows the data)."""
        if isinstance(spec, Fill):
            if spec is Fill.LAST_SYSTEM:
                return dead_system
            if spec is Fill.DEAD_CELL:
                return torch.eye(3, dtype=like.dtype, device=like.device) * self.dead_length
            if spec is Fill.LAST_REAL:
                return spec
            row = torch.zeros(like.shape[-1], dtype=like.dtype, device=like.device)
            if self.self_loop:
                row[0] = self.dead_length if spec is Fill.DEAD_SHIFT else 1
            return row
        if isinstance(spec, Tensor):
            return spec.to(dtype=like.dtype, device=like.device)
        return spec

    def _plan_systems(
        self, plan: _Plan, data: Mapping[str, Tensor], dim: int, s: int, s_cap: int, n_cap: int,
        dead_system: int, counts: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """Plan the per-system fields (a block of rows per system), the
        per-system count fields (``{name: (dims index, cap)}``: the dead
        system counts the dead rows) and ``ptr``. ``dims[dim]`` is ``s``,
        ``dims[dim + 1]`` ``s + 1``."""
        counts = counts or {}
        fields = {name: spec for name, spec in self.system_fields.items() if name not in counts}
        fields.update({name: 0 for name in counts})
        for name, spec in fields.items():
            if name not in data or name in plan.aliases:
                continue
            real = data[name]
            unit = real.shape[0] // s if s else _rows_per_system(real, spec)
            if real.shape[0] != unit * s:
                raise ValueError(
                    f"ddpad: per-system field {name!r} has {real.shape[0]} rows, not a multiple of {s} systems"
                )
            fill = self._fill_value(spec, real, dead_system)
            rows = _Rows(self._buffer(name, (s_cap * unit, *real.shape[1:]), real), fill, unit=unit)
            plan.add(name, rows, real, dim)
            if fill is Fill.LAST_REAL:
                plan.last_real.append((rows, dim))
            if name in counts:  # own: a dead row, rewritten; join: the last real one, added to
                d, cap = counts[name]
                plan.count_rows.append((rows.blocks[dead_system], d, cap, self.placement == "join"))
        if self.ptr is not None and self.ptr in data and self.ptr not in plan.aliases:
            ptr = data[self.ptr]
            # real offsets, then n up to the dead system (empty systems), then n_cap
            rows = _Rows(self._buffer(self.ptr, (s_cap + 1,), ptr), n_cap)
            plan.add(self.ptr, rows, ptr, dim + 1)
            if self.placement == "own":
                plan.ptr_mid = rows.buf[s + 1: s_cap] if s + 1 < s_cap else None
            else:  # the copy writes ptr[s] = n each call: the dead system ends at n_cap
                plan.ptr_last, plan.ptr_value = rows.buf[s: s + 1], n_cap


def _rows_per_system(real: Tensor, spec: FillSpec) -> int:
    """Rows per system of a per-system field when there are no real systems."""
    return 3 if spec is Fill.DEAD_CELL and real.dim() == 2 else 1


def _require(data: Mapping[str, Tensor], name: str) -> Tensor:
    try:
        return data[name]
    except KeyError:
        raise KeyError(
            f"ddpad: input has no field {name!r} (fields: {sorted(data)}); "
            "configure the padder's field names to match the model input"
        ) from None


_ATOMS = CapPolicy(initial_factor=1.15, grow_factor=1.30, stride=16, strict_gt=False)
_EDGES = CapPolicy(initial_factor=1.35, grow_factor=1.30, stride=16)
_SYSTEMS = CapPolicy(initial_factor=1.0, grow_factor=1.5, stride=4)


class COOPadder(_PadderBase):
    """Pads an edge-list (COO) graph: atoms, edges and systems (MACE-style).

    Dead atoms sit far outside the real atoms' bounding box. Dead edges, and
    real edges with an endpoint ``>= n_real`` (sentinels), become either a
    self-loop on the dead atom ``n_cap - 1`` whose shift fields carry a
    vector of length ``dead_length`` (an edge field uses
    :attr:`Fill.DEAD_SHIFT` and the dead atoms have their own system, whose
    cell :attr:`Fill.DEAD_CELL` reproduces that shift from a unit lattice
    shift), or otherwise an edge of the dead anchor pair
    ``n_cap - 2 -> n_cap - 1`` placed ``dead_length`` apart with zero shifts.

    Parameters
    ----------
    cutoff
        The model's cutoff; dead edges are longer (``dead_length``, default
        ``2 * cutoff + 1``).
    positions, edge_index
        Field names of the positions ``[N, 3]`` and the edge index.
    edge_layout
        ``"2E"`` for ``[2, E]`` (sender, receiver rows) or ``"E2"``.
    atom_fields, edge_fields, system_fields
        Other fields to pad, with the fill of their dead rows.
    system_index
        Per-atom system label field (filled with the dead atoms' system).
    ptr
        System boundaries field ``[S + 1]``, or None.
    system_count
        A per-system field whose length is the system count, used when there
        is no ``ptr``.
    atom_counts, edge_counts
        Per-system atom / edge count fields (fairchem's ``natoms``,
        ``nedges``): the system holding the dead atoms / dead edges counts them.
    placement
        ``"own"`` (dead system) or ``"join"`` (last real system).
    atom_outputs, system_outputs, edge_outputs
        Output keys sliced by :meth:`unpad` to the real atoms, systems, edges.
    atoms_policy, edges_policy, systems_policy
        Cap policies; ``systems_policy=None`` pads to exactly the real systems
        (plus the dead one).
    atoms_key, edges_key, systems_key
        Names of the caps in ``cap_state``.
    """

    def __init__(
        self,
        cutoff: float,
        *,
        positions: str = "positions",
        edge_index: str = "edge_index",
        edge_layout: Literal["2E", "E2"] = "2E",
        atom_fields: Mapping[str, FillSpec] | None = None,
        edge_fields: Mapping[str, FillSpec] | None = None,
        system_fields: Mapping[str, FillSpec] | None = None,
        system_index: str | None = "batch",
        ptr: str | None = "ptr",
        system_count: str | None = None,
        atom_counts: str | None = None,
        edge_counts: str | None = None,
        placement: Placement = "own",
        atom_outputs: Sequence[str] = (),
        system_outputs: Sequence[str] = (),
        edge_outputs: Sequence[str] = (),
        atoms_policy: CapPolicy | None = None,
        edges_policy: CapPolicy = _EDGES,
        systems_policy: CapPolicy | None = _SYSTEMS,
        atoms_key: str = "atoms",
        edges_key: str = "edges",
        systems_key: str = "systems",
        dead_length: float | None = None,
    ) -> None:
        if edge_layout not in ("2E", "E2"):
            raise ValueError(f"edge_layout must be '2E' or 'E2', got {edge_layout!r}")
        if not cutoff > 0:
            raise ValueError(f"cutoff must be > 0, got {cutoff!r}")
        edge_fields = dict(edge_fields or {})
        if Fill.LAST_REAL in edge_fields.values():
            raise ValueError("Fill.LAST_REAL is for per-system (or per-atom) fields, not edge fields")
        # A self-loop needs its lattice image through the dead system's own
        # cell; joined to a real cell (maybe zero) it could be short, so
        # "join" uses the anchor pair with zero shifts.
        self.self_loop = Fill.DEAD_SHIFT in edge_fields.values() and placement == "own"
        if atoms_policy is None:  # the anchor pair needs two dead rows
            atoms_policy = _ATOMS if self.self_loop else CapPolicy(1.15, 1.30, 16, extra=1, strict_gt=False)
        atom_fields = dict(atom_fields or {})
        if system_index is not None:
            atom_fields.setdefault(system_index, Fill.LAST_SYSTEM)
        super().__init__(
            atom_fields=atom_fields, system_fields=system_fields or {}, ptr=ptr,
            system_count=system_count, placement=placement, atom_outputs=atom_outputs,
            system_outputs=system_outputs, atoms_policy=atoms_policy,
            systems_policy=systems_policy, atoms_key=atoms_key, systems_key=systems_key,
            dead_length=2.0 * cutoff + 1.0 if dead_length is None else dead_length,
        )
        if self.dead_length <= cutoff:
            raise ValueError(f"dead_length {self.dead_length} must exceed the cutoff {cutoff}")
        self.cutoff = float(cutoff)
        self.positions = positions
        self.edge_index = edge_index
        self.edge_layout = edge_layout
        self.edge_fields = edge_fields
        self.system_index = system_index
        self.edges_policy = edges_policy
        self.edges_key = edges_key
        self.edge_outputs = tuple(edge_outputs)
        self.n_edges: int | None = None
        self.atom_counts = atom_counts
        self.edge_counts = edge_counts

    def _row_counts(self, n_atoms: int) -> dict[str, int]:
        rows = super()._row_counts(n_atoms)
        if self.n_edges is not None:
            rows.update({key: self.n_edges for key in self.edge_outputs})
        return rows

    def _config(self) -> tuple[dict[str, Any], ...]:
        return (self.atom_fields, self.system_fields, self.edge_fields)

    def _dead_rows_needed(self) -> int:
        return 1 if self.self_loop else 2

    def _count(self, data: Mapping[str, Tensor]) -> dict[str, int]:
        ei = _require(data, self.edge_index)
        return {
            self.atoms_key: int(_require(data, self.positions).shape[0]),
            self.edges_key: int(ei.shape[1 if self.edge_layout == "2E" else 0]),
            self.systems_key: self._n_systems(data, self.system_index),
        }

    def _extra_requests(self, counts: dict[str, int]) -> dict[str, tuple[int, CapPolicy]]:
        return {self.edges_key: (counts[self.edges_key], self.edges_policy)}

    def _pad_to(self, data: Mapping[str, Tensor], counts: dict[str, int], caps: Mapping[str, int]) -> dict[str, Any]:
        n, e, s = counts[self.atoms_key], counts[self.edges_key], counts[self.systems_key]
        self.n_edges = e
        key = (caps[self.atoms_key], caps[self.edges_key], caps[self.systems_key], s,
               data[self.positions].device, tuple(data))
        dims = (n, e, s, s + 1)
        plan, srcs = self._fitting_plan(data, key, dims, lambda: self._plan_coo(data, key, n, s, caps))
        out = self._write(plan, data, srcs, dims)
        self._plan = plan
        return out

    def _plan_coo(self, data: Mapping[str, Tensor], key: tuple[Any, ...], n: int, s: int, caps: Mapping[str, int]) -> _Plan:
        n_cap, e_cap, s_cap = caps[self.atoms_key], caps[self.edges_key], caps[self.systems_key]
        dead_system = self._dead_system(s, s_cap)
        plan = self._new_plan(key)

        # positions: dead atoms beyond the largest real coordinate in every
        # coordinate (out of every cutoff), so rewritten each call; the anchor
        # pair dead_length apart. One scalar bound, not a per-coordinate box: a
        # reduction over dim 0 of an [N, 3] tensor costs 15x a full one on CPU
        pos = data[self.positions]
        plan.pos = _Rows(self._buffer(self.positions, (n_cap, *pos.shape[1:]), pos), None)
        plan.add(self.positions, plan.pos, pos, 0, tracked=False)
        plan.offsets = torch.full((n_cap, *pos.shape[1:]), self.dead_length, dtype=pos.dtype, device=pos.device)
        if not self.self_loop:
            plan.offsets[n_cap - 1, 0] += self.dead_length
        plan.far = torch.empty((), dtype=pos.dtype, device=pos.device)
        plan.pos_views = (-1, pos, pos)

        # edges: dead ones and sentinels (an endpoint >= n) join the dead atom(s)
        ei = data[self.edge_index]
        sender, receiver = (n_cap - 1, n_cap - 1) if self.self_loop else (n_cap - 2, n_cap - 1)
        transposed = self.edge_layout == "2E"
        pair = torch.tensor([sender, receiver], dtype=ei.dtype, device=ei.device)
        shape = (2, e_cap) if transposed else (e_cap, 2)
        plan.add(self.edge_index, _Rows(self._buffer(self.edge_index, shape, ei), pair, transposed=transposed), ei, 1)
        plan.pair = pair[:, None] if transposed else pair
        plan.edge_fill = {}
        for name, spec in self.edge_fields.items():
            if name in data and name not in plan.aliases:
                real = data[name]
                fill = self._fill_value(spec, real, dead_system)
                plan.edge_fill[len(plan.names)] = torch.as_tensor(fill, dtype=real.dtype, device=real.device)
                plan.add(name, _Rows(self._buffer(name, (e_cap, *real.shape[1:]), real), fill), real, 1)
        plan.edge_span = range(1, len(plan.names))

        for name, spec in self.atom_fields.items():
            if name in data and name not in plan.aliases:
                real = data[name]
                fill = self._fill_value(spec, real, dead_system)
                rows = _Rows(self._buffer(name, (n_cap, *real.shape[1:]), real), fill)
                plan.add(name, rows, real, 0)
                if fill is Fill.LAST_REAL:
                    plan.last_real.append((rows, 0))
        # dead rows are counted by the system that holds them (dead edges join
        # dead atoms, so both belong to the dead atoms' system)
        counted = {name: (d, cap) for name, d, cap in ((self.atom_counts, 0, n_cap), (self.edge_counts, 1, e_cap))
                   if name is not None}
        self._plan_systems(plan, data, 2, s, s_cap, n_cap, dead_system, counted)
        return plan

    def _write(self, plan: _Plan, data: Mapping[str, Tensor], srcs: list[Tensor], dims: tuple[int, ...]) -> dict[str, Any]:
        n, e = dims[0], dims[1]
        stale = plan.check()
        views = plan.views(dims)
        grad = {i for i in plan.floats if srcs[i].requires_grad} if any(map(_REQUIRES_GRAD, srcs)) else _NO_GRAD
        ei = srcs[1]
        # sentinels: read on the host only where that is free (no device to wait for)
        # (amax, not max: torch's CPU max of int64 is not vectorised, 3.6x slower)
        masked = e > 0 and (ei.device.type not in _HOST_DEVICES or int(ei.amax()) >= n)
        concat: dict[str, Tensor] = {}
        if not grad and not masked:
            torch._foreach_copy_(views, srcs)  # every real row of every field, one call
        else:
            skip = grad | (set(plan.edge_span) if masked else set())
            keep = [i for i in range(len(srcs)) if i not in skip]
            torch._foreach_copy_([views[i] for i in keep], [srcs[i] for i in keep])
            if masked:
                self._write_sentinels(plan, srcs, views, n, e, grad, concat)
            for i in grad:
                if i != 0 and not (masked and i in plan.edge_span):  # positions below
                    count = dims[plan.layout[i][1]]
                    concat[plan.names[i]] = torch.cat([srcs[i], plan.dst[i].tail(count, srcs[i])])
        self._write_positions(plan, srcs[0], n, 0 in grad, concat)
        plan.write_dead(dims, stale)
        plan.done(dims)
        plan.fresh_aliases()
        out = dict(data)
        out.update(plan.aliases)
        out.update(concat)
        return out

    def _write_positions(self, plan: _Plan, pos: Tensor, n: int, grad: bool, concat: dict[str, Tensor]) -> None:
        if grad:  # concatenated: forces taken by the caller reach its positions
            far = pos.detach().amax() if n else 0.0
            concat[self.positions] = torch.cat([pos, plan.offsets[n:] + far])
            return
        if plan.pos_views[0] != n:
            plan.pos_views = (n, plan.offsets[n:], plan.pos.flat[n:])
        _, offsets, dead = plan.pos_views
        if n:
            torch.amax(pos, out=plan.far)
            torch.add(offsets, plan.far, out=dead)
        else:
            dead.copy_(offsets)

    def _write_sentinels(
        self, plan: _Plan, srcs: list[Tensor], views: list[Tensor], n: int, e: int, grad: set[int],
        concat: dict[str, Tensor],
    ) -> None:
        """Edges with an endpoint ``>= n`` join the dead atom(s) with dead edge fields."""
        ei = srcs[1]
        transposed = self.edge_layout == "2E"
        invalid = (ei >= n).any(0 if transposed else 1)
        torch.where(invalid if transposed else invalid[:, None], plan.pair, ei, out=views[1])
        for i in plan.edge_span[1:]:
            src, fill = srcs[i], plan.edge_fill[i]
            mask = invalid.view(e, *(1,) * (src.dim() - 1))
            if i in grad:
                concat[plan.names[i]] = torch.cat([torch.where(mask, fill, src), plan.dst[i].tail(e, src)])
            else:
                torch.where(mask, fill, src, out=views[i])


_ARITHMETIC_FROM = 4096


def _arithmetic_reroute(mat: Tensor) -> bool:
    """Whether :func:`_reroute` of ``mat`` takes the arithmetic form: integers
    of at most 32 bits (AIMNet2's ``int32`` matrices) on a host device."""
    return mat.device.type in _HOST_DEVICES and not mat.dtype.is_floating_point and mat.dtype.itemsize <= 4


def _reroute(real: Tensor, n: int, pad: Tensor, pad_index: int, out: Tensor, scratch: Tensor | None) -> Tensor | None:
    """``out = where(real >= n, pad, real)``: neighbour entries past the real
    atoms (sentinels) point at the pad index. Returns the sentinel mask when
    it built one (neighbour fields reuse it), else None.

    With ``scratch`` (see :func:`_arithmetic_reroute`), in four vectorised
    ops instead: ``c = min(real, n)``; ``t = max(c - (n - 1), 0)``, which is
    1 exactly at the sentinels; ``out = c + t * (pad - n)``. On the CPU the
    bool mask of ``ge`` and ``where`` are not vectorised: 17 us against 57
    over 80,000 int32 entries on one thread (a copy: 3). Below
    ``_ARITHMETIC_FROM`` entries the two extra calls cost more than they
    save (4 us a call at 20 atoms). For int64 the two forms cost the same,
    and on a GPU ``where`` is two kernels, not four.
    """
    if scratch is None or real.numel() < _ARITHMETIC_FROM:
        sentinel = real >= n
        torch.where(sentinel, pad, real, out=out)
        return sentinel
    torch.clamp(real, max=n, out=out)
    torch.sub(out, n - 1, out=scratch)
    scratch.clamp_(min=0)
    out.add_(scratch, alpha=pad_index - n)
    return None


_DENSE_ATOMS = CapPolicy(initial_factor=1.15, grow_factor=1.15, stride=16, strict_gt=False)
_BATCH_ATOMS = CapPolicy(initial_factor=1.15, grow_factor=1.30, stride=16)
_NEIGHBORS = CapPolicy(initial_factor=1.0, grow_factor=1.25, stride=8)


class DensePadder(_PadderBase):
    """Pads a dense ``(N, K)`` neighbour matrix riding on the atom dimension.

    The input's last row is the model's own sentinel / pad atom, so the real
    count is ``rows - 1`` and neighbour entries ``>= rows - 1`` are
    sentinels. Output rows are ``n_cap``; the dead row ``n_cap - 1`` is the
    new sentinel: sentinels and all dead rows point at it.

    Parameters
    ----------
    nbmat
        Neighbour-matrix fields ``[rows, K]`` (e.g. short- and long-range);
        the first is required, the others are padded when present, and a
        field that is the same tensor as an earlier one stays an alias.
    atom_fields, system_fields
        Per-atom (``rows`` long, sentinel row included) and per-system fields
        with the fill of dead rows; :attr:`Fill.LAST_SYSTEM` is the dead
        atoms' system index.
    neighbor_fields
        Fields riding on a neighbour matrix (``[rows, K, ...]``, e.g. lattice
        shifts), keyed by name, valued ``(nbmat_name, fill)``.
    neighbors_policy
        Grow-only cap of the width ``K`` (key ``"neighbors"`` plus the nbmat
        name for the second and later matrices); None keeps ``K`` as given.
    placement, system_count, ptr, atom_outputs, system_outputs
        As for :class:`COOPadder`.
    """

    sentinel_row = True

    def __init__(
        self,
        *,
        nbmat: Sequence[str] = ("nbmat",),
        atom_fields: Mapping[str, FillSpec] | None = None,
        system_fields: Mapping[str, FillSpec] | None = None,
        neighbor_fields: Mapping[str, tuple[str, FillSpec]] | None = None,
        system_count: str | None = None,
        ptr: str | None = None,
        placement: Placement = "own",
        atom_outputs: Sequence[str] = (),
        system_outputs: Sequence[str] = (),
        atoms_policy: CapPolicy | None = None,
        neighbors_policy: CapPolicy | None = _NEIGHBORS,
        systems_policy: CapPolicy | None = _SYSTEMS,
        atoms_key: str = "atoms",
        neighbors_key: str = "neighbors",
        systems_key: str = "systems",
        dead_length: float = 1.0e3,
    ) -> None:
        if not nbmat:
            raise ValueError("nbmat must name at least one neighbour-matrix field")
        super().__init__(
            atom_fields=atom_fields or {}, system_fields=system_fields or {}, ptr=ptr,
            system_count=system_count, placement=placement, atom_outputs=atom_outputs,
            system_outputs=system_outputs,
            atoms_policy=atoms_policy or (_DENSE_ATOMS if self.sentinel_row else _BATCH_ATOMS),
            systems_policy=systems_policy, atoms_key=atoms_key, systems_key=systems_key,
            dead_length=dead_length,
        )
        self.nbmat = tuple(nbmat)
        self.neighbor_fields = dict(neighbor_fields or {})
        self.neighbors_policy = neighbors_policy
        self.width_keys = {
            name: neighbors_key if i == 0 else f"{neighbors_key}_{name}"
            for i, name in enumerate(self.nbmat)
        }

    def _config(self) -> tuple[dict[str, Any], ...]:
        return (self.atom_fields, self.system_fields, self.neighbor_fields)

    def _dead_rows_needed(self) -> int:
        return 1 if self.sentinel_row else 0

    def _count(self, data: Mapping[str, Tensor]) -> dict[str, int]:
        first = _require(data, self.nbmat[0])
        counts = {
            self.atoms_key: int(first.shape[0]) - (1 if self.sentinel_row else 0),
            self.systems_key: self._n_systems(data, _system_label(self.atom_fields)),
        }
        for name in self._present_nbmat(data):
            mat = data[name]
            if mat.shape[0] != first.shape[0]:
                raise ValueError(
                    f"ddpad: neighbour matrices disagree on rows: {self.nbmat[0]!r} has "
                    f"{first.shape[0]}, {name!r} has {mat.shape[0]}"
                )
            counts[self.width_keys[name]] = int(mat.shape[1])
        return counts

    def _present_nbmat(self, data: Mapping[str, Tensor]) -> list[str]:
        """The first matrix (required) and the others that are present and are
        not the same tensor as an earlier one (aliases are padded once)."""
        names = [self.nbmat[0]]
        _require(data, names[0])
        for name in self.nbmat[1:]:
            if name in data and not any(data[name] is data[kept] for kept in names):
                names.append(name)
        return names

    def _extra_requests(self, counts: dict[str, int]) -> dict[str, tuple[int, CapPolicy]]:
        if self.neighbors_policy is None:
            return {}
        return {key: (counts[key], self.neighbors_policy) for key in self.width_keys.values() if key in counts}

    def _pad_to(self, data: Mapping[str, Tensor], counts: dict[str, int], caps: Mapping[str, int]) -> dict[str, Any]:
        n, s = counts[self.atoms_key], counts[self.systems_key]
        first = data[self.nbmat[0]]
        present = self._present_nbmat(data)
        alias_of = {name: next(k for k in present if data[k] is data[name])
                    for name in self.nbmat if name in data and name not in present}
        widths = tuple((data[name].dtype, caps.get(self.width_keys[name], data[name].shape[1])) for name in present)
        neighbors = tuple((data[name].dtype, data[name].shape[2:]) for name in self.neighbor_fields if name in data)
        key = (caps[self.atoms_key], caps[self.systems_key], s, first.device, tuple(data), widths,
               tuple(alias_of.items()), neighbors)
        dims = (n, int(first.shape[0]), s, s + 1)
        plan, srcs = self._fitting_plan(data, key, dims,
                                        lambda: self._plan_dense(data, key, n, s, caps, present, alias_of))
        out = self._write(plan, data, srcs, dims)
        self._plan = plan
        return out

    def _plan_dense(
        self, data: Mapping[str, Tensor], key: tuple[Any, ...], n: int, s: int, caps: Mapping[str, int],
        present: list[str], alias_of: dict[str, str],
    ) -> _Plan:
        n_cap, s_cap = caps[self.atoms_key], caps[self.systems_key]
        dead_system = self._dead_system(s, s_cap)
        pad_index = n_cap - 1 if self.sentinel_row else n_cap
        plan = self._new_plan(key)
        for name, spec in self.atom_fields.items():
            if name in data and name not in plan.aliases:
                real = data[name]  # rows long (a sentinel row included): its first n rows are real
                fill = self._fill_value(spec, real, dead_system)
                rows = _Rows(self._buffer(name, (n_cap, *real.shape[1:]), real), fill)
                plan.add(name, rows, real, 1, view_dim=0)
                if fill is Fill.LAST_REAL:
                    plan.last_real.append((rows, 0))
        plan.n_atom_fields = len(plan.names)
        self._plan_systems(plan, data, 2, s, s_cap, n_cap, dead_system)
        # neighbour matrices: sentinels and every dead slot point at the pad index
        plan.mats = []
        for name in present:
            mat = data[name]
            k_cap = caps.get(self.width_keys[name], mat.shape[1])
            grid = _Grid(self._buffer(name, (n_cap, k_cap), mat), pad_index)
            scratch = None  # for the arithmetic reroute (_reroute), where it is the faster one
            if _arithmetic_reroute(mat):
                scratch = _Grid(self._buffer(f"{name} scratch", (n_cap, k_cap), mat), None)
            pad = torch.tensor(pad_index, dtype=mat.dtype, device=mat.device)
            plan.mats.append((name, grid, pad, pad_index, scratch))
            plan.aliases[name] = grid.alias
            plan.tracked.append(grid)
        for name, kept in alias_of.items():  # aliases of a padded matrix stay aliases
            plan.aliases[name] = plan.aliases[kept]
        plan.neighbors = []
        for name, (mat_name, spec) in self.neighbor_fields.items():
            if name not in data:
                continue
            real = data[name]
            k_cap = plan.aliases[mat_name].shape[1]
            fill = self._fill_value(spec, real, dead_system)
            grid = _Grid(self._buffer(name, (n_cap, k_cap, *real.shape[2:]), real), fill)
            fill_t = torch.as_tensor(fill, dtype=real.dtype, device=real.device)
            plan.neighbors.append((name, alias_of.get(mat_name, mat_name), grid, fill_t))
            plan.aliases[name] = grid.alias
            plan.tracked.append(grid)
        return plan

    def _write(self, plan: _Plan, data: Mapping[str, Tensor], srcs: list[Tensor], dims: tuple[int, ...]) -> dict[str, Any]:
        n = dims[0]
        stale = plan.check()
        views = plan.views(dims)
        k = plan.n_atom_fields
        if self.sentinel_row:  # the input's own pad atom is not a real row
            srcs = [t[:n] for t in srcs[:k]] + srcs[k:]
        grad = [i for i in plan.floats if srcs[i].requires_grad] if any(map(_REQUIRES_GRAD, srcs)) else []
        concat: dict[str, Tensor] = {}
        if not grad:
            torch._foreach_copy_(views, srcs)
        else:
            keep = [i for i in range(len(srcs)) if i not in grad]
            torch._foreach_copy_([views[i] for i in keep], [srcs[i] for i in keep])
            for i in grad:
                count = dims[plan.layout[i][1]]
                concat[plan.names[i]] = torch.cat([srcs[i], plan.dst[i].tail(count, srcs[i])])
        plan.write_dead(dims, stale)
        masks: dict[str, Tensor | None] = {}
        for name, grid, pad, pad_index, scratch in plan.mats:
            mat = data[name]
            real = mat[:n] if self.sentinel_row else mat
            k = real.shape[1]
            masks[name] = _reroute(real, n, pad, pad_index, grid.real(n, k),
                                   None if scratch is None else scratch.real(n, k))
            grid.settle(n, k)
        for name, mat_name, grid, fill in plan.neighbors:
            real = data[name].detach()  # as before: not differentiated through
            real = real[:n] if self.sentinel_row else real
            sentinel = masks[mat_name]
            if sentinel is None:  # the arithmetic reroute builds none: once per matrix
                mat = data[mat_name]
                sentinel = masks[mat_name] = (mat[:n] if self.sentinel_row else mat) >= n
            mask = sentinel.view(*sentinel.shape, *(1,) * (real.dim() - 2))
            torch.where(mask, fill, real, out=grid.real(n, real.shape[1]))
            grid.settle(n, real.shape[1])
        plan.done(dims)
        plan.fresh_aliases()
        out = dict(data)
        out.update(plan.aliases)
        out.update(concat)
        return out


class DenseBatchPadder(DensePadder):
    """Pads a flat batch before the model appends its own pad atom (AIMNet2-style).

    No sentinel row in the input: the real count is ``rows``, neighbour
    entries ``>= n_real`` are sentinels, and they and all dead rows point at
    ``n_cap``, the index of the pad atom the model appends afterwards, so the
    model's own masks remove them. Dead atoms get the configured fills
    (``numbers = 0``). Parameters as for :class:`DensePadder`; default atoms
    policy: initial 1.15, grow 1.30, stride 16.
    """

    sentinel_row = False


def _system_label(atom_fields: Mapping[str, FillSpec]) -> str | None:
    """The per-atom field filled with :attr:`Fill.LAST_SYSTEM`, if any."""
    for name, spec in atom_fields.items():
        if spec is Fill.LAST_SYSTEM:
            return name
    return None
