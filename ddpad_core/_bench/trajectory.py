"""``ddpad bench``: eager, unpadded compiles and ddpad side by side on one trajectory.

Every variant runs the same pre-built inputs (same seeds, same system) of a
trajectory whose atom count fluctuates (rattle plus random insertions and
deletions). Compile events are counted from Dynamo's own compile ids.
"""

from __future__ import annotations

import itertools
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from ddpad import Stats, wrap
from ddpad._evaluator import UnpaddedCompiled
from ddpad._stats import lowest_fill

__all__ = ["VARIANTS", "figure", "fluctuating_trajectory", "plot", "run_bench"]

VARIANTS = ("eager", "compile-static", "compile-dynamic", "compile-default", "native-padding", "ddpad", "ddpad-tight")


def fluctuating_trajectory(atoms: Any, steps: int, rattle: float, rate: float, seed: int = 0) -> list[Any]:
    """``steps`` structures: each rattled by ``rattle`` (A); with probability
    ``rate`` per step an atom is deleted or a displaced copy inserted next to
    its source (the count stays within +-10 % of the start)."""
    import numpy as np  # here, not at the top: ddpad bench --overhead runs without numpy

    rng = np.random.default_rng(seed)
    current = atoms.copy()
    n0 = len(atoms)
    out = []
    for _ in range(steps):
        if rng.random() < rate:
            i = int(rng.integers(len(current)))
            grow = rng.random() < 0.5
            if grow and len(current) < 1.1 * n0 or len(current) <= 0.9 * n0:
                extra = current[i:i + 1].copy()
                direction = rng.normal(size=3)
                extra.positions += 1.2 * direction / np.linalg.norm(direction)
                current = current[: i + 1] + extra + current[i + 1:]
            else:
                del current[i]
        frame = current.copy()
        frame.positions += rng.normal(scale=rattle, size=frame.positions.shape)
        out.append(frame)
    return out


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process high-water mark


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(
    step_fn: Callable[[Any], Any], inputs: list[Any], stats: Stats, device: torch.device, advance_calls: bool
) -> dict[str, Any]:
    """Run every input; ``advance_calls`` when ``step_fn`` does not count its
    own calls in ``stats`` (ddpad's wrapper does)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, fills = [], []
    for data in inputs:
        t0 = time.perf_counter()
        step_fn(data)
        _sync(device)
        times.append(time.perf_counter() - t0)
        stats.calls += int(advance_calls)
        fills.append(lowest_fill(stats.fill))  # this step's (padded variants only)
    compiled_calls = set(stats.graphs_by_call)
    steady = [t for i, t in enumerate(times) if i not in compiled_calls]
    return {
        "total_s": sum(times),
        "compile_s": sum(t for i, t in enumerate(times) if i in compiled_calls),
        "steady_median_s": statistics.median(steady) if steady else None,
        "graphs": stats.graphs,
        "recompiles": stats.recompiles,
        "peak_memory_mb": _peak_memory_mb(device),
        "cumulative_s": list(itertools.accumulate(times)),
        "growth_calls": stats.growth_calls + stats.fit_calls,
        "slowest_later_s": max(times[1:], default=0.0),
        # per step, for plots: its wall time, the lowest fill, and the steps that compiled, grew or fitted caps
        "step_s": times,
        "step_fill": fills,
        "compile_steps": sorted(compiled_calls),
        "growth_steps": sorted({e.call for e in stats.growths}),
        "fit_steps": sorted({e.call for e in stats.fits} | {e.call for e in stats.shrinks}),
        "changing_run": stats.changing_run,  # tight caps kept at head room: on which step, and why
        # real rows / cap per key, the mean since the caps last changed (padded variants only)
        "fill": stats.mean_fill,
    }


def run_bench(
    adapter: Any,
    model: torch.nn.Module,
    structures: list[Any],
    *,
    backend: str = "inductor",
    variants: tuple[str, ...] = VARIANTS,
    call_kwargs: dict[str, Any] | None = None,
    on_variant: Callable[[str, int, int, dict[str, Any] | None], None] | None = None,
) -> dict[str, Any]:
    """Time each variant over the inputs built from ``structures``.

    ``on_variant(name, index, total, result)`` is called as each variant
    starts (``result`` None) and ends (its timings); ``index`` counts from 1.
    """
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    device = next(model.parameters()).device
    if adapter.tools.native_padding is None:  # only for packages that pad themselves (mace)
        variants = tuple(v for v in variants if v != "native-padding")
    build = adapter.input_builder(model)
    inputs = [build(s) for s in structures]
    kwargs = dict(call_kwargs or {})
    results: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(variants, start=1):
        if on_variant is not None:
            on_variant(name, index, len(variants), None)
        step, variant_inputs, stats = _variant(name, adapter, model, structures, inputs, backend, kwargs)
        results[name] = _timed(step, variant_inputs, stats, device, advance_calls=name == "eager")
        if on_variant is not None:
            on_variant(name, index, len(variants), results[name])
    ratios = _ratios(results)
    return {
        "adapter": adapter.name,
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype),
        "atoms": [len(s) for s in structures],
        "steps": len(structures),
        "backend": backend,
        "peak_memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "process max RSS (cumulative)",
        "variants": results,
        "ddpad_speedup": ratios,
    }


def _variant(name: str, adapter: Any, model: torch.nn.Module, structures: list[Any], inputs: list[Any],
             backend: str, kwargs: dict[str, Any]) -> tuple[Callable[[Any], Any], list[Any], Stats]:
    """One variant's step, the inputs it takes and the stats it counts into."""
    if name == "eager":
        def step(data: Any) -> Any:
            return adapter.reference(model, data, **kwargs)

        return step, inputs, Stats()
    if name in ("ddpad", "ddpad-tight"):  # the padders' own head room / cap_policy="tight"
        policy = "tight" if name == "ddpad-tight" else "headroom"
        wrapped = wrap(model, adapter, backend=backend, on_recompile="ignore", cap_policy=policy)
        return (lambda data: wrapped(data, **kwargs)), inputs, wrapped.stats
    if name == "native-padding":  # the package's own padding, compiled statically
        native = adapter.tools.native_padding(model)
        inputs = [native(s) for s in structures]
        unpadded = UnpaddedCompiled(model, adapter, backend=backend, dynamic=False)
    else:
        dynamic = {"compile-static": False, "compile-dynamic": True, "compile-default": None}[name]
        unpadded = UnpaddedCompiled(model, adapter, backend=backend, dynamic=dynamic)
    return (lambda data: unpadded(data, **kwargs)), inputs, unpadded.stats


def _ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each variant's total and steady time over ddpad's (none without ddpad)."""
    ratios: dict[str, dict[str, float | None]] = {}
    ours = results.get("ddpad")
    if ours is None:
        return ratios
    for name, res in results.items():
        if name == "ddpad":
            continue
        steady = (res["steady_median_s"] / ours["steady_median_s"]
                  if res["steady_median_s"] and ours["steady_median_s"] else None)
        ratios[name] = {"total": res["total_s"] / ours["total_s"], "steady": steady}
    return ratios


def figure(result: dict[str, Any]) -> Any:
    """The bench plot as a matplotlib ``Figure``: cumulative wall time against
    step, one line per variant, integer step ticks, the legend right of the
    axes (off the curves)."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(9, 4.5))
    ax = fig.add_subplot()
    for name, res in result["variants"].items():
        graphs = res["graphs"]
        label = f"{name} ({graphs} graph{'' if graphs == 1 else 's'})"
        ax.plot(range(1, len(res["cumulative_s"]) + 1), res["cumulative_s"], label=label)
    ax.set_xlabel("MD step")
    ax.set_ylabel("cumulative wall time [s]")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"ddpad bench {result['adapter']} ({result['device']}, backend {result['backend']})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def plot(result: dict[str, Any], path: str) -> None:
    """Write :func:`figure` to ``path``."""
    figure(result).savefig(path, dpi=120)
