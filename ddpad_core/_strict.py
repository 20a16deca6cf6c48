"""Strict mode: a compile that no cap change or new call form explains is
reported (``on_recompile``) with Dynamo's own guard-failure reasons."""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Mapping
from typing import Any, Literal

import torch

__all__ = ["OnRecompile", "RecompileError", "call_form", "guard_failure_counts", "unexplained"]

OnRecompile = Literal["warn", "raise", "ignore"]


class RecompileError(RuntimeError):
    """A graph was compiled that no capacity change explains (strict mode)."""


def call_form(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """The non-tensor arguments of a call: a new form compiles a new graph."""
    if not args and not kwargs:
        return ()
    return (
        tuple(None if isinstance(a, torch.Tensor) else repr(a) for a in args),
        tuple(sorted((k, repr(v)) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))),
    )


# the last count of Dynamo's guard-failure reasons, and the frame counter it was taken at
_GUARD_FAILURES: contextvars.ContextVar[tuple[Any, int, dict[Any, int]] | None] = contextvars.ContextVar(
    "ddpad_guard_failures", default=None
)


def guard_failure_counts() -> Mapping[Any, int]:
    """Guard-failure reasons Dynamo recorded so far, per code object.

    Dynamo records them only while converting a frame, after counting the
    frame in ``counters["frames"]["total"]``; while that count (of the same
    counter object: ``counters.clear()`` replaces it) has not moved, the last
    count still holds, and a call costs two lookups instead of a scan.
    Before anything imported Dynamo there are none (and importing it, seconds,
    is left to what compiles: ``compile_mode="aot"`` may never need it)."""
    if "torch._dynamo" not in sys.modules:
        return {}
    utils = torch._dynamo.utils
    frames = utils.counters["frames"]
    total = frames["total"]
    last = _GUARD_FAILURES.get()
    if last is not None and last[0] is frames and last[1] == total:
        return last[2]
    counts = {code: len(reasons) for code, reasons in utils.guard_failures.items()}
    _GUARD_FAILURES.set((frames, total, counts))
    return counts


def _new_guard_failures(before: Mapping[Any, int]) -> list[str]:
    reasons: list[str] = []
    for code, listed in torch._dynamo.utils.guard_failures.items():
        reasons.extend(str(r) for r in listed[before.get(code, 0):])
    return reasons


def unexplained(call: int, graphs: int, failures_before: Mapping[Any, int]) -> str:
    """The message for call ``call``'s ``graphs`` compiles that no cap change
    explains, with the guard failures Dynamo recorded since ``failures_before``."""
    reasons = _new_guard_failures(failures_before) or ["(Dynamo gave no guard-failure reason)"]
    return (
        f"ddpad: call {call} compiled {graphs} graph(s) although no cap changed; "
        f"Dynamo's guard failure: {' | '.join(reasons)}. Something other than the "
        "padded shapes varies between calls (dtype, device, requires_grad, a Python "
        "argument, or an unpadded field)."
    )
