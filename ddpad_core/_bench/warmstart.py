"""Cold vs warm first calls, and a growing system with and without background
compiles, each in a fresh process (``ddpad bench ADAPTER --compile-store``).

Three fresh processes run the adapter's default model and system once
through ``ddpad.wrap(..., compile_cache=STORE)``:

- ``cold``: an empty store and an empty Inductor cache directory;
- ``store``: the store the cold run filled, an empty Inductor cache (another
  machine or container: on a CPU, Inductor rebuilds the C++ kernels from the
  stored source; a GPU's Triton kernels travel in the entry);
- ``warm``: the store and the Inductor cache the cold run filled (a restart
  on the same machine).

Each reports the first call's wall time (imports excluded), what compiled
and loaded, and the energy, which must be bit-identical.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = [
    "first_call", "format_growing", "format_warm_start", "growing", "growing_run", "plot_growing", "precompile_run",
    "random_model", "warm_start",
]


def first_call(adapter_name: str, store: str, backend: str, device: str, dtype: str | None,
               compile_mode: str = "dynamo", model: str | None = None, system: str | None = None) -> dict[str, Any]:
    """One first call in this process (the child's side), then 20 steady
    calls on the same input (their median: ``steady_s``). ``model``: a file
    or name for the adapter's ``load_model`` (default: its random model);
    ``system``: an ASE-readable file (default: the adapter's system)."""
    import ddpad
    import torch
    from ddpad import adapters

    adapter = adapters.get(adapter_name)
    torch.manual_seed(0)
    atoms = adapter.tools.default_system() if system is None else _read(system)
    torch_dtype = getattr(torch, dtype) if dtype else None
    if model is None:
        module = random_model(adapter, torch_dtype, device, {int(z) for z in atoms.numbers})
    else:
        module = adapter.tools.load_model(model, device)
        module = module.to(torch_dtype) if torch_dtype else module
    data = adapter.engine.build_input(module, atoms)
    # head room: the caps of the first call are the caps of every run (a tight one fits them later)
    # (the AOT rows: this process builds the package, as a first process would with aot_build="foreground")
    aot = {"aot_build": "foreground"} if compile_mode == "aot" else {}
    wrapped = ddpad.wrap(module, adapter, compile_cache=store, backend=backend, compile_mode=compile_mode,
                         cap_policy="headroom", **aot)
    t0 = time.perf_counter()
    out = adapter.flat(wrapped(data))
    seconds = time.perf_counter() - t0
    steady = []
    for _ in range(20):
        t1 = time.perf_counter()
        wrapped(data)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        steady.append(time.perf_counter() - t1)
    energy = out[adapter.flat_energy_key].detach().double().cpu()
    forces = out["forces"].detach().double().cpu() if "forces" in out else torch.zeros(0)
    s = wrapped.stats
    return {
        "first_call_s": seconds, "graphs_compiled": s.graphs_compiled + s.aot_compiled,
        "graphs_loaded": s.graphs_loaded + s.aot_loaded, "aot_loaded": s.aot_loaded, "aot_refused": s.aot_refused,
        "compile_s": s.compile_seconds + s.aot_seconds, "load_s": s.load_seconds + s.aot_load_seconds,
        "store_hits": s.store_hits, "energy": energy.tolist(), "forces": forces.tolist(),
        "steady_s": sorted(steady)[len(steady) // 2],
    }


def random_model(adapter: Any, dtype: Any, device: str, numbers: set[int]) -> Any:
    """The adapter's random model, built for ``numbers`` as well as its own
    elements where it takes elements (``ToolHooks.random_model_elements``:
    mace, sevennet), as ``ddpad run`` builds it."""
    options: dict[str, Any] = {}
    if adapter.tools.random_model_elements is not None:
        options["atomic_numbers"] = tuple(sorted(set(adapter.tools.random_model_elements) | numbers))
    return adapter.tools.random_model(dtype, device, **options)


def _read(path: str) -> Any:
    import ase.io

    return ase.io.read(path, format="extxyz")


def warm_start(adapter: str, *, backend: str = "inductor", device: str = "cpu", dtype: str | None = None,
               workdir: str | None = None, aot: bool = True, model: str | None = None,
               system: Any = None) -> dict[str, dict[str, Any]]:
    """Run the cold, store-only and warm first calls (and, with ``aot``, the
    ahead-of-time route's build and load); returns each one's result.
    ``model``: a file or name the adapter's ``load_model`` takes (default:
    its random model); ``system``: an ``ase.Atoms`` (default: the
    adapter's)."""
    with tempfile.TemporaryDirectory(prefix="ddpad-warm-", dir=workdir) as tmp:
        root = pathlib.Path(tmp)
        store, cold_cache, fresh_cache = (str(root / name) for name in ("store", "inductor-cold", "inductor-fresh"))
        spec = {"adapter_name": adapter, "store": store, "backend": backend, "device": device, "dtype": dtype,
                "model": model, "system": None}
        if system is not None:  # each child reads it: the very structure, whatever made it
            spec["system"] = str(root / "system.extxyz")
            system.write(spec["system"], format="extxyz")
        results = {name: _run_child("first_call", spec, {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
                   for name, cache in (("cold", cold_cache), ("store", fresh_cache), ("warm", cold_cache))}
        if aot:  # the ahead-of-time route: a build, then a load, each with an empty Inductor cache
            spec = {**spec, "store": str(root / "aot-store"), "compile_mode": "aot"}
            for name in ("aot build", "aot load"):
                cache = str(root / f"inductor-{name.replace(' ', '-')}")
                results[name] = _run_child("first_call", spec, {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
    return results


def format_warm_start(adapter: str, results: dict[str, dict[str, Any]]) -> str:
    """A table: first-call seconds, ratio to cold, graphs compiled / loaded,
    and whether the energies are bit-identical to the cold run's."""
    cold = results["cold"]
    rows = [f"{adapter}: first call in a fresh process, then the median of 20 steady calls",
            f"{'run':<9} {'first call s':>12} {'x cold':>7} {'compiled':>8} {'loaded':>6} {'steady ms':>9} "
            f"{'x cold':>7} {'identical':>9}"]
    for name, r in results.items():
        # the AOT rows are compared with the AOT build (the process that built the package)
        base = results.get("aot build", cold) if name.startswith("aot") else cold
        same = r["energy"] == base["energy"] and r.get("forces") == base.get("forces")
        rows.append(f"{name:<9} {r['first_call_s']:>12.2f} {r['first_call_s'] / cold['first_call_s']:>7.3f} "
                    f"{r['graphs_compiled']:>8} {r['graphs_loaded']:>6} {r['steady_s'] * 1e3:>9.3f} "
                    f"{r['steady_s'] / cold['steady_s']:>7.3f} {same!s:>9}")
    return "\n".join(rows)


def growing_run(adapter_name: str, store: str, backend: str, device: str, dtype: str | None, steps: int,
                every: int, background: float | None, warm: int = 0, cap_policy: str = "headroom",
                caps: dict[str, int] | None = None, compile_mode: str = "dynamo") -> dict[str, Any]:
    """A trajectory that gains one atom every ``every`` steps (a displaced
    copy of a random atom), each step timed (the child's side); ``caps``:
    preset (a precompile's, as ``ddpad run`` reads them from its caps file)."""
    import ddpad
    import numpy as np
    import torch
    from ddpad import adapters

    adapter = adapters.get(adapter_name)
    torch.manual_seed(0)
    model = adapter.tools.random_model(getattr(torch, dtype) if dtype else None, device)
    atoms = adapter.tools.default_system()
    rng = np.random.default_rng(0)
    times = []
    with ddpad.wrap(model, adapter, compile_cache=store, backend=backend, background_compile=background,
                    warm_ladder=warm, cap_policy=cap_policy, caps=caps, compile_mode=compile_mode) as wrapped:
        for step in range(steps):
            if step and step % every == 0:
                i = int(rng.integers(len(atoms)))
                extra = atoms[i:i + 1].copy()
                direction = rng.normal(size=3)
                extra.positions += 1.2 * direction / np.linalg.norm(direction)
                atoms = atoms + extra
            frame = atoms.copy()
            frame.positions += rng.normal(scale=0.02, size=frame.positions.shape)
            data = adapter.engine.build_input(model, frame)
            t0 = time.perf_counter()
            wrapped(data, **adapter.call_options(False))
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    s = wrapped.stats
    after = times[1:]
    grew = sorted({e.call for e in [*s.growths, *s.fits]})  # (a fit compiles as a growth does)
    return {
        "atoms": [len(adapter.tools.default_system()), len(atoms)], "times": times, "total_s": sum(times),
        "first_s": times[0], "max_after_first_s": max(after), "median_s": sorted(after)[len(after) // 2],
        "growth_steps": grew, "max_growth_s": max((times[i] for i in grew), default=0.0),
        "growth_calls": s.growth_calls, "fit_calls": s.fit_calls, "mean_fill": s.mean_fill,
        "graphs_compiled": s.graphs_compiled, "graphs_loaded": s.graphs_loaded,
        "compile_s": s.compile_seconds, "load_s": s.load_seconds, "background_started": s.background_started,
        "background_used": s.background_used, "background_wasted": s.background_wasted,
        "rungs_warmed": s.rungs_warmed, "rungs_used": s.rungs_used, "warm_s": s.warm_seconds,
        "aot_loaded": s.aot_loaded, "aot_background": s.aot_background, "aot_refused": s.aot_refused,
    }


def precompile_run(adapter_name: str, store: str, backend: str, device: str, dtype: str | None,
                   rungs: int, cap_policy: str = "headroom", compile_mode: str = "dynamo") -> dict[str, Any]:
    """``ddpad precompile``'s ladder for the adapter's default model and
    system (the child's side): the caps and the next ``rungs`` rungs (tight:
    fitted on the first call, as ``ddpad precompile`` does)."""
    import ddpad
    import torch
    from ddpad import adapters

    adapter = adapters.get(adapter_name)
    torch.manual_seed(0)
    model = adapter.tools.random_model(getattr(torch, dtype) if dtype else None, device)
    atoms = adapter.tools.default_system()
    t0 = time.perf_counter()
    if compile_mode == "aot":  # ddpad precompile --aot: every package in its worker process
        from .._prebuild import prebuild_packages

        built = prebuild_packages(model, adapter, adapter.engine.build_input(model, atoms), store=store, rungs=rungs,
                                  tight=cap_policy == "tight", call_kwargs=adapter.call_options(False),
                                  compile_kwargs={"backend": backend})
        if built.failed:
            raise RuntimeError(f"ddpad: package builds failed: {built.failed}")
        return {"seconds": time.perf_counter() - t0, "caps": built.caps}
    policy: Any = ddpad.TightPolicy(settle=1) if cap_policy == "tight" else cap_policy
    wrapped = ddpad.wrap(model, adapter, compile_cache=store, backend=backend, on_recompile="ignore",
                         warm_ladder=rungs, cap_policy=policy)
    wrapped(adapter.engine.build_input(model, atoms), **adapter.call_options(False))
    wrapped.close()
    return {"seconds": time.perf_counter() - t0, "caps": wrapped.caps}


def _run_child(function: str, spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    code = (f"import json, sys; from ddpad._bench.warmstart import {function}; a = json.loads(sys.argv[1]); "
            f"print('RESULT' + json.dumps({function}(**a)))")
    res = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], env=env, capture_output=True,
                         text=True, check=False)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"ddpad: the {function} child for {spec['adapter_name']} failed:\n{res.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT"):])


def growing(adapter: str, *, steps: int = 200, every: int = 5, threshold: float = 0.9, rungs: int = 5,
            backend: str = "inductor", device: str = "cpu", dtype: str | None = None,
            workdir: str | None = None, policies: tuple[str, ...] = ("headroom", "tight"),
            aot: bool = False, ways: tuple[str, ...] | None = None) -> dict[str, dict[str, Any]]:
    """The growing trajectory in fresh processes with empty stores and
    Inductor caches: growths compiled in the foreground; with background
    compiles of the next bucket at ``threshold`` fill; with a ladder of
    ``rungs`` warmed by the first call; and the same after a ``ddpad
    precompile`` of that ladder (its own process, timed apart as
    ``precompile_s``), whose first call loads the rungs; each under every
    cap policy of ``policies`` (a tight precompile's fitted caps are the
    run's preset, as ``ddpad run`` reads them from the precompile's caps
    file). With ``aot``, also ``aot precompiled``: ``ddpad precompile --aot``'s
    packages (built in worker processes), then ``compile_mode="aot"`` with
    the warm ladder (every rung's package loaded by the first call).
    ``ways``: these of them only."""
    results = {}
    ways = ways or ("foreground", "background", "warm", "precompiled", *(("aot precompiled",) if aot else ()))
    for policy in policies:
        for way in ways:
            name = way if policy == "headroom" else f"{policy} {way}"
            with tempfile.TemporaryDirectory(prefix="ddpad-grow-", dir=workdir) as tmp:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}
                common = {"adapter_name": adapter, "store": os.path.join(tmp, "store"), "backend": backend,
                          "device": device, "dtype": dtype}
                mode = "aot" if way.startswith("aot") else "dynamo"
                precompiled = (_run_child("precompile_run", {**common, "rungs": rungs, "cap_policy": policy,
                                                             "compile_mode": mode}, env)
                               if way.endswith("precompiled") else None)
                background = threshold if way == "background" else None
                warm = rungs if way in ("warm", "precompiled", "aot precompiled") else 0
                caps = precompiled["caps"] if precompiled is not None and policy == "tight" else None
                results[name] = _run_child("growing_run", {
                    **common, "steps": steps, "every": every, "background": background, "warm": warm,
                    "cap_policy": policy, "caps": caps, "compile_mode": mode}, env)
                if precompiled is not None:
                    results[name]["precompile_s"] = precompiled["seconds"]
    return results


def format_growing(adapter: str, results: dict[str, dict[str, Any]]) -> str:
    """A table: total, first step, slowest later step over the median, and
    what compiled, loaded, ran in the background and was warmed."""
    from .._stats import lowest_fill

    first = next(iter(results.values()))
    header = (f"{'growths':<17} {'total s':>8} {'first s':>8} {'slowest later s':>15} {'x median':>9} "
              f"{'slowest growth s':>16} {'x median':>9} {'compiled':>8} {'loaded':>6} {'bg started/used':>15} "
              f"{'rungs warmed/used':>17} {'fill':>5}")
    rows = [f"{adapter}: {len(first['times'])} steps, {first['atoms'][0]} -> {first['atoms'][1]} atoms", header]
    for name, r in results.items():
        rows.append(f"{name:<17} {r['total_s']:>8.1f} {r['first_s']:>8.1f} {r['max_after_first_s']:>15.2f} "
                    f"{r['max_after_first_s'] / r['median_s']:>9.1f} {r['max_growth_s']:>16.4f} "
                    f"{r['max_growth_s'] / r['median_s']:>9.1f} {r['graphs_compiled']:>8} {r['graphs_loaded']:>6} "
                    f"{r['background_started']:>7}/{r['background_used']:<7} "
                    f"{r.get('rungs_warmed', 0):>8}/{r.get('rungs_used', 0):<8} "
                    f"{lowest_fill(r.get('mean_fill', {})) or 0:>5.3f}")
    return "\n".join(rows)


_LABELS = {"foreground": "growths compiled in the foreground", "background": "background worker processes",
           "warm": "ladder warmed by the first call", "precompiled": "ddpad precompile, then warmed (loaded)",
           "aot precompiled": "ddpad precompile --aot, then every rung's package loaded"}


def plot_growing(adapter: str, results: dict[str, dict[str, Any]], path: str) -> None:
    """Per-step wall time against step, one line per way of growing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        way = name.removeprefix("tight ")
        label = _LABELS.get(way, way) + (" (tight caps)" if way != name else "")
        ax.semilogy(range(len(r["times"])), r["times"], label=label)
    ax.set_xlabel("step (one atom added every 5 steps)")
    ax.set_ylabel("step wall time (s)")
    ax.set_title(f"ddpad {adapter}: a growing system")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
