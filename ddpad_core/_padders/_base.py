"""The padder base class: systems, placement, fills, persistent buffers,
``pad`` / ``unpad`` and the public extension hooks a layout implements."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .._capacity import CapPolicy, resolve_caps
from ._buffers import _Plan, _Rows, _Value
from ._checks import labels_error
from ._dead import DeadRows, Fill, FillSpec, Placement

__all__ = ["PadderBase"]

class PadderBase:
    """Systems, placement, fills, persistent buffers and ``unpad``: what every
    built-in padder shares (:class:`COOPadder`, :class:`DensePadder`).

    A layout subclasses it and implements :meth:`count` and
    :meth:`write_padded`; :meth:`extra_requests`, :meth:`check_fits`,
    :meth:`row_counts` and :meth:`unpad_mapping` have defaults to extend
    (call ``super()``). ``pad`` calls, in order: ``count``,
    ``extra_requests`` (caps are resolved), ``check_fits``,
    ``write_padded``; ``unpad`` calls ``row_counts`` (cached while the
    counts stay the same) and ``unpad_mapping``.

    Parameters
    ----------
    dead
        Where the dead edges go and the dead rows the graph needs
        (:mod:`._dead`).
    """

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
        dead: DeadRows,
    ) -> None:
        if placement not in ("own", "join"):
            raise ValueError(f"placement must be 'own' or 'join', got {placement!r}")
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
        self.dead = dead
        self.dead_length = dead.dead_length
        self.n_atoms: int | None = None
        self.n_systems: int | None = None
        self.caps: dict[str, int] = {}
        self._buffers: dict[str, Tensor] = {}
        self._plan: _Plan | None = None
        self._row_cache: tuple[tuple[int, ...], dict[str, int]] | None = None
        self.allocations = 0  # cap-sized buffers allocated so far (steady state: none)

    @property
    def self_loop(self) -> bool:
        """Whether dead edges are self-loops (else the anchor pair): :attr:`dead`."""
        return self.dead.self_loop

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
        counts = self.count(data)
        requests: dict[str, tuple[int, CapPolicy]] = {}
        if cap_atoms:
            requests[self.atoms_key] = (counts[self.atoms_key], self.atoms_policy)
        if self.systems_policy is not None:
            requests[self.systems_key] = (
                self._system_need(counts[self.systems_key]),
                self.systems_policy,
            )
        requests.update(self.extra_requests(counts))
        caps = resolve_caps(cap_state, requests)
        if not cap_atoms:
            caps[self.atoms_key] = counts[self.atoms_key] + self.dead.rows_needed
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
        return self._pad_counted(data, self.count(data), caps)

    def _pad_counted(self, data: Any, counts: dict[str, int], caps: Mapping[str, int]) -> Any:
        self.check_fits(counts, caps)
        self.n_atoms = counts[self.atoms_key]
        self.n_systems = counts[self.systems_key]
        self.caps = dict(caps)
        try:
            return self.write_padded(data, counts, caps)
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
        return self.unpad_mapping(output, self._rows_of(n_atoms))

    def _rows_of(self, n_atoms: int) -> dict[str, int]:
        """:meth:`row_counts`, cached while the counts stay the same."""
        key = (n_atoms, self.n_systems, getattr(self, "n_edges", None))
        if self._row_cache is None or self._row_cache[0] != key:
            self._row_cache = (key, self.row_counts(n_atoms))
        return self._row_cache[1]

    def restore(self) -> None:
        """Hand out fresh aliases for buffers the model flagged.

        The model gets aliases of the buffers (never the buffers), so flags it
        sets on its inputs (mace and UMA call ``requires_grad_``) never reach
        the buffers; an alias that requires grad is replaced before the next
        call. Frameworks call this after every padded
        forward (nvalchemi's protocol expects it); ``pad`` checks it too."""
        if self._plan is not None:
            self._plan.fresh_aliases()

    # -- public hooks ---------------------------------------------------------

    def count(self, data: Any) -> dict[str, int]:
        """The real counts of the input: first thing ``pad`` and ``pad_to`` call.

        Parameters
        ----------
        data
            The model's input, as given to ``pad``.

        Returns
        -------
        dict[str, int]
            Every cap key's real count: at least ``atoms_key`` and
            ``systems_key``, plus the keys :meth:`extra_requests` asks caps
            for. Read from shapes (no device value is read on a GPU).
        """
        raise NotImplementedError

    def extra_requests(self, counts: dict[str, int]) -> dict[str, tuple[int, CapPolicy]]:
        """Caps beyond atoms and systems: called by ``pad`` after :meth:`count`,
        before the caps are resolved (one collective for all of them), and by
        :meth:`check_fits`.

        Returns
        -------
        dict[str, tuple[int, CapPolicy]]
            ``{cap key: (real count, policy)}``; none by default.
        """
        return {}

    def check_fits(self, counts: Mapping[str, int], caps: Mapping[str, int]) -> None:
        """Check the counts fit the caps: called before every write.

        Raises
        ------
        RuntimeError
            When a count (with the dead rows it needs) overflows its cap,
            naming the key, the count and the cap, or a cap is missing.
        """
        need = {
            self.atoms_key: counts[self.atoms_key] + self.dead.rows_needed,
            self.systems_key: self._system_need(counts[self.systems_key]),
        }
        for key, (value, _) in self.extra_requests(counts).items():
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

    def write_padded(self, data: Any, counts: dict[str, int], caps: Mapping[str, int]) -> Any:
        """Write the padded input: called by ``pad`` / ``pad_to`` once the
        counts fit the caps. If it raises, the next call rewrites every
        buffer whole.

        Parameters
        ----------
        data
            The model's input.
        counts
            :meth:`count`'s result.
        caps
            The resolved caps (every key of ``counts``).

        Returns
        -------
        Any
            What the model is called with, at the caps' shapes.
        """
        raise NotImplementedError

    def row_counts(self, n_atoms: int) -> dict[str, int]:
        """Output key -> real rows, for :meth:`unpad_mapping`: called by
        ``unpad`` when the counts changed since the last call.

        Returns
        -------
        dict[str, int]
            ``atom_outputs`` -> ``n_atoms``, ``system_outputs`` -> the real
            systems (once a ``pad`` has counted them).
        """
        rows = {key: n_atoms for key in self.atom_outputs}
        if self.n_systems is not None:
            rows.update({key: self.n_systems for key in self.system_outputs})
        return rows

    def unpad_mapping(self, output: Mapping[str, Any], rows: Mapping[str, int]) -> dict[str, Any]:
        """Slice a mapping output: called by ``unpad`` for every dict output.

        Parameters
        ----------
        output
            The model's output.
        rows
            :meth:`row_counts`' result.

        Returns
        -------
        dict
            ``output`` with each tensor whose key is in ``rows`` sliced to
            that many leading rows, at any depth of nested dicts (fairchem
            nests them per head and property).
        """
        unpadded = {}
        for key, value in output.items():
            if isinstance(value, Tensor):  # first: a Mapping check is an ABC lookup
                if key in rows:
                    value = value[: rows[key]]
            elif isinstance(value, Mapping):
                value = self.unpad_mapping(value, rows)
            unpadded[key] = value
        return unpadded

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

    def _n_systems(self, data: Mapping[str, Tensor], system_index: str | None) -> int:
        """Real systems: from ``ptr``, a per-system field, or the largest label."""
        if self.ptr is not None and self.ptr in data:
            return int(data[self.ptr].shape[0]) - 1
        if self.system_count is not None:
            return int(_require(data, self.system_count).shape[0])
        if system_index is not None and system_index in data:
            labels = data[system_index]
            if not labels.numel():
                return 0
            lo, hi = torch.stack(torch.aminmax(labels)).tolist()  # a count: read once
            if lo < 0:
                raise labels_error(system_index, lo, hi, hi + 1, self._systems_source(data))
            return int(hi) + 1
        return 1

    def _systems_source(self, data: Mapping[str, Tensor]) -> str:
        """Where :meth:`_n_systems` takes the system count from, for messages."""
        if self.ptr is not None and self.ptr in data:
            return f"from {self.ptr!r}"
        if self.system_count is not None:
            return f"the length of {self.system_count!r}"
        return "the largest label + 1"

    def dead_system(self, n_systems: int, s_cap: int) -> int:
        """Index of the system the dead atoms belong to (a hook for
        subclasses that pad fields of their own: a padder with per-system
        counts of its own puts the dead rows' count there)."""
        return s_cap - 1 if self.placement == "own" else max(n_systems - 1, 0)

    def buffer(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A persistent buffer called ``name``, reallocated only when shape,
        dtype or device change (a hook for subclasses: write a field of
        their own into it, so the compiled graph's input keeps its storage)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
            self.allocations += 1
        return buf

    def _plan_atoms(self, plan: _Plan, data: Mapping[str, Tensor], n_cap: int, dead_system: int, dim: int,
                    view_dim: int | None = None) -> None:
        """Plan the per-atom fields (``dims[dim]`` rows, ``dims[view_dim]`` of
        them real: see :meth:`_Plan.add`); the first system-label field
        (:attr:`Fill.LAST_SYSTEM`) is checked every call (on the CPU)."""
        for name, spec in self.atom_fields.items():
            if name in data and name not in plan.aliases:
                real = data[name]
                fill = self._fill_value(spec, real, dead_system)
                rows = _Rows(self.buffer(name, (n_cap, *real.shape[1:]), real), fill)
                plan.add(name, rows, real, dim, view_dim=view_dim)
                if fill is Fill.LAST_REAL:
                    plan.last_real.append((rows, 0))
                if spec is Fill.LAST_SYSTEM and plan.labels is None:
                    plan.labels = (len(plan.names) - 1, self._systems_source(data))

    def _fill_value(self, spec: FillSpec, like: Tensor, dead_system: int) -> _Value | Fill:
        """Resolve a fill marker to a value broadcastable to one row (block) of
        ``like``; :attr:`Fill.LAST_REAL` stays a marker (it follows the data)."""
        if isinstance(spec, Fill):
            if spec is Fill.LAST_SYSTEM:
                return dead_system
            if spec is Fill.DEAD_CELL:
                return self.dead.cell_fill(like)
            if spec is Fill.LAST_REAL:
                return spec
            return self.dead.shift_fill(spec, like)
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
            rows = _Rows(self.buffer(name, (s_cap * unit, *real.shape[1:]), real), fill, unit=unit)
            plan.add(name, rows, real, dim)
            if fill is Fill.LAST_REAL:
                plan.last_real.append((rows, dim))
            if name in counts:  # own: a dead row, rewritten; join: the last real one, added to
                d, cap = counts[name]
                plan.count_rows.append((rows.blocks[dead_system], d, cap, self.placement == "join"))
        if self.ptr is not None and self.ptr in data and self.ptr not in plan.aliases:
            ptr = data[self.ptr]
            # real offsets, then n up to the dead system (empty systems), then n_cap
            rows = _Rows(self.buffer(self.ptr, (s_cap + 1,), ptr), n_cap)
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
