"""An ASE calculator that runs any adapter's fixed-shape (compiled) model.

Requires ``ase`` (installed with any model extra)::

    from ddpad.ase import Calculator
    atoms.calc = Calculator(model, "mace", backend="inductor")
    ase.md.langevin.Langevin(atoms, ...).run(1000)   # one compiled graph
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import numpy as np
import torch

from ._version import install_command

try:
    from ase.calculators.calculator import Calculator as _AseCalculator
    from ase.calculators.calculator import all_changes
    from ase.stress import full_3x3_to_voigt_6_stress
except ImportError as exc:  # pragma: no cover - exercised only without ase
    raise ImportError(f"ddpad.ase needs ASE: pip install ase (or any model extra, e.g. "
                      f"{install_command('mace')})") from exc

from ._caps_file import cached_caps_path as _cached_caps_path
from ._evaluator import Evaluator, engine_wrap_options
from ._fs import cache_dir
from ._padded import PaddedModel
from ._store import model_fingerprint
from ._structures import Structures

log = logging.getLogger("ddpad")

__all__ = ["Calculator"]


def _numpy(value: torch.Tensor) -> np.ndarray:
    return value.detach().cpu().numpy().astype(np.float64)


class Calculator(_AseCalculator):
    """ASE calculator over ``ddpad.wrap(model, adapter, ...)``.

    Parameters
    ----------
    model
        The model (e.g. a MACE, AIMNet2 or UMA module).
    adapter
        Adapter name or :class:`~ddpad.adapters.Adapter`.
    compile
        Compile the model (``False`` still pads: eager, fixed shapes).
    pad
        ``False`` runs the model without padding (with ``compile=False``: the
        plain eager model, the reference).
    call_kwargs
        Options passed on every model call.
    tensor_input
        Build the model's input from the atoms' arrays as tensors on the
        model's device (the adapter's ``tensor_input``, every built-in
        adapter's; the numbers tensor is reused while the atoms stay the
        same; for AIMNet2 one system per molecule of a ``mol_id`` array,
        each with ``atoms.info["charge"]``), not through the adapter's ASE
        pipeline. ``None``: where the adapter has one and what it needs
        (vesin-torch for a neighbour list) is installed;
        ``True``: an error if it cannot; ``False``: the pipeline (the
        reference).
    cached_caps
        Bound to a store, with tight caps and no ``caps=``, the calculator
        starts from the caps ``ddpad precompile`` or an earlier run fitted
        to this model (its architecture) on this system (its formula and
        periodicity), kept in ddpad's user cache, and writes its own there
        once they are fitted, and again when they grow: its first call
        loads what they built, and a run that grew starts where it ended.
        ``False``: neither (``ddpad run`` keeps that file itself).
    **wrap_kwargs
        Passed to :func:`ddpad.wrap` (``backend``, ``caps``, ``on_recompile`` ...).
        ``compile_cache`` defaults to ddpad's compile store
        (:func:`ddpad.default_store_dir`) for a padded model compiled by
        Inductor, as in torch-sim and LAMMPS: tight caps, and the next
        process finds the graphs; ``compile_cache=None`` for neither.

    Attributes
    ----------
    wrapped : PaddedModel or None
        The fixed-shape model; ``calc.wrapped.stats`` has graphs, growths, fill.
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress"]

    def __init__(
        self,
        model: torch.nn.Module,
        adapter: Any,
        *,
        compile: bool = True,
        pad: bool = True,
        call_kwargs: dict[str, Any] | None = None,
        tensor_input: bool | None = None,
        cached_caps: bool = True,
        **wrap_kwargs: Any,
    ) -> None:
        super().__init__()
        self.evaluate = Evaluator(model, adapter, pad=pad, compile=compile, tensor_input=tensor_input,
                                  **engine_wrap_options(wrap_kwargs, pad=pad, compile=compile))
        self.wrapped: PaddedModel | None = self.evaluate.wrapped
        self.call_kwargs = dict(call_kwargs or {})
        self.tensor_input = self.evaluate.takes_tensors
        self._device = next(model.parameters()).device
        self._molecules = self.evaluate.adapter.engine.molecules
        self._composition: tuple[Any, Structures] | None = None
        wrapped = self.wrapped
        # the user cache's caps of this model on the first call's system (see the docstring)
        self._caps_pending = cached_caps and not (wrapped is None or wrapped.sizer is None
                                                  or wrapped.options.caps is not None
                                                  or wrapped.options.compile_cache is None)
        self._caps_out: str | None = None  # where to keep the caps once fitted, and after each change
        self._caps_kept: dict[str, int] = {}  # the caps that file holds

    def structures(self, atoms: Any) -> Structures:
        """``atoms`` as :class:`~ddpad.padding.Structures` on the model's device (one
        system, or one per molecule of its ``mol_id`` array for a model whose
        systems are molecules); the numbers, pbc, system and charge tensors
        are the last call's while they are equal, so the composition is
        checked once, not every step."""
        key = (atoms.numbers.copy(), atoms.pbc.copy(), _copy(atoms.arrays.get("mol_id")) if self._molecules else None,
               atoms.info.get("charge", 0.0))
        c = self._composition
        if c is None or not all(np.array_equal(a, b) for a, b in zip(c[0], key)):  # (None equals only None)
            c = self._composition = (key, Structures.from_atoms(atoms, device=self._device, molecules=self._molecules))
        known = c[1]
        as_tensor = functools.partial(torch.as_tensor, dtype=torch.float64, device=self._device)
        cell = as_tensor(atoms.cell.array).expand(known.cells.shape[0], 3, 3)
        return Structures(as_tensor(atoms.positions), known.numbers, cell, known.pbc, known.system, known.charge)

    def calculate(self, atoms: Any = None, properties: Any = None, system_changes: Any = all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        wants_stress = bool(self.atoms.pbc.all()) and "stress" in (properties or [])
        adapter = self.evaluate.adapter
        if self._caps_pending:  # (the first call of a store-bound tight calculator)
            self._caps_pending, self._caps_out = False, self._start_from_cached_caps(self.atoms)
        atoms = self.structures(self.atoms) if self.tensor_input else self.atoms
        out = self.evaluate(atoms, stress=wants_stress, **self.call_kwargs)
        wrapped = self.wrapped
        if self._caps_out is not None and wrapped.sizer.settled and wrapped.cap_state != self._caps_kept:
            self._keep_caps(self._caps_out)  # fitted, or grown since: the next process starts there
        energy = float(out[adapter.flat_energy_key].detach().sum())
        self.results = {"energy": energy, "free_energy": energy}
        if isinstance(out.get("forces"), torch.Tensor):
            self.results["forces"] = _numpy(out["forces"])
        for key in (adapter.engine.atom_energy_key, "energies"):
            if key is not None and isinstance(out.get(key), torch.Tensor):
                self.results["energies"] = _numpy(out[key])
                break
        if wants_stress and isinstance(out.get("stress"), torch.Tensor):
            self.results["stress"] = full_3x3_to_voigt_6_stress(_numpy(out["stress"]).reshape(3, 3))

    def _start_from_cached_caps(self, atoms: Any) -> str:
        """Preset the caps cached for this model on ``atoms``' system, if
        any; the path to keep them in as they are fitted or grow."""
        wrapped = self.wrapped
        assert wrapped is not None and wrapped.adapter is not None
        path = cached_caps_path(wrapped.adapter.name, self.evaluate.model, atoms)
        if not os.path.exists(path):
            return path
        try:
            wrapped.load_caps(path)
        except (OSError, ValueError) as exc:  # the cache's file, not the user's input: one warning
            log.warning("ddpad: ignoring the cached caps %s (%s); this run fits its own", path, exc)
            return path
        self._caps_kept = dict(wrapped.cap_state)
        return path

    def _keep_caps(self, path: str) -> None:
        """Write the caps a tight run fitted (or grew to since) where the
        next process looks; a folder that cannot be written: said once."""
        wrapped = self.wrapped
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            wrapped.save_caps(path)
        except OSError as exc:
            self._caps_out = None
            log.warning("ddpad: could not keep the fitted caps in %s (%s)", path, exc)
        self._caps_kept = dict(wrapped.cap_state)


def cached_caps_path(adapter: str, model: torch.nn.Module, atoms: Any) -> str:
    """The user cache's caps file of ``model`` on the system of ``atoms``
    (:func:`ddpad._caps_file.cached_caps_path`), where ``ddpad precompile``,
    ``ddpad run`` and this calculator keep the caps they fitted."""
    return _cached_caps_path(os.path.join(cache_dir(), "caps"), adapter, model_fingerprint(model),
                             atoms.get_chemical_formula(mode="hill"), atoms.pbc)


def _copy(array: np.ndarray | None) -> np.ndarray | None:
    return None if array is None else array.copy()
