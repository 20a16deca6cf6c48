"""The benchmarks page (``benchmarks/page.py``): measured by ``ddpad bench``, rendered, never edited by hand."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from types import ModuleType

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture()
def page(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``benchmarks/page.py`` writing its reports, page and plots under ``tmp_path``."""
    spec = importlib.util.spec_from_file_location("ddpad_bench_page", ROOT / "benchmarks" / "page.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    for name, path in (("RESULTS", "results"), ("PAGE", "benchmarks.md"), ("IMAGES", "img")):
        monkeypatch.setattr(module, name, tmp_path / path)
    return module


def test_the_committed_page_is_what_its_reports_render(page: ModuleType) -> None:
    """A table edited by hand (or reports changed without rendering) fails here:
    ``python benchmarks/page.py --render`` makes the page again."""
    page.RESULTS = ROOT / "benchmarks" / "results"
    committed = (ROOT / "docs" / "pages" / "benchmarks.md").read_text(encoding="utf-8")
    assert page.render() == committed, "docs/pages/benchmarks.md differs: run python benchmarks/page.py --render"
    for name in sorted(p.stem for p in page.RESULTS.glob("*.json")):
        assert name in {m.name for m in page.MEASUREMENTS}, f"benchmarks/results/{name}.json: no such measurement"


def test_the_readme_s_answer_against_packages_quotes_the_reports() -> None:
    """The README's "faster than what your package already does?" figures
    are the committed reports' (issue 53): re-measured, they change here."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    results = ROOT / "benchmarks" / "results"
    ase = json.loads((results / "ase-one.json").read_text())["report"]["variants"]
    trajectory = json.loads((results / "trajectory-mace.json").read_text())["report"]["ddpad_speedup"]
    said = (f"ddpad's step is {ase['ddpad']['ratio_median']:.2f}x mace's eager calculator's, where mace's own "
            f"compiled route (`compile_mode=\"default\"`) is {ase['MACECalculator (compiled)']['ratio_median']:.2f}x")
    assert said in readme
    assert f"takes {trajectory['compile-dynamic']['total']:.2f}x ddpad's time, compiles included" in readme


def test_a_whole_run_table_says_each_route_against_ddpad(page: ModuleType) -> None:
    """``benchmarks/run_total.py``'s report (issue 53's compile-included
    totals) renders one row per route, cold and warm, and ddpad's graphs."""
    def run(seconds: float, x: float, **extra: object) -> dict[str, object]:
        return {"run_s": seconds, "first_call_s": 1.0, "process_s": seconds + 10, "x_ddpad": x, **extra}

    runs = {"ddpad cold": run(100.0, 1.0, graphs=2, growth_calls=1), "ddpad warm": run(40.0, 1.0, graphs=2,
                                                                                       growth_calls=0),
            "compiled cold": run(150.0, 1.5), "compiled warm": run(60.0, 1.5),
            "eager cold": run(80.0, 0.8), "eager warm": run(80.0, 2.0)}
    doc = {"command": "OMP_NUM_THREADS=1 python benchmarks/run_total.py --adapter mace --steps 1000",
           "date": "2026-12-07 23:00 UTC", "minutes": 10.0, "load": [0.1, 0.2],
           "machine": {"cpu": "cpu", "cores": 2}, "torch": "2.13.0", "ddpad": "abc",
           "report": {"adapter": "mace", "steps": 1000, "threads": 1, "runs": runs}}
    text = page.total_section(doc)
    assert "1,000 Langevin steps of mace" in text
    assert "| the package's compiled route | 150.0 | 1.0 | **1.50** | 60.0 | 1.0 | **1.50** | - |" in text
    assert "| ddpad (`ddpad.ase.Calculator`, its defaults) | 100.0 | 1.0 | **1.00** | 40.0 | 1.0 | **1.00** | 2 (1 growth calls), warm 2 |" in text


@pytest.mark.slow
def test_measure_then_render(page: ModuleType, tmp_path: pathlib.Path) -> None:
    """Two real (short) ``ddpad bench`` runs, reported with what made them and rendered with plots."""
    runs = [page.Measurement("overhead", None, ("--overhead", "--sizes", "20", "--calls", "2")),
            page.Measurement("trajectory-mace", "toy", ("toy", "--steps", "12", "--backend", "eager",
                                                        "--variants", "eager,ddpad,ddpad-tight"), env=page.COLD)]
    page.RESULTS.mkdir()
    for m in runs:
        assert page._installed(sys.executable, m.adapter) is None
        doc = page.run(m, sys.executable, quick=False)
        assert doc is not None
        # the command as run, its environment included
        assert doc["command"].startswith("OMP_NUM_THREADS=1 TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 ddpad bench toy"
                                         if m.adapter else "OMP_NUM_THREADS=1 ddpad bench --overhead")
        assert doc["machine"]["cores"] and len(doc["load"]) == 2 and doc["torch"].startswith("2.")
        (page.RESULTS / f"{m.name}.json").write_text(json.dumps(doc), encoding="utf-8")
    text = page.render()
    assert "ddpad bench --overhead --sizes 20 --calls 2" in text and "ddpad bench toy --steps 12" in text
    assert "| coo | 20 |" in text and "| ddpad-tight |" in text
    # the measurements not run are listed with the command that adds them
    assert "## Not measured yet" in text and "`first-call-mace`" in text and "`overhead`" not in text.split(
        "## Not measured yet")[1]
    for plot in ("bench-steps.png", "bench-fill.png"):
        assert (page.IMAGES / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (page.IMAGES / "bench-first-call.png").exists()  # no first-call report: no plot


def test_an_adapter_not_installed_is_skipped_with_the_reason(page: ModuleType) -> None:
    why = page._installed(sys.executable, "no-such-adapter")
    assert why is not None and "no-such-adapter" in why and "unknown adapter" in why


def test_bad_options_are_one_line(page: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--only", "nothing-*"], ["--python", "mace"], ["--python", "nope=/usr/bin/python3"]):
        with pytest.raises(SystemExit) as err:
            page.main(argv)
        assert err.value.code == 2
    err_text = capsys.readouterr().err
    assert "matches none of" in err_text and "expected ADAPTER=PATH" in err_text
