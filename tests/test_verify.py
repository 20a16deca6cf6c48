"""First-use checks (``verify``): every compiled graph's first call per caps
and call form is compared with the eager step on the same padded input; a
disagreement returns the eager numbers and those caps run eager."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import ddpad
import ddpad_toy_plugin as toy
from _miscompiling import OFF, miscompiling
from _mpnn import MPNN, trajectory
from ddpad import PaddedModel
from ddpad._verify import disagreement, nonfinite
from ddpad.cli._report import checks_line
from test_runtime import SeamModel, assert_same, compile_core, padded_model, padder

def _reference(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return model({k: v.clone() for k, v in data.items()})


def test_a_miscompiling_backend_gives_the_eager_numbers(caplog: pytest.LogCaptureFixture) -> None:
    """Before: the backend's numbers were returned as they came, 1e-3 off."""
    model = MPNN()
    wrapped = padded_model(model, backend=miscompiling, cap_policy="headroom")
    steps = trajectory(12, (1, 3), seed=4)
    with caplog.at_level(logging.WARNING, logger="ddpad"):
        for data in steps:
            assert_same(wrapped(data), _reference(model, data))
    s = wrapped.stats
    caps_seen = 1 + s.growth_calls
    assert s.checks == s.disagreements == s.eager_forms == caps_seen
    lines = [r.getMessage() for r in caplog.records if "disagrees with the eager step" in r.getMessage()]
    assert len(lines) == caps_seen and "report it to PyTorch" in lines[0] and "'atoms'" in lines[0]
    assert "max deviation" in lines[0]


class _Rows(MPNN):
    """Records the atom rows of each eager (not traced) call."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __call__(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            self.rows.append(int(data["positions"].shape[0]))
        return super().__call__(data, *args, **kwargs)


def test_a_refused_caps_later_calls_run_the_unpadded_model() -> None:
    """Before (#53): the calls at caps whose graph disagreed ran the padded
    eager step, dead rows and all (orb at one thread, where Inductor's code
    is wrong: 1.67 x orb's own eager step; unpadded, 1.00 x). They now run
    the model's own step on the unpadded input, and give its numbers."""
    model = _Rows()
    wrapped = padded_model(model, backend=miscompiling, cap_policy="headroom")
    steps = [trajectory(1, 1, seed=7)[0] for _ in range(4)]
    first = steps[0]
    for data in [first, first, first]:
        assert_same(wrapped(data), _reference(model, data))
    real = int(first["positions"].shape[0])
    assert wrapped.stats.eager_forms == 1 and wrapped.caps["atoms"] > real
    model.rows.clear()
    assert_same(wrapped(first), _reference(model, first))
    assert model.rows == [real, real]  # this call's (unpadded), then the reference's
    # under a domain decomposition every rank keeps the padded step
    model.rows.clear()
    with ddpad.padding.activate_dd_context(ddpad.padding.DistributedContext()):
        wrapped(first)
    assert model.rows == [wrapped.caps["atoms"]]


def test_verify_false_opts_out() -> None:
    model = MPNN()
    wrapped = padded_model(model, backend=miscompiling, cap_policy="headroom", verify=False)
    data = trajectory(1, 1, seed=5)[0]
    out, ref = wrapped(data), _reference(model, data)
    assert abs(float(out["energy"][0] - ref["energy"][0]) - OFF) < 1e-9
    assert wrapped.stats.checks == 0
    with pytest.raises(TypeError, match="verify must be True"):
        padded_model(model, verify="yes")


class _CountingEager(MPNN):
    """Counts its own eager forward calls (Dynamo's trace runs the code
    under a tracer, not through this counter's ``__call__``)."""

    def __init__(self) -> None:
        super().__init__()
        self.eager_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            self.eager_calls += 1
        return super().__call__(*args, **kwargs)


def test_each_graph_is_checked_once_and_steady_calls_run_nothing_eager() -> None:
    model = _CountingEager()
    wrapped = padded_model(model, backend="aot_eager", cap_policy="headroom", on_recompile="raise")
    steps = trajectory(40, (1, 3), seed=6)
    for data in steps:
        wrapped(data)
    wrapped(steps[-1], compute_stress=False)  # a new call form: a new graph, checked
    s = wrapped.stats
    checked = 1 + s.growth_calls + 1
    assert (s.checks, s.disagreements) == (checked, 0)
    # one eager step per check (Dynamo traces the rest); none on the steady calls
    assert model.eager_calls == checked


def test_a_seam_padded_model_is_checked_at_its_seam(caplog: pytest.LogCaptureFixture) -> None:
    """A model that pads inside its forward (UMA): the eager step runs its
    compiled part eager, padded at the seam to the same caps; nothing grows
    twice and no resolution is recorded twice."""
    model = SeamModel()
    wrapped = PaddedModel(model, padder(), pad_in_forward=True, backend=miscompiling, compile_region=compile_core,
                          cap_policy="headroom", on_recompile="raise")  # (caps first run eager compile later)
    steps = trajectory(10, (1, 3), seed=7)
    with caplog.at_level(logging.WARNING, logger="ddpad"):
        for data in steps:
            assert_same(wrapped(data), _reference(model.core._orig_mod, data))
    s = wrapped.stats
    assert s.checks == s.disagreements == 1 + s.growth_calls
    assert ddpad.padding.current_dd_context() is ddpad.padding.NOT_DISTRIBUTED
    good = PaddedModel(SeamModel(), padder(), pad_in_forward=True, backend="aot_eager", compile_region=compile_core,
                       cap_policy="headroom", on_recompile="raise")
    for data in steps:
        good(data)
    assert good.stats.checks == 1 + good.stats.growth_calls and good.stats.disagreements == 0
    assert [e.key for e in good.stats.growths] == [e.key for e in s.growths]  # the check grew nothing


class _Scribbler(toy.Morse):
    """Writes an intermediate into its input dict and reuses it when it is
    there, as aimnet does: a check that handed the compiled step's dict to
    the eager step backpropagated through the compiled graph again
    ("Trying to backward through the graph a second time": AIMNet2 under
    compile_mode="aot" lost its first step so)."""

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pos = data["pos"]
        if not pos.requires_grad:
            pos.requires_grad_(True)
        src, dst = data["edge_index"]
        if "r" not in data:
            data["r"] = (pos[dst] - pos[src]).norm(dim=-1)
        r = data["r"]
        pair = self.depth * ((1 - torch.exp(-(r - 1.2))) ** 2 - 1) * (r < self.cutoff)
        atom_e = torch.zeros_like(pos[:, 0]).index_add(0, dst, 0.5 * pair) + self.shift
        energy = torch.zeros(data["ptr"].shape[0] - 1, dtype=pos.dtype).index_add(0, data["batch"], atom_e)
        (grad,) = torch.autograd.grad(energy.sum(), pos)
        if bool(energy.sum() > 1e9):  # a data-dependent branch: compile_mode="aot" refuses the trace
            energy = energy * 0
        return {"energy": energy, "forces": -grad, "atom_energy": atom_e}


@pytest.mark.parametrize("mode", ["dynamo", "aot"])
def test_a_model_that_writes_into_its_input_is_checked_on_its_own_copy(mode: str) -> None:
    """Before (aot): the refused package fell back to torch.compile, whose
    check ran the eager step on the dict the compiled step had written into,
    and the call raised."""
    model = _Scribbler().double().eval()
    wrapped = ddpad.wrap(model, toy.ADAPTER, backend="aot_eager", cap_policy="headroom", compile_mode=mode)
    system = toy.ADAPTER.tools.default_system()
    for step in range(3):
        atoms = system.copy()
        atoms.rattle(0.02, seed=step)
        data = toy.ADAPTER.engine.build_input(model, atoms)
        out, ref = wrapped(data), model({k: v.clone() for k, v in data.items()})
        for key in ("energy", "forces", "atom_energy"):
            torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-12)
    assert wrapped.stats.checks == 1 and wrapped.stats.disagreements == 0
    assert wrapped.stats.aot_refused == (mode == "aot")


# -- engines that call torch.compile themselves: each graph the backend compiles is checked


def _energy_and_count(positions: torch.Tensor, weight: torch.Tensor, calls: torch.Tensor) -> torch.Tensor:
    """Two graphs (a graph break between them), the first writing into an input."""
    calls.add_(1)
    energy = (weight * positions.pow(2)).sum()
    torch._dynamo.graph_break()
    return energy * 0.5 + positions.sum()


def _engine_compiled(backend: Any, **options: Any) -> tuple[Any, ddpad.Stats]:
    torch._dynamo.reset()
    stats = ddpad.Stats()
    return torch.compile(_energy_and_count, backend=ddpad.padding.counting_backend(stats, backend, **options)), stats


def test_an_engines_miscompiled_graphs_run_eagerly_differentiable(caplog: pytest.LogCaptureFixture) -> None:
    """nvalchemi compiles the model itself, with ``padder.compile_kwargs()``'s
    backend. Before: its graphs were never checked, and a miscompiled one's
    numbers (1e-3 off) were returned."""
    compiled, stats = _engine_compiled(miscompiling)
    weight, calls = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), torch.zeros((), dtype=torch.long)
    for step in range(3):
        positions = torch.linspace(0.1, 0.7, 3, dtype=torch.float64).add(0.1 * step).requires_grad_(True)
        with caplog.at_level(logging.WARNING, logger="ddpad"):
            energy = compiled(positions, weight, calls)
        want = _energy_and_count(positions, weight, torch.zeros((), dtype=torch.long))
        assert float(energy.detach()) == pytest.approx(float(want.detach()), abs=1e-15)
        (grad,) = torch.autograd.grad(energy, positions)  # the eager run's outputs reach the inputs
        torch.testing.assert_close(grad, weight * positions.detach() + 1, rtol=0, atol=1e-15)
    assert int(calls) == 3  # the first graph wrote into its input once per call, the check's run into a copy
    assert (stats.graphs, stats.checks, stats.disagreements, stats.eager_forms) == (2, 2, 2, 2)
    assert sum("disagrees with the same graph run eagerly" in r.getMessage() for r in caplog.records) == 2


def test_an_engines_graphs_that_agree_are_checked_once() -> None:
    compiled, stats = _engine_compiled("aot_eager")
    weight, calls = torch.tensor([1.0, 2.0, 3.0]), torch.zeros((), dtype=torch.long)
    for step in range(4):
        positions = torch.linspace(0.1, 0.7, 3).add(0.1 * step)
        assert float(compiled(positions, weight, calls)) == float(_energy_and_count(positions, weight, calls.clone()))
    assert int(calls) == 4
    assert (stats.graphs, stats.checks, stats.disagreements, stats.eager_forms) == (2, 2, 0, 0)


def test_an_engine_may_opt_out_of_the_check() -> None:
    compiled, stats = _engine_compiled(miscompiling, verify=False)
    positions, weight = torch.linspace(0.1, 0.7, 3), torch.tensor([1.0, 2.0, 3.0])
    want = _energy_and_count(positions, weight, torch.zeros((), dtype=torch.long))
    got = float(compiled(positions, weight, torch.zeros((), dtype=torch.long)))
    assert abs(got - float(want)) > OFF  # both graphs' numbers, as the backend made them
    assert (stats.graphs, stats.checks) == (2, 0)


def test_an_engines_steady_call_reads_no_missing_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo's wrapper around a compiled graph reads its ``__name__`` on
    every call. Before: ``CheckedGraph`` had none, so each steady call went
    through ``__getattr__`` and a raised AttributeError (2.7 us per graph per
    call, measured alone)."""
    from ddpad._verify import CheckedGraph

    misses: list[str] = []
    delegate = CheckedGraph.__getattr__

    def counted(self: CheckedGraph, name: str) -> Any:
        misses.append(name)
        return delegate(self, name)

    monkeypatch.setattr(CheckedGraph, "__getattr__", counted)
    compiled, stats = _engine_compiled("aot_eager")
    weight, calls = torch.tensor([1.0, 2.0, 3.0]), torch.zeros((), dtype=torch.long)
    compiled(torch.linspace(0.1, 0.7, 3), weight, calls)
    misses.clear()
    for _ in range(5):
        compiled(torch.linspace(0.1, 0.7, 3), weight, calls)
    assert stats.checks == 2 and misses == []


class _NonFinite(MPNN):
    """An MPNN whose per-atom energies are NaN in dead rows (``where="dead"``:
    the padded rows, whose species one-hot is all zero) or in the first real
    row (``where="real"``), as a padding defect or a model's own NaN would be."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def forward(self, data: dict[str, torch.Tensor], compute_stress: bool = True) -> dict[str, torch.Tensor]:
        out = super().forward(data, compute_stress)
        rows = data["node_attrs"].sum(-1) == 0 if self.where == "dead" else torch.arange(
            out["node_energy"].shape[0], device=out["node_energy"].device) == 0
        out["node_energy"] = torch.where(rows, torch.nan, out["node_energy"])
        return out


def test_nan_in_the_same_places_is_no_disagreement() -> None:
    nan = float("nan")
    same = {"e": torch.tensor([nan, 1.0]), "f": torch.tensor([[0.5, float("inf")]])}
    assert disagreement(same, {k: v.clone() for k, v in same.items()}) is None
    assert disagreement({"e": torch.tensor([1.0, 1.0])}, {"e": torch.tensor([nan, 1.0])}) == \
        "output ['e']: NaN or inf in other places than the eager step's"
    assert "output ['e']: max deviation" in disagreement({"e": torch.tensor([nan, 1.1])},
                                                          {"e": torch.tensor([nan, 1.0])})
    assert disagreement({"e": torch.tensor([-float("inf")])}, {"e": torch.tensor([float("inf")])}) is not None
    assert nonfinite({"e": torch.tensor([nan]), "f": torch.ones(2), "n": torch.tensor([1])}) == ["['e']"]


def test_nan_in_dead_rows_is_a_padding_defect_not_a_compiler_bug(caplog: pytest.LogCaptureFixture) -> None:
    """Before: the check counted the eager step's own NaN in dead rows as a
    disagreement, blamed the compiler and ran every caps eager (SevenNet-0)."""
    model = _NonFinite("dead")
    wrapped = padded_model(model, backend="aot_eager", cap_policy="headroom")
    with caplog.at_level(logging.WARNING, logger="ddpad"):
        for data in trajectory(6, (1, 3), seed=3):
            out, ref = wrapped(data), _reference(model, data)
            assert torch.isfinite(out["node_energy"]).all()
            assert_same(out, ref)
    s = wrapped.stats
    assert s.checks == 1 + s.growth_calls == s.dead_nonfinite
    assert s.disagreements == s.eager_forms == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "dead rows only (['node_energy'])" in lines[0] and "not a compiler bug" in lines[0]
    assert "report it to PyTorch" not in lines[0]
    assert "with NaN or inf in dead rows" in checks_line(s)


def test_nan_in_a_real_row_is_an_error_naming_the_output() -> None:
    """Before: a warning blamed the compiler and the NaN was returned."""
    wrapped = padded_model(_NonFinite("real"), backend="aot_eager")
    with pytest.raises(FloatingPointError, match=r"NaN or inf in real rows \(\['node_energy'\]\).*not a compiler"):
        wrapped(trajectory(1, 1, seed=5)[0])
    assert wrapped.stats.eager_forms == 0
