"""The fixed-shape compiled forward (issue: pad, compile, unpad, restore)."""

from __future__ import annotations

import json
import logging
import pathlib
import re
import warnings
from typing import Any

import pytest
import torch

import ddpad
from _mpnn import CUTOFF, MPNN, trajectory
from ddpad import PaddedModel, RecompileError, ShrinkPolicy
from ddpad.padding import COOPadder, Fill

KEYS = ("energy", "node_energy", "forces", "stress")


def padder(cls: type[COOPadder] = COOPadder) -> COOPadder:
    return cls(
        CUTOFF,
        atom_fields={"node_attrs": 0.0},
        edge_fields={"unit_shifts": Fill.DEAD_UNIT_SHIFT},
        system_fields={"cell": Fill.DEAD_CELL},
        atom_outputs=("forces", "node_energy"),
        system_outputs=("energy", "stress"),
    )


def padded_model(model: torch.nn.Module, **kw: object) -> PaddedModel:
    # unit_shifts are the only shift field: self-loop made from DEAD_UNIT_SHIFT needs DEAD_SHIFT;
    # this model recomputes shifts from unit_shifts, so the anchor pair is used.
    return PaddedModel(model, padder(), **kw)  # type: ignore[arg-type]


def assert_same(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], atol: float = 1e-10) -> None:
    assert out.keys() == ref.keys()
    for key in ref:
        assert out[key].shape == ref[key].shape and out[key].dtype == ref[key].dtype, key
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=atol, msg=key)


def check_compiles(model: PaddedModel) -> None:
    stats = model.stats
    growth_calls = {e.call for e in stats.growths}
    assert stats.max_graphs_per_frame == 1 + len(growth_calls)
    assert set(stats.graphs_by_call) <= {0} | growth_calls  # nothing compiles without a growth
    assert stats.unexplained == []


@pytest.mark.parametrize("n_systems", [1, (2, 4)], ids=["one-system", "2-4-systems"])
def test_200_steps_exact_and_one_graph_per_growth(n_systems: int | tuple[int, int]) -> None:
    model = MPNN()
    wrapped = padded_model(model, backend="aot_eager", on_recompile="raise")
    steps = trajectory(200, n_systems, seed=1)
    n_atoms = [d["positions"].shape[0] for d in steps]
    n_edges = [d["edge_index"].shape[1] for d in steps]
    assert max(n_atoms) / min(n_atoms) > 1.1 and max(n_edges) / min(n_edges) > 1.25
    for data in steps:
        ref = model({k: v.clone() for k, v in data.items()})
        assert_same(wrapped(data), ref)
    check_compiles(wrapped)
    assert wrapped.stats.calls == 200 and 0 < len(wrapped.stats.growths) < 10
    assert set(wrapped.stats.fill) == {"atoms", "edges", "systems"}
    assert all(0 < f <= 1 for f in wrapped.stats.fill.values())
    assert wrapped.stats.pad_seconds > 0


def test_call_options_pass_through_and_growth_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    model = MPNN()
    # (headroom: under compile=False's default, cap_policy="tight", a first growth fits every cap instead)
    wrapped = padded_model(model, compile=False, cap_policy="headroom")
    small, big = trajectory(1, 1, seed=2, n0=20)[0], trajectory(1, 3, seed=3, n0=60)[0]
    with caplog.at_level(logging.INFO, logger="ddpad"):
        wrapped(small)
        out = wrapped(big, compute_stress=False)
    assert "stress" not in out
    assert_same(out, model({k: v.clone() for k, v in big.items()}, compute_stress=False))
    assert "atoms" in caplog.text and "expect one recompile" in caplog.text
    event = wrapped.stats.growths[0]
    assert event.call == 1 and event.new > event.old and event.real <= event.new


def test_strict_mode_names_an_unexplained_recompile() -> None:
    model = MPNN()
    wrapped = padded_model(model, backend="eager", on_recompile="raise")
    data = trajectory(1, 1, seed=4)[0]
    wrapped(data)
    wrapped(data)
    as_float = dict(data, node_attrs=data["node_attrs"].float().double().requires_grad_(True))
    with pytest.raises(RecompileError, match="no cap changed.*requires_grad|no cap changed.*node_attrs"):
        wrapped(as_float)


def test_default_mode_warns() -> None:
    wrapped = padded_model(MPNN(), backend="eager")
    data = trajectory(1, 1, seed=4)[0]
    wrapped(data)
    as_float = dict(data, node_attrs=data["node_attrs"].float().double().requires_grad_(True))
    with pytest.warns(RuntimeWarning, match="no cap changed"):
        wrapped(as_float)


def test_saved_caps_round_trip_compiles_once(tmp_path: pathlib.Path) -> None:
    model = MPNN()
    steps = trajectory(15, 1, seed=5, n0=30) + trajectory(15, (2, 3), seed=5)
    first = padded_model(model, backend="eager")
    for data in steps:
        first(data)
    assert first.stats.growths  # the cold run grew
    path = tmp_path / "caps.json"
    first.save_caps(path)
    doc = json.loads(path.read_text())
    assert doc["caps"] == first.caps and doc["format"] == "ddpad-caps/1"

    warm = padded_model(model, backend="eager", caps=path, on_recompile="raise")
    for data in steps:
        warm(data)
    assert warm.stats.growths == [] and set(warm.stats.graphs_by_call) == {0}
    assert warm.caps == first.caps
    with pytest.raises(ValueError, match="positive integer"):
        padded_model(model, caps={"atoms": 0})
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a ddpad caps file"):
        padded_model(model, caps=tmp_path / "bad.json")


def test_steady_state_reuses_padding_buffers() -> None:
    model = MPNN()
    seen: list[dict[str, int]] = []

    class Spy(torch.nn.Module):
        def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            seen.append({k: v.data_ptr() for k, v in data.items() if v.numel() >= 16})
            return model(data)

    wrapped = padded_model(Spy(), compile=False, caps={"atoms": 64, "edges": 4096, "systems": 4})
    for data in trajectory(10, 1, seed=6):
        wrapped(data)
    assert wrapped.stats.growths == []
    assert all(ptrs == seen[0] for ptrs in seen[1:])
    assert wrapped.stats.last_pad_allocations == 0 and wrapped.stats.pad_allocations == len(seen[0]) + 1  # + ptr
    grown = trajectory(1, 3, seed=7, n0=60)[0]  # a growth reallocates
    wrapped(grown)
    assert wrapped.stats.growths and wrapped.stats.last_pad_allocations > 0
    assert {"positions", "edge_index", "node_attrs", "unit_shifts", "batch"} <= set(seen[0])


def test_gradients_reach_a_caller_tensor_that_requires_grad() -> None:
    model = MPNN()
    wrapped = padded_model(model, compile=False)
    data = trajectory(1, 1, seed=7)[0]
    attrs = data["node_attrs"].clone().requires_grad_(True)
    out = wrapped(dict(data, node_attrs=attrs))
    out["energy"].sum().backward()
    ref_attrs = data["node_attrs"].clone().requires_grad_(True)
    model(dict(data, node_attrs=ref_attrs))["energy"].sum().backward()
    torch.testing.assert_close(attrs.grad, ref_attrs.grad, rtol=0, atol=1e-10)


def test_restore_runs_when_the_model_raises() -> None:
    class Boom(torch.nn.Module):
        def forward(self, data: dict[str, torch.Tensor]) -> None:
            data["positions"].requires_grad_(True)
            raise RuntimeError("model failed")

    p = padder()
    wrapped = PaddedModel(Boom(), p, compile=False)
    with pytest.raises(RuntimeError, match="model failed"):
        wrapped(trajectory(1, 1, seed=8)[0])
    assert not any(buf.requires_grad for buf in p._buffers.values())


def test_shrink_after_long_low_fill_then_recompile_is_explained(caplog: pytest.LogCaptureFixture) -> None:
    model = MPNN()
    big = trajectory(1, 4, seed=9, n0=60)[0]
    small = trajectory(12, 1, seed=10, n0=20)
    # (when_it_pays=False: five 1 ms steps never pay for a compile; the recompile's explanation is the subject)
    wrapped = padded_model(model, backend="eager", on_recompile="raise",
                           shrink=ShrinkPolicy(below=0.5, after=5, when_it_pays=False))
    wrapped(big)
    caps_big = wrapped.caps
    with caplog.at_level(logging.INFO, logger="ddpad"):
        for data in small:
            assert_same(wrapped(data), model({k: v.clone() for k, v in data.items()}))
    assert wrapped.stats.shrinks and all(e.new < e.old for e in wrapped.stats.shrinks)
    # the recompile at the shrunk caps says so, as a shrink (not "caps grew")
    shrunk = ", ".join(f"{e.key} {e.old} -> {e.new}" for e in wrapped.stats.shrinks)
    assert f"caps shrank ({shrunk}): compiling or loading the graph" in caplog.text, caplog.text
    assert wrapped.caps["atoms"] < caps_big["atoms"] and wrapped.caps["edges"] < caps_big["edges"]
    assert wrapped.stats.unexplained == []
    with pytest.raises(ValueError, match="below"):
        ShrinkPolicy(below=1.5)


def test_wrap_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="on_recompile"):
        padded_model(MPNN(), on_recompile="explode")
    with pytest.raises(TypeError, match="GraphPadder"):
        PaddedModel(MPNN(), object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="compile=False"):
        padded_model(MPNN(), compile=False, backend="eager")


def test_an_unknown_wrap_keyword_is_a_type_error_naming_the_closest() -> None:
    """Before: a typo went to torch.compile, failed late inside Dynamo (or,
    with compile=False, not at all) and entered the store's key."""
    with pytest.raises(TypeError, match=r"unexpected keyword 'cap_polcy': did you mean 'cap_policy'\?"):
        padded_model(MPNN(), compile=False, cap_polcy="tight")
    with pytest.raises(TypeError, match=r"'fulgraph': did you mean 'fullgraph'"):
        padded_model(MPNN(), backend="eager", fulgraph=True)
    with pytest.raises(TypeError, match="compile_kwargs must be a mapping"):
        padded_model(MPNN(), backend="eager", compile_kwargs="dynamic=False")
    wrapped = padded_model(MPNN(), backend="eager", compile_kwargs={"dynamic": False, "fullgraph": False})
    assert dict(wrapped.options.compile_kwargs) == {"backend": "eager", "dynamic": False, "fullgraph": False}
    data = trajectory(1, 1, seed=4)[0]
    assert_same(wrapped(data), MPNN()({k: v.clone() for k, v in data.items()}))


def test_an_adapters_inductor_options_go_under_the_callers() -> None:
    """``Adapter.inductor_options`` (orb's ``cpp.dynamic_threads``) reach
    ``torch.compile(options=...)`` when Inductor compiles, under the
    caller's own ``options=``; another backend gets none."""
    import dataclasses

    import ddpad_toy_plugin as toy

    adapter = dataclasses.replace(toy.ADAPTER, inductor_options={"cpp.dynamic_threads": True, "max_autotune": False})
    model = toy.Morse(3.0).double()
    assert ddpad.wrap(model, adapter).options.compile_kwargs["options"] == {"cpp.dynamic_threads": True,
                                                                            "max_autotune": False}
    mine = ddpad.wrap(model, adapter, options={"max_autotune": True}).options.compile_kwargs["options"]
    assert mine == {"cpp.dynamic_threads": True, "max_autotune": True}
    assert "options" not in ddpad.wrap(model, adapter, backend="aot_eager").options.compile_kwargs
    assert "options" not in ddpad.wrap(model, toy.ADAPTER).options.compile_kwargs


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_short_run_one_graph_per_frame() -> None:
    model = MPNN(width=8)
    steps = trajectory(12, 1, seed=11, n0=24)
    wrapped = padded_model(model, backend="inductor", on_recompile="raise",
                           caps={"atoms": 48, "edges": 2048, "systems": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for data in steps:
            assert_same(wrapped(data), model({k: v.clone() for k, v in data.items()}), atol=1e-9)
    assert set(wrapped.stats.graphs_by_call) == {0} and wrapped.stats.max_graphs_per_frame == 1
    assert wrapped.stats.growths == []


class SeamModel(torch.nn.Module):
    """A model that pads at its own seam, as UMA-style models do: eager
    preprocessing, then the active context's padder, then the core that the
    adapter compiles (``compile_region``)."""

    def __init__(self) -> None:
        super().__init__()
        self.core = MPNN()

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        data = dict(data, positions=data["positions"] * 1.0)  # eager work before the seam
        return self.core(ddpad.padding.current_dd_context().maybe_pad_graph(data))


def compile_core(model: SeamModel, compile_fn: Any) -> SeamModel:
    model.core = compile_fn(model.core)
    return model


@pytest.mark.parametrize("warm", [0, 3], ids=["growths", "warm-ladder"])
def test_pad_in_forward_through_the_context(warm: int) -> None:
    model = SeamModel()
    plain = model.core
    wrapped = PaddedModel(model, padder(), pad_in_forward=True, backend="eager", on_recompile="raise",
                          compile_region=compile_core, warm_ladder=warm)
    for data in trajectory(30, (1, 3), seed=13):
        ref = plain({k: v.clone() for k, v in data.items()})
        assert_same(wrapped(data), ref)
        assert ddpad.padding.current_dd_context() is ddpad.padding.NOT_DISTRIBUTED  # restored after the call
    stats = wrapped.stats
    assert stats.growths and set(wrapped.caps) == {"atoms", "edges", "systems"}
    if not warm:
        check_compiles(wrapped)
        return
    # the rungs warmed through the seam's context; the growths of the system
    # count (which rungs keep as it is) compile, the others take a rung
    assert stats.rungs_warmed == 3 and stats.rungs_used >= 1 and stats.unexplained == []
    assert stats.max_graphs_per_frame == 1 + 3 + stats.fit_calls + stats.growth_calls - stats.rungs_used


def test_public_wrap_with_adapter_object() -> None:
    from ddpad.adapters import Adapter, EngineHooks

    adapter = Adapter(
        name="mpnn", make_padder=lambda m: padder(), energy_key="energy", atom_outputs=("forces", "node_energy"),
        system_outputs=("energy", "stress"), cutoff=lambda m: CUTOFF, engine=EngineHooks(build_input=lambda m, a: a),
        install_hint="(tests)",
    )
    model = MPNN()
    data = trajectory(1, 2, seed=12)[0]
    for wrapped in (ddpad.wrap(model, adapter, compile=False), adapter.wrap(model, compile=False)):
        assert isinstance(wrapped, torch.nn.Module)
        assert_same(wrapped(data), model({k: v.clone() for k, v in data.items()}))


def test_counting_backend_survives_deepcopy() -> None:
    """Lightning (imported by nequip) deep-copies compile arguments: the
    counting backend must copy, not recurse."""
    import copy

    backend = ddpad.padding.counting_backend(ddpad.Stats(), "eager")
    assert copy.deepcopy(backend) is backend  # compiles still count into the same stats
    assert copy.deepcopy({"backend": backend})["backend"] is backend
    fresh = type(backend).__new__(type(backend))  # how copy and pickle probe an instance
    with pytest.raises(AttributeError):
        fresh.inner


def test_growth_past_dynamos_recompile_limit_still_compiles() -> None:
    """Every cap set is one cache entry of the model's frame: past Dynamo's
    default limit of 8 a growing run fell back to eager without a word."""
    from _mpnn import batch_of, system

    model = MPNN()
    wrapped = padded_model(model, backend="aot_eager", on_recompile="raise")
    gen = torch.Generator().manual_seed(0)
    n = 4
    while n < 400:  # each size overflows the last one's caps: about 12 growths
        data = batch_of([system(n, (n / 0.12) ** (1 / 3), 3, gen)])
        assert_same(wrapped(data), model({k: v.clone() for k, v in data.items()}))
        n = int(n * 1.45) + 1
    assert len({e.call for e in wrapped.stats.growths}) > torch._dynamo.config.recompile_limit
    check_compiles(wrapped)


def test_a_compile_announces_itself_through_the_ddpad_logger(caplog: pytest.LogCaptureFixture) -> None:
    """The Python API printed nothing while it compiled (19 minutes of
    silence on a loaded machine): the first call and each growth say, at
    INFO on the ``ddpad`` logger, the caps they compile at and what they
    compiled or loaded, with the seconds; a steady call says nothing."""
    steps = trajectory(30, 1, seed=3)
    wrapped = padded_model(MPNN(), backend="aot_eager")
    with caplog.at_level(logging.INFO, logger="ddpad"):
        wrapped(steps[0])
    first = caplog.text
    assert "first call at caps {" in first and ": compiling or loading the graph" in first
    assert re.search(r"first call at caps \{.*\}: compiled \d+ graphs? in [\d.]+ s.* \([\d.]+ s in all\)", first)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ddpad"):
        wrapped(steps[0])
    assert "compil" not in caplog.text


def test_a_fit_says_fitted_and_a_growth_grew(caplog: pytest.LogCaptureFixture) -> None:
    """A tight fit that shrank every cap was announced as "caps grew": the
    fitting call says "caps fitted", a later growth "caps grew", each with
    its caps old -> new."""
    steps = trajectory(30, 1, seed=3)
    wrapped = padded_model(MPNN(), backend="aot_eager", cap_policy=ddpad.TightPolicy(settle=2), verify=False)
    with caplog.at_level(logging.INFO, logger="ddpad"):
        wrapped(steps[0])
        wrapped(steps[0])  # the window's last call: fits the caps
        fitted = wrapped.stats.fits
        wrapped(trajectory(1, 2, seed=4, n0=80)[0])  # more atoms and systems than the fitted caps hold
    text = caplog.text
    assert fitted and f"caps fitted ({fitted[0].key} {fitted[0].old} -> {fitted[0].new}" in text, text
    grown = wrapped.stats.growths
    assert grown and f"caps grew ({grown[0].key} {grown[0].old} -> {grown[0].new}" in text, text
    assert text.count("caps grew") == 1


def test_a_logging_handler_hears_each_compile_as_an_event() -> None:
    """The compile announcement is a hook of the library: a handler on the
    ``ddpad`` logger gets a :class:`ddpad.CompileEvent` on each record (what
    ``ddpad run`` prints from), start and done, naming the kind of call and
    its caps; a steady call sends none, nor does a call of a tight sizing's
    window (it runs the eager step: nothing compiles before the fit)."""
    events: list[ddpad.CompileEvent] = []

    class Hear(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if hasattr(record, "ddpad_compile"):
                events.append(record.ddpad_compile)

    logger = logging.getLogger("ddpad")
    handler, level = Hear(level=logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        wrapped = padded_model(MPNN(), backend="aot_eager", cap_policy=ddpad.TightPolicy(settle=2), verify=False)
        steps = trajectory(30, 1, seed=3)
        wrapped(steps[0])  # the window: eager
        wrapped(steps[0])  # fits the caps: the first compile
        wrapped(steps[0])
        wrapped(trajectory(1, 2, seed=4, n0=80)[0])  # grows them
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [(e.phase, e.kind) for e in events] == [
        ("start", "fitted"), ("done", "fitted"), ("start", "grew"), ("done", "grew")], events
    assert events[0].caps and events[-1].caps == dict(wrapped.cap_state)
    assert events[0].change and wrapped.stats.fits[0].key in events[0].change
    assert wrapped.stats.settling_steps == 1
    assert all(e.built == "graph" for e in events)


def test_caps_changes_are_named_by_what_they_did() -> None:
    from ddpad._stats import caps_changed

    before = {"atoms": 80, "systems": 4}
    assert caps_changed(before, {"atoms": 65, "systems": 2}, True) == "fitted (atoms 80 -> 65, systems 4 -> 2)"
    assert caps_changed(before, {"atoms": 65, "systems": 2}, False) == "shrank (atoms 80 -> 65, systems 4 -> 2)"
    assert caps_changed(before, {"atoms": 96, "systems": 4}, False) == "grew (atoms 80 -> 96)"


def test_a_long_compile_is_shown_on_stderr_where_no_logging_is_configured(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's snippet printed nothing for 7 minutes while it compiled
    (the notice was an INFO record nothing showed): where the application
    configured no logging, a call still compiling after ``NOTICE_AFTER``
    seconds says so on stderr (the first time with how to silence it) and
    says what it did when it ends; the silencing line silences it, and an
    application's own logging set-up takes over."""
    from ddpad import _noise

    own = logging.getLogger("ddpad")
    monkeypatch.setattr(own, "propagate", False)  # (pytest's own handlers on the root logger: not the app's)
    monkeypatch.setattr(own, "handlers", list(own.handlers))
    monkeypatch.setattr(_noise, "NOTICE_AFTER", 0.0)
    monkeypatch.setattr(_noise._STDERR, "hinted", False)
    steps = trajectory(3, 1, seed=3)
    padded_model(MPNN(), backend="aot_eager")(steps[0])
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("ddpad: first call at caps {") and err[0].endswith(
        f": compiling or loading the graph… ({_noise.SILENCE} silences these notices)"), err
    assert re.match(r"ddpad: first call at caps \{.*\}: compiled \d+ graphs? in ", err[1]), err
    assert len(err) == 2
    monkeypatch.setattr(own, "level", logging.WARNING)  # the silencing line
    padded_model(MPNN(), backend="aot_eager")(steps[0])
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(own, "level", logging.NOTSET)
    monkeypatch.setattr(own, "handlers", [*own.handlers, logging.NullHandler()])  # the application's
    padded_model(MPNN(), backend="aot_eager")(steps[0])
    assert capsys.readouterr().err == ""


def test_a_compiling_call_silences_torchs_pytree_deprecation() -> None:
    """``FutureWarning: isinstance(treespec, LeafSpec) is deprecated`` came
    out of a first call (torch copying a tree spec while it exports or
    compiles): silenced inside a call that may compile, not on a steady one."""
    import copy

    from torch.utils import _pytree

    _, spec = _pytree.tree_flatten({"a": 1})

    def call(compiled: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        copy.deepcopy(spec)  # what torch's export does on the way to a package
        return compiled(data, *args, **kwargs)

    steps = trajectory(3, 1, seed=3)
    wrapped = PaddedModel(MPNN(), padder(), call=call, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped(steps[0])
        assert not [w for w in caught if "LeafSpec" in str(w.message)]
        wrapped(steps[0])  # a steady call: outside ddpad's scope, the user's filters rule
    assert [w for w in caught if "LeafSpec" in str(w.message)]


def test_known_third_party_noise_is_silenced_inside_ddpads_own_scopes(capsys: pytest.CaptureFixture[str]) -> None:
    """About 12 third-party warnings and banners came out of a plain
    ``wrap`` (e3nn, mace, TorchScript); those ddpad triggers itself (here:
    preparing the model) are silenced there, and only there."""
    import dataclasses

    toy = pytest.importorskip("ddpad_toy_plugin")

    def noisy_prepare(model: torch.nn.Module) -> torch.nn.Module:
        warnings.warn("To copy construct from a tensor, it is recommended to use sourceTensor.detach().clone()",
                      UserWarning, stacklevel=1)
        warnings.warn("something the user should see", UserWarning, stacklevel=1)
        print("cuequivariance or cuequivariance_torch is not available. Cuequivariance acceleration will be disabled.")
        print("a line of the model's own")
        return model

    adapter = dataclasses.replace(toy.ADAPTER, prepare_model=noisy_prepare)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddpad.wrap(toy.Morse(), adapter, compile=False)
        warnings.warn("To copy construct from a tensor (outside ddpad)", UserWarning, stacklevel=1)
    messages = [str(w.message) for w in caught]
    assert messages == ["something the user should see", "To copy construct from a tensor (outside ddpad)"]
    out = capsys.readouterr().out
    assert "cuequivariance" not in out and "a line of the model's own" in out


class _OwnCaps(torch.nn.Module):
    """The MPNN, resolving caps of its own on a plain dict inside its forward
    (as a model holding a padder of its own, or a framework's, does)."""

    def __init__(self) -> None:
        super().__init__()
        self.mpnn = MPNN()
        self.own: dict[str, int] = {}

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ddpad.padding.resolve_caps(self.own, {"inner": (100, ddpad.padding.CapPolicy(1.0))})
        return self.mpnn(data)


def test_a_calls_scope_is_handed_to_its_padder_not_left_in_ambient_state() -> None:
    """The wrapper's ceilings, ready rungs, tight sizing and its record of
    resolutions reach its padder on the caps it hands over (``ScopedCaps``):
    a resolution the model makes of its own caps during the call is neither
    bounded by the wrapper's ceilings nor recorded as the wrapper's (before,
    the scope sat in context variables, and ``inner`` hit the wrapper's
    ceiling of 10)."""
    seen: list[object] = []

    class Seeing(COOPadder):
        def pad(self, data: Any, cap_state: dict[str, int], cap_atoms: bool = True) -> Any:
            seen.append(cap_state)
            return super().pad(data, cap_state, cap_atoms)

    model = _OwnCaps()
    wrapped = PaddedModel(model, padder(Seeing), compile=False, max_caps={"inner": 10, "atoms": 4096})
    for data in trajectory(3):
        assert_same(wrapped(data), model.mpnn({k: v.clone() for k, v in data.items()}))
    assert model.own == {"inner": 112}  # its own bucket, past the wrapper's ceiling
    assert {r.key for r in wrapped.last_resolutions} == {"atoms", "edges", "systems"}
    assert all(isinstance(caps, ddpad.padding.ScopedCaps) and caps.scope.ceilings["inner"] == 10 for caps in seen)
