"""Optional, hysteretic cap shrinking."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ._capacity import CapResolution, TightCaps
from ._stats import CapEvent

__all__ = ["ShrinkPolicy", "Shrinker"]

log = logging.getLogger("ddpad")


@dataclass(frozen=True)
class ShrinkPolicy:
    """Optional, hysteretic cap shrinking (off unless passed to :func:`wrap`).

    A cap shrinks only after ``after`` consecutive calls in which its fill
    (agreed need / cap) stayed below ``below``; it then becomes
    ``policy.grow(max need over that stretch, factor)`` (under
    ``cap_policy="tight"``, the tight fit of that need), and only if that is
    smaller. Under an agreement group the needs are already MAX-reduced, so
    every rank sees the same fills and shrinks on the same call. A shrink
    costs a recompile unless that shape is still in Dynamo's cache; with
    ``when_it_pays`` (default) one that would compile is taken only when the
    step time it saves over another ``after`` calls exceeds the longest
    compile the model has paid (:class:`Shrinker`).
    """

    below: float = 0.5
    after: int = 1000
    factor: float = 1.15
    when_it_pays: bool = True

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
    :meth:`~ddpad.padding.CapPolicy.grow`, at the shrink's own factor; under a tight
    sizing, its fit).

    A shrink to caps whose graph is ready (they ran before, or are a rung)
    costs nothing and is taken: the smallest such caps that hold every need. One that would compile is taken only if it pays:
    the step time it saves (this call's, scaled by how much the cap shrinks)
    over another ``after`` calls must exceed the longest compile this model
    has paid; otherwise the streak starts over. Under an agreement group
    step times differ per rank, so there the agreed fills alone decide (every
    rank shrinks on the same call)."""

    def __init__(self, policy: ShrinkPolicy, sizer: TightCaps | None = None) -> None:
        self.policy = policy
        self.sizer = sizer
        self._low: dict[str, tuple[int, int]] = {}  # key -> (streak, max need)
        self.compile_seconds = 0.0  # the longest call that compiled, so far

    def observe(self, call: int, resolved: list[CapResolution], caps: dict[str, int], *,
                seconds: float | None = None, compiled: bool = False,
                ready: Callable[[], list[dict[str, int]]] | None = None, agreed: bool = False) -> list[CapEvent]:
        """Count call ``call``'s fills (the call took ``seconds``, and
        ``compiled`` when it compiled); shrink ``caps`` in place where a streak
        ended and the shrink is free (to caps among ``ready()``, whose graphs
        are ready) or pays, and return those shrinks."""
        if compiled and seconds is not None:
            self.compile_seconds = max(self.compile_seconds, seconds)
        policy, shrunk, highs = self.policy, {}, {}
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
            sizer = self.sizer
            tight = sizer is not None and sizer.changing is None  # a changing run shrinks as head room does
            new = sizer.policy.fit(r.policy, high) if tight else r.policy.grow(high, policy.factor)
            if new < caps[r.key]:
                shrunk[r.key], highs[r.key] = new, (r.real, high)
        if not shrunk:
            return []
        # the keys whose streaks ended on this call shrink together: one graph. Caps whose graph is
        # ready and hold every need (the stretch's highest for these keys) are free: the smallest wins
        needs = {r.key: (highs[r.key][1] if r.key in highs else r.need, r.policy) for r in resolved}
        fitting = [dict(c) for c in (ready() if ready is not None else [])
                   if all(k in c and p.fits(n, c[k]) for k, (n, p) in needs.items())
                   and sum(c.values()) < sum(caps.values())]
        free = bool(fitting)
        if free:
            smallest = min(fitting, key=lambda c: sum(c.values()))
            shrunk = {k: v for k, v in smallest.items() if v != caps.get(k)}
        saved = (seconds or 0.0) * (1.0 - max(new / caps[k] for k, new in shrunk.items())) * policy.after
        real = {r.key: r.real for r in resolved}
        if policy.when_it_pays and not (free or agreed or saved >= self.compile_seconds):
            log.info("fill below %.2f for %d calls, but shrinking %s would save about %.1f s over as many calls "
                     "against a %.1f s compile: kept", policy.below, policy.after,
                     ", ".join(f"{k} {caps[k]} -> {v}" for k, v in shrunk.items()), saved, self.compile_seconds)
            return []
        events = []
        for key, new in shrunk.items():
            if self.sizer is not None:
                self.sizer.refit(key)
            high = highs[key][1] if key in highs else needs[key][0]
            events.append(CapEvent(call, key, caps[key], new, real.get(key, 0), high))
            log.info("%s fill below %.2f for %d calls (max need %d): shrink %d -> %d, %s", key, policy.below,
                     policy.after, high, caps[key], new, "a ready graph" if free else "expect one recompile")
            caps[key] = new
        return events
