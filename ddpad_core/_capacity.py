"""Capacity policy: grow-only, bucketed caps, agreed across ranks in one collective.

See SPEC section 2 (the formula and its reference values) and section 3
(agreement). Capacities live in a plain ``dict[str, int]`` the caller owns.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Agreement",
    "CapPolicy",
    "CapResolution",
    "bucket",
    "cap_agreement_group",
    "cap_agreement_over",
    "record_resolutions",
    "resolve_cap",
    "resolve_caps",
]

log = logging.getLogger("ddpad")

# Floor of x * f is taken after adding this, so that 100 * 1.15 counts as 115
# and not 114.99999999999999.
_FLOOR_EPS = 1e-9


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
    """

    initial_factor: float
    grow_factor: float = 1.30
    stride: int = 16
    extra: int = 0
    strict_gt: bool = True

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


@dataclass
class Agreement:
    """An active agreement scope: the group, the device of the reduce, and a
    count of the collectives it issued (one per :func:`resolve_caps` call).
    ``reduce_max`` replaces the ``torch.distributed`` all-reduce (e.g. an MPI
    communicator's, for engines that run under MPI without torch.distributed)."""

    group: Any
    device: torch.device
    world_size: int
    collectives: int = 0
    reduce_max: Callable[[list[int]], list[int]] | None = None

    def max_reduce(self, needs: list[int]) -> list[int]:
        """MAX-reduce ``needs`` over the group in one all-reduce."""
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "ddpad: capacity agreement is a blocking collective and must run in "
                "eager code; call the padder outside the compiled region or under "
                "torch.compiler.disable"
            )
        self.collectives += 1
        if self.reduce_max is not None:
            return [int(v) for v in self.reduce_max(list(needs))]
        import torch.distributed as dist

        vec = torch.tensor(needs, dtype=torch.int64, device=self.device)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in vec.tolist()]


_AGREEMENT: contextvars.ContextVar[Agreement | None] = contextvars.ContextVar(
    "ddpad_agreement", default=None
)
_RESOLUTIONS: contextvars.ContextVar[list[CapResolution] | None] = contextvars.ContextVar(
    "ddpad_resolutions", default=None
)


@contextlib.contextmanager
def cap_agreement_group(
    group: Any = None, device: torch.device | str | None = None
) -> Iterator[Agreement | None]:
    """Make every capacity resolution inside the block agree across ``group``.

    Each :func:`resolve_caps` call MAX-reduces the needs of all its keys over
    the group in one all-reduce, so every rank resolves the same caps and
    recompiles on the same step. A no-op (yields ``None``) when
    ``torch.distributed`` is unavailable or not initialised, or the group
    has one rank.

    Parameters
    ----------
    group
        A ``torch.distributed`` process group; ``None`` is the default group.
    device
        Where the reduce tensor lives: ``"cpu"`` for gloo, the rank's CUDA
        device for NCCL. Default: CUDA current device under NCCL, else CPU.

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
            agreement = Agreement(group, torch.device(device), world)
    with _active(agreement):
        yield agreement


@contextlib.contextmanager
def cap_agreement_over(
    reduce_max: Callable[[list[int]], list[int]], world_size: int
) -> Iterator[Agreement | None]:
    """Like :func:`cap_agreement_group`, with the MAX all-reduce done by
    ``reduce_max`` (``needs -> needs maxed over all ranks``, called once per
    :func:`resolve_caps`), e.g. an mpi4py communicator's ``allreduce``. A
    no-op (yields ``None``) for ``world_size == 1``."""
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


@contextlib.contextmanager
def record_resolutions() -> Iterator[list[CapResolution]]:
    """Collect every :class:`CapResolution` made inside the block (growths,
    fills) into the yielded list. Nested blocks each see their own list."""
    sink: list[CapResolution] = []
    token = _RESOLUTIONS.set(sink)
    try:
        yield sink
    finally:
        _RESOLUTIONS.reset(token)


def resolve_caps(
    state: dict[str, int], requests: Mapping[str, tuple[int, CapPolicy]]
) -> dict[str, int]:
    """Resolve several capacity keys at once: one collective for all of them.

    Parameters
    ----------
    state
        The caller's caps, updated in place (grow-only).
    requests
        ``{key: (real_count, policy)}``.

    Returns
    -------
    dict[str, int]
        The cap of every requested key.
    """
    keys = list(requests)
    reals = [_as_count(f"real (key {k!r})", requests[k][0]) for k in keys]
    policies = [requests[k][1] for k in keys]
    needs = [r + p.extra for r, p in zip(reals, policies)]
    agreement = _AGREEMENT.get()
    if agreement is not None and keys:
        needs = agreement.max_reduce(needs)
    sink = _RESOLUTIONS.get()
    caps: dict[str, int] = {}
    for key, real, need, policy in zip(keys, reals, needs, policies):
        old = state.get(key)
        if old is None:
            cap = bucket(need, policy.initial_factor, policy.stride)
        elif need > old or (need == old and not policy.strict_gt):
            cap = max(policy.stride, bucket(need, policy.grow_factor, policy.stride))
            relation = ">" if need > old else ">="
            log.info(
                "%s %d %s cap %d: grow to %d, expect one recompile",
                key, need, relation, old, cap,
            )
        else:
            cap = old
        state[key] = cap
        caps[key] = cap
        if sink is not None:
            sink.append(CapResolution(key, real, need, old, cap, policy))
    return caps


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

