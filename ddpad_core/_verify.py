"""First-use checks: a compiled step's numbers are compared with the eager
step's before anyone sees them.

Every compiled graph (a ``torch.compile`` graph or an ahead-of-time package)
runs its first call at given caps and call form beside the eager model on the
same padded input; outputs must agree within the tolerance of the least
precise floating dtype at work. A disagreement returns the eager result, and
that route is not used again for those caps and call form (a package falls
back to ``torch.compile``, ``torch.compile`` to the eager step), with one
warning. One eager step per compiled graph is the whole cost: nothing is
checked on a steady call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ._stats import Stats

__all__ = ["check", "disagreement", "fresh"]


# relative tolerance of a check, by the least precise dtype at work: a compiler
# may fuse and reorder floating-point work the eager step does in order
_RTOL = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def disagreement(out: Any, ref: Any, model: torch.nn.Module | None = None) -> str | None:
    """None when every output of ``out`` matches ``ref``'s (the eager step's)
    within the tolerance of the least precise floating dtype among the
    outputs and ``model``'s parameters (a float32 model's float64 outputs
    carry float32 work), else what differed."""
    got, want = pytree.tree_flatten(out)[0], pytree.tree_flatten(ref)[0]
    if len(got) != len(want):
        return f"{len(got)} outputs, the eager step {len(want)}"
    dtypes = {x.dtype for x in want if isinstance(x, torch.Tensor) and x.is_floating_point()}
    dtypes |= {p.dtype for p in (model.parameters() if model is not None else ()) if p.is_floating_point()}
    rtol = max((_RTOL.get(dtype, 1e-4) for dtype in dtypes), default=1e-4)
    for i, (a, b) in enumerate(zip(got, want)):
        if not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {i}: {a!r} != {b!r}"
            continue
        if not isinstance(a, torch.Tensor):
            return f"output {i}: {type(a).__name__}, the eager step a tensor"
        a, b = a.detach(), b.detach()
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: {tuple(a.shape)} {a.dtype}, the eager step {tuple(b.shape)} {b.dtype}"
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return f"output {i} differs"
            continue
        scale = float(b.abs().max()) if b.numel() else 0.0
        tol = rtol * max(scale, 1.0)
        worst = float((a - b).abs().max()) if b.numel() else 0.0
        if not worst <= tol:  # (NaN fails too)
            return f"output {i}: max deviation {worst:.3g} > {tol:.3g}"
    return None


def check(stats: Stats, model: torch.nn.Module, out: Any, eager: Callable[[], Any]) -> tuple[Any, str | None]:
    """One first-use check: ``eager()``'s result (the eager step on the input
    the compiled step had) and what of ``out`` disagreed with it (None: all
    agreed), counted and timed in ``stats``."""
    t0 = time.perf_counter()
    ref = eager()
    why = disagreement(out, ref, model)
    stats.checks += 1
    stats.disagreements += why is not None
    stats.check_seconds += time.perf_counter() - t0
    return ref, why


def fresh(data: Any) -> Any:
    """``data`` with new containers (dicts, lists, tuples) around the same
    tensors: a model that writes into its input dict (aimnet adds its
    intermediates to it) must not hand one route's autograd graph to the next."""
    return pytree.tree_map(lambda leaf: leaf, data)
