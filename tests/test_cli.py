"""The ddpad command: list, run (short, eager backend), bad input."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("ase")
pytest.importorskip("ddpad_toy_plugin", reason="tests/plugin_pkg not installed (nox session core installs it)")


def ddpad(*args: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "ddpad", *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_list_shows_missing_packages_with_hints() -> None:
    res = ddpad("list", "--json")
    assert res.returncode == 0, res.stderr
    rows = {row["name"]: row for row in json.loads(res.stdout)}
    assert rows["toy"]["status"] == "installed" and rows["toy"]["kind"] == "plugin"
    assert rows["broken"]["status"] == "unavailable" and "broken on purpose" in rows["broken"]["error"]
    for name in ("mace", "uma", "aimnet2"):
        assert rows[name]["kind"] == "built-in" and rows[name]["install"] == f"pip install 'ddpad[{name}]'"
    text = ddpad("list").stdout
    assert text.splitlines()[0].split() == ["adapter", "kind", "status", "version", "install"]


def test_run_writes_caps_trajectory_and_numbers(tmp_path: pathlib.Path) -> None:
    res = ddpad("run", "toy", "--steps", "8", "--backend", "eager", "--traj", "md.xyz", "--traj-every", "2",
                "--json", "run.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "RANDOMLY INITIALISED" in res.stdout and "compiled graphs:" in res.stdout
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["steps"] == 8 and doc["calls"] >= 9 and doc["graphs"] >= 1 and doc["unexplained"] == []
    caps = json.loads((tmp_path / "ddpad-toy-caps.json").read_text())
    assert caps["adapter"] == "toy" and set(caps["caps"]) == {"atoms", "edges", "systems"}
    import ase.io

    frames = ase.io.read(tmp_path / "md.xyz", index=":")
    assert len(frames) == 5 and len(frames[0]) == 27
    # warm restart from the caps file: nothing grows
    again = ddpad("run", "toy", "--steps", "4", "--backend", "eager", "--caps", "ddpad-toy-caps.json",
                  "--json", "warm.json", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "warm.json").read_text())["growths"] == []


def test_bench_json_schema_and_plot(tmp_path: pathlib.Path) -> None:
    res = ddpad("bench", "toy", "--steps", "12", "--rate", "0.5", "--backend", "eager", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "ddpad-bench.json").read_text())
    assert (tmp_path / "ddpad-bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the toy package has no padding of its own: no native-padding variant
    assert set(doc["variants"]) == {"eager", "compile-static", "compile-dynamic", "compile-default", "ddpad"}
    assert doc["steps"] == 12 and len(set(doc["atoms"])) > 1  # the atom count fluctuated
    for variant in doc["variants"].values():
        assert set(variant) >= {"total_s", "compile_s", "steady_median_s", "graphs", "recompiles", "peak_memory_mb"}
        assert len(variant["cumulative_s"]) == 12 and variant["total_s"] > 0
    assert doc["variants"]["eager"]["graphs"] == 0
    assert doc["variants"]["compile-static"]["recompiles"] > doc["variants"]["ddpad"]["recompiles"]
    assert set(doc["ddpad_speedup"]) == {"eager", "compile-static", "compile-dynamic", "compile-default"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "nope"], "unknown ddpad adapter 'nope'"),
        (["run", "toy", "--system", "missing.xyz"], "does not exist"),
        (["run", "toy", "--system", "Qq"], "unknown system 'Qq'"),
        (["run", "toy", "--model", "nowhere.pt"], "model file 'nowhere.pt' does not exist"),
        (["run", "toy", "--steps", "0"], "--steps must be >= 1"),
        (["run", "broken"], "failed to import"),
        (["bench", "toy", "--variants", "eager,fast"], "unknown variants fast"),
        (["bench", "toy", "--steps", "1"], "--steps must be >= 2"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], message: str, tmp_path: pathlib.Path) -> None:
    res = ddpad(*args, cwd=tmp_path)
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddpad: error:") and message in lines[0], res.stderr
