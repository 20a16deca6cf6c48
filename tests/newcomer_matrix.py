"""A newcomer's matrix (issue 28): for each extra, a fresh virtual
environment, the README's install line, ``ddpad list`` and ``ddpad run NAME
--steps 2 --backend aot_eager``; prints one table row per extra.

Run from a clone: ``python3.11 tests/newcomer_matrix.py [EXTRA ...]`` (all
eleven by default; about 1-2 GB of disk and a few minutes per extra, one at
a time: each environment lies under ``$TMPDIR`` and is removed after its row).
An extra that is an engine, not an adapter (torchsim, nvalchemi, lammps),
runs the adapter it is used with (:data:`PAIRED`) and imports what its
README usage imports (:data:`ENGINES`). ``tests/test_install.py`` makes the
same checks inside each nox session, from these tables.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXTRAS = ("mace", "uma", "aimnet2", "torchsim", "nvalchemi", "lammps", "sevennet", "nequip", "allegro", "orb",
            "mattersim")
ADAPTER_EXTRAS = ("mace", "uma", "aimnet2", "sevennet", "nequip", "allegro", "orb", "mattersim")
# the adapter an engine extra is used with (its README example's model)
PAIRED = {"nvalchemi": "mace", "lammps": "mace", "torchsim": "mace"}
# the README's install line of an engine that does not bring its adapter (nvalchemi's extra has mace-torch)
README_EXTRAS = {"torchsim": "torchsim,mace", "lammps": "lammps,mace"}
# what the engine's README usage imports, and a first call where one is cheap
ENGINES = {
    "torchsim": "import torch_sim, ddpad.torchsim",
    "nvalchemi": "import nvalchemi.models.mace, nvalchemi.distributed, nvalchemi.neighbors, ddpad.engines.nvalchemi",
    "lammps": (
        "from mpi4py import MPI\nfrom lammps import lammps\nimport ddpad.engines.lammps\n"
        "lammps(cmdargs=['-log', 'none', '-screen', 'none']).close()"
    ),
}


def install_line(extras: str) -> list[str]:
    """The README's install line for ``extras`` (run in the clone)."""
    return ["-m", "pip", "install", "torch==2.13.0", "-e", f".[{extras}]"]


def adapter_for(extra: str) -> str:
    """The adapter an extra gives: its own, or the one it pairs with."""
    return extra if extra in ADAPTER_EXTRAS else PAIRED[extra]


def env_for(venv: pathlib.Path, cache: pathlib.Path) -> dict[str, str]:
    """The environment a user of ``venv`` has (activated), with a scratch
    cache and the wheel's MPICH found as the README says."""
    lib = str(venv / "lib")
    return {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "XDG_CACHE_HOME": str(cache), "OMP_NUM_THREADS": "1",
            "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [lib, os.environ.get("LD_LIBRARY_PATH")]))}


def _last(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("WARNING: Location")]
    return lines[-1][:160] if lines else ""


def row(extra: str, python: str = "python3.11") -> dict[str, object]:
    """One extra's row: install, list, run (and the engine's imports)."""
    work = pathlib.Path(tempfile.mkdtemp(prefix=f"ddpad-newcomer-{extra}-"))
    venv, cache = work / "venv", work / "cache"
    adapter = adapter_for(extra)
    out: dict[str, object] = {"extra": extra, "adapter": adapter}
    start = time.monotonic()
    try:
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        py = str(venv / "bin" / "python")
        env = env_for(venv, cache)
        inst = subprocess.run([py, *install_line(README_EXTRAS.get(extra, extra))], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=3600)
        out["install"] = "ok" if inst.returncode == 0 else f"rc {inst.returncode}: {_last(inst.stderr)}"
        out["install_s"] = round(time.monotonic() - start)
        if inst.returncode != 0:
            return out
        listed = subprocess.run(["ddpad", "list", "--json"], cwd=work, env=env, capture_output=True, text=True)
        try:
            rows = {r["name"]: r for r in json.loads(listed.stdout[listed.stdout.index("["):])}
            out["list"] = rows[adapter]["status"] + (f": {rows[adapter]['error']}" if rows[adapter]["error"] else "")
        except (ValueError, KeyError):
            out["list"] = f"rc {listed.returncode}: {_last(listed.stderr)}"
        t0 = time.monotonic()
        run = subprocess.run(["ddpad", "run", adapter, "--steps", "2", "--backend", "aot_eager"], cwd=work,
                             env=env, capture_output=True, text=True, timeout=1800)
        out["run"] = "ok" if run.returncode == 0 else f"rc {run.returncode}: {_last(run.stderr)}"
        out["run_s"] = round(time.monotonic() - t0)
        if extra in ENGINES:
            eng = subprocess.run([py, "-c", ENGINES[extra]], cwd=work, env=env, capture_output=True, text=True)
            out["engine"] = "ok" if eng.returncode == 0 else f"rc {eng.returncode}: {_last(eng.stderr)}"
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still removes its environment
    extras = argv or list(EXTRAS)
    unknown = sorted(set(extras) - set(EXTRAS))
    if unknown:
        print(f"unknown extras {unknown}; known: {', '.join(EXTRAS)}", file=sys.stderr)
        return 2
    rows = []
    print("| extra | adapter run | install | ddpad list | ddpad run | engine imports |", flush=True)
    print("| --- | --- | --- | --- | --- | --- |", flush=True)
    for extra in extras:
        try:
            r = row(extra)
        except subprocess.TimeoutExpired as exc:
            r = {"extra": extra, "adapter": adapter_for(extra), "install": f"timed out: {' '.join(exc.cmd)[:80]}"}
        rows.append(r)
        print(f"| {r['extra']} | {r['adapter']} | {r.get('install')} ({r.get('install_s', '-')} s) | "
              f"{r.get('list', '-')} | {r.get('run', '-')} ({r.get('run_s', '-')} s) | {r.get('engine', '-')} |",
              flush=True)
    worked = all(r.get("install") == "ok" and str(r.get("list", "")).startswith("installed") and r.get("run") == "ok"
                 and r.get("engine", "ok") == "ok" for r in rows)
    return 0 if worked else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
