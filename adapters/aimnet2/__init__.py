"""AIMNet2 (``aimnet`` package): dense neighbour-matrix padding.

The native input is aimnet's flat ("mode 1") batch as its calculator builds
it: ``coord [N+1, 3]``, ``numbers``, ``mol_idx``, per-molecule ``charge``
(and ``mult``), and neighbour matrices ``nbmat[_lr|_coulomb|_dftd3]`` of
shape ``[N+1, K]`` whose last row is the model's pad atom and whose entries
``N`` are sentinels. :class:`ddpad.DensePadder` pads the rows to the atoms
cap and every matrix width ``K`` to its own grow-only cap. Dead atoms
(``numbers = 0``) form their own zero-charge molecule: joined to a real one
they would take part in its charge equilibration.

The output is what aimnet's calculator returns: ``energy [S]``,
``charges [N]`` and, unless ``forces=False``, ``forces [N, 3]`` (autograd
of the energy around the compiled model, so the model itself compiles to
one graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ddpad import DensePadder, Fill
from ddpad.adapters import Adapter

__all__ = ["ADAPTER", "build_input", "evaluate", "make_padder"]

NBMAT_KEYS = ("nbmat", "nbmat_lr", "nbmat_coulomb", "nbmat_dftd3")
ATOM_OUTPUTS = ("forces", "charges", "spin_charges")
SYSTEM_OUTPUTS = ("energy",)


def make_padder(model: torch.nn.Module | None = None, **overrides: Any) -> DensePadder:
    """The AIMNet2 padder; keyword arguments override :class:`ddpad.DensePadder`'s."""
    config: dict[str, Any] = dict(
        nbmat=NBMAT_KEYS,
        atom_fields={"coord": 0.0, "numbers": 0, "mol_idx": Fill.LAST_SYSTEM},
        system_fields={"charge": 0.0, "mult": 1.0},
        neighbor_fields={f"shifts{k[5:]}": (k, 0.0) for k in NBMAT_KEYS},
        system_count="charge",
        atom_outputs=ATOM_OUTPUTS,
        system_outputs=SYSTEM_OUTPUTS,
    )
    config.update(overrides)
    return DensePadder(**config)


def _step(model: Any, data: dict[str, Tensor], *, forces: bool = True) -> dict[str, Tensor]:
    """One evaluation: the model's energy and charges, forces by autograd.

    ``model`` may be compiled; the gradient is taken outside it, so Dynamo
    sees one graph and AOTAutograd compiles its backward.
    """
    coord = data["coord"]
    if forces and not coord.requires_grad:
        coord.requires_grad_(True)
    out = model(data)
    result = {"energy": out["energy"], "charges": out["charges"]}
    if "spin_charges" in out:
        result["spin_charges"] = out["spin_charges"]
    if forces:
        (grad,) = torch.autograd.grad(out["energy"].sum(), coord)
        result["forces"] = -grad
    return result


def evaluate(model: torch.nn.Module, data: dict[str, Tensor], *, forces: bool = True) -> dict[str, Tensor]:
    """The unpadded eager reference: what the wrapped model returns for ``data``.

    Per-atom outputs drop the model's pad atom (the last row), as aimnet's
    calculator does.
    """
    inp = {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in data.items()}
    out = _step(model, inp, forces=forces)
    n = data["nbmat"].shape[0] - 1
    return {k: (v[:n] if k in ATOM_OUTPUTS else v) for k, v in out.items()}


def build_input(
    model: torch.nn.Module,
    atoms: Any,
    *,
    charge: float | Sequence[float] | None = None,
    calculator: Any = None,
    device: str | torch.device = "cpu",
) -> dict[str, Tensor]:
    """aimnet's own flat input for one ``ase.Atoms`` or a list of molecules.

    The neighbour matrices come from aimnet's calculator pipeline
    (``AIMNet2Calculator.prepare_input``), so the input is exactly what
    aimnet itself would feed the model. Pass ``calculator`` to reuse one
    across steps; ``charge`` per molecule (default: ``atoms.info["charge"]``
    or 0).
    """
    from aimnet.calculators import AIMNet2Calculator

    mols = list(atoms) if isinstance(atoms, (list, tuple)) else [atoms]
    if not mols:
        raise ValueError("build_input needs at least one molecule")
    if any(bool(getattr(m, "pbc", [False]).any()) for m in mols):
        raise ValueError("the aimnet2 adapter takes molecules (pbc=False); periodic input is not supported")
    if calculator is None:
        calculator = AIMNet2Calculator(model=model, device=str(device))
    if charge is None:
        charges = [float(m.info.get("charge", 0.0)) for m in mols]
    else:
        charges = [float(c) for c in (charge if isinstance(charge, Sequence) else [charge] * len(mols))]
    dtype = next(model.parameters()).dtype
    data = {
        "coord": torch.cat([torch.as_tensor(m.get_positions(), dtype=dtype) for m in mols]),
        "numbers": torch.cat([torch.as_tensor(m.get_atomic_numbers()) for m in mols]),
        "charge": torch.tensor(charges, dtype=dtype),
        "mol_idx": torch.repeat_interleave(torch.arange(len(mols)), torch.tensor([len(m) for m in mols])),
    }
    return calculator.prepare_input({k: v.to(device) for k, v in data.items()})


def _cutoff(model: torch.nn.Module) -> float:
    return float(model.aev.rc_s)


ADAPTER = Adapter(
    name="aimnet2",
    make_padder=make_padder,
    energy_key="energy",
    atom_outputs=ATOM_OUTPUTS,
    system_outputs=SYSTEM_OUTPUTS,
    cutoff=_cutoff,
    build_input=build_input,
    install_hint="pip install 'ddpad[aimnet2]'",
    requires=("aimnet",),
    call=_step,
)
