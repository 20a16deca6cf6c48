"""Malformed input: a ValueError naming the field, what is wrong and what to
do, not a wrong answer or a torch error from inside the padder (issue 27).

Shapes are checked on every device (they are host metadata). Index values
(negative indices, system labels past the system count) are checked on
the CPU, where the padder reads a value anyway and reading costs no
synchronisation; on a GPU a check would synchronise every call, so there
values are not checked (except a count the padder reads from the labels).
Validate an input on the CPU first to catch them there.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "check_labels", "check_not_negative", "edges_masked", "labels_error", "negative_error", "shape_error",
]

# devices whose values the host reads without a synchronisation (a steady
# call asks a tensor's is_cpu: the same set, without building a device)
_HOST_DEVICES = frozenset({"cpu"})


def shape_error(name: str, t: Tensor, expected: str, how: str = "") -> ValueError:
    """The error for field ``name`` of the wrong shape (``expected``, e.g. ``"(N, 3)"``)."""
    return ValueError(
        f"ddpad: field {name!r} has shape {tuple(t.shape)}, expected {expected}{how}; build the "
        "input the model takes, or configure the padder's field names to match it"
    )


def negative_error(name: str, lo: int, n: int) -> ValueError:
    return ValueError(
        f"ddpad: field {name!r} has negative indices (smallest {lo}): an index must be in [0, {n}) "
        f"(or >= {n}, a sentinel); eager indexing wraps a negative one to a real atom, padded it "
        "would reach a dead one. Build the neighbour list without negative entries"
    )


def check_not_negative(name: str, index: Tensor, n: int) -> None:
    """On a host device: raise when ``index`` has a negative entry."""
    if index.is_cpu and index.numel():
        # (aminmax, not amin: torch's CPU amin of int64 is not vectorised, 2.2x slower)
        lo = int(torch.aminmax(index)[0])
        if lo < 0:
            raise negative_error(name, lo, n)


def edges_masked(name: str, edge_index: Tensor, n: int) -> bool:
    """Whether ``edge_index`` may hold sentinels (entries ``>= n``), raising on a
    negative entry. Read on a host device only, where it is free (no device to
    wait for), in one whole-tensor pass (aminmax; torch's CPU max and amin of
    int64 are not vectorised); on a device: assumed, and masked on the device."""
    if not edge_index.numel():
        return False
    if not edge_index.is_cpu:
        return True
    lo, hi = torch.aminmax(edge_index)
    if int(lo) < 0:
        raise negative_error(name, int(lo), n)
    return int(hi) >= n


def check_labels(name: str, labels: Tensor, n_systems: int, source: str) -> None:
    """On a host device: raise when a system label is outside ``[0, n_systems)``
    (``source``: where the system count came from, for the message)."""
    if labels.is_cpu and labels.numel():
        lo, hi = torch.aminmax(labels)
        if int(lo) < 0 or int(hi) >= n_systems:
            raise labels_error(name, int(lo), int(hi), n_systems, source)


def labels_error(name: str, lo: int, hi: int, n_systems: int, source: str) -> ValueError:
    return ValueError(
        f"ddpad: field {name!r} has system labels outside [0, {n_systems}): smallest {lo}, largest "
        f"{hi}, with {n_systems} system{'s' if n_systems != 1 else ''} ({source}); label every atom "
        "with the index of its system"
    )
