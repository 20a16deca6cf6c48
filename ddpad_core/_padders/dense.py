"""The dense neighbour-matrix padders (AIMNet2-style): a ``(N, K)`` matrix
riding on the atom dimension, sentinels rerouted to the pad atom.

A steady-state call copies every real row in one ``torch._foreach_copy_``
and reroutes sentinel neighbours; no device value is read on the host.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .._capacity import CapPolicy
from ._base import PadderBase, _require
from ._buffers import _REQUIRES_GRAD, _Grid, _Plan
from ._checks import _HOST_DEVICES, check_labels, check_not_negative, shape_error
from ._dead import Fill, FillSpec, Placement, dense_dead_rows
from ._policies import BATCH_ATOMS_POLICY, DENSE_ATOMS_POLICY, NEIGHBORS_POLICY, SYSTEMS_POLICY

__all__ = ["DenseBatchPadder", "DensePadder"]


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


class DensePadder(PadderBase):
    """Pads a dense ``(N, K)`` neighbour matrix riding on the atom dimension.

    The input's last row is the model's own sentinel / pad atom, so the real
    count is ``rows - 1`` and neighbour entries ``>= rows - 1`` are
    sentinels. Output rows are ``n_cap``; the dead row ``n_cap - 1`` is the
    new sentinel: sentinels and all dead rows point at it.

    Malformed input is a ValueError naming the field: a neighbour matrix
    not ``[rows, K]``, a neighbour field not ``[rows, K, ...]`` like its
    matrix, and on the CPU (where reading a value costs no synchronisation)
    negative neighbour entries and system labels outside ``[0, n_systems)``.

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
        neighbors_policy: CapPolicy | None = NEIGHBORS_POLICY,
        systems_policy: CapPolicy | None = SYSTEMS_POLICY,
        atoms_key: str = "atoms",
        neighbors_key: str = "neighbors",
        systems_key: str = "systems",
        dead_length: float = 1.0e3,
    ) -> None:
        if not nbmat:
            raise ValueError("nbmat must name at least one neighbour-matrix field")
        atoms_policy = atoms_policy or (DENSE_ATOMS_POLICY if self.sentinel_row else BATCH_ATOMS_POLICY)
        if placement == "own":  # the dead system needs an atom row of its own besides the pad row: a model
            # that sizes its per-system sums from the labels (AIMNet2, eager) miscounts an empty one
            atoms_policy = dataclasses.replace(atoms_policy, extra=atoms_policy.extra + 1)
        super().__init__(
            atom_fields=atom_fields or {}, system_fields=system_fields or {}, ptr=ptr,
            system_count=system_count, placement=placement, atom_outputs=atom_outputs,
            system_outputs=system_outputs,
            atoms_policy=atoms_policy,
            systems_policy=systems_policy, atoms_key=atoms_key, systems_key=systems_key,
            dead=dense_dead_rows(self.sentinel_row, dead_length),
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

    def count(self, data: Mapping[str, Tensor]) -> dict[str, int]:
        first = _require(data, self.nbmat[0])
        counts = {
            self.atoms_key: int(first.shape[0]) - (1 if self.sentinel_row else 0),
            self.systems_key: self._n_systems(data, _system_label(self.atom_fields)),
        }
        for name in self._present_nbmat(data):
            mat = data[name]
            if mat.dim() != 2:
                raise shape_error(name, mat, "(rows, K)", " (a row of neighbour indices per atom)")
            if mat.shape[0] != first.shape[0]:
                raise ValueError(
                    f"ddpad: neighbour matrices disagree on rows: {self.nbmat[0]!r} has "
                    f"{first.shape[0]}, {name!r} has {mat.shape[0]}"
                )
            counts[self.width_keys[name]] = int(mat.shape[1])
        for name, (mat_name, _) in self.neighbor_fields.items():
            if name in data and mat_name in data and data[name].shape[:2] != data[mat_name].shape:
                rows, k = data[mat_name].shape
                raise shape_error(name, data[name], f"({rows}, {k}, ...)", f" (the rows and width of {mat_name!r})")
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

    def extra_requests(self, counts: dict[str, int]) -> dict[str, tuple[int, CapPolicy]]:
        if self.neighbors_policy is None:
            return {}
        return {key: (counts[key], self.neighbors_policy) for key in self.width_keys.values() if key in counts}

    def write_padded(
        self, data: Mapping[str, Tensor], counts: dict[str, int], caps: Mapping[str, int],
    ) -> dict[str, Any]:
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
        dead_system = self.dead_system(s, s_cap)
        pad_index = n_cap - 1 if self.sentinel_row else n_cap
        plan = self._new_plan(key)
        # rows long (a sentinel row included): their first n rows are real
        self._plan_atoms(plan, data, n_cap, dead_system, 1, view_dim=0)
        plan.n_atom_fields = len(plan.names)
        self._plan_systems(plan, data, 2, s, s_cap, n_cap, dead_system)
        # neighbour matrices: sentinels and every dead slot point at the pad index
        plan.mats = []
        for name in present:
            mat = data[name]
            k_cap = caps.get(self.width_keys[name], mat.shape[1])
            grid = _Grid(self.buffer(name, (n_cap, k_cap), mat), pad_index)
            scratch = None  # for the arithmetic reroute (_reroute), where it is the faster one
            if _arithmetic_reroute(mat):
                scratch = _Grid(self.buffer(f"{name} scratch", (n_cap, k_cap), mat), None)
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
            grid = _Grid(self.buffer(name, (n_cap, k_cap, *real.shape[2:]), real), fill)
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
        reals = {name: data[name][:n] if self.sentinel_row else data[name] for name, *_ in plan.mats}
        for name, real in reals.items():  # checked before anything is written (on the CPU)
            check_not_negative(name, real, n)
        if plan.labels is not None:
            i, source = plan.labels
            check_labels(plan.names[i], srcs[i], dims[2], source)
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
            real = reals[name]
            k = real.shape[1]
            masks[name] = _reroute(real, n, pad, pad_index, grid.real(n, k),
                                   None if scratch is None else scratch.real(n, k))
            grid.settle(n, k)
        for name, mat_name, grid, fill in plan.neighbors:
            real = data[name].detach()  # as before: not differentiated through
            real = real[:n] if self.sentinel_row else real
            sentinel = masks[mat_name]
            if sentinel is None:  # the arithmetic reroute builds none: once per matrix
                sentinel = masks[mat_name] = reals[mat_name] >= n
            mask = sentinel.view(*sentinel.shape, *(1,) * (real.dim() - 2))
            torch.where(mask, fill, real, out=grid.real(n, real.shape[1]))
            grid.settle(n, real.shape[1])
        return plan.finish(dims, data, concat)


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
