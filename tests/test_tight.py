"""Tight caps (``cap_policy="tight"``): caps fitted to the needs a run saw,
in fine strides, in lockstep across ranks, restarted tight from a caps file."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import pytest
import torch

import ddpad
from ddpad._capacity import TightCaps
from ddpad._padders._policies import ATOMS_POLICY, EDGES_POLICY, NEIGHBORS_POLICY
from _spawn import run_ranks
from test_agreement import graph as _graph

TIGHT = ddpad.TightPolicy()


def graph(n: int, e: int, gen: torch.Generator, s: int = 1) -> dict[str, torch.Tensor]:
    return _graph(n, e, s, gen)


class Pairwise(torch.nn.Module):
    """Energy from the padded graph: a dead row that leaked would change it."""

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pos, (i, j) = data["positions"], data["edge_index"]
        d = (pos[i] - pos[j]).pow(2).sum(-1)
        energy = torch.zeros(int(data["ptr"].numel()) - 1, dtype=pos.dtype).index_add(
            0, data["batch"][i], torch.exp(-d))
        return {"energy": energy, "forces": pos * 2}


def wrapped(**options: Any) -> ddpad.PaddedModel:
    padder = ddpad.padding.COOPadder(2.0, atom_outputs=("forces",), system_outputs=("energy",))
    return ddpad.PaddedModel(Pairwise(), padder, **{"compile": False, **options})


# -- the fit ----------------------------------------------------------------------


@pytest.mark.parametrize("need", [256, 300, 1000, 2736, 22_090, 100_000])
@pytest.mark.parametrize("policy", [ATOMS_POLICY, EDGES_POLICY])
def test_a_fitted_cap_fills_at_least_95_percent_from_256_rows(need: int, policy: ddpad.padding.CapPolicy) -> None:
    cap = TIGHT.fit(policy, need)
    assert policy.fits(need, cap) and cap % 1 == 0
    assert need / cap >= 0.95, (need, cap)
    # a count that held still is fitted with no margin: an MD run's atoms
    assert need / TIGHT.fit(policy, need, 0.0) >= 0.99


@pytest.mark.parametrize("need", range(1, 256, 7))
def test_a_small_count_is_fitted_within_one_stride_plus_its_dead_row(need: int) -> None:
    for policy in (ATOMS_POLICY, EDGES_POLICY):
        cap = TIGHT.fit(policy, need)
        assert policy.fits(need, cap)
        assert cap <= need * (1 + TIGHT.margin) + 1 + 16


def test_dense_neighbour_columns_fit_at_least_90_percent() -> None:
    for need in range(20, 200):
        assert need / TIGHT.fit(NEIGHBORS_POLICY, need) >= 0.90, need
    # today's head room, for the record: one growth of the widest column
    assert 33 / NEIGHBORS_POLICY.grow(33) < 0.80


def test_growths_after_the_fit_double_their_step_and_stop_at_the_padders_own() -> None:
    steps = [TIGHT.grow(EDGES_POLICY, 10_000, k) / 10_000 for k in range(6)]
    assert steps == sorted(steps)
    assert 1.03 < steps[0] < 1.05 and steps[1] > 1.07
    assert TIGHT.grow(EDGES_POLICY, 10_000, 10) == EDGES_POLICY.grow(10_000)


@pytest.mark.parametrize("bad", [{"settle": 0}, {"settle": 1.5}, {"margin": -0.1}, {"margin": 0.5},
                                 {"margin": True}, {"changing": -0.01}, {"changing": float("nan")}, {"changing": "4%"}])
def test_a_bad_tight_policy_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ddpad.TightPolicy(**bad)


# -- a run under it ----------------------------------------------------------------


def test_a_run_settles_once_then_holds_its_caps_at_high_fill() -> None:
    gen = torch.Generator().manual_seed(0)
    model = wrapped(cap_policy="tight")
    caps = []
    for step in range(40):
        model(graph(300, 3000 + (step * 37) % 61, gen))
        caps.append(model.caps)
    assert caps[8] == caps[0]  # the window: the padder's own head room
    assert caps[9] != caps[8] and caps[9] == caps[-1]  # fitted on call 10, held after
    assert model.stats.fit_calls == 1 and {e.call for e in model.stats.fits} == {9}
    assert {"atoms", "edges"} <= {e.key for e in model.stats.fits}
    assert model.stats.growths == []
    fill = model.stats.mean_fill
    assert fill["atoms"] >= 0.99 and fill["edges"] >= 0.95, fill
    assert model.caps["edges"] >= 3060  # the highest need seen, not the last


def test_headroom_keeps_the_reference_caps() -> None:
    gen = torch.Generator().manual_seed(0)
    model = wrapped(cap_policy="headroom")
    for step in range(20):
        model(graph(300, 3000 + (step * 37) % 61, gen))
    assert model.caps["edges"] == ddpad.padding.bucket(3000, 1.35, 16)
    assert model.stats.fits == []


def test_a_growth_in_the_window_fits_every_cap_on_that_call() -> None:
    gen = torch.Generator().manual_seed(0)
    model = wrapped(cap_policy=ddpad.TightPolicy(changing=1.0))  # (the 50 % jump is not taken as a changing run)
    model(graph(300, 3000, gen))
    model(graph(300, 4500, gen))  # edges overflow the head room on call 2
    assert model.stats.fit_calls == 1 and model.stats.growths == []
    assert model.caps["edges"] == TIGHT.fit(EDGES_POLICY, 4500)
    assert model.caps["atoms"] == TIGHT.fit(ATOMS_POLICY, 300, 0.0)


def test_a_growth_in_the_window_of_a_changing_run_grows_as_head_room() -> None:
    gen = torch.Generator().manual_seed(0)
    model = wrapped(cap_policy="tight")
    model(graph(300, 3000, gen))
    model(graph(300, 4500, gen))  # a 50 % jump: a changing run, settled on this call
    assert model.sizer is not None and model.sizer.settled and model.stats.fits == []
    assert model.caps == {"atoms": ATOMS_POLICY.initial(300), "systems": model.caps["systems"],
                          "edges": EDGES_POLICY.grow(4500)}
    assert model.stats.changing_run == "step 1: edges swung 50.0 % over 2 calls"


def changing_frames(gen: torch.Generator, calls: int = 25) -> list[dict[str, torch.Tensor]]:
    """A run that inserts an atom on every call (its edges with it): the
    counts swing 9 % over a ten-call window, 24 % over the run (within the
    head room of the first call's caps)."""
    return [graph(100 + k, 10 * (100 + k), gen) for k in range(calls)]


def test_a_changing_run_keeps_head_room_caps_and_grows_as_head_room_does() -> None:
    """Before (#53): tight caps fitted the window's needs with a 2 % margin
    and then grew on every few insertions (a compile each): on MACE over
    ``ddpad bench``'s changing trajectory, four graphs to head room's one.
    A window that swung past ``changing`` keeps the caps head room has."""
    gen = torch.Generator().manual_seed(0)
    frames = changing_frames(gen) + [graph(140, 1400, gen), graph(190, 1900, gen)]  # then two overflows
    tight, headroom = wrapped(cap_policy="tight"), wrapped(cap_policy="headroom")
    caps = []
    for data in frames:
        tight(data), headroom(data)
        caps.append((tight.caps, headroom.caps))
    assert all(a == b for a, b in caps[TIGHT.settle - 1:]), caps
    assert tight.stats.fits == [] and len(tight.stats.growths) == len(headroom.stats.growths) > 0
    assert tight.stats.changing_run is not None and tight.stats.changing_run.endswith("swung 9.0 % over 10 calls")
    assert tight.sizer is not None and tight.sizer.changing == tight.stats.changing_run.split(": ", 1)[1]


def test_a_steady_run_under_the_threshold_is_still_fitted() -> None:
    gen = torch.Generator().manual_seed(0)
    model = wrapped(cap_policy=ddpad.TightPolicy(changing=0.10))  # the same run, a wider threshold
    for data in changing_frames(gen, 10):
        model(data)
    assert model.stats.fit_calls == 1 and model.stats.changing_run is None
    assert model.caps["edges"] == TIGHT.fit(EDGES_POLICY, 1090)


def test_a_changing_run_compiles_no_more_graphs_than_head_room() -> None:
    gen = torch.Generator().manual_seed(0)
    frames = changing_frames(gen)
    counts = {}
    for policy in ("tight", "headroom"):
        model = wrapped(compile=True, backend="aot_eager", cap_policy=policy, on_recompile="raise")
        for data in frames:
            model(data)
        counts[policy] = model.stats.graphs
        eager = wrapped(compile=False)
        ref, got = eager(frames[-1]), model(frames[-1])
        assert all(torch.allclose(got[k], ref[k], atol=1e-10) for k in ref)
    assert counts == {"tight": 1, "headroom": 1}


def test_fitted_caps_give_the_headroom_run_s_numbers() -> None:
    gen = torch.Generator().manual_seed(1)
    frames = [graph(200, 2000 + 7 * k, gen, s=2) for k in range(15)]
    tight, headroom = wrapped(cap_policy="tight"), wrapped(cap_policy="headroom")
    for data in frames:
        a, b = tight(data), headroom(data)
        torch.testing.assert_close(a["energy"], b["energy"], rtol=0, atol=1e-12)
        torch.testing.assert_close(a["forces"], b["forces"], rtol=0, atol=0)
    assert tight.caps["edges"] < headroom.caps["edges"]


def test_a_call_that_raises_while_fitting_leaves_the_window_open() -> None:
    gen = torch.Generator().manual_seed(0)
    model = wrapped(cap_policy=ddpad.TightPolicy(settle=3))
    model(graph(100, 1000, gen))
    model(graph(100, 1000, gen))
    before = model.caps
    broken = graph(100, 1000, gen)
    broken["edge_index"] = broken["edge_index"].double()  # the model's index_add raises
    with pytest.raises(IndexError):
        model(broken)
    assert model.caps == before and model.sizer is not None and not model.sizer.settled
    model(graph(100, 1000, gen))
    assert model.sizer.settled and model.caps != before


def test_a_restart_from_a_caps_file_starts_tight(tmp_path: pathlib.Path) -> None:
    gen = torch.Generator().manual_seed(0)
    first = wrapped(cap_policy="tight")
    for _ in range(12):
        first(graph(300, 3000, gen))
    first.save_caps(tmp_path / "caps.json")
    again = wrapped(cap_policy="tight", caps=tmp_path / "caps.json")
    again(graph(300, 3000, gen))
    assert again.caps == first.caps and again.stats.fits == []
    assert json.loads((tmp_path / "caps.json").read_text())["caps"] == first.caps


def test_a_caps_file_of_a_headroom_run_is_fitted_after_the_window(tmp_path: pathlib.Path) -> None:
    gen = torch.Generator().manual_seed(0)
    old = wrapped(cap_policy="headroom")
    old(graph(300, 3000, gen))
    old.save_caps(tmp_path / "caps.json")
    assert "fitted" not in json.loads((tmp_path / "caps.json").read_text())
    tight = wrapped(cap_policy="tight", caps=tmp_path / "caps.json")
    for _ in range(10):
        tight(graph(300, 3000, gen))
    assert tight.stats.fit_calls == 1 and tight.caps["edges"] < old.caps["edges"]


def test_growths_after_the_fit_are_small_and_widen() -> None:
    gen = torch.Generator().manual_seed(0)
    model = wrapped(cap_policy=ddpad.TightPolicy(settle=2))
    model(graph(300, 3000, gen))
    model(graph(300, 3000, gen))
    fitted = model.caps["edges"]
    edges = fitted
    for _ in range(4):  # a system whose edges keep climbing past the cap
        edges = model.caps["edges"] + 1
        model(graph(300, edges, gen))
    steps = [e.new / e.old for e in model.stats.growths]
    assert len(steps) == 4 and steps == sorted(steps) and steps[0] < 1.06, steps
    assert model.caps["edges"] < EDGES_POLICY.grow(fitted + 1) * 1.3 ** 3  # headroom would be far above


def test_default_is_tight_where_growth_is_cheap() -> None:
    from ddpad._options import WrapOptions

    assert WrapOptions(compile=False).tight_policy(False) is not None
    assert WrapOptions().tight_policy(store_bound=True) is not None
    assert WrapOptions(warm_ladder=2).tight_policy(False) is not None
    assert WrapOptions().tight_policy(store_bound=False) is None  # a plain compile: every growth compiles
    assert WrapOptions(cap_policy="headroom", compile=False).tight_policy(False) is None
    assert WrapOptions(cap_policy="tight").tight_policy(False) == ddpad.TightPolicy()
    with pytest.raises(ValueError, match="cap_policy"):
        WrapOptions(cap_policy="snug")


def test_shrink_under_tight_refits() -> None:
    gen = torch.Generator().manual_seed(0)
    model = wrapped(cap_policy=ddpad.TightPolicy(settle=2), shrink=ddpad.ShrinkPolicy(below=0.8, after=3))
    for _ in range(2):
        model(graph(300, 3000, gen))
    for _ in range(4):  # edges drop for good
        model(graph(300, 1500, gen))
    assert model.stats.shrinks and model.caps["edges"] == TIGHT.fit(EDGES_POLICY, 1500)


# -- compiled: graphs, the warm ladder -----------------------------------------------


def test_a_tight_run_compiles_once_at_its_fit_and_nothing_unexplained() -> None:
    """Before (#53): the first call compiled at head-room caps and the fit on
    call 9 compiled again (two graphs, one used nine times); the window's
    calls now run the eager step, and the one graph is the fitted one."""
    gen = torch.Generator().manual_seed(0)
    model = wrapped(compile=True, backend="aot_eager", cap_policy="tight", on_recompile="raise")
    inputs = [graph(120, 1200 + step % 7, gen) for step in range(20)]
    for data in inputs:
        model(data)
    stats = model.stats
    assert stats.graphs == stats.fit_calls == 1 and stats.growth_calls == 0
    assert set(stats.graphs_by_call) == {TIGHT.settle - 1} and stats.settling_steps == TIGHT.settle - 1
    eager = wrapped(compile=False)
    for data in inputs[-3:]:  # the compiled calls after the window give the model's numbers
        ref, got = eager(data), model(data)
        assert all(torch.allclose(got[k], ref[k], atol=1e-10) for k in ref)


def test_the_warm_ladder_fits_on_the_first_call_and_climbs_in_fine_rungs() -> None:
    """Under a warm ladder the caps are fitted on the first call (the margin
    kept) and the rungs warmed right after it: no stall ten steps in."""
    gen = torch.Generator().manual_seed(0)
    model = wrapped(compile=True, backend="aot_eager", cap_policy="tight", warm_ladder=2, on_recompile="raise")
    model(graph(120, 1200, gen))
    fitted, rungs = model.caps, model.rungs
    assert fitted["edges"] == TIGHT.fit(EDGES_POLICY, 1200) and model.stats.fits == []
    assert len(rungs) == 2 and fitted["edges"] < rungs[0]["edges"] < EDGES_POLICY.grow(fitted["edges"] + 1)
    assert set(model.stats.graphs_by_call) == {0}
    graphs = model.stats.graphs
    for _ in range(12):  # past the window: nothing is fitted again
        model(graph(120, 1200, gen))
    model(graph(120, fitted["edges"] + 1, gen))  # a growth lands on the first rung: no compile
    assert model.caps == rungs[0] and model.stats.graphs == graphs and model.stats.rungs_used == 1


def test_background_targets_are_the_fine_rungs() -> None:
    from ddpad._background import Background
    from ddpad._capacity import CapResolution
    from ddpad._ladder import Ladder, ladder

    sizer = TightCaps(TIGHT, settled=True)
    caps = {"atoms": 304, "edges": 3072}
    resolved = [CapResolution("atoms", 300, 301, 304, 304, ATOMS_POLICY),
                CapResolution("edges", 3000, 3000, 3072, 3072, EDGES_POLICY)]
    fine, coarse = ladder(caps, resolved, 1, sizer)[0], ladder(caps, resolved, 1)[0]
    assert caps["edges"] < fine["edges"] < coarse["edges"]
    assert fine["edges"] == TIGHT.grow(EDGES_POLICY, 3073, 0)
    background = Background.__new__(Background)  # what after_call would start, without a worker
    started: list[Any] = []
    background.__dict__.update(sizer=sizer, running={}, logs={}, targets=set(), disabled=False, threshold=0.9,
                               workers=1, ladder=Ladder(), sized=None, peaks={})
    def start(owner: Any, target: Any, *args: Any) -> None:
        started.append(dict(target))
        background.targets.add(target)

    background._start = start  # type: ignore[method-assign]

    class Owner:
        cap_state = caps

    background.after_call(Owner(), None, (), {}, resolved)  # the caps as sized: at fill 0.99 nothing starts
    assert started == []
    rising = [dataclasses.replace(r, real=r.real + 1, need=r.need + 1) for r in resolved]
    background.after_call(Owner(), None, (), {}, rising)
    assert started == [fine]


# -- lockstep -------------------------------------------------------------------------


def tight_worker(rank: int, world: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank)
    model = wrapped(cap_policy=ddpad.TightPolicy(settle=5))
    caps = []
    with ddpad.cap_agreement_group(None, "cpu"):
        for step in range(12):
            # rank 1 alone carries the largest need, and overflows on step 7
            edges = 900 + 40 * rank + (600 if rank == 1 and step >= 7 else 0)
            model(graph(100 + 10 * rank, edges, gen))
            caps.append(model.caps)
    return {"caps": caps, "fits": [e.call for e in model.stats.fits],
            "growths": [e.call for e in model.stats.growths]}


@pytest.mark.slow
def test_ranks_fit_the_same_caps_on_the_same_call(tmp_path: pathlib.Path) -> None:
    results = run_ranks(tight_worker, 2, tmp_path, timeout=300)
    assert results[0]["caps"] == results[1]["caps"]
    assert results[0]["fits"] == results[1]["fits"] and set(results[0]["fits"]) == {4}
    caps = results[0]["caps"]
    assert caps[4]["edges"] == TIGHT.fit(EDGES_POLICY, 940, 0.0)  # the MAX need over the ranks (held still)
    assert caps[4]["atoms"] == TIGHT.fit(ATOMS_POLICY, 111, 0.0)
    assert results[0]["growths"] == results[1]["growths"] and results[0]["growths"]


def test_a_fit_on_one_call_keeps_the_margin() -> None:
    """``ddpad precompile`` fits on its first call: one call says nothing of
    how a count moves, so every cap keeps the margin (without it the run's
    first rattled frame grew the edges at once, past the precompiled rungs)."""
    gen = torch.Generator().manual_seed(0)
    model = wrapped(cap_policy=ddpad.TightPolicy(settle=1))
    model(graph(300, 3000, gen))
    assert model.stats.fits == [] and model.caps["edges"] == TIGHT.fit(EDGES_POLICY, 3000)
    assert model.caps["edges"] >= 3060


class Slow(Pairwise):
    """A step that takes ``seconds`` (what a shrink would save a fraction of)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import time

        time.sleep(self.seconds)
        return super().forward(data)


def _shrinking(model: torch.nn.Module, shrink: ddpad.ShrinkPolicy) -> ddpad.PaddedModel:
    padder = ddpad.padding.COOPadder(2.0, atom_outputs=("forces",), system_outputs=("energy",))
    # (verify=False: the first-use check is one more step on every compiling call, counted in what a new
    # graph costs, as it should be; these step times and margins were set for the compile alone)
    return ddpad.PaddedModel(model, padder, backend="eager", cap_policy="headroom", shrink=shrink,
                             on_recompile="ignore", verify=False)


def test_a_shrink_that_would_compile_waits_until_it_pays() -> None:
    """Dynamo's trace of the first call (a compile) against steps of 1 ms: a
    shrink that saves half a millisecond over 3 calls does not pay, and the
    caps stay; one back to caps that ran before is free and is taken."""
    gen = torch.Generator().manual_seed(0)
    model = _shrinking(Pairwise(), ddpad.ShrinkPolicy(below=0.6, after=3))
    model(graph(300, 3000, gen))
    big = model.caps
    for _ in range(7):
        model(graph(100, 600, gen))
    assert model.stats.shrinks == [] and model.caps == big and model.shrinker is not None
    assert model.shrinker.compile_seconds > 0
    # a slow step pays for the compile: each step after the first takes as long as the first call did
    # (its trace and sleep, measured), so the streak's saving (most of a step, over 3 calls) exceeds it under
    # any load (a fixed 0.5 s step lost to a trace of more than 0.4 s on a loaded 2-core machine)
    slow = _shrinking(Slow(0.05), ddpad.ShrinkPolicy(below=0.6, after=3))
    slow(graph(300, 3000, gen))
    assert slow.shrinker is not None and slow.shrinker.compile_seconds > 0.05
    slow.model.seconds = slow.shrinker.compile_seconds
    for _ in range(4):
        slow(graph(100, 600, gen))
    assert slow.stats.shrinks and slow.caps["edges"] < big["edges"]


def test_a_shrink_to_caps_that_ran_before_is_free() -> None:
    gen = torch.Generator().manual_seed(0)
    model = _shrinking(Pairwise(), ddpad.ShrinkPolicy(below=0.6, after=3, factor=1.35))
    model(graph(100, 600, gen))  # these caps ran: their graph is in Dynamo's cache
    small = model.caps
    model(graph(300, 3000, gen))  # grows
    for _ in range(4):
        model(graph(100, 600, gen))
    assert model.caps == small and {e.key for e in model.stats.shrinks} == {"atoms", "edges"}


def test_a_tight_precompile_is_where_the_next_run_starts(tmp_path: pathlib.Path) -> None:
    """``ddpad precompile`` fits on its one call and writes the caps where
    ``ddpad run`` of that model on that system looks; the run starts from
    them, fitted: no window, no fit, no growth on a static start."""
    from _cli import ddpad as cli

    store = str(tmp_path / "store")
    pre = cli("precompile", "toy", "--backend", "aot_eager", "--ladder", "1", "--compile-cache", store, cwd=tmp_path)
    assert pre.returncode == 0, pre.stderr
    (cached,) = (tmp_path / "cache" / "ddpad" / "caps").glob("toy-Ar27-*.json")
    doc = json.loads(cached.read_text())
    assert doc["fitted"] is True and f"caps written to {cached}" in pre.stdout
    run = cli("run", "toy", "--steps", "12", "--backend", "aot_eager", "--compile-cache", store,
              "--json", "run.json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert f"caps loaded from {cached}" in run.stdout
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["fits"] == [] and report["growths"] == [] and report["caps"] == doc["caps"]
