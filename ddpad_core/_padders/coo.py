"""The edge-list (COO) padder: atoms, edges and systems (MACE-style).

A steady-state call checks the input against the plan, copies every real
row in one ``torch._foreach_copy_``, writes the dead positions (they follow
the largest real coordinate) and reroutes sentinel edges. No device value is
read on the host, except on the CPU, where whether any edge is a sentinel is
read to skip the masked copies (no device to synchronise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from .._capacity import CapPolicy
from ._base import PadderBase, _require
from ._buffers import _NO_GRAD, _REQUIRES_GRAD, _Plan, _Rows
from ._checks import check_labels, edges_masked, shape_error
from ._dead import Fill, FillSpec, Placement, coo_dead_rows
from ._policies import ATOMS_POLICY, EDGES_POLICY, SYSTEMS_POLICY

__all__ = ["COOPadder"]


class COOPadder(PadderBase):
    """Pads an edge-list (COO) graph: atoms, edges and systems (MACE-style).

    Dead atoms sit far outside the real atoms' bounding box. Dead edges, and
    real edges with an endpoint ``>= n_real`` (sentinels), become either a
    self-loop on the dead atom ``n_cap - 1`` whose shift fields carry a
    vector of length ``dead_edge_length`` (an edge field uses
    :attr:`Fill.DEAD_SHIFT` and the dead atoms have their own system, whose
    cell :attr:`Fill.DEAD_CELL` reproduces that shift from a unit lattice
    shift), or otherwise an edge of the dead anchor pair
    ``n_cap - 2 -> n_cap - 1`` placed ``dead_edge_length`` apart with zero shifts
    (the rule: :func:`._dead.coo_dead_rows`).

    Malformed input is a ValueError naming the field: positions not ``[N,
    3]``, an edge index not ``[2, E]`` (``"E2"``: ``[E, 2]``), and on the
    CPU (where reading a value costs no synchronisation) negative edge
    indices and system labels outside ``[0, n_systems)``.

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
    edge_pair_outputs
        Output keys laid out ``[2, E]`` like a ``"2E"`` edge index (a model
        echoing its edge index): sliced to the real edges on their last axis.
    ptr_outputs
        Output keys laid out ``[S + 1]`` like ``ptr``: sliced to the real
        systems plus one.
    atoms_policy, edges_policy, systems_policy
        Cap policies; ``systems_policy=None`` pads to exactly the real systems
        (plus the dead one).
    atoms_key, edges_key, systems_key
        Names of the caps in ``cap_state``.
    dead_length
        How far beyond the real atoms the dead atoms sit, and the length of
        a dead edge unless ``dead_edge_length`` is given (default ``2 *
        cutoff + 1``).
    dead_edge_length
        The length of a dead edge, at least the cutoff (default
        ``dead_length``). Beyond the cutoff an envelope that is zero there
        (mace's, nequip's, fairchem's) makes a dead edge exactly inert. An
        envelope that is a polynomial vanishing only *at* the cutoff
        (sevenn's polynomial and XPLOR envelopes) grows without bound beyond
        it: hundreds of dead edges at ``2 * cutoff + 1`` drive the dead
        atom's features to inf and NaN. Such a model takes the cutoff itself,
        where every smooth envelope is zero.
    """

    #: The model builds edge vectors as ``pos[j] - pos[i] + unit_shift @
    #: cell`` (nequip): a :attr:`Fill.DEAD_UNIT_SHIFT` edge field through the
    #: dead system's :attr:`Fill.DEAD_CELL` then makes dead self-loops long
    #: without a cartesian :attr:`Fill.DEAD_SHIFT` field. Subclasses for such
    #: models set it; the default keeps the anchor pair there.
    vectors_from_cell = False

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
        edge_pair_outputs: Sequence[str] = (),
        ptr_outputs: Sequence[str] = (),
        atoms_policy: CapPolicy | None = None,
        edges_policy: CapPolicy = EDGES_POLICY,
        systems_policy: CapPolicy | None = SYSTEMS_POLICY,
        atoms_key: str = "atoms",
        edges_key: str = "edges",
        systems_key: str = "systems",
        dead_length: float | None = None,
        dead_edge_length: float | None = None,
    ) -> None:
        if edge_layout not in ("2E", "E2"):
            raise ValueError(f"edge_layout must be '2E' or 'E2', got {edge_layout!r}")
        if not cutoff > 0:
            raise ValueError(f"cutoff must be > 0, got {cutoff!r}")
        edge_fields = dict(edge_fields or {})
        if Fill.LAST_REAL in edge_fields.values():
            raise ValueError("Fill.LAST_REAL is for per-system (or per-atom) fields, not edge fields")
        dead = coo_dead_rows(placement, edge_fields, system_fields or {},
                             2.0 * cutoff + 1.0 if dead_length is None else dead_length,
                             vectors_from_cell=self.vectors_from_cell, edge_length=dead_edge_length)
        atom_fields = dict(atom_fields or {})
        if system_index is not None:
            atom_fields.setdefault(system_index, Fill.LAST_SYSTEM)
        super().__init__(
            atom_fields=atom_fields, system_fields=system_fields or {}, ptr=ptr,
            system_count=system_count, placement=placement, atom_outputs=atom_outputs,
            system_outputs=system_outputs, systems_policy=systems_policy,
            atoms_policy=dead.atoms_policy(ATOMS_POLICY) if atoms_policy is None else atoms_policy,
            atoms_key=atoms_key, systems_key=systems_key, dead=dead,
        )
        if self.dead_length <= cutoff:
            raise ValueError(f"dead_length {self.dead_length} must exceed the cutoff {cutoff}")
        if dead.edge_length < cutoff:
            raise ValueError(f"dead_edge_length {dead.edge_length} is inside the cutoff {cutoff}: a dead edge "
                             "would carry a message; give the cutoff or more")
        self.cutoff = float(cutoff)
        self.positions = positions
        self.edge_index = edge_index
        self.edge_layout = edge_layout
        self.edge_fields = edge_fields
        self.system_index = system_index
        self.edges_policy = edges_policy
        self.edges_key = edges_key
        self.edge_outputs = tuple(edge_outputs)
        self.edge_pair_outputs = tuple(edge_pair_outputs)
        self.ptr_outputs = tuple(ptr_outputs)
        self.n_edges: int | None = None
        self.atom_counts = atom_counts
        self.edge_counts = edge_counts

    def row_counts(self, n_atoms: int) -> dict[str, int]:
        """As :meth:`PadderBase.row_counts`, plus ``edge_outputs`` (the real
        edges) and ``ptr_outputs`` (the real systems plus one)."""
        rows = super().row_counts(n_atoms)
        if self.n_edges is not None:
            rows.update({key: self.n_edges for key in self.edge_outputs})
        if self.n_systems is not None:
            rows.update({key: self.n_systems + 1 for key in self.ptr_outputs})
        return rows

    def unpad_mapping(self, output: Mapping[str, Any], rows: Mapping[str, int]) -> dict[str, Any]:
        """As :meth:`PadderBase.unpad_mapping`; ``edge_pair_outputs`` (``[2,
        E]`` tensors) are sliced on their last axis."""
        out = super().unpad_mapping(output, rows)
        if self.edge_pair_outputs and self.n_edges is not None:
            for key in self.edge_pair_outputs:
                value = out.get(key)
                if isinstance(value, Tensor) and value.dim() == 2 and value.shape[0] == 2:
                    out[key] = value[:, : self.n_edges]
        return out

    def _config(self) -> tuple[dict[str, Any], ...]:
        return (self.atom_fields, self.system_fields, self.edge_fields)

    def count(self, data: Mapping[str, Tensor]) -> dict[str, int]:
        pos, ei = _require(data, self.positions), _require(data, self.edge_index)
        if pos.dim() != 2 or pos.shape[1] != 3:
            raise shape_error(self.positions, pos, "(N, 3)")
        transposed = self.edge_layout == "2E"
        if ei.dim() != 2 or ei.shape[0 if transposed else 1] != 2:
            raise shape_error(self.edge_index, ei, "(2, E)" if transposed else "(E, 2)",
                              f" (edge_layout={self.edge_layout!r})")
        return {
            self.atoms_key: int(pos.shape[0]),
            self.edges_key: int(ei.shape[1 if transposed else 0]),
            self.systems_key: self._n_systems(data, self.system_index),
        }

    def extra_requests(self, counts: dict[str, int]) -> dict[str, tuple[int, CapPolicy]]:
        return {self.edges_key: (counts[self.edges_key], self.edges_policy)}

    def write_padded(
        self, data: Mapping[str, Tensor], counts: dict[str, int], caps: Mapping[str, int],
    ) -> dict[str, Any]:
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
        dead_system = self.dead_system(s, s_cap)
        plan = self._new_plan(key)

        # positions: dead atoms beyond the largest real coordinate in every
        # coordinate (out of every cutoff), so rewritten each call; the anchor
        # pair dead_length apart. One scalar bound, not a per-coordinate box: a
        # reduction over dim 0 of an [N, 3] tensor costs 15x a full one on CPU
        pos = data[self.positions]
        plan.pos = _Rows(self.buffer(self.positions, (n_cap, *pos.shape[1:]), pos), None)
        plan.add(self.positions, plan.pos, pos, 0, tracked=False)
        plan.offsets = self.dead.offsets(n_cap, pos)
        plan.far = torch.empty((), dtype=pos.dtype, device=pos.device)
        plan.pos_views = (-1, pos, pos)

        # edges: dead ones and sentinels (an endpoint >= n) join the dead atom(s)
        ei = data[self.edge_index]
        transposed = self.edge_layout == "2E"
        pair = torch.tensor(self.dead.pair(n_cap), dtype=ei.dtype, device=ei.device)
        shape = (2, e_cap) if transposed else (e_cap, 2)
        plan.add(self.edge_index, _Rows(self.buffer(self.edge_index, shape, ei), pair, transposed=transposed), ei, 1)
        plan.pair = pair[:, None] if transposed else pair
        plan.edge_fill = {}
        for name, spec in self.edge_fields.items():
            if name in data and name not in plan.aliases:
                real = data[name]
                fill = self._fill_value(spec, real, dead_system)
                plan.edge_fill[len(plan.names)] = torch.as_tensor(fill, dtype=real.dtype, device=real.device)
                plan.add(name, _Rows(self.buffer(name, (e_cap, *real.shape[1:]), real), fill), real, 1)
        plan.edge_span = range(1, len(plan.names))

        self._plan_atoms(plan, data, n_cap, dead_system, 0)
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
        masked = e > 0 and edges_masked(self.edge_index, srcs[1], n)
        if plan.labels is not None:
            i, source = plan.labels
            check_labels(plan.names[i], srcs[i], dims[2], source)
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
        return plan.finish(dims, data, concat)

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

