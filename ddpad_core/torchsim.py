"""A torch-sim model interface over any adapter's fixed-shape (compiled) model.

Requires ``torch-sim-atomistic``. Tested with 0.3.0, the release that
installs on Python 3.11. The current release (0.6.2, Python >= 3.12) keeps
the members used here (``ModelInterface`` with ``_device``, ``_dtype``,
``_compute_forces``, ``_compute_stress`` and ``forward(state)``; the
state's ``positions``, ``atomic_numbers``, ``row_vector_cell``, ``pbc`` (a
``[3]`` tensor there, a bool in 0.3.0: both taken) and ``system_idx``;
``io.state_to_atoms(state)``): read from its wheel, not run here::

    import torch_sim as ts
    from ddpad.torchsim import Model

    model = Model(mace_model, "mace", compute_stress=True, backend="inductor")
    final = ts.optimize(system=structures, model=model, optimizer=ts.frechet_cell_fire)

Systems joining and leaving the batch change the atom, edge and system
counts nearly every step; the ``"systems"`` cap (plus the dead system)
keeps the compiled shapes fixed.
"""

from __future__ import annotations

from typing import Any

import torch

from ._version import install_command

try:
    import torch_sim as ts
    from torch_sim.models.interface import ModelInterface
except ImportError as exc:  # pragma: no cover - exercised only without torch-sim
    raise ImportError(f"ddpad.torchsim needs torch-sim: {install_command('torchsim')}") from exc

from ._evaluator import Evaluator, engine_wrap_options
from ._padded import PaddedModel
from ._structures import Structures

__all__ = ["Model"]


class Model(ModelInterface):
    """torch-sim ``ModelInterface`` over ``ddpad.wrap(model, adapter, ...)``.

    Parameters
    ----------
    model
        The model (MACE, AIMNet2, UMA ...).
    adapter
        Adapter name or :class:`~ddpad.adapters.Adapter`.
    compute_forces, compute_stress
        What ``forward`` returns besides the energy.
    pad
        ``False`` runs the model without padding: eagerly (``compile=False``,
        the reference) or compiled (what ddpad is measured against).
    compile
        Compile the model.
    tensor_input
        Build the model's input from the state's tensors (see Notes).
        ``None``: where the adapter has a ``tensor_input`` and its neighbour
        list (vesin-torch, in the ``torchsim`` extra) is installed; ``True``:
        an error if it cannot; ``False``: through ``ase.Atoms``.
    **wrap_kwargs
        Passed to :func:`ddpad.wrap` (``backend``, ``caps``, ``on_recompile`` ...).
        ``compile_cache`` defaults to ddpad's compile store
        (:func:`ddpad.default_store_dir`) for a padded model compiled by
        Inductor, so it gets tight caps and its graphs are found again by the
        next process; pass ``compile_cache=None`` for neither.

    Notes
    -----
    Where the adapter has a ``tensor_input`` (every built-in adapter),
    each step builds the model's input from the state's tensors on their
    device; no ``ase.Atoms`` (a state's per-system ``charge``, where the
    installed torch-sim keeps one, reaches models that read it: AIMNet2). Otherwise each step converts the state
    to ``ase.Atoms`` and builds the input with the adapter's own pipeline, on
    the CPU. ``self.wrapped.stats`` has the compiled graphs, growths and fill.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        adapter: Any,
        *,
        compute_forces: bool = True,
        compute_stress: bool = False,
        pad: bool = True,
        compile: bool = True,
        tensor_input: bool | None = None,
        **wrap_kwargs: Any,
    ) -> None:
        super().__init__()
        self.evaluate = Evaluator(model, adapter, pad=pad, compile=compile, tensor_input=tensor_input,
                                  **engine_wrap_options(wrap_kwargs, pad=pad, compile=compile))
        self.wrapped: PaddedModel | None = self.evaluate.wrapped
        param = next(model.parameters())
        self._device = param.device
        self._dtype = param.dtype
        self._compute_forces = compute_forces
        self._compute_stress = compute_stress

    def forward(self, state: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        if isinstance(state, dict):
            state = ts.SimState(**state, masses=torch.ones_like(state["positions"]))
        if self.evaluate.takes_tensors:
            # (a torch-sim that keeps a total charge per system passes it on: AIMNet2 reads it)
            structures: Any = Structures(state.positions, state.atomic_numbers, state.row_vector_cell, state.pbc,
                                         state.system_idx, getattr(state, "charge", None))
        else:
            structures = ts.io.state_to_atoms(state)
        out = self.evaluate(structures, stress=self._compute_stress, **kwargs)
        results = {"energy": out[self.evaluate.adapter.flat_energy_key].detach().to(self._dtype)}
        if self._compute_forces:
            results["forces"] = out["forces"].detach().to(self._dtype)
        if self._compute_stress:
            results["stress"] = out["stress"].detach().to(self._dtype).reshape(-1, 3, 3)
        return results
