"""Optional, hysteretic cap shrinking."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ._capacity import CapResolution
from ._stats import CapEvent

__all__ = ["ShrinkPolicy", "Shrinker"]

log = logging.getLogger("ddpad")


@dataclass(frozen=True)
class ShrinkPolicy:
    """Optional, hysteretic cap shrinking (off unless passed to :func:`wrap`).

    A cap shrinks only after ``after`` consecutive calls in which its fill
    (agreed need / cap) stayed below ``below``; it then becomes
    ``policy.grow(max need over that stretch, factor)``, and only if that is
    smaller. Under an agreement group the needs are already MAX-reduced, so
    every rank sees the same fills and shrinks on the same call. A shrink
    costs a recompile unless that shape is still in Dynamo's cache.
    """

    below: float = 0.5
    after: int = 1000
    factor: float = 1.15

    def __post_init__(self) -> None:
        if not 0.0 < self.below < 1.0:
            raise ValueError(f"below must be in (0, 1), got {self.below!r}")
        if self.after < 1:
            raise ValueError(f"after must be >= 1, got {self.after!r}")
        if self.factor < 1.0:
            raise ValueError(f"factor must be >= 1.0, got {self.factor!r}")


class Shrinker:
    """Tracks each key's low-fill streak under a :class:`ShrinkPolicy` and
    says when a cap shrinks (through the policy's one growth rule,
    :meth:`~ddpad.CapPolicy.grow`, at the shrink's own factor)."""

    def __init__(self, policy: ShrinkPolicy) -> None:
        self.policy = policy
        self._low: dict[str, tuple[int, int]] = {}  # key -> (streak, max need)

    def observe(self, call: int, resolved: list[CapResolution], caps: dict[str, int]) -> list[CapEvent]:
        """Count call ``call``'s fills; shrink ``caps`` in place where a streak
        ended, and return those shrinks."""
        policy, events = self.policy, []
        for r in resolved:
            streak, high = self._low.get(r.key, (0, 0))
            if r.cap and r.need / r.cap < policy.below:
                streak, high = streak + 1, max(high, r.need)
            else:
                streak, high = 0, 0
            self._low[r.key] = (streak, high)
            if streak < policy.after:
                continue
            self._low[r.key] = (0, 0)
            new = r.policy.grow(high, policy.factor)
            if new < caps[r.key]:
                event = CapEvent(call, r.key, caps[r.key], new, r.real, high)
                events.append(event)
                caps[r.key] = new
                log.info(
                    "%s fill below %.2f for %d calls (max need %d): shrink %d -> %d, expect one recompile",
                    r.key, policy.below, policy.after, high, event.old, new,
                )
        return events
