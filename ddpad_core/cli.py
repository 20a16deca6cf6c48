"""The ddpad command: list adapters, run compiled padded MD, benchmark.

Every mistake in the input (unknown adapter, missing or unreadable file,
system the model does not know, unavailable device, bad option) prints one
line starting with ``ddpad: error:`` and exits with status 2, never a
traceback. Known third-party noise (TorchScript and ``torch.load`` warnings,
import-time banners) is silenced unless ``-v`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import inspect
import io
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ddpad._fs import cache_dir
from ddpad._noise import ignore_noise

if TYPE_CHECKING:
    import torch

# torch and the model packages are imported inside the commands, not here:
# parsing the arguments and printing help takes no torch import (seconds).

__all__ = ["main"]

DESCRIPTION = (
    "Keep torch.compile'd interatomic potentials on one compiled graph through MD. "
    "Commands: 'list' shows the adapters and whether their model package is installed; "
    "'run' runs compiled, padded Langevin MD; 'bench' times eager, unpadded torch.compile "
    "and ddpad on one trajectory whose atom count changes. 'ddpad COMMAND -h' for options."
)



class CliError(Exception):
    """A user error: reported on one line, exit status 2."""


class _Interrupted(Exception):
    """Ctrl-C, with what the run had done by then: one line, exit status 130."""


def _one_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (its type if none)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _a(word: str) -> str:
    """``word`` with its indefinite article: "an OrderedDict", "a dict"."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def _format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    line: str | None = None) -> str:
    """Warnings as one line: ddpad's own as ``ddpad: warning: ...``, others
    (shown with -v) with their origin."""
    text = str(message)
    if text.startswith("ddpad: "):
        return f"ddpad: warning: {text[len('ddpad: '):]}\n"
    return f"{category.__name__} ({filename}:{lineno}): {text}\n"


@contextlib.contextmanager
def _quiet_prints(verbose: bool) -> Iterator[None]:
    """Swallow what model packages print on import (e.g. mace's cuequivariance
    notice, Warp's banner); with ``-v`` let it through."""
    if verbose:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield
    warp = sys.modules.get("warp")
    config = getattr(warp, "config", None)
    if config is not None and hasattr(config, "quiet"):
        config.quiet = True  # Warp prints its banner when it initialises, later


def _adapter(name: str, verbose: bool = False) -> Any:
    """The adapter ``name``, its model package imported; a missing or broken
    one is a :class:`CliError` (one line: what failed and the fix)."""
    from ddpad import adapters

    try:
        with _quiet_prints(verbose):
            return adapters.get(name)
    except (adapters.AdapterNotFound, adapters.AdapterUnavailable) as exc:
        raise CliError(" ".join(str(exc).split())) from None


def _package_version(requires: Sequence[str], owners: Mapping[str, Sequence[str]] | None = None) -> str:
    """The version of the first of ``requires`` (import names, the model
    package's first) whose distribution is installed; ``owners`` is
    ``importlib.metadata.packages_distributions()``, looked up once by the caller."""
    owners = importlib.metadata.packages_distributions() if owners is None else owners
    for module in requires:
        dist = owners.get(module.split(".")[0])
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
    owners = importlib.metadata.packages_distributions()
    for name in adapters.available():
        with _quiet_prints(getattr(args, "verbose", False)):  # status imports the model package
            info = adapters.status(name)
        requires = info.get("requires") or []
        state = info["state"]  # installed only when its packages import; broken when one fails to
        version = _package_version(requires, owners) if state in ("installed", "broken") else "-"
        error = " ".join((info["error"] or "").split())
        rows.append((name, info["kind"], state, version, info.get("install_hint") or "", error))
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


# -- checks of the input -------------------------------------------------------


def _device(spec: str | None) -> str:
    """The device to run on: ``spec`` checked against this torch build, or
    cuda when available, else cpu."""
    import torch

    if spec is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise CliError(f"--device {spec!r} is not a device torch knows (cpu, cuda, cuda:1 ...)") from None
    if device.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise CliError(f"--device {spec}: this torch {torch.__version__} is built without CUDA; "
                           "install a CUDA build of torch or use --device cpu")
        if not torch.cuda.is_available():
            raise CliError(f"--device {spec}: torch sees no GPU on this machine; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CliError(f"--device {spec}: only {torch.cuda.device_count()} GPU(s) visible")
    return spec


def _dtype(adapter: Any, name: str | None) -> torch.dtype:
    import torch

    if name is not None:
        return {"float32": torch.float32, "float64": torch.float64}[name]
    return torch.float64 if adapter.name == "mace" else torch.get_default_dtype()


def _output_path(path: str | None, option: str) -> None:
    """``path`` can be written: its directory exists."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"{option} {path!r}: directory {folder!r} does not exist")
    if os.path.isdir(path):
        raise CliError(f"{option} {path!r} is a directory, not a file")


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
        except Exception as exc:  # noqa: BLE001 - any reader failure is the file's
            raise CliError(f"cannot read system file {spec!r}: {_one_line(exc)}") from None
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


def _numbers(atoms: Any) -> set[int]:
    structures = atoms if isinstance(atoms, (list, tuple)) else [atoms]
    return {int(z) for a in structures for z in a.numbers}


def _symbols(numbers: Sequence[int]) -> str:
    from ase.data import chemical_symbols

    return ", ".join(chemical_symbols[z] for z in numbers)


def _model(
    adapter: Any, path: str | None, dtype: torch.dtype, device: str, atoms: Any, verbose: bool = False
) -> tuple[torch.nn.Module, str]:
    """The model to run and a description of it. Without ``path``, the
    adapter's random model; if it takes ``atomic_numbers`` (mace), built for
    the system's elements as well as its own defaults."""
    import torch

    if path is None:
        if adapter.random_model is None:
            raise CliError(f"adapter {adapter.name!r} cannot build a random model; pass --model PATH")
        options: dict[str, Any] = {}
        what = "RANDOMLY INITIALISED model (no --model given): numbers are not physical"
        param = inspect.signature(adapter.random_model).parameters.get("atomic_numbers")
        if param is not None:
            default = tuple(param.default) if param.default is not inspect.Parameter.empty else ()
            numbers = tuple(sorted(set(default) | _numbers(atoms)))
            options["atomic_numbers"] = numbers
            what = f"RANDOMLY INITIALISED model for {_symbols(numbers)} (no --model given): numbers are not physical"
        try:
            with _quiet_prints(verbose):
                return adapter.random_model(dtype, device, **options), what
        except ValueError as exc:  # e.g. a dtype the model package does not run in
            raise CliError(f"{adapter.name}: {_one_line(exc)}") from None
    if not os.path.exists(path):
        raise CliError(f"model file {path!r} does not exist")
    if adapter.load_model is None:
        raise CliError(f"adapter {adapter.name!r} cannot load checkpoints")
    try:
        with _quiet_prints(verbose):
            model = adapter.load_model(path, device)
    except Exception as exc:  # noqa: BLE001 - whatever the file holds, one line
        raise CliError(
            f"cannot load {path!r} as a {adapter.name} model ({type(exc).__name__}: {_one_line(exc)}); "
            "see docs/pages/trained-models.md for the file each adapter takes"
        ) from None
    if not isinstance(model, torch.nn.Module):
        hint = " (a state_dict or a training checkpoint?)" if isinstance(model, dict) else ""
        raise CliError(
            f"cannot load {path!r} as a {adapter.name} model: it holds {_a(type(model).__name__)}{hint}, "
            "not a model; see docs/pages/trained-models.md"
        )
    return model.to(dtype), f"model {path}"


def _check_fits(adapter: Any, model: torch.nn.Module, atoms: Any) -> None:
    """Build the model's input once: a system with elements (or charges,
    tasks ...) the model does not know fails here, on one line."""
    try:
        adapter.input_builder(model)(atoms)
    except (ValueError, KeyError) as exc:
        raise CliError(f"the system does not fit the model: {_one_line(exc)}") from None


def _load_caps(path: str | None, adapter: str) -> dict[str, int] | None:
    """The caps in ``path`` if it exists (None otherwise); any unreadable,
    corrupt or foreign file (another adapter's) is one error line, before
    anything announces the caps."""
    if path is None or not os.path.exists(path):
        return None
    from ddpad import load_caps

    try:
        caps = load_caps(path, adapter=adapter)
    except (ValueError, OSError) as exc:
        message = _one_line(exc)
        raise CliError(message if path in message else f"caps file {path!r}: {message}") from None
    return caps


def _cached_caps_path(adapter: str, model: torch.nn.Module, atoms: Any) -> str:
    """The user cache's caps file of this model on this system: keyed by the
    model's architecture (:func:`ddpad.model_fingerprint`, not its weights),
    the system's formula (species and atom count) and periodicity, so runs
    of other models or systems neither read nor overwrite it."""
    import hashlib

    from ddpad import model_fingerprint

    formula = atoms.get_chemical_formula(mode="hill")
    key = {"model": model_fingerprint(model), "formula": formula, "pbc": [bool(p) for p in atoms.pbc]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()[:12]
    return os.path.join(_cache_dir(), "caps", f"{adapter}-{formula[:40]}-{digest}.json")


def _cached_caps(path: str, adapter: str) -> dict[str, int] | None:
    """The caps an earlier run of this model on this system left in the user
    cache; an unreadable one is ignored, with a warning line (it is the
    cache's, not the user's input)."""
    try:
        return _load_caps(path, adapter)
    except CliError as exc:
        print(f"ddpad: warning: ignoring the cached caps ({exc}); starting from the system's own caps",
              file=sys.stderr)
        return None


def _cache_dir() -> str:
    """ddpad's folder in the user's cache (:func:`ddpad._fs.cache_dir`, as the
    compile store's default)."""
    return str(cache_dir())


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


class _Announcing:
    """Stands in for a padded model's padder: when a call may compile (the
    first call, or caps fitted or grew; ``sizer``, the model's tight sizing,
    says which), says so before the compile starts."""

    def __init__(self, padder: Any, name: str, progress: _Progress, sizer: Any = None) -> None:
        from ._stats import caps_changed  # (torch: imported by the command, not by the CLI's parser)

        self._changed = caps_changed
        self._padder = padder
        self._name = name
        self._progress = progress
        self._sizer = sizer
        self._first = True

    def pad(self, data: Any, cap_state: dict[str, int], *args: Any, **kwargs: Any) -> Any:
        before = dict(cap_state)
        fitting = self._sizer is not None and not self._sizer.settled  # (a change in the window is the fit)
        out = self._padder.pad(data, cap_state, *args, **kwargs)
        if self._first:
            self._first = False
            self._progress.say(f"first call of {self._name} at caps {dict(cap_state)}: compiling or loading "
                               "its graph…")
        elif cap_state != before:
            self._progress.say(f"caps {self._changed(before, cap_state, fitting)}: compiling or loading their "
                               "graph…")
        return out

    def __getattr__(self, name: str) -> Any:  # unpad, restore, allocations ...
        if name == "_padder" or name.startswith("__"):  # a copy / pickle probe before __init__ ran
            raise AttributeError(name)
        return getattr(self._padder, name)


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


# -- the commands ----------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    """Langevin MD (300 K) under ASE with the adapter's fixed-shape model."""
    adapter = _adapter(args.adapter, args.verbose)
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
    device = _device(args.device)
    dtype = _dtype(adapter, args.dtype)
    caps_in = _load_caps(args.caps, adapter.name)  # checked (adapter included) before anything is announced
    atoms = _system(adapter, args.system)
    if isinstance(atoms, (list, tuple)):
        raise CliError("ddpad run takes one system (one ase.Atoms); this file holds several")
    model, what = _model(adapter, args.model, dtype, device, atoms, args.verbose)
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
    calc = Calculator(model, adapter, compile=not args.no_compile, caps=preset, cap_policy=args.cap_policy,
                      **compile_kwargs)
    wrapped = calc.wrapped
    assert wrapped is not None
    stats = wrapped.stats
    progress = _Progress(args.steps, lambda: stats.graphs + stats.aot_compiled + stats.aot_loaded)
    if not args.no_compile:
        wrapped.padder = _Announcing(wrapped.padder, adapter.name, progress, wrapped.sizer)
    atoms.calc = calc
    dyn = _langevin(atoms)

    def tick() -> None:
        if 1 <= dyn.nsteps <= args.steps:  # (ASE calls its observers before the first step too)
            progress.step(dyn.nsteps)

    dyn.attach(tick, interval=1)
    writer = None
    started = time.perf_counter()
    try:
        try:
            atoms.get_potential_energy()  # step 0: the first compile
        except KeyboardInterrupt:
            what_ran = "call" if args.no_compile else "compile"
            raise _Interrupted(f"interrupted during the first {what_ran}; nothing was written") from None
        first = time.perf_counter() - started
        if not args.no_compile:
            print(f"first call {first:.1f} s: {stats.work()}", flush=True)
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
    elapsed = ran - started
    stepping = (f"{progress.all_steps / max(progress.all_seconds, 1e-9):.2f} steps/s on the "
                f"{progress.all_steps} step(s) that compiled nothing" if progress.all_steps else "every step compiled")
    compiling = "" if args.no_compile else f"{progress.compiling:.1f} s compiling or loading (the first call included), "
    print(f"{args.steps} steps in {elapsed:.1f} s: {compiling}{stepping}")
    print(f"compiled graphs: {stats.graphs}; {_growth_summary(stats)}; "
          f"unexplained recompiles: {len(stats.unexplained)}")
    if stats.store_hits or stats.store_misses or stats.rungs_warmed or stats.aot_compiled or stats.aot_loaded \
            or stats.aot_refused or stats.background_started:  # not every backend stores
        print(_store_line(stats))
    if not args.no_compile:
        print(_checks_line(stats, getattr(args, "verify", True)))
    print(_fill_line(stats, args.cap_policy))
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
                       "growth_calls": stats.growth_calls, **stats.as_dict()}, fh, indent=2)
    return 0


def _finish_builds(wrapped: Any) -> None:
    """Let the packages worker processes are building (``--aot``) land in the
    store, so the next run loads them; Ctrl-C leaves them unbuilt."""
    builds = wrapped.package_builds
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


def _save_caps(wrapped: Any, path: str) -> str:
    """Write the wrapped model's caps to ``path`` (its folder made if needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    wrapped.save_caps(path)
    return path


def _growth_summary(stats: Any) -> str:
    """``growth calls: N``: the calls on which caps grew (each one compile,
    however many caps grew on it), then each grown cap's first and last
    size and how many times it grew."""
    if not stats.growths:
        return "growth calls: 0"
    grown: dict[str, list[Any]] = {}
    for event in stats.growths:
        grown.setdefault(event.key, []).append(event)
    caps = ", ".join(f"{key} {events[0].old} -> {events[-1].new}"
                     + (f" ({len(events)} growths)" if len(events) > 1 else "") for key, events in grown.items())
    return f"growth calls: {stats.growth_calls} ({caps})"


def _fill_line(stats: Any, policy: str) -> str:
    """``fill (tight): atoms 0.99 (cap 516), ...``: real rows over the cap,
    the mean over the steps since the caps last changed, and the call that
    fitted them."""
    fill = stats.mean_fill
    line = f"fill ({policy}, mean since the caps last changed): " + ", ".join(
        f"{k} {fill[k]:.3f} (cap {stats.caps[k]})" for k in sorted(fill))
    if stats.fits:
        changed = ", ".join(f"{e.key} {e.old} -> {e.new}" for e in stats.fits)
        line += f"; caps fitted on step {stats.fits[0].call} ({changed})"
    return line


def _store_options(args: argparse.Namespace) -> dict[str, Any]:
    """Compile arguments: backend, compile store, background compiles."""
    options: dict[str, Any] = {"backend": args.backend}
    if getattr(args, "aot", False):
        options["compile_mode"] = "aot"
    if not args.no_compile_cache:
        options["compile_cache"] = args.compile_cache
        if getattr(args, "background_compile", None) is not None:
            options["background_compile"] = args.background_compile
    if getattr(args, "warm_ladder", 0):
        options["warm_ladder"] = args.warm_ladder
    if not getattr(args, "verify", True):
        options["verify"] = False
    return options


def _store_line(stats: Any) -> str:
    """The compile store's counts: graphs looked up in it (found + not found),
    graphs compiled + loaded (from the store + from torch's own cache), then
    background compiles, warm-ladder rungs and packages."""
    uncached = f" ({stats.graphs_uncached} past torch's caches)" if stats.graphs_uncached else ""
    aot = (f"; ahead-of-time packages: {stats.aot_compiled} built in {stats.aot_seconds:.1f} s, {stats.aot_loaded} "
           f"loaded in {stats.aot_load_seconds:.2f} s, {stats.aot_checked} checked against eager, "
           f"{stats.aot_refused} call form(s) on torch.compile"
           if stats.aot_compiled or stats.aot_loaded or stats.aot_refused else "")
    unused = stats.background_started - stats.background_used
    looked_up = stats.store_hits + stats.store_misses
    return (f"compile store: {stats.store_hits} of {looked_up} graph(s) found in it, {stats.store_misses} not "
            f"(compiled or taken from torch's own cache, then written); graphs: {stats.graphs_compiled} "
            f"compiled{uncached} in {stats.compile_seconds:.1f} s, {stats.graphs_loaded} loaded in "
            f"{stats.load_seconds:.1f} s ({stats.store_loads} from the store, "
            f"{stats.graphs_loaded - stats.store_loads} from torch's own cache); background compiles: "
            f"{stats.background_started} started, "
            f"{stats.background_used} used"
            + (f" ({unused} unused: worker CPU time this run did not need)" if unused else "")
            + (f"; warm ladder: {stats.rungs_warmed} rung(s) in {stats.warm_seconds:.1f} s, {stats.rungs_used} "
               "growth(s) took one" if stats.rungs_warmed else "") + aot)


def _checks_line(stats: Any, verify: bool = True) -> str:
    """What the first-use checks found (``verify``), or that none ran."""
    if not verify:
        return "not checked against the eager step (--no-verify): the compiled graphs' numbers are as compiled"
    line = (f"checked against the eager step: {stats.checks} compiled graph(s) on their first call, "
            f"{stats.disagreements} disagreed ({stats.check_seconds:.2f} s)")
    if stats.eager_forms:
        line += f" ({stats.eager_forms} caps / call form(s) run eager: see the warnings above)"
    return line


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
    from ._evaluator import engine_input

    loaded = _load_caps(args.caps, adapter.name)  # checked first
    preset = args.caps if loaded is not None else None
    if args.aot:
        return _precompile_packages(args, adapter, model, what, atoms, loaded, device, dtype)
    # tight: the caps fitted to this system on the first call (a run's window is
    # ten steps), written where ddpad run looks for them, so the run starts there
    policy: Any = TightPolicy(settle=1) if args.cap_policy == "tight" else "headroom"
    wrapped = wrap(model, adapter, caps=preset, compile_cache=args.compile_cache, backend=args.backend,
                   on_recompile="ignore", warm_ladder=args.ladder, cap_policy=policy,
                   compile_mode="aot" if args.aot else "dynamo")
    data = engine_input(adapter, model, atoms)  # as the run's calculator builds it
    print(f"ddpad precompile {adapter.name}: {what}, device {device}, {dtype}, store {args.compile_cache}")
    t0 = time.perf_counter()
    wrapped(data, **adapter.call_options(False))
    seconds, warm = time.perf_counter() - t0, wrapped.stats.warm_seconds
    print(f"caps {wrapped.caps}: {seconds - warm:.1f} s")
    for caps in wrapped.rungs:
        print(f"caps {caps}")
    print(f"{len(wrapped.rungs)} rung(s) in {warm:.1f} s")
    print(_store_line(wrapped.stats))
    if args.caps is None:
        print(f"caps written to {_save_caps(wrapped, _cached_caps_path(adapter.name, model, atoms))} "
              "(ddpad run of this model on this system starts from them)")
    return 0


def _precompile_packages(args: argparse.Namespace, adapter: Any, model: Any, what: str, atoms: Any,
                         caps: dict[str, int] | None, device: str, dtype: Any) -> int:
    """``ddpad precompile --aot``: the caps' and rungs' packages, each built in
    its own worker process (``--workers`` at once)."""
    from ._evaluator import engine_input
    from ._prebuild import prebuild_packages

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


def _bench_compile_store(args: argparse.Namespace) -> int:
    """Cold / store-only / warm first calls and (unless ``--first-call``) the
    growing trajectory, each in fresh processes with empty caches; a JSON
    report and a plot of the growing trajectory."""
    from ._warmstart import (
        format_growing,
        format_warm_start,
        growing,
        plot_growing,
        warm_start,
    )

    adapter = _adapter(args.adapter, args.verbose)
    device = _device(args.device)
    # the children build the model ddpad run would: the dtype resolved here (an adapter takes a dtype, not None)
    dtype = str(_dtype(adapter, args.dtype)).removeprefix("torch.")
    mode = "--first-call" if args.first_call else "--compile-store"
    print(f"ddpad bench {adapter.name} {mode}: {dtype}, fresh processes, empty stores and Inductor caches "
          f"(several compiles: minutes on a CPU)", flush=True)
    warm = warm_start(adapter.name, backend=args.backend, device=device, dtype=dtype)
    print(format_warm_start(adapter.name, warm), flush=True)
    if args.first_call:
        _write_json(args.out, {"adapter": adapter.name, "device": device, "dtype": dtype, "warm_start": warm})
        return 0
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
    dtype = _dtype(adapter, args.dtype)
    base = _system(adapter, args.system)
    if isinstance(base, (list, tuple)):
        raise CliError("ddpad bench takes one system (one ase.Atoms); this file holds several")
    if args.repeat != 1:
        if not base.pbc.all():
            raise CliError("--repeat needs a periodic system")
        base = base * (args.repeat, args.repeat, args.repeat)
    model, what = _model(adapter, args.model, dtype, device, base, args.verbose)
    _check_fits(adapter, model, base)
    return device, base, model, what


def _bench_steady(args: argparse.Namespace) -> int:
    """What the dead rows cost a steady step: eager, the unpadded compile at
    the exact shape, ddpad at head-room and at tight caps, alternated."""
    from ._bench import fluctuating_trajectory
    from ._steady import format_steady, steady_table

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
    _write_json(args.out, {**result, "model": what})
    return 0


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _bench_overhead(args: argparse.Namespace) -> int:
    """ddpad's own per-call host cost against the bare model, per built-in padder and size."""
    from ._overhead import QUICK_CALLS, QUICK_SIZES, format_table, overhead_table

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
    from ._overhead import PADDERS

    padders = args.padders or None
    unknown = sorted(set(padders or ()) - set(PADDERS))
    if unknown:
        raise CliError(f"--padders: unknown {unknown}; the padders are {sorted(PADDERS)}")
    rows = overhead_table(sizes, calls, paths=args.paths, padders=padders)
    print(format_table(rows))
    _write_json(args.out, {"sizes": list(sizes), "calls": calls, "threads": _threads(), "rows": rows})
    return 0


def _write_json(path: str, report: dict[str, Any]) -> None:
    """Write a bench's JSON report and say where."""
    _output_path(path, "--out")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {path}")


def cmd_bench(args: argparse.Namespace) -> int:
    """Eager, unpadded compiles and ddpad on one fluctuating trajectory."""
    if args.overhead:  # a core install (torch only) runs it: no _bench, no numpy
        return _bench_overhead(args)
    from ._bench import VARIANTS, fluctuating_trajectory, plot, run_bench
    from ._stats import lowest_fill

    if args.adapter is None:
        raise CliError("ddpad bench needs an adapter name (see 'ddpad list'), or --overhead")
    if args.compile_store or args.first_call:
        return _bench_compile_store(args)
    if args.steady:
        return _bench_steady(args)
    adapter = _adapter(args.adapter, args.verbose)
    if args.steps < 2:
        raise CliError(f"--steps must be >= 2, got {args.steps}")
    if not 0.0 <= args.rate <= 1.0:
        raise CliError(f"--rate must be in [0, 1], got {args.rate}")
    if args.rattle < 0:
        raise CliError(f"--rattle must be >= 0, got {args.rattle}")
    if args.repeat < 1:
        raise CliError(f"--repeat must be >= 1, got {args.repeat}")
    variants = tuple(args.variants.split(",")) if args.variants else VARIANTS
    bad = sorted(set(variants) - set(VARIANTS))
    if bad:
        raise CliError(f"unknown variants {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError("ddpad bench plots with matplotlib: pip install matplotlib") from None
    for path, option in ((args.out, "--out"), (args.plot, "--plot")):
        _output_path(path, option)
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
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    plot(result, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


# -- the parser -------------------------------------------------------------------


def _verbose_option(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="show third-party warnings and notices and ddpad's INFO log (default: hidden)")


def _common_options(parser: argparse.ArgumentParser) -> None:
    """The options ``run`` and ``bench`` share."""
    parser.add_argument("adapter", help="adapter name (see 'ddpad list')")
    parser.add_argument("--model", metavar="PATH",
                        help="trained model file (docs: 'Use your trained model'); default: a randomly "
                             "initialised model (mace: built for the system's elements plus H, C, O)")
    parser.add_argument("--system", metavar="FILE|NAME",
                        help="structure file (any ASE format) or a name ase.build knows (H2O, Cu); "
                             "default: the adapter's built-in system")
    parser.add_argument("--device", help="cpu, cuda or cuda:N; default: cuda when torch sees a GPU, else cpu")
    parser.add_argument("--dtype", choices=["float32", "float64"],
                        help="model precision; default: float64 for mace, torch's default dtype otherwise")
    parser.add_argument("--backend", default="inductor",
                        help="torch.compile backend (aot_eager skips inductor's code generation: a faster "
                             "compile, for trying things out); default: inductor")



def _store_arguments(parser: argparse.ArgumentParser) -> None:
    """The compile-store options ``run`` and ``precompile`` share."""
    parser.add_argument("--compile-cache", metavar="DIR", default=os.path.join(_cache_dir(), "compile"),
                        help="compile store: what compiling produced, loaded by later runs instead of "
                             f"compiling (default: {os.path.join(_cache_dir(), 'compile')})")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="neither read nor write the compile store (default: use it)")
    parser.add_argument("--aot", action="store_true",
                        help="ahead-of-time packages: each caps' whole step traced, exported and compiled by "
                             "AOTInductor into the compile store, loaded by later runs without tracing; a step "
                             "the route cannot take runs torch.compile, said in one line (default: torch.compile)")
    parser.add_argument("--cap-policy", choices=["tight", "headroom"], default="tight",
                        help="tight: after a few steps fit every cap to the needs seen (fill about 0.97) and "
                             "grow in small steps; headroom: the padders' own caps (edges 35 %% above the need, "
                             "growths of 30 %%), fewer compiles for a system that keeps growing (default: tight)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddpad", description=DESCRIPTION)
    _verbose_option(parser, False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{list,run,precompile,bench}")

    p_list = sub.add_parser("list", help="adapters, whether their model package is installed, install hints",
                            description="Every adapter, whether its model package is installed, and how to install it.")
    p_list.add_argument("--json", action="store_true", help="machine-readable output (default: a table)")
    _verbose_option(p_list, argparse.SUPPRESS)
    p_list.set_defaults(func=cmd_list)

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
    p_bench.add_argument("--out", default="ddpad-bench.json", metavar="FILE",
                         help="JSON report (default: ddpad-bench.json)")
    p_bench.add_argument("--plot", default="ddpad-bench.png", metavar="FILE",
                         help="plot of cumulative wall time against step (default: ddpad-bench.png)")
    _verbose_option(p_bench, argparse.SUPPRESS)
    p_bench.set_defaults(func=cmd_bench)
    return parser


class _OwnLogFormat(logging.Formatter):
    """ddpad's log records on one line: ``ddpad: warning: ...`` from WARNING
    up, ``ddpad: ...`` below (the ``ddpad: `` a message starts with not doubled)."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        text = text[len("ddpad: "):] if text.startswith("ddpad: ") else text
        return f"ddpad: warning: {text}" if record.levelno >= logging.WARNING else f"ddpad: {text}"


@contextlib.contextmanager
def _cli_scope(verbose: bool) -> Iterator[None]:
    """The command's warning filters, warning format and log handler, all
    restored when it ends (``main`` called from Python leaves no trace)."""
    format_before = warnings.formatwarning
    root, own = logging.getLogger(), logging.getLogger("ddpad")
    before = (root.level, own.level, own.propagate)
    handlers: list[tuple[logging.Logger, logging.Handler]] = []
    own_handler = logging.StreamHandler()  # ddpad's log records as its warnings read: "ddpad: warning: ..."
    own_handler.setFormatter(_OwnLogFormat())
    handlers.append((own, own_handler))
    own.propagate = False
    own.setLevel(logging.INFO if verbose else logging.WARNING)
    with warnings.catch_warnings():
        warnings.formatwarning = _format_warning
        if verbose:
            other = logging.StreamHandler()
            other.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            handlers.append((root, other))
            root.setLevel(logging.INFO)
        else:  # the known third-party warnings, not ddpad's own (shown with -v)
            ignore_noise()
        for logger, handler in handlers:
            logger.addHandler(handler)
        try:
            yield
        finally:
            warnings.formatwarning = format_before
            for logger, handler in handlers:
                logger.removeHandler(handler)
            root.setLevel(before[0])
            own.setLevel(before[1])
            own.propagate = before[2]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ddpad`` command; returns its exit status (0, 2 for a user
    error, 130 when interrupted)."""
    args = build_parser().parse_args(argv)
    with _cli_scope(args.verbose):
        try:
            return int(args.func(args))
        except CliError as exc:
            print(f"ddpad: error: {exc}", file=sys.stderr)
            return 2
        except _Interrupted as exc:
            print(f"ddpad: {exc}", file=sys.stderr)
            return 130
        except KeyboardInterrupt:
            print("ddpad: interrupted", file=sys.stderr)
            return 130
