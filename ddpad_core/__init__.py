"""ddpad: keep torch.compile'd interatomic potentials on one compiled graph.

Pads every step's graph to fixed, grow-only, bucketed capacities with inert
dead atoms and edges, and grows those capacities in lockstep across ranks.

Two tiers. ``ddpad`` itself holds what a user of a model needs: :func:`wrap`
and :class:`PaddedModel`, the engines (:class:`Evaluator`, ``ddpad.ase``,
``ddpad.torchsim``, ``ddpad.engines``), :class:`Stats`, the errors, caps
files and the compile store. :mod:`ddpad.padding` holds what a padder,
adapter or framework author builds on (the padder protocol, capacity, the
padders, the distributed context); ``ddpad.adapters`` the adapter record and
registry; ``ddpad.testing`` the conformance kit.

Public names load on first use (PEP 562): ``import ddpad`` and the command
line's ``-h`` import no torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

if TYPE_CHECKING:  # what the names are, for type checkers and readers
    from ._agreement import AgreementError, cap_agreement_group
    from ._capacity import CapacityError, TightPolicy
    from ._caps_file import load_caps, save_caps
    from ._evaluator import Evaluator
    from ._noise import CompileEvent
    from ._padded import PaddedModel
    from ._shrink import ShrinkPolicy
    from ._stats import CapEvent, Stats
    from ._store import CompileStore, default_store_dir
    from ._strict import RecompileError
    from ._wrap import wrap

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("AgreementError", "cap_agreement_group"), "._agreement"),
    **dict.fromkeys(("CapacityError", "TightPolicy"), "._capacity"),
    **dict.fromkeys(("load_caps", "save_caps"), "._caps_file"),
    "Evaluator": "._evaluator",
    "CompileEvent": "._noise",
    "PaddedModel": "._padded",
    "ShrinkPolicy": "._shrink",
    **dict.fromkeys(("CapEvent", "Stats"), "._stats"),
    **dict.fromkeys(("CompileStore", "default_store_dir"), "._store"),
    "RecompileError": "._strict",
    "wrap": "._wrap",
}

__all__ = [
    "AgreementError",
    "CapEvent",
    "CapacityError",
    "CompileEvent",
    "CompileStore",
    "Evaluator",
    "PaddedModel",
    "RecompileError",
    "ShrinkPolicy",
    "Stats",
    "TightPolicy",
    "cap_agreement_group",
    "default_store_dir",
    "load_caps",
    "save_caps",
    "wrap",
]

# the other tiers and the integrations (which import optional packages) load
# on first attribute access too: ``ddpad.ase.Calculator`` works without
# importing ``ddpad.ase`` first
_LAZY_MODULES = frozenset({"padding", "ase", "torchsim", "testing", "engines"})


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        return getattr(importlib.import_module(module, __name__), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    # (the lazy submodules are not listed: inspect.getmembers, as the API reference's builder runs it, reads
    # every listed name, and ddpad.torchsim without torch-sim raises)
    return sorted({*globals(), *_EXPORTS})
