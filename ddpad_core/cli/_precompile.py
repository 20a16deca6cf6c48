"""``ddpad precompile``: a model's caps and the next growth buckets compiled
(or built as ahead-of-time packages) into the compile store."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ._common import (
    CliError,
    _adapter,
    _cached_caps_path,
    _check_fits,
    _common_options,
    _device,
    _load_caps,
    _model,
    _save_caps,
    _store_arguments,
    _system,
    _verbose_option,
)
from ._report import store_line


def cmd_precompile(args: argparse.Namespace) -> int:
    """Compile the system's caps and the next ``--ladder`` buckets into the store."""
    adapter = _adapter(args.adapter, args.verbose)
    if args.ladder is not None and args.ladder < 0:
        raise CliError(f"--ladder must be >= 0, got {args.ladder}")
    if args.no_compile_cache:
        raise CliError("precompile writes into the compile store; drop --no-compile-cache")
    # (pair_style ddpad runs CPU packages: --lammps builds on the CPU unless told otherwise, which it refuses)
    device = "cpu" if args.lammps and args.device is None else _device(args.device)
    atoms = _system(adapter, args.system)
    model, what = _model(adapter, args.model, args.dtype, device, atoms, args.verbose)
    dtype = next(model.parameters()).dtype
    _check_fits(adapter, model, atoms)

    from ddpad import TightPolicy, wrap
    from .._evaluator import engine_input

    if args.lammps:
        return _precompile_lammps(args, adapter, model, what, atoms, device, dtype)
    args.ladder = 2 if args.ladder is None else args.ladder
    loaded = _load_caps(args.caps, adapter.name)  # checked first
    preset = args.caps if loaded is not None else None
    if args.aot:
        return _precompile_packages(args, adapter, model, what, atoms, loaded, device, dtype)
    # tight: the caps fitted to this system on the first call (a run's window is
    # ten steps), written where ddpad run looks for them, so the run starts there
    policy: Any = TightPolicy(settle=1) if args.cap_policy == "tight" else "headroom"
    wrapped = wrap(model, adapter, caps=preset, compile_cache=args.compile_cache, backend=args.backend,
                   on_recompile="ignore", warm_ladder=args.ladder, cap_policy=policy)
    data = engine_input(adapter, model, atoms)  # as the run's calculator builds it
    print(f"ddpad precompile {adapter.name}: {what}, device {device}, {dtype}, store {args.compile_cache}")
    t0 = time.perf_counter()
    wrapped(data, **adapter.call_options(False))
    seconds, warm = time.perf_counter() - t0, wrapped.stats.warm_seconds
    print(f"caps {wrapped.caps}: {seconds - warm:.1f} s")
    for caps in wrapped.rungs:
        print(f"caps {caps}")
    print(f"{len(wrapped.rungs)} rung(s) in {warm:.1f} s")
    print(store_line(wrapped.stats))
    if args.caps is None:
        print(f"caps written to {_save_caps(wrapped, _cached_caps_path(adapter.name, model, atoms))} "
              "(ddpad run of this model on this system starts from them)")
    return 0


def _precompile_packages(args: argparse.Namespace, adapter: Any, model: Any, what: str, atoms: Any,
                         caps: dict[str, int] | None, device: str, dtype: Any) -> int:
    """``ddpad precompile --aot``: the caps' and rungs' packages, each built in
    its own worker process (``--workers`` at once)."""
    from .._evaluator import engine_input
    from .._prebuild import prebuild_packages

    if args.workers is not None and args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    data = engine_input(adapter, model, atoms)  # as the run's calculator builds it
    print(f"ddpad precompile --aot {adapter.name}: {what}, device {device}, {dtype}, store {args.compile_cache}; "
          f"{args.ladder} rung(s), packages built in worker processes", flush=True)
    built = prebuild_packages(model, adapter, data, store=args.compile_cache, rungs=args.ladder,
                              workers=args.workers, caps=caps, tight=args.cap_policy == "tight",
                              call_kwargs=adapter.call_options(False), compile_kwargs={"backend": args.backend})
    for caps_built in [built.caps, *built.rungs]:
        print(f"caps {caps_built}")
    print(f"{1 + len(built.rungs)} package(s) in {built.seconds:.1f} s")
    for name, why in built.failed.items():
        print(f"caps {name}: {why}")
    if args.caps is None:
        print(f"caps written to {_save_caps(built.sizing, _cached_caps_path(adapter.name, model, atoms))} "
              "(ddpad run of this model on this system starts from them)")
    if built.failed:
        raise CliError(f"{len(built.failed)} of {1 + len(built.rungs)} package build(s) failed (above); a run "
                       "falls back to torch.compile at those caps")
    return 0


def _precompile_lammps(args: argparse.Namespace, adapter: Any, model: Any, what: str, atoms: Any,
                       device: str, dtype: Any) -> int:
    """``ddpad precompile --lammps``: ``pair_style ddpad`` packages, one per
    rung, sized from the system as one LAMMPS rank holding all of it sees it
    (its atoms and ghosts) and halved per rung, or ``--rung`` caps."""
    from ..engines.lammps_package import build_ladder, ghost_graph

    rungs = [_rung(text) for text in args.rung] if args.rung else None
    if device != "cpu":
        raise CliError(f"pair_style ddpad runs CPU packages (GPU packages are not built yet); drop --device {device}")
    if adapter.engine.lammps_input is None:
        raise CliError(f"adapter {adapter.name!r} cannot be packaged for pair_style ddpad (no lammps_input); "
                       "run it in LAMMPS through ddpad.engines.lammps.Potential (fix external)")
    ladder = 4 if args.ladder is None else args.ladder
    if ladder < 1:
        raise CliError(f"--ladder must be >= 1 with --lammps (packages to build), got {ladder}")
    if not all(atoms.pbc):
        raise CliError("--lammps sizes its packages from a periodic system (the box LAMMPS holds); pass "
                       "--system FILE with a cell, or --rung ATOMS:EDGES")
    layers = adapter.engine.message_layers(model) if adapter.engine.message_layers is not None else 1
    cutoff = float(adapter.cutoff(model))
    ghost = layers * cutoff + args.skin
    example = ghost_graph(atoms, adapter.engine.lammps_input(model)[0], cutoff, ghost).pruned(layers)
    out = args.out or f"{adapter.name}-lammps"
    print(f"ddpad precompile --lammps {adapter.name}: {what}, {dtype}; {len(atoms)} atoms and the "
          f"{example.n_atoms - len(atoms)} ghosts and {example.n_edges} pairs their energy depends on ({layers} "
          f"layers x cutoff {cutoff:g}); packages into {out}", flush=True)
    t0 = time.perf_counter()
    try:
        built = build_ladder(model, adapter, out, example, rungs=ladder, caps=rungs,
                             on_built=lambda p: print(f"{p.path}: {p.atoms} atoms, {p.edges} edges, checked, "
                                                      f"{p.seconds:.0f} s", flush=True))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print(f"{len(built)} package(s) in {time.perf_counter() - t0:.0f} s; in LAMMPS: pair_style ddpad {out}, "
          f"comm_modify cutoff {ghost:g} (build the plugin once: ddpad lammps build-plugin)")
    return 0


def _rung(text: str) -> tuple[int, int]:
    try:
        atoms, edges = (int(v) for v in text.split(":"))
    except ValueError:
        raise CliError(f"--rung takes ATOMS:EDGES (e.g. 2048:65536), got {text!r}") from None
    return atoms, edges


def add_parser(sub: Any) -> None:
    """The ``precompile`` command's parser, under ``sub``."""
    p_pre = sub.add_parser(
        "precompile", help="compile a model's caps and the next growth buckets into the compile store",
        description="Compile the adapter's model at the system's caps (or --caps) and at the next --ladder "
                    "rungs of caps (each one bucket up in every count but the number of systems) into the "
                    "compile store, so a later run whose system grows loads instead of compiling (and, with "
                    "run --warm-ladder, loads them all before its first step).")
    _common_options(p_pre)
    _store_arguments(p_pre)
    p_pre.add_argument("--ladder", type=int, default=None, metavar="K",
                       help="rungs to compile beyond the first caps (default: 2); with --lammps, packages to build, "
                            "each 0.8 x the one above (default: 4)")
    p_pre.add_argument("--workers", type=int, default=None, metavar="N",
                       help="with --aot: package builds at once (default: one per CPU, at most one per package)")
    p_pre.add_argument("--caps", metavar="FILE.json", help="start from these caps, a caps file from ddpad run (default: the system's own caps)")
    p_pre.add_argument("--lammps", action="store_true",
                       help="build pair_style ddpad packages (one per --ladder rung, largest first) into --out "
                            "(default: compile-store entries for ddpad's own runs)")
    p_pre.add_argument("--out", metavar="DIR", help="with --lammps: the packages' folder (default: ADAPTER-lammps)")
    p_pre.add_argument("--rung", action="append", metavar="ATOMS:EDGES",
                       help="with --lammps: a package's caps (repeatable; default: sized from --system)")
    p_pre.add_argument("--skin", type=float, default=1.0, metavar="A",
                       help="with --lammps: LAMMPS's neighbour skin, for the ghost depth (default: 1.0)")
    _verbose_option(p_pre, argparse.SUPPRESS)
    p_pre.set_defaults(func=cmd_precompile)
