"""ddpad: keep torch.compile'd interatomic potentials on one compiled graph.

Pads every step's graph to fixed, grow-only, bucketed capacities with inert
dead atoms and edges, and grows those capacities in lockstep across ranks.
"""

from ._capacity import (
    Agreement,
    AgreementError,
    CapacityError,
    CapPolicy,
    CapResolution,
    bucket,
    cap_agreement_group,
    cap_agreement_over,
    cap_ceilings,
    record_resolutions,
    resolve_cap,
    resolve_caps,
)
from ._context import (
    NOT_DISTRIBUTED,
    DistributedContext,
    GatherMeta,
    HaloMeta,
    activate_dd_context,
    current_dd_context,
)
from ._padders import COOPadder, DenseBatchPadder, DensePadder, Fill, FillSpec
from ._protocol import GraphPadder
from ._runtime import (
    CapEvent,
    Evaluator,
    PaddedModel,
    RecompileError,
    ShrinkPolicy,
    Stats,
    UnpaddedCompiled,
    compile_counted,
    counting_backend,
    derive_ceilings,
    load_caps,
    resolve_adapter,
    save_caps,
    wrap,
)
from ._store import CompileStore, default_store_dir, model_fingerprint

__version__ = "0.1.0"

__all__ = [
    "NOT_DISTRIBUTED",
    "Agreement",
    "AgreementError",
    "COOPadder",
    "CapEvent",
    "CapPolicy",
    "CapResolution",
    "CapacityError",
    "CompileStore",
    "DenseBatchPadder",
    "DensePadder",
    "DistributedContext",
    "Evaluator",
    "Fill",
    "FillSpec",
    "GatherMeta",
    "GraphPadder",
    "HaloMeta",
    "PaddedModel",
    "RecompileError",
    "ShrinkPolicy",
    "Stats",
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


# Integrations that import optional packages (ase, torch-sim) load on first
# attribute access, so ``import ddpad`` stays torch-only and
# ``ddpad.ase.Calculator`` works without importing ``ddpad.ase`` first.
_LAZY_MODULES = frozenset({"ase", "torchsim", "testing", "engines"})


def __getattr__(name: str) -> object:
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
