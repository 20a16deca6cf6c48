"""``pair_style ddpad`` (LAMMPS's C++ loop, no Python) against ddpad's ``fix
external`` route (a Python callback each step, ``--aot``: the same kind of
AOTInductor package of the whole step), on the same random float64 MACE and
diamond box, at 1 and 2 MPI ranks and two box sizes.

Each run is a fresh ``mpirun``. A steady step is the difference of a run of
4 x ``--steps`` steps and one of ``--steps`` steps over the steps between, so
what every run pays once cancels (the plugin's first package load; the
callback's package load and first-use check, its tight caps fitted on step
9 and their package loaded: its packages are built by a first run, untimed).
The routes alternate (``--repeats``); a row gives each route's fastest
steady step and the median ratio with its range over the repeats. Bytes per rank per step: LAMMPS's own ghost traffic
(positions forward, forces back: 2 x ghosts x 3 doubles, from the ghost count
LAMMPS reports) for both routes, plus the ``fix external`` route's all-reduce
of every atom's force and its 7 totals ((N_global + 1) x 3 + 7 doubles).

    python benchmarks/lammps_plugin.py [--cells 4 8] [--ranks 1 2] [--steps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
R_MAX = 2.6
GHOST = 2 * R_MAX + 1.0


def _env(plugin: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ, DDPAD_LAMMPS_PLUGIN_DIR=str(plugin), OMP_NUM_THREADS="1")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(BIN.parent / "lib"), env.get("LD_LIBRARY_PATH")]))
    return env


def _run(command: list[str], env: dict[str, str], cwd: pathlib.Path) -> str:
    proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def _plugin_seconds(work: pathlib.Path, env: dict[str, str], packages: pathlib.Path, ranks: int, cells: int,
                    steps: int) -> tuple[float, float]:
    """LAMMPS's loop time over ``steps`` steps, and the ghosts per rank."""
    out = _run([str(BIN / "mpirun"), "-np", str(ranks), str(BIN / "lmp"), "-in",
                str(ROOT / "examples" / "lammps" / "in.diamond"), "-var", "packages", str(packages), "-var", "ghost",
                str(GHOST), "-var", "steps", str(steps), "-var", "cells", str(cells)], env, work)
    loop = float(re.search(r"Loop time of (\S+) on \d+ procs for (\d+) steps", out).group(1))
    ghosts = float(re.search(r"Nghost:\s+(\S+) ave", out).group(1))
    return loop, ghosts


def _external_seconds(work: pathlib.Path, env: dict[str, str], model: pathlib.Path, store: pathlib.Path,
                      ranks: int, cells: int, steps: int) -> float:
    """Seconds of ``steps`` steps of examples/lammps_md.py --aot (after its ``run 0``)."""
    report = work / f"external-{ranks}-{cells}.json"
    _run([str(BIN / "mpirun"), "-np", str(ranks), sys.executable, str(ROOT / "examples" / "lammps_md.py"),
          "--model", str(model), "--device", "cpu", "--backend", "inductor", "--aot", "--aot-build", "foreground",
          "--compile-cache", str(store), "--cells", str(cells), "2", "2", "--json", str(report),
          "--steps", str(steps)], env, work)
    return steps / json.loads(report.read_text())["steps_per_s"]


def steady(seconds: Callable[[int], float], short: int, long: int) -> float:
    """Seconds per steady step: the difference of a long and a short run over
    their difference in steps, so what both runs pay once (loading and
    checking a package, a caps fit and the package it loads) cancels."""
    return (seconds(long) - seconds(short)) / (long - short)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, nargs="+", default=[4, 8], help="diamond cells along x (x 2 x 2)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=10, help="the short run's steps (the long run: 4x)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating repeats of the two routes")
    parser.add_argument("--rungs", type=int, default=4, help="packages per box (as ddpad precompile --lammps)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()

    import torch
    from ase.build import bulk
    from ddpad.adapters import get
    from ddpad.engines.lammps_build import build_plugin
    from ddpad.engines.lammps_package import build_ladder, ghost_graph

    adapter = get("mace")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddpad-lmp-bench-") as tmp:
        work = pathlib.Path(tmp)
        env = _env(work / "plugin")
        build_plugin(work / "plugin", say=lambda text: None)
        torch.manual_seed(7)
        model = adapter.tools.random_model(torch.float64, "cpu", r_max=R_MAX)
        torch.save(model, work / "model.pt")
        for cells in args.cells:
            atoms = bulk("C", "diamond", a=3.57, cubic=True).repeat((cells, 2, 2))
            example = ghost_graph(atoms, adapter.engine.lammps_input(model)[0], R_MAX, GHOST).pruned(2)
            t0 = time.perf_counter()
            packages = work / f"packages-{cells}"
            build_ladder(model, adapter, packages, example, rungs=args.rungs)
            built = time.perf_counter() - t0
            for ranks in args.ranks:
                model_file, store = work / "model.pt", work / "store"
                _external_seconds(work, env, model_file, store, ranks, cells, 12)  # builds its packages (caps fit on step 9)
                ghosts = _plugin_seconds(work, env, packages, ranks, cells, 1)[1]
                plugin, external = [], []
                for _ in range(args.repeats):  # the two routes alternate: each pair of figures under one load
                    plugin.append(steady(lambda n: _plugin_seconds(work, env, packages, ranks, cells, n)[0],
                                         args.steps, 4 * args.steps))
                    external.append(steady(lambda n: _external_seconds(work, env, model_file, store, ranks, cells, n),
                                           args.steps, 4 * args.steps))
                ratios = sorted(p / e for p, e in zip(plugin, external))
                # MPI bytes a rank sends a step: none on one rank (ghosts are local copies)
                ghost_bytes = 2 * ghosts * 3 * 8 if ranks > 1 else 0.0
                reduce_bytes = ((len(atoms) + 1) * 3 + 7) * 8 if ranks > 1 else 0.0
                rows.append({"atoms": len(atoms), "ranks": ranks, "ghosts_per_rank": ghosts,
                             "plugin_ms": 1e3 * min(plugin), "external_ms": 1e3 * min(external),
                             "ratio": ratios[len(ratios) // 2], "ratio_min": ratios[0], "ratio_max": ratios[-1],
                             "plugin_bytes": ghost_bytes, "external_bytes": ghost_bytes + reduce_bytes,
                             "packages_built_s": built})
                print(json.dumps(rows[-1]), flush=True)
    report = {"steps": args.steps, "repeats": args.repeats, "rungs": args.rungs, "threads_per_rank": 1, "rows": rows}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
