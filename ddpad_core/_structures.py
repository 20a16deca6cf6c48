"""Structures as tensors: the input every engine has (positions, atomic
numbers, cells, periodicity, the system of each atom), checked once per
composition, and a neighbour list computed on the tensors' device (:class:`NeighborList`).

An adapter's ``tensor_input`` turns a :class:`Structures` into the model's
native input without leaving the device: no ``ase.Atoms``, no CPU pipeline.
What depends only on the composition (which atoms, of which species, in which
system) is worked out when the composition changes and reused while it stays
(:class:`Composition`); a step with the same atoms reads nothing from the device
but what the neighbour list itself needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._version import install_command

__all__ = ["Composition", "NeighborList", "Structures"]


@dataclass
class Structures:
    """One or more structures as tensors on one device.

    Parameters
    ----------
    positions
        ``[N, 3]`` Cartesian positions, the atoms of each system contiguous
        and the systems in order.
    numbers
        ``[N]`` atomic numbers (integer).
    cell
        ``[S, 3, 3]`` cells, lattice vectors as rows (ASE's convention); a
        single ``[3, 3]`` cell is taken for one system.
    pbc
        Periodicity: one bool for every system and direction, ``[3]`` for
        every system, or ``[S, 3]``.
    system
        ``[N]`` index of each atom's system, ``0 .. S-1`` in order; ``None``:
        all atoms are one system.
    charge
        ``[S]`` total charge of each system, for models that take one
        (AIMNet2); ``None``: every system neutral. Models without a charge
        input ignore it.
    """

    positions: Tensor
    numbers: Tensor
    cell: Tensor
    pbc: bool | Tensor
    system: Tensor | None = None
    charge: Tensor | None = None

    @classmethod
    def from_atoms(cls, atoms: Any, *, dtype: torch.dtype = torch.float64,
                   device: str | torch.device = "cpu", molecules: bool = False) -> Structures:
        """Structures from one ``ase.Atoms`` or a list of them, each a system
        whose charge is its ``info["charge"]`` (default 0).

        ``molecules=True`` (a model whose systems are molecules: AIMNet2's
        :attr:`~ddpad.adapters.EngineHooks.molecules`): an ``Atoms`` with a
        ``mol_id`` array is one system per molecule, each with the
        ``Atoms``' cell, periodicity and ``info["charge"]``, as the
        adapter's ASE pipeline splits it; a molecule's atoms must be
        contiguous."""
        structures = list(atoms) if isinstance(atoms, (list, tuple)) else [atoms]
        if not structures:
            raise ValueError("ddpad.padding.Structures.from_atoms needs at least one structure")
        # one entry per system: (its Atoms, its atom count)
        systems = [(a, hi - lo) for a in structures
                   for lo, hi in (molecule_ranges(a) if molecules else [(0, len(a))])]
        positions = torch.cat([torch.as_tensor(a.positions, dtype=dtype) for a in structures])
        numbers = torch.cat([torch.as_tensor(a.numbers, dtype=torch.long) for a in structures])
        cell = torch.stack([torch.as_tensor(a.cell.array, dtype=dtype) for a, _ in systems])
        pbc = torch.stack([torch.as_tensor(a.pbc, dtype=torch.bool) for a, _ in systems])
        system = torch.repeat_interleave(torch.arange(len(systems)),
                                         torch.tensor([count for _, count in systems], dtype=torch.long))
        charge = torch.tensor([float(a.info.get("charge", 0.0)) for a, _ in systems], dtype=dtype)
        return cls(positions.to(device), numbers.to(device), cell.to(device), pbc.to(device), system.to(device),
                   charge.to(device))

    @property
    def cells(self) -> Tensor:
        """``[S, 3, 3]`` cells."""
        return self.cell if self.cell.dim() == 3 else self.cell.unsqueeze(0)


def molecule_ranges(atoms: Any) -> list[tuple[int, int]]:
    """The atom range of each molecule of an ``ase.Atoms`` by its ``mol_id``
    array (one range for the whole ``Atoms`` without one), in order.

    Raises
    ------
    ValueError
        A molecule's atoms are not contiguous (outputs come back in input
        order).
    """
    ids = atoms.arrays.get("mol_id")
    if ids is None or len(ids) == 0:
        return [(0, len(atoms))]
    starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]]
    if len({int(ids[i]) for i in starts}) != len(starts):
        raise ValueError("ddpad: mol_id must group each molecule's atoms contiguously")
    return list(zip(starts, starts[1:] + [len(ids)]))


class Composition:
    """What a :class:`Structures` fixes until its atoms change: the number of
    systems, the atom range of each (on the host), ``ptr`` and the system index
    on the device, and the periodicity per system. Built (and the input
    checked, reading the device once) by :meth:`of`; reused while the same
    ``numbers`` and ``system`` tensors, unmodified, come back.

    Parameters
    ----------
    structures
        The structures.
    known
        Atomic numbers the model knows; ``None``: any.
    """

    def __init__(self, structures: Structures, known: frozenset[int] | None = None) -> None:
        s = structures
        positions, numbers = s.positions, s.numbers
        if positions.dim() != 2 or positions.shape[-1] != 3:
            raise ValueError(f"ddpad: positions must be [N, 3], got {list(positions.shape)}")
        if numbers.shape != positions.shape[:1]:
            raise ValueError(f"ddpad: numbers must be [N] = [{positions.shape[0]}], got {list(numbers.shape)}")
        n = positions.shape[0]
        device = positions.device
        system = s.system if s.system is not None else torch.zeros(n, dtype=torch.long, device=device)
        if system.shape != (n,):
            raise ValueError(f"ddpad: system must be [N] = [{n}], got {list(system.shape)}")
        cells = s.cells
        n_systems = cells.shape[0]
        if cells.shape[1:] != (3, 3):
            raise ValueError(f"ddpad: cell must be [S, 3, 3] or [3, 3], got {list(s.cell.shape)}")
        # the one read of the device per composition: counts, order, species, finiteness
        counts = torch.bincount(system.long(), minlength=n_systems).tolist() if n else [0] * n_systems
        if len(counts) > n_systems or (n and bool((system[1:] < system[:-1]).any())) or (n and int(system.min()) < 0):
            raise ValueError(f"ddpad: system indices must run 0 .. {n_systems - 1} in order (one cell per system); "
                             "sort the atoms by system")
        for index, count in enumerate(counts):
            if count == 0:
                raise ValueError(f"ddpad: system {index} has no atoms; every system needs at least one")
        ptr = [0]
        for count in counts:
            ptr.append(ptr[-1] + count)
        self.n_systems = n_systems
        self.ranges = [(ptr[i], ptr[i + 1]) for i in range(n_systems)]
        self.pbc = _pbc_rows(s.pbc, n_systems)
        # vesin's ``periodic`` per system: a bool, or a tensor for mixed directions
        self.periodic = [p[0] if len(set(p)) == 1 else torch.tensor(p, device=device) for p in self.pbc]
        if known is not None:
            for index, (lo, hi) in enumerate(self.ranges):
                unknown = sorted(set(numbers[lo:hi].tolist()) - known)
                if unknown:
                    raise ValueError(f"ddpad: system {index} has atomic numbers {unknown} that the model does "
                                     f"not know (it knows {_spans(known)})")
        finite = torch.isfinite(positions).all(dim=1)
        if not bool(finite.all()):
            bad = sorted({_system_of(int(i), self.ranges) for i in torch.nonzero(~finite).flatten().tolist()})
            raise ValueError(f"ddpad: system(s) {bad} have positions that are not finite (NaN or inf)")
        dets = torch.linalg.det(cells.double()).abs().tolist()
        for index, (det, periodic) in enumerate(zip(dets, self.pbc)):
            if any(periodic) and det < 1e-12:
                raise ValueError(f"ddpad: system {index} is periodic ({list(periodic)}) but its cell has no "
                                 "volume; give it a cell or pbc=False")
        self.ptr = torch.tensor(ptr, dtype=torch.long, device=device)
        self.system = system.long()
        self._numbers, self._system = numbers, s.system
        self._versions = (numbers._version, None if s.system is None else s.system._version)
        self._pbc = s.pbc

    def matches(self, structures: Structures) -> bool:
        """Whether ``structures`` has this composition: the same ``numbers``,
        ``system`` and ``pbc`` objects, unmodified (no read of the device)."""
        s = structures
        return (s.numbers is self._numbers and s.system is self._system and s.pbc is self._pbc
                and self._versions == (s.numbers._version, None if s.system is None else s.system._version))

    @classmethod
    def of(cls, structures: Structures, cached: Composition | None,
           known: frozenset[int] | None = None) -> Composition:
        """``cached`` when it still matches, else a new (checked) composition."""
        return cached if cached is not None and cached.matches(structures) else cls(structures, known)


def _pbc_rows(pbc: bool | Tensor, n_systems: int) -> list[tuple[bool, bool, bool]]:
    if isinstance(pbc, Tensor):
        rows = pbc.bool().reshape(-1, 3).tolist() if pbc.numel() in (3, 3 * n_systems) else None
        if rows is None and pbc.numel() == 1:
            rows = [[bool(pbc)] * 3]
        if rows is None:
            raise ValueError(f"ddpad: pbc must be a bool, [3] or [S, 3] = [{n_systems}, 3], got {list(pbc.shape)}")
    else:
        rows = [[bool(pbc)] * 3]
    if len(rows) == 1:
        rows = rows * n_systems
    return [(bool(a), bool(b), bool(c)) for a, b, c in rows]


def _spans(numbers: frozenset[int]) -> str:
    """``1-99`` or ``1, 6, 8``: runs of consecutive numbers joined."""
    runs: list[list[int]] = []
    for z in sorted(numbers):
        if runs and z == runs[-1][-1] + 1:
            runs[-1].append(z)
        else:
            runs.append([z])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def _system_of(atom: int, ranges: list[tuple[int, int]]) -> int:
    return next(i for i, (lo, hi) in enumerate(ranges) if lo <= atom < hi)


class NeighborList:
    """Every ordered pair closer than ``cutoff``, on the structures' device,
    by vesin-torch (imported when this is made: an ``ImportError`` naming the
    package then, not at the first step). One vesin call per system; vesin
    inverts the box even when nothing is periodic, so a non-periodic system
    gets a unit box.

    Parameters
    ----------
    cutoff
        The model's cutoff radius.

    Raises
    ------
    ImportError
        vesin-torch is not installed.
    """

    def __init__(self, cutoff: float) -> None:
        try:
            from vesin_torch import NeighborList as Vesin
        except ImportError:
            try:
                from vesin.torch import NeighborList as Vesin
            except ImportError as exc:
                raise ImportError("ddpad's tensor input path needs vesin-torch (in the mace, sevennet, nequip, mattersim, "
                                  f"allegro and torchsim extras): pip install vesin-torch, or "
                                  f"{install_command('torchsim')}") from exc
        self.cutoff = float(cutoff)
        self._vesin = Vesin(cutoff=self.cutoff, full_list=True)

    def __call__(self, structures: Structures, composition: Composition) -> tuple[Tensor, Tensor, Tensor]:
        """The pairs of ``structures`` (whose composition is ``composition``).

        Returns
        -------
        edge_index
            ``[2, E]`` (sender ``i``, receiver ``j``), global atom indices; no
            atom paired with itself in its own image.
        unit_shifts
            ``[E, 3]`` lattice translations (float, the positions' dtype): the
            pair's vector is ``r_j - r_i + unit_shifts @ cell``.
        shifts
            ``[E, 3]`` ``unit_shifts @ cell`` of the pair's system.
        """
        positions, cells = structures.positions.detach(), structures.cells.detach()
        pairs, units, shifts = [], [], []
        for index, (lo, hi) in enumerate(composition.ranges):
            cell = cells[index]
            box = cell if any(composition.pbc[index]) else torch.eye(3, dtype=cell.dtype, device=cell.device)
            i, j, unit = self._vesin.compute(points=positions[lo:hi], box=box, periodic=composition.periodic[index],
                                             quantities="ijS")
            unit = unit.to(positions.dtype)
            pairs.append(torch.stack((i, j)).long() + lo)
            units.append(unit)
            shifts.append(unit @ cell)
        return torch.cat(pairs, dim=1), torch.cat(units), torch.cat(shifts)
