"""The conformance kit: one test suite for every ddpad adapter, built-in or plugin.

Like the base test classes a table library gives the authors of its
extension types, a model package that ships a ddpad adapter writes one test
class and inherits every check::

    import pytest, torch
    from ddpad.testing import AdapterTests

    class TestMyModel(AdapterTests):
        adapter = "mymodel"          # a registered name or an Adapter
        dtype = torch.float64
        atol = 1e-10                 # against the unpadded eager model

        @pytest.fixture
        def model(self):             # default: adapter.tools.random_model(dtype, "cpu")
            ...

        @pytest.fixture
        def trajectory(self):        # default: made from adapter.tools.default_system()
            return [...]             # ase.Atoms or lists of them, counts changing

        @pytest.fixture
        def foundation_models(self): # default: adapter.tools.foundation_models()
            return {"my-model-1": lambda: load("my-model-1.pt")}   # the configurations users run

        @pytest.fixture
        def foundation_structures(self): # default: the trajectory's first three single structures
            return [...]

Each check is also a function (``check_exact``, ``check_follows_weights``, ``check_dead_rows``,
``check_call_forms``, ``check_autograd``, ``check_engine_hooks``, ``check_empty_rejected``,
``check_torchsim``, ``check_tensor_input``, ``check_tight``, ``check_aot``, ``check_real_model``) for use
outside pytest classes. Needs pytest and ase;
the torch-sim check runs where torch-sim is installed and is skipped
(saying so) where it is not.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from ._padded import PaddedModel
from ._version import install_command
from ._registry import resolve_adapter

__all__ = [
    "AdapterTests",
    "PoisonedPadder",
    "check_aot",
    "check_autograd",
    "check_call_forms",
    "check_dead_rows",
    "check_empty_rejected",
    "check_engine_hooks",
    "check_exact",
    "check_follows_weights",
    "check_graphs",
    "check_real_model",
    "check_tensor_input",
    "check_tight",
    "check_torchsim",
    "default_trajectory",
]


def _tensors(output: Mapping[str, Any]) -> dict[str, Tensor]:
    return {k: v for k, v in output.items() if isinstance(v, Tensor)}


def _compare(out: Mapping[str, Any], ref: Mapping[str, Any], *, atol: float, rtol: float, where: str) -> float:
    """Assert the same tensor keys, shapes and dtypes, and values within
    tolerance; return the largest absolute deviation."""
    got, want = _tensors(out), _tensors(ref)
    assert got.keys() == want.keys(), f"{where}: keys {sorted(got)} != eager {sorted(want)}"
    worst = 0.0
    for key, value in want.items():
        assert got[key].shape == value.shape, f"{where}: {key} shape {tuple(got[key].shape)} != eager {tuple(value.shape)}"
        assert got[key].dtype == value.dtype, f"{where}: {key} dtype {got[key].dtype} != eager {value.dtype}"
        assert torch.isfinite(got[key]).all(), f"{where}: {key} has non-finite values"
        torch.testing.assert_close(got[key].detach(), value.detach(), atol=atol, rtol=rtol, msg=lambda m, key=key: f"{where}: {key}: {m}")
        if value.numel():
            worst = max(worst, float((got[key].detach() - value.detach()).abs().max()))
    return worst


def _options(adapter: Any) -> dict[str, Any]:
    return adapter.call_options(True)


def check_graphs(wrapped: PaddedModel) -> None:
    """Compiled graphs are one plus one per growth (or fit) call (per compiled frame),
    nothing compiles on a call that grew no cap, and no recompile went
    unexplained."""
    stats = wrapped.stats
    growth_calls = {e.call for e in [*stats.growths, *stats.fits]}  # (a tight fit compiles as a growth does)
    assert stats.max_graphs_per_frame == 1 + len(growth_calls), (
        f"{stats.graphs_per_frame} graphs per frame for {len(growth_calls)} growth calls"
    )
    assert set(stats.graphs_by_call) <= {0} | growth_calls, f"compiles on calls {sorted(stats.graphs_by_call)}"
    assert stats.unexplained == []


def check_exact(
    adapter: Any, model: torch.nn.Module, trajectory: Sequence[Any], *,
    atol: float, rtol: float = 0.0, backend: str = "aot_eager", **wrap_kwargs: Any,
) -> tuple[PaddedModel, float]:
    """Run ``trajectory`` through the padded, compiled model (strict mode) and
    compare every output with the unpadded eager model's; check the graph
    count. Returns the wrapped model and the largest deviation seen."""
    adapter = resolve_adapter(adapter)
    wrapped = adapter.wrap(model, backend=backend, on_recompile="raise", **wrap_kwargs)
    build = adapter.input_builder(model)
    options = _options(adapter)
    worst = 0.0
    for step, structure in enumerate(trajectory):
        data = build(structure)
        ref = adapter.flat(adapter.reference(model, data, **options))
        out = adapter.flat(wrapped(data, **options))
        worst = max(worst, _compare(out, ref, atol=atol, rtol=rtol, where=f"step {step}"))
    check_graphs(wrapped)
    return wrapped, worst


def check_follows_weights(
    adapter: Any, model: torch.nn.Module, structure: Any, *, atol: float, rtol: float = 0.0,
    backend: str = "aot_eager", scale: float = 1.1,
) -> PaddedModel:
    """What the user holds is what runs: after the wrapped model's first call
    the weights of ``model`` (the object the user holds) change three ways,
    and each next call equals the changed model's unpadded eager output:
    every parameter scaled in place (an optimizer step's kind of change),
    ``load_state_dict`` back to the first weights (copied in place), and
    ``load_state_dict(..., assign=True)`` of scaled weights (new tensors: an
    adapter's prepared copy is prepared again, with a warning). Returns the
    wrapped model."""
    adapter = resolve_adapter(adapter)
    wrapped = adapter.wrap(model, backend=backend)
    build = adapter.input_builder(model)
    options = _options(adapter)

    def same(where: str) -> None:
        data = build(structure)
        ref = adapter.flat(adapter.reference(model, data, **options))
        _compare(adapter.flat(wrapped(data, **options)), ref, atol=atol, rtol=rtol, where=where)

    same("first call")
    first = {key: value.detach().clone() for key, value in model.state_dict().items()}
    parameters = {name for name, _ in model.named_parameters()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(scale)
    same("after every parameter was scaled in place")
    model.load_state_dict(first)
    same("after load_state_dict")
    model.load_state_dict({key: value * scale if key in parameters else value for key, value in first.items()},
                          assign=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the notice that the copy was prepared again)
        same("after load_state_dict(assign=True)")
    return wrapped


def check_real_model(
    adapter: Any, model: torch.nn.Module, structures: Sequence[Any], *, atol: float, rtol: float = 0.0,
    backend: str = "aot_eager", **wrap_kwargs: Any,
) -> PaddedModel:
    """A configuration users run (:attr:`ToolHooks.foundation_models`) through
    the padded model compiled by ``backend``, every graph checked on its
    first use: each structure's outputs equal the unpadded eager model's
    and are finite; no padded output row held NaN or inf, dead rows
    included (the first-use checks saw each caps' padded outputs:
    ``stats.dead_nonfinite == 0``); and the compiled route answered every
    caps (``stats.eager_forms == 0``), one graph plus one per growth.
    Returns the wrapped model."""
    adapter = resolve_adapter(adapter)
    wrapped, _ = check_exact(adapter, model, structures, atol=atol, rtol=rtol, backend=backend, **wrap_kwargs)
    stats = wrapped.stats
    assert stats.checks >= 1, "no compiled graph was checked on its first use"
    assert stats.dead_nonfinite == 0, (
        f"{stats.dead_nonfinite} padded step(s) held NaN or inf in dead rows: the padding is not inert on "
        "this configuration (see the warning)")
    assert stats.eager_forms == 0 and stats.disagreements == 0, (
        f"{stats.eager_forms} caps ran eager, {stats.disagreements} check(s) disagreed: the compiled route "
        "was not taken (see the warnings)")
    return wrapped


def check_tight(
    adapter: Any, model: torch.nn.Module, trajectory: Sequence[Any], *, atol: float, rtol: float = 0.0,
) -> PaddedModel:
    """``trajectory`` through the padded model under ``cap_policy="tight"``
    (fitted after two calls, so the rest of the trajectory runs at fitted
    caps and grows from them), compared with the unpadded eager model at
    every step. Not compiled: what tight caps change is how few dead rows
    there are, which the padding alone decides. Returns the wrapped model."""
    from ._capacity import TightPolicy

    adapter = resolve_adapter(adapter)
    # (changing=inf: fitted however much the trajectory's counts swing, for fitted caps are what is checked;
    # sevennet's trajectory doubles its atoms in the window)
    wrapped = adapter.wrap(model, compile=False, cap_policy=TightPolicy(settle=2, changing=math.inf))
    build = adapter.input_builder(model)
    options = _options(adapter)
    for step, structure in enumerate(trajectory):
        data = build(structure)
        ref = adapter.flat(adapter.reference(model, data, **options))
        out = adapter.flat(wrapped(data, **options))
        _compare(out, ref, atol=atol, rtol=rtol, where=f"step {step} (tight caps)")
    assert wrapped.stats.fit_calls == 1, f"the caps were not fitted: {wrapped.stats.fits}"
    return wrapped


def check_aot(
    adapter: Any, model: torch.nn.Module, trajectory: Sequence[Any], *, atol: float, rtol: float = 0.0,
    store: Any = None, forms: bool = True, poison_scale: float = 1.0e3,
) -> dict[str, Any]:
    """The exactness, dead-row and call-form checks through
    ``compile_mode="aot"``: ``trajectory`` at one set of caps (the
    trajectory's own, sized first without compiling, so one package serves
    every step), each step against the unpadded eager model; its first
    structure again with poisoned dead rows (the same package, loaded: the
    outputs may not change by more than the eager model's own run-to-run
    noise, or 8 ulps of the output's size, what a package's parallel
    reductions vary by between calls); with ``forms``, every call form of the adapter (one package
    each). A form the route refuses runs on ``torch.compile`` and is checked
    the same way. Returns ``{"refused": {form: reason}, "packages": built +
    loaded, "worst": largest deviation, "build_s": seconds}``; ``store``: a
    compile store's folder (default: a temporary one)."""
    import tempfile

    adapter = resolve_adapter(adapter)
    build = adapter.input_builder(model)
    options = _options(adapter)
    sizing = adapter.wrap(model, compile=False, cap_policy="headroom")
    for structure in trajectory:
        sizing(build(structure), **options)
    with tempfile.TemporaryDirectory(prefix="ddpad-kit-aot-") as tmp:
        common = {"compile_mode": "aot", "compile_cache": store if store is not None else tmp, "caps": sizing.caps,
                  "cap_policy": "headroom", "backend": "inductor", "aot_build": "foreground"}
        wrapped = adapter.wrap(model, **common)
        worst, first = 0.0, None
        for step, structure in enumerate(trajectory):
            out = adapter.flat(wrapped(build(structure), **options))
            ref = adapter.flat(adapter.reference(model, build(structure), **options))
            worst = max(worst, _compare(out, ref, atol=atol, rtol=rtol, where=f"step {step} (compile_mode='aot')"))
            first = _tensors(out) if first is None else first
        assert wrapped.caps == sizing.caps, f"the caps grew under preset caps: {sizing.caps} -> {wrapped.caps}"
        assert first is not None, "an empty trajectory"
        noise = check_dead_rows(adapter, model, trajectory[0], scale=poison_scale)
        poisoned_padder = PoisonedPadder(adapter.make_padder(model), scale=poison_scale)
        poisoned = adapter.wrap(model, padder=poisoned_padder, **common)
        got = _tensors(adapter.flat(poisoned(build(trajectory[0]), **options)))
        assert poisoned_padder.poisoned > 0, "no dead atom rows to poison: the trajectory's first structure fills its caps"
        for key, value in first.items():
            deviation = float((got[key].detach() - value.detach()).abs().max()) if value.numel() else 0.0
            # a package's parallel reductions (more than one thread) round differently from call to
            # call: a few ulps of the output's size are noise, a leak of 1e3-sized poison is not
            ulps = 8 * torch.finfo(value.dtype).eps * float(value.detach().abs().max()) \
                if value.is_floating_point() and value.numel() else 0.0
            assert torch.isfinite(got[key]).all() and deviation <= max(4 * noise[key], ulps), (
                f"{key} changed with the dead rows' content through the package: {deviation:.3g} "
                f"(the eager model's run-to-run noise {noise[key]:.3g}, 8 ulps of the output {ulps:.3g})")
        if forms:
            for form in adapter.call_forms:
                out = adapter.flat(wrapped(build(trajectory[0]), **form))
                ref = adapter.flat(adapter.reference(model, build(trajectory[0]), **form))
                worst = max(worst, _compare(out, ref, atol=atol, rtol=rtol, where=f"call form {form} (aot)"))
        refused = {} if wrapped.manager.aot is not None else {"every form": "the model pads at its own seam inside its forward"}
        for route in (wrapped, poisoned):
            refused.update({str(form): why for form, why in route.manager.refused.items()})
        s, p = wrapped.stats, poisoned.stats
        return {"refused": refused, "packages": s.aot_compiled + s.aot_loaded, "worst": worst,
                "build_s": s.aot_seconds, "checked": s.aot_checked + p.aot_checked,
                "loaded_by_second": p.aot_loaded}


class PoisonedPadder:
    """A padder that fills the dead atom rows of every floating-point per-atom field
    with large random values after the real padder ran: real outputs must not
    change by a bit. Everything else is the wrapped padder's."""

    def __init__(self, inner: Any, *, scale: float = 1.0e3, seed: int = 0) -> None:
        self.inner = inner
        self.scale = scale
        self.generator = torch.Generator().manual_seed(seed)
        self.poisoned = 0  # dead rows overwritten so far

    def pad(self, data: Any, cap_state: dict[str, int], cap_atoms: bool = True) -> Any:
        out = self.inner.pad(data, cap_state, cap_atoms)
        n, cap = self.inner.n_atoms, self.inner.caps[self.inner.atoms_key]
        end = cap - (1 if getattr(self.inner, "sentinel_row", False) else 0)  # the model's own pad row stays
        if out is None or end <= n:
            return out
        for value in _atom_fields(self.inner, out):
            if isinstance(value, Tensor) and value.is_floating_point() and value.dim() and value.shape[0] == cap:
                noise = torch.randn(end - n, *value.shape[1:], generator=self.generator, dtype=value.dtype)
                with torch.no_grad():
                    value[n:end] = noise.to(value.device) * self.scale
                self.poisoned += end - n
        return out

    def unpad(self, output: Any, n_real: int | None = None) -> Any:
        return self.inner.unpad(output, n_real)

    def __getattr__(self, name: str) -> Any:  # restore(), allocations, caps ...
        if name == "inner" or name.startswith("__"):  # a copy / pickle probe before __init__ ran
            raise AttributeError(name)
        return getattr(self.inner, name)


def _atom_fields(padder: Any, data: Any) -> list[Any]:
    """The per-atom fields the padder pads (its ``atom_fields`` and
    ``positions``); every atoms-cap-long field when it does not say (an
    edge field of the same length could then be hit: name them). A padder
    of a non-dict input offers ``flatten(data) -> {name: tensor}`` (sharing
    the tensors) so its fields can be found by the names it uses."""
    if callable(getattr(padder, "flatten", None)):
        fields = dict(padder.flatten(data))
    elif isinstance(data, Mapping):
        fields = dict(data)
    elif callable(getattr(data, "keys", None)):
        fields = {k: data[k] for k in data.keys()}  # noqa: SIM118 - not a dict
    else:
        fields = dict(vars(data))
    named = set(getattr(padder, "atom_fields", None) or ()) | {getattr(padder, "positions", None)}
    named.discard(None)
    return [fields[k] for k in named if k in fields] if named else list(fields.values())


def check_dead_rows(adapter: Any, model: torch.nn.Module, structure: Any, *, scale: float = 1.0e3, seed: int = 0) -> dict[str, float]:
    """Real outputs do not change, whatever the dead rows hold, and stay finite.

    Bit-identical where the model is deterministic; a model whose own repeated
    runs differ (parallel scatter sums, measured here by running it three
    times) may differ by at most four times that run-to-run noise. Returns the
    noise per output key.
    """
    adapter = resolve_adapter(adapter)
    build = adapter.input_builder(model)
    options = _options(adapter)
    plain = adapter.wrap(model, compile=False)
    runs = [_tensors(adapter.flat(plain(build(structure), **options))) for _ in range(3)]
    want = runs[0]
    noise = {k: max(float((r[k].detach() - v.detach()).abs().max()) if v.numel() else 0.0 for r in runs)
             for k, v in want.items()}
    poisoned_padder = PoisonedPadder(adapter.make_padder(model), scale=scale, seed=seed)
    poisoned = adapter.wrap(model, compile=False, padder=poisoned_padder)
    for _ in range(2):  # the second call reuses the padder's buffers
        got = _tensors(adapter.flat(poisoned(build(structure), **options)))
        assert poisoned_padder.poisoned > 0, "no dead atom rows to poison: pick a structure below the cap"
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.isfinite(got[key]).all(), f"{key}: non-finite values with poisoned dead rows"
            deviation = float((got[key].detach() - value.detach()).abs().max()) if value.numel() else 0.0
            assert deviation <= 4 * noise[key], (
                f"{key} changed with the dead rows' content: max deviation {deviation:.3g} "
                f"(the model's own run-to-run noise: {noise[key]:.3g})"
            )
    return noise


def check_call_forms(adapter: Any, model: torch.nn.Module, structure: Any, *, atol: float, rtol: float = 0.0,
                     backend: str = "aot_eager") -> None:
    """Every keyword set the model package's own drivers use works on the
    wrapped model and gives the eager results (strict mode: a new form may
    compile, a repeated one may not)."""
    adapter = resolve_adapter(adapter)
    wrapped = adapter.wrap(model, backend=backend, on_recompile="raise")
    build = adapter.input_builder(model)
    for form in (*adapter.call_forms, *adapter.call_forms):  # twice: the second pass compiles nothing
        data = build(structure)
        ref = adapter.flat(adapter.reference(model, data, **form))
        out = adapter.flat(wrapped(data, **form))
        _compare(out, ref, atol=atol, rtol=rtol, where=f"call form {form}")
    assert wrapped.stats.unexplained == []


def _get(data: Any, name: str) -> Tensor:
    return data[name] if isinstance(data, Mapping) else getattr(data, name)


def _set(data: Any, name: str, value: Tensor) -> None:
    if isinstance(data, Mapping):
        data[name] = value  # type: ignore[index]
    else:
        setattr(data, name, value)


def check_autograd(adapter: Any, model: torch.nn.Module, structure: Any, *, atol: float, rtol: float = 0.0,
                   backend: str = "aot_eager") -> None:
    """Forces by autograd of the returned energy with respect to the caller's
    positions (as with the native model) equal the eager forces."""
    adapter = resolve_adapter(adapter)
    if adapter.grad_input is None:
        pytest.skip(f"adapter {adapter.name!r} declares no grad_input")
    wrapped = adapter.wrap(model, backend=backend)
    build = adapter.input_builder(model)
    data = build(structure)
    ref = adapter.flat(adapter.reference(model, data))
    positions = _get(data, adapter.grad_input).detach().clone().requires_grad_(True)
    _set(data, adapter.grad_input, positions)
    out = adapter.flat(wrapped(data))
    (grad,) = torch.autograd.grad(out[adapter.flat_energy_key].sum(), positions)
    n = ref["forces"].shape[0]
    _compare({"forces": -grad[:n]}, {"forces": ref["forces"]}, atol=atol, rtol=rtol, where="autograd forces")


def check_engine_hooks(adapter: Any, model: torch.nn.Module, structure: Any, *, atol: float, rtol: float = 0.0,
                       backend: str = "aot_eager") -> None:
    """What the adapter's :class:`~ddpad.adapters.EngineHooks` declare for
    engines that split space holds for its model: ``message_layers`` is a
    count of at least 1, and the per-atom energies (``atom_energy_key``) of
    the energy-only forward (``energy_only_options``) on the wrapped model
    sum to the eager energy, their gradient with respect to
    ``positions_key`` (where one is declared) giving the eager forces: what
    the LAMMPS engine computes from them."""
    adapter = resolve_adapter(adapter)
    engine = adapter.engine
    if engine.message_layers is None and engine.atom_energy_key is None:
        pytest.skip(f"adapter {adapter.name!r} declares neither message_layers nor atom_energy_key")
    if engine.message_layers is not None:
        layers = engine.message_layers(model)
        assert type(layers) is int and layers >= 1, f"message_layers gave {layers!r}, not a count >= 1"
    if engine.atom_energy_key is None:
        return
    wrapped = adapter.wrap(model, backend=backend)
    data = adapter.input_builder(model)(structure)
    ref = adapter.flat(adapter.reference(model, data))
    positions = None  # no positions_key: the sum only (the engines that differentiate it refuse the model)
    if engine.positions_key is not None:
        positions = _get(data, engine.positions_key).detach().clone().requires_grad_(True)
        _set(data, engine.positions_key, positions)
    energies = wrapped(data, **engine.energy_only_options)[engine.atom_energy_key]
    got, want = {"energy": energies.detach().sum()}, {"energy": ref[adapter.flat_energy_key].detach().sum()}
    if positions is not None:
        (grad,) = torch.autograd.grad(energies.sum(), positions)
        got["forces"], want["forces"] = -grad[:ref["forces"].shape[0]], ref["forces"]
    _compare(got, want, atol=atol, rtol=rtol, where=f"energy-only per-atom energies ({engine.atom_energy_key!r})")


def check_torchsim(adapter: Any, model: torch.nn.Module, batches: Sequence[Sequence[Any]], *, atol: float,
                   rtol: float = 0.0, backend: str = "aot_eager") -> None:
    """``ddpad.torchsim.Model`` on torch-sim states of ``batches`` (lists of
    ``ase.Atoms``; their system and atom counts changing) gives the eager
    model's energies and forces, on one graph per growth."""
    ts = pytest.importorskip("torch_sim", reason=f"torch-sim not installed: {install_command('torchsim')}")
    from ddpad.torchsim import Model

    adapter = resolve_adapter(adapter)
    param = next(model.parameters())
    padded = Model(model, adapter, backend=backend, on_recompile="raise")
    eager = Model(model, adapter, pad=False, compile=False)
    for step, batch in enumerate(batches):
        state = ts.io.atoms_to_state(list(batch), device=param.device, dtype=param.dtype)
        out, ref = padded(state), eager(state)
        assert out["energy"].shape == (len(batch),), f"batch {step}: energy shape {tuple(out['energy'].shape)}"
        _compare(out, ref, atol=atol, rtol=rtol, where=f"torch-sim batch {step}")
    check_graphs(padded.wrapped)


def check_tensor_input(adapter: Any, model: torch.nn.Module, structures: Sequence[Any], *, atol: float,
                       rtol: float = 0.0, backend: str = "aot_eager") -> None:
    """The adapter's ``tensor_input`` (an engine's tensors -> the native
    input) gives the numbers of its ASE pipeline: each of ``structures``
    (``ase.Atoms`` or lists of them) as :class:`~ddpad.padding.Structures` on the
    model's device, through the unpadded eager model and through the padded
    model (one graph per growth), against the pipeline's eager energies,
    forces and (periodic structures) stress."""
    from ._evaluator import Evaluator
    from ._structures import Structures

    adapter = resolve_adapter(adapter)
    if adapter.engine.tensor_input is None:
        pytest.skip(f"adapter {adapter.name!r} declares no tensor_input")
    device = next(model.parameters()).device
    eager = Evaluator(model, adapter, pad=False, compile=False)
    padded = Evaluator(model, adapter, backend=backend, on_recompile="raise")
    for step, atoms in enumerate(structures):
        parts = list(atoms) if isinstance(atoms, (list, tuple)) else [atoms]
        stress = all(bool(a.pbc.all()) for a in parts)
        tensors = Structures.from_atoms(parts, device=device, molecules=adapter.engine.molecules)
        keys = ["energy", "forces", *(["stress"] if stress else [])]
        want = {k: v for k, v in eager(parts, stress=stress).items() if k in keys}
        for where, got in (("eager", eager(tensors, stress=stress)), ("padded", padded(tensors, stress=stress))):
            _compare({k: got[k] for k in keys}, want, atol=atol, rtol=rtol,
                     where=f"tensor input, structure {step}, {where}")
    assert padded.wrapped is not None
    check_graphs(padded.wrapped)


def check_empty_rejected(adapter: Any, model: torch.nn.Module) -> None:
    """An empty structure is a clear ``ValueError`` from the input builder."""
    from ase import Atoms

    adapter = resolve_adapter(adapter)
    with pytest.raises(ValueError, match=r"\w"):
        adapter.input_builder(model)(Atoms())
    with pytest.raises(ValueError, match=r"\w"):
        adapter.input_builder(model)([])


def default_trajectory(adapter: Any, steps: int = 8) -> list[Any]:
    """Structures from ``adapter.tools.default_system()`` whose atom, edge and
    system counts change: atoms deleted and rattled, every third step a
    batch of two."""
    import numpy as np

    adapter = resolve_adapter(adapter)
    if adapter.tools.default_system is None:
        raise ValueError(f"adapter {adapter.name!r} has no default_system: give the trajectory fixture")
    base = adapter.tools.default_system()
    base = base[0] if isinstance(base, (list, tuple)) else base
    rng = np.random.default_rng(0)

    def variant(step: int) -> Any:
        atoms = base.copy()
        drop = int(rng.integers(0, 4))
        if drop:
            del atoms[sorted(rng.choice(len(atoms), size=drop, replace=False).tolist())]
        atoms.rattle(0.03, seed=step)
        return atoms

    return [[variant(s), variant(s + 100)] if s % 3 == 2 else variant(s) for s in range(steps)]


def _counts(structure: Any) -> tuple[int, int]:
    parts = structure if isinstance(structure, (list, tuple)) else [structure]
    return sum(len(p) for p in parts), len(parts)


class AdapterTests:
    """Base class of an adapter's conformance tests (see the module docstring).

    Class attributes: ``adapter`` (name or Adapter), ``dtype``, ``atol``,
    ``rtol``, ``backend`` (``"aot_eager"`` counts graphs without inductor's
    compile time), ``poison_scale`` (magnitude of the dead-row values),
    ``aot_route`` (True: every call form takes ``compile_mode="aot"``; else
    a piece of the reason the route gives for refusing it: the check then
    asserts that it falls back, exactly). ``test_exact_through_aot`` builds
    AOTInductor packages (minutes for a real model on a CPU) and carries
    the ``inductor`` marker, ``test_foundation_configurations`` (a compile
    of each model users run: minutes on a CPU) the ``long`` marker: register
    both in the plugin's pytest config. Fixtures to override: ``model``,
    ``trajectory``, ``foundation_models`` (the configurations users run,
    each through :func:`check_real_model` at ``foundation_atol``: trained
    float32 models on their own elements), ``foundation_structures`` (what
    they run on).
    """

    adapter: Any = None
    dtype: torch.dtype = torch.float64
    atol: float = 1e-10
    rtol: float = 0.0
    backend: str = "aot_eager"
    poison_scale: float = 1.0e3
    aot_route: bool | str = True  # True: takes compile_mode="aot"; a string: the reason it is refused
    foundation_atol: float = 1e-4  # foundation models: float32, energies of hundreds of eV

    @pytest.fixture
    def resolved(self) -> Any:
        if self.adapter is None:
            raise TypeError(f"{type(self).__name__} must set the class attribute 'adapter'")
        return resolve_adapter(self.adapter)

    @pytest.fixture
    def model(self, resolved: Any) -> torch.nn.Module:
        if resolved.tools.random_model is None:
            raise TypeError(f"adapter {resolved.name!r} has no random_model: override the 'model' fixture")
        return resolved.tools.random_model(self.dtype, "cpu")

    @pytest.fixture
    def trajectory(self, resolved: Any) -> list[Any]:
        return default_trajectory(resolved)

    @pytest.fixture
    def foundation_models(self, resolved: Any) -> Mapping[str, Any]:
        hook = resolved.tools.foundation_models
        return dict(hook()) if hook is not None else {}

    def test_trajectory_changes_counts(self, trajectory: list[Any]) -> None:
        counts = [_counts(s) for s in trajectory]
        assert len({c[0] for c in counts}) > 1, "the trajectory must change the atom count"

    def test_exact_with_one_graph_per_growth(self, resolved: Any, model: torch.nn.Module, trajectory: list[Any]) -> None:
        wrapped, _ = check_exact(resolved, model, trajectory, atol=self.atol, rtol=self.rtol, backend=self.backend)
        assert wrapped.stats.calls == len(trajectory)

    def test_exact_under_tight_caps(self, resolved: Any, model: torch.nn.Module, trajectory: list[Any]) -> None:
        check_tight(resolved, model, trajectory, atol=self.atol, rtol=self.rtol)

    def test_dead_rows_are_inert(self, resolved: Any, model: torch.nn.Module, trajectory: list[Any]) -> None:
        check_dead_rows(resolved, model, trajectory[0], scale=self.poison_scale)

    def test_native_call_forms(self, resolved: Any, model: torch.nn.Module, trajectory: list[Any]) -> None:
        if not resolved.call_forms:
            pytest.skip(f"adapter {resolved.name!r} declares no call_forms")
        check_call_forms(resolved, model, trajectory[0], atol=self.atol, rtol=self.rtol, backend=self.backend)

    def test_energy_differentiable_by_the_caller(self, resolved: Any, model: torch.nn.Module, trajectory: list[Any]) -> None:
        check_autograd(resolved, model, trajectory[0], atol=self.atol, rtol=self.rtol, backend=self.backend)

    def test_engine_hooks(self, resolved: Any, model: torch.nn.Module, trajectory: list[Any]) -> None:
        check_engine_hooks(resolved, model, trajectory[0], atol=self.atol, rtol=self.rtol, backend=self.backend)

    def test_empty_structure_rejected(self, resolved: Any, model: torch.nn.Module) -> None:
        check_empty_rejected(resolved, model)

    def test_ase_calculator(self, resolved: Any, model: torch.nn.Module, trajectory: list[Any]) -> None:
        from ddpad.ase import Calculator

        atoms = next(s for s in trajectory if not isinstance(s, (list, tuple))).copy()
        atoms.calc = Calculator(model, resolved, backend=self.backend)
        energy = atoms.get_potential_energy()
        ref = resolved.flat(resolved.reference(model, resolved.input_builder(model)(atoms)))
        torch.testing.assert_close(torch.tensor(energy, dtype=torch.float64),
                                   ref[resolved.flat_energy_key].detach().double().sum(), atol=max(self.atol, 1e-6), rtol=self.rtol)

    @pytest.mark.inductor
    def test_exact_through_aot(self, resolved: Any, model: torch.nn.Module, trajectory: list[Any]) -> None:
        result = check_aot(resolved, model, trajectory, atol=self.atol, rtol=self.rtol,
                           poison_scale=self.poison_scale)
        if self.aot_route is True:
            assert result["refused"] == {}, f"compile_mode='aot' refused: {result['refused']}"
            assert result["checked"] >= 2
        else:
            assert result["refused"], f"compile_mode='aot' was expected to refuse ({self.aot_route!r}) and did not"
            assert all(self.aot_route in why for why in result["refused"].values()), result["refused"]

    @pytest.fixture
    def foundation_structures(self, trajectory: list[Any]) -> list[Any]:
        """What each foundation configuration runs: the trajectory's first
        three single structures (override with small cells: at a foundation
        model's cutoff an atom has 100-250 neighbours, and each configuration
        compiles its own graphs)."""
        return [s for s in trajectory if not isinstance(s, (list, tuple))][:3]

    def test_follows_the_users_weights(self, resolved: Any, model: torch.nn.Module, trajectory: list[Any]) -> None:
        structure = next(s for s in trajectory if not isinstance(s, (list, tuple)))
        check_follows_weights(resolved, model, structure, atol=self.atol, rtol=self.rtol, backend=self.backend)

    @pytest.mark.long
    def test_foundation_configurations(self, resolved: Any, foundation_models: Mapping[str, Any],
                                       foundation_structures: list[Any]) -> None:
        """Each configuration users run: exact, finite in every padded row,
        compiled. A float64 configuration of a float64 suite is held to
        ``atol``, the rest to ``foundation_atol``."""
        if not foundation_models:
            pytest.skip(f"adapter {resolved.name!r} names no foundation configuration: override the "
                        "'foundation_models' fixture")
        for name, build in foundation_models.items():
            model = build()
            float64 = next(model.parameters()).dtype == torch.float64 == self.dtype
            try:
                check_real_model(resolved, model, foundation_structures,
                                 atol=self.atol if float64 else self.foundation_atol, rtol=self.rtol,
                                 backend=self.backend)
            except AssertionError as exc:
                raise AssertionError(f"foundation configuration {name!r}: {exc}") from exc

    def test_tensor_input(self, resolved: Any, model: torch.nn.Module, trajectory: list[Any]) -> None:
        check_tensor_input(resolved, model, trajectory, atol=self.atol, rtol=self.rtol, backend=self.backend)

    def test_torchsim_model(self, resolved: Any, model: torch.nn.Module, trajectory: list[Any]) -> None:
        singles = [s for s in trajectory if not isinstance(s, (list, tuple))]
        pairs = [list(s) for s in trajectory if isinstance(s, (list, tuple))]
        if len(singles) < 2 or not pairs:
            pytest.skip("the trajectory has no batch of systems to run through torch-sim")
        batches = [pairs[0], [singles[0]], [singles[1], *pairs[0]]]
        check_torchsim(resolved, model, batches, atol=self.atol, rtol=self.rtol, backend=self.backend)
