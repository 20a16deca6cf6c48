"""Agreement across ranks: one checked, fixed-size MAX exchange per step (SPEC section 3).

Every rank of an agreement group resolves the same caps on the same step:
each :func:`~ddpad.padding.resolve_caps` call issues exactly one exchange of the
needs and current caps of all its keys, with a header that catches ranks
that disagree on keys or step, a rank that failed, or an exchange paired
with a collective that is not ddpad's. The scope is a context variable.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "EXCHANGE_SLOTS",
    "MAX_KEYS",
    "Agreement",
    "AgreementError",
    "cap_agreement_group",
    "cap_agreement_over",
    "current_agreement",
    "key_fingerprint",
]


class AgreementError(RuntimeError):
    """ddpad's cap exchange across ranks failed: the ranks disagree on the cap
    keys or the step, a rank reported a failed step, the exchange was paired
    with another collective, or it timed out. Raised on every rank that sees it."""



# The exchange is one fixed-size int64 vector, MAX-reduced. Values that must be
# equal on every rank travel as (x, -x): after the MAX, x == -(-x) holds only
# if every rank sent the same x. The size never depends on the step, so a
# mismatch is detected from the values instead of hanging on the sizes.
_MAGIC = 0x64647061  # "ddpa": a vector that lacks it was paired with another collective
# magic, -magic, fingerprint, -fingerprint, step, -step, failure: 0 for none,
# else (where << _RANK_BITS) | (rank + 1), where = 2 * step + 1 for a failure
# before that step's exchange, 2 * step + 2 after it (in the model)
_HEADER = 7
_RANK_BITS = 24
EXCHANGE_SLOTS = 64
MAX_KEYS = (EXCHANGE_SLOTS - _HEADER) // 3  # a need, a cap and a ceiling each
NO_CEILING = 1 << 62  # a key without a ceiling, in the exchange


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
    rank: int = 0
    failed_code: int = 0  # where ``failed`` happened: 2 * step + 1 (before its exchange) or + 2 (after)

    def exchange(self, keys: list[str], needs: list[int], caps: list[int],
                 ceilings: list[int | None] | None = None) -> tuple[list[int], list[int], list[int | None]]:
        """One checked exchange: ``(needs, caps)`` MAX-reduced over the group,
        and ``ceilings`` (None: none) MIN-reduced, so that every rank
        resolves the same caps under the smallest ceiling of any rank.

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
        where, self.failed_code = (self.failed_code or 2 * step + 1) if failed else 0, 0
        failure = (where << _RANK_BITS) | (self.rank + 1) if failed else 0
        lows = [-(NO_CEILING if c is None else c) for c in (ceilings or [None] * len(keys))]
        vec = [_MAGIC, -_MAGIC, fp, -fp, step, -step, failure, *needs, *caps, *lows]
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
            at, after = divmod((out[6] >> _RANK_BITS) - 1, 2)
            rank = (out[6] & ((1 << _RANK_BITS) - 1)) - 1
            where = f"after the cap exchange at step {at}, reported at step {step}" if after else \
                f"before the cap exchange at step {at}"
            raise AgreementError(
                f"ddpad: rank {rank}'s step failed {where}"
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
        agreed = [None if -c >= NO_CEILING else -c for c in out[_HEADER + 2 * k : _HEADER + 3 * k]]
        return out[_HEADER : _HEADER + k], out[_HEADER + k : _HEADER + 2 * k], agreed

    def failed_after(self, reason: str) -> None:
        """Record a local failure after this step's exchange (in the model):
        the peers learn of it, with its step, at the next exchange."""
        self.failed, self.failed_code = reason, 2 * (self.step - 1) + 2

    def fail(self, reason: str) -> None:
        """Report a local failure to the peers in an exchange of its own (so
        that they raise on the same step instead of waiting), then return.
        Call it on a rank whose step failed before it reached the exchange."""
        self.failed, self.failed_code = reason, 2 * self.step + 1
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
        t0 = time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            waited = time.monotonic() - t0
            what = (f"timed out after {self.timeout:g} s waiting for the other ranks" if waited >= 0.9 * self.timeout
                    else f"failed after {waited:.1f} s (the collective reported an error: a peer died or closed "
                         "its connection)")
            raise AgreementError(
                f"ddpad: the cap exchange at step {step} {what} ({exc}); a rank failed or hangs elsewhere. "
                "The process group is not usable after this: destroy it and restart from the last checkpoint"
            ) from exc
        return [int(v) for v in tensor.tolist()]



_AGREEMENT: contextvars.ContextVar[Agreement | None] = contextvars.ContextVar(
    "ddpad_agreement", default=None
)

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
            agreement = Agreement(group, torch.device(device), world, timeout=timeout, exchange_group=exchange_group,
                                  rank=dist.get_rank(group))
    with _active(agreement):
        yield agreement


@contextlib.contextmanager
def cap_agreement_over(
    reduce_max: Callable[[list[int]], list[int]], world_size: int, rank: int = 0
) -> Iterator[Agreement | None]:
    """Like :func:`cap_agreement_group`, with the MAX all-reduce done by
    ``reduce_max`` (``values -> values maxed over all ranks``, called once per
    :func:`resolve_caps` with a fixed-size list), e.g. an mpi4py
    communicator's ``allreduce``; ``rank`` names this rank in failure
    messages. A no-op (yields ``None``) for ``world_size == 1``."""
    agreement = (Agreement(None, torch.device("cpu"), world_size, reduce_max=reduce_max, rank=rank)
                 if world_size > 1 else None)
    with _active(agreement):
        yield agreement


@contextlib.contextmanager
def _active(agreement: Agreement | None) -> Iterator[None]:
    token = _AGREEMENT.set(agreement)
    try:
        yield
    finally:
        _AGREEMENT.reset(token)


