"""What several built-in adapters share: their declaration, stress layout,
detached derivatives and the default system."""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any

import torch
from torch import Tensor

from . import Adapter

__all__ = ["builtin_adapter", "detach", "diamond_carbon", "unknown_elements", "voigt_to_full"]

# [3, 3] positions of ASE's Voigt order (xx, yy, zz, yz, xz, xy)
_VOIGT_INDEX = ((0, 5, 4), (5, 1, 3), (4, 3, 2))


def builtin_adapter(name: str, *, requires: tuple[str, ...], **fields: Any) -> Adapter:
    """The built-in adapter ``name`` (an entry point of ddpad's own
    distribution, ``pyproject.toml``), needing ``requires`` (import names,
    the model package's first); its install hint is left to the registry,
    which gives every built-in ddpad's extra of its name."""
    return Adapter(name=name, requires=requires, **fields)


def voigt_to_full(voigt: Tensor) -> Tensor:
    """``[..., 6]`` in ASE's Voigt order (xx, yy, zz, yz, xz, xy) -> the
    symmetric ``[..., 3, 3]``."""
    return voigt[..., torch.tensor(_VOIGT_INDEX, device=voigt.device)]


def detach(out: MutableMapping[str, Any], keys: Iterable[str]) -> MutableMapping[str, Any]:
    """``out`` with its tensors under ``keys`` detached (in place; returned):
    the derivatives a model package returns without an autograd graph in
    evaluation mode, where the compiled call kept one to trace its backward."""
    for key in keys:
        value = out.get(key)
        if isinstance(value, Tensor):
            out[key] = value.detach()
    return out


def diamond_carbon() -> Any:
    """Periodic bulk: a rattled 2x2x2 diamond-carbon supercell (64 atoms)."""
    from ase.build import bulk

    atoms = bulk("C", "diamond", a=3.57, cubic=True) * (2, 2, 2)
    atoms.rattle(0.05, seed=0)
    return atoms


def unknown_elements(unknown: Iterable[int], known: Iterable[int]) -> ValueError:
    """The error for a structure holding elements the model does not know:
    those elements by symbol, and the model's by symbol when few (else
    their count and range), not 89 bare atomic numbers."""
    from ase.data import chemical_symbols

    def symbol(z: int) -> str:
        return chemical_symbols[z] if 0 < z < len(chemical_symbols) else f"Z={z}"

    missing, held = sorted(set(unknown)), sorted(set(known))
    held_text = (", ".join(map(symbol, held)) if len(held) <= 20
                 else f"{len(held)} elements, {symbol(held[0])} to {symbol(held[-1])}")
    return ValueError(f"the model does not know {', '.join(map(symbol, missing))} "
                      f"(atomic number{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}); "
                      f"it knows {held_text}")
