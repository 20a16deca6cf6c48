"""``compile_mode="aot"``: ahead-of-time packages per caps and call form, on
the toy plugin model (an AOTInductor build of it takes seconds; real models
take minutes to tens of minutes here, behind the ``inductor`` marker)."""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest
import torch

import ddpad
import ddpad_toy_plugin as toy


def _frames(model: torch.nn.Module, count: int, rattle: float = 0.02) -> list[dict[str, torch.Tensor]]:
    system = toy.ADAPTER.tools.default_system()
    gen = torch.Generator().manual_seed(0)
    frames = []
    for _ in range(count):
        atoms = system.copy()
        atoms.positions += (torch.randn(len(atoms), 3, generator=gen, dtype=torch.float64) * rattle).numpy()
        frames.append(toy.ADAPTER.engine.build_input(model, atoms))
    return frames


def _same(out: dict[str, Any], ref: dict[str, Any], atol: float = 1e-10) -> None:
    for key in ("energy", "forces", "atom_energy"):
        torch.testing.assert_close(out[key], ref[key].detach(), rtol=0, atol=atol)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """One store for the module: the toy's package is built once."""
    return tmp_path_factory.mktemp("aot-store")


def test_steady_calls_run_the_package_exactly(store: pathlib.Path) -> None:
    model = toy.ADAPTER.tools.random_model()
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=store, cap_policy="headroom",
                         aot_build="foreground")
    for data in _frames(model, 6):
        _same(wrapped(data), model({k: v.clone() for k, v in data.items()}))
    s = wrapped.stats
    assert (s.aot_compiled + s.aot_loaded, s.aot_checked, s.aot_refused) == (1, 1, 0)
    assert s.graphs == 0  # no Dynamo on the call path


def test_another_process_loads_the_package_bit_for_bit(store: pathlib.Path) -> None:
    """At one thread: at two, under load (a busy loop beside it, or the other
    test worker), the same package's last bit varied between processes
    (1.158859838096933 built, ...0933 loaded; before and after the route
    interface), as accumulation order across threads does."""
    script = textwrap.dedent("""
        import json, sys, torch, ddpad, ddpad_toy_plugin as toy
        sys.path.insert(0, sys.argv[2])
        from test_aot import _frames
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = toy.ADAPTER.tools.random_model()
        wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=sys.argv[1],
                             cap_policy="headroom", aot_build="foreground")
        out = wrapped(_frames(model, 1)[0])
        s = wrapped.stats
        print(json.dumps({"compiled": s.aot_compiled, "loaded": s.aot_loaded, "graphs": s.graphs,
                          "forces": out["forces"].tolist(), "energy": out["energy"].tolist()}))
    """)
    import json

    runs = []
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", script, str(store / "procs"), str(pathlib.Path(__file__).parent)],
                             capture_output=True, text=True, timeout=600, check=False,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    built, loaded = runs
    assert (built["compiled"], built["loaded"]) == (1, 0) and (loaded["compiled"], loaded["loaded"]) == (0, 1)
    assert built["graphs"] == loaded["graphs"] == 0
    assert loaded["forces"] == built["forces"] and loaded["energy"] == built["energy"]


class _Branchy(toy.Morse):
    """A data-dependent branch: fake tracing cannot take it."""

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().forward(data)
        if bool(out["energy"].sum() > 1e9):
            out["energy"] = out["energy"] * 0
        return out


def test_a_data_dependent_branch_falls_back_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    model = _Branchy(3.0).double()
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", backend="aot_eager", cap_policy="headroom")
    frames = _frames(model, 3)
    with caplog.at_level(logging.WARNING, logger="ddpad"):
        outs = [wrapped(data) for data in frames]
    for out, data in zip(outs, frames):
        _same(out, model({k: v.clone() for k, v in data.items()}))
    lines = [r.getMessage() for r in caplog.records if "compile_mode='aot' falls back" in r.getMessage()]
    assert len(lines) == 1 and "tracing the step failed" in lines[0], lines
    s = wrapped.stats
    assert s.aot_refused == 1 and s.aot_compiled == 0 and s.graphs >= 1  # torch.compile took the steps


def test_a_fallback_that_disagrees_with_the_eager_step_runs_eager(caplog: pytest.LogCaptureFixture) -> None:
    """Where the package is refused, torch.compile's first call at the caps
    is checked too (Inductor's CPU code for orb was wrong at one thread)."""
    from _miscompiling import miscompiling  # (+1e-3 on every output: Inductor's wrong CPU code, as a backend)

    model = _Branchy(3.0).double()
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", backend=miscompiling, cap_policy="headroom")
    frames = _frames(model, 3)
    with caplog.at_level(logging.WARNING, logger="ddpad"):
        outs = [wrapped(data) for data in frames]
    for out, data in zip(outs, frames):
        _same(out, model({k: v.clone() for k, v in data.items()}))
    s = wrapped.stats
    assert (s.eager_forms, s.disagreements, s.aot_refused) == (1, 1, 1)
    assert "torch.compile disagrees with the eager step" in caplog.text


def test_each_caps_and_call_form_has_one_record_of_the_route_that_answered() -> None:
    """The compile manager keeps, per caps and call form, which route answered
    it (package, torch.compile or eager) and whether a compiled graph or
    package exists for it (its caps are then ready for a later growth)."""
    from _miscompiling import miscompiling

    def records(model: torch.nn.Module, **options: Any) -> list[tuple[str, bool]]:
        wrapped = ddpad.wrap(model, toy.ADAPTER, cap_policy="headroom", **options)
        for data in _frames(model, 2):
            wrapped(data)
        assert len(wrapped.manager.records) == 1  # one caps, one call form
        assert wrapped.manager.ready() == ([wrapped.caps] if wrapped.manager.records[
            next(iter(wrapped.manager.records))].compiled else [])
        return [(r.route, r.compiled) for r in wrapped.manager.records.values()]

    plain = toy.Morse(3.0).double()
    assert records(plain, compile_mode="aot", backend="aot_eager") == [("package", True)]
    assert records(plain, backend="aot_eager") == [("torch.compile", True)]
    assert records(_Branchy(3.0).double(), compile_mode="aot", backend="aot_eager") == [("torch.compile", True)]
    # (its graph ran once, disagreed, and those caps run the unpadded eager model since)
    assert records(_Branchy(3.0).double(), compile_mode="aot", backend=miscompiling) == [("unpadded", True)]
    assert records(plain, compile=False) == [("eager", False)]


def test_a_caller_who_differentiates_the_energy_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    model = toy.ADAPTER.tools.random_model()
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", backend="aot_eager", cap_policy="headroom")
    data = _frames(model, 1)[0]
    data["pos"].requires_grad_(True)
    with caplog.at_level(logging.WARNING, logger="ddpad"):
        wrapped(data)
    assert wrapped.stats.aot_refused == 1 and "differentiates" in caplog.text


def test_a_package_that_disagrees_with_the_eager_step_is_not_used(store: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from ddpad import _aot

    model = toy.ADAPTER.tools.random_model()
    original = _aot._Package.__call__

    def off(self: Any, leaves: list[torch.Tensor]) -> Any:
        out = original(self, leaves)
        return {**out, "energy": out["energy"] + 1e-3}

    monkeypatch.setattr(_aot._Package, "__call__", off)
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=store, backend="aot_eager",
                         cap_policy="headroom", aot_build="foreground")
    data = _frames(model, 1)[0]
    with caplog.at_level(logging.WARNING, logger="ddpad"):
        out = wrapped(data)
        again = wrapped(data)
    ref = model({k: v.clone() for k, v in data.items()})
    _same(out, ref)
    _same(again, ref)
    assert wrapped.stats.aot_refused == 1 and "disagrees with the eager step" in caplog.text


def test_the_check_reads_a_float32_models_float64_outputs_at_float32_tolerance() -> None:
    """MACE's float32 model returns float64 node energies carrying float32
    work: Inductor's reordering moved them 6e-8, and a float64 tolerance
    refused every package of it."""
    from ddpad._verify import disagreement as _close

    ref = {"node_energy": torch.ones(80, dtype=torch.float64), "forces": torch.ones(80, 3)}
    out = {"node_energy": ref["node_energy"] + 6e-8, "forces": ref["forces"].clone()}
    assert _close(out, ref, torch.nn.Linear(2, 2)) is None
    energies = {"node_energy": ref["node_energy"]}  # a float64 model's float64 output: float64 tolerance
    assert "max deviation" in str(_close({"node_energy": out["node_energy"]}, energies,
                                         torch.nn.Linear(2, 2).double()))
    assert _close(out, energies) == "2 outputs, the eager step 1"


def test_other_weights_are_another_package(store: pathlib.Path) -> None:
    first, other = toy.ADAPTER.tools.random_model(), toy.ADAPTER.tools.random_model()
    with torch.no_grad():
        other.depth += 0.1
    data = _frames(first, 1)[0]
    a, b = (ddpad.wrap(m, toy.ADAPTER, compile_mode="aot", compile_cache=store, cap_policy="headroom",
                       aot_build="foreground") for m in (first, other))
    a(data)
    b(data)
    assert b.stats.aot_loaded == 0 and b.stats.aot_compiled == 1 and b.stats.aot_refused == 0


def test_compile_mode_is_checked() -> None:
    model = toy.ADAPTER.tools.random_model()
    with pytest.raises(ValueError, match="compile_mode"):
        ddpad.wrap(model, toy.ADAPTER, compile_mode="jit")
    with pytest.raises(TypeError, match="compile=False"):
        ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile=False)


def test_ddpad_run_aot_builds_then_loads(tmp_path: pathlib.Path) -> None:
    """``ddpad run --aot`` twice: the first run builds its packages (the first
    caps, then the fitted ones), the second starts from the fitted caps and
    loads its one package, building nothing and compiling no graph."""
    import json

    from _cli import ddpad as cli

    runs = []
    for name in ("first.json", "second.json"):
        # aot_eager: the first run's fallback graphs are counted, not compiled by inductor (the package is)
        res = cli("run", "toy", "--aot", "--steps", "12", "--backend", "aot_eager", "--json", name, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        runs.append(json.loads((tmp_path / name).read_text()))
    first, second = runs
    # the first run: torch.compile at its caps while a worker builds the fitted caps' package (not the
    # first caps': they are about to be fitted), which the run waits for before it ends
    assert first["aot_background"] == 1 and first["aot_compiled"] == 0 and first["aot_refused"] == 0
    assert first["graphs"] >= 1
    assert (second["aot_compiled"], second["aot_loaded"], second["graphs"], second["aot_background"]) == (0, 1, 0, 0)


def test_a_missing_package_is_built_in_the_background_while_torch_compile_runs(tmp_path: pathlib.Path) -> None:
    model = toy.ADAPTER.tools.random_model()
    frames = _frames(model, 4)
    options = {"compile_mode": "aot", "compile_cache": tmp_path, "cap_policy": "headroom", "backend": "aot_eager"}
    with ddpad.wrap(model, toy.ADAPTER, **options) as wrapped:
        first = wrapped(frames[0])  # torch.compile now; the package in a worker
        s = wrapped.stats
        assert (s.aot_background, s.aot_compiled, s.aot_loaded) == (1, 0, 0) and s.graphs >= 1
        assert wrapped.finish_builds(timeout=600) == 0
        outs = [first, *(wrapped(data) for data in frames[1:])]
        assert (s.aot_loaded, s.aot_checked, s.aot_refused, s.aot_background) == (1, 1, 0, 1)
    for out, data in zip(outs, frames):
        _same(out, model({k: v.clone() for k, v in data.items()}))
    graphs = s.graphs
    again = ddpad.wrap(model, toy.ADAPTER, **options)
    again(frames[0])
    assert (again.stats.aot_loaded, again.stats.graphs, again.stats.aot_background) == (1, 0, 0)
    assert s.graphs == graphs  # the first model compiled nothing after it switched


def test_an_adapter_no_worker_can_rebuild_builds_its_package_in_the_call(tmp_path: pathlib.Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """An adapter made in a script (here a renamed copy of the toy's, whose
    hooks hold a lambda) is neither loaded by its name in another process nor
    pickled: by default its packages are built in the call that needs them,
    and asking for workers is one clear error. Before, the worker was sent
    its name, failed (``unknown ddpad adapter``), and those caps ran
    torch.compile with nothing built."""
    adapter = dataclasses.replace(toy.ADAPTER, name="toy-copy")
    model = toy.ADAPTER.tools.random_model()
    frames = _frames(model, 2)
    options = {"compile_mode": "aot", "compile_cache": tmp_path, "cap_policy": "headroom", "backend": "aot_eager"}
    with caplog.at_level(logging.WARNING, logger="ddpad"), ddpad.wrap(model, adapter, **options) as wrapped:
        outs = [wrapped(data) for data in frames]
        s = wrapped.stats
        assert (s.aot_compiled, s.aot_background, s.aot_checked, s.aot_refused, s.graphs) == (1, 0, 1, 0, 0)
    assert not [r for r in caplog.records if "build" in r.getMessage() and "failed" in r.getMessage()]
    for out, data in zip(outs, frames):
        _same(out, model({k: v.clone() for k, v in data.items()}))
    with pytest.raises(ValueError, match="needs an adapter a worker process can rebuild.*'toy-copy'"):
        ddpad.wrap(model, adapter, aot_build="background", **options)


def test_a_background_build_the_route_refuses_falls_back_with_its_reason(tmp_path: pathlib.Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PYTHONPATH", str(pathlib.Path(__file__).parent))  # (the worker unpickles _Branchy)
    model = _Branchy(3.0).double()
    frames = _frames(model, 3)
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=tmp_path, cap_policy="headroom",
                         backend="aot_eager")
    with caplog.at_level(logging.WARNING, logger="ddpad"):
        wrapped(frames[0])
        assert wrapped.finish_builds(timeout=600) == 0
        outs = [wrapped(data) for data in frames]
    for out, data in zip(outs, frames):
        _same(out, model({k: v.clone() for k, v in data.items()}))
    lines = [r.getMessage() for r in caplog.records if r.name == "ddpad" and r.levelno >= logging.WARNING
             and "backend 'aot_eager'" not in r.getMessage()]
    assert len(lines) == 1, lines  # one warning: the worker's failure, its log's last line
    assert "package build" in lines[0] and "exit status 2" in lines[0] and "tracing the step failed" in lines[0]
    assert wrapped.stats.aot_refused == 1


def test_aot_build_is_checked(tmp_path: pathlib.Path) -> None:
    model = toy.ADAPTER.tools.random_model()
    with pytest.raises(ValueError, match="aot_build must be"):
        ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", aot_build="later")
    with pytest.raises(ValueError, match="needs compile_cache"):
        ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", aot_build="background")
    with pytest.raises(TypeError, match="compile_mode='aot'"):
        ddpad.wrap(model, toy.ADAPTER, aot_build="foreground", compile_cache=tmp_path)


def test_precompile_aot_builds_the_ladder_in_workers_and_a_run_loads_every_rung(tmp_path: pathlib.Path) -> None:
    """``prebuild_packages`` (``ddpad precompile --aot``): the fitted caps and
    a rung, built by two workers at once; a run with ``warm_ladder=1`` from
    those caps loads both at its first call and grows into the rung with
    nothing traced, compiled or built."""
    from ddpad._prebuild import prebuild_packages

    model = toy.ADAPTER.tools.random_model()
    frames = _frames(model, 1)
    built = prebuild_packages(model, toy.ADAPTER, frames[0], store=tmp_path, rungs=1, workers=2, timeout=900)
    assert built.failed == {} and len(built.rungs) == 1 and built.fitted
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=tmp_path, caps=built.caps,
                         warm_ladder=1, cap_policy=ddpad.TightPolicy(settle=1), backend="aot_eager")
    wrapped(frames[0])
    s = wrapped.stats
    assert (s.aot_loaded, s.aot_compiled, s.aot_background, s.graphs) == (2, 0, 0, 0)
    system = toy.ADAPTER.tools.default_system()
    bigger = system + system[:1]
    bigger.positions[-1] += (1.2, 0.0, 0.0)
    data = toy.ADAPTER.engine.build_input(model, bigger)
    out = wrapped(data)
    _same(out, model({k: v.clone() for k, v in data.items()}))
    assert wrapped.caps in built.rungs and (s.aot_loaded, s.graphs, s.aot_background) == (2, 0, 0)


def _aot_rank(rank: int, world: int, store: str) -> dict[str, Any]:
    """One rank: its own atoms (fewer on rank 1), caps agreed with its peer,
    packages from one shared store."""
    import ddpad

    torch.manual_seed(0)
    model = toy.ADAPTER.tools.random_model()
    system = toy.ADAPTER.tools.default_system()
    atoms = system[: len(system) - 3 * rank]
    worst = 0.0
    with ddpad.cap_agreement_group(None, "cpu"):
        wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=store, cap_policy="headroom",
                             aot_build="foreground")
        for step in range(3):
            frame = atoms.copy()
            frame.rattle(0.02, seed=step + 10 * rank)
            data = toy.ADAPTER.engine.build_input(model, frame)
            out = wrapped(data)
            ref = model({k: v.clone() for k, v in data.items()})
            worst = max(worst, *(float((out[k] - ref[k].detach()).abs().max()) for k in ("energy", "forces")))
    s = wrapped.stats
    return {"compiled": s.aot_compiled, "loaded": s.aot_loaded, "refused": s.aot_refused, "graphs": s.graphs,
            "caps": wrapped.caps, "worst": worst}


@pytest.mark.slow
def test_ranks_share_one_package_per_caps(tmp_path: pathlib.Path) -> None:
    """Two gloo ranks with different atoms agree on caps; one builds the
    package (the store's lock), the other waits and loads it."""
    from _spawn import run_ranks

    results = run_ranks(_aot_rank, 2, tmp_path, str(tmp_path / "store"), timeout=900)
    assert results[0]["caps"] == results[1]["caps"]
    assert sorted((r["compiled"], r["loaded"]) for r in results) == [(0, 1), (1, 0)]
    assert all(r["refused"] == 0 and r["graphs"] == 0 and r["worst"] < 1e-10 for r in results)


def test_the_kit_checks_the_toy_through_the_route(tmp_path: pathlib.Path) -> None:
    """``ddpad.testing.check_aot`` (``AdapterTests.test_exact_through_aot``,
    behind the ``inductor`` marker for real models) on the toy plugin model:
    exact along a trajectory at one set of caps, dead rows inert through the
    loaded package, every call form."""
    from ddpad.testing import check_aot, default_trajectory

    model = toy.ADAPTER.tools.random_model()
    result = check_aot(toy.ADAPTER, model, default_trajectory(toy.ADAPTER, 4), atol=1e-10, store=tmp_path)
    assert result["refused"] == {} and result["worst"] < 1e-10
    assert result["checked"] >= 2 and result["loaded_by_second"] == 1


def test_bench_overhead_paths_columns() -> None:
    """``ddpad bench --overhead --paths``: a wrapped call's cost through
    torch.compile and through the package, beside the padder's own."""
    from ddpad._bench.overhead import format_table, overhead_table

    rows = overhead_table(sizes=(20,), calls=5, padders=["coo"], paths=True)
    assert len(rows) == 1 and rows[0]["compile_path_us"] > 0 and rows[0]["aot_path_us"] > 0
    assert "package path us" in format_table(rows)


def test_ddpad_precompile_aot_then_run_loads(tmp_path: pathlib.Path) -> None:
    """``ddpad precompile toy --aot --ladder 0`` builds the fitted caps'
    package in a worker; ``ddpad run toy --aot`` then starts from those caps
    and loads it, building and compiling nothing."""
    import json

    from _cli import ddpad as cli

    pre = cli("precompile", "toy", "--aot", "--ladder", "0", cwd=tmp_path)
    assert pre.returncode == 0, pre.stderr
    assert "1 package(s) in" in pre.stdout and "caps written to" in pre.stdout
    res = cli("run", "toy", "--aot", "--steps", "4", "--json", "run.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    run = json.loads((tmp_path / "run.json").read_text())
    assert (run["aot_loaded"], run["aot_compiled"], run["aot_background"], run["graphs"]) == (1, 0, 0, 0)
    bad = cli("precompile", "toy", "--aot", "--workers", "0", cwd=tmp_path)
    assert bad.returncode != 0 and "--workers must be >= 1" in bad.stderr


_ASE_AFTER_PRECOMPILE = """
import json, sys
import torch
import ddpad.ase
from ddpad.adapters import get

model, atoms = torch.load("model.pt", weights_only=False), get("toy").tools.default_system()
atoms.calc = calc = ddpad.ase.Calculator(model, "toy", compile_mode="aot")
atoms.get_forces()
stats = calc.wrapped.stats
json.dump({"caps": calc.wrapped.caps, "aot_loaded": stats.aot_loaded, "aot_compiled": stats.aot_compiled,
           "graphs": stats.graphs, "settling_steps": stats.settling_steps}, sys.stdout)
"""


def test_ddpad_precompile_aot_prepares_the_ase_calculator_s_first_call(tmp_path: pathlib.Path) -> None:
    """Before (#53): ``ddpad precompile --aot`` wrote the fitted caps where
    ``ddpad run`` looks, but ``ddpad.ase.Calculator(..., compile_mode="aot")``
    in the next process started from its own caps and built a third package
    (MACE: 288 s). The calculator, bound to the store, now starts from the
    cached caps of this model on this system and loads the package; a run
    with no cached caps keeps what it fits for the next process."""
    import json
    import os
    import subprocess
    import sys

    from _cli import ddpad as cli

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def ase_first_call() -> dict[str, object]:
        out = subprocess.run([sys.executable, "-c", _ASE_AFTER_PRECOMPILE], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=600, check=False)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    torch.save(toy.Morse().double(), tmp_path / "model.pt")  # the user's model, as the issue tried it
    pre = cli("precompile", "toy", "--aot", "--ladder", "0", "--model", "model.pt", cwd=tmp_path)
    assert pre.returncode == 0, pre.stderr
    cached = next((tmp_path / "cache" / "ddpad" / "caps").glob("toy-*.json"))
    caps = json.loads(cached.read_text())["caps"]
    first = ase_first_call()
    assert first == {"caps": caps, "aot_loaded": 1, "aot_compiled": 0, "graphs": 0, "settling_steps": 0}
    # cached_caps=False (ddpad run keeps the file itself: --no-caps) neither reads nor writes it
    script = _ASE_AFTER_PRECOMPILE.replace('compile_mode="aot")', 'compile_mode="aot", cached_caps=False)')
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["settling_steps"] == 1 and json.loads(cached.read_text())["caps"] == caps
    # with no cached caps the first call is the window's (eager); the fit is kept for the next process
    cached.unlink()
    script = _ASE_AFTER_PRECOMPILE.replace("atoms.get_forces()", """for step in range(10):
    atoms.positions[0, 0] += 0.001 * step
    atoms.get_forces()
fitted = dict(calc.wrapped.caps)
atoms.positions *= 0.8  # denser: more edges, the caps grow past the fit
atoms.get_forces()
print(json.dumps(fitted))""")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stderr
    assert "cached caps" not in out.stderr, out.stderr  # (before: a warning that the file did not exist)
    at_fit, grown = (json.loads(line) for line in out.stdout.split("\n")[:2])
    kept = json.loads(cached.read_text())
    # kept at the fit and again after the growth (before: at the fit only, so a warm run grew again)
    assert grown["settling_steps"] == 9 and kept["fitted"] is True
    assert kept["caps"] == grown["caps"] and grown["caps"]["edges"] > at_fit["edges"]


class _Stasher(toy.Morse):
    """Caches a tensor on itself on its first call (as lazily initialised
    models do), then takes a data-dependent branch the trace refuses: the
    trace's fake tensor must not stay on the model for the route after it."""

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if "offset" not in self.__dict__:
            self.offset = data["pos"].new_zeros(())
        out = super().forward(data)
        out["energy"] = out["energy"] + self.offset
        if bool(out["energy"].sum() > 1e9):
            out["energy"] = out["energy"] * 0
        return out


def test_a_refused_trace_leaves_the_model_as_it_was() -> None:
    model = _Stasher(3.0).double()
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", backend="aot_eager", cap_policy="headroom",
                         aot_build="foreground")
    for data in _frames(model, 2):
        _same(wrapped(data), _Stasher(3.0).double()({k: v.clone() for k, v in data.items()}))
    assert wrapped.stats.aot_refused == 1
    assert not isinstance(model.__dict__.get("offset"), torch._subclasses.FakeTensor)


def _changes(model: toy.Morse) -> list[tuple[str, Any]]:
    """Changes a user makes to a wrapped model between MD segments."""
    original = {k: v.clone() for k, v in model.state_dict().items()}

    def fill() -> None:
        with torch.no_grad():
            model.depth.fill_(0.9)

    def load() -> None:
        model.load_state_dict(original)  # back to the weights the first package holds

    def cutoff() -> None:
        model.cutoff = 2.5

    return [("fill_", fill), ("load_state_dict", load), ("cutoff", cutoff)]


def test_a_package_never_outlives_its_weights_or_hyper_parameters(tmp_path: pathlib.Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Before: after ``fill_``, ``load_state_dict`` or ``model.cutoff = 2.5``
    the package built first kept answering (energy off by 9-17 eV on the
    default system). A rebuild (a call whose caps did not change) raises
    none of torch's export deprecations at the user (``FutureWarning:
    isinstance(treespec, LeafSpec) is deprecated``)."""
    model = toy.ADAPTER.tools.random_model()
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=tmp_path, cap_policy="headroom",
                         aot_build="foreground")
    frame = _frames(model, 1)[0]
    _same(wrapped(frame), model({k: v.clone() for k, v in frame.items()}))
    s = wrapped.stats
    for name, change in _changes(model):
        change()
        with caplog.at_level(logging.WARNING, logger="ddpad"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            caplog.clear()
            out = wrapped(frame)
            again = wrapped(frame)
        assert not [w for w in caught if "LeafSpec" in str(w.message)], name
        ref = model({k: v.clone() for k, v in frame.items()})
        _same(out, ref)
        _same(again, ref)
        lines = [r.getMessage() for r in caplog.records if "model changed" in r.getMessage()]
        assert len(lines) == 1, (name, lines)
    # fill_ and cutoff built one package each; load_state_dict went back to the first weights: loaded
    assert (s.aot_compiled, s.aot_loaded, s.aot_refused, s.disagreements) == (3, 1, 0, 0)


def test_an_unchanged_model_costs_a_watch_and_no_rekey() -> None:
    """The watch reads counters and identities only; writing the same values
    back in place re-keys to the same key and keeps the package."""
    model = toy.ADAPTER.tools.random_model()
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", backend="aot_eager", cap_policy="headroom",
                         aot_build="foreground")
    frame = _frames(model, 1)[0]
    wrapped(frame)
    assert wrapped.manager.aot is not None and wrapped.manager.aot.watch.changed() is None
    key = wrapped.manager.aot.key
    with torch.no_grad():
        model.depth.copy_(model.depth.clone())
    assert "in place" in str(wrapped.manager.aot.watch.changed())
    wrapped(frame)
    assert wrapped.manager.aot.key == key and wrapped.stats.aot_compiled == 1


def test_a_weight_change_builds_the_new_package_in_the_background(tmp_path: pathlib.Path) -> None:
    """With background builds, a package of the new weights is built by a
    worker under the new weights' key (not reported as built because the
    old weights' package was) while torch.compile runs."""
    model = toy.ADAPTER.tools.random_model()
    frame = _frames(model, 1)[0]
    with ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=tmp_path, cap_policy="headroom",
                    backend="aot_eager") as wrapped:
        wrapped(frame)
        assert wrapped.finish_builds(timeout=600) == 0
        wrapped(frame)
        with torch.no_grad():
            model.depth.fill_(0.9)
        out = wrapped(frame)  # torch.compile, checked, while the new package builds
        assert wrapped.finish_builds(timeout=600) == 0
        again = wrapped(frame)
    ref = model({k: v.clone() for k, v in frame.items()})
    _same(out, ref)
    _same(again, ref)
    s = wrapped.stats
    assert (s.aot_background, s.aot_loaded, s.aot_compiled, s.aot_refused) == (2, 2, 0, 0)


def test_steady_table_times_the_package_beside_torch_compile_at_the_same_caps() -> None:
    """``ddpad bench --steady --package``: the package row runs the package
    (not a fallback) at the tight caps ``torch.compile``'s row has."""
    from ddpad._bench.steady import format_steady, steady_table

    model = toy.ADAPTER.tools.random_model()
    base = toy.ADAPTER.tools.default_system()
    structures = []
    for seed in range(3):
        atoms = base.copy()
        atoms.rattle(0.02, seed=seed)
        structures.append(atoms)
    result = steady_table(toy.ADAPTER, model, structures, backend="aot_eager", rounds=1, calls=2, package=True)
    rows = result["variants"]
    assert rows["package"]["route"] == "package"
    assert rows["package"]["caps"] == rows["tight"]["caps"]
    assert "package" in format_steady(result)


class _Indexed(toy.Morse):
    """The toy with a one-row embedding indexed by ``torch.tensor(0)`` made in
    its forward, as fairchem's ``DatasetEmbedding`` does (UMA): a 0-dim
    tensor constant in the traced step."""

    def __init__(self) -> None:
        super().__init__(3.0)
        self.offset = torch.nn.Embedding(1, 1, dtype=torch.float64)
        with torch.no_grad():
            self.offset.weight.fill_(0.25)

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().forward(data)
        return dict(out, energy=out["energy"] + self.offset(torch.tensor(0)).squeeze())


def test_a_step_indexing_with_a_scalar_tensor_constant_takes_the_package(store: pathlib.Path) -> None:
    """Inductor inlines a 0-dim tensor constant as a number, which its
    embedding lowering cannot take: the build failed ("LoweringException:
    AssertionError") and UMA's step fell back to torch.compile. Such a step
    is built keeping its tensor constants as buffers."""
    model = _Indexed()
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=store, cap_policy="headroom",
                         aot_build="foreground")
    for data in _frames(model, 3):
        _same(wrapped(data), model({k: v.clone() for k, v in data.items()}))
    s = wrapped.stats
    assert (s.aot_refused, s.aot_compiled + s.aot_loaded, s.aot_checked, s.graphs) == (0, 1, 1, 0), wrapped.manager.refused


def test_a_model_padding_at_its_own_seam_takes_packages_of_the_part_after_it(tmp_path: pathlib.Path) -> None:
    """A model that pads inside its forward (UMA) runs eager up to its seam
    and its compile region as one package per padded shape (before: the
    whole model fell back to torch.compile, "a package needs the padded input
    from outside"); exact against the unpadded model, no Dynamo, and a
    second model of the same weights loads the package."""
    from _mpnn import trajectory
    from test_runtime import SeamModel, assert_same, compile_core, padder

    steps = trajectory(4, (2, 2), seed=3)
    sizing = ddpad.PaddedModel(SeamModel(), padder(), pad_in_forward=True, compile=False, cap_policy="headroom")
    for data in steps:
        sizing(data)
    common: dict[str, Any] = dict(pad_in_forward=True, compile_region=compile_core, compile_mode="aot",
                                  compile_cache=tmp_path, caps=sizing.caps, cap_policy="headroom")
    runs = []
    for _ in range(2):
        model = SeamModel()
        reference = model.core  # (outside a ddpad context its seam pads nothing: the unpadded model)
        wrapped = ddpad.PaddedModel(model, padder(), **common)
        for data in steps:
            assert_same(wrapped(data), reference({k: v.clone() for k, v in data.items()}))
        runs.append(wrapped.stats)
    built, loaded = runs
    assert (built.aot_compiled, built.aot_loaded, built.aot_checked, built.aot_refused) == (1, 0, 1, 0)
    assert (loaded.aot_compiled, loaded.aot_loaded, loaded.aot_checked, loaded.aot_refused) == (0, 1, 1, 0)
    assert built.graphs == loaded.graphs == 0  # no Dynamo on the call path


class _Nudge(torch.nn.Module):
    """A part that cannot trace (a data-dependent branch), taking and giving
    the same kind of input as the part after it."""

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if bool(data["positions"].sum() > 1e9):
            data = dict(data, positions=data["positions"] * 0)
        return dict(data, positions=data["positions"] + 0.0)


class _TwoParts(torch.nn.Module):
    """A model padding at its own seam whose compile region is two parts
    (``traces``: the second one takes a package)."""

    def __init__(self, traces: bool) -> None:
        super().__init__()
        from _mpnn import MPNN

        self.first, self.core = _Nudge(), MPNN() if traces else torch.nn.Sequential(_Nudge(), MPNN())

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.core(self.first(ddpad.padding.current_dd_context().maybe_pad_graph(dict(data))))


@pytest.mark.parametrize("traces", [True, False], ids=["second-traces", "neither-traces"])
def test_each_part_after_a_seam_has_its_own_packages_refusals_and_checks(traces: bool) -> None:
    """Each part after a model's seam has its own packages, refusals and
    first-use checks, though both take the same dict of tensors. Before
    (first-use checks keyed by the padded shapes alone, shared by the
    parts): the second part's first torch.compile call went unchecked, its
    key having passed as the first part's. With the records table keyed by
    the call form alone, the first part's refusal refused the second's form
    too (its package never built) and the second ran a graph never compiled."""
    from _mpnn import trajectory
    from test_runtime import assert_same, padder

    def both(model: _TwoParts, compile_fn: Any) -> _TwoParts:
        model.first, model.core = compile_fn(model.first), compile_fn(model.core)
        return model

    model = _TwoParts(traces)
    first, core = model.first, model.core
    wrapped = ddpad.PaddedModel(model, padder(), pad_in_forward=True, compile_region=both, compile_mode="aot",
                                backend="aot_eager", cap_policy="headroom")
    for data in trajectory(3, (2, 2), seed=3):
        assert_same(wrapped(data), core(first({k: v.clone() for k, v in data.items()})))
    s = wrapped.stats
    assert s.checks == 2  # each part's first call: a package's or torch.compile's
    if traces:
        assert (s.aot_compiled, s.aot_checked, s.aot_refused) == (1, 1, 1), s
        assert s.routes == {"package": {"checked": 1, "refused": 1}, "torch.compile": {"checked": 1}}
    else:
        assert (s.aot_compiled, s.aot_refused) == (0, 2), s
        assert s.routes == {"package": {"refused": 2}, "torch.compile": {"checked": 2}}


def test_a_differentiating_caller_gets_a_graph_whether_or_not_the_package_is_built(store: pathlib.Path) -> None:
    """A package returns plain tensors, so every call whose caller
    differentiates runs torch.compile. Before, the check ran only while no
    package was built: once one was, such a caller got plain tensors
    ("element 0 of tensors does not require grad"); and a first call that
    differentiated refused the form for good, its later plain calls on
    torch.compile too."""
    model = toy.ADAPTER.tools.random_model().train()  # (its forces keep their graph: the caller's grad runs)
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=store, cap_policy="headroom",
                         aot_build="foreground", backend="aot_eager")
    frames = _frames(model, 4)
    wrapped(frames[0])  # the package, built or loaded
    for data in frames[1:3]:
        data = {k: v.clone() for k, v in data.items()}
        data["pos"].requires_grad_(True)
        out = wrapped(data)
        (grad,) = torch.autograd.grad(out["energy"].sum(), data["pos"])
        ref = model({k: v.clone() for k, v in data.items()})
        torch.testing.assert_close(-grad, ref["forces"].detach(), rtol=0, atol=1e-10)
    graphs = wrapped.stats.graphs
    _same(wrapped(frames[3]), model({k: v.clone() for k, v in frames[3].items()}))  # a plain call: the package
    s = wrapped.stats
    assert (s.aot_refused, s.graphs, wrapped.manager.refused) == (1, graphs, {})


def test_two_builds_of_the_same_code_at_once_each_package_their_own_weights(tmp_path: pathlib.Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Two models of one architecture (other weights) built at the same time
    in two processes of one machine, as CI's test workers do: AOTInductor
    wrote a build's files (the .so, its metadata) at a path named by the
    generated code alone, so the other process's build overwrote this one's
    before it was packaged, and this model's package held the other's
    (caught by the metadata check: "it holds a package built for ...", the
    build failing the call). The interleaving is made here: the other
    process builds between this build's compile and its packaging."""
    import torch._inductor.package as aoti_package

    script = textwrap.dedent("""
        import sys, torch, ddpad, ddpad_toy_plugin as toy
        sys.path.insert(0, sys.argv[2])
        from test_aot import _frames, _same
        model = toy.ADAPTER.tools.random_model()
        with torch.no_grad():
            model.depth += 0.1
        data = _frames(model, 1)[0]
        wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=sys.argv[1],
                             cap_policy="headroom", aot_build="foreground")
        _same(wrapped(data), model({k: v.clone() for k, v in data.items()}))
        assert (wrapped.stats.aot_compiled, wrapped.stats.aot_refused) == (1, 0), wrapped.stats
    """)
    package_aoti = aoti_package.package_aoti
    others: list[subprocess.CompletedProcess[str]] = []

    def package_after_the_other_build(*args: Any, **kwargs: Any) -> Any:
        if not others:
            others.append(subprocess.run([sys.executable, "-c", script, str(tmp_path / "other"),
                                          str(pathlib.Path(__file__).parent)],
                                         capture_output=True, text=True, timeout=600, check=False))
        return package_aoti(*args, **kwargs)

    monkeypatch.setattr(aoti_package, "package_aoti", package_after_the_other_build)
    model = toy.ADAPTER.tools.random_model()
    data = _frames(model, 1)[0]
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=tmp_path / "this",
                         cap_policy="headroom", aot_build="foreground")
    out = wrapped(data)
    assert len(others) == 1 and others[0].returncode == 0, others[0].stderr[-3000:]
    _same(out, model({k: v.clone() for k, v in data.items()}))
    assert (wrapped.stats.aot_compiled, wrapped.stats.aot_refused) == (1, 0)
