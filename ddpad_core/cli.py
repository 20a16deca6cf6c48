"""The ``ddpad`` command: ``list`` adapters and ``run`` compiled, padded MD.

Bad input (unknown adapter, missing file, bad system) prints one line
starting with ``ddpad: error:`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["main"]


class CliError(Exception):
    """A user error: reported on one line, exit status 2."""


def _adapter(name: str) -> Any:
    from ddpad import adapters

    try:
        return adapters.get(name)
    except (adapters.AdapterNotFound, adapters.AdapterUnavailable) as exc:
        raise CliError(str(exc)) from None


def _package_version(requires: Sequence[str]) -> str:
    for module in requires:
        dist = importlib.metadata.packages_distributions().get(module.split(".")[0])
        if dist:
            try:
                return importlib.metadata.version(dist[0])
            except importlib.metadata.PackageNotFoundError:
                continue
    return "-"


def cmd_list(args: argparse.Namespace) -> int:
    """Every adapter with its status, model-package version and install hint."""
    from ddpad import adapters

    rows = []
    for name in adapters.available():
        info = adapters.status(name)
        requires = info.get("requires") or []
        state = "installed" if info["ok"] else ("missing" if "not installed" in (info["error"] or "") else "unavailable")
        version = _package_version(requires) if info["ok"] else "-"
        rows.append((name, info["kind"], state, version, info.get("install_hint") or "", info["error"] or ""))
    if args.json:
        keys = ("name", "kind", "status", "version", "install", "error")
        print(json.dumps([dict(zip(keys, row)) for row in rows], indent=2))
        return 0
    print(f"{'adapter':<10} {'kind':<10} {'status':<12} {'version':<10} install")
    for name, kind, state, version, hint, error in rows:
        print(f"{name:<10} {kind:<10} {state:<12} {version:<10} {hint}")
        if error and state != "missing":
            print(f"{'':<10} {error}")
    return 0


def _system(adapter: Any, spec: str | None) -> Any:
    """The system to simulate: the adapter's default, an ASE-readable file,
    or a name ``ase.build`` knows (a molecule or a bulk crystal)."""
    if spec is None:
        if adapter.default_system is None:
            raise CliError(f"adapter {adapter.name!r} has no built-in system; pass --system FILE")
        return adapter.default_system()
    import ase.io
    from ase.build import bulk, molecule

    if os.path.exists(spec):
        try:
            return ase.io.read(spec)
        except Exception as exc:
            raise CliError(f"cannot read system file {spec!r}: {exc}") from None
    if spec.endswith((".xyz", ".extxyz", ".cif", ".traj", ".pdb", ".vasp")) or os.sep in spec:
        raise CliError(f"system file {spec!r} does not exist")
    try:
        return molecule(spec)
    except KeyError:
        pass
    try:
        return bulk(spec, cubic=True) * (3, 3, 3)
    except (KeyError, ValueError, RuntimeError):
        raise CliError(
            f"unknown system {spec!r}: not a file, an ase.build molecule name (e.g. H2O) or a bulk element (e.g. Cu)"
        ) from None


def _model(adapter: Any, path: str | None, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, str]:
    if path is None:
        if adapter.random_model is None:
            raise CliError(f"adapter {adapter.name!r} cannot build a random model; pass --model PATH")
        return adapter.random_model(dtype, device), "RANDOMLY INITIALISED model (no --model given): numbers are not physical"
    if not os.path.exists(path):
        raise CliError(f"model file {path!r} does not exist")
    if adapter.load_model is None:
        raise CliError(f"adapter {adapter.name!r} cannot load checkpoints")
    return adapter.load_model(path, device).to(dtype), f"model {path}"


def _progress(step: int, total: int, started: float) -> None:
    """A progress bar on a terminal; a line per 10 % otherwise (logs, CI)."""
    width = 30
    done = int(width * step / total)
    rate = step / max(time.perf_counter() - started, 1e-9)
    line = f"[{'#' * done}{'.' * (width - done)}] {step}/{total} steps, {rate:6.2f} steps/s"
    if sys.stderr.isatty():
        sys.stderr.write("\r" + line + ("\n" if step == total else ""))
    elif step == total or step % max(1, total // 10) == 0:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def cmd_run(args: argparse.Namespace) -> int:
    """Langevin MD (300 K) under ASE with the adapter's fixed-shape model."""
    adapter = _adapter(args.adapter)
    if args.steps < 1:
        raise CliError(f"--steps must be >= 1, got {args.steps}")
    if args.caps is not None and not os.path.exists(args.caps) and not args.caps.endswith(".json"):
        raise CliError(f"caps file {args.caps!r} does not exist (and is not a .json path to write)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "float64": torch.float64, None: None}[args.dtype]
    if dtype is None:
        dtype = torch.float64 if adapter.name == "mace" else torch.get_default_dtype()
    atoms = _system(adapter, args.system)

    from ase import units
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    from ddpad.ase import Calculator

    model, what = _model(adapter, args.model, dtype, device)
    print(f"ddpad run {adapter.name}: {len(atoms)} atoms, {what}, device {device}, {dtype}")
    caps_in = args.caps if args.caps and os.path.exists(args.caps) else None
    compile_kwargs = {"backend": args.backend} if not args.no_compile else {}
    calc = Calculator(model, adapter, compile=not args.no_compile, caps=caps_in, **compile_kwargs)
    atoms.calc = calc
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=__import__("numpy").random.default_rng(0))
    dyn = Langevin(atoms, 0.5 * units.fs, temperature_K=300, friction=0.01 / units.fs, rng=__import__("numpy").random.default_rng(1))
    writer = None
    if args.traj:
        import ase.io

        writer = open(args.traj, "w")  # noqa: SIM115 - closed below
        dyn.attach(lambda: ase.io.write(writer, atoms, format="extxyz"), interval=args.traj_every)
    started = time.perf_counter()
    counter = {"step": 0}

    def tick() -> None:
        counter["step"] += 1
        if counter["step"] <= args.steps:
            _progress(counter["step"], args.steps, started)

    dyn.attach(tick, interval=1)
    try:
        atoms.get_potential_energy()  # step 0: first compile
        first = time.perf_counter() - started
        dyn.run(args.steps)
    finally:
        if writer is not None:
            writer.close()
    elapsed = time.perf_counter() - started
    stats = calc.wrapped.stats
    steady = args.steps / max(elapsed - first, 1e-9)
    print(f"{args.steps} steps in {elapsed:.1f} s ({args.steps / elapsed:.2f} steps/s overall, "
          f"{steady:.2f} steps/s after the first call, which took {first:.1f} s)")
    print(f"compiled graphs: {stats.graphs}; cap growths: {len(stats.growths)}; unexplained recompiles: {len(stats.unexplained)}")
    print("fill: " + ", ".join(f"{k} {stats.fill[k]:.2f} (cap {stats.caps[k]})" for k in sorted(stats.fill)))
    caps_out = args.caps or f"ddpad-{adapter.name}-caps.json"
    calc.wrapped.save_caps(caps_out)
    print(f"caps written to {caps_out} (pass --caps {caps_out} to start warm)")
    if args.traj:
        print(f"trajectory written to {args.traj}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"adapter": adapter.name, "atoms": len(atoms), "steps": args.steps, "seconds": elapsed,
                       "first_call_seconds": first, "model": what, "device": device, **stats.as_dict()}, fh, indent=2)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Eager, unpadded compiles and ddpad on one fluctuating trajectory."""
    from ._bench import VARIANTS, fluctuating_trajectory, plot, run_bench

    adapter = _adapter(args.adapter)
    if args.steps < 2:
        raise CliError(f"--steps must be >= 2, got {args.steps}")
    if not 0.0 <= args.rate <= 1.0:
        raise CliError(f"--rate must be in [0, 1], got {args.rate}")
    variants = tuple(args.variants.split(",")) if args.variants else VARIANTS
    bad = sorted(set(variants) - set(VARIANTS))
    if bad:
        raise CliError(f"unknown variants {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError("ddpad bench plots with matplotlib: pip install matplotlib") from None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "float64": torch.float64, None: None}[args.dtype]
    if dtype is None:
        dtype = torch.float64 if adapter.name == "mace" else torch.get_default_dtype()
    base = _system(adapter, args.system)
    if args.repeat != 1:
        if not base.pbc.all():
            raise CliError("--repeat needs a periodic system")
        base = base * (args.repeat, args.repeat, args.repeat)
    model, what = _model(adapter, args.model, dtype, device)
    structures = fluctuating_trajectory(base, args.steps, args.rattle, args.rate, seed=args.seed)
    print(f"ddpad bench {adapter.name}: {len(base)} atoms (+-{args.rate} insert/delete per step, "
          f"rattle {args.rattle} A), {args.steps} steps, {what}, device {device}, backend {args.backend}")
    result = run_bench(adapter, model, structures, backend=args.backend, variants=variants)
    result.update(model=what, seed=args.seed, rattle=args.rattle, rate=args.rate, threads=torch.get_num_threads())
    print(f"{'variant':<16} {'total s':>9} {'compile s':>10} {'median ms':>10} {'graphs':>7} {'recomp':>7} {'ddpad x':>8}")
    for name, res in result["variants"].items():
        med = res["steady_median_s"]
        ratio = result["ddpad_speedup"].get(name, {}).get("total")
        print(f"{name:<16} {res['total_s']:9.2f} {res['compile_s']:10.2f} "
              f"{(med * 1e3 if med else float('nan')):10.2f} {res['graphs']:7d} {res['recompiles']:7d} "
              f"{(f'{ratio:.2f}' if ratio else '-'):>8}")
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    plot(result, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddpad", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="adapters, whether their model package is installed, install hints")
    p_list.add_argument("--json", action="store_true", help="machine-readable output")
    p_list.set_defaults(func=cmd_list)
    p_run = sub.add_parser("run", help="compiled, padded MD with an adapter")
    p_run.add_argument("adapter", help="adapter name (see `ddpad list`)")
    p_run.add_argument("--model", help="local checkpoint; default: a randomly initialised model")
    p_run.add_argument("--system", help="structure file (any ASE format) or name; default: the adapter's built-in system")
    p_run.add_argument("--steps", type=int, default=200)
    p_run.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p_run.add_argument("--dtype", choices=["float32", "float64"])
    p_run.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p_run.add_argument("--no-compile", action="store_true", help="pad but run eagerly")
    p_run.add_argument("--caps", help="caps JSON: read at start if it exists, written at the end")
    p_run.add_argument("--traj", help="write an extxyz trajectory here")
    p_run.add_argument("--traj-every", type=int, default=10)
    p_run.add_argument("--json", help="write the run's numbers (timings, graphs, growths, fill) here")
    p_run.set_defaults(func=cmd_run)
    p_bench = sub.add_parser("bench", help="eager / unpadded compiles / ddpad on one fluctuating trajectory")
    p_bench.add_argument("adapter")
    p_bench.add_argument("--model", help="local checkpoint; default: a randomly initialised model")
    p_bench.add_argument("--system", help="structure file or name; default: the adapter's built-in system")
    p_bench.add_argument("--repeat", type=int, default=1, help="supercell repeat of a periodic system (size)")
    p_bench.add_argument("--steps", type=int, default=60)
    p_bench.add_argument("--rattle", type=float, default=0.05, help="per-step displacement scale, A")
    p_bench.add_argument("--rate", type=float, default=0.3, help="probability per step of an atom insert/delete")
    p_bench.add_argument("--seed", type=int, default=0)
    p_bench.add_argument("--variants", help="comma-separated subset of the variants (default all)")
    p_bench.add_argument("--backend", default="inductor")
    p_bench.add_argument("--device")
    p_bench.add_argument("--dtype", choices=["float32", "float64"])
    p_bench.add_argument("--out", default="ddpad-bench.json")
    p_bench.add_argument("--plot", default="ddpad-bench.png")
    p_bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CliError as exc:
        print(f"ddpad: error: {exc}", file=sys.stderr)
        return 2
