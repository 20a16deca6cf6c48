"""What ddpad's guards cost: the first-use check, and a package's weight watch.

``python benchmarks/check_cost.py ADAPTER [--backend inductor] [--steps 20] [--aot] [--json FILE]``

One process, the adapter's random model on its default system, head-room
caps (one graph): the first call (compile + check), the check alone (one
eager step on the padded input and the comparison: ``stats.check_seconds``),
and the median steady call; the check as a fraction of each. With ``--aot``
the same model through an ahead-of-time package (built in the foreground,
into a temporary store), and the weight watch that runs before every package
call (:class:`ddpad._weights.Watch`) timed against the package's steady call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any


def _median_call(fn: Any, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(adapter_name: str, backend: str, steps: int, aot: bool) -> dict[str, Any]:
    """The numbers for one adapter (see the module's docstring)."""
    import torch

    import ddpad
    from ddpad import adapters

    adapter = adapters.get(adapter_name)
    assert adapter.tools.random_model is not None and adapter.tools.default_system is not None
    model = adapter.tools.random_model(torch.float64 if adapter_name == "mace" else torch.get_default_dtype(), "cpu")
    options = adapter.call_options(True)
    row: dict[str, Any] = {"adapter": adapter_name, "backend": backend, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory(prefix="ddpad-check-cost-") as store:
        extra = {"compile_mode": "aot", "aot_build": "foreground", "compile_cache": store} if aot else {}
        wrapped = ddpad.wrap(model, adapter, backend=backend, cap_policy="headroom", **extra)
        build = adapter.input_builder(wrapped.model)
        data = build(adapter.tools.default_system())
        t0 = time.perf_counter()
        wrapped(data, **options)
        first = time.perf_counter() - t0
        s = wrapped.stats
        steady = _median_call(lambda: wrapped(build(adapter.tools.default_system()), **options), steps)
        build_only = _median_call(lambda: build(adapter.tools.default_system()), steps)
        steady -= build_only  # (the input pipeline is not the call)
        row.update(first_call_s=first, check_s=s.check_seconds, steady_s=steady, checks=s.checks,
                   disagreements=s.disagreements, check_of_first=s.check_seconds / first,
                   check_of_steady=s.check_seconds / steady, route="package" if s.aot_checked else "torch.compile")
        if aot and wrapped.manager.aot is not None:
            watch = wrapped.manager.aot.watch
            calls = 2000
            t0 = time.perf_counter()
            for _ in range(calls):
                watch.changed()
            per_call = (time.perf_counter() - t0) / calls
            row.update(watch_us=per_call * 1e6, watch_of_steady=per_call / steady,
                       tensors=len(watch._tensors), modules=len(watch._modules))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapter")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--aot", action="store_true", help="through an ahead-of-time package, with the weight watch")
    parser.add_argument("--json", help="also write the row to this JSON file")
    args = parser.parse_args(argv)
    row = measure(args.adapter, args.backend, args.steps, args.aot)
    print(f"{row['adapter']} ({row['route']}, {row['backend']}, {row['threads']} thread(s)): first call "
          f"{row['first_call_s']:.2f} s, check {row['check_s'] * 1e3:.1f} ms ({row['check_of_first']:.2%} of the "
          f"first call, {row['check_of_steady']:.2f}x a steady step of {row['steady_s'] * 1e3:.2f} ms), "
          f"{row['checks']} check(s), {row['disagreements']} disagreed")
    if "watch_us" in row:
        print(f"weight watch: {row['watch_us']:.1f} us a call ({row['tensors']} tensors, {row['modules']} modules), "
              f"{row['watch_of_steady']:.3%} of the package's steady call")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(row, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
