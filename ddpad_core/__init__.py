"""ddpad: keep torch.compile'd interatomic potentials on one compiled graph.

Pads every step's graph to fixed, grow-only, bucketed capacities with inert
dead atoms and edges, and grows those capacities in lockstep across ranks.
"""

from ._capacity import (
    Agreement,
    CapPolicy,
    CapResolution,
    bucket,
    cap_agreement_group,
    cap_agreement_over,
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
    load_caps,
    resolve_adapter,
    save_caps,
    wrap,
)

__version__ = "0.1.0"

__all__ = [
    "NOT_DISTRIBUTED",
    "Agreement",
    "COOPadder",
    "CapEvent",
    "CapPolicy",
    "CapResolution",
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
    "compile_counted",
    "counting_backend",
    "current_dd_context",
    "load_caps",
    "record_resolutions",
    "resolve_adapter",
    "resolve_cap",
    "resolve_caps",
    "save_caps",
    "wrap",
]
