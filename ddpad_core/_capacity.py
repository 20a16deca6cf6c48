"""Capacity policy: grow-only, bucketed caps, agreed across ranks in one collective.

See SPEC section 2 (the formula and its reference values) and section 3
(agreement, :mod:`._agreement`). Capacities live in a plain ``dict[str, int]``
the caller owns. :meth:`CapPolicy.grow` is the one growth rule: resolution,
the warm ladder's rungs and shrinking all size a cap through it.
:class:`TightPolicy` (``cap_policy="tight"``) is the policy beside it: caps
fitted to the needs a run has seen, in fine strides (:class:`TightCaps`
holds one model's observations).
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

from ._agreement import _AGREEMENT, Agreement

__all__ = [
    "CapPolicy",
    "CapResolution",
    "CapScope",
    "CapacityError",
    "ScopedCaps",
    "TightCaps",
    "TightPolicy",
    "bucket",
    "resolve_cap",
    "resolve_caps",
]

log = logging.getLogger("ddpad")

# Floor of x * f is taken after adding this, so that 100 * 1.15 counts as 115
# and not 114.99999999999999.
_FLOOR_EPS = 1e-9


class CapacityError(RuntimeError):
    """A real count needs a cap beyond its ceiling, or a step that grew a cap
    failed (the caps were rolled back). The message names the cap, its size
    and the real count that asked for it."""


def _as_count(name: str, value: Any) -> int:
    """Return ``value`` as a non-negative int, or raise ``ValueError`` naming it."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer count, got bool {value!r}")
    try:
        count = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be an integer count, got {type(value).__name__} {value!r}"
        ) from None
    if count < 0:
        raise ValueError(f"{name} must be >= 0, got {count}")
    return count


@dataclass(frozen=True)
class CapPolicy:
    """How one capacity key is sized and grown.

    Parameters
    ----------
    initial_factor
        Head room on first sight of the key (``>= 1``).
    grow_factor
        Head room when the need overflows the cap (``>= 1``).
    stride
        Caps are multiples of this (``>= 1``).
    extra
        Slots reserved on top of the real count (e.g. 2 for an anchor pair).
    strict_gt
        Overflow when ``need > cap`` (True) or ``need >= cap`` (False; atoms,
        whose dead atom sits at ``cap - 1`` and must not collide with a real one).
    max_cap
        Ceiling of the cap (None: none). A growth stops at the ceiling; a need
        the ceiling cannot hold raises :class:`CapacityError`.
    """

    initial_factor: float
    grow_factor: float = 1.30
    stride: int = 16
    extra: int = 0
    strict_gt: bool = True
    max_cap: int | None = None

    def __post_init__(self) -> None:
        for name in ("initial_factor", "grow_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number >= 1.0, got {value!r}")
            if not math.isfinite(value) or value < 1.0:
                raise ValueError(f"{name} must be >= 1.0, got {value!r}")
        stride = _as_count("stride", self.stride)
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        _as_count("extra", self.extra)
        if self.max_cap is not None and _as_count("max_cap", self.max_cap) < 1:
            raise ValueError(f"max_cap must be >= 1, got {self.max_cap}")

    def fits(self, need: int, cap: int) -> bool:
        """True when ``need`` rows fit a cap of ``cap`` (no overflow)."""
        return need < cap or (need == cap and self.strict_gt)

    def initial(self, need: int) -> int:
        """The cap on first sight of ``need`` rows: ``bucket(need, initial_factor)``."""
        return bucket(need, self.initial_factor, self.stride)

    def grow(self, need: int, factor: float | None = None) -> int:
        """The cap ``need`` rows grow to once they overflow their cap:
        ``max(stride, bucket(need, factor))``, ``factor`` defaulting to
        ``grow_factor``. The one growth rule: resolution, the warm ladder's
        rungs (:mod:`._ladder`) and shrinking (:mod:`._shrink`, with its own
        factor) all call it, so they cannot drift apart."""
        return max(self.stride, bucket(need, self.grow_factor if factor is None else factor, self.stride))

    def overflow(self, cap: int) -> int:
        """The smallest need that overflows ``cap``."""
        return cap + 1 if self.strict_gt else cap


@dataclass(frozen=True)
class TightPolicy:
    """``cap_policy="tight"``: caps that settle close to the need.

    A run starts at each padder's own caps (:meth:`CapPolicy.initial`: head
    room while nothing is known), watches its needs for ``settle`` calls,
    running them on the eager step (a graph compiled at caps about to be
    fitted would serve no later call), and then fits every cap to the
    highest need it saw, and compiles there: that need times
    ``1 + margin`` for a count that moved in the window (edges), the need
    itself for one that held still over two calls or more (an MD run's
    atoms), rounded up to a fine
    stride (a power of two no larger than ``need * margin / 2``, nor than the
    padder's own stride). A growth before the window ends fits the caps at
    once. After that a need past its cap grows it by a small step, twice
    the margin, doubling with each further growth of that key (a system that
    keeps growing soon grows in the padder's own steps, not in a compile per
    two per cent), never beyond :meth:`CapPolicy.grow`.

    A window whose needs swung by more than ``changing`` (a key's highest
    need over its lowest, minus one: the atom count of a run that inserts
    and deletes atoms, a batch whose systems come and go; an MD run's edges
    swing by well under it) is a changing run: its caps are kept where they
    are, at head room, and grow as head room's do, for a fit down would be
    paid for in a compile per growth that follows.

    Parameters
    ----------
    settle
        Calls watched before the caps are fitted (``>= 1``; 1 fits them on
        the first call, as ``ddpad precompile`` does).
    margin
        Head room over the highest need of a count that moved (``[0, 0.25]``).
    changing
        The swing over the window that makes a run a changing one (``>=
        0``; ``math.inf``: none does, the caps are always fitted; 0.04 by default: measured on a 64-atom MACE diamond cell, its
        edges swung 0.3 % over ten Langevin steps at 300 K and 2-3 % at
        1000 K; one insertion among 64 atoms moves its edges 5 %).
    """

    settle: int = 10
    margin: float = 0.02
    changing: float = 0.04

    def __post_init__(self) -> None:
        if isinstance(self.settle, bool) or not isinstance(self.settle, int) or self.settle < 1:
            raise ValueError(f"settle must be a number of calls >= 1, got {self.settle!r}")
        margin = self.margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0.0 <= margin <= 0.25:
            raise ValueError(f"margin must be a fraction in [0, 0.25], got {margin!r}")
        changing = self.changing
        if isinstance(changing, bool) or not isinstance(changing, (int, float)) or not 0.0 <= changing:
            raise ValueError(f"changing must be a fraction >= 0 (math.inf: never), got {changing!r}")

    def fit(self, policy: CapPolicy, need: int, margin: float | None = None) -> int:
        """The tight cap of ``need`` rows: the smallest multiple of the fine
        stride that holds ``need * (1 + margin)`` rows without overflow,
        ``margin`` defaulting to the policy's."""
        margin = self.margin if margin is None else margin
        room = int(need * self.margin / 2)  # a stride under half the margin keeps fill >= 1 / (1 + 2 margin)
        stride = min(policy.stride, 1 << (room.bit_length() - 1)) if room else 1
        # the smallest cap that holds need * (1 + margin) rows: that many for a
        # strict key (edges), one more where the dead row sits at cap - 1 (atoms)
        rows = math.floor(need * (1.0 + margin) + _FLOOR_EPS) + (0 if policy.strict_gt else 1)
        return stride * -(-max(rows, 1) // stride)

    def grow(self, policy: CapPolicy, need: int, growths: int) -> int:
        """The cap ``need`` rows grow to after ``growths`` earlier growths of
        their key since the caps were fitted: a fit at ``2 ** (growths + 1)``
        margins, at most the padder's own growth (:meth:`CapPolicy.grow`)."""
        margin = min(self.margin * 2 ** (growths + 1), policy.grow_factor - 1.0)
        return min(self.fit(policy, need, margin), policy.grow(need))


class TightCaps:
    """One wrapped model's tight sizing: the needs seen, whether the caps
    are fitted, each key's growths since. Read by :func:`resolve_caps`
    inside the model's call scope; written by :meth:`observe` only after a
    call succeeded (a call that raises leaves it as it was). Under an
    agreement group the needs are the agreed (MAX) ones and the window counts
    calls, so every rank fits the same caps on the same call."""

    __slots__ = ("changing", "growths", "high", "low", "policy", "settled", "watched")

    def __init__(self, policy: TightPolicy, *, settled: bool = False) -> None:
        self.policy = policy
        self.settled = settled  # True for preset caps (a caps file): they are already fitted
        self.changing: str | None = None  # at the fit: why the run is a changing one (its caps kept)
        self.watched = 0  # calls observed before the fit
        self.high: dict[str, int] = {}
        self.low: dict[str, int] = {}
        self.growths: dict[str, int] = {}

    @property
    def due(self) -> bool:
        """Whether the next call fits the caps (the window ends with it)."""
        return not self.settled and self.watched + 1 >= self.policy.settle

    def settling(self, rows: Sequence[tuple[str, int, int | None, CapPolicy]]) -> bool:
        """Whether this call fits the caps: the window ends, or a need
        overflows its cap before it does (``rows``: key, need, cap, policy)."""
        return not self.settled and (self.due or any(
            cap is not None and not policy.fits(need, cap) for _, need, cap, policy in rows))

    def watching(self, rows: Sequence[Any]) -> bool:
        """Whether a call with scope rows ``rows`` (:class:`Row`) is one of
        the window's before the fit: it runs the eager step, for nothing
        compiled at caps the fit is about to change is used again."""
        return not self.settled and not self.settling([(r.key, r.need, r.old, r.policy) for r in rows])

    def swing(self, needs: Sequence[tuple[str, int]]) -> str | None:
        """Why a fit with this call's ``needs`` (key, need) finds a changing
        run ("edges swung 5.3 % over 10 calls"), or None for a steady one."""
        worst, why = self.policy.changing, None
        for key, need in needs:
            high, low = max(need, self.high.get(key, need)), min(need, self.low.get(key, need))
            swing = high / low - 1.0 if low else 0.0
            if swing > worst:
                worst, why = swing, f"{key} swung {100 * swing:.1f} % over {self.watched + 1} calls"
        return why

    def fitted(self, key: str, policy: CapPolicy, need: int, old: int | None) -> int:
        """``key``'s cap when the caps are fitted: to the highest need seen
        (this call's included), never above a cap that still holds it."""
        high, low = max(need, self.high.get(key, need)), min(need, self.low.get(key, need))
        still = key in self.high and high == low  # held still over two calls at least; one call says nothing
        cap = self.policy.fit(policy, high, 0.0 if still else None)
        return cap if old is None or not policy.fits(need, old) else min(cap, old)

    def grown(self, key: str, policy: CapPolicy, need: int, ahead: int = 0) -> int:
        """The cap a need past ``key``'s fitted cap grows to (``ahead``: as
        if that many growths came first, for rungs up the ladder); head
        room's growth in a changing run."""
        if self.changing is not None:
            return policy.grow(need)
        return self.policy.grow(policy, need, self.growths.get(key, 0) + ahead)

    def observe(self, rows: Sequence[tuple[Any, ...]]) -> bool:
        """A successful call's scope rows ``(key, real, need, old, cap,
        policy)``; True when it fitted the caps."""
        settles = self.settling([(key, need, old, policy) for key, _, need, old, _, policy in rows])
        if settles:
            self.changing = self.swing([(key, need) for key, _, need, _, _, _ in rows])
        if not self.settled:
            self.watched += 1
            for key, _, need, _, _, _ in rows:
                self.high[key] = max(need, self.high.get(key, need))
                self.low[key] = min(need, self.low.get(key, need))
        else:
            for key, _, _, old, cap, _ in rows:
                if old is not None and cap > old:
                    self.growths[key] = self.growths.get(key, 0) + 1
        self.settled = self.settled or settles
        return settles

    def observe_call(self, rows: Sequence[Any]) -> bool:
        """:meth:`observe` a successful call's rows where they matter: while
        the caps settle, or when a cap changed; True on the call that fits."""
        if self.settled and all(r.old == r.cap for r in rows):
            return False
        return self.observe(rows)

    def refit(self, key: str) -> None:
        """``key``'s cap shrank to a fit: its growths start over."""
        self.growths.pop(key, None)


def bucket(x: int, factor: float, stride: int) -> int:
    """``stride * ceil((floor(x * factor) + 1) / stride)``: the next bucket above ``x * factor``."""
    grown = math.floor(x * factor + _FLOOR_EPS) + 1
    return stride * -(-grown // stride)


@dataclass(frozen=True)
class CapResolution:
    """One key resolved on one call: what was asked and what came out.

    ``real`` is this process's count, ``need`` the (agreed) count plus
    ``extra`` that the cap was sized for. ``old_cap`` is ``None`` on first
    sight. ``grew`` is true when the cap changed (first sight included).
    """

    key: str
    real: int
    need: int
    old_cap: int | None
    cap: int
    policy: CapPolicy

    @property
    def grew(self) -> bool:
        return self.old_cap != self.cap


_row = tuple.__new__  # a Row without NamedTuple's Python-level __new__ (the steady path: every key, every call)


class Row(NamedTuple):
    """One key resolved on one call, as a call's scope records it: a
    :class:`CapResolution`'s fields in a tuple (no object per key and call
    on the steady path), made into one only where a caller asks for them."""

    key: str
    real: int
    need: int
    old: int | None
    cap: int
    policy: CapPolicy


_NO_CEILINGS: Mapping[str, int] = MappingProxyType({})


def checked_ceilings(ceilings: Mapping[str, int] | None) -> Mapping[str, int]:
    """``ceilings`` validated (every value a count >= 1), read-only."""
    for key, value in (ceilings or {}).items():
        if _as_count(f"ceiling of {key!r}", value) < 1:
            raise ValueError(f"ceiling of {key!r} must be >= 1, got {value}")
    return MappingProxyType(dict(ceilings or {}))


class CapScope:
    """What one call resolves its caps under, and what it resolved.

    A :class:`~ddpad.PaddedModel` call makes one and hands it to its padder
    on the caps themselves (:class:`ScopedCaps`), so a padder's
    :func:`resolve_caps` reads it from the ``cap_state`` it was given, not
    from ambient state.

    Parameters
    ----------
    ceilings
        Per-key cap ceilings (validated: :func:`checked_ceilings`), on top of
        each policy's ``max_cap``; None or empty: none.
    rungs
        Caps whose graphs are ready (warmed, or compiling in a background
        worker): a growth takes the smallest that fits every need instead of
        its own buckets.
    sizer
        The model's tight sizing (``cap_policy="tight"``), or None for its
        padders' own policies.

    Attributes
    ----------
    rows
        Every key resolved in the scope, one :class:`Row` each, in order.
    """

    __slots__ = ("ceilings", "rows", "rungs", "sizer")

    def __init__(self, ceilings: Mapping[str, int] | None = None, rungs: Sequence[Mapping[str, int]] = (),
                 sizer: TightCaps | None = None) -> None:
        self.ceilings = ceilings or None
        self.rungs = rungs
        self.sizer = sizer
        self.rows: list[Row] = []

    @property
    def resolutions(self) -> list[CapResolution]:
        """Every key resolved in the scope, as public records, in order."""
        return resolutions(self.rows)


class ScopedCaps(dict[str, int]):
    """A call's caps (the ``cap_state`` a padder grows in place, SPEC section
    4's signature unchanged) with the :class:`CapScope` they resolve under."""

    __slots__ = ("scope",)

    def __init__(self, caps: Mapping[str, int], scope: CapScope) -> None:
        super().__init__(caps)
        self.scope = scope


def resolutions(rows: list[Row]) -> list[CapResolution]:
    """The :class:`CapResolution` of each row a :class:`CapScope` recorded."""
    return [CapResolution(*row) for row in rows]


def _ceiling(key: str, policy: CapPolicy, scoped: Mapping[str, int]) -> int | None:
    limit, other = policy.max_cap, scoped.get(key)
    if limit is None or (other is not None and other < limit):
        return other
    return limit


def resolve_caps(
    state: dict[str, int], requests: Mapping[str, tuple[int, CapPolicy]]
) -> dict[str, int]:
    """Resolve several capacity keys at once: one collective for all of them.

    Parameters
    ----------
    state
        The caller's caps, updated in place (grow-only) once every key
        resolved. A :class:`ScopedCaps` (what a wrapped model's call hands its
        padder) resolves under its scope's ceilings, ready rungs and tight
        sizing, and records its rows there (nothing ambient); a plain dict
        under none of them (only each policy's ``max_cap``).
    requests
        ``{key: (real_count, policy)}``.

    Returns
    -------
    dict[str, int]
        The cap of every requested key.

    Raises
    ------
    CapacityError
        When a need exceeds its ceiling (``CapPolicy.max_cap`` or the
        scope's); ``state`` is left unchanged.
    """
    scope = state.scope if type(state) is ScopedCaps else None
    agreement = _AGREEMENT.get()
    if scope is None:
        ceilings, rungs, sizer = _NO_CEILINGS, (), None
    else:
        ceilings, rungs, sizer = scope.ceilings or _NO_CEILINGS, scope.rungs, scope.sizer
    steady = agreement is None and (sizer is None or not sizer.due)  # (a due fit takes the general path)
    rows = _steady(state, requests, ceilings) if steady else None
    if rows is None:
        rows = _resolve(state, requests, agreement, ceilings, sizer, rungs)
    if scope is not None:
        scope.rows.extend(rows)
    return {row.key: row.cap for row in rows}


def _steady(
    state: Mapping[str, int], requests: Mapping[str, tuple[int, CapPolicy]], ceilings: Mapping[str, int]
) -> list[Row] | None:
    """The rows of a call that changes nothing (every key known, within its
    ceiling, its need fitting its cap: nearly every call), or None."""
    rows = []
    for key, (real, policy) in requests.items():
        cap = state.get(key)
        if cap is None or type(real) is not int or real < 0:  # new key, or a count to check
            return None
        need = real + policy.extra
        if need > cap or (need == cap and not policy.strict_gt):
            return None
        ceiling = _ceiling(key, policy, ceilings)
        if ceiling is not None and cap > ceiling:
            return None
        rows.append(_row(Row, (key, real, need, cap, cap, policy)))
    return rows


def _resolve(
    state: dict[str, int], requests: Mapping[str, tuple[int, CapPolicy]], agreement: Agreement | None,
    ceilings: Mapping[str, int], sizer: TightCaps | None = None, rungs: Sequence[Mapping[str, int]] = (),
) -> list[Row]:
    """Resolve every key (SPEC sections 2 and 3): the general path; under a
    tight sizing (``sizer``) a fit or a growth takes its sizes."""
    keys = list(requests)
    reals = [_as_count(f"real (key {k!r})", requests[k][0]) for k in keys]
    policies = [requests[k][1] for k in keys]
    needs = [r + p.extra for r, p in zip(reals, policies)]
    current = dict(state)
    limits = own = [_ceiling(key, policy, ceilings) for key, policy in zip(keys, policies)]
    if agreement is not None and keys:
        # the smallest ceiling of any rank holds on every rank: all resolve the same caps
        needs, agreed, limits = agreement.exchange(keys, needs, [state.get(k, 0) for k in keys], limits)
        for key, cap in zip(keys, agreed):
            if cap > current.get(key, 0):  # a peer's cap (loaded or grown) is larger
                current[key] = cap
    rows: list[Row] = []
    # (a changing run's window ends on the head-room path: its caps are kept, or grow as head room's)
    fitting = sizer is not None and sizer.settling(
        [(key, need, current.get(key), policy) for key, need, policy in zip(keys, needs, policies)]
    ) and sizer.swing(list(zip(keys, needs))) is None
    for key, real, need, policy, ceiling, mine in zip(keys, reals, needs, policies, limits, own):
        old = current.get(key)
        if fitting:
            assert sizer is not None
            cap = sizer.fitted(key, policy, need, old)
        elif old is None:
            cap = policy.initial(need)
        elif not policy.fits(need, old):
            cap = policy.grow(need) if sizer is None or not sizer.settled else sizer.grown(key, policy, need)
        else:
            cap = old
        if ceiling is not None and cap > ceiling:
            if not policy.fits(need, ceiling):
                raise CapacityError(
                    f"ddpad: {key!r} needs {need} rows (real {real}"
                    + (f" + {policy.extra} reserved" if policy.extra else "")
                    + f") but its ceiling is {ceiling}"
                    + (f" (another rank's: the smallest holds on every rank; this rank's is {mine})"
                       if mine != ceiling else "")
                    + "; raise the ceiling (max_caps / memory_budget) or split the system"
                )
            cap = max(ceiling, old or 0)
        rows.append(Row(key, real, need, state.get(key), cap, policy))
    # never under an agreement: every rank sizes its caps from the agreed needs alone
    # (not for a fit: the ready rungs sit above the caps it fits down)
    rung = _ready_rung(rows, current, ceilings, rungs) if agreement is None and not fitting else None
    if rung is not None:
        rows = [row._replace(cap=rung[row.key]) for row in rows]
    for key, _, need, old, cap, policy in rows:
        if fitting and old is not None and cap != old:
            log.info("%s cap %d fitted to %d (the needs seen so far), expect one recompile", key, old, cap)
        elif old is not None and cap != old:
            relation = ">" if need > old else ">="
            log.info("%s %d %s cap %d: grow to %d, expect one recompile", key, need, relation, old, cap)
        state[key] = cap
    return rows


def _ready_rung(rows: list[Row], current: Mapping[str, int], ceilings: Mapping[str, int],
                rungs: Sequence[Mapping[str, int]]) -> Mapping[str, int] | None:
    """The smallest ready rung a growth among ``rows`` can take: one that
    holds every key, each at least its current cap, fitting its need and
    within its ceiling (a need often overflows by more than a stride, so its
    own bucket would miss the rung's graph); None when nothing grew."""
    if not any(old is not None and cap != old for _, _, _, old, cap, _ in rows):
        return None
    fitting = [
        rung for rung in rungs
        if all(rung.get(k, -1) >= c for k, c in current.items())
        and all(k in rung and p.fits(need, rung[k]) and rung[k] <= (_ceiling(k, p, ceilings) or rung[k])
                for k, _, need, _, _, p in rows)
    ]
    return min(fitting, key=lambda rung: sum(rung.values()), default=None)


def resolve_cap(
    state: dict[str, int],
    key: str,
    real: int,
    *,
    initial_factor: float,
    grow_factor: float = 1.30,
    stride: int = 16,
    extra: int = 0,
    strict_gt: bool = True,
) -> int:
    """Resolve one capacity key (SPEC section 2).

    ``need = real + extra`` (MAX over the agreement group when one is
    active). First sight: ``bucket(need, initial_factor)``. Later: the stored
    cap, unless ``need`` overflows it (``need > cap``, or ``>=`` when
    ``strict_gt`` is False), then ``max(stride, bucket(need, grow_factor))``.
    Caps never shrink.

    Raises
    ------
    ValueError
        For a negative or non-integer ``real`` / ``extra``, ``stride < 1`` or
        a factor below 1.0; the message names the argument.
    """
    real = _as_count("real", real)
    policy = CapPolicy(initial_factor, grow_factor, stride, extra, strict_gt)
    return resolve_caps(state, {key: (real, policy)})[key]

