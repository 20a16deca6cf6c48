"""DistributedContext: inert default, nesting, restore on exception (SPEC section 7)."""

from __future__ import annotations

import threading

import pytest
import torch

import ddpad
from ddpad.padding import (
    NOT_DISTRIBUTED,
    COOPadder,
    DistributedContext,
    GatherMeta,
    HaloMeta,
    activate_dd_context,
    current_dd_context,
)


def test_inert_outside_any_scope() -> None:
    ctx = current_dd_context()
    assert ctx is NOT_DISTRIBUTED
    assert not ctx.is_distributed and not ctx.is_halo and not ctx.is_sharded
    assert ctx.world_size == 1 and ctx.rank == 0
    assert ctx.n_owned is None and ctx.n_padded is None and not ctx.compiling
    data = {"x": torch.ones(2)}
    assert ctx.maybe_pad_graph(data) is data
    with pytest.raises(AttributeError, match="read-only"):
        NOT_DISTRIBUTED.graph_padder = COOPadder(1.0)  # type: ignore[misc]


def test_nesting_restores_and_exceptions_restore() -> None:
    outer, inner = DistributedContext(strategy="halo"), DistributedContext(strategy="gather")
    with activate_dd_context(outer):
        assert current_dd_context() is outer
        with activate_dd_context(inner):
            assert current_dd_context() is inner
            with activate_dd_context(inner):  # re-entrant
                assert current_dd_context() is inner
            assert current_dd_context() is inner
        assert current_dd_context() is outer
        with pytest.raises(ValueError), activate_dd_context(inner):
            raise ValueError("boom")
        assert current_dd_context() is outer
    assert current_dd_context() is NOT_DISTRIBUTED


def test_threads_do_not_see_each_others_context() -> None:
    seen: list[DistributedContext] = []
    with activate_dd_context(DistributedContext(strategy="halo")):
        t = threading.Thread(target=lambda: seen.append(current_dd_context()))
        t.start()
        t.join()
    assert seen == [NOT_DISTRIBUTED]


def test_properties_with_metadata() -> None:
    halo = HaloMeta(n_owned=90, n_padded=128, send_sizes=(5, 7), n_global=200)
    ctx = DistributedContext(halo_meta=halo)
    assert ctx.is_halo and not ctx.is_sharded and ctx.is_distributed
    assert (ctx.n_owned, ctx.n_padded) == (90, 128)
    sharded = DistributedContext(gather_meta=GatherMeta(n_owned=10, n_padded=16, counts=(10, 12), n_global=22))
    assert sharded.is_sharded and sharded.is_distributed and sharded.n_owned == 10

    class Mesh:
        def size(self) -> int:
            return 4

        def get_rank(self) -> int:
            return 3

    meshed = DistributedContext(mesh=Mesh())
    assert meshed.world_size == 4 and meshed.rank == 3 and meshed.is_distributed
    assert not DistributedContext().is_distributed


def test_maybe_pad_graph_with_padder_uses_context_caps() -> None:
    padder = COOPadder(2.0, system_index=None, ptr=None, systems_policy=None)
    ctx = DistributedContext(graph_padder=padder, cap_atoms=False)
    data = {"positions": torch.zeros(10, 3), "edge_index": torch.zeros(2, 7, dtype=torch.long)}
    with activate_dd_context(ctx):
        out = current_dd_context().maybe_pad_graph(data)
    assert out["positions"].shape == (12, 3)  # atoms fixed: just the anchor pair
    assert ctx.cap_state == {"edges": 16}
    assert ddpad.padding.current_dd_context() is NOT_DISTRIBUTED
