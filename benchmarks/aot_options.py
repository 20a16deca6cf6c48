"""Inductor options for ahead-of-time packages on this machine.

``python benchmarks/aot_options.py ADAPTER [--blocks 6] [--calls 10] [--json FILE]``

One process, the adapter's random model (MACE in float64) on its default
system at head-room caps (one package per option set, each built in the
foreground into a temporary store of its own): the build time, the steady
call of each package, the option sets stepped in alternating blocks of
``--calls`` calls (the median block per set, and its ratio to the package
ddpad builds), and each one's largest deviation from the unpadded eager
model. Options tried: none (what ddpad builds), ``freezing=True`` (weights
folded into the graph as constants), ``max_autotune=True`` with the GEMM
backends ``CPP,ATEN``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

OPTION_SETS: dict[str, dict[str, Any]] = {
    "none (what ddpad builds)": {},
    "freezing=True": {"freezing": True},
    "max_autotune=True, GEMM backends CPP,ATEN": {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"},
}


def _deviation(out: Any, ref: Any, adapter: Any) -> float:
    import torch

    got, want = adapter.flat(out), adapter.flat(ref)
    return max(float((got[k].detach().double() - want[k].detach().double()).abs().max()) for k in want
               if isinstance(want[k], torch.Tensor) and k in got)


def measure(adapter_name: str, blocks: int, calls: int) -> dict[str, Any]:
    """The numbers for one adapter (see the module's docstring)."""
    import torch

    from ddpad import adapters

    adapter = adapters.get(adapter_name)
    dtype = torch.float64 if adapter_name == "mace" else torch.get_default_dtype()
    model = adapter.tools.random_model(dtype, "cpu")
    options = adapter.call_options(True)
    build = adapter.input_builder(model)
    data = build(adapter.tools.default_system())
    ref = adapter.reference(model, build(adapter.tools.default_system()))
    rows: dict[str, dict[str, Any]] = {}
    wrapped: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ddpad-aot-options-") as tmp:
        for i, (name, inductor) in enumerate(OPTION_SETS.items()):
            one = adapter.wrap(model, compile_mode="aot", aot_build="foreground", compile_cache=f"{tmp}/{i}",
                               cap_policy="headroom")
            assert one.manager.aot is not None, f"{adapter_name} takes no package route"
            one.manager.aot.inductor_options = dict(inductor)
            out = one(build(adapter.tools.default_system()), **options)
            s = one.stats
            rows[name] = {"build_s": s.aot_seconds, "route": "package" if s.aot_checked and not s.aot_refused
                          else f"refused: {'; '.join(one.manager.refused.values())}",
                          "deviation": _deviation(out, ref, adapter), "blocks_s": []}
            wrapped[name] = one
        for _ in range(blocks):  # alternating: a load swing lands on every set alike
            for name, one in wrapped.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    one(data, **options)
                rows[name]["blocks_s"].append((time.perf_counter() - t0) / calls)
    base = statistics.median(next(iter(rows.values()))["blocks_s"])
    for row in rows.values():
        row["steady_ms"] = 1e3 * statistics.median(row["blocks_s"])
        row["ratio"] = row["steady_ms"] / (1e3 * base)
    return {"adapter": adapter_name, "threads": torch.get_num_threads(), "blocks": blocks, "calls": calls,
            "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = ["| AOTInductor options | build s | steady step ms (x default) | max deviation from eager | route |",
             "|---|---|---|---|---|"]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | {row['build_s']:.1f} | {row['steady_ms']:.2f} ({row['ratio']:.3f}) | "
                     f"{row['deviation']:.1e} | {row['route']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapter")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    result = measure(args.adapter, args.blocks, args.calls)
    print(f"{args.adapter}, {result['threads']} thread(s), {args.blocks} alternating blocks of {args.calls} calls")
    print(table(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
