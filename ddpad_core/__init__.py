"""ddpad: keep torch.compile'd interatomic potentials on one compiled graph.

Pads every step's graph to fixed, grow-only, bucketed capacities with inert
dead atoms and edges, and grows those capacities in lockstep across ranks.

Public names load on first use (PEP 562): ``import ddpad`` and the command
line's ``-h`` import no torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

if TYPE_CHECKING:  # what the names are, for type checkers and readers
    from ._agreement import Agreement, AgreementError, cap_agreement_group, cap_agreement_over
    from ._capacity import (
        CapacityError,
        CapPolicy,
        CapResolution,
        CapScope,
        ScopedCaps,
        TightPolicy,
        bucket,
        cap_ceilings,
        record_resolutions,
        resolve_cap,
        resolve_caps,
    )
    from ._caps_file import load_caps, save_caps
    from ._compile import compile_counted, counting_backend
    from ._context import (
        NOT_DISTRIBUTED,
        DistributedContext,
        GatherMeta,
        HaloMeta,
        activate_dd_context,
        current_dd_context,
    )
    from ._evaluator import Evaluator, UnpaddedCompiled
    from ._memory import derive_ceilings
    from ._noise import CompileEvent
    from ._padded import PaddedModel
    from ._padders import COOPadder, DenseBatchPadder, DensePadder, Fill, FillSpec, PadderBase
    from ._protocol import GraphPadder
    from ._shrink import ShrinkPolicy
    from ._stats import CapEvent, Stats
    from ._store import CompileStore, default_store_dir, model_fingerprint
    from ._strict import RecompileError
    from ._structures import Composition, NeighborList, Structures
    from ._registry import resolve_adapter
    from ._wrap import wrap

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(('Agreement', 'AgreementError', 'cap_agreement_group', 'cap_agreement_over'), "._agreement"),
    **dict.fromkeys(('CapPolicy', 'CapResolution', 'CapScope', 'CapacityError', 'ScopedCaps', 'TightPolicy', 'bucket', 'cap_ceilings', 'record_resolutions', 'resolve_cap', 'resolve_caps'), "._capacity"),
    **dict.fromkeys(('load_caps', 'save_caps'), "._caps_file"),
    **dict.fromkeys(('compile_counted', 'counting_backend'), "._compile"),
    **dict.fromkeys(('DistributedContext', 'GatherMeta', 'HaloMeta', 'NOT_DISTRIBUTED', 'activate_dd_context', 'current_dd_context'), "._context"),
    **dict.fromkeys(('Evaluator', 'UnpaddedCompiled'), "._evaluator"),
    "derive_ceilings": "._memory",
    "CompileEvent": "._noise",
    "PaddedModel": "._padded",
    **dict.fromkeys(('COOPadder', 'DenseBatchPadder', 'DensePadder', 'Fill', 'FillSpec', 'PadderBase'), "._padders"),
    "GraphPadder": "._protocol",
    "ShrinkPolicy": "._shrink",
    **dict.fromkeys(('CapEvent', 'Stats'), "._stats"),
    **dict.fromkeys(('CompileStore', 'default_store_dir', 'model_fingerprint'), "._store"),
    "RecompileError": "._strict",
    **dict.fromkeys(('Composition', 'NeighborList', 'Structures'), "._structures"),
    "resolve_adapter": "._registry",
    "wrap": "._wrap",
}

__all__ = [
    "NOT_DISTRIBUTED",
    "Agreement",
    "AgreementError",
    "COOPadder",
    "CapEvent",
    "CapPolicy",
    "CapResolution",
    "CapScope",
    "CapacityError",
    "CompileEvent",
    "CompileStore",
    "Composition",
    "DenseBatchPadder",
    "DensePadder",
    "DistributedContext",
    "Evaluator",
    "Fill",
    "FillSpec",
    "GatherMeta",
    "GraphPadder",
    "HaloMeta",
    "NeighborList",
    "PaddedModel",
    "PadderBase",
    "RecompileError",
    "ScopedCaps",
    "ShrinkPolicy",
    "Stats",
    "Structures",
    "TightPolicy",
    "UnpaddedCompiled",
    "activate_dd_context",
    "bucket",
    "cap_agreement_group",
    "cap_agreement_over",
    "cap_ceilings",
    "compile_counted",
    "counting_backend",
    "current_dd_context",
    "default_store_dir",
    "derive_ceilings",
    "load_caps",
    "model_fingerprint",
    "record_resolutions",
    "resolve_adapter",
    "resolve_cap",
    "resolve_caps",
    "save_caps",
    "wrap",
]

# integrations that import optional packages (ase, torch-sim) load on first
# attribute access too: ``ddpad.ase.Calculator`` works without importing
# ``ddpad.ase`` first
_LAZY_MODULES = frozenset({"ase", "torchsim", "testing", "engines"})


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        return getattr(importlib.import_module(module, __name__), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_LAZY_MODULES})
