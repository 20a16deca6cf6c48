"""Lockstep caps across real gloo ranks: one collective per step, same graphs per step."""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest
import torch

from _spawn import run_ranks

STEPS = 36


def real_counts(rank: int, step: int) -> tuple[int, int, int]:
    """(atoms, edges, systems) of one rank: uneven partition, rank 1 alone
    crosses bucket boundaries (atoms 60 -> 130, edges 500 -> 1300)."""
    if rank == 1:
        return 60 + 2 * step, 500 + 22 * step, 1 + step // 12
    return 30 + rank * 7 + step % 3, 200 + rank * 40 + (step * 5) % 17, 1


def graph(n: int, e: int, s: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    sizes = torch.full((s,), n // s)
    sizes[-1] += n - int(sizes.sum())
    return {
        "positions": torch.randn(n, 3, generator=gen, dtype=torch.float64),
        "batch": torch.repeat_interleave(torch.arange(s), sizes),
        "ptr": torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]),
        "edge_index": torch.randint(0, n, (2, e), generator=gen),
    }


class Summed(torch.nn.Module):
    """A model with a collective inside: the all-reduced sum of its inputs."""

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        total = (data["positions"] ** 2).sum() + data["edge_index"].sum().double()
        dist.all_reduce(total)
        return {"energy": total.reshape(1), "forces": data["positions"] * 2}


def lockstep_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    import ddpad

    gen = torch.Generator().manual_seed(rank)
    padder = ddpad.padding.COOPadder(2.0, atom_outputs=("forces",))
    model = ddpad.PaddedModel(Summed(), padder, backend="eager", on_recompile="raise")
    issued = {"all_reduce": 0}
    original = dist.all_reduce

    def counting_all_reduce(*args: Any, **kwargs: Any) -> Any:
        issued["all_reduce"] += 1
        return original(*args, **kwargs)

    caps, collectives, graphs = [], [], []
    shadow: dict[str, int] = {}  # the same padding, counted outside the model
    with ddpad.cap_agreement_group(None, "cpu") as agreement:
        assert agreement is not None and agreement.world_size == world
        for step in range(STEPS):
            data = graph(*real_counts(rank, step), gen)
            # count the all-reduces the padding issues (the model's own run compiled)
            dist.all_reduce = counting_all_reduce  # type: ignore[assignment]
            try:
                before = issued["all_reduce"]
                padded = ddpad.padding.COOPadder(2.0).pad(data, shadow)
                collectives.append(issued["all_reduce"] - before)
            finally:
                dist.all_reduce = original  # type: ignore[assignment]
            del padded
            out = model(data)
            assert out["forces"].shape == data["positions"].shape
            assert shadow == model.cap_state
            caps.append(dict(model.cap_state))
            graphs.append(model.stats.graphs)
    return {
        "caps": caps, "collectives": collectives, "graphs": graphs,
        "agreement_collectives": agreement.collectives, "growth_calls": model.stats.growth_calls,
        "max_per_frame": model.stats.max_graphs_per_frame,
    }


@pytest.mark.slow
def test_three_ranks_agree_every_step(tmp_path: pathlib.Path) -> None:
    results = run_ranks(lockstep_worker, 3, tmp_path, timeout=300)
    caps = [r["caps"] for r in results]
    assert caps[0] == caps[1] == caps[2]
    # rank 1 alone crossed buckets, yet every rank grew: lockstep
    assert len({c["atoms"] for c in caps[0]}) > 1 and len({c["edges"] for c in caps[0]}) > 1
    for r in results:
        assert r["collectives"] == [1] * STEPS  # one all-reduce for all keys of a step
        assert r["agreement_collectives"] == 2 * STEPS  # pad() + the model's own call
    graphs = [r["graphs"] for r in results]
    assert graphs[0] == graphs[1] == graphs[2]  # same compile on the same step
    assert results[0]["max_per_frame"] == 1 + results[0]["growth_calls"]


# -- checked agreement: mismatches raise on every rank, never hang -----------------


def _raises(fn: Any) -> tuple[str, float]:
    """(error type and message, seconds) of ``fn()``, which must raise."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    return "no error", time.monotonic() - t0


class Flaky(torch.nn.Module):
    """Fails inside the model (after the cap exchange) when ``fail`` is set."""

    fail = False

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.fail:
            raise RuntimeError("model blew up")
        return {"forces": data["positions"] * 2}


def checked_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    import ddpad
    from ddpad.padding import CapPolicy, resolve_caps

    policy = CapPolicy(1.15)
    out: dict[str, Any] = {}
    # different key sets (an optional neighbour matrix on one rank only)
    keys = {"atoms": (10, policy), "edges": (50, policy)}
    if rank == 1:
        keys["neighbors"] = (8, policy)
    with ddpad.cap_agreement_group(None, "cpu"):
        out["keys"] = _raises(lambda: resolve_caps({}, keys))
    # the same number of keys with other meanings
    names = {"atoms": (10, policy), ("edges" if rank == 0 else "neighbors"): (50, policy)}
    with ddpad.cap_agreement_group(None, "cpu"):
        out["names"] = _raises(lambda: resolve_caps({}, names))
    # a rank that skipped a step
    with ddpad.cap_agreement_group(None, "cpu") as agreement:
        resolve_caps({}, {"atoms": (10, policy)})
        if rank == 0:
            agreement.step += 1
        out["steps"] = _raises(lambda: resolve_caps({}, {"atoms": (10, policy)}))
    # a rank whose input is bad fails before the exchange: every rank raises on that step
    gen = torch.Generator().manual_seed(rank)
    model = ddpad.PaddedModel(Flaky(), ddpad.padding.COOPadder(2.0, atom_outputs=("forces",)), compile=False)
    good = graph(20, 60, 1, gen)
    with ddpad.cap_agreement_group(None, "cpu") as agreement:
        model(good)
        bad = {k: v for k, v in good.items() if k != "edge_index"} if rank == 0 else good
        out["before_exchange"] = _raises(lambda: model(bad))
        out["before_exchange_step"] = agreement.step
    # a rank that fails inside the model (after the exchange) and carries on:
    # every rank raises at the next exchange, none pairs it with something else
    with ddpad.cap_agreement_group(None, "cpu"):
        Flaky.fail = rank == 0
        first = _raises(lambda: model(good))
        Flaky.fail = False
        out["after_exchange"] = [first, _raises(lambda: model(good))]
    # caps loaded from a file on one rank only are agreed on the first exchange
    caps = {"atoms": 256, "edges": 4096, "systems": 8} if rank == 0 else None
    warm = ddpad.PaddedModel(Flaky(), ddpad.padding.COOPadder(2.0, atom_outputs=("forces",)), compile=False, caps=caps)
    with ddpad.cap_agreement_group(None, "cpu"):
        warm(good)
    out["loaded_caps"] = warm.caps
    # an exchange that meets the model's own collective of the same size
    with ddpad.cap_agreement_group(None, "cpu"):
        if rank == 0:
            out["paired"] = _raises(lambda: resolve_caps({}, {"atoms": (10, policy)}))
        else:
            dist.all_reduce(torch.ones(64, dtype=torch.int64))
            out["paired"] = ("model collective", 0.0)
    # a peer that never arrives: a bounded wait and a ddpad error naming the step
    exchange = dist.new_group()
    with ddpad.cap_agreement_group(None, "cpu", timeout=2.0, exchange_group=exchange):
        if rank == 0:
            out["timeout"] = _raises(lambda: resolve_caps({}, {"atoms": (10, policy)}))
        else:
            time.sleep(4.0)
            out["timeout"] = ("late", 0.0)
            dist.all_reduce(torch.zeros(64, dtype=torch.int64), group=exchange)  # drain rank 0's exchange
    return out


def test_checked_agreement_raises_on_every_rank(tmp_path: pathlib.Path) -> None:
    results = run_ranks(checked_worker, 2, tmp_path, timeout=180)
    for rank, r in enumerate(results):
        assert r["keys"][0].startswith("AgreementError: ddpad: ranks disagree on the cap keys at step 0")
        assert ("['atoms', 'edges', 'neighbors']" if rank else "['atoms', 'edges']") in r["keys"][0]
        assert "disagree on the cap keys" in r["names"][0]
        assert "ranks are at different cap-exchange steps" in r["steps"][0]
        assert r["keys"][1] < 5 and r["names"][1] < 5 and r["steps"][1] < 5  # seconds: no hang
        # one rank's bad input: it raises its own error, its peer learns on the same step
        if rank == 0:
            assert r["before_exchange"][0].startswith("KeyError")
        else:
            step = results[0]["before_exchange_step"] - 1  # the exchange rank 0 made alone to report it
            assert r["before_exchange"][0].startswith(
                f"AgreementError: ddpad: rank 0's step failed before the cap exchange at step {step}")
        assert r["before_exchange"][1] < 5
        assert r["before_exchange_step"] == results[0]["before_exchange_step"]
        first, second = r["after_exchange"]
        assert first[0] == ("RuntimeError: model blew up" if rank == 0 else "no error")
        # the step that failed and the rank, not the step that reported it (issue 27)
        assert second[0].startswith(
            "AgreementError: ddpad: rank 0's step failed after the cap exchange at step 0, reported at step 1")
        assert r["loaded_caps"] == results[0]["loaded_caps"] == {"atoms": 256, "edges": 4096, "systems": 8}
    assert "paired with a collective that is not ddpad's" in results[0]["paired"][0]
    message, seconds = results[0]["timeout"]
    assert message.startswith("AgreementError: ddpad: the cap exchange at step 0 timed out after 2 s")
    assert 1.5 < seconds < 10


def dead_peer_worker(rank: int, world: int) -> dict[str, Any]:
    import os

    import ddpad
    from ddpad.padding import CapPolicy, resolve_caps

    policy = CapPolicy(1.15)
    with ddpad.cap_agreement_group(None, "cpu", timeout=60.0):
        if rank == 1:
            os._exit(0)  # a peer that dies (its connection closes) instead of arriving
        return {"dead": _raises(lambda: resolve_caps({}, {"atoms": (10, policy)}))}


def test_a_dead_peer_is_not_reported_as_a_timeout(tmp_path: pathlib.Path) -> None:
    """gloo reports a peer that died within a second; the error says the
    collective failed (after how long), not that it "timed out after 60 s"."""
    import json

    import torch.multiprocessing as mp
    from _spawn import _entry, free_port

    ctx = mp.start_processes(_entry, args=(dead_peer_worker, 2, free_port(), str(tmp_path), ()), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not all(not p.is_alive() for p in ctx.processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
    message, seconds = json.loads((tmp_path / "rank0.json").read_text())["dead"]
    assert message.startswith("AgreementError: ddpad: the cap exchange at step 0 failed after"), message
    assert "timed out" not in message and seconds < 30


def ceilings_worker(rank: int, world: int) -> dict[str, Any]:
    """Rank 0's edges ceiling is 600, rank 1's 5000; rank 1 alone needs more
    edges each step. Every rank resolves the same caps, under 600, and
    raises CapacityError on the same step once the agreed need passes it."""
    import ddpad

    gen = torch.Generator().manual_seed(rank)
    padder = ddpad.padding.COOPadder(2.0, atom_outputs=("forces",))
    model = ddpad.PaddedModel(Summed(), padder, backend="eager", max_caps={"edges": 600 if rank == 0 else 5000})
    caps: list[dict[str, int]] = []
    failed = None
    with ddpad.cap_agreement_group(None, "cpu", timeout=60):
        for step in range(12):
            n, e = (40, 200) if rank == 0 else (40, 300 + 40 * step)
            try:
                model(graph(n, e, 1, gen))
            except ddpad.CapacityError as exc:
                failed = [step, str(exc)]
                break
            caps.append(dict(model.cap_state))
    return {"caps": caps, "failed": failed}


def test_ranks_resolve_the_same_caps_under_the_smallest_ceiling(tmp_path: pathlib.Path) -> None:
    """Before: each rank applied its own ceiling after the exchange, so rank
    1 grew its edges past 600 while rank 0 raised CapacityError alone, and
    rank 1 then waited in the next exchange."""
    results = run_ranks(ceilings_worker, 2, tmp_path, timeout=180)
    assert results[0]["caps"] == results[1]["caps"] and results[0]["caps"]
    assert all(c["edges"] <= 600 for c in results[0]["caps"])
    assert results[0]["failed"] is not None and results[0]["failed"][0] == results[1]["failed"][0]
    assert "its ceiling is 600 (another rank's" in results[1]["failed"][1]
    assert "its ceiling is 600; raise" in results[0]["failed"][1]
