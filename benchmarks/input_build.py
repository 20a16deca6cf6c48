"""Building a model's input: the adapter's ASE pipeline against its tensor path.

``python benchmarks/input_build.py ADAPTER [--sizes 64 512 4096] [--calls 10] [--json FILE]``

One process, the adapter's random model, rattled diamond-carbon supercells
(a third of the atoms hydrogen) of each size. Per size, in alternating
calls so both see the same load, the median of ``--calls`` builds:

- pipeline: ``adapter.engine.build_input(model, atoms)`` (the package's own data
  pipeline and CPU neighbour list: what every engine step ran before);
- tensor: ``adapter.engine.tensor_input(model)`` on a :class:`ddpad.padding.Structures`
  whose positions moved (the composition checked once, as an engine's steps
  with the same atoms), neighbour list by vesin-torch on the CPU here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

SUPERCELLS = {64: (2, 2, 2), 512: (4, 4, 4), 4096: (8, 8, 8)}


def _atoms(n: int) -> Any:
    from ase.build import bulk

    if n not in SUPERCELLS:
        raise SystemExit(f"input_build.py: sizes are {sorted(SUPERCELLS)}, got {n}")
    atoms = bulk("C", "diamond", a=3.57, cubic=True) * SUPERCELLS[n]
    atoms.numbers[::3] = 1
    atoms.rattle(0.05, seed=0)
    return atoms


def measure(adapter_name: str, sizes: list[int], calls: int) -> dict[str, Any]:
    """Median build times per size (see the module's docstring)."""
    import torch

    from ddpad.padding import Structures
    from ddpad.adapters import get

    adapter = get(adapter_name)
    if adapter.engine.tensor_input is None:
        raise SystemExit(f"input_build.py: adapter {adapter_name!r} has no tensor_input")
    float32_only = ("sevennet", "mattersim")  # their packages run float32 only
    model = adapter.tools.random_model(*((torch.float64,) if adapter_name not in float32_only else ()))
    rows = []
    for n in sizes:
        atoms = _atoms(n)
        build = adapter.engine.tensor_input(model)
        structures = Structures.from_atoms(atoms)
        build(structures)  # the composition, checked once
        times: dict[str, list[float]] = {"pipeline": [], "tensor": []}
        for call in range(calls):
            t0 = time.perf_counter()
            adapter.engine.build_input(model, atoms)
            times["pipeline"].append(time.perf_counter() - t0)
            structures.positions = structures.positions + 1e-4 * (call % 2)
            t0 = time.perf_counter()
            build(structures)
            times["tensor"].append(time.perf_counter() - t0)
        pipeline, tensor = (statistics.median(times[k]) for k in ("pipeline", "tensor"))
        rows.append({"atoms": n, "pipeline_ms": 1e3 * pipeline, "tensor_ms": 1e3 * tensor,
                     "speedup": pipeline / tensor})
    return {"adapter": adapter_name, "calls": calls, "threads": torch.get_num_threads(), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapter")
    parser.add_argument("--sizes", type=int, nargs="+", default=sorted(SUPERCELLS))
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    report = measure(args.adapter, args.sizes, args.calls)
    for row in report["rows"]:
        print(f"{report['adapter']}, {row['atoms']} atoms: pipeline {row['pipeline_ms']:.1f} ms, "
              f"tensor {row['tensor_ms']:.2f} ms ({row['speedup']:.1f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
