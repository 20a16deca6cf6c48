"""The built wheel ships every adapter subpackage, py.typed and the LAMMPS plugin's sources."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_contains_every_adapter(tmp_path: pathlib.Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = tmp_path.glob("ddpad-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {str(pathlib.PurePosixPath(n).parent) for n in names if n.endswith("__init__.py")}
    on_disk = {p.parent.name for p in (ROOT / "adapters").glob("*/__init__.py")}
    assert on_disk, "no adapter subpackages found"
    for name in on_disk:
        assert f"ddpad/adapters/{name}" in packages, f"adapters/{name} missing from the wheel"
    assert "ddpad/py.typed" in names
    # ddpad lammps build-plugin compiles these where the package is installed
    for source in ("pair_ddpad.cpp", "loader.cpp"):
        assert f"ddpad/engines/lammps_plugin/{source}" in names, f"{source} missing from the wheel"
    assert not any(n.startswith(("ddpad_core/", "adapters/")) for n in names)


def test_import_name_is_ddpad_only() -> None:
    import ddpad

    assert pathlib.Path(ddpad.__file__).parent.name == "ddpad_core"  # the folder, reached as `ddpad`
    assert "ddpad_core" not in sys.modules and "adapters" not in sys.modules


def test_engines_import_with_torch_only_and_name_their_install() -> None:
    """The engine modules import without their engines; using one that is
    missing says what to install."""
    import importlib.util

    from ddpad.engines import lammps, nvalchemi

    if importlib.util.find_spec("nvalchemi") is None:
        with pytest.raises(ImportError, match=r"pip install torch==2\.13\.0 -e '\.\[nvalchemi\]'"):
            nvalchemi.BatchPadder(3.0).pad(object(), {})
    if importlib.util.find_spec("mpi4py") is None:
        with pytest.raises(ImportError, match=r"pip install torch==2\.13\.0 -e '\.\[lammps\]'"):
            lammps.Potential(object(), torch.nn.Linear(1, 1), "mace", ["C"])


def test_every_test_module_runs_in_a_session() -> None:
    """The test run is the noxfile's sessions, each naming its modules: a
    module none names never runs (test_verify.py, the first-use checks,
    was left out of the core session so)."""
    tests = pathlib.Path(__file__).resolve().parent
    noxfile = (tests / "noxfile.py").read_text(encoding="utf-8")
    unnamed = [p.name for p in sorted(tests.glob("test_*.py")) if f"tests/{p.name}" not in noxfile]
    assert not unnamed, f"in no nox session (tests/noxfile.py): {unnamed}"


def test_metadata_floors_are_what_the_code_needs() -> None:
    """``requires-python`` admits no Python the code cannot run on (it calls
    ``BaseException.add_note``, new in 3.11), and the torch floor is the
    torch the tests pin (the compile store, export and AOTInductor APIs
    change between releases). Before: ``>=3.10`` and ``torch>=2.4``."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    python = re.fullmatch(r">=\s*3\.(\d+)", project["requires-python"])
    assert python is not None and int(python.group(1)) >= 11, project["requires-python"]
    pinned = re.search(r"^torch==(\d+\.\d+)", (ROOT / "tests" / "constraints.txt").read_text(), re.M)
    floors = [d for d in project["dependencies"] if d.startswith("torch")]
    assert pinned is not None and floors == [f"torch>={pinned.group(1)}"], (floors, pinned)
