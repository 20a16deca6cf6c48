"""The warm ladder's rungs and the single owner of ready caps.

A *rung* is a set of caps one growth ahead of the current ones: every count
that grows with the system (atoms, edges, a dense padder's neighbour
columns: every key but ``systems``, the number of systems, which a growing
system keeps) one :meth:`~ddpad.padding.CapPolicy.grow` up. :class:`Ladder` holds the
caps whose graphs are ready (warmed by the first call) or being compiled (a
background worker); a growth takes the smallest that fits
(:mod:`._capacity`'s ready-rung choice) and the ladder counts it. Under a
tight sizing (:class:`~ddpad._capacity.TightCaps`) each rung is one tight growth up,
in the fine strides a growth of that model would take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

from ._capacity import CapResolution, TightCaps

__all__ = ["Ladder", "ladder", "next_caps"]

Source = Literal["warm", "background"]
_Key = tuple[tuple[str, int], ...]


def next_caps(caps: Mapping[str, int], r: CapResolution, sizer: TightCaps | None = None,
              ahead: int = 0) -> dict[str, int]:
    """``caps`` with ``r.key`` at the cap its first overflow would grow it to
    (by ``sizer``'s tight growth, ``ahead`` growths on, when there is one)."""
    policy = r.policy
    need = policy.overflow(r.cap)
    grown = policy.grow(need) if sizer is None or not sizer.settled else sizer.grown(r.key, policy, need, ahead)
    if policy.max_cap is not None:
        grown = min(grown, policy.max_cap)
    return {**caps, r.key: grown}


def ladder(caps: Mapping[str, int], resolved: list[CapResolution], rungs: int,
           sizer: TightCaps | None = None) -> list[dict[str, int]]:
    """The next ``rungs`` caps of a growing system: each rung one growth up in
    every count that grows with it (every key but ``systems``), the other
    keys as they are; it ends where every scaling key is at its ceiling.

    A growth takes the smallest rung that fits all its needs, so the rungs
    serve whichever key overflows first and however fast the edges grow
    against the atoms. Built from caps and needs only (agreed ones under an
    agreement group)."""
    scaled = [r for r in resolved if r.key != "systems" and r.need > 0]
    current, out = dict(caps), []
    for step in range(rungs if scaled else 0):
        for r in scaled:
            current = next_caps(current, dataclasses.replace(r, cap=current[r.key]), sizer, step)
        if current == (out[-1] if out else caps):  # every scaling key at its ceiling
            break
        out.append(dict(current))
    return out


class Ladder:
    """Caps whose graphs are ready or being compiled, and what became of them.

    The warm ladder (:mod:`._warm`) and background workers
    (:mod:`._background`) :meth:`add` caps; a growth reads :attr:`ready`
    (through the call's scope) and :meth:`count_use` records that it took
    one. The counts are read by :class:`~ddpad.Stats`.
    """

    def __init__(self) -> None:
        self._ready: list[dict[str, int]] = []
        self._sources: dict[_Key, Source] = {}
        self._used: set[_Key] = set()
        self.uses = 0  # growths that took a ready rung
        self.background_wasted = 0  # background rungs no growth reached, counted at close

    @property
    def ready(self) -> list[dict[str, int]]:
        """Every rung added so far, in order (the list a call's scope reads)."""
        return self._ready

    def add(self, caps: Mapping[str, int], source: Source) -> None:
        """Make ``caps`` a rung a growth may take."""
        key = tuple(sorted(caps.items()))
        if key not in self._sources:
            self._sources[key] = source
            self._ready.append(dict(caps))

    def has(self, caps: Mapping[str, int]) -> bool:
        """Whether ``caps`` is a rung (of any source)."""
        return tuple(sorted(caps.items())) in self._sources

    def count_use(self, caps: Mapping[str, int]) -> None:
        """A growth landed on ``caps``: count it if they are a rung."""
        key = tuple(sorted(caps.items()))
        if key in self._sources:
            self.uses += 1
            self._used.add(key)

    def close_background(self) -> None:
        """The background compiles are over: count those no growth reached."""
        self.background_wasted = self.count("background", used=False)

    def count(self, source: Source, *, used: bool | None = None) -> int:
        """Rungs of ``source`` (only those a growth reached, or did not, with ``used``)."""
        return sum(1 for key, s in self._sources.items()
                   if s == source and (used is None or (key in self._used) == used))
