"""What several built-in adapters share: their declaration from the registry's
entry, stress layout, detached derivatives, structures and the default system."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import torch
from ddpad._noise import quiet
from torch import Tensor

from ._adapter import Adapter
from ._registry import builtin_declaration

__all__ = ["builtin_adapter", "detach", "diamond_carbon", "voigt_to_full"]

# [3, 3] positions of ASE's Voigt order (xx, yy, zz, yz, xz, xy)
_VOIGT_INDEX = ((0, 5, 4), (5, 1, 3), (4, 3, 2))


def builtin_adapter(name: str, **fields: Any) -> Adapter:
    """The built-in adapter ``name``: ``fields`` plus what the registry
    declares for it (``requires``, ``install_hint``), kept in one place.
    Building or loading a model runs inside :func:`ddpad._noise.quiet`: the
    model package's known warnings (TorchScript annotations, e3nn's
    ``torch.load``) are raised because ddpad builds it."""
    for hook in ("random_model", "load_model"):
        if fields.get(hook) is not None:
            fields[hook] = _quietly(fields[hook])
    return Adapter(name=name, **builtin_declaration(name), **fields)


def _quietly(build: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(build)
    def quietly(*args: Any, **kwargs: Any) -> Any:
        with quiet():
            return build(*args, **kwargs)

    return quietly


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
