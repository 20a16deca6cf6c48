"""``ddpad bench ADAPTER --steady``: what the dead rows cost a steady step.

On one system, after the same short MD-like stretch (rattled frames, no
insertions), every variant runs the same last frame, alternated call by
call in one process (timings swing with load; a ratio holds only between
calls made side by side):

- ``eager``: the adapter's reference, unpadded;
- ``unpadded``: the model compiled at exactly that frame's shape (the same
  backend: what padding is measured against);
- ``headroom``: ddpad at the padders' own caps (first sight of the stretch);
- ``tight``: ddpad at the caps ``cap_policy="tight"`` fitted to the stretch;
- ``tight:KEY`` (``per_key``): the head-room caps with only ``KEY`` fitted,
  to tell, say, a dense padder's rows from its neighbour columns;
- ``package`` (``package``): the tight caps through the ahead-of-time
  package (``compile_mode="aot"``, built in a temporary store before the
  timing), against ``tight``, ``torch.compile`` at the same caps.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from ddpad import TightPolicy, wrap
from ddpad._evaluator import UnpaddedCompiled

__all__ = ["format_steady", "steady_table"]


def _caps_after(adapter: Any, model: torch.nn.Module, inputs: list[Any], policy: Any,
                call_kwargs: dict[str, Any]) -> dict[str, int]:
    """The caps a (not compiled) wrapped model holds after ``inputs``."""
    sizing = wrap(model, adapter, compile=False, cap_policy=policy)
    for data in inputs:
        sizing(data, **call_kwargs)
    return sizing.caps


def steady_table(adapter: Any, model: torch.nn.Module, structures: list[Any], *, backend: str = "inductor",
                 rounds: int = 5, calls: int = 10, per_key: bool = False, package: bool = False,
                 call_kwargs: dict[str, Any] | None = None,
                 on_variant: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Median step of each variant on the last of ``structures``, and its
    ratio to the unpadded compiled step and to eager.

    The head-room caps are those of the first structure, the tight ones
    fitted over all of them (``TightPolicy(settle=len(structures))``).
    With ``package``, the ``package`` row's ``route`` says whether the
    package ran (``"package"``) or the route fell back (its reason).
    """
    with tempfile.TemporaryDirectory(prefix="ddpad-steady-") as store:
        return _steady_table(adapter, model, structures, backend=backend, rounds=rounds, calls=calls,
                             per_key=per_key, package=store if package else None, call_kwargs=call_kwargs,
                             on_variant=on_variant)


def _steady_table(adapter: Any, model: torch.nn.Module, structures: list[Any], *, backend: str, rounds: int,
                  calls: int, per_key: bool, package: str | None, call_kwargs: dict[str, Any] | None,
                  on_variant: Callable[[str], None] | None) -> dict[str, Any]:
    kwargs = dict(call_kwargs or {})
    device = next(model.parameters()).device
    build = adapter.input_builder(model)
    inputs = [build(s) for s in structures]
    target = inputs[-1]
    headroom = _caps_after(adapter, model, inputs[:1], "headroom", kwargs)
    tight = _caps_after(adapter, model, inputs, TightPolicy(settle=len(inputs)), kwargs)
    steps: dict[str, Callable[[], Any]] = {"eager": lambda: adapter.reference(model, target, **kwargs)}
    unpadded = UnpaddedCompiled(model, adapter, backend=backend, dynamic=False)
    steps["unpadded"] = lambda: unpadded(target, **kwargs)
    variants = {"headroom": headroom, "tight": tight}
    if per_key:
        variants.update({f"tight:{k}": {**headroom, k: v} for k, v in tight.items()
                         if v != headroom.get(k) and k != "systems"})
    padded_models = {}
    for name, preset in variants.items():  # preset caps, held: no growth on the target frame
        padded = wrap(model, adapter, backend=backend, caps=preset, cap_policy="headroom", on_recompile="ignore")
        steps[name] = lambda padded=padded: padded(target, **kwargs)
        padded_models[name] = padded
    if package is not None:  # the tight caps again, through the package route
        variants["package"] = tight
        packaged = wrap(model, adapter, backend="inductor", caps=tight, cap_policy="headroom", on_recompile="ignore",
                        compile_mode="aot", compile_cache=package, aot_build="foreground")
        # its own copy of the frame: the unpadded models mark the shared one's positions as requiring grad
        # (fairchem and mace set it in place), which a package refuses (the caller would differentiate)
        own = build(structures[-1])
        steps["package"] = lambda: packaged(own, **kwargs)
        padded_models["package"] = packaged
    for name, step in steps.items():  # compile (and a first steady call) before any timing
        if on_variant is not None:
            on_variant(name)
        step()
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for _ in range(calls):
            for name, step in steps.items():  # alternated call by call
                _sync(device)
                t0 = time.perf_counter()
                step()
                _sync(device)
                times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    base, eager = median["unpadded"], median["eager"]
    rows = {name: {"median_ms": median[name] * 1e3, "vs_unpadded": median[name] / base,
                   "vs_eager": median[name] / eager, "caps": variants.get(name),
                   "fill": padded_models[name].stats.mean_fill if name in padded_models else {}}
            for name in steps}
    if package is not None:
        packaged = padded_models["package"]
        refused = packaged.manager.refused if packaged.manager.aot is not None else {(): "no package route"}
        rows["package"]["route"] = "; ".join(refused.values()) or "package"
    return {"adapter": adapter.name, "device": str(device), "backend": backend, "threads": torch.get_num_threads(),
            "atoms": [len(s) for s in structures], "calls": rounds * calls, "variants": rows}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_steady(result: dict[str, Any]) -> str:
    """The table ``ddpad bench --steady`` prints."""
    lines = [f"{'variant':<18} {'median ms':>10} {'/ unpadded':>11} {'/ eager':>8}  fill (real / cap)  caps"]
    for name, row in result["variants"].items():
        fill = ", ".join(f"{k} {v:.3f}" for k, v in sorted(row["fill"].items()) if k != "systems") or "-"
        caps = ", ".join(f"{k} {v}" for k, v in sorted((row["caps"] or {}).items())) or "-"
        lines.append(f"{name:<18} {row['median_ms']:10.2f} {row['vs_unpadded']:11.3f} {row['vs_eager']:8.3f}  "
                     f"{fill:<17}  {caps}")
        if row.get("route", "package") != "package":
            lines.append(f"{'':<18} (the package route fell back: {row['route']})")
    return "\n".join(lines)
