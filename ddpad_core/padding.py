"""The padding tier: what a padder, adapter or framework author builds on.

``import ddpad`` gives what a user of a model needs (``wrap``, the
engines, ``Stats``, the errors, caps files, the store). This module gives
the parts underneath, for code that pads a representation itself:

- the padder protocol (SPEC section 4): :class:`GraphPadder`;
- capacity (SPEC section 2): :func:`resolve_cap`, :func:`resolve_caps`
  (all of a step's keys in one exchange), :func:`bucket`,
  :class:`CapPolicy`, and the call scope a padder is handed
  (:class:`ScopedCaps`, :class:`CapScope`, :class:`CapResolution`);
- agreement across ranks (SPEC section 3) for a framework with its own
  reduction: :func:`cap_agreement_over`, :class:`Agreement` (the
  ``torch.distributed`` scope is :func:`ddpad.cap_agreement_group`);
- the built-in padders (SPEC section 6): :class:`COOPadder`,
  :class:`DensePadder`, :class:`DenseBatchPadder`, their base
  :class:`PadderBase` and fill markers :class:`Fill`, :data:`FillSpec`;
- the distributed context (SPEC section 7): :class:`DistributedContext`,
  :func:`current_dd_context`, :func:`activate_dd_context`,
  :data:`NOT_DISTRIBUTED`, :class:`HaloMeta`, :class:`GatherMeta`;
- an engine's tensor input, as adapters read it: :class:`Structures`,
  :class:`Composition`, :class:`NeighborList`;
- :func:`counting_backend`, for a framework that calls ``torch.compile``
  itself: each graph counted into a ``Stats`` and checked on its first call.
"""

from __future__ import annotations

from ._agreement import Agreement, cap_agreement_over
from ._capacity import CapPolicy, CapResolution, CapScope, ScopedCaps, bucket, resolve_cap, resolve_caps
from ._compile import counting_backend
from ._context import (
    NOT_DISTRIBUTED,
    DistributedContext,
    GatherMeta,
    HaloMeta,
    activate_dd_context,
    current_dd_context,
)
from ._padders import COOPadder, DenseBatchPadder, DensePadder, Fill, FillSpec, PadderBase
from ._protocol import GraphPadder
from ._structures import Composition, NeighborList, Structures

__all__ = [
    "NOT_DISTRIBUTED",
    "Agreement",
    "COOPadder",
    "CapPolicy",
    "CapResolution",
    "CapScope",
    "Composition",
    "DenseBatchPadder",
    "DensePadder",
    "DistributedContext",
    "Fill",
    "FillSpec",
    "GatherMeta",
    "GraphPadder",
    "HaloMeta",
    "NeighborList",
    "PadderBase",
    "ScopedCaps",
    "Structures",
    "activate_dd_context",
    "bucket",
    "cap_agreement_over",
    "counting_backend",
    "current_dd_context",
    "resolve_cap",
    "resolve_caps",
]
