"""The warm ladder: the first call also runs the compiled model at the next
rungs of caps, so that a later growth only switches to a ready graph.

The way a server captures its batch sizes before serving. Each rung runs
twice (its compile, then a steady call) and the run's own caps once more,
so that neither a growth's step nor the next step is the first steady call
after a compile (which costs about three steady calls).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from ._capacity import CapResolution, TightCaps
from ._ladder import Ladder, ladder

__all__ = ["warm", "warm_rungs"]

log = logging.getLogger("ddpad")


def warm_rungs(caps: Mapping[str, int], resolved: list[CapResolution], count: int,
               ceilings: Mapping[str, int], sizer: TightCaps | None = None) -> list[dict[str, int]]:
    """The next ``count`` rungs above ``caps`` that stay within ``ceilings``
    (a tight sizing's fine rungs with ``sizer``)."""
    return [rung for rung in ladder(caps, resolved, count, sizer)
            if all(rung[k] <= ceilings.get(k, rung[k]) for k in rung)]


def warm(rungs: list[dict[str, int]], caps: Mapping[str, int], step: Callable[[Mapping[str, int]], None],
         into: Ladder) -> list[dict[str, int]]:
    """Run ``step`` at every rung (twice) and at ``caps`` (once); each rung
    that ran is added to ``into``. A step that raises ends the ladder with a
    warning: the first call's own result stands, and growths past the last
    warmed rung compile when they come. Returns the warmed rungs."""
    warmed = []
    for rung in rungs:
        if not (_try(step, rung) and _try(step, rung)):
            break
        into.add(rung, "warm")
        warmed.append(rung)
        log.info("warmed caps %s", rung)
    _try(step, caps)
    return warmed


def _try(step: Callable[[Mapping[str, int]], None], caps: Mapping[str, int]) -> bool:
    try:
        step(caps)
    except Exception as exc:  # noqa: BLE001 - reported; the run goes on
        log.warning("ddpad: warming caps %s failed (%s: %s); no rung from there up is warmed", dict(caps),
                    type(exc).__name__, exc)
        return False
    return True
