"""The per-model declaration: how ddpad pads, calls and unpads one model
family (:class:`Adapter`), with what engines need to feed it
(:class:`EngineHooks`) and what the command line, the benchmarks and the
conformance kit need to build one (:class:`ToolHooks`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ._noise import quiet
from ._protocol import GraphPadder

if TYPE_CHECKING:
    from ddpad import PaddedModel

__all__ = ["Adapter", "EngineHooks", "ToolHooks"]


@dataclass(frozen=True)
class EngineHooks:
    """What the engines (ASE, torch-sim, LAMMPS, nvalchemi) need of a model
    family to feed it and read it: :attr:`Adapter.engine`.

    Attributes
    ----------
    build_input
        ``(model, atoms, **options) -> native input`` from ``ase.Atoms`` (or a
        list of them): the reference input path the tensor path is compared with.
    tensor_input
        Optional ``model -> (Structures -> native input)``: the native input
        built from tensors on their device (:class:`ddpad.padding.Structures`), for
        the engines (the ASE calculator, torch-sim). Made once per model
        (state per composition lives in the returned function); an
        ``ImportError`` when it is made (a missing neighbour list) sends the
        engines to ``build_input``, as they go without it.
    input_context
        Optional ``model -> dict``: keyword arguments for ``build_input`` made
        once per model and reused every step (e.g. aimnet's calculator).
    stress_option
        The call keyword that turns stress on (mace: ``"compute_stress"``);
        None when the model computes no stress, or computes it whenever the
        input has a cell.
    properties
        Optional ``output -> {"energy", "forces", "stress", ...}``: flat
        properties of a (nested) native output, for calculators. Default:
        the output itself.
    atom_energy_key
        Key of per-atom energies ``[N]`` in the native output, for engines that own only
        some of the atoms they evaluate (LAMMPS domains sum their owned
        atoms); None when the model gives none.
    message_layers
        Optional ``model -> int``: how many cutoffs deep an atom's energy
        sees (the message-passing layers; 1 for a strictly local model such
        as Allegro). Engines that split space (LAMMPS) need ghost atoms that
        deep; without it they ask the caller.
    energy_only_options
        Call keywords for a forward that returns energies without taking
        derivatives (the engine takes them), e.g. mace's ``compute_force=False``.
    molecules
        The model's systems are molecules, each with its own total charge
        (AIMNet2): the engines make an ``ase.Atoms`` with a ``mol_id`` array
        one system per molecule (:meth:`ddpad.padding.Structures.from_atoms`), as the
        adapter's ``build_input`` does.
    positions_key
        The native input field holding atom positions, for engines that
        differentiate the energy themselves (LAMMPS); None when the energy
        is not a function of an input field (SevenNet: its input holds
        precomputed edge vectors), which such engines refuse.
    lammps_input
        Optional ``model -> (elements, build)`` for ``pair_style ddpad``
        packages (:mod:`ddpad.engines.lammps_package`): the model's atomic
        numbers in the order of its element indices, and a traceable
        ``build(positions, species, dead, edge_index, shifts) -> native
        input`` for one graph of explicit ghost atoms (no periodic cell),
        the ``dead`` rows in a system of their own; ``shifts`` ``(edges, 3)``
        are Cartesian displacements the model adds to its edge vectors
        (zeros: the package differentiates the energy by them for per-atom
        virials). None: not packaged for LAMMPS.
    """

    build_input: Callable[..., Any]
    tensor_input: Callable[[torch.nn.Module], Callable[[Any], Any]] | None = None
    input_context: Callable[[torch.nn.Module], dict[str, Any]] | None = None
    stress_option: str | None = None
    properties: Callable[[Any], dict[str, Any]] | None = None
    atom_energy_key: str | None = None
    message_layers: Callable[[torch.nn.Module], int] | None = None
    energy_only_options: Mapping[str, Any] = field(default_factory=dict)
    molecules: bool = False
    positions_key: str | None = "positions"
    lammps_input: Callable[[torch.nn.Module], tuple[tuple[int, ...], Callable[..., Any]]] | None = None


@dataclass(frozen=True)
class ToolHooks:
    """What ``ddpad run`` / ``bench`` / ``precompile``, the worker processes
    and the conformance kit need of a model family to build a model and a
    system without the user's: :attr:`Adapter.tools`. All optional.

    Attributes
    ----------
    random_model
        ``(dtype, device) -> model``: a small randomly initialised model from
        the package's own classes (``ddpad run`` without ``--model``). It runs
        with the model packages' known warnings and banners silenced (they
        are raised because ddpad builds the model).
    random_model_elements
        The atomic numbers ``random_model`` builds its model for by default,
        where it takes ``atomic_numbers=`` to build for others (mace,
        sevennet: H, C, O): ``ddpad run`` builds it for these and the
        system's elements. None: ``random_model`` takes no elements.
    default_dtype
        The precision ``ddpad run`` and ``ddpad bench`` build the random model
        in when not told (mace: float64, as its own tools run); None: torch's
        default dtype.
    load_model
        ``(path, device) -> model``: load a local checkpoint (silenced as
        ``random_model``).
    default_system
        ``() -> ase.Atoms | list[ase.Atoms]``: the built-in system of
        ``ddpad run`` (periodic bulk or a set of molecules).
    native_padding
        ``model -> (atoms -> padded native input)``: the model package's own
        padding, benchmarked by ``ddpad bench`` beside ddpad.
    ase_calculator
        ``model -> ase calculator``: the model package's own ASE calculator
        around ``model``, the baseline of ``ddpad bench --engines``' ASE rows
        (an ``ImportError`` or ``RuntimeError`` when it cannot run here, with
        why).
    torchsim_model
        ``model -> torch-sim model``: the package's own torch-sim model around
        ``model``, the baseline of the torch-sim rows (likewise).
    compiled_ase_calculator
        ``model -> ase calculator``: the package's own compiled route in ASE
        (mace: ``MACECalculator(..., compile_mode="default")``), a row of
        ``ddpad bench --engines``' ASE table beside its eager calculator.
    foundation_models
        ``() -> {name: () -> model}``: the configurations users run, each
        built without a download: a trained model the package ships, or a
        published foundation architecture built by the package's own config
        code (random weights where none ship). The conformance kit runs each
        (:func:`ddpad.testing.check_real_model`): random test weights in
        small test configurations miss what real ones do (sevenn's envelope
        beyond the cutoff sent SevenNet-0's dead rows to NaN).
    """

    random_model: Callable[[torch.dtype, str], torch.nn.Module] | None = None
    random_model_elements: tuple[int, ...] | None = None
    default_dtype: torch.dtype | None = None
    load_model: Callable[[str, str], torch.nn.Module] | None = None
    default_system: Callable[[], Any] | None = None
    native_padding: Callable[[torch.nn.Module], Callable[[Any], Any]] | None = None
    ase_calculator: Callable[[torch.nn.Module], Any] | None = None
    torchsim_model: Callable[[torch.nn.Module], Any] | None = None
    compiled_ase_calculator: Callable[[torch.nn.Module], Any] | None = None
    foundation_models: Callable[[], Mapping[str, Callable[[], torch.nn.Module]]] | None = None

    def __post_init__(self) -> None:
        for hook in ("random_model", "load_model"):
            build = getattr(self, hook)
            if build is not None and not getattr(build, "_ddpad_quiet", False):
                object.__setattr__(self, hook, _quietly(build))


@dataclass(frozen=True)
class Adapter:
    """One model family's declaration (SPEC section 8): what the runtime
    needs to pad, compile, call and check the model, with what engines need
    (:attr:`engine`) and what the tools need (:attr:`tools`) in records of
    their own.

    Attributes
    ----------
    name
        Registry name, e.g. ``"mace"``.
    make_padder
        ``model -> GraphPadder`` configured for the model's native input and cutoff.
    energy_key
        Output key of the per-system energy in the native output (with
        ``engine.properties``, the flat key is ``"energy"``:
        :attr:`flat_energy_key`).
    cutoff
        ``model -> float``: the model's interaction cutoff.
    engine
        :class:`EngineHooks`: how engines build the model's input (from
        ``ase.Atoms`` at least) and read its output.
    tools
        :class:`ToolHooks`: a random or saved model and a default system for
        the command line, the benchmarks and the conformance kit.
    install_hint
        The pip command that installs the model package. A built-in
        adapter leaves it empty: the registry gives it ddpad's extra of its
        name, the one place that command is written.
    requires
        IMPORT names (not distribution names) of the packages the adapter
        needs, the model package's own FIRST (mace: ``("mace", "e3nn")``,
        allegro: ``("allegro", "nequip")``): the registry imports each
        before handing the adapter out (missing: ``pip install`` hint;
        failing to import: reported as broken), and the compile store keys
        on the versions of their distributions.
    atom_outputs
        Per-atom output keys, for readers of the declaration; ddpad reads
        none: ``unpad`` strips the keys the padder is configured with
        (``make_padder``). Default: none.
    system_outputs
        Per-system output keys, likewise informational. Default: none.
    pad_in_forward
        The model builds its graph in ``forward`` and pads at its own seam
        through ``current_dd_context().maybe_pad_graph`` (UMA style).
    prepare_model
        Optional ``model -> model`` run once by ``wrap`` before compiling
        (e.g. to install the padding seam on that instance).
    call
        Optional ``(compiled_model, padded_input, *args, **kwargs) -> output``:
        how one step runs, for models whose derivatives are taken outside
        ``forward`` (AIMNet2: forces by autograd around the compiled energy).
        Default: ``compiled_model(padded_input, *args, **kwargs)``.
    dynamo_config
        ``torch._dynamo.config`` values set around each compiled call only
        (scoped with ``config.patch``, restored after), e.g. MACE's
        ``{"trace_autograd_ops": True}`` to keep its forces in the graph.
    inductor_options
        Inductor options this model family needs, given to
        ``torch.compile(options=...)`` under the caller's own when Inductor
        compiles (part of the compile store's key), e.g. orb's
        ``{"cpp.dynamic_threads": True}``: at one thread Inductor's CPU code
        for orb's ``scatter_add_`` followed by ``count[count < 1] = 1`` is
        wrong, and that option keeps the scatter on ATen's kernel.
    compile_region
        Optional ``(model, compile_fn) -> callable``: what to compile. A model
        that pads at its own seam (``pad_in_forward``) must compile only the
        part after the seam (the part before it sees unpadded shapes): the
        adapter applies ``compile_fn`` to that part and returns the model to
        call. Under ``compile_mode="aot"`` the same hook puts the part's
        ahead-of-time packages in its place, so the part must take tensors in
        dicts, lists and tuples and plain constants (UMA's ``UMACore``).
        Default: the whole model is compiled.
    evaluate
        Optional ``(model, native_input, *args, **kwargs) -> output``: the
        unpadded eager model, output shaped as the wrapped model's (the
        reference padding is checked against). Default: ``call`` or
        ``model(input, ...)`` on a copy of the input.
    call_forms
        Keyword sets the model package's own drivers call the native model
        with (its calculator, evaluation script, torch-sim model), e.g. mace's
        ``{"training": False, "compute_force": True, "compute_stress": True}``.
        The wrapped model must accept each and give the eager results
        (``ddpad.testing`` checks them).
    grad_input
        The native input field (key or attribute) holding positions, when a
        caller may take forces by autograd of the returned energy with
        respect to it (as with the native model); None when the native
        model's energy is not connected to its input.
    """

    name: str
    make_padder: Callable[[torch.nn.Module], GraphPadder]
    energy_key: str
    cutoff: Callable[[torch.nn.Module], float]
    engine: EngineHooks
    tools: ToolHooks = field(default_factory=ToolHooks)
    install_hint: str = ""
    requires: tuple[str, ...] = ()
    atom_outputs: tuple[str, ...] = ()
    system_outputs: tuple[str, ...] = ()
    pad_in_forward: bool = False
    prepare_model: Callable[[torch.nn.Module], torch.nn.Module] | None = None
    call: Callable[..., Any] | None = None
    dynamo_config: Mapping[str, Any] = field(default_factory=dict)
    inductor_options: Mapping[str, Any] = field(default_factory=dict)
    compile_region: Callable[[torch.nn.Module, Callable[[Any], Any]], Any] | None = None
    evaluate: Callable[..., Any] | None = None
    call_forms: tuple[Mapping[str, Any], ...] = ()
    grad_input: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineHooks):
            raise TypeError(f"ddpad: Adapter {self.name!r} needs engine=EngineHooks(build_input=...): how the "
                            f"engines (ASE, torch-sim, LAMMPS) build the model's input; got {self.engine!r}")
        if not isinstance(self.tools, ToolHooks):
            raise TypeError(f"ddpad: Adapter {self.name!r}: tools must be a ToolHooks, got {self.tools!r}")

    @property
    def flat_energy_key(self) -> str:
        """The energy's key in :meth:`flat` properties."""
        return "energy" if self.engine.properties is not None else self.energy_key

    def flat(self, output: Any) -> dict[str, Any]:
        """Flat properties (energy, forces, stress ...) of a native output."""
        properties = self.engine.properties
        return properties(output) if properties is not None else output

    def reference(self, model: torch.nn.Module, data: Any, *args: Any, **kwargs: Any) -> Any:
        """The unpadded, uncompiled model's output for ``data`` (not modified)."""
        if isinstance(data, Mapping):
            data = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
        if self.evaluate is not None:
            return self.evaluate(model, data, *args, **kwargs)
        if self.call is not None:
            return self.call(model, data, *args, **kwargs)
        return model(data, *args, **kwargs)

    def input_builder(self, model: torch.nn.Module) -> Callable[[Any], Any]:
        """``atoms -> native input`` for ``model``, reusing per-model state."""
        engine = self.engine
        extra = engine.input_context(model) if engine.input_context is not None else {}
        return lambda atoms: engine.build_input(model, atoms, **extra)

    def call_options(self, stress: bool) -> dict[str, Any]:
        """Call keywords that ask the model for stress (or not)."""
        option = self.engine.stress_option
        return {option: stress} if option else {}

    def wrap(self, model: torch.nn.Module, *, compile: bool = True, **kwargs: Any) -> PaddedModel:
        """``ddpad.wrap(model, self, ...)``: the fixed-shape (compiled) model."""
        import ddpad  # the public face: wrap sits above this record

        return ddpad.wrap(model, self, compile=compile, **kwargs)


def _quietly(build: Callable[..., Any]) -> Callable[..., Any]:
    """``build`` run inside :func:`ddpad._noise.quiet`."""
    @functools.wraps(build)
    def quietly(*args: Any, **kwargs: Any) -> Any:
        with quiet():
            return build(*args, **kwargs)

    quietly._ddpad_quiet = True  # type: ignore[attr-defined]  # (replace() builds the record again)
    return quietly
