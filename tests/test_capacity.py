"""resolve_cap / resolve_caps: SPEC section 2 formula, reference values, validation."""

from __future__ import annotations

import logging

import pytest

import ddpad
from ddpad.padding import CapPolicy, CapScope, ScopedCaps, resolve_cap, resolve_caps


def test_reference_values_atoms_sequence() -> None:
    state: dict[str, int] = {}
    kw = dict(initial_factor=1.15, strict_gt=False)
    assert resolve_cap(state, "atoms", 100, **kw) == 128
    for real in range(101, 128):
        assert resolve_cap(state, "atoms", real, **kw) == 128
    assert resolve_cap(state, "atoms", 128, **kw) == 176
    assert state == {"atoms": 176}


@pytest.mark.parametrize(
    ("real", "factor", "stride", "expected"),
    [(100, 1.35, 16, 144), (1000, 1.15, 64, 1152), (5000, 1.15, 1024, 6144), (0, 1.15, 16, 16)],
)
def test_reference_values_first_sight(real: int, factor: float, stride: int, expected: int) -> None:
    assert resolve_cap({}, "k", real, initial_factor=factor, stride=stride) == expected


def test_overflow_grow_reference() -> None:
    state = {"edges": 192}
    assert resolve_cap(state, "edges", 200, initial_factor=1.35) == 272


def test_grow_only_never_shrinks() -> None:
    state: dict[str, int] = {}
    caps = [resolve_cap(state, "e", r, initial_factor=1.35) for r in (500, 10, 0, 400, 700, 3)]
    assert caps == sorted(caps)
    assert caps[1:3] == [caps[0], caps[0]]


def test_strict_gt_both_ways() -> None:
    strict = {"k": 128}
    assert resolve_cap(strict, "k", 128, initial_factor=1.15, strict_gt=True) == 128
    assert resolve_cap(strict, "k", 129, initial_factor=1.15, strict_gt=True) == 176
    loose = {"k": 128}
    assert resolve_cap(loose, "k", 127, initial_factor=1.15, strict_gt=False) == 128
    assert resolve_cap(loose, "k", 128, initial_factor=1.15, strict_gt=False) == 176


def test_extra_reserves_slots() -> None:
    assert resolve_cap({}, "a", 126, initial_factor=1.0, extra=2) == 144  # need 128 -> 129 -> 144
    state = {"a": 128}
    assert resolve_cap(state, "a", 126, initial_factor=1.15, extra=2) == 128  # 128 > 128 is false
    assert resolve_cap(state, "a", 127, initial_factor=1.15, extra=2) == 176


def test_grow_at_least_one_stride() -> None:
    state = {"k": 0}
    assert resolve_cap(state, "k", 1, initial_factor=1.0, grow_factor=1.0, stride=16) == 16


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(real=-1), "real"),
        (dict(real=3.0), "real"),
        (dict(real=True), "real"),
        (dict(real="7"), "real"),
        (dict(extra=-2), "extra"),
        (dict(extra=1.5), "extra"),
        (dict(stride=0), "stride"),
        (dict(stride=2.5), "stride"),
        (dict(initial_factor=0.9), "initial_factor"),
        (dict(grow_factor=0.99), "grow_factor"),
        (dict(initial_factor=float("nan")), "initial_factor"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict, name: str) -> None:
    args = dict(real=10, initial_factor=1.15)
    args.update(kwargs)
    real = args.pop("real")
    with pytest.raises(ValueError, match=name):
        resolve_cap({}, "k", real, **args)


def test_numpy_and_tensor_ints_are_counts() -> None:
    import numpy as np
    import torch

    assert resolve_cap({}, "k", np.int64(100), initial_factor=1.35) == 144
    assert resolve_cap({}, "k", torch.tensor(100), initial_factor=1.35) == 144


def test_resolve_caps_many_keys_and_records(caplog: pytest.LogCaptureFixture) -> None:
    scope = CapScope()
    state = ScopedCaps({"edges": 2800}, scope)
    policies = {"atoms": CapPolicy(1.15, strict_gt=False), "edges": CapPolicy(1.35)}
    with caplog.at_level(logging.INFO, logger="ddpad"):
        caps = resolve_caps(state, {"atoms": (100, policies["atoms"]), "edges": (2818, policies["edges"])})
    assert caps == {"atoms": 128, "edges": 3664}
    assert [(r.key, r.old_cap, r.cap, r.grew) for r in scope.resolutions] == [
        ("atoms", None, 128, True), ("edges", 2800, 3664, True)]
    assert "edges 2818 > cap 2800: grow to 3664, expect one recompile" in caplog.text


def test_no_agreement_without_process_group() -> None:
    with ddpad.cap_agreement_group(None, "cpu") as agreement:
        assert agreement is None
        assert resolve_cap({}, "k", 100, initial_factor=1.35) == 144


def test_agreement_over_a_custom_reducer_is_one_call_per_resolution() -> None:
    """An engine without torch.distributed (LAMMPS under MPI) agrees through
    its own MAX all-reduce: one call per resolve_caps, all keys at once."""
    peer_needs = [300, 10]  # what the other rank needs this step
    calls: list[list[int]] = []

    def reduce_max(vec: list[int]) -> list[int]:
        calls.append(list(vec))
        peer = list(vec)  # the peer's exchange: same header and keys, its own needs
        peer[7:9] = peer_needs
        return [max(a, b) for a, b in zip(vec, peer)]

    policies = {"atoms": CapPolicy(1.15, strict_gt=False), "edges": CapPolicy(1.35)}
    with ddpad.padding.cap_agreement_over(reduce_max, world_size=2) as agreement:
        caps = resolve_caps({}, {"atoms": (100, policies["atoms"]), "edges": (2818, policies["edges"])})
    assert len(calls) == 1 and len(calls[0]) == 64 and calls[0][7:9] == [100, 2818]
    assert agreement is not None and agreement.collectives == 1
    assert caps == {"atoms": resolve_cap({}, "a", 300, initial_factor=1.15, strict_gt=False),
                    "edges": resolve_cap({}, "e", 2818, initial_factor=1.35)}
    with ddpad.padding.cap_agreement_over(reduce_max, world_size=1) as single:
        assert single is None
        resolve_caps({}, {"atoms": (1, policies["atoms"])})
    assert len(calls) == 1


def test_steady_calls_record_and_respect_ceilings() -> None:
    """The fast path of a call that changes nothing still records its
    resolutions, and leaves a cap above its ceiling to the general path."""
    policy = CapPolicy(1.15, strict_gt=False)
    scope = CapScope()
    state = ScopedCaps({"atoms": 64}, scope)
    assert resolve_caps(state, {"atoms": (40, policy)}) == {"atoms": 64}
    assert [(r.key, r.real, r.need, r.old_cap, r.cap, r.grew) for r in scope.resolutions] == [
        ("atoms", 40, 40, 64, 64, False)]
    ceiled = ScopedCaps(state, CapScope({"atoms": 32}))
    assert resolve_caps(ceiled, {"atoms": (20, policy)}) == {"atoms": 64}  # fits the ceiling: kept
    with pytest.raises(ddpad.CapacityError, match="ceiling is 32"):
        resolve_caps(ceiled, {"atoms": (40, policy)})
    assert resolve_caps(state, {"atoms": (64, policy)}) == {"atoms": 96}  # not strict: 64 overflows 64
    with pytest.raises(ValueError, match="integer count"):
        resolve_caps(state, {"atoms": (True, policy)})
    with pytest.raises(ValueError, match=">= 0"):
        resolve_caps(state, {"atoms": (-1, policy)})


def test_a_growth_takes_the_smallest_ready_rung_that_fits() -> None:
    """Rungs (caps with graphs ready): a need overflowing by more than a
    stride still lands on the rung its own bucket would miss by a stride."""

    policies = {"atoms": CapPolicy(1.15, strict_gt=False), "edges": CapPolicy(1.35)}
    rungs = [{"atoms": 96, "edges": 1216}, {"atoms": 64, "edges": 928}]  # any order: the smallest fitting wins

    def grow(state: dict[str, int], atoms: int, edges: int, ready: list[dict[str, int]]) -> dict[str, int]:
        caps = ScopedCaps(state, CapScope(rungs=ready))  # the rungs travel on the caps, as a call hands them
        out = resolve_caps(caps, {"atoms": (atoms, policies["atoms"]), "edges": (edges, policies["edges"])})
        state.update(caps)
        return out

    assert grow({"atoms": 48, "edges": 704}, 33, 717, []) == {"atoms": 48, "edges": 944}  # its own bucket
    state = {"atoms": 48, "edges": 704}
    assert grow(state, 33, 717, rungs) == {"atoms": 64, "edges": 928} == state  # every key moves to the rung
    assert grow(state, 40, 900, rungs) == {"atoms": 64, "edges": 928}  # no growth: the caps stay
    assert grow(state, 40, 986, rungs) == {"atoms": 96, "edges": 1216}
    assert grow(state, 50, 1300, rungs) == {"atoms": 96, "edges": 1696}  # past every rung: its own bucket
    # a rung below a current cap, or one a need does not fit, is not taken
    assert grow({"atoms": 80, "edges": 704}, 33, 717, [{"atoms": 64, "edges": 928}]) == {"atoms": 80, "edges": 944}
    assert grow({"atoms": 48, "edges": 704}, 64, 717, [{"atoms": 64, "edges": 928}]) == {"atoms": 96, "edges": 944}
    assert grow({}, 33, 717, rungs) == {"atoms": 48, "edges": 976}  # first sight sizes from the need alone


def test_the_growth_rule_is_one_function_for_resolution_rungs_and_shrink(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CapPolicy.grow`` is the one growth rule: changing it changes how a
    resolution grows a cap, the warm ladder's rungs and a shrink's new cap
    alike (before, each wrote ``max(stride, bucket(...))`` itself)."""
    from ddpad._capacity import CapResolution
    from ddpad._ladder import ladder
    from ddpad._shrink import Shrinker

    policy = CapPolicy(1.0, grow_factor=1.3, stride=16)

    def outcomes() -> tuple[int, list[dict[str, int]], int]:
        state = {"edges": 64}
        grown = resolve_caps(state, {"edges": (65, policy)})["edges"]
        rungs = ladder({"edges": 64}, [CapResolution("edges", 60, 60, 64, 64, policy)], 2)
        shrinker = Shrinker(ddpad.ShrinkPolicy(below=0.5, after=1, factor=1.3))
        caps = {"edges": 1024}
        shrinker.observe(1, [CapResolution("edges", 100, 100, 1024, 1024, policy)], caps)
        return grown, rungs, caps["edges"]

    assert outcomes() == (96, [{"edges": 96}, {"edges": 128}], 144)  # SPEC section 2's bucket

    def powers_of_two(self: CapPolicy, need: int, factor: float | None = None) -> int:
        return 1 << max(need - 1, 1).bit_length()

    monkeypatch.setattr(CapPolicy, "grow", powers_of_two)
    assert outcomes() == (128, [{"edges": 128}, {"edges": 256}], 128)


def test_a_scope_travels_on_the_caps_it_is_handed_with() -> None:
    """Ceilings and the record of a :class:`ddpad.padding.CapScope` apply to the caps
    that carry it (:class:`ddpad.padding.ScopedCaps`) and nowhere else: a plain dict
    resolved beside it sees neither, however the two interleave."""
    from ddpad import CapacityError

    policy = CapPolicy(1.0, stride=16)
    scope = CapScope({"atoms": 32})
    caps, plain = ScopedCaps({}, scope), {}
    assert resolve_caps(caps, {"atoms": (20, policy)}) == {"atoms": 32} == caps
    assert resolve_caps(plain, {"atoms": (40, policy)}) == {"atoms": 48}  # no ceiling, nothing recorded
    with pytest.raises(CapacityError, match="ceiling is 32"):
        resolve_caps(caps, {"atoms": (40, policy)})
    assert caps == {"atoms": 32}  # unchanged by the refused resolution
    assert [(r.key, r.real, r.old, r.cap) for r in scope.rows] == [("atoms", 20, None, 32)]
    unscoped = CapScope()  # a scope without ceilings has none
    assert resolve_caps(ScopedCaps({}, unscoped), {"atoms": (24, policy)}) == {"atoms": 32}
    assert [(r.key, r.cap) for r in unscoped.resolutions] == [("atoms", 32)] and len(scope.rows) == 1
