"""The per-call overhead benchmark (``ddpad._bench.overhead``), in quick mode (issue 15)."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from ddpad import PaddedModel, RecompileError, _capacity
from ddpad._bench.overhead import PADDERS, QUICK_SIZES, _Trivial, format_table, overhead_table

COLUMNS = {"padder", "atoms", "edges", "bare_us", "wrapped_us", "overhead_us", "pad_us", "clone_us", "device_ops",
           "pad_per_clone", "overhead_per_clone"}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return overhead_table(quick=True)


def test_table_covers_every_padder_and_size(rows: list[dict]) -> None:
    assert [(r["padder"], r["atoms"]) for r in rows] == [(p, n) for p in PADDERS for n in QUICK_SIZES]
    for r in rows:
        assert set(r) == COLUMNS
        assert r["pad_us"] > 0 and r["clone_us"] > 0 and r["wrapped_us"] > 0
        assert r["pad_per_clone"] == pytest.approx(r["pad_us"] / r["clone_us"])
    text = format_table(rows)
    assert len(text.splitlines()) == len(rows) + 1 and "pad/clone" in text


def test_padding_a_thousand_atoms_costs_a_few_copies(rows: list[dict]) -> None:
    """Loose on purpose (a loaded 2-core machine): before the per-layout plans
    a COO pad of 1,000 atoms cost 20-60 clones of the input, now 2-3."""
    for r in rows:
        if r["atoms"] == 1000 and r["padder"] in ("coo", "coo-uma"):
            assert r["pad_per_clone"] < 10, r


def test_steady_calls_launch_a_handful_of_kernels(rows: list[dict]) -> None:
    """On a GPU each op a call dispatches is a kernel launch (a few us): a
    steady call adds one copy of every field and the few ops the data needs
    (sentinels rerouted, dead positions, a LAST_REAL row), none per field and
    none per atom. The counts are exact on any machine; growing one is a
    regression (UMA's was 11 while the dead system's counts were rewritten
    every call)."""
    most = {"coo": 7, "coo-mace": 8, "coo-uma": 9, "dense-aimnet2": 5, "dense-batch": 5}
    for r in rows:
        assert r["device_ops"] <= most[r["padder"]], r


def _trivial(name: str = "coo", n: int = 20, **kw: object) -> tuple[PaddedModel, dict]:
    make, build, positions = PADDERS[name]
    return PaddedModel(_Trivial(positions), make(), **kw), build(n, torch.Generator().manual_seed(n))  # type: ignore[arg-type]


class _CountingItems(collections.defaultdict):
    """Dynamo's guard-failure map, counting the scans of it."""

    scans = 0

    def items(self):  # type: ignore[no-untyped-def]
        type(self).scans += 1
        return super().items()


def test_steady_calls_build_no_resolutions_and_scan_no_guard_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that changes no cap allocates no CapResolution and does not
    scan Dynamo's guard failures (nothing was converted since the last
    call); its fills are still the real counts over the caps."""
    wrapped, data = _trivial()
    wrapped(data)
    wrapped(data)  # a first call may convert a frame somewhere (a recount on the next one)
    built: list[object] = []

    @dataclasses.dataclass(frozen=True)
    class Counted(_capacity.CapResolution):
        def __post_init__(self) -> None:
            built.append(self)

    failures = _CountingItems(list, torch._dynamo.utils.guard_failures)
    monkeypatch.setattr(torch._dynamo.utils, "guard_failures", failures)
    monkeypatch.setattr(_capacity, "CapResolution", Counted)
    for _ in range(3):
        wrapped(data)
    assert built == [] and _CountingItems.scans == 0
    n, e = data["positions"].shape[0], data["edge_index"].shape[1]
    caps = wrapped.caps
    assert wrapped.stats.fill == {"atoms": n / caps["atoms"], "edges": e / caps["edges"], "systems": 2 / caps["systems"]}
    wrapped(dict(data, edge_index=data["edge_index"].repeat(1, 2), unit_shifts=data["unit_shifts"].repeat(2, 1)))
    assert sorted(r.key for r in built) == ["atoms", "edges", "systems"]  # a growth: recorded as before
    assert [(g.key, g.old) for g in wrapped.stats.growths] == [("edges", caps["edges"])]


def test_strict_mode_reasons_are_this_calls_only() -> None:
    """The guard-failure count is kept between calls: a recompile elsewhere
    in between must not reach the reasons of this model's recompile."""
    wrapped, data = _trivial(backend="eager", on_recompile="raise")
    wrapped(data)
    wrapped(data)
    foreign = torch.compile(lambda foreign_arg: foreign_arg * 2, backend="eager", dynamic=False)
    foreign(torch.ones(3))
    foreign(torch.ones(3, dtype=torch.float64))  # a guard failure of another frame
    wrapped(data)
    with pytest.raises(RecompileError, match="no cap changed") as err:
        wrapped(dict(data, positions=data["positions"].float()))
    assert "foreign_arg" not in str(err.value) and "positions" in str(err.value)


def test_cli_prints_the_table_and_writes_it(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    from ddpad.cli import main

    out = tmp_path / "overhead.json"
    assert main(["bench", "--overhead", "--quick", "--calls", "2", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("padder"))
    rows = [line.split()[:2] for line in lines[head + 1:-1]]
    assert rows == [[p, f"{n:,}"] for p in PADDERS for n in QUICK_SIZES]
    assert lines[-1] == f"wrote {out}"
    # the JSON report holds the printed rows, for the benchmarks page
    doc = json.loads(out.read_text())
    assert [[r["padder"], f"{r['atoms']:,}"] for r in doc["rows"]] == rows
    assert doc["calls"] == 2 and doc["sizes"] == list(QUICK_SIZES) and set(doc["rows"][0]) >= COLUMNS


def test_a_neighbour_field_adds_one_kernel_to_a_dense_pad() -> None:
    """Lattice shifts riding on the neighbour matrix cost their own ``where``
    only: the sentinel mask is the one the matrix's reroute built, not
    computed again (on a GPU: one kernel more, not two)."""
    from ddpad.padding import DensePadder
    from ddpad._bench.overhead import _ops

    n, k = 30, 8
    gen = torch.Generator().manual_seed(0)
    data = {
        "coord": torch.randn(n + 1, 3, generator=gen), "numbers": torch.randint(1, 9, (n + 1,), generator=gen),
        "charge": torch.zeros(1), "nbmat": torch.randint(0, n + 1, (n + 1, k), generator=gen, dtype=torch.int32),
        "shifts": torch.randn(n + 1, k, 3, generator=gen),
    }
    meta = {key: value.to("meta") for key, value in data.items()}
    counts = []
    for neighbor_fields in ({}, {"shifts": ("nbmat", 0.0)}):
        padder = DensePadder(atom_fields={"coord": 0.0, "numbers": 0}, system_count="charge",
                             neighbor_fields=neighbor_fields)
        state: dict[str, int] = {}
        counts.append(_ops(lambda p=padder, s=state: p.pad(meta, s)))
    assert counts[1] == counts[0] + 1, counts


def test_the_architecture_page_counts_what_a_call_visits() -> None:
    """docs/pages/architecture.md said a steady call makes 34 ddpad function
    calls and a growth call 153, where ``benchmarks/call_trace.py`` counted
    35 and 166 (on the commit before this test too): the page quotes the
    script's counts."""
    root = pathlib.Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "call_trace.py")], capture_output=True,
                         text=True, timeout=600, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    steady = re.search(r"steady: (\d+) modules, (\d+) calls", res.stdout)
    growth = re.search(r"growth: (\d+) modules, (\d+) calls", res.stdout)
    assert steady and growth, res.stdout + res.stderr
    page = " ".join((root / "docs" / "pages" / "architecture.md").read_text(encoding="utf-8").split())
    assert "What a steady call visits" in page
    assert f": {steady[1]} runtime modules (" in page and f") and {steady[2]} ddpad function calls." in page, steady[0]
    assert f"check): {growth[1]} modules, {growth[2]} calls." in page, growth[0]
