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
    _dtype,
    _load_caps,
    _model,
    _save_caps,
    _store_arguments,
    _system,
    _verbose_option,
)


def cmd_precompile(args: argparse.Namespace) -> int:
    """Compile the system's caps and the next ``--ladder`` buckets into the store."""
    adapter = _adapter(args.adapter, args.verbose)
    if args.ladder < 0:
        raise CliError(f"--ladder must be >= 0, got {args.ladder}")
    if args.no_compile_cache:
        raise CliError("precompile writes into the compile store; drop --no-compile-cache")
    device = _device(args.device)
    dtype = _dtype(adapter, args.dtype)
    atoms = _system(adapter, args.system)
    model, what = _model(adapter, args.model, dtype, device, atoms, args.verbose)
    _check_fits(adapter, model, atoms)

    from ddpad import TightPolicy, wrap
    from .._evaluator import engine_input

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
    print(wrapped.stats.store_line())
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
    p_pre.add_argument("--ladder", type=int, default=2, metavar="K", help="rungs to compile beyond the first caps (default: 2)")
    p_pre.add_argument("--workers", type=int, default=None, metavar="N",
                       help="with --aot: package builds at once (default: one per CPU, at most one per package)")
    p_pre.add_argument("--caps", metavar="FILE.json", help="start from these caps, a caps file from ddpad run (default: the system's own caps)")
    _verbose_option(p_pre, argparse.SUPPRESS)
    p_pre.set_defaults(func=cmd_precompile)
