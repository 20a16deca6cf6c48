"""Lockstep caps across real gloo ranks: one collective per step, same graphs per step."""

from __future__ import annotations

import pathlib
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
    padder = ddpad.COOPadder(2.0, atom_outputs=("forces",))
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
                padded = ddpad.COOPadder(2.0).pad(data, shadow)
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
