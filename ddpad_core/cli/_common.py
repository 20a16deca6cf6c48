"""What the commands share: the user-error type, the checks of the input
(adapter, device, dtype, system, model, caps files) and the options
``run``, ``precompile`` and ``bench`` have in common."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ddpad._fs import cache_dir

if TYPE_CHECKING:
    import torch

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
    """``--dtype``, else the adapter's default, else torch's (a ``--model``
    file keeps its own: see :func:`_model`)."""
    import torch

    if name is not None:
        return {"float32": torch.float32, "float64": torch.float64}[name]
    return adapter.tools.default_dtype or torch.get_default_dtype()


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
        if adapter.tools.default_system is None:
            raise CliError(f"adapter {adapter.name!r} has no built-in system; pass --system FILE")
        return adapter.tools.default_system()
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
    adapter: Any, path: str | None, dtype: str | None, device: str, atoms: Any, verbose: bool = False
) -> tuple[torch.nn.Module, str]:
    """The model to run and a description of it, in ``dtype`` (``--dtype``;
    None: a ``path`` model's own, the adapter's default for a random one).
    Without ``path``, the adapter's random model; where it takes elements
    (``Adapter.tools.random_model_elements``: mace, sevennet), built for the
    system's elements as well as its own."""
    import torch

    if path is None:
        if adapter.tools.random_model is None:
            raise CliError(f"adapter {adapter.name!r} cannot build a random model; pass --model PATH")
        from .._bench.warmstart import random_model

        what = "RANDOMLY INITIALISED model (no --model given): numbers are not physical"
        if adapter.tools.random_model_elements is not None:
            numbers = tuple(sorted(set(adapter.tools.random_model_elements) | _numbers(atoms)))
            what = f"RANDOMLY INITIALISED model for {_symbols(numbers)} (no --model given): numbers are not physical"
        try:
            with _quiet_prints(verbose):
                return random_model(adapter, _dtype(adapter, dtype), device, _numbers(atoms)), what
        except ValueError as exc:  # e.g. a dtype the model package does not run in
            raise CliError(f"{adapter.name}: {_one_line(exc)}") from None
    if adapter.tools.load_model is None:
        raise CliError(f"adapter {adapter.name!r} cannot load checkpoints")
    try:
        with _quiet_prints(verbose):
            model = adapter.tools.load_model(path, device)
    except FileNotFoundError as exc:
        if os.path.exists(path):
            raise CliError(f"cannot load {path!r} as a {adapter.name} model ({_one_line(exc)})") from None
        # a name the adapter resolves without a download (sevenn's 7net-0) loads; one it cannot says why
        why = f": {_one_line(exc)}" if exc.errno is None else ""
        raise CliError(f"model file {path!r} does not exist{why}") from None
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
    # a loaded model keeps its precision unless told (before: cast to the adapter's or torch's default)
    return (model if dtype is None else model.to(_dtype(adapter, dtype))), f"model {path}"


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
    """The user cache's caps file of this model on this system
    (:func:`ddpad.ase.cached_caps_path`: the ASE calculator's too)."""
    from ..ase import cached_caps_path

    return cached_caps_path(adapter, model, atoms)


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



def _save_caps(wrapped: Any, path: str) -> str:
    """Write the wrapped model's caps to ``path`` (its folder made if needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    wrapped.save_caps(path)
    return path



def _store_options(args: argparse.Namespace) -> dict[str, Any]:
    """Compile arguments: backend, compile store, background compiles."""
    options: dict[str, Any] = {"backend": args.backend}
    if getattr(args, "aot", False):
        options["compile_mode"] = "aot"
    # (None, not left out: the engines bind ddpad's store by default)
    options["compile_cache"] = None if args.no_compile_cache else args.compile_cache
    if not args.no_compile_cache:
        if getattr(args, "background_compile", None) is not None:
            options["background_compile"] = args.background_compile
    if getattr(args, "warm_ladder", 0):
        options["warm_ladder"] = args.warm_ladder
    if not getattr(args, "verify", True):
        options["verify"] = False
    return options



def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"



def _write_json(path: str, report: dict[str, Any]) -> None:
    """Write a bench's JSON report and say where."""
    _output_path(path, "--out")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {path}")



# -- the parser -------------------------------------------------------------------


def _verbose_option(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="show third-party warnings and notices and ddpad's INFO log (default: hidden)")


def _common_options(parser: argparse.ArgumentParser) -> None:
    """The options ``run`` and ``bench`` share."""
    parser.add_argument("adapter", help="adapter name (see 'ddpad list')")
    parser.add_argument("--model", metavar="PATH|NAME",
                        help="trained model file (docs: 'Use your trained model'), or a name the model package "
                             "resolves without a download (sevennet: 7net-0, 7net-l3i5, 7net-mf-0); default: a randomly "
                             "initialised model (mace: built for the system's elements plus H, C, O)")
    parser.add_argument("--system", metavar="FILE|NAME",
                        help="structure file (any ASE format) or a name ase.build knows (H2O, Cu); "
                             "default: the adapter's built-in system")
    parser.add_argument("--device", help="cpu, cuda or cuda:N; default: cuda when torch sees a GPU, else cpu")
    parser.add_argument("--dtype", choices=["float32", "float64"],
                        help="model precision; default: a --model file's own, else the adapter's (float64 for mace), "
                             "else torch's default dtype")
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
