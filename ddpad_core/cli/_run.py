"""``ddpad run``: compiled, padded Langevin MD under ASE, with a progress
line, the compile announcements and a summary of what the run compiled,
loaded, grew and filled."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from ._common import (
    CliError,
    _adapter,
    _cache_dir,
    _cached_caps,
    _cached_caps_path,
    _check_fits,
    _common_options,
    _device,
    _Interrupted,
    _load_caps,
    _model,
    _output_path,
    _save_caps,
    _store_arguments,
    _store_options,
    _system,
    _verbose_option,
)
from ._report import checks_line, fill_line, growth_line, store_line


# -- what the user sees while it runs -------------------------------------------


class _Progress:
    """A progress bar on a terminal, a line per 10 % otherwise (logs, CI):
    the steps/s of the steps since the last 10 % mark, less those that
    compiled or loaded a graph (``compiles``: how many so far), and apart
    the seconds spent in those and the first call."""

    def __init__(self, total: int, compiles: Callable[[], int] = lambda: 0) -> None:
        self.total = total
        self.compiles = compiles
        self.open = False  # a bar is drawn on the current terminal line
        self.start(0.0)

    def start(self, compiling: float) -> None:
        """The steps start; the first call took ``compiling`` seconds."""
        self.last, self.seen, self.compiling = time.perf_counter(), self.compiles(), compiling
        self.steps, self.seconds = 0, 0.0  # the steps since the last mark that compiled nothing
        self.all_steps, self.all_seconds = 0, 0.0  # every step that compiled nothing

    def step(self, step: int) -> None:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        seen = self.compiles()
        if seen != self.seen:  # this step compiled or loaded: its time is the compile's
            self.seen, self.compiling = seen, self.compiling + seconds
        else:
            self.steps, self.seconds = self.steps + 1, self.seconds + seconds
            self.all_steps, self.all_seconds = self.all_steps + 1, self.all_seconds + seconds
        width = 30
        done = int(width * step / self.total)
        rate = f"{self.steps / max(self.seconds, 1e-9):6.2f}" if self.steps else "     -"
        line = (f"[{'#' * done}{'.' * (width - done)}] {step}/{self.total} steps, {rate} steps/s, "
                f"{self.compiling:.1f} s compiling so far")
        mark = step == self.total or step % max(1, self.total // 10) == 0
        if sys.stderr.isatty():
            self.open = step != self.total
            sys.stderr.write("\r" + line + ("\n" if step == self.total else ""))
        elif mark:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
        if mark:
            self.steps, self.seconds = 0, 0.0

    def end(self) -> None:
        """End a drawn bar's line (the run stopped before its last step)."""
        if self.open:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.open = False

    def say(self, message: str) -> None:
        """Print ``message`` on a line of its own, under any drawn bar."""
        if self.open:
            sys.stderr.write("\n")
            self.open = False
        print(message, flush=True)


class _Announcements(logging.Handler):
    """Says, under the progress line, when a call of the run starts
    compiling or loading (the first call, caps fitted, grew or shrank): the
    library's :class:`ddpad._noise.CompileEvent` records, heard on the
    ``ddpad`` logger."""

    def __init__(self, name: str, progress: _Progress) -> None:
        super().__init__(logging.INFO)
        self._name = name
        self._progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ddpad_compile", None)
        if event is None or event.phase != "start":
            return
        if event.kind == "first":
            line = f"first call of {self._name} at caps {dict(event.caps)}: compiling or loading its graph…"
        elif event.kind == "seam":
            line = f"first call of {self._name} (caps sized at its padding seam): compiling or loading its graph…"
        elif event.change is not None:
            line = f"caps {event.change}: compiling or loading their graph…"
        else:
            line = f"{event.message}…"
        self._progress.say(line)


@contextlib.contextmanager
def _announcing(name: str, progress: _Progress) -> Iterator[None]:
    """The run's compile announcements (:class:`_Announcements`) while it runs."""
    own = logging.getLogger("ddpad")
    handler = _Announcements(name, progress)
    own.addHandler(handler)
    try:
        yield
    finally:
        own.removeHandler(handler)


def _langevin(atoms: Any) -> Any:
    """Langevin MD at 300 K, 0.5 fs; the centre of mass held by ``FixCom``
    (ASE's own ``fixcm`` flag is deprecated)."""
    import numpy as np
    from ase import units
    from ase.constraints import FixCom
    from ase.md import velocitydistribution
    from ase.md.langevin import Langevin

    atoms.set_constraint([*atoms.constraints, FixCom()])
    # ase >= 3.27 deprecates MaxwellBoltzmannDistribution for thermalize_momenta (the same draw)
    thermalize = getattr(velocitydistribution, "thermalize_momenta", None)
    if thermalize is not None:
        thermalize(atoms, 300, rng=np.random.default_rng(0))
    else:
        velocitydistribution.MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
    return Langevin(atoms, 0.5 * units.fs, temperature_K=300, friction=0.01 / units.fs, fixcm=False,
                    rng=np.random.default_rng(1))


def cmd_run(args: argparse.Namespace) -> int:
    """Langevin MD (300 K) under ASE with the adapter's fixed-shape model."""
    adapter = _adapter(args.adapter, args.verbose)
    _check_options(args)
    device = _device(args.device)
    caps_in = _load_caps(args.caps, adapter.name)  # checked (adapter included) before anything is announced
    atoms = _system(adapter, args.system)
    if isinstance(atoms, (list, tuple)):
        raise CliError("ddpad run takes one system (one ase.Atoms); this file holds several")
    model, what = _model(adapter, args.model, args.dtype, device, atoms, args.verbose)
    dtype = next(model.parameters()).dtype
    _check_fits(adapter, model, atoms)
    caps_path, cached = args.caps, args.caps is None
    if cached:
        caps_path = _cached_caps_path(adapter.name, model, atoms)
        caps_in = None if args.no_caps else _cached_caps(caps_path, adapter.name)

    from ddpad.ase import Calculator

    print(f"ddpad run {adapter.name}: {len(atoms)} atoms, {what}, device {device}, {dtype}")
    if caps_in is not None:
        origin = (" (the last run of this model on this system; --no-caps starts from the system's own)"
                  if cached else "")
        print(f"caps loaded from {caps_path}{origin}: {caps_in}")
    compile_kwargs = _store_options(args) if not args.no_compile else {}
    # a caps file goes in as its path: it says whether a tight run fitted its caps
    preset = caps_path if caps_in is not None else None
    policy: Any = args.cap_policy
    if policy == "tight":  # a run shorter than the window still fits, and compiles once, on its last call
        from .. import TightPolicy

        policy = TightPolicy(settle=min(TightPolicy().settle, args.steps + 1))
    # (the run keeps the cached caps file itself: --no-caps, an unreadable file, --caps elsewhere)
    calc = Calculator(model, adapter, compile=not args.no_compile, caps=preset, cap_policy=policy,
                      cached_caps=False, **compile_kwargs)
    wrapped = calc.wrapped
    assert wrapped is not None
    atoms.calc = calc
    first, elapsed, progress = _steps(args, adapter.name, atoms, wrapped, caps_path)
    _summary(args, wrapped.stats, progress, elapsed)
    _save_caps(wrapped, caps_path)
    print(f"caps written to {caps_path} "
          + ("(the next run of this model on this system starts from them)" if cached
             else f"(pass --caps {caps_path} to start warm)"))
    if args.traj:
        print(f"trajectory written to {args.traj}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"adapter": adapter.name, "atoms": len(atoms), "steps": args.steps, "seconds": elapsed,
                       "first_call_seconds": first, "model": what, "device": device, "caps_file": caps_path,
                       "growth_calls": wrapped.stats.growth_calls, **wrapped.stats.as_dict()}, fh, indent=2)
    return 0


def _check_options(args: argparse.Namespace) -> None:
    """``ddpad run``'s options that contradict each other or are out of range,
    each a :class:`CliError`; the output paths writable."""
    if args.steps < 1:
        raise CliError(f"--steps must be >= 1, got {args.steps}")
    if args.traj_every < 1:
        raise CliError(f"--traj-every must be >= 1, got {args.traj_every}")
    if args.warm_ladder < 0 or (args.warm_ladder and args.no_compile):
        raise CliError(f"--warm-ladder takes a number of rungs >= 0 and needs compiling, got {args.warm_ladder}"
                       + (" with --no-compile" if args.no_compile else ""))
    if args.caps is not None and not os.path.exists(args.caps) and not args.caps.endswith(".json"):
        raise CliError(f"caps file {args.caps!r} does not exist (and is not a .json path to write)")
    if args.no_caps and args.caps is not None:
        raise CliError("--no-caps (start from the system's own caps) and --caps FILE (start from FILE): give one")
    for path, option in ((args.caps, "--caps"), (args.traj, "--traj"), (args.json, "--json")):
        _output_path(path, option)


def _steps(
    args: argparse.Namespace, name: str, atoms: Any, wrapped: Any, caps_path: str
) -> tuple[float, float, _Progress]:
    """The first call (step 0), then ``args.steps`` Langevin steps, with the
    progress line and the compile announcements: the first call's seconds,
    all the steps' seconds and the progress (its compile-free steps)."""
    stats = wrapped.stats
    progress = _Progress(args.steps, lambda: stats.graphs + stats.aot_compiled + stats.aot_loaded)
    dyn = _langevin(atoms)

    def tick() -> None:
        if 1 <= dyn.nsteps <= args.steps:  # (ASE calls its observers before the first step too)
            progress.step(dyn.nsteps)

    dyn.attach(tick, interval=1)
    writer = None
    started = time.perf_counter()
    with _announcing(name, progress):
        try:
            try:
                atoms.get_potential_energy()  # step 0: the first compile
            except KeyboardInterrupt:
                what_ran = "call" if args.no_compile else "compile"
                raise _Interrupted(f"interrupted during the first {what_ran}; nothing was written") from None
            first = time.perf_counter() - started
            if not args.no_compile:
                said = ("the eager step: tight caps settle before the one compile" if stats.settling_steps
                        else stats.work())
                print(f"first call {first:.1f} s: {said}", flush=True)
            if args.traj:  # opened only now: an interrupted first compile leaves no empty file
                import ase.io

                writer = open(args.traj, "w", encoding="utf-8")  # noqa: SIM115 - closed below
                dyn.attach(lambda: ase.io.write(writer, atoms, format="extxyz"), interval=args.traj_every)
            progress.start(first)
            try:
                dyn.run(args.steps)
            except KeyboardInterrupt:
                progress.end()
                raise _Interrupted(f"interrupted at step {min(dyn.nsteps, args.steps)} of {args.steps}; "
                                   f"caps written to {_save_caps(wrapped, caps_path)}"
                                   + (f", the trajectory so far to {args.traj}" if args.traj else "")) from None
            ran = time.perf_counter()  # (the steps' time: not the wait for package builds)
            _finish_builds(wrapped)
        finally:
            wrapped.close()  # background compiles
            if writer is not None:
                writer.close()
    return first, ran - started, progress


def _summary(args: argparse.Namespace, stats: Any, progress: _Progress, elapsed: float) -> None:
    """The run's summary: speed, graphs and growths, the store, the checks, the fill."""
    stepping = (f"{progress.all_steps / max(progress.all_seconds, 1e-9):.2f} steps/s on the "
                f"{progress.all_steps} step(s) that compiled nothing" if progress.all_steps else "every step compiled")
    compiling = "" if args.no_compile else f"{progress.compiling:.1f} s compiling or loading (the first call included), "
    print(f"{args.steps} steps in {elapsed:.1f} s: {compiling}{stepping}")
    print(f"compiled graphs: {stats.graphs}; {growth_line(stats)}; "
          f"unexplained recompiles: {len(stats.unexplained)}")
    if stats.store_hits or stats.store_misses or stats.rungs_warmed or stats.aot_compiled or stats.aot_loaded \
            or stats.aot_refused or stats.background_started:  # not every backend stores
        print(store_line(stats))
    if not args.no_compile:
        print(checks_line(stats, getattr(args, "verify", True)))
    print(fill_line(stats, args.cap_policy))


def _finish_builds(wrapped: Any) -> None:
    """Let the packages worker processes are building (``--aot``) land in the
    store, so the next run loads them; Ctrl-C leaves them unbuilt."""
    builds = wrapped.manager.package_builds
    if builds is None or not builds.active:
        return
    print(f"waiting for {builds.pending} ahead-of-time package build(s) in the "
          "background, for the next run (Ctrl-C skips)", flush=True)
    t0 = time.perf_counter()
    try:
        left = wrapped.finish_builds()
    except KeyboardInterrupt:
        print("package builds stopped: the next run builds them", flush=True)
        return
    print(f"package builds done in {time.perf_counter() - t0:.1f} s" + (f" ({left} left)" if left else ""),
          flush=True)


def add_parser(sub: Any) -> None:
    """The ``run`` command's parser, under ``sub``."""
    p_run = sub.add_parser(
        "run", help="compiled, padded Langevin MD (300 K) with an adapter",
        description="Compiled, padded Langevin MD at 300 K, 0.5 fs steps, under ASE. Prints steps/s, compiled "
                    "graphs, growth calls (the steps on which caps grew) and fill; keeps the caps for a warm restart "
                    "of the same model on the same system.")
    _common_options(p_run)
    _store_arguments(p_run)
    p_run.add_argument("--steps", type=int, default=200, help="MD steps (default: 200)")
    p_run.add_argument("--no-compile", action="store_true",
                       help="pad but run eagerly, no torch.compile (default: compile)")
    p_run.add_argument("--caps", metavar="FILE.json",
                       help="caps file: read at the start if it exists (a warm restart), written at the end; "
                            "default: the user cache's file of this model (its architecture) on this system (its "
                            f"formula), under {os.path.join(_cache_dir(), 'caps')}, read when an earlier run "
                            "left it")
    p_run.add_argument("--no-caps", action="store_true",
                       help="do not read the user cache's caps of an earlier run: start from the system's own "
                            "caps (this run's are still written; default: read them)")
    p_run.add_argument("--traj", metavar="FILE", help="write an extxyz trajectory here (default: none)")
    p_run.add_argument("--traj-every", type=int, default=10, metavar="N",
                       help="write every N-th step to --traj (default: 10)")
    p_run.add_argument("--json", metavar="FILE",
                       help="write the run's numbers (timings, graphs, growth calls and events, fill) here (default: none)")
    p_run.add_argument("--background-compile", type=float, default=0.9, metavar="FILL",
                       help="when a cap's fill passes FILL, compile its next bucket in a worker process, "
                            "so the growth only loads (default: 0.9)")
    p_run.add_argument("--warm-ladder", type=int, default=0, metavar="K",
                       help="the first call also compiles (or loads, after ddpad precompile --ladder K) the next K "
                            "rungs of caps, so growths up to them never wait for a compile (default: 0)")
    p_run.add_argument("--no-background-compile", dest="background_compile", action="store_const", const=None,
                       help="no background compiles (default: on)")
    p_run.add_argument("--no-verify", dest="verify", action="store_false",
                       help="skip the check of each compiled graph's first call against the eager step (one "
                            "eager step per compiled graph; default: checked)")
    _verbose_option(p_run, argparse.SUPPRESS)
    p_run.set_defaults(func=cmd_run)
