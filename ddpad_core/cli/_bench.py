"""``ddpad bench``: the command line of the benchmarks in :mod:`ddpad._bench`
(a trajectory whose atom count changes, steady steps, first calls and warm
starts, ddpad's own per-call cost)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._common import (
    CliError,
    _adapter,
    _check_fits,
    _common_options,
    _device,
    _minutes,
    _model,
    _output_path,
    _system,
    _threads,
    _verbose_option,
    _write_json,
)


def _bench_compile_store(args: argparse.Namespace) -> int:
    """Cold / store-only / warm first calls and (unless ``--first-call``) the
    growing trajectory, each in fresh processes with empty caches; a JSON
    report and a plot of the growing trajectory."""
    from .._bench.warmstart import (
        format_growing,
        format_warm_start,
        growing,
        plot_growing,
        warm_start,
    )

    adapter = _adapter(args.adapter, args.verbose)
    device = _device(args.device)
    mode = "--first-call" if args.first_call else "--compile-store"
    # the model and system checked here, once (a bad --model or element is one line, not a child's traceback)
    _, base, model, what = _bench_system(adapter, args)
    # the children build the model ddpad run would: the dtype resolved here (an adapter takes a dtype, not None)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    print(f"ddpad bench {adapter.name} {mode}: {what}, {len(base)} atoms, {dtype}, fresh processes, empty stores "
          f"and Inductor caches (several compiles: minutes on a CPU)", flush=True)
    chosen = {"model": args.model, "system": None if args.system is None and args.repeat == 1 else base}
    if args.first_call:
        warm = warm_start(adapter.name, backend=args.backend, device=device, dtype=dtype, **chosen)
        print(format_warm_start(adapter.name, warm), flush=True)
        _write_json(args.out, {"adapter": adapter.name, "model": what, "system": base.get_chemical_formula(),
                               "atoms": len(base), "device": device, "dtype": dtype, "warm_start": warm})
        return 0
    if chosen != {"model": None, "system": None}:
        raise CliError("--compile-store runs the adapter's random model on its own system: --model, --system "
                       "and --repeat go with --first-call")
    warm = warm_start(adapter.name, backend=args.backend, device=device, dtype=dtype)
    print(format_warm_start(adapter.name, warm), flush=True)
    grow = growing(adapter.name, steps=args.steps, backend=args.backend, device=device, dtype=dtype,
                   aot=args.aot_ladder)
    print(format_growing(adapter.name, grow), flush=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"adapter": adapter.name, "device": device, "warm_start": warm, "growing": grow}, fh, indent=1)
    plot_growing(adapter.name, grow, args.plot)
    print(f"report written to {args.out}, plot to {args.plot}")
    return 0


def _bench_system(adapter: Any, args: argparse.Namespace) -> tuple[str, Any, Any, str]:
    """``ddpad bench``'s device, system (``--repeat``-ed), model and what the model is."""
    device = _device(args.device)
    base = _system(adapter, args.system)
    if isinstance(base, (list, tuple)):
        raise CliError("ddpad bench takes one system (one ase.Atoms); this file holds several")
    if args.repeat != 1:
        if not base.pbc.all():
            raise CliError("--repeat needs a periodic system")
        base = base * (args.repeat, args.repeat, args.repeat)
    model, what = _model(adapter, args.model, args.dtype, device, base, args.verbose)
    _check_fits(adapter, model, base)
    return device, base, model, what


def _bench_steady(args: argparse.Namespace) -> int:
    """What the dead rows cost a steady step: eager, the unpadded compile at
    the exact shape, ddpad at head-room and at tight caps, alternated."""
    from .._bench.trajectory import fluctuating_trajectory
    from .._bench.steady import format_steady, steady_table

    adapter = _adapter(args.adapter, args.verbose)
    device, base, model, what = _bench_system(adapter, args)
    # the stretch a tight run fits its caps over: its ten-step window, rattled, no insertions
    structures = fluctuating_trajectory(base, 10, args.rattle, 0.0, seed=args.seed)
    print(f"ddpad bench {adapter.name} --steady: {len(base)} atoms, {what}, device {device}, backend "
          f"{args.backend}, {_threads()} thread(s); variants alternated call by call on one frame", flush=True)
    result = steady_table(adapter, model, structures, backend=args.backend, per_key=args.per_key, package=args.package,
                          call_kwargs=adapter.call_options(False),
                          on_variant=lambda name: print(f"compiling / warming {name}…", flush=True))
    print(format_steady(result))
    _write_json(args.out, {**result, "model": what, "system": base.get_chemical_formula()})
    return 0


def _bench_engines(args: argparse.Namespace) -> int:
    """ddpad's MD step inside each engine (ASE, torch-sim, LAMMPS) against
    the engine's own model for the adapter's package, one table."""
    from .._bench.engines import ENGINE_NAMES, Unavailable, format_engines, measure, systems

    adapter = _adapter(args.adapter, args.verbose)
    if args.blocks < 1:
        raise CliError(f"--blocks must be >= 1, got {args.blocks}")
    device = _device(args.device)
    model, what = _model(adapter, args.model, args.dtype, device,
                         systems("one", adapter.engine.molecules)[0], args.verbose)
    print(f"ddpad bench {adapter.name} --engines: {what}, device {device}, backend {args.backend}, {_threads()} "
          f"thread(s); Langevin MD, ddpad and each engine's own model in alternating blocks of 10 steps", flush=True)
    rows, skipped = [], []
    for engine, kind in (("ase", "one"), ("torchsim", "one"), ("torchsim", "batch"), ("lammps", "one")):
        print(f"{ENGINE_NAMES[engine]}, {kind}: compiling, warming, {args.blocks} blocks…", flush=True)
        try:
            rows.append(measure(engine, kind, adapter, model, blocks=args.blocks, backend=args.backend))
        except Unavailable as exc:
            skipped.append((engine, kind, str(exc)))
    print(format_engines(rows, skipped))
    _write_json(args.out, {"adapter": adapter.name, "model": what, "device": device, "threads": _threads(),
                           "engines": rows, "not_measured": [list(s) for s in skipped]})
    if not rows:
        raise CliError(f"ddpad bench {adapter.name} --engines: no engine could run ("
                       + "; ".join(why for _, _, why in skipped) + ")")
    return 0


def _bench_overhead(args: argparse.Namespace) -> int:
    """ddpad's own per-call host cost against the bare model, per built-in padder and size."""
    from .._bench.overhead import QUICK_CALLS, QUICK_SIZES, format_table, overhead_table

    sizes = tuple(args.sizes) if args.sizes else QUICK_SIZES if args.quick else (20, 100, 1000, 10000, 100000)
    calls = args.calls if args.calls is not None else QUICK_CALLS if args.quick else 50
    if min(sizes) < 1 or calls < 1:
        raise CliError(f"--sizes and --calls must be >= 1, got {list(sizes)} and {calls}")
    _output_path(args.out, "--out")
    print(f"ddpad bench --overhead: PaddedModel(compile=False) around a trivial model, {calls} calls per "
          "median, one thread; overhead = wrapped - model; clone = {k: v.clone()} of the input; device ops = "
          "kernels a steady call adds on a GPU"
          + ("; the path columns: a wrapped call over the bare model through torch.compile (inductor, Dynamo's "
             "guards included) and through the ahead-of-time package (one compile and one build per padder and "
             "size: minutes)" if args.paths else ""), flush=True)
    from .._bench.overhead import PADDERS

    padders = args.padders or None
    unknown = sorted(set(padders or ()) - set(PADDERS))
    if unknown:
        raise CliError(f"--padders: unknown {unknown}; the padders are {sorted(PADDERS)}")
    rows = overhead_table(sizes, calls, paths=args.paths, padders=padders)
    print(format_table(rows))
    _write_json(args.out, {"sizes": list(sizes), "calls": calls, "threads": _threads(), "rows": rows})
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Eager, unpadded compiles and ddpad on one fluctuating trajectory."""
    if args.overhead:  # a core install (torch only) runs it: no _bench, no numpy
        return _bench_overhead(args)
    from .._bench.trajectory import VARIANTS, fluctuating_trajectory, plot, run_bench

    if args.adapter is None:
        raise CliError("ddpad bench needs an adapter name (see 'ddpad list'), or --overhead")
    if args.compile_store or args.first_call:
        return _bench_compile_store(args)
    if args.steady:
        return _bench_steady(args)
    if args.engines:
        return _bench_engines(args)
    adapter = _adapter(args.adapter, args.verbose)
    variants = _trajectory_options(args, VARIANTS)
    device, base, model, what = _bench_system(adapter, args)
    structures = fluctuating_trajectory(base, args.steps, args.rattle, args.rate, seed=args.seed)
    print(f"ddpad bench {adapter.name}: {len(base)} atoms (+-{args.rate} insert/delete per step, "
          f"rattle {args.rattle} A), {args.steps} steps, {what}, device {device}, backend {args.backend}")
    compiled_times: list[float] = []

    def report(name: str, index: int, total: int, result: dict[str, Any] | None) -> None:
        if result is None:
            print(f"[{index}/{total}] {name}: {args.steps} steps…", flush=True)
            return
        line = (f"[{index}/{total}] {name}: {result['total_s']:.1f} s (compile {result['compile_s']:.1f} s), "
                f"{result['graphs']} graph{'' if result['graphs'] == 1 else 's'}")
        if name != "eager":
            compiled_times.append(result["total_s"])
        left = total - index
        if left and compiled_times:  # rough: every compiled variant like the mean so far
            line += f"; roughly {_minutes(left * sum(compiled_times) / len(compiled_times))} left"
        print(line, flush=True)

    result = run_bench(adapter, model, structures, backend=args.backend, variants=variants, on_variant=report)
    result.update(model=what, seed=args.seed, rattle=args.rattle, rate=args.rate, threads=_threads())
    _print_variants(result)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    plot(result, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


def _trajectory_options(args: argparse.Namespace, known: tuple[str, ...]) -> tuple[str, ...]:
    """The trajectory benchmark's options checked (each a :class:`CliError`),
    matplotlib there, the outputs writable: the variants to run."""
    if args.steps < 2:
        raise CliError(f"--steps must be >= 2, got {args.steps}")
    if not 0.0 <= args.rate <= 1.0:
        raise CliError(f"--rate must be in [0, 1], got {args.rate}")
    if args.rattle < 0:
        raise CliError(f"--rattle must be >= 0, got {args.rattle}")
    if args.repeat < 1:
        raise CliError(f"--repeat must be >= 1, got {args.repeat}")
    variants = tuple(args.variants.split(",")) if args.variants else known
    bad = sorted(set(variants) - set(known))
    if bad:
        raise CliError(f"unknown variants {', '.join(bad)}; choose from {', '.join(known)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError("ddpad bench plots with matplotlib: pip install matplotlib") from None
    for path, option in ((args.out, "--out"), (args.plot, "--plot")):
        _output_path(path, option)
    return variants


def _print_variants(result: dict[str, Any]) -> None:
    """The trajectory benchmark's table, one row per variant."""
    from .._stats import lowest_fill

    print(f"{'variant':<16} {'total s':>9} {'compile s':>10} {'median ms':>10} {'graphs':>7} {'recomp':>7} "
          f"{'growths':>7} {'slowest x med':>13} {'fill':>6} {'ddpad faster by':>16}")
    for name, res in result["variants"].items():
        med = res["steady_median_s"]
        ratio = result["ddpad_speedup"].get(name, {}).get("total")
        low = lowest_fill(res["fill"])
        slowest = res["slowest_later_s"] / med if med else float("nan")
        print(f"{name:<16} {res['total_s']:9.2f} {res['compile_s']:10.2f} "
              f"{(med * 1e3 if med else float('nan')):10.2f} {res['graphs']:7d} {res['recompiles']:7d} "
              f"{res['growth_calls']:7d} {slowest:13.1f} {(f'{low:.3f}' if low is not None else '-'):>6} "
              f"{(f'{ratio:.2f}x' if ratio else '-'):>16}")
    print("growths: calls that grew or fitted caps; fill: the lowest key's real rows / cap (mean since the caps "
          "last changed); ddpad faster by: this variant's total time / ddpad's (below 1: this variant was faster)")


def add_parser(sub: Any) -> None:
    """The ``bench`` command's parser, under ``sub``."""
    p_bench = sub.add_parser(
        "bench", help="eager / unpadded torch.compile / ddpad on one fluctuating trajectory",
        description="Time eager, torch.compile without padding (dynamic=False, True, default), the model "
                    "package's own padding where it has one, and ddpad on one trajectory whose atom count "
                    "changes; write a JSON report and a plot. Compiles dominate (minutes per compiled variant "
                    "on a CPU); for a quick look: --steps 20 --variants eager,compile-dynamic,ddpad.")
    _common_options(p_bench)
    adapter_arg = next(a for a in p_bench._actions if a.dest == "adapter")
    adapter_arg.nargs = "?"  # not needed with --overhead (checked in cmd_bench)
    p_bench.add_argument("--overhead", action="store_true",
                         help="instead: time ddpad's own per-call host cost (pad, unpad, cap resolution, "
                              "bookkeeping) for every built-in padder against the bare model and a clone of "
                              "the input, and print the table (no adapter needed; default: off)")
    p_bench.add_argument("--quick", action="store_true", help="with --overhead: 20 / 100 / 1,000 atoms, 10 calls (default: off)")
    p_bench.add_argument("--sizes", type=int, nargs="+", metavar="N",
                         help="with --overhead: atom counts (default: 20 100 1000 10000 100000)")
    p_bench.add_argument("--calls", type=int, metavar="N", help="with --overhead: timed calls per median (default: 50)")
    p_bench.add_argument("--aot-ladder", action="store_true",
                         help="with --compile-store: the growing trajectory also after ddpad precompile --aot "
                              "(packages built in worker processes; minutes; default: off)")
    p_bench.add_argument("--paths", action="store_true",
                         help="with --overhead: also a wrapped call's cost through torch.compile and through the "
                              "ahead-of-time package (compiles per padder and size: minutes; default: off)")
    p_bench.add_argument("--padders", nargs="+", metavar="NAME",
                         help="with --overhead: these padders only (default: all)")
    p_bench.add_argument("--repeat", type=int, default=1, metavar="N",
                         help="N x N x N supercell of a periodic system, to scale it up (default: 1)")
    p_bench.add_argument("--steps", type=int, default=60, help="trajectory length (default: 60)")
    p_bench.add_argument("--rattle", type=float, default=0.05, metavar="A",
                         help="per-step random displacement scale in A (default: 0.05)")
    p_bench.add_argument("--rate", type=float, default=0.3,
                         help="probability per step of inserting or deleting an atom (default: 0.3)")
    p_bench.add_argument("--seed", type=int, default=0, help="random seed of the trajectory (default: 0)")
    p_bench.add_argument("--variants", metavar="A,B,...",
                         help="comma-separated subset of eager, compile-static, compile-dynamic, "
                              "compile-default, native-padding, ddpad (head room), ddpad-tight (default: all)")
    p_bench.add_argument("--steady", action="store_true",
                         help="what the dead rows cost a steady step: eager, the model compiled at the exact "
                              "shape, ddpad at head-room and at tight caps, alternated on one frame (default: off)")
    p_bench.add_argument("--per-key", action="store_true",
                         help="with --steady: also the head-room caps with one key fitted at a time (rows vs "
                              "neighbour columns; default: off)")
    p_bench.add_argument("--package", action="store_true",
                         help="with --steady: also the tight caps through the ahead-of-time package, built first "
                              "(minutes for a real model), against torch.compile at the same caps (default: off)")
    p_bench.add_argument("--compile-store", action="store_true",
                         help="instead: first calls cold / from the store / warm, and a system growing by one "
                              "atom every 5 steps (--steps) with and without background compiles, each in fresh "
                              "processes (default: off)")
    p_bench.add_argument("--first-call", action="store_true",
                         help="instead: the first call cold / from the store / warm / as an ahead-of-time "
                              "package built then loaded, each in a fresh process (--compile-store without the "
                              "growing trajectory; default: off)")
    p_bench.add_argument("--engines", action="store_true",
                         help="instead: ddpad's MD step inside ASE, torch-sim and LAMMPS (one rank) against each "
                              "engine's own model from the model package (its calculator, its torch-sim model; "
                              "for LAMMPS the plain eager model in the same callback), alternated in one "
                              "process, one table (default: off)")
    p_bench.add_argument("--blocks", type=int, default=8, metavar="N",
                         help="with --engines: alternating blocks of 10 steps timed per variant (default: 8)")
    p_bench.add_argument("--out", default="ddpad-bench.json", metavar="FILE",
                         help="JSON report (default: ddpad-bench.json)")
    p_bench.add_argument("--plot", default="ddpad-bench.png", metavar="FILE",
                         help="plot of cumulative wall time against step (default: ddpad-bench.png)")
    _verbose_option(p_bench, argparse.SUPPRESS)
    p_bench.set_defaults(func=cmd_bench)
