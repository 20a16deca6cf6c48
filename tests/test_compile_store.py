"""The compile store: keys, entries, locks, background workers, and a real
cold -> warm round trip through Inductor in fresh processes."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import ddpad
import pytest
import torch
from ddpad import CompileStore
from ddpad._store import _graph_key
from ddpad._store import store_environment as _store_environment

toy = pytest.importorskip("ddpad_toy_plugin")


def _model(dtype: torch.dtype = torch.float64, cutoff: float = 3.0) -> torch.nn.Module:
    return toy.Morse(cutoff).to(dtype)


def _data(model: torch.nn.Module, n: int = 27) -> dict[str, torch.Tensor]:
    from ase import Atoms

    g = torch.stack(torch.meshgrid(*[torch.arange(3.0)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    return toy.ADAPTER.engine.build_input(model, Atoms(f"Ar{n}", positions=(g * 1.3).numpy()))


def test_model_key_follows_architecture_dtype_and_backend_not_weights(tmp_path: pathlib.Path) -> None:
    store = CompileStore(tmp_path)
    env = _store_environment(toy.ADAPTER, {}, {"backend": "inductor", "dynamic": False})
    base = store.model_key(_model(), **env)
    retrained = _model()
    with torch.no_grad():
        retrained.depth.add_(0.5)
    assert store.model_key(retrained, **env) == base  # weights are graph inputs, not code
    assert store.model_key(_model(torch.float32), **env) != base
    assert store.model_key(_model(cutoff=3.5), **env) != base  # a hyper-parameter Dynamo bakes in
    other = _store_environment(toy.ADAPTER, {}, {"backend": "aot_eager", "dynamic": False})
    assert store.model_key(_model(), **other) != base
    assert json.loads((tmp_path / base / "model.json").read_text())["adapter"] == "toy"


@pytest.mark.parametrize(("adapter", "distribution"), [("mace", "mace-torch"), ("allegro", "nequip-allegro")])
def test_model_key_follows_the_model_packages_distribution_version(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, adapter: str, distribution: str) -> None:
    """The key records the version of the distribution that provides the
    adapter's model package (``mace`` is installed as ``mace-torch``), so an
    upgrade changes it; before, ``requires`` import names were looked up as
    distribution names, ``mace`` was not found and e3nn's version went in."""
    import dataclasses
    import importlib.metadata

    from ddpad import adapters

    requires = tuple(adapters.status(adapter)["requires"])  # the built-in's, installed or not
    declared = dataclasses.replace(toy.ADAPTER, name=adapter, requires=requires)
    provides = {"mace": ["mace-torch"], "e3nn": ["e3nn"], "allegro": ["nequip-allegro"], "nequip": ["nequip"]}
    versions = {"mace-torch": "0.3.14", "e3nn": "0.4.4", "nequip-allegro": "0.8.2", "nequip": "0.14.0"}
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: provides)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name])
    store, model = CompileStore(tmp_path), _model()

    def key() -> str:
        return store.model_key(model, **_store_environment(declared, {}, {"backend": "inductor"}))

    before = key()
    recorded = json.loads((tmp_path / before / "model.json").read_text())["packages"]
    assert recorded[distribution] == versions[distribution]
    versions[distribution] += ".post1"  # pip install -U of the model package alone
    assert key() != before


def test_graph_key_follows_caps() -> None:
    seen: list[list[str]] = []

    def capture(gm: torch.fx.GraphModule, inputs: list) -> object:
        seen[-1].append(_graph_key("m", gm, inputs))
        return gm.forward

    model = _model()
    for caps in ({"atoms": 32, "edges": 704, "systems": 2}, {"atoms": 32, "edges": 704, "systems": 2},
                 {"atoms": 48, "edges": 704, "systems": 2}):
        torch._dynamo.reset()
        seen.append([])
        wrapped = ddpad.wrap(model, toy.ADAPTER, caps=caps, backend=capture, on_recompile="ignore")
        wrapped(_data(model))
    assert seen[0] == seen[1] and not set(seen[0]) & set(seen[2])


def test_corrupt_or_truncated_entries_are_set_aside(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CompileStore(tmp_path)
    entry = store.entry("m", "g")
    store.write(entry, b"artifacts" * 100)
    assert store.read(entry) == b"artifacts" * 100
    entry.write_bytes(entry.read_bytes()[:-10])  # a writer killed mid-way without the atomic rename
    with caplog.at_level(logging.WARNING, logger="ddpad"):
        assert store.read(entry) is None
    assert "checksum" in caplog.text and entry.with_suffix(".corrupt").exists() and not entry.exists()
    entry.write_bytes(b"garbage")
    assert store.read(entry) is None and not store.load(entry)


def test_concurrent_writers_never_leave_a_mix(tmp_path: pathlib.Path) -> None:
    writer = textwrap.dedent("""
        import sys; from ddpad import CompileStore
        store = CompileStore(sys.argv[1]); entry = store.entry("m", "g")
        for i in range(150):
            store.write(entry, sys.argv[2].encode() * (1000 + i))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(tmp_path), tag]) for tag in ("a", "b")]
    store = CompileStore(tmp_path)
    reads = 0
    while any(p.poll() is None for p in procs):
        payload = store.read(store.entry("m", "g"))
        if payload is not None:
            assert set(payload) in ({ord("a")}, {ord("b")})
            reads += 1
    assert all(p.returncode == 0 for p in procs) and reads > 0
    assert not list(tmp_path.glob("m/*.corrupt"))


def test_one_process_compiles_the_other_waits_then_loads(tmp_path: pathlib.Path) -> None:
    holder = textwrap.dedent("""
        import sys, time; from ddpad import CompileStore
        store = CompileStore(sys.argv[1]); entry = store.entry("m", "g")
        with store.lock(entry) as mine:
            print(mine, flush=True); time.sleep(1.5); store.write(entry, b"compiled")
        time.sleep(5)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "True"
        store = CompileStore(tmp_path)
        entry = store.entry("m", "g")
        t0 = time.monotonic()
        with store.lock(entry) as mine:
            assert not mine and store.read(entry) == b"compiled"  # waited, then load
        assert time.monotonic() - t0 > 0.5
    finally:
        proc.wait(30)


def test_lock_wait_is_bounded(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    holder = textwrap.dedent("""
        import sys, time; from ddpad import CompileStore
        store = CompileStore(sys.argv[1]); entry = store.entry("m", "g")
        with store.lock(entry):
            print("held", flush=True); time.sleep(30)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        store = CompileStore(tmp_path, wait_timeout=1.0)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="ddpad"), store.lock(store.entry("m", "g")) as mine:
            assert mine  # gave up waiting: compile here
        assert 0.9 < time.monotonic() - t0 < 10 and "compiling here" in caplog.text
    finally:
        proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie has exited
        return fh.read().split()[2] != "Z"


def test_background_worker_starts_at_the_threshold_and_close_stops_it(tmp_path: pathlib.Path) -> None:
    model = _model()
    wrapped = ddpad.wrap(model, toy.ADAPTER, backend="aot_eager", compile_cache=tmp_path, background_compile=0.5,
                         cap_policy="headroom")
    with wrapped:
        wrapped(_data(model, 20))  # the caps as sized: whatever their fill, nothing starts
        assert wrapped.stats.background_started == 0
        wrapped(_data(model, 22))  # needs rising past what was seen, to fills past 0.5
        assert wrapped.stats.background_started >= 1
        assert wrapped.manager.background is not None
        procs = list(wrapped.manager.background.running.values())
        assert procs and all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)
    assert wrapped.stats.background_wasted == wrapped.stats.background_started


def test_no_background_compile_for_needs_the_caps_were_sized_for(tmp_path: pathlib.Path) -> None:
    """Before: every tight run started a background compile at its fit (the
    fitted caps' fill, about 0.97, is past a 0.9 trigger), and every run from
    fitted caps at its first call, for caps nothing needed (a 100-step
    ``ddpad run mace``: 1 started, 0 used). A worker starts only for a need
    that rises past every need the caps were sized for."""
    from ase import Atoms

    model = _model()
    grid = torch.stack(torch.meshgrid(*[torch.arange(3.0)] * 3, indexing="ij"), -1).reshape(-1, 3) * 1.3
    frames = []
    for step in range(5):
        atoms = Atoms("Ar27", positions=grid.numpy())
        atoms.rattle(0.05, seed=step)
        frames.append(toy.ADAPTER.engine.build_input(model, atoms))
    options = {"backend": "aot_eager", "compile_cache": tmp_path, "background_compile": 0.9}
    # (changing=1.0: the 27-atom cluster's edges swing past 4 % when rattled, and this is about fitted caps)
    with ddpad.wrap(model, toy.ADAPTER, cap_policy=ddpad.TightPolicy(settle=5, changing=1.0), **options) as wrapped:
        for data in [*frames, *frames]:  # fitted on the fifth call; then the needs the window saw
            wrapped(data)
        assert wrapped.stats.fit_calls == 1 and wrapped.stats.background_started == 0
        wrapped.save_caps(tmp_path / "caps.json")
    with ddpad.wrap(model, toy.ADAPTER, caps=tmp_path / "caps.json", cap_policy="tight", **options) as again:
        for data in sorted(frames, key=lambda d: d["edge_index"].shape[1]):  # rising, to the window's peak
            again(data)
        assert again.stats.fits == [] and again.stats.background_started == 0


@pytest.mark.parametrize("ending", ["exception", "killed"])
def test_background_workers_do_not_outlive_their_run(tmp_path: pathlib.Path, ending: str) -> None:
    script = textwrap.dedent(f"""
        import os, signal, sys, torch, ddpad, ddpad_toy_plugin as toy
        sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        from test_compile_store import _data, _model
        model = _model()
        wrapped = ddpad.wrap(model, toy.ADAPTER, backend="aot_eager", compile_cache=sys.argv[1],
                             background_compile=0.5,
                         cap_policy="headroom")
        wrapped(_data(model, 20))
        wrapped(_data(model, 22))
        print(" ".join(str(p.pid) for p in wrapped.manager.background.running.values()), flush=True)
        if {ending!r} == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("the MD loop failed")
    """)
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         check=False)
    pids = [int(p) for p in res.stdout.split()]
    assert pids, res.stderr[-2000:]
    if ending == "exception":
        assert "the MD loop failed" in res.stderr
    else:
        assert res.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 90  # a worker notices after its imports
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


_FIRST_CALL = textwrap.dedent("""
    import json, sys, time, torch, ddpad, ddpad_toy_plugin as toy
    sys.path.insert(0, sys.argv[2])
    from test_compile_store import _data, _model
    model = _model()
    warm = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_cache=sys.argv[1], on_recompile="raise", warm_ladder=warm,
                         cap_policy="headroom")
    out = wrapped(_data(model))
    s = wrapped.stats
    print(json.dumps({"compiled": s.graphs_compiled, "loaded": s.graphs_loaded, "hits": s.store_hits,
                      "rungs": s.rungs_warmed, "store_loads": s.store_loads,
                      "misses": s.store_misses, "energy": out["energy"].tolist(), "forces": out["forces"].tolist()}))
""")


@pytest.mark.inductor
@pytest.mark.parametrize("rungs", [0, 2], ids=["caps", "warm-ladder"])
def test_a_warm_process_loads_every_graph_and_matches_bit_for_bit(tmp_path: pathlib.Path, rungs: int) -> None:
    """Inductor, two fresh processes with their own (empty) Inductor caches:
    the second compiles nothing and returns the same bits; with a warm
    ladder, its rungs too (what ``ddpad precompile --ladder`` leaves)."""
    runs = []
    for name in ("cold", "warm"):
        # one thread: Inductor's parallel reductions round differently from run to run
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{name}"), "OMP_NUM_THREADS": "1"}
        res = subprocess.run([sys.executable, "-c", _FIRST_CALL, str(tmp_path / "store"),
                              str(pathlib.Path(__file__).parent), str(rungs)], env=env, capture_output=True,
                             text=True, check=False, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["rungs"] == warm["rungs"] == rungs
    assert cold["compiled"] >= 1 + rungs and cold["loaded"] == 0 and cold["misses"] == cold["compiled"]
    assert warm["compiled"] == 0 and warm["loaded"] == cold["compiled"] and warm["hits"] == cold["compiled"]
    assert cold["store_loads"] == 0 and warm["store_loads"] == warm["loaded"]  # every load was the store's
    assert warm["energy"] == cold["energy"] and warm["forces"] == cold["forces"]


def test_precompile_walks_the_bucket_ladder(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ddpad import cli

    assert cli.main(["precompile", "toy", "--backend", "aot_eager", "--ladder", "2",
                     "--compile-cache", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("caps {")]
    ladder = [json.loads(line[len("caps "):line.index("}") + 1].replace("'", '"')) for line in lines]
    assert len(ladder) == 3
    for low, high in zip(ladder, ladder[1:]):  # every count that grows with the atoms one bucket up per rung
        assert high["atoms"] > low["atoms"] and high["edges"] > low["edges"]
        assert high["systems"] == low["systems"]  # the system count does not scale with the atoms
    assert cli.main(["precompile", "toy", "--ladder", "-1"]) == 2


@pytest.mark.long
def test_bench_compile_store_reports_both_comparisons(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpad import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "toy", "--compile-store", "--backend", "aot_eager", "--steps", "12"]) == 0
    out = capsys.readouterr().out
    assert "cold" in out and "warm" in out and "foreground" in out and "background" in out
    report = json.loads((tmp_path / "ddpad-bench.json").read_text())
    assert report["warm_start"]["warm"]["energy"] == report["warm_start"]["cold"]["energy"]
    assert len(report["growing"]["background"]["times"]) == 12 and (tmp_path / "ddpad-bench.png").exists()


@pytest.mark.long
def test_bench_first_call_reports_first_calls_only(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``--first-call``: the benchmarks page's first-call rows, without the growing trajectory."""
    from ddpad import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "toy", "--first-call", "--backend", "aot_eager", "--out", "first.json"]) == 0
    report = json.loads((tmp_path / "first.json").read_text())
    assert set(report) == {"adapter", "model", "system", "atoms", "device", "dtype", "warm_start"}
    assert "foreground" not in capsys.readouterr().out
    assert set(report["warm_start"]) == {"cold", "store", "warm", "aot build", "aot load"}
    assert report["warm_start"]["aot load"]["graphs_compiled"] == 0



def test_bench_first_call_children_get_a_dtype(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --dtype the children were handed None, which an adapter's
    random_model need not take (nequip: "nequip models are float32 or
    float64, got None"): they get the dtype ddpad run would use."""
    from ddpad import cli
    from ddpad._bench import warmstart as _warmstart

    seen = []

    def fake(adapter: str, **kwargs: object) -> dict:
        seen.append(kwargs["dtype"])
        row = {"first_call_s": 1.0, "graphs_compiled": 1, "graphs_loaded": 0, "steady_s": 0.1, "energy": [0.0]}
        return {"cold": row}

    monkeypatch.setattr(_warmstart, "warm_start", fake)
    out = tmp_path / "first.json"
    assert cli.main(["bench", "toy", "--first-call", "--out", str(out)]) == 0
    assert cli.main(["bench", "toy", "--first-call", "--dtype", "float64", "--out", str(out)]) == 0
    assert seen == [str(torch.get_default_dtype()).removeprefix("torch."), "float64"]
    assert json.loads(out.read_text())["dtype"] == "float64"


def test_bench_first_call_runs_the_model_and_system_given(tmp_path: pathlib.Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, ``--first-call`` ran the adapter's random model on its own
    system whatever ``--model``, ``--system`` and ``--repeat`` said (a
    SevenNet-0 row would have timed a random model). The children get them,
    and load that model on that structure; ``--compile-store`` (whose
    growing run is the adapter's own) refuses them."""
    import ase.io
    from ase import Atoms
    from ddpad import cli
    from ddpad._bench import warmstart as _warmstart
    from ddpad.adapters import get

    toy = get("toy")
    model = toy.tools.random_model(torch.float64)
    with torch.no_grad():
        model.depth.mul_(1.7)  # not the random model a child would build
    torch.save(model, tmp_path / "toy.pt")
    system = Atoms("Ar8", positions=[[1.3 * i, 0.4 * (i % 2), 0.0] for i in range(8)])
    ase.io.write(tmp_path / "chain.xyz", system)
    seen = []
    real = _warmstart.warm_start

    def first_only(adapter: str, **kwargs: object) -> dict:
        seen.append(kwargs)
        spec = {"adapter_name": adapter, "store": str(tmp_path / "store"), "backend": "eager", "device": "cpu",
                "dtype": kwargs["dtype"], "model": kwargs["model"], "system": None}
        if kwargs["system"] is not None:
            spec["system"] = str(tmp_path / "given.extxyz")
            kwargs["system"].write(spec["system"], format="extxyz")
        return {"cold": _warmstart.first_call(**spec)}

    monkeypatch.setattr(_warmstart, "warm_start", first_only)
    out = tmp_path / "first.json"
    assert cli.main(["bench", "toy", "--first-call", "--model", str(tmp_path / "toy.pt"), "--system",
                     str(tmp_path / "chain.xyz"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["system"] == "Ar8" and report["atoms"] == 8 and report["model"] == f"model {tmp_path / 'toy.pt'}"
    assert seen[-1]["model"] == str(tmp_path / "toy.pt") and len(seen[-1]["system"]) == 8
    ref = toy.flat(toy.reference(model, toy.engine.build_input(model, system)))
    # (the children run the dtype ddpad run would, float32 here: the model's energy to float32's precision)
    assert report["warm_start"]["cold"]["energy"] == pytest.approx(ref["energy"].double().reshape(-1).tolist(),
                                                                   rel=1e-6)
    assert cli.main(["bench", "toy", "--first-call", "--repeat", "2", "--system", str(tmp_path / "chain.xyz"),
                     "--out", str(out)]) == 2  # a non-periodic system cannot repeat: one line, before any child
    monkeypatch.setattr(_warmstart, "warm_start", real)
    assert cli.main(["bench", "toy", "--compile-store", "--model", str(tmp_path / "toy.pt")]) == 2


@pytest.mark.slow
def test_a_growth_loads_what_a_background_worker_compiled(tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor: at 72 % edge fill a worker compiles the next edge bucket;
    the growth to it then compiles nothing and loads the worker's graph,
    and the result matches the eager model."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the worker inherits it
    model = _model()
    with ddpad.wrap(model, toy.ADAPTER, compile_cache=tmp_path / "store", background_compile=0.7,
                    cap_policy="headroom") as wrapped:
        wrapped(_data(model, 20))  # 300 edges: cap 416
        wrapped(_data(model, 21))  # more edges, fill past 0.7
        assert wrapped.stats.background_started == 1 and wrapped.manager.background is not None
        (worker,) = wrapped.manager.background.running.values()
        assert worker.wait(900) == 0
        compiled, loaded = wrapped.stats.graphs_compiled, wrapped.stats.graphs_loaded
        data = _data(model, 24)  # 418 edges: the cap grows to 544, the bucket the worker compiled
        out = wrapped(data)
        assert wrapped.caps["edges"] == 544 and wrapped.stats.background_used == 1
        assert wrapped.stats.graphs_compiled == compiled and wrapped.stats.graphs_loaded > loaded
    reference = model(_data(model, 24))
    torch.testing.assert_close(out["forces"], reference["forces"].detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(out["energy"], reference["energy"].detach(), rtol=0, atol=1e-10)


def test_a_graph_past_torchs_caches_counts_as_uncached(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph that only returns its inputs (nvalchemi's DD has a few) is
    compiled past torch's caches (AOTAutograd bypasses them), in
    milliseconds. It is counted apart, so that a second rank compiling it
    again is not taken for a store that failed to share (issue 14: 3 of
    nvalchemi's 26 graphs per rank), and gets no entry (before, such a graph
    saved the process's other artifacts under its key, and loading that
    entry then "missed")."""
    from torch._inductor.compile_fx import compile_fx

    from ddpad._compile import _CountingBackend
    from ddpad._stats import Stats
    from ddpad._store import bind_store as store_link

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    class Passthrough(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return a, b

    gm = torch.fx.symbolic_trace(Passthrough())
    inputs = [torch.ones(3), torch.zeros(2)]
    link = store_link(Passthrough(), tmp_path / "store", None, {}, backend="inductor", dynamic=False)
    def under_dynamo(graph: torch.fx.GraphModule, example: list[torch.Tensor]) -> object:
        """What torch reports for such a graph that Dynamo hands over (seen
        in nvalchemi's run): an AOTAutograd miss, nothing saved, no Inductor
        graph. Called directly, compile_fx bypasses the caches instead."""
        torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_miss"] += 1
        return graph.forward

    for inner in (compile_fx, under_dynamo, compile_fx, under_dynamo):  # two processes each, one store
        stats = Stats()
        with caplog.at_level(logging.INFO, logger="ddpad"):
            _CountingBackend(inner, stats, link)(gm, inputs)
        assert (stats.graphs_compiled, stats.graphs_uncached, stats.graphs_loaded) == (1, 1, 0)
        assert (stats.store_hits, stats.store_misses) == (0, 0)  # nothing to keep: no entry to hit or miss
    assert not list((tmp_path / "store").rglob("*.bin"))
    assert "caches missed" not in caplog.text


def _growing(model: torch.nn.Module, atoms: int) -> list[dict[str, torch.Tensor]]:
    """The toy cluster gaining one atom per frame, each 1.2 A from a random
    atom: the edges grow about twice as fast as the atoms."""
    import numpy as np

    system, rng, frames = toy.ADAPTER.tools.default_system(), np.random.default_rng(0), []
    for _ in range(atoms):
        extra = system[int(rng.integers(len(system)))].position + 1.2 * (d := rng.normal(size=3)) / np.linalg.norm(d)
        system = system + system[:1].copy()
        system.positions[-1] = extra
        frames.append(toy.ADAPTER.engine.build_input(model, system))
    return frames


def test_a_warm_ladder_serves_every_growth_without_a_compile(tmp_path: pathlib.Path) -> None:
    """The first call warms 5 rungs; the system then grows 27 -> 66 atoms
    through all of them: every growth takes a rung and compiles nothing,
    exactly."""
    model = _model()
    frames = _growing(model, 40)
    wrapped = ddpad.wrap(model, toy.ADAPTER, backend="aot_eager", on_recompile="raise", warm_ladder=5,
                         cap_policy="headroom")
    for data in frames:
        out = wrapped(data)
        ref = model(data)
        torch.testing.assert_close(out["energy"], ref["energy"].detach(), rtol=0, atol=1e-10)
        torch.testing.assert_close(out["forces"], ref["forces"].detach(), rtol=0, atol=1e-10)
    s = wrapped.stats
    assert s.rungs_warmed == 5 and s.growth_calls >= 4 and s.rungs_used == s.growth_calls
    assert set(s.graphs_by_call) == {0} and s.unexplained == []
    assert wrapped.caps in wrapped.rungs
    # without the ladder every growth compiles
    plain = ddpad.wrap(model, toy.ADAPTER, backend="aot_eager", on_recompile="raise")
    for data in frames:
        plain(data)
    assert len(plain.stats.graphs_by_call) == 1 + plain.stats.growth_calls


class _Fussy(toy.Morse):
    """Fails above 96 atoms, as a model out of memory at a large rung would."""

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if data["pos"].shape[0] > 96:
            raise RuntimeError("out of memory (simulated)")
        return super().forward(data)


def test_a_warm_ladder_stops_below_ceilings_and_a_failing_rung(caplog: pytest.LogCaptureFixture) -> None:
    model = _Fussy(3.0).double()
    capped = ddpad.wrap(model, toy.ADAPTER, backend="aot_eager", warm_ladder=4, max_caps={"edges": 1300},
                        cap_policy="headroom")
    out = capped(_data(model))
    assert [r["edges"] for r in capped.rungs] == [928, 1216] and capped.stats.rungs_warmed == 2
    with caplog.at_level(logging.WARNING, logger="ddpad"):
        failing = ddpad.wrap(model, toy.ADAPTER, backend="aot_eager", warm_ladder=4, cap_policy="headroom")
        assert torch.equal(failing(_data(model))["energy"], out["energy"])  # the first call's result stands
    assert [r["atoms"] for r in failing.rungs] == [64, 96] and failing.stats.rungs_warmed == 2
    assert "warming caps {'atoms': 128" in caplog.text and "out of memory (simulated)" in caplog.text
    assert failing.caps == capped.caps == {"atoms": 48, "systems": 4, "edges": 704}
    with pytest.raises(ValueError, match="warm_ladder must be a number of rungs >= 0"):
        ddpad.wrap(model, toy.ADAPTER, warm_ladder=-1)


def test_the_ladder_grows_every_count_but_the_systems() -> None:
    """A dense padder's neighbour columns (AIMNet2's keys) are fewer than the
    atoms but grow with them: every rung moves them too; ``systems`` stays;
    the ladder ends where every growing key is at its ceiling."""
    from ddpad.padding import CapPolicy
    from ddpad._ladder import ladder
    from ddpad._capacity import CapResolution

    def resolved(atoms_max: int | None = None, neighbours_max: int | None = None) -> list[CapResolution]:
        return [CapResolution("atoms", 50, 50, None, 64, CapPolicy(1.15, 1.15, strict_gt=False, max_cap=atoms_max)),
                CapResolution("systems", 9, 9, None, 12, CapPolicy(1.0, 1.5, 4)),
                CapResolution("neighbors", 11, 11, None, 16, CapPolicy(1.0, 1.25, 8, max_cap=neighbours_max))]

    caps = {"atoms": 64, "systems": 12, "neighbors": 16}
    assert ladder(caps, resolved(), 2) == [{"atoms": 80, "systems": 12, "neighbors": 24},
                                           {"atoms": 96, "systems": 12, "neighbors": 32}]
    assert ladder(caps, resolved(80, 24), 3) == [{"atoms": 80, "systems": 12, "neighbors": 24}]


def test_a_background_worker_grows_the_system_count_when_it_fills(tmp_path: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Rungs keep the number of systems, so a worker started because the
    system count filled compiles that key one bucket up, not a rung whose
    caps the growth of the system count would not fit."""
    import dataclasses

    model = _model()
    wrapped = ddpad.wrap(model, toy.ADAPTER, backend="aot_eager", compile_cache=tmp_path, background_compile=0.9,
                         cap_policy="headroom")
    assert wrapped.manager.background is not None
    started: list[dict[str, int]] = []
    monkeypatch.setattr(wrapped.manager.background, "_start", lambda owner, target, *rest: started.append(dict(target)))
    wrapped(_data(model))  # every fill below 0.9: nothing starts
    assert started == []
    caps = wrapped.caps
    full = [dataclasses.replace(r, real=r.cap - 1, need=r.cap) if r.key == "systems" else r
            for r in wrapped.last_resolutions]
    wrapped.manager.background.after_call(wrapped, None, (), {}, full)
    assert len(started) == 1 and started[0]["systems"] > caps["systems"]
    assert {k: v for k, v in started[0].items() if k != "systems"} == {k: v for k, v in caps.items() if k != "systems"}


def test_each_entry_holds_its_own_graph_only(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four graphs of two models compiled by Inductor in one process, through
    one store: four entries whose artifacts are disjoint, their total size
    within 10 % of every artifact held once. Before, torch's cumulative list
    went into each entry: entry N held graphs 1..N, both models' (about
    2.5 times the size here), and every new compile rewrote them all."""
    from torch._inductor.compile_fx import compile_fx
    from torch.compiler._cache import CacheArtifactManager

    from ddpad._compile import _CountingBackend
    from ddpad._stats import Stats
    from ddpad._store import bind_store as store_link

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    class Scaled(torch.nn.Module):
        def __init__(self, power: int) -> None:
            super().__init__()
            self.power = power

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x.sin() * 2.0).pow(self.power).sum(-1)

    with CacheArtifactManager.with_fresh_cache():  # (what other tests compiled stays out of it)
        for model in (Scaled(2), Scaled(3)):
            link = store_link(model, tmp_path / "store", None, {}, backend="inductor", dynamic=False)
            compiled = torch.compile(model, backend=_CountingBackend(compile_fx, Stats(), link), dynamic=False)
            for rows in (3, 5):  # two graphs a model: other shapes
                compiled(torch.rand(rows, 4))
        link.flush()
    entries = sorted((tmp_path / "store").rglob("*.bin"))
    assert len(entries) == 4, entries
    store = ddpad.CompileStore(tmp_path / "store")
    keys, distinct = [], {}
    for path in entries:
        artifacts = CacheArtifactManager.deserialize(store.read(path))
        held = [a for kind in artifacts.values() for a in kind]
        keys.append({a.key for a in held})
        distinct.update({a.key: len(a.content) for a in held})
    assert all(keys) and all(not (a & b) for i, a in enumerate(keys) for b in keys[i + 1:]), keys
    total = sum(path.stat().st_size for path in entries)
    assert total <= 1.1 * sum(distinct.values()), (total, sum(distinct.values()))


def test_a_lazily_compiled_backward_goes_to_a_late_file_and_is_loaded(tmp_path: pathlib.Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A backward Inductor compiles when the caller differentiates the
    outputs, after the forward's entry was written: ``flush`` writes it to a
    ``late-*.bin`` file of its own (the entry is not written again), and the
    next binding of the model's key hands it to torch."""
    from torch._inductor.compile_fx import compile_fx
    from torch.compiler._cache import CacheArtifactManager

    from ddpad._compile import _CountingBackend
    from ddpad._stats import Stats
    from ddpad._store import bind_store as store_link

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with CacheArtifactManager.with_fresh_cache():
        link = store_link(model, tmp_path / "store", None, {}, backend="inductor", dynamic=False)
        compiled = torch.compile(model, backend=_CountingBackend(compile_fx, Stats(), link), dynamic=False)
        x = torch.rand(5, 4, requires_grad=True)
        out = compiled(x)
        (entry,) = (tmp_path / "store").rglob("*.bin")
        written = entry.stat().st_mtime_ns
        out.sum().backward()  # the backward compiles now
        link.flush()
        link.flush()  # nothing new: nothing written
    late = sorted((tmp_path / "store").rglob("late-*.bin"))
    assert len(late) == 1 and entry.stat().st_mtime_ns == written
    assert store_link(model, tmp_path / "store", None, {}, backend="inductor", dynamic=False).load_late() == 1
