"""Production safety (single process): caps change only with success, ceilings,
caps files that survive kills and concurrent writers, strict mode that knows
call forms."""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import ddpad
from _mpnn import MPNN, trajectory
from ddpad import CapacityError, PaddedModel, RecompileError
from ddpad._memory import derive_ceilings
from ddpad.padding import COOPadder, CapPolicy, Fill
from test_runtime import assert_same, padder


class SpikyMPNN(MPNN):
    """An MPNN whose allocator gives out above ``limit`` padded atoms, as a GPU
    does on a burst: the call raises the allocator's error."""

    limit = 300

    def forward(self, data: dict[str, torch.Tensor], compute_stress: bool = True) -> dict[str, torch.Tensor]:
        if data["positions"].shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"out of memory: tried to allocate for {data['positions'].shape[0]} atoms")
        return super().forward(data, compute_stress)


def spike(n: int = 400) -> dict[str, torch.Tensor]:
    return trajectory(1, 1, seed=9, n0=n)[0]


def test_out_of_memory_on_a_spike_rolls_the_caps_back(tmp_path: pathlib.Path) -> None:
    model = SpikyMPNN()
    wrapped = PaddedModel(model, padder(), backend="eager", on_recompile="raise")
    steps = trajectory(6, 1, seed=3)
    for data in steps[:3]:
        wrapped(data)
    before, growths, calls = wrapped.caps, list(wrapped.stats.growths), wrapped.stats.calls
    big = spike()
    with pytest.raises(CapacityError) as info:
        wrapped(big)
    message = str(info.value)
    n_big = big["positions"].shape[0]
    assert f"'atoms' {before['atoms']} -> " in message and f"for real {n_big}" in message
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    # nothing of the failed call stays: caps, growths, call count
    assert wrapped.caps == before and wrapped.stats.growths == growths and wrapped.stats.calls == calls
    assert [e.key for e in wrapped.stats.failed_growths] == ["atoms", "edges"]
    # later normal steps run at the old caps, exact, with no compile (strict mode holds)
    graphs = wrapped.stats.graphs
    for data in steps[3:]:
        assert_same(wrapped(data), model(dict(data)))
    assert wrapped.stats.graphs == graphs and wrapped.stats.unexplained == []
    wrapped.save_caps(tmp_path / "caps.json")
    assert ddpad.load_caps(tmp_path / "caps.json") == before


def test_a_model_error_rolls_back_and_says_which_caps() -> None:
    class Broken(MPNN):
        def forward(self, data: dict[str, torch.Tensor], compute_stress: bool = True) -> dict[str, torch.Tensor]:
            if data["positions"].shape[0] > 300:
                raise ValueError("model rejects large inputs")
            return super().forward(data, compute_stress)

    wrapped = PaddedModel(Broken(), padder(), compile=False)
    wrapped(trajectory(1, 1, seed=3)[0])
    before = wrapped.caps
    with pytest.raises(ValueError, match="model rejects") as info:
        wrapped(spike())
    assert any("rolled back" in note for note in info.value.__notes__)
    assert wrapped.caps == before


def test_ceilings_stop_growth_then_raise_or_run_eager() -> None:
    model = MPNN()
    data, big = trajectory(1, 1, seed=3)[0], spike(120)
    n_big = big["positions"].shape[0]
    strict = PaddedModel(model, padder(), compile=False, max_caps={"atoms": 96})
    strict(data)
    with pytest.raises(CapacityError, match=rf"'atoms' needs {n_big + 1} rows \(real {n_big} \+ 1 reserved\).*ceiling is 96"):
        strict(big)
    assert strict.caps["atoms"] <= 96
    # growth clamps to the ceiling when the need fits under it
    clamped = PaddedModel(model, padder(), compile=False, max_caps={"atoms": 80})
    clamped(trajectory(1, 1, seed=3, n0=60)[0])
    assert clamped.caps["atoms"] == 80
    # on_overflow="eager": the step runs unpadded, exact, caps untouched
    lenient = PaddedModel(model, padder(), compile=False, max_caps={"atoms": 96}, on_overflow="eager")
    lenient(data)
    caps = lenient.caps
    assert_same(lenient(big), model(dict(big)))
    assert lenient.caps == caps and lenient.stats.eager_steps == 1
    # a CapPolicy ceiling works the same way
    capped = COOPadder(3.0, atom_fields={"node_attrs": 0.0}, edge_fields={"unit_shifts": Fill.DEAD_UNIT_SHIFT},
                       system_fields={"cell": Fill.DEAD_CELL},
                       atoms_policy=CapPolicy(1.15, 1.3, 16, extra=1, strict_gt=False, max_cap=64))
    with pytest.raises(CapacityError, match="ceiling is 64"):
        capped.pad(big, {})
    with pytest.raises(ValueError, match="max_cap"):
        CapPolicy(1.15, max_cap=0)


def test_memory_budget_derives_ceilings_and_needs_cuda() -> None:
    assert derive_ceilings({"atoms": 128, "edges": 4096}, peak_bytes=1000, budget_bytes=2500) == {
        "atoms": 320, "edges": 10240}
    wrapped = PaddedModel(MPNN(), padder(), compile=False, memory_budget=10**9)
    with pytest.raises(ValueError, match="memory_budget .* needs a CUDA input"):
        wrapped(trajectory(1, 1, seed=3)[0])
    assert wrapped.caps == {}
    with pytest.raises(ValueError, match="memory_budget"):
        PaddedModel(MPNN(), padder(), compile=False, memory_budget=-1)


def test_strict_mode_knows_call_forms_and_failed_steps() -> None:
    model = SpikyMPNN()
    wrapped = PaddedModel(model, padder(), backend="eager", on_recompile="raise")
    steps = trajectory(12, 1, seed=6)
    wrapped(steps[0])
    wrapped(steps[1], compute_stress=False)  # a new call form compiles: not an error
    graphs = wrapped.stats.graphs
    wrapped(steps[2], compute_stress=False)
    wrapped(steps[3])
    assert wrapped.stats.graphs == graphs  # each form compiled once
    with pytest.raises(CapacityError):
        wrapped(spike())
    for data in steps[4:]:
        wrapped(data)
    assert wrapped.stats.unexplained == []
    as_float = dict(steps[5], node_attrs=steps[5]["node_attrs"].float().double().requires_grad_(True))
    with pytest.raises(RecompileError):  # what no cap and no call form explains still raises
        wrapped(as_float)


# -- caps files ---------------------------------------------------------------


def test_caps_file_errors_name_the_file(tmp_path: pathlib.Path) -> None:
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    with pytest.raises(ValueError, match=f"cannot read caps file '{corrupt}'"):
        ddpad.load_caps(corrupt)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"caps": {"atoms": 64}}))
    with pytest.raises(ValueError, match=f"caps file '{other}' is not a ddpad caps file"):
        ddpad.load_caps(other)
    missing = tmp_path / "missing.json"
    with pytest.raises(ValueError, match="cannot read caps file .*missing.json"):
        ddpad.load_caps(missing)
    aimnet = tmp_path / "aimnet.json"
    ddpad.save_caps({"atoms": 64}, aimnet, adapter="aimnet2")
    with pytest.raises(ValueError, match="holds caps of adapter 'aimnet2', not 'mace'"):
        ddpad.load_caps(aimnet, adapter="mace")
    huge = tmp_path / "huge.json"
    ddpad.save_caps({"atoms": 10**9}, huge)
    with pytest.raises(ValueError, match="exceeds its ceiling 4096"):
        PaddedModel(MPNN(), padder(), compile=False, caps=huge, max_caps={"atoms": 4096})
    bad = tmp_path / "bad.json"
    ddpad.save_caps({"atoms": -3}, bad)
    with pytest.raises(ValueError, match="'atoms' must be a positive integer"):
        ddpad.load_caps(bad)


def test_unknown_preset_keys_warn(tmp_path: pathlib.Path) -> None:
    wrapped = PaddedModel(MPNN(), padder(), compile=False, caps={"atoms": 64, "atomz": 64})
    with pytest.warns(RuntimeWarning, match=r"preset caps \['atomz'\] are not used"):
        wrapped(trajectory(1, 1, seed=3)[0])


def _write_forever(path: str, value: int) -> None:
    while True:
        ddpad.save_caps({"atoms": value, "edges": value * 10}, path, adapter="mace")


def test_caps_writes_are_atomic_under_kills_and_concurrent_writers(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "caps.json"
    ddpad.save_caps({"atoms": 16, "edges": 160}, path, adapter="mace")
    # a writer killed mid-save leaves the old or the new file, never a partial one
    for _ in range(10):
        proc = subprocess.Popen([sys.executable, "-c", (
            "import ddpad\n"
            f"while True: ddpad.save_caps({{'atoms': 32, 'edges': 320}}, {str(path)!r}, adapter='mace')\n")])
        time.sleep(0.4 + 0.05 * _)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert ddpad.load_caps(path, adapter="mace") in ({"atoms": 16, "edges": 160}, {"atoms": 32, "edges": 320})
    # two writers and a reader at once: every load succeeds
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_write_forever, args=(str(path), v)) for v in (48, 64)]
    for w in writers:
        w.start()
    try:
        loads = 0
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            caps = ddpad.load_caps(path, adapter="mace")
            assert caps["edges"] == 10 * caps["atoms"]
            loads += 1
        assert loads > 50
    finally:
        for w in writers:
            w.kill()
            w.join()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "caps.json"]
    assert all(name.startswith(".ddpad-caps-") for name in leftovers)  # only temp files of killed writers
    assert os.path.exists(path)


def test_save_failure_keeps_the_old_file(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "caps.json"
    ddpad.save_caps({"atoms": 16}, path)

    def broken_fsync(*args: Any, **kwargs: Any) -> None:  # the write fails after the temp file exists
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        ddpad.save_caps({"atoms": 32}, path)
    monkeypatch.undo()
    assert ddpad.load_caps(path) == {"atoms": 16}
    assert [p.name for p in tmp_path.iterdir()] == ["caps.json"]
