"""A whole MD run, compiles included: ddpad against the package's own routes, each in fresh processes.

``python benchmarks/run_total.py [--adapter mace] [--steps 1000] [--json FILE]``

Each variant runs ``--steps`` Langevin steps under ASE on the 64-atom cell
of ``ddpad bench --engines`` (same seeded random model, dtype and start) in
a fresh process, twice: cold (empty Inductor cache and ddpad store, a
folder of their own) and warm (the second run of the same job, the same
folders). The variants: ddpad's calculator (its defaults: tight caps, the
store), the package's own compiled route
(:attr:`ToolHooks.compiled_ase_calculator <ddpad.adapters.ToolHooks>`) and
its eager calculator. Timed from before the calculator is built to the
last step; the process's start-up and imports are reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

VARIANTS = ("ddpad", "compiled", "eager")


def child(adapter_name: str, variant: str, steps: int) -> dict[str, Any]:
    """One run in this process: seconds from building the calculator to the last step."""
    import copy

    import numpy as np
    import torch
    from ase import units
    from ase.md.langevin import Langevin

    from ddpad._bench.engines import TEMPERATURE_K, TIMESTEP_FS, systems
    from ddpad.adapters import get
    from ddpad.ase import Calculator

    adapter = get(adapter_name)
    torch.manual_seed(0)
    dtype = adapter.tools.default_dtype or torch.get_default_dtype()
    model = adapter.tools.random_model(dtype, "cpu")
    atoms = systems("one", adapter.engine.molecules)[0]
    t0 = time.perf_counter()
    if variant == "ddpad":
        atoms.calc = Calculator(model, adapter)
    elif variant == "compiled":
        atoms.calc = adapter.tools.compiled_ase_calculator(copy.deepcopy(model))
    else:
        atoms.calc = adapter.tools.ase_calculator(copy.deepcopy(model))
    dyn = Langevin(atoms, TIMESTEP_FS * units.fs, temperature_K=TEMPERATURE_K, friction=0.02,
                   rng=np.random.default_rng(1))
    atoms.get_forces()
    first = time.perf_counter() - t0
    dyn.run(steps)
    out: dict[str, Any] = {"run_s": time.perf_counter() - t0, "first_call_s": first}
    wrapped = getattr(atoms.calc, "wrapped", None)
    if wrapped is not None:  # ddpad's: what it compiled or loaded, and how its caps grew
        stats = wrapped.stats
        out.update(graphs=stats.graphs, growth_calls=stats.growth_calls, caps=dict(wrapped.caps),
                   changing_run=stats.changing_run)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", default="mace")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--json", help="also write the report to this file")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.adapter, args.child, args.steps)))
        return 0
    from ddpad.adapters import get

    tools = get(args.adapter).tools
    if tools.compiled_ase_calculator is None or tools.ase_calculator is None:
        raise SystemExit(f"run_total.py: adapter {args.adapter!r} declares no compiled or eager ASE calculator")
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ddpad-total-") as tmp:
        for variant in VARIANTS:
            folder = os.path.join(tmp, variant)  # this variant's caches: empty for cold, kept for warm
            env = {**os.environ, "XDG_CACHE_HOME": os.path.join(folder, "cache"),
                   "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor")}
            env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)  # (warm means torch's caches too)
            for run in ("cold", "warm"):
                t0 = time.perf_counter()
                res = subprocess.run([sys.executable, __file__, "--adapter", args.adapter, "--steps",
                                      str(args.steps), "--child", variant], capture_output=True, text=True,
                                     env=env, check=False)
                process = time.perf_counter() - t0
                if res.returncode != 0:
                    raise SystemExit(f"run_total.py: {variant} ({run}) failed:\n{res.stderr[-3000:]}")
                got = json.loads(res.stdout.strip().splitlines()[-1])
                rows[f"{variant} {run}"] = {**got, "process_s": process}
                print(f"{variant:9s} {run}: run {got['run_s']:7.1f} s (first call {got['first_call_s']:6.1f} s), "
                      f"process {process:7.1f} s", flush=True)
    ours = {run: rows[f"ddpad {run}"]["run_s"] for run in ("cold", "warm")}
    for name, row in rows.items():
        row["x_ddpad"] = row["run_s"] / ours[name.split()[1]]
    report = {"adapter": args.adapter, "steps": args.steps, "threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
              "runs": rows}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
