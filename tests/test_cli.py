"""The ddpad command: list, run (short, eager backend), bad input."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import warnings
from collections.abc import Callable

import pytest

pytest.importorskip("ase")
pytest.importorskip("ddpad_toy_plugin", reason="tests/plugin_pkg not installed (nox session core installs it)")

from _cli import ddpad
from ddpad import cli
from ddpad.cli._report import checks_line, fill_line, growth_line


def errors(res: subprocess.CompletedProcess[str]) -> list[str]:
    """What stderr says, less ddpad's own one-line warnings (the toy plugin
    declares a name clash with mace on purpose)."""
    return [line for line in res.stderr.splitlines() if line.strip() and not line.startswith("ddpad: warning:")]


def test_list_shows_missing_packages_with_hints() -> None:
    res = ddpad("list", "--json")
    assert res.returncode == 0, res.stderr
    rows = {row["name"]: row for row in json.loads(res.stdout)}
    assert rows["toy"]["status"] == "installed" and rows["toy"]["kind"] == "plugin"
    assert rows["broken"]["status"] == "broken" and "broken on purpose" in rows["broken"]["error"]
    for name in ("mace", "uma", "aimnet2"):
        assert rows[name]["kind"] == "built-in"
        assert rows[name]["install"] == f"pip install torch==2.13.0 -e '.[{name}]'"
    text = ddpad("list").stdout
    assert text.splitlines()[0].split() == ["adapter", "kind", "status", "version", "install"]


def test_run_writes_caps_trajectory_and_numbers(tmp_path: pathlib.Path) -> None:
    res = ddpad("run", "toy", "--steps", "12", "--backend", "eager", "--traj", "md.xyz", "--traj-every", "2",
                "--json", "run.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "RANDOMLY INITIALISED" in res.stdout and "compiled graphs:" in res.stdout
    # no third-party noise, ASE's fixcm FutureWarning included (the toy plugin's
    # declared name clash with mace is ddpad's own warning and stays)
    assert "FutureWarning" not in res.stderr and "UserWarning" not in res.stderr, res.stderr
    assert "ddpad: warning: plugin adapter 'mace'" in res.stderr and "return adapters" not in res.stderr
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["steps"] == 12 and doc["calls"] >= 13 and doc["graphs"] >= 1 and doc["unexplained"] == []
    # tight caps (ddpad run's default): fitted on the window's last step, the fill said per key
    fill = next(line for line in res.stdout.splitlines() if line.startswith("fill (tight"))
    assert "caps fitted on step 9" in fill and doc["fits"] and min(doc["mean_fill"].values()) > 0.5
    # the compile is announced before it starts, with the caps, and said when done: what it compiled, in how long
    # the first calls run the eager step while the caps settle (said), and the fit compiles once: it is
    # announced before it starts, with each cap old -> new (a fit, never a growth)
    lines = res.stdout.splitlines()
    assert re.fullmatch(r"first call [\d.]+ s: the eager step: tight caps settle before the one compile",
                        next(line for line in lines if line.startswith("first call"))), lines
    assert not any(line.startswith("first call of toy at caps") for line in lines)
    fit = ", ".join(f"{e['key']} {e['old']} -> {e['new']}" for e in doc["fits"])
    assert f"caps fitted ({fit}): compiling or loading their graph…" in lines and "caps grew" not in res.stdout
    assert doc["graphs_by_call"] and min(int(c) for c in doc["graphs_by_call"]) == 9
    # caps go to the user cache folder, never into the working directory unasked
    assert not list(tmp_path.glob("*caps*.json"))
    (cached,) = (tmp_path / "cache" / "ddpad" / "caps").glob("toy-Ar27-*.json")
    assert f"caps written to {cached} (the next run of this model on this system starts from them)" in res.stdout
    assert doc["caps_file"] == str(cached) and doc["growth_calls"] == 0
    caps = json.loads(cached.read_text())
    assert caps["adapter"] == "toy" and set(caps["caps"]) == {"atoms", "edges", "systems"} and caps["fitted"]
    (tmp_path / "ddpad-toy-caps.json").write_text(cached.read_text())
    import ase.io

    frames = ase.io.read(tmp_path / "md.xyz", index=":")
    assert len(frames) == 7 and len(frames[0]) == 27
    # warm restart from the caps file, with a warm ladder above it: nothing grows
    again = ddpad("run", "toy", "--steps", "4", "--backend", "eager", "--caps", "ddpad-toy-caps.json",
                  "--json", "warm.json", "--warm-ladder", "2", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    warm = json.loads((tmp_path / "warm.json").read_text())
    assert warm["growths"] == [] and warm["rungs_warmed"] == 2 and "warm ladder: 2 rung(s) in " in again.stdout
    assert f"caps loaded from ddpad-toy-caps.json: {caps['caps']}" in again.stdout


def test_steps_per_second_exclude_the_compiles(capsys: pytest.CaptureFixture[str]) -> None:
    """The progress line's steps/s counted the compiles in: it is the rate
    of the steps since the last line that compiled nothing, and the time
    spent compiling (the first call's, then each compiling step's) is apart."""
    compiles = [1]
    progress = cli._run._Progress(20, lambda: compiles[0])  # (a line every 2 steps)
    progress.start(100.0)  # a 100 s first call
    for step, seconds, compiled in ((1, 0.5, 0), (2, 0.5, 0), (3, 7.0, 1), (4, 1.0, 0), (5, 3.0, 1), (6, 3.0, 1)):
        progress.last -= seconds
        compiles[0] += compiled
        progress.step(step)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and "2/20 steps,   2.00 steps/s, 100.0 s compiling so far" in lines[0], lines
    assert "4/20 steps,   1.00 steps/s, 107.0 s compiling so far" in lines[1], lines
    assert "6/20 steps,      - steps/s, 113.0 s compiling so far" in lines[2], lines  # compiling steps only
    # the run's summary: every step that compiled nothing, and the compiling apart
    assert (progress.all_steps, progress.all_seconds, progress.compiling) == (3, pytest.approx(2.0, abs=0.01),
                                                                              pytest.approx(113.0, abs=0.01))


def test_progress_counts_steps_taken(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The first progress line came before the first step (ASE calls its
    observers once before stepping), so its steps/s timed nothing: each
    line counts the MD steps taken."""
    seen: list[tuple[int, int]] = []
    langevin = cli._run._langevin

    def watched(atoms: object) -> object:
        dyn = langevin(atoms)
        monkeypatch.setattr(cli._run._Progress, "step", lambda self, step: seen.append((step, dyn.nsteps)))
        return dyn

    monkeypatch.setattr(cli._run, "_langevin", watched)
    assert cli.main(["run", "toy", "--no-compile", "--steps", "3"]) == 0
    capsys.readouterr()
    assert seen == [(1, 1), (2, 2), (3, 3)]


def test_the_summary_keeps_compiling_apart_from_stepping(capsys: pytest.CaptureFixture[str]) -> None:
    """It said "(50.50 steps/s after the first call, ...)" with the tight fit's
    compile inside those steps: the rate is of the steps that compiled nothing."""
    assert cli.main(["run", "toy", "--no-compile", "--steps", "3"]) == 0
    assert re.search(r"^3 steps in [\d.]+ s: [\d.]+ steps/s on the 3 step\(s\) that compiled nothing$",
                     capsys.readouterr().out, re.MULTILINE)
    assert cli.main(["run", "toy", "--backend", "aot_eager", "--steps", "12", "--no-compile-cache", "--no-caps"]) == 0
    # the first call compiled, and the tight fit on step 10: 11 steps stepped
    assert re.search(r"^12 steps in [\d.]+ s: [\d.]+ s compiling or loading \(the first call included\), "
                     r"[\d.]+ steps/s on the 11 step\(s\) that compiled nothing$", capsys.readouterr().out, re.MULTILINE)


def test_bench_json_schema_and_plot(tmp_path: pathlib.Path) -> None:
    res = ddpad("bench", "toy", "--steps", "12", "--rate", "0.5", "--backend", "eager", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    # a line as each variant starts and one as it ends, with a rough time left
    out = res.stdout
    names = ["eager", "compile-static", "compile-dynamic", "compile-default", "ddpad", "ddpad-tight"]
    starts = re.findall(r"^\[(\d)/6\] (\S+): 12 steps…$", out, re.MULTILINE)
    ends = re.findall(r"^\[(\d)/6\] (\S+): [\d.]+ s \(compile [\d.]+ s\), \d+ graphs?(; roughly \S+ \w+ left)?$",
                      out, re.MULTILINE)
    assert [name for _, name in starts] == [name for _, name, _ in ends] == names
    assert [bool(left) for _, _, left in ends] == [False, True, True, True, True, False]
    tagged = [line for line in out.splitlines() if re.match(r"\[\d/6\] ", line)]
    assert all(line.endswith("12 steps…") for line in tagged[0::2])  # start, end, start, end ...
    assert not any(line.endswith("12 steps…") for line in tagged[1::2])
    assert "ddpad faster by" in out
    doc = json.loads((tmp_path / "ddpad-bench.json").read_text())
    assert (tmp_path / "ddpad-bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the toy package has no padding of its own: no native-padding variant
    assert set(doc["variants"]) == {"eager", "compile-static", "compile-dynamic", "compile-default", "ddpad",
                                    "ddpad-tight"}
    assert doc["steps"] == 12 and len(set(doc["atoms"])) > 1  # the atom count fluctuated
    for variant in doc["variants"].values():
        assert set(variant) >= {"total_s", "compile_s", "steady_median_s", "graphs", "recompiles", "peak_memory_mb"}
        assert len(variant["cumulative_s"]) == 12 and variant["total_s"] > 0
        # per step, for the benchmarks page's plots
        assert len(variant["step_s"]) == len(variant["step_fill"]) == 12
        assert variant["cumulative_s"][-1] == pytest.approx(sum(variant["step_s"]))
        assert set(variant["compile_steps"]) == set(range(12)) & set(variant["compile_steps"])
    assert doc["variants"]["eager"]["step_fill"] == [None] * 12 and not doc["variants"]["eager"]["compile_steps"]
    # at --rate 0.5 the counts swing past 4 % in the window: tight keeps head room's caps, and says why
    tight_run = doc["variants"]["ddpad-tight"]
    assert tight_run["fit_steps"] == [] and re.match(r"step \d+: \w+ swung [\d.]+ % over \d+ calls$",
                                                      tight_run["changing_run"])
    for name in ("ddpad", "ddpad-tight"):
        padded = doc["variants"][name]
        # head room compiles on the first step; tight runs its window eager and compiles where it settles
        first = 0 if name == "ddpad" else int(tight_run["changing_run"].split(":")[0].split()[1])
        assert all(0 < f <= 1 for f in padded["step_fill"]) and padded["compile_steps"][0] == first
        # every step that grew or fitted caps compiled
        assert set(padded["growth_steps"]) | set(padded["fit_steps"]) <= set(padded["compile_steps"])
    assert doc["variants"]["eager"]["graphs"] == 0
    assert doc["variants"]["compile-static"]["recompiles"] > doc["variants"]["ddpad"]["recompiles"]
    assert set(doc["ddpad_speedup"]) == {"eager", "compile-static", "compile-dynamic", "compile-default",
                                         "ddpad-tight"}
    # the padded variants say their fill (tight's, at head room's caps, is head room's)
    head, tight = doc["variants"]["ddpad"]["fill"], doc["variants"]["ddpad-tight"]["fill"]
    assert set(head) == set(tight) >= {"atoms", "edges"}
    assert re.search(r"^ddpad-tight .* 0\.\d{3} ", out, re.MULTILINE)


def test_bench_plot_legend_off_the_curves_integer_ticks() -> None:
    from ddpad._bench.trajectory import figure

    steps = 7
    result = {"adapter": "toy", "device": "cpu", "backend": "eager", "variants": {
        "eager": {"graphs": 0, "cumulative_s": [0.1 * i for i in range(1, steps + 1)]},
        "ddpad": {"graphs": 1, "cumulative_s": [1.0 + 0.1 * i for i in range(1, steps + 1)]},
        "compile-static": {"graphs": 8, "cumulative_s": [2.0 * i for i in range(1, steps + 1)]},
    }}
    fig = figure(result)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["eager (0 graphs)", "ddpad (1 graph)", "compile-static (8 graphs)"]
    fig.canvas.draw()
    legend_box = ax.get_legend().get_window_extent()
    assert legend_box.x0 >= ax.get_window_extent().x1  # right of the axes: off the curves
    ticks = [t for t in ax.get_xticks() if 1 <= t <= steps]
    assert ticks and all(float(t).is_integer() for t in ticks)


def test_help_is_plain_and_every_option_says_its_default() -> None:
    parser = cli.build_parser()
    top = parser.format_help()
    assert "``" not in top and "bench" in top and "run" in top and "list" in top
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for command in ("run", "bench", "precompile"):
        for action in subparsers[command]._actions:
            if action.dest in ("help", "adapter"):
                continue
            assert action.help and "default" in action.help, (command, action.option_strings)


def test_a_dtype_the_model_package_refuses_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import dataclasses

    from ddpad import adapters

    def float32_only(dtype: object = None, device: str = "cpu") -> None:
        raise ValueError("runs in float32 only (it casts inside forward); got torch.float64")

    toy = adapters.get("toy")
    refusing = dataclasses.replace(toy, tools=dataclasses.replace(toy.tools, random_model=float32_only))
    monkeypatch.setattr(cli._run, "_adapter", lambda name, verbose=False: refusing)
    assert cli.main(["run", "toy", "--dtype", "float64", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddpad: error: toy: runs in float32 only"), err


def test_known_third_party_noise_is_silenced_own_warnings_stay() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cli.ignore_noise()
        warnings.warn("The TorchScript type system doesn't support instance-level annotations on empty", UserWarning)
        # torch's pytree, during an export or a compile (a message with regex characters in it)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
                      "treespec.is_leaf()` instead.", FutureWarning)
        warnings.warn("Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected, since the", UserWarning)
        warnings.warn("ddpad: call 3 compiled 1 graph(s) although no cap changed", RuntimeWarning)
    assert [str(w.message)[:6] for w in seen] == ["ddpad:"]


def _write(name: str, text: str | bytes) -> Callable[[pathlib.Path], None]:
    def make(folder: pathlib.Path) -> None:
        path = folder / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
    return make


def _state_dict(folder: pathlib.Path) -> None:
    import torch

    model = __import__("ddpad.adapters", fromlist=["get"]).get("toy").tools.random_model(None, "cpu")
    torch.save(model.state_dict(), folder / "weights.pt")


@pytest.mark.parametrize(
    ("args", "make", "message"),
    [
        (["run", "toy", "--device", "cuda"], None, "--device cuda: "),
        (["run", "toy", "--device", "gpu0"], None, "--device 'gpu0' is not a device torch knows"),
        (["run", "toy", "--caps", "bad.json"], _write("bad.json", "{not json"), "bad.json"),
        (["run", "toy", "--caps", "other.json"], _write("other.json", '{"atoms": 64}'), "other.json"),
        (["run", "toy", "--model", "weights.pt"], _state_dict,
         "cannot load 'weights.pt' as a toy model: it holds an OrderedDict (a state_dict"),
        (["run", "toy", "--caps", "c.json", "--no-caps"], None, "--no-caps (start from the system's own caps) and"),
        (["run", "toy", "--model", "notes.txt"], _write("notes.txt", "not a model\n"),
         "cannot load 'notes.txt' as a toy model (UnpicklingError"),
        (["run", "toy", "--traj", "nowhere/md.xyz"], None, "--traj 'nowhere/md.xyz': directory"),
        (["run", "toy", "--json", "nowhere/run.json"], None, "--json 'nowhere/run.json': directory"),
        (["run", "toy", "--traj-every", "0"], None, "--traj-every must be >= 1"),
        (["run", "toy", "--warm-ladder", "-1"], None, "--warm-ladder takes a number of rungs >= 0"),
        (["run", "toy", "--warm-ladder", "2", "--no-compile"], None, "with --no-compile"),
        (["bench", "toy", "--out", "nowhere/b.json"], None, "--out 'nowhere/b.json': directory"),
        (["bench", "toy", "--repeat", "0"], None, "--repeat must be >= 1"),
    ],
)
def test_ordinary_mistakes_are_one_line(
    args: list[str], make: Callable[[pathlib.Path], None] | None, message: str, tmp_path: pathlib.Path
) -> None:
    if "cuda" in args and __import__("torch").cuda.is_available():
        pytest.skip("a GPU is visible")
    if make is not None:
        make(tmp_path)
    res = ddpad(*args, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = errors(res)
    assert len(lines) == 1 and lines[0].startswith("ddpad: error:") and message in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_elements_the_model_does_not_know_are_one_line(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("mace")
    # `from ddpad import adapters`: `import ddpad.adapters` would shadow the ddpad() helper
    import ase.io
    import torch
    from ase.build import bulk
    from ddpad import adapters

    mace = adapters.get("mace")
    torch.save(mace.tools.random_model(torch.float64, "cpu"), tmp_path / "hco.model")  # knows H, C, O
    ase.io.write(tmp_path / "si.xyz", bulk("Si", cubic=True))
    res = ddpad("run", "mace", "--model", "hco.model", "--system", "si.xyz", "--no-compile", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = errors(res)
    expected = "the system does not fit the model: the model does not know Si (atomic number 14); it knows H, C, O"
    assert lines == [f"ddpad: error: {expected}"], res.stderr


def test_a_model_file_keeps_its_precision_unless_told(tmp_path: pathlib.Path) -> None:
    """Before: ``--model`` was cast to the adapter's default dtype (the toy's:
    torch's float32; mace's: float64, whatever the file held), so a float64
    model was run in float32 and its caps were kept under another model."""
    import torch
    import ddpad_toy_plugin as toy

    torch.save(toy.Morse().double(), tmp_path / "model.pt")
    kept = ddpad("run", "toy", "--model", "model.pt", "--steps", "1", "--no-compile", cwd=tmp_path)
    assert kept.returncode == 0, kept.stderr
    assert "model model.pt, device cpu, torch.float64" in kept.stdout
    told = ddpad("run", "toy", "--model", "model.pt", "--dtype", "float32", "--steps", "1", "--no-compile",
                 cwd=tmp_path)
    assert told.returncode == 0, told.stderr
    assert "model model.pt, device cpu, torch.float32" in told.stdout


def test_random_model_is_built_for_the_systems_elements(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("mace")
    import ase.io
    from ase.build import bulk

    ase.io.write(tmp_path / "si.xyz", bulk("Si", cubic=True))
    res = ddpad("run", "mace", "--system", "si.xyz", "--steps", "2", "--no-compile", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "RANDOMLY INITIALISED model for H, C, O, Si" in res.stdout
    # third-party noise (TorchScript, torch.load, cuequivariance notice) hidden by default
    assert "FutureWarning" not in res.stderr and "UserWarning" not in res.stderr, res.stderr
    assert "cuequivariance" not in res.stdout


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
    lines = errors(res)
    assert len(lines) == 1 and lines[0].startswith("ddpad: error:") and message in lines[0], res.stderr


def test_caps_of_another_adapter_are_refused_before_they_are_announced(tmp_path: pathlib.Path) -> None:
    import ddpad as ddpad_api  # the ddpad() helper above runs the command

    ddpad_api.save_caps({"atoms": 64, "edges": 1024, "systems": 4}, tmp_path / "mace-caps.json", adapter="mace")
    res = ddpad("run", "toy", "--caps", "mace-caps.json", "--no-compile", "--steps", "1", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert errors(res) == ["ddpad: error: caps file 'mace-caps.json' holds caps of adapter 'mace', not 'toy'"]
    assert "caps loaded" not in res.stdout, res.stdout


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert cli.main(["run", "toy", "--no-compile", "--steps", "1", *args]) == 0
    return capsys.readouterr().out


def test_cached_caps_are_per_model_and_system_and_read_back(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    first = _run(capsys)
    assert "caps loaded" not in first
    folder = tmp_path / "cache" / "ddpad" / "caps"
    (default,) = folder.glob("toy-Ar27-*.json")
    doc = json.loads(default.read_text())
    doc["caps"]["edges"] += 16  # an earlier run's grown caps: the next run starts from them
    default.write_text(json.dumps(doc))
    again = _run(capsys)
    assert (f"caps loaded from {default} (the last run of this model on this system; --no-caps starts from the "
            f"system's own): {doc['caps']}") in again
    assert f"(cap {doc['caps']['edges']})" in again  # the grown cap was used
    # another system and another model (float64: another architecture) each get their own file
    other_system = _run(capsys, "--system", "H2O")
    other_model = _run(capsys, "--dtype", "float64")
    assert "caps loaded" not in other_system and "caps loaded" not in other_model
    files = sorted(p.name for p in folder.glob("*.json"))
    assert len(files) == 3 and any(name.startswith("toy-H2O-") for name in files), files
    assert json.loads(default.read_text())["caps"] == doc["caps"]  # not overwritten by the others
    assert "caps loaded" not in _run(capsys, "--no-caps")
    # an explicit --caps FILE wins over the cache
    import ddpad as ddpad_api  # the ddpad() helper above runs the command

    ddpad_api.save_caps({"atoms": 96, "edges": 2048, "systems": 4}, tmp_path / "mine.json", adapter="toy")
    mine = _run(capsys, "--caps", "mine.json")
    assert "caps loaded from mine.json: {'atoms': 96, 'edges': 2048, 'systems': 4}" in mine


def test_a_corrupt_cached_caps_file_is_ignored_with_a_warning(tmp_path: pathlib.Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _run(capsys)
    (default,) = (tmp_path / "cache" / "ddpad" / "caps").glob("toy-*.json")
    default.write_text("{truncated")
    assert cli.main(["run", "toy", "--no-compile", "--steps", "1"]) == 0
    out, err = capsys.readouterr()
    assert "caps loaded" not in out and "ddpad: warning: ignoring the cached caps (" in err
    assert json.loads(default.read_text())["caps"]  # rewritten whole


_SLOW_FIRST_COMPILE = """
import sys, time
import torch
from ddpad import cli

def slow(gm, example_inputs):  # a compile that takes long enough to press Ctrl-C in
    print("COMPILING", flush=True)
    time.sleep(120)
    return gm

torch._dynamo.register_backend(slow, name="slow_for_test")
sys.exit(cli.main(sys.argv[1:]))
"""


def test_ctrl_c_during_the_first_compile_is_one_line_and_writes_nothing(tmp_path: pathlib.Path) -> None:
    import signal

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    # fitted caps in the cache: the first call compiles (without them the first calls run the eager
    # step while tight caps settle, and the one compile comes at the fit)
    fit = subprocess.run([sys.executable, "-m", "ddpad", "run", "toy", "--backend", "eager", "--steps", "12"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert fit.returncode == 0, fit.stderr
    (cached,) = (tmp_path / "cache" / "ddpad" / "caps").glob("*.json")
    written = cached.read_text()
    # Ctrl-C as at a terminal: a test run started in the background of a shell without job
    # control (``.ci/run &``) ignores SIGINT, and a child inheriting that never sees it
    child = subprocess.Popen(
        [sys.executable, "-c", _SLOW_FIRST_COMPILE, "run", "toy", "--backend", "slow_for_test", "--steps", "2",
         "--traj", "md.xyz"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("COMPILING"):
                break
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 130, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("ddpad: warning:")]
    assert lines == ["ddpad: interrupted during the first compile; nothing was written"], err
    assert not (tmp_path / "md.xyz").exists()
    assert list((tmp_path / "cache" / "ddpad" / "caps").glob("*.json")) == [cached] and cached.read_text() == written


_HELP_WITHOUT_TORCH = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("ddpad_cli_alone", sys.argv[1],
                                              submodule_search_locations=[sys.argv[1].rsplit("/", 1)[0]])
cli = importlib.util.module_from_spec(spec)
sys.modules["ddpad_cli_alone"] = cli  # (its command modules import from it as a package)
spec.loader.exec_module(cli)
for argv in (["-h"], ["run", "-h"], ["bench", "-h"], ["precompile", "-h"], ["list", "-h"]):
    try:
        cli.main(argv)
    except SystemExit as exc:
        assert exc.code == 0, (argv, exc.code)
print("torch" in sys.modules, "numpy" in sys.modules, "ase" in sys.modules)
"""


def test_help_imports_neither_torch_nor_a_model_package() -> None:
    res = subprocess.run([sys.executable, "-c", _HELP_WITHOUT_TORCH, cli.__file__], capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "False False False", res.stdout[-2000:]


def test_ddpad_help_as_a_user_runs_it_imports_no_torch() -> None:
    code = ("import sys\nfrom ddpad import cli\ntry:\n    cli.main(['-h'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0 and res.stdout.splitlines()[-1] == "False", (res.stdout[-500:], res.stderr[-2000:])


def test_bench_overhead_runs_without_numpy(tmp_path: pathlib.Path) -> None:
    code = ("import sys\nsys.modules['numpy'] = None  # a core install: torch only\nfrom ddpad import cli\n"
            "sys.exit(cli.main(['bench', '--overhead', '--sizes', '20', '--calls', '1']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "dense-batch" in res.stdout and "ModuleNotFoundError" not in res.stderr


def test_the_summary_says_whether_the_first_calls_were_checked() -> None:
    """Before: ``--no-verify`` printed "checked against the eager step: 0
    compiled graph(s) on their first call, 0 disagreed", as if checks had run
    and found nothing to check."""
    from ddpad import Stats

    stats = Stats(checks=2, disagreements=1, check_seconds=0.5, eager_forms=1)
    assert checks_line(stats).startswith("checked against the eager step: 2 compiled graph(s) on their "
                                          "first call, 1 disagreed (0.50 s)")
    assert checks_line(Stats(), verify=False).startswith("not checked against the eager step (--no-verify)")


def test_store_line_says_what_became_of_each_graph() -> None:
    """It said "1 loaded in 66.5 s (0 hits, 1 misses)", then "0 of 2
    graph(s) found in it, 2 not (compiled or taken from torch's own cache,
    then written)": which of the two, the reader could not tell. Now each
    graph not in the store is said compiled or found in torch's own cache,
    and the counts add up (looked up = in it + not; not in it = compiled +
    from torch's cache)."""
    from ddpad import Stats
    from ddpad.cli._report import store_line

    line = store_line(Stats(graphs=1, graphs_loaded=1, load_seconds=66.5, store_misses=1))
    assert line.startswith("compile store: found 0 of 1 graph in it; the 1 not in it was found in torch's own "
                           "cache, then written to it; loading took 66.5 s; "), line
    line = store_line(Stats(graphs=2, graphs_compiled=2, compile_seconds=30.1, store_misses=2))
    assert line.startswith("compile store: found 0 of 2 graphs in it; the 2 not in it were compiled in 30.1 s, "
                           "then written to it; background"), line
    line = store_line(Stats(graphs=2, graphs_compiled=1, compile_seconds=30.1, graphs_loaded=1, store_misses=2))
    assert "the 2 not in it were compiled (1, in 30.1 s) or found in torch's own cache (1), then" in line
    line = store_line(Stats(graphs=3, graphs_compiled=1, compile_seconds=3.0, graphs_loaded=2, load_seconds=1.5,
                            store_hits=2, store_misses=1, store_loads=2))
    assert line.startswith("compile store: found 2 of 3 graphs in it; the 1 not in it was compiled in 3.0 s, "
                           "then written to it; loading took 1.5 s; "), line


def test_the_readme_names_the_step_a_run_fits_its_caps_on() -> None:
    """The README said the run fits its caps "ten steps in", and the run
    printed "caps fitted on step 9": the first call is step 0, so the tenth
    call (the default ``TightPolicy().settle``) is step 9. The README now
    quotes the summary's step."""
    from ddpad import CapEvent, Stats, TightPolicy

    readme = " ".join((pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    quoted = re.findall(r'"caps fitted on step (\d+)" in the summary', readme)
    assert quoted == [str(TightPolicy().settle - 1)], quoted
    assert f"caps fitted on step {quoted[0]} (" in fill_line(Stats(fits=[CapEvent(9, "atoms", 80, 65, 64, 64)]), "tight")


def test_first_call_says_what_it_compiled_or_loaded() -> None:
    """"first call done in 34.6 s (compile included)" was said of a store
    load that compiled nothing: the first call says what it compiled, loaded
    from the store or torch's cache, or loaded as a package, each with its
    seconds."""
    from ddpad import Stats

    assert Stats(graphs_compiled=1, compile_seconds=30.1, checks=1, check_seconds=1.25).work() == (
        "compiled 1 graph in 30.1 s, checked against the eager step in 1.2 s")
    assert Stats(graphs_loaded=2, store_loads=1, load_seconds=2.0).work() == (
        "loaded 2 graphs (1 from the compile store and 1 from torch's own cache) in 2.0 s")
    assert Stats(aot_loaded=1, aot_load_seconds=0.02).work() == "loaded 1 package in 0.02 s"
    assert Stats(aot_compiled=2, aot_seconds=80.0).work() == "built 2 packages in 80.0 s"
    before = Stats(graphs_compiled=1, compile_seconds=30.0)
    assert before.work(before.snapshot()) == "nothing compiled or loaded"


def test_growths_are_counted_in_calls_with_the_caps_that_grew() -> None:
    from ddpad import CapEvent, Stats

    stats = Stats(growths=[CapEvent(3, "atoms", 32, 48, 40, 40), CapEvent(3, "edges", 512, 704, 600, 600),
                           CapEvent(9, "edges", 704, 912, 800, 800)])
    assert growth_line(stats) == "growth calls: 2 (atoms 32 -> 48, edges 512 -> 912 (2 growths))"
    assert growth_line(Stats()) == "growth calls: 0"
    # caps that changed by a fit, not a growth, are said (before: "growth calls: 0" alone, then
    # "(caps fitted on step 9, not grown)", which left the second compiled graph unexplained)
    fitted = Stats(fits=[CapEvent(9, "atoms", 80, 65, 64, 64)])
    assert growth_line(fitted) == ("growth calls: 0 (the caps changed once: fitted to the needs seen up to step 9, "
                                    "one compile; no cap grew after)")
    kept = Stats(changing_run="step 9: edges swung 5.3 % over 10 calls")
    assert growth_line(kept) == ("growth calls: 0 (tight caps kept at head room, step 9: edges swung 5.3 % over "
                                 "10 calls: a changing run)")
    assert fill_line(kept, "tight").endswith("; caps kept at head room on step 9: edges swung 5.3 % over 10 calls "
                                             "(a changing run)")


def test_main_restores_warning_filters_format_and_logging(capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    root, own = logging.getLogger(), logging.getLogger("ddpad")

    def state() -> tuple[object, ...]:
        return (list(warnings.filters), warnings.formatwarning, list(root.handlers), root.level,
                list(own.handlers), own.level, own.propagate)

    before = state()
    for verbose in ([], ["-v"]):
        assert cli.main([*verbose, "run", "toy", "--no-compile", "--steps", "1"]) == 0
        assert state() == before, verbose
    capsys.readouterr()


def test_ddpad_log_records_read_as_its_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    with cli._cli_scope(verbose=False):
        logging.getLogger("ddpad").warning("ddpad: the compile store is not used with backend %r", "eager")
        logging.getLogger("ddpad").info("ddpad: compiling (hidden without -v)")
    with cli._cli_scope(verbose=True):
        logging.getLogger("ddpad").info("compiling")
    assert capsys.readouterr().err.splitlines() == [
        "ddpad: warning: the compile store is not used with backend 'eager'", "ddpad: compiling"]


def test_bench_engines_says_why_each_engine_cannot_run(tmp_path: pathlib.Path) -> None:
    """``ddpad bench ADAPTER --engines`` compares with the package's own
    models (``ToolHooks.ase_calculator`` / ``torchsim_model``; LAMMPS with
    the plain eager model in the same callback): an adapter
    declaring none gets each engine's reason, and exit status 2 when no
    engine could run; nothing is silently left out."""
    out = tmp_path / "engines.json"
    res = ddpad("bench", "toy", "--engines", "--blocks", "1", "--backend", "eager", "--out", str(out))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "declares no ASE calculator to compare with (ToolHooks.ase_calculator)" in res.stdout
    assert "not measured" in res.stdout
    assert any(line.startswith("LAMMPS (1 rank)") and "not measured" in line for line in res.stdout.splitlines())
    assert "no engine could run" in "\n".join(errors(res))
    report = json.loads(out.read_text())
    assert report["engines"] == [] and {e for e, _, _ in report["not_measured"]} == {"ase", "torchsim", "lammps"}


def test_no_compile_cache_reaches_the_calculator_as_none() -> None:
    """``--no-compile-cache`` passes ``compile_cache=None`` (not nothing): the
    ASE calculator binds ddpad's compile store by default, so leaving the
    option out would have put the store back."""
    import argparse

    from ddpad.cli._common import _store_options

    args = argparse.Namespace(backend="inductor", no_compile_cache=True, compile_cache="/elsewhere")
    assert _store_options(args)["compile_cache"] is None
    args.no_compile_cache = False
    assert _store_options(args)["compile_cache"] == "/elsewhere"
