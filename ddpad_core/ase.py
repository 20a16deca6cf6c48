"""An ASE calculator that runs any adapter's fixed-shape (compiled) model.

Requires ``ase`` (installed with any model extra)::

    from ddpad.ase import Calculator
    atoms.calc = Calculator(model, "mace", backend="inductor")
    ase.md.langevin.Langevin(atoms, ...).run(1000)   # one compiled graph
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

try:
    from ase.calculators.calculator import Calculator as _AseCalculator
    from ase.calculators.calculator import all_changes
except ImportError as exc:  # pragma: no cover - exercised only without ase
    raise ImportError("ddpad.ase needs ASE: pip install ase (or any model extra, e.g. 'ddpad[mace]')") from exc

from ._runtime import PaddedModel, wrap

__all__ = ["Calculator"]


class Calculator(_AseCalculator):
    """ASE calculator over ``ddpad.wrap(model, adapter, ...)``.

    Parameters
    ----------
    model
        The model (e.g. a MACE or AIMNet2 module).
    adapter
        Adapter name or :class:`~ddpad.adapters.Adapter`.
    compile
        Compile the model (``False`` still pads: eager, fixed shapes).
    pad
        ``False`` runs the plain model (no padding, no compile): the reference.
    call_kwargs
        Options passed on every model call (e.g. ``{"compute_stress": True}``).
    **wrap_kwargs
        Passed to :func:`ddpad.wrap` (``backend``, ``caps``, ``on_recompile`` ...).

    Attributes
    ----------
    wrapped : PaddedModel
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
        **wrap_kwargs: Any,
    ) -> None:
        super().__init__()
        self.wrapped: PaddedModel = wrap(model, adapter, compile=compile and pad, **wrap_kwargs)
        self.adapter = self.wrapped.adapter
        assert self.adapter is not None
        self.model = model
        self.pad = pad
        self.build = self.adapter.input_builder(model)
        self.call_kwargs = dict(call_kwargs or {})

    def calculate(self, atoms: Any = None, properties: Any = None, system_changes: Any = all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        data = self.build(self.atoms)
        kwargs = dict(self.call_kwargs)
        wants_stress = bool(self.atoms.pbc.all()) and "stress" in (properties or [])
        kwargs.update(self.adapter.call_options(wants_stress))
        out = self.wrapped(data, **kwargs) if self.pad else self.adapter.reference(self.model, data, **kwargs)
        out = self.adapter.flat(out)
        energy = float(out[self.adapter.energy_key].detach().sum())
        self.results = {"energy": energy, "free_energy": energy}
        if "forces" in out and out["forces"] is not None:
            self.results["forces"] = out["forces"].detach().cpu().numpy().astype(np.float64)
        for key in ("node_energy", "energies"):
            if isinstance(out.get(key), torch.Tensor):
                self.results["energies"] = out[key].detach().cpu().numpy().astype(np.float64)
        stress = out.get("stress")
        if wants_stress and isinstance(stress, torch.Tensor):
            from ase.stress import full_3x3_to_voigt_6_stress

            self.results["stress"] = full_3x3_to_voigt_6_stress(stress.detach().cpu().numpy().reshape(3, 3))
