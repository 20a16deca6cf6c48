"""Capacity policy: grow-only, bucketed caps, agreed across ranks in one collective.

See SPEC section 2 (the formula and its reference values) and section 3
(agreement). Capacities live in a plain ``dict[str, int]`` the caller owns.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import logging
import math
import operator
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

__all__ = [
    "Agreement",
    "AgreementError",
    "CapPolicy",
    "CapResolution",
    "CapacityError",
    "bucket",
    "cap_agreement_group",
    "cap_agreement_over",
    "cap_ceilings",
    "record_resolutions",
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


class AgreementError(RuntimeError):
    """ddpad's cap exchange across ranks failed: the ranks disagree on the cap
    keys or the step, a rank reported a failed step, the exchange was paired
    with another collective, or it timed out. Raised on every rank that sees it."""


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


# The exchange is one fixed-size int64 vector, MAX-reduced. Values that must be
# equal on every rank travel as (x, -x): after the MAX, x == -(-x) holds only
# if every rank sent the same x. The size never depends on the step, so a
# mismatch is detected from the values instead of hanging on the sizes.
_MAGIC = 0x64647061  # "ddpa": a vector that lacks it was paired with another collective
_HEADER = 7  # magic, -magic, fingerprint, -fingerprint, step, -step, failed
EXCHANGE_SLOTS = 64
MAX_KEYS = (EXCHANGE_SLOTS - _HEADER) // 2


def key_fingerprint(keys: list[str]) -> int:
    """A stable 31-bit fingerprint of the key names in order."""
    return zlib.crc32("\0".join(keys).encode()) & 0x7FFFFFFF


@dataclass
class Agreement:
    """An active agreement scope: the group, the device of the reduce, and a
    count of the collectives it issued (one per :func:`resolve_caps` call).

    Every exchange is one MAX all-reduce of a fixed-size vector that carries,
    besides the needs, the current caps (so caps loaded from files or grown
    alone are agreed too), a fingerprint of the key names, a step counter and
    a failure flag; ranks that disagree on keys or step, or a rank that
    reports a failure, make every rank raise :class:`AgreementError` on the
    same exchange. The wait is bounded by ``timeout`` seconds.

    ``reduce_max`` replaces the ``torch.distributed`` all-reduce (e.g. an MPI
    communicator's, for engines that run under MPI without torch.distributed);
    ``exchange_group`` is the group the exchange runs on (default ``group``):
    a group of its own (``torch.distributed.new_group()``, made once) keeps
    ddpad's exchange from ever pairing with a collective of the model.
    """

    group: Any
    device: torch.device
    world_size: int
    collectives: int = 0
    reduce_max: Callable[[list[int]], list[int]] | None = None
    timeout: float = 600.0
    exchange_group: Any = None
    step: int = 0
    failed: str | None = None  # a local failure not yet reported to the peers

    def max_reduce(self, needs: list[int]) -> list[int]:
        """MAX-reduce ``needs`` over the group (one checked exchange)."""
        return self.exchange([f"value{i}" for i in range(len(needs))], needs, [0] * len(needs))[0]

    def exchange(self, keys: list[str], needs: list[int], caps: list[int]) -> tuple[list[int], list[int]]:
        """One checked exchange: ``(needs, caps)`` MAX-reduced over the group.

        Raises
        ------
        AgreementError
            On every rank, when ranks differ in keys or step, a rank reported
            a failure (:meth:`fail`), the exchange met another collective, or
            the peers did not arrive within ``timeout``.
        """
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "ddpad: capacity agreement is a blocking collective and must run in "
                "eager code; call the padder outside the compiled region or under "
                "torch.compiler.disable"
            )
        if len(keys) > MAX_KEYS:
            raise ValueError(f"ddpad agrees at most {MAX_KEYS} cap keys per step, got {len(keys)}: {keys}")
        step, fp = self.step, key_fingerprint(keys)
        self.step += 1
        failed, self.failed = self.failed, None
        vec = [_MAGIC, -_MAGIC, fp, -fp, step, -step, 1 if failed else 0, *needs, *caps]
        vec += [0] * (EXCHANGE_SLOTS - len(vec))
        out = self._all_reduce_max(vec, step)
        k = len(keys)
        if out[0] != _MAGIC or out[1] != -_MAGIC:
            raise AgreementError(
                f"ddpad: the cap exchange at step {step} was paired with a collective that is not "
                "ddpad's (a rank skipped or repeated a step, or the model's collectives share the "
                "group); give the exchange a group of its own (exchange_group=new_group())"
            )
        if out[6]:
            raise AgreementError(
                f"ddpad: a rank's step failed before the cap exchange at step {step}"
                + (f" (here: {failed})" if failed else "; see that rank's error")
                + ": every rank stops at this step"
            )
        if out[2] != -out[3]:
            raise AgreementError(
                f"ddpad: ranks disagree on the cap keys at step {step}: this rank resolves {keys} "
                f"(fingerprint {fp}), another rank different keys (fingerprints {-out[3]}..{out[2]}); "
                "every rank must pad the same fields (e.g. an optional neighbour matrix on all ranks or none)"
            )
        if out[4] != -out[5]:
            raise AgreementError(
                f"ddpad: ranks are at different cap-exchange steps (this rank {step}, others "
                f"{-out[5]}..{out[4]}): a rank skipped or repeated a step"
            )
        return out[_HEADER : _HEADER + k], out[_HEADER + k : _HEADER + 2 * k]

    def fail(self, reason: str) -> None:
        """Report a local failure to the peers in an exchange of its own (so
        that they raise on the same step instead of waiting), then return.
        Call it on a rank whose step failed before it reached the exchange."""
        self.failed = reason
        try:
            self.exchange([], [], [])
        except AgreementError:
            pass  # the peers learned of it; the caller raises its own error

    def _all_reduce_max(self, vec: list[int], step: int) -> list[int]:
        self.collectives += 1
        if self.reduce_max is not None:
            return [int(v) for v in self.reduce_max(vec)]
        import torch.distributed as dist

        tensor = torch.tensor(vec, dtype=torch.int64, device=self.device)
        group = self.exchange_group if self.exchange_group is not None else self.group
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise AgreementError(
                f"ddpad: the cap exchange at step {step} timed out after {self.timeout:g} s waiting for "
                f"the other ranks ({exc}); a rank failed or hangs elsewhere. The process group is not "
                "usable after this: destroy it and restart from the last checkpoint"
            ) from exc
        return [int(v) for v in tensor.tolist()]


_AGREEMENT: contextvars.ContextVar[Agreement | None] = contextvars.ContextVar(
    "ddpad_agreement", default=None
)
# (key, real, need, old cap or None, cap, policy): a CapResolution's fields,
# built into one only where a caller asks for them
_Row = tuple[str, int, int, int | None, int, CapPolicy]
_RESOLUTIONS: contextvars.ContextVar[Callable[[list[_Row]], None] | None] = contextvars.ContextVar(
    "ddpad_resolutions", default=None
)
_CEILINGS: contextvars.ContextVar[Mapping[str, int]] = contextvars.ContextVar(
    "ddpad_ceilings", default=MappingProxyType({})
)
# caps whose graphs are ready (warmed, or compiling in a background worker): a
# growth takes the smallest that fits every need instead of its own buckets
_RUNGS: contextvars.ContextVar[Sequence[Mapping[str, int]]] = contextvars.ContextVar("ddpad_rungs", default=())


def current_agreement() -> Agreement | None:
    """The active agreement scope, or None."""
    return _AGREEMENT.get()


@contextlib.contextmanager
def cap_agreement_group(
    group: Any = None,
    device: torch.device | str | None = None,
    *,
    timeout: float = 600.0,
    exchange_group: Any = None,
) -> Iterator[Agreement | None]:
    """Make every capacity resolution inside the block agree across ``group``.

    Each :func:`resolve_caps` call MAX-reduces the needs (and current caps)
    of all its keys over the group in one checked all-reduce, so every rank
    resolves the same caps and recompiles on the same step. A no-op (yields
    ``None``) when ``torch.distributed`` is unavailable or not initialised,
    or the group has one rank.

    Parameters
    ----------
    group
        A ``torch.distributed`` process group; ``None`` is the default group.
    device
        Where the reduce tensor lives: ``"cpu"`` for gloo, the rank's CUDA
        device for NCCL. Default: CUDA current device under NCCL, else CPU.
    timeout
        Seconds an exchange waits for the other ranks before raising
        :class:`AgreementError` (a compile on another rank counts: allow for it).
    exchange_group
        Run the exchange on this group (same ranks) instead of ``group``: a
        group of its own keeps it from ever pairing with the model's collectives.

    Yields
    ------
    Agreement or None
        The active scope, whose ``collectives`` counts the all-reduces issued.
    """
    import torch.distributed as dist

    agreement: Agreement | None = None
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(group)
        if world > 1:
            if device is None:
                backend = dist.get_backend(group)
                device = (
                    torch.device("cuda", torch.cuda.current_device())
                    if backend == "nccl"
                    else torch.device("cpu")
                )
            agreement = Agreement(group, torch.device(device), world, timeout=timeout, exchange_group=exchange_group)
    with _active(agreement):
        yield agreement


@contextlib.contextmanager
def cap_agreement_over(
    reduce_max: Callable[[list[int]], list[int]], world_size: int
) -> Iterator[Agreement | None]:
    """Like :func:`cap_agreement_group`, with the MAX all-reduce done by
    ``reduce_max`` (``values -> values maxed over all ranks``, called once per
    :func:`resolve_caps` with a fixed-size list), e.g. an mpi4py
    communicator's ``allreduce``. A no-op (yields ``None``) for ``world_size == 1``."""
    agreement = Agreement(None, torch.device("cpu"), world_size, reduce_max=reduce_max) if world_size > 1 else None
    with _active(agreement):
        yield agreement


@contextlib.contextmanager
def _active(agreement: Agreement | None) -> Iterator[None]:
    token = _AGREEMENT.set(agreement)
    try:
        yield
    finally:
        _AGREEMENT.reset(token)


def _checked_ceilings(ceilings: Mapping[str, int] | None) -> Mapping[str, int]:
    for key, value in (ceilings or {}).items():
        if _as_count(f"ceiling of {key!r}", value) < 1:
            raise ValueError(f"ceiling of {key!r} must be >= 1, got {value}")
    return MappingProxyType(dict(ceilings or {}))


@contextlib.contextmanager
def cap_ceilings(ceilings: Mapping[str, int] | None) -> Iterator[None]:
    """Per-key cap ceilings for every resolution inside the block (on top of
    each policy's ``max_cap``; the smaller wins)."""
    token = _CEILINGS.set(_checked_ceilings(ceilings))
    try:
        yield
    finally:
        _CEILINGS.reset(token)


@contextlib.contextmanager
def record_resolutions() -> Iterator[list[CapResolution]]:
    """Collect every :class:`CapResolution` made inside the block (growths,
    fills) into the yielded list. Nested blocks each see their own list."""
    sink: list[CapResolution] = []
    token = _RESOLUTIONS.set(lambda rows: sink.extend(CapResolution(*row) for row in rows))
    try:
        yield sink
    finally:
        _RESOLUTIONS.reset(token)


class _Scope:
    """One call's scope (what a :class:`~ddpad.PaddedModel` call opens): every
    resolution inside goes to ``rows`` as a plain tuple of the fields of a
    :class:`CapResolution` (no object per key and call), under ``ceilings``.
    A class, not a generator: it is entered on every call."""

    __slots__ = ("_ceilings", "_rungs", "_tokens", "rows")

    def __init__(self, ceilings: Mapping[str, int] | None, rungs: Sequence[Mapping[str, int]] = ()) -> None:
        self.rows: list[_Row] = []
        self._ceilings = _checked_ceilings(ceilings) if ceilings else None
        self._rungs = rungs
        self._tokens: tuple[Any, Any, Any] = (None, None, None)

    def __enter__(self) -> list[_Row]:
        ceilings = _CEILINGS.set(self._ceilings) if self._ceilings is not None else None
        rungs = _RUNGS.set(self._rungs) if self._rungs else None
        self._tokens = (_RESOLUTIONS.set(self.rows.extend), ceilings, rungs)
        return self.rows

    def __exit__(self, *exc: object) -> None:
        rows, ceilings, rungs = self._tokens
        _RESOLUTIONS.reset(rows)
        if ceilings is not None:
            _CEILINGS.reset(ceilings)
        if rungs is not None:
            _RUNGS.reset(rungs)


def resolutions(rows: list[_Row]) -> list[CapResolution]:
    """The :class:`CapResolution` of each row a :class:`_Scope` recorded."""
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
        The caller's caps, updated in place (grow-only) once every key resolved.
    requests
        ``{key: (real_count, policy)}``.

    Returns
    -------
    dict[str, int]
        The cap of every requested key.

    Raises
    ------
    CapacityError
        When a need exceeds its ceiling (``CapPolicy.max_cap`` or
        :func:`cap_ceilings`); ``state`` is left unchanged.
    """
    agreement, ceilings = _AGREEMENT.get(), _CEILINGS.get()
    rows = _steady(state, requests, ceilings) if agreement is None else None
    if rows is None:
        rows = _resolve(state, requests, agreement, ceilings)
    sink = _RESOLUTIONS.get()
    if sink is not None:
        sink(rows)
    return {row[0]: row[4] for row in rows}


def _steady(
    state: Mapping[str, int], requests: Mapping[str, tuple[int, CapPolicy]], ceilings: Mapping[str, int]
) -> list[_Row] | None:
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
        rows.append((key, real, need, cap, cap, policy))
    return rows


def _resolve(
    state: dict[str, int], requests: Mapping[str, tuple[int, CapPolicy]], agreement: Agreement | None,
    ceilings: Mapping[str, int],
) -> list[_Row]:
    """Resolve every key (SPEC sections 2 and 3): the general path."""
    keys = list(requests)
    reals = [_as_count(f"real (key {k!r})", requests[k][0]) for k in keys]
    policies = [requests[k][1] for k in keys]
    needs = [r + p.extra for r, p in zip(reals, policies)]
    current = dict(state)
    if agreement is not None and keys:
        needs, agreed = agreement.exchange(keys, needs, [state.get(k, 0) for k in keys])
        for key, cap in zip(keys, agreed):
            if cap > current.get(key, 0):  # a peer's cap (loaded or grown) is larger
                current[key] = cap
    rows: list[_Row] = []
    for key, real, need, policy in zip(keys, reals, needs, policies):
        old = current.get(key)
        if old is None:
            cap = bucket(need, policy.initial_factor, policy.stride)
        elif not policy.fits(need, old):
            cap = max(policy.stride, bucket(need, policy.grow_factor, policy.stride))
        else:
            cap = old
        ceiling = _ceiling(key, policy, ceilings)
        if ceiling is not None and cap > ceiling:
            if not policy.fits(need, ceiling):
                raise CapacityError(
                    f"ddpad: {key!r} needs {need} rows (real {real}"
                    + (f" + {policy.extra} reserved" if policy.extra else "")
                    + f") but its ceiling is {ceiling}; raise the ceiling (max_caps / memory_budget) "
                    "or split the system"
                )
            cap = max(ceiling, old or 0)
        rows.append((key, real, need, state.get(key), cap, policy))
    # never under an agreement: every rank sizes its caps from the agreed needs alone
    rung = _ready_rung(rows, current, ceilings) if agreement is None else None
    if rung is not None:
        rows = [(key, real, need, old, rung[key], policy) for key, real, need, old, _, policy in rows]
    for key, _, need, old, cap, _ in rows:
        if old is not None and cap != old:
            relation = ">" if need > old else ">="
            log.info("%s %d %s cap %d: grow to %d, expect one recompile", key, need, relation, old, cap)
        state[key] = cap
    return rows


def _ready_rung(rows: list[_Row], current: Mapping[str, int], ceilings: Mapping[str, int]) -> Mapping[str, int] | None:
    """The smallest ready rung a growth among ``rows`` can take: one that
    holds every key, each at least its current cap, fitting its need and
    within its ceiling (a need often overflows by more than a stride, so its
    own bucket would miss the rung's graph); None when nothing grew."""
    if not any(old is not None and cap != old for _, _, _, old, cap, _ in rows):
        return None
    fitting = [
        rung for rung in _RUNGS.get()
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

