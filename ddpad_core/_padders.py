"""Built-in padders for plain ``dict[str, Tensor]`` inputs (SPEC section 6).

Every padder pads atoms, systems and (COO) edges or (dense) neighbour
columns to grow-only caps resolved in one :func:`resolve_caps` call, so an
active agreement group costs one collective per step. Dead atoms live in
their own dead system (``placement="own"``, the default) or are joined to
the last real system (``"join"``, only for frameworks that sum owned
per-atom energies under a mask). Padded tensors are written into
persistent cap-sized buffers, reallocated only when a cap grows.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
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
        return self._pad_to(data, counts, caps)

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
        return self._unpad_mapping(output, n_atoms)

    def _row_counts(self, n_atoms: int) -> dict[str, int]:
        """Output key -> real rows."""
        rows = {key: n_atoms for key in self.atom_outputs}
        if self.n_systems is not None:
            rows.update({key: self.n_systems for key in self.system_outputs})
        return rows

    def _unpad_mapping(self, output: Mapping[str, Any], n_atoms: int) -> dict[str, Any]:
        """Slice known output keys, at any depth of nested dicts (fairchem
        nests them per head and property)."""
        rows = self._row_counts(n_atoms)
        unpadded = {}
        for key, value in output.items():
            if isinstance(value, Mapping):
                value = self._unpad_mapping(value, n_atoms)
            elif isinstance(value, Tensor) and key in rows:
                value = value[: rows[key]]
            unpadded[key] = value
        return unpadded

    def restore(self) -> None:
        """Reset the persistent buffers' ``requires_grad`` and ``.grad``.

        The model gets fresh aliases of the buffers each call, so flags it sets
        on its inputs (mace and UMA call ``requires_grad_``) never persist;
        this resets anything set on the buffers themselves. Frameworks call it
        after every padded forward (nvalchemi's protocol expects it)."""
        for buf in self._buffers.values():
            buf.grad = None
            if buf.requires_grad:
                buf.requires_grad_(False)

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
            return int(labels.max()) + 1 if labels.numel() else 0
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

    def _rows(self, name: str, real: Tensor, n_rows: int, dead: Tensor | float | int | bool) -> Tensor:
        """``real`` followed by dead rows up to ``n_rows``.

        Written into a persistent buffer; a real tensor that requires grad is
        concatenated instead so gradients reach the caller's tensor.
        """
        n = real.shape[0]
        if real.requires_grad:
            tail = torch.as_tensor(dead, dtype=real.dtype, device=real.device)
            return torch.cat([real, tail.expand(n_rows - n, *real.shape[1:])])
        buf = self._buffer(name, (n_rows, *real.shape[1:]), real)
        with torch.no_grad():
            buf[:n].copy_(real)
            if isinstance(dead, Tensor):
                buf[n:].copy_(dead)
            else:
                buf[n:].fill_(dead)
        return buf.detach()

    def _fill_value(self, spec: FillSpec, like: Tensor, dead_system: int) -> Tensor | float | int | bool:
        """Resolve a fill marker to a value broadcastable to one row of ``like``."""
        if isinstance(spec, Fill):
            if spec is Fill.LAST_SYSTEM:
                return dead_system
            if spec is Fill.DEAD_CELL:
                return torch.eye(3, dtype=like.dtype, device=like.device) * self.dead_length
            if spec is Fill.LAST_REAL:
                return like[-1].detach() if like.shape[0] else torch.zeros_like(like[:1])[0]
            row = torch.zeros(like.shape[-1], dtype=like.dtype, device=like.device)
            if self.self_loop:
                row[0] = self.dead_length if spec is Fill.DEAD_SHIFT else 1
            return row
        if isinstance(spec, Tensor):
            return spec.to(dtype=like.dtype, device=like.device)
        return spec

    def _pad_systems(
        self, data: Mapping[str, Tensor], out: dict[str, Any], n_atoms: int, n_cap: int,
        n_systems: int, s_cap: int, dead_system: int,
    ) -> None:
        """Pad per-system fields (a block of rows per system) and ``ptr``."""
        for name, spec in self.system_fields.items():
            if name not in data:
                continue
            real = data[name]
            rows = real.shape[0] // n_systems if n_systems else _rows_per_system(real, spec)
            fill = self._fill_value(spec, real, dead_system)
            if rows == 1:
                out[name] = self._rows(name, real, s_cap, fill)
            else:  # a block of rows per system, e.g. mace's cell [S * 3, 3]
                blocks = real.reshape(n_systems, rows, *real.shape[1:])
                padded = self._rows(name, blocks, s_cap, fill)
                out[name] = padded.reshape(s_cap * rows, *real.shape[1:])
        if self.ptr is not None and self.ptr in data:
            ptr = self._rows(self.ptr, data[self.ptr], s_cap + 1, n_atoms)
            with torch.no_grad():
                ptr[dead_system + 1:] = n_cap
            out[self.ptr] = ptr


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

    def _dead_rows_needed(self) -> int:
        return 1 if self.self_loop else 2

    def _edges(self, data: Mapping[str, Tensor]) -> Tensor:
        """The edge index as ``[2, E]`` (a view for the ``E2`` layout)."""
        ei = _require(data, self.edge_index)
        return ei if self.edge_layout == "2E" else ei.t()

    def _count(self, data: Mapping[str, Tensor]) -> dict[str, int]:
        return {
            self.atoms_key: int(_require(data, self.positions).shape[0]),
            self.edges_key: int(self._edges(data).shape[1]),
            self.systems_key: self._n_systems(data, self.system_index),
        }

    def _extra_requests(self, counts: dict[str, int]) -> dict[str, tuple[int, CapPolicy]]:
        return {self.edges_key: (counts[self.edges_key], self.edges_policy)}

    def _pad_to(self, data: Mapping[str, Tensor], counts: dict[str, int], caps: Mapping[str, int]) -> dict[str, Any]:
        n, e, s = counts[self.atoms_key], counts[self.edges_key], counts[self.systems_key]
        n_cap, e_cap, s_cap = caps[self.atoms_key], caps[self.edges_key], caps[self.systems_key]
        self.n_edges = e
        dead_system = self._dead_system(s, s_cap)
        out: dict[str, Any] = dict(data)

        # dead atoms beyond the real atoms' bounding box: out of every cutoff
        pos = data[self.positions]
        far = pos.detach().amax(0) if n else torch.zeros(3, dtype=pos.dtype, device=pos.device)
        # outside no_grad: positions that require grad (forces taken by the
        # caller) stay connected through the padded tensor
        out[self.positions] = self._rows(self.positions, pos, n_cap, far + self.dead_length)
        if not self.self_loop:  # the anchor pair, dead_length apart
            out[self.positions][n_cap - 1, 0] += self.dead_length
        for name, spec in self.atom_fields.items():
            if name in data:
                out[name] = self._rows(name, data[name], n_cap, self._fill_value(spec, data[name], dead_system))

        # edges: dead ones and sentinels (an endpoint >= n) join the dead atom(s)
        sender, receiver = (n_cap - 1, n_cap - 1) if self.self_loop else (n_cap - 2, n_cap - 1)
        ei = self._edges(data)
        native = data[self.edge_index]
        shape = (2, e_cap) if self.edge_layout == "2E" else (e_cap, 2)
        buf = self._buffer(self.edge_index, shape, native)
        view = buf if self.edge_layout == "2E" else buf.t()
        invalid = (ei >= n).any(0)
        with torch.no_grad():
            view[:, :e].copy_(ei)
            view[0, :e].masked_fill_(invalid, sender)
            view[1, :e].masked_fill_(invalid, receiver)
            view[0, e:] = sender
            view[1, e:] = receiver
        out[self.edge_index] = buf
        for name, spec in self.edge_fields.items():
            if name not in data:
                continue
            fill = self._fill_value(spec, data[name], dead_system)
            padded = self._rows(name, data[name], e_cap, fill)
            with torch.no_grad():
                padded[:e][invalid] = torch.as_tensor(fill, dtype=padded.dtype, device=padded.device)
            out[name] = padded
        self._pad_systems(data, out, n, n_cap, s, s_cap, dead_system)
        # dead rows are counted by the system that holds them (dead edges
        # join dead atoms, so both belong to the dead atoms' system)
        for name, dead in ((self.atom_counts, n_cap - n), (self.edge_counts, e_cap - e)):
            if name is not None and name in data:
                counts = self._rows(name, data[name], s_cap, 0)
                with torch.no_grad():
                    counts[dead_system] += dead
                out[name] = counts
        return out


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
        n_cap, s_cap = caps[self.atoms_key], caps[self.systems_key]
        dead_system = self._dead_system(s, s_cap)
        pad_index = n_cap - 1 if self.sentinel_row else n_cap
        out: dict[str, Any] = dict(data)
        for name, spec in self.atom_fields.items():
            if name in data:
                real = data[name][:n]
                out[name] = self._rows(name, real, n_cap, self._fill_value(spec, real, dead_system))
        masks: dict[str, Tensor] = {}
        present = self._present_nbmat(data)
        for name in present:
            mat = data[name]
            k_cap = caps.get(self.width_keys[name], mat.shape[1])
            buf = self._buffer(name, (n_cap, k_cap), mat)
            sentinel = mat[:n] >= n
            masks[name] = sentinel
            with torch.no_grad():
                buf.fill_(pad_index)
                buf[:n, : mat.shape[1]].copy_(mat[:n]).masked_fill_(sentinel, pad_index)
            out[name] = buf
        for name in self.nbmat:  # aliases of a padded matrix stay aliases
            if name in data and name not in present:
                kept = next(k for k in present if data[k] is data[name])
                out[name], masks[name] = out[kept], masks[kept]
        for name, (mat_name, spec) in self.neighbor_fields.items():
            if name not in data:
                continue
            real = data[name]
            k_cap = out[mat_name].shape[1]
            fill = self._fill_value(spec, real, dead_system)
            buf = self._buffer(name, (n_cap, k_cap, *real.shape[2:]), real)
            with torch.no_grad():
                if isinstance(fill, Tensor):
                    buf.copy_(fill.expand_as(buf))
                else:
                    buf.fill_(fill)
                buf[:n, : real.shape[1]].copy_(real[:n])
                buf[:n, : real.shape[1]][masks[mat_name]] = torch.as_tensor(fill, dtype=buf.dtype, device=buf.device)
            out[name] = buf
        self._pad_systems(data, out, n, n_cap, s, s_cap, dead_system)
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
