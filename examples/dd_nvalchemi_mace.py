"""Domain-decomposed NVE of periodic diamond with nvalchemi-toolkit, a compiled
MACE, and ddpad as nvalchemi's graph padder.

    torchrun --nproc-per-node 2 examples/dd_nvalchemi_mace.py [--model my.model]
             [--steps 100] [--cells 8 4 4] [--backend inductor] [--eager]

One GPU per rank over NCCL when CUDA is available, else CPU ranks over gloo.
Rank 0 prints the total energy of the whole system every few steps (the
forward all-reduces it over the ranks; every rank must hold the same value,
checked), steps/s, and each rank's compiled graphs (each checked on its first
call against the same graph run eagerly), caps and owned atoms (they change
as atoms migrate). ``--eager`` runs the reference instead:
nvalchemi's own domain decomposition, eager (no compile, no ddpad), same
system and steps; its total energies must match a normal run's (run it as a
separate job: a second ``DomainParallel`` in the same process gives other
energies in nvalchemi-toolkit 0.2).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import numpy as np
import torch
import torch.distributed as dist


def system(cells: tuple[int, int, int], drift: float):
    from ase.build import bulk
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    atoms = bulk("C", "diamond", a=3.57, cubic=True) * cells
    atoms.rattle(0.1, seed=1)
    atoms.wrap()  # nvalchemi's DD expects atoms inside the cell
    MaxwellBoltzmannDistribution(atoms, temperature_K=600, rng=np.random.default_rng(0))
    velocities = atoms.get_velocities()
    velocities[:, 0] += drift * 10.180505710759414  # A/fs along x: atoms cross domains
    atoms.set_velocities(velocities)
    atoms.arrays["forces"] = np.zeros((len(atoms), 3))
    atoms.info["energy"] = 0.0
    return atoms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="mace model file (default: randomly initialised, r_max 3 A)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--cells", type=int, nargs=3, default=(4, 2, 2), help="diamond unit cells")
    parser.add_argument("--drift", type=float, default=0.05, help="x velocity added, A/fs")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="compile store shared by the ranks: one compiles, the others load (default: none)")
    parser.add_argument("--padder", choices=("ddpad", "nvalchemi"), default="ddpad",
                        help="nvalchemi: its built-in padder, for comparison")
    parser.add_argument("--eager", action="store_true",
                        help="the reference: nvalchemi's DD eagerly, no compile, no ddpad (compare the energies)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        os.environ.setdefault("NVALCHEMI_HALO_P2P", "1")  # gloo has no all_to_all_v

    torch.set_default_dtype(torch.float64)
    import ddpad
    from ddpad.adapters import get
    from ddpad.engines.nvalchemi import BatchPadder, gloo_exchange, use_padder
    from nvalchemi.data import AtomicData, Batch
    from nvalchemi.distributed import DomainConfig, DomainParallel
    from nvalchemi.dynamics.integrators.nve import NVE
    from nvalchemi.models.mace import MACEWrapper
    from torch.distributed.device_mesh import init_device_mesh

    mace = get("mace")

    model = mace.tools.load_model(args.model, str(device)) if args.model else mace.tools.random_model(torch.float64, str(device), r_max=3.0)
    atoms = system(tuple(args.cells), args.drift)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("domain",))

    def simulate(compile: bool, padder: BatchPadder | None) -> tuple[list[float], list[int], DomainParallel, float, float]:
        """``args.steps`` NVE steps; the total energy after each, the owned
        atoms, the engine, the first step's seconds and the steps/s after it."""
        wrapper = MACEWrapper(model)
        batch = Batch.from_data_list([AtomicData.from_atoms(atoms, dtype=torch.float64, device=device)])
        batch.velocities.copy_(torch.as_tensor(atoms.get_velocities(), device=device))
        config = DomainConfig(cutoff=wrapper.cutoff, skin=0.5, mesh=mesh, compile=compile, grid_dims=(world, 1, 1))
        md = DomainParallel(NVE(wrapper, dt=0.5), config)
        declared = use_padder(wrapper, padder) if padder is not None else contextlib.nullcontext()
        with declared:
            local = md.partition(batch if rank == 0 else None)
        if compile:
            # DomainParallel (0.2) compiles with inductor and takes no compile options:
            # hand its DistributedModel the backend, counting graphs into `stats` and
            # checking each one's first call against the graph run eagerly
            store = {"compile_cache": args.compile_cache, "model": model} if args.compile_cache else {}
            md._dist_model._dd_compile_kwargs = {"backend": ddpad.padding.counting_backend(stats, args.backend, **store)}
        energies, owned = [], []
        exchange = contextlib.nullcontext() if cuda else gloo_exchange()
        with exchange:
            t0 = time.perf_counter()
            local, _ = md.step(local)  # the first step compiles
            first = time.perf_counter() - t0
            energies.append(total_energy(local))
            t1 = time.perf_counter()
            for _ in range(1, args.steps):
                local, _ = md.step(local)
                energies.append(total_energy(local))
                owned.append(int(local.num_nodes))
            if cuda:
                torch.cuda.synchronize()
            rate = (args.steps - 1) / (time.perf_counter() - t1)
        return energies, owned, md, first, rate

    def total_energy(local: Batch) -> float:
        """The whole system's energy: nvalchemi's forward all-reduces it over the
        ranks and replicates it; check that every rank holds the same value."""
        energy = local.energy.detach().sum().reshape(1).to(torch.float64)
        low, high = energy.clone(), energy.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if float(high - low) > 1e-9 * max(1.0, abs(float(high))):
            raise RuntimeError(f"ranks disagree on the total energy: {float(low)} vs {float(high)}")
        return float(energy)

    stats = ddpad.Stats()
    padder = BatchPadder(float(model.r_max)) if args.padder == "ddpad" and not args.eager else None
    energies, owned, md, first, rate = simulate(not args.eager, padder)
    if rank == 0:
        what = "eager DD reference (no compile, no ddpad)" if args.eager else f"compiled, padder {args.padder}"
        print(f"{what}: total energy of all {len(atoms)} atoms after each step", flush=True)
        for step, energy in enumerate(energies):
            print(f"step {step + 1:4d}  total energy {energy:.10f} eV", flush=True)

    info = [None] * world
    dist.all_gather_object(info, {"graphs": stats.graphs, "caps": dict(md._dist_model._cap_state),
                                  "compiled": stats.graphs_compiled, "compile_s": stats.compile_seconds,
                                  "uncached": stats.graphs_uncached,
                                  "loaded": stats.graphs_loaded, "load_s": stats.load_seconds,
                                  "checked": stats.checks, "check_s": stats.check_seconds,
                                  "disagreed": stats.disagreements,
                                  "owned": (min(owned), max(owned)) if owned else None,
                                  "collectives": padder.collectives if padder is not None else "n/a"})
    if rank == 0:
        print(f"ranks: {world} ({device.type}), padder: {'none (eager)' if args.eager else args.padder}, atoms: {len(atoms)}, "
              f"first step{'' if args.eager else ' (compile)'}: {first:.1f} s, steps/s: {rate:.2f}")
        for r, row in enumerate(info):
            print(f"rank {r}: {row['graphs']} compiled graphs ({row['compiled']} compiled in {row['compile_s']:.1f} s "
                  f"({row['uncached']} past torch's caches), "
                  f"{row['loaded']} loaded in {row['load_s']:.1f} s), {row['checked']} checked in "
                  f"{row['check_s']:.2f} s ({row['disagreed']} disagreed), caps {row['caps']}, "
                  f"owned atoms {row['owned']}, ddpad cap all-reduces {row['collectives']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
