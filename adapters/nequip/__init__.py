"""NequIP (``nequip``): COO edge-list padding of nequip's ``AtomicDataDict``.

The native input is what nequip's ASE calculator builds (``from_ase`` ->
``ChemicalSpeciesToAtomTypeMapper`` -> ``NeighborListTransform``, batched
with ``AtomicDataDict.batched_from_list``): ``pos``, ``atom_types``,
``atomic_numbers``, ``edge_index [2, E]``, ``edge_cell_shift [E, 3]``
(lattice shifts), ``cell [S, 3, 3]``, ``pbc [S, 3]``, ``batch`` and
``num_atoms [S]``, all float fields in float64 (nequip's data dtype).

- Dead atoms form their own dead system (type 0, far away) with its own
  cubic cell of edge ``2 r_max + 1``; ``num_atoms`` of the dead system
  counts them. Joined to a real system, nequip's ``PerTypeScaleShift``
  would add their per-type shift to its energy.
- Dead edges are self-loops on the last dead atom with lattice shift
  ``(1, 0, 0)``: nequip computes edge vectors as ``pos[j] - pos[i] +
  edge_cell_shift @ cell[batch[i]]``, so each dead edge is ``(2 r_max + 1,
  0, 0)`` whatever the dead atoms' positions: never zero, beyond the
  cutoff, so the polynomial envelope is exactly zero.
- One graph: nequip's ``ForceStressOutput`` calls ``pos.requires_grad_`` and
  ``torch.autograd.grad`` inside ``forward``. Positions are made to require
  grad before the compiled call, ``trace_autograd_ops`` is switched on
  around it only, and the compiled module returns its outputs detached
  (the native model's are not differentiable again either: its inner
  ``autograd.grad`` frees the graph), so energy, forces, stress and virial
  are one Dynamo graph.

Shared with the Allegro adapter (``ddpad.adapters.allegro``): both models
are nequip ``GraphModel`` objects built from the same data pipeline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import random
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from ddpad.padding import COOPadder, Composition, Fill, NeighborList, Structures
from ddpad.adapters import Adapter, EngineHooks, ToolHooks
from ddpad.adapters._common import builtin_adapter
from torch import Tensor

__all__ = [
    "ADAPTER",
    "NequIPForward",
    "NequIPPadder",
    "build_input",
    "build_model",
    "build_named",
    "build_random",
    "default_system",
    "dtype_name",
    "evaluate",
    "foundation_model_config",
    "foundation_models",
    "global_state",
    "lammps_input",
    "load_model",
    "make_adapter",
    "make_padder",
    "oam_config",
    "oam_per_type_energies",
    "oam_type_names",
    "prepare_model",
    "properties",
    "random_model",
    "random_model_config",
    "tensor_input",
]

ATOM_FIELDS: dict[str, Any] = {"atom_types": 0, "atomic_numbers": 0}
EDGE_FIELDS: dict[str, Any] = {"edge_cell_shift": Fill.DEAD_UNIT_SHIFT}
SYSTEM_FIELDS: dict[str, Any] = {"cell": Fill.DEAD_CELL, "pbc": True}
# every per-atom / per-edge / per-system key nequip models return (inputs
# echoed, intermediates and outputs), so unpad strips dead rows from all of them
ATOM_OUTPUTS = (
    "pos", "atom_types", "atomic_numbers", "batch", "node_attrs", "node_features",
    "feature_norm_factor", "atomic_energy", "forces", "charges", "stresses", "magmoms",
    "born_effective_charges",
)
SYSTEM_OUTPUTS = (
    "total_energy", "stress", "virial", "cell", "pbc", "num_atoms", "free_energy", "dipole",
    "polarization", "magmom", "charge", "spin", "dielectric_tensor",
)
EDGE_OUTPUTS = (
    "edge_cell_shift", "edge_vectors", "edge_lengths", "normed_edge_lengths", "edge_cutoff",
    "edge_attrs", "edge_embedding", "edge_features", "edge_energy", "edge_forces",
)
# per-edge outputs laid out [2, E] like the edge index
EDGE_PAIR_OUTPUTS = ("edge_index", "edge_type_flat")


def _graph_model(model: torch.nn.Module) -> torch.nn.Module:
    """The nequip ``GraphModel`` inside ``model`` (itself, or the one
    :class:`NequIPForward` wraps)."""
    return model.graph_model if isinstance(model, NequIPForward) else model


def _cutoff(model: torch.nn.Module) -> float:
    return float(_graph_model(model).metadata["r_max"])


def _type_names(model: torch.nn.Module) -> list[str]:
    return list(_graph_model(model).metadata["type_names"].split(" "))


class NequIPPadder(COOPadder):
    """:class:`ddpad.padding.COOPadder` for nequip's field names, with dead self-loops.

    nequip has no cartesian shift field: its edge vectors come from the
    lattice shift (``edge_cell_shift``) and the per-system ``cell``, so a
    self-loop through the dead system's cell (:attr:`Fill.DEAD_UNIT_SHIFT` with
    :attr:`Fill.DEAD_CELL`) is already longer than the cutoff (placement
    ``"own"``; joined to a real system the anchor pair with zero shifts is
    used). :func:`make_padder` also has ``unpad`` strip dead edges from the
    ``[2, E]`` outputs (``edge_index``, ``edge_type_flat``: sliced on their
    last axis, :data:`EDGE_PAIR_OUTPUTS`).
    """

    vectors_from_cell = True


def make_padder(model: torch.nn.Module, **overrides: Any) -> NequIPPadder:
    """The nequip padder for ``model`` (cutoff: its ``r_max`` metadata);
    keyword arguments override :class:`ddpad.padding.COOPadder`'s."""
    config: dict[str, Any] = {
        "positions": "pos", "edge_index": "edge_index", "system_index": "batch", "ptr": None,
        "system_count": "num_atoms", "atom_counts": "num_atoms",
        "atom_fields": ATOM_FIELDS, "edge_fields": EDGE_FIELDS, "system_fields": SYSTEM_FIELDS,
        "atom_outputs": ATOM_OUTPUTS, "system_outputs": SYSTEM_OUTPUTS, "edge_outputs": EDGE_OUTPUTS,
        "edge_pair_outputs": EDGE_PAIR_OUTPUTS,
    }
    config.update(overrides)
    return NequIPPadder(_cutoff(model), **config)


class NequIPForward(torch.nn.Module):
    """A nequip ``GraphModel`` arranged for one Dynamo graph.

    ``forward(data)`` is the model's forward with every output detached: the
    model's own ``autograd.grad`` (forces, virial) then traces into the same
    graph (with ``trace_autograd_ops``), since nothing returned still needs
    the autograd graph it consumes. ``forward(data, do_derivatives=False)``
    runs only the energy model inside ``ForceStressOutput`` and returns its
    outputs attached, for callers that differentiate energies themselves
    (e.g. the LAMMPS engine summing a domain's owned atomic energies).
    """

    def __init__(self, graph_model: torch.nn.Module) -> None:
        super().__init__()
        self.graph_model = graph_model

    @property
    def metadata(self) -> dict[str, str]:
        """The wrapped model's metadata (``r_max``, ``type_names`` ...)."""
        return self.graph_model.metadata

    def forward(self, data: dict[str, Tensor], do_derivatives: bool = True) -> dict[str, Tensor]:
        if do_derivatives:
            out = self.graph_model(data)
            return {k: v.detach() for k, v in out.items()}
        inner = self.graph_model.model
        if not hasattr(inner, "func"):
            raise ValueError(
                f"do_derivatives=False needs nequip's ForceStressOutput around the energy model, "
                f"found {type(inner).__name__}"
            )
        fields = {k: data[k] for k in self.graph_model.model_input_fields if k in data}
        return inner.func(fields)


def prepare_model(model: torch.nn.Module) -> NequIPForward:
    """The compile-ready form of ``model``: :class:`NequIPForward` around it
    (sharing its parameters; nothing global is changed)."""
    return model if isinstance(model, NequIPForward) else NequIPForward(model)


class _CompiledForward(torch.nn.Module):
    """``model`` called through a compiled function (see :func:`compile_region`)."""

    def __init__(self, model: NequIPForward, compiled: Any) -> None:
        super().__init__()
        self.model = model
        self._compiled = compiled

    @property
    def metadata(self) -> dict[str, str]:
        return self.model.metadata

    def forward(self, data: dict[str, Tensor], *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        return self._compiled(data, *args, **kwargs)


def compile_region(model: torch.nn.Module, compile_fn: Any) -> torch.nn.Module:
    """Compile ``model`` (the :class:`NequIPForward`) through a plain function.

    Why: importing nequip imports lightning, which replaces ``torch.compile``
    process-wide with a wrapper that deep-copies the compile keyword
    arguments whenever it compiles an ``nn.Module``. A function is compiled
    without that copy (nothing of the caller's arguments is duplicated), and
    Dynamo traces the module call inside it the same way.
    """

    def forward(data: dict[str, Tensor], *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        return model(data, *args, **kwargs)

    return _CompiledForward(model, compile_fn(forward))


def _step(model: Any, data: dict[str, Tensor], *, do_derivatives: bool = True) -> dict[str, Tensor]:
    """One call: positions require grad before the (compiled) call, as
    ``ForceStressOutput`` would make them inside it (``requires_grad_`` on an
    input is a graph break)."""
    if do_derivatives:
        data["pos"].requires_grad_(True)
        return model(data)
    return model(data, do_derivatives=False)


def evaluate(model: torch.nn.Module, data: dict[str, Tensor], *, do_derivatives: bool = True) -> dict[str, Tensor]:
    """The unpadded eager reference: the native model on a copy of ``data``,
    outputs detached as the wrapped model returns them."""
    inp = {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in data.items()}
    return _step(prepare_model(model), inp, do_derivatives=do_derivatives)


def properties(output: Mapping[str, Any]) -> dict[str, Tensor]:
    """Flat properties of a nequip output: ``energy [S]`` (nequip's
    ``total_energy [S, 1]``), ``energies [N]`` (``atomic_energy [N, 1]``),
    ``forces [N, 3]``, ``stress [S, 3, 3]`` in ASE's sign (nequip's stress is
    ``+1/V dE/de``; its ASE calculator passes it on as is) and ``virial``."""
    flat: dict[str, Tensor] = {}
    if isinstance(output.get("total_energy"), Tensor):
        flat["energy"] = output["total_energy"].reshape(-1)
    if isinstance(output.get("atomic_energy"), Tensor):
        flat["energies"] = output["atomic_energy"].reshape(-1)
    for key in ("forces", "stress", "virial"):
        if isinstance(output.get(key), Tensor):
            flat[key] = output[key]
    return flat


def build_input(
    model: torch.nn.Module,
    atoms: Any,
    *,
    chemical_species_to_atom_type_map: Mapping[str, str] | None = None,
    device: str | torch.device | None = None,
) -> dict[str, Tensor]:
    """nequip's own input dict for one ``ase.Atoms`` or a list of them.

    Built as ``NequIPCalculator`` builds it: ``from_ase`` (float64, nequip's
    data dtype), then nequip's ``basic_transforms`` for the model's metadata
    (type mapping, neighbour list at ``r_max``, per-edge-type cutoffs), then
    batched with ``AtomicDataDict.batched_from_list``, moved to ``device``
    (default: the model's). Only the fields the model reads, plus ``pbc`` and
    ``atomic_numbers``, are kept (labels on the atoms are dropped).

    Raises
    ------
    ValueError
        For no structures, a structure without atoms, or chemical species the
        model's type map does not know.
    """
    from nequip.data import AtomicDataDict, from_ase
    from nequip.integrations.utils import basic_transforms
    from nequip.utils import torch_default_dtype

    structures = list(atoms) if isinstance(atoms, (list, tuple)) else [atoms]
    if not structures:
        raise ValueError("build_input needs at least one structure")
    if any(len(a) == 0 for a in structures):
        raise ValueError("build_input got a structure without atoms")
    graph_model = _graph_model(model)
    type_names = _type_names(model)
    species_map = dict(chemical_species_to_atom_type_map or {t: t for t in type_names})
    unknown = sorted({s for a in structures for s in a.get_chemical_symbols()} - set(species_map))
    if unknown:
        raise ValueError(f"chemical species {unknown} are not known to the model (types {type_names})")
    metadata = graph_model.metadata
    transforms = basic_transforms(metadata, float(metadata["r_max"]), type_names, species_map)
    keep = set(graph_model.model_input_fields) | {"pbc", "atomic_numbers"}
    frames = []
    with torch_default_dtype(torch.float64):  # nequip's data are always float64
        for a in structures:
            data = from_ase(a)
            for transform in transforms:
                data = transform(data)
            frames.append(AtomicDataDict.with_batch_({k: v for k, v in data.items() if k in keep}))
    batch = frames[0] if len(frames) == 1 else AtomicDataDict.batched_from_list(frames)
    target = device if device is not None else next(graph_model.parameters()).device
    return {k: v.to(target) for k, v in batch.items()}


def tensor_input(model: torch.nn.Module, *,
                 chemical_species_to_atom_type_map: Mapping[str, str] | None = None) -> Any:
    """``Structures -> nequip's input dict`` on the structures' device: the
    fields of :func:`build_input` (float64 positions, cells and lattice
    shifts, as nequip's data are), the neighbour list from vesin-torch with
    nequip's own per-edge-type pruning (``NeighborListPruneTransform``) where
    the model has per-edge-type cutoffs. Per composition the atom types
    (from atomic numbers through the species map), ``num_atoms`` and the
    checks; per step the neighbour list."""
    from ase.data import chemical_symbols
    from nequip.nn import graph_model as nequip_graph_model

    graph_model = _graph_model(model)
    type_names = _type_names(model)
    species_map = dict(chemical_species_to_atom_type_map or {t: t for t in type_names})
    type_of = {z: type_names.index(species_map[symbol]) for z, symbol in enumerate(chemical_symbols)
               if symbol in species_map and species_map[symbol] in type_names}
    metadata = graph_model.metadata
    r_max = float(metadata["r_max"])
    keep = set(graph_model.model_input_fields) | {"pbc", "atomic_numbers"}
    pruner = None
    per_edge_type = metadata.get(nequip_graph_model.PER_EDGE_TYPE_CUTOFF_KEY, None)
    if per_edge_type not in (None, ""):
        from nequip.data.transforms.neighborlist import NeighborListPruneTransform
        from nequip.nn.embedding.utils import cutoff_str_to_fulldict

        if isinstance(per_edge_type, str):
            per_edge_type = cutoff_str_to_fulldict(per_edge_type, type_names)
        pruner = NeighborListPruneTransform(r_max=r_max, per_edge_type_cutoff=per_edge_type, type_names=type_names)
    pairs = NeighborList(r_max)  # (vesin-torch: an ImportError here, not at the first step)
    state: dict[str, Any] = {}

    def build(structures: Structures) -> dict[str, Tensor]:
        composition = Composition.of(structures, state.get("composition"), frozenset(type_of))
        if composition is not state.get("composition"):
            device = structures.positions.device
            table = torch.full((len(chemical_symbols),), -1, dtype=torch.long, device=device)
            table[torch.tensor(list(type_of), device=device)] = torch.tensor(list(type_of.values()), device=device)
            numbers = structures.numbers.long()
            state.update(composition=composition, atomic_numbers=numbers, atom_types=table[numbers],
                         num_atoms=composition.ptr.diff(),
                         pbc=torch.tensor(composition.pbc, dtype=torch.bool, device=device))
        edge_index, unit_shifts, _ = pairs(structures, composition)
        data = {
            "pos": structures.positions.detach().to(torch.float64), "edge_index": edge_index,
            "edge_cell_shift": unit_shifts.to(torch.float64), "cell": structures.cells.detach().to(torch.float64),
            "pbc": state["pbc"], "atomic_numbers": state["atomic_numbers"], "atom_types": state["atom_types"],
            "batch": composition.system, "num_atoms": state["num_atoms"],
        }
        if pruner is not None:
            data = pruner(data)
        return {k: v for k, v in data.items() if k in keep}

    return build


def lammps_input(model: torch.nn.Module) -> tuple[tuple[int, ...], Any]:
    """The model's atomic numbers (its type names, which must be element
    symbols), and ``(positions, species, dead, edge_index, shifts) ->
    nequip's input dict`` for one graph of explicit ghost atoms (``pair_style
    ddpad``): traceable, the edge displacements ``shifts`` (zeros: the
    package differentiates them) as cell shifts of a unit cell, dead atoms
    in a second system. Models
    with per-edge-type cutoffs are refused (their pairs are pruned per type
    pair, which the pair style does not do)."""
    from ase.data import atomic_numbers
    from nequip.nn import graph_model as nequip_graph_model

    graph_model = _graph_model(model)
    type_names = _type_names(model)
    if graph_model.metadata.get(nequip_graph_model.PER_EDGE_TYPE_CUTOFF_KEY, None) not in (None, ""):
        raise ValueError("this nequip model has per-edge-type cutoffs, which pair_style ddpad packages do not "
                         "prune by; run it through ddpad.engines.lammps.Potential (fix external)")
    foreign = [t for t in type_names if t not in atomic_numbers]
    if foreign:
        raise ValueError(f"type names {foreign} are not element symbols: pair_style ddpad maps LAMMPS types to "
                         "elements")
    zs = tuple(atomic_numbers[t] for t in type_names)
    keep = set(graph_model.model_input_fields) | {"pbc", "atomic_numbers"}

    def build(positions: Tensor, species: Tensor, dead: Tensor, edge_index: Tensor,
              shifts: Tensor) -> dict[str, Tensor]:
        n, device = positions.shape[0], positions.device
        alive = (~dead).sum()
        data = {
            "pos": positions.to(torch.float64), "edge_index": edge_index,
            # edge vectors gain shifts @ cell: an identity cell makes them Cartesian
            "edge_cell_shift": shifts.to(torch.float64),
            "cell": torch.eye(3, dtype=torch.float64, device=device).expand(2, 3, 3),
            "pbc": torch.zeros(2, 3, dtype=torch.bool, device=device),
            "atomic_numbers": torch.tensor(zs, device=device)[species], "atom_types": species,
            "batch": dead.long(), "num_atoms": torch.stack([alive, n - alive]),
        }
        return {k: v for k, v in data.items() if k in keep}

    return zs, build


@contextlib.contextmanager
def global_state() -> Iterator[None]:
    """nequip's global state (which its model builders and loaders require),
    scoped: everything ``set_global_state`` changes process-wide the first
    time (default dtype, RNG seeds, Dynamo flags, e3nn code-generation flags,
    JIT fusion strategy, environment variables, sharing strategy) is restored
    on exit. Models built inside keep what they were built with."""
    import e3nn
    from nequip.utils.global_state import set_global_state

    dtype = torch.get_default_dtype()
    rng = (torch.random.get_rng_state(), np.random.get_state(), random.getstate())
    dynamo = {k: getattr(torch._dynamo.config, k) for k in ("capture_dynamic_output_shape_ops", "capture_scalar_outputs")}
    e3nn_defaults = e3nn.get_optimization_defaults()
    env = {k: os.environ.get(k) for k in ("PYTORCH_JIT_USE_NNC_NOT_NVFUSER", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    sharing = torch.multiprocessing.get_sharing_strategy()
    fusion = _fusion_strategy([("STATIC", 2), ("DYNAMIC", 10)])  # read it ...
    _fusion_strategy(fusion)  # ... and put it back
    try:
        with warnings.catch_warnings():  # it sets the (deprecated) JIT fusion strategy
            warnings.simplefilter("ignore", DeprecationWarning)
            set_global_state()
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.random.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])
        for key, value in dynamo.items():
            setattr(torch._dynamo.config, key, value)
        e3nn.set_optimization_defaults(**e3nn_defaults)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.multiprocessing.set_sharing_strategy(sharing)
        _fusion_strategy(fusion)


def _fusion_strategy(strategy: Any) -> Any:
    """``torch.jit.set_fusion_strategy`` without its deprecation warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.set_fusion_strategy(strategy)


def build_model(config: Mapping[str, Any], device: str = "cpu") -> torch.nn.Module:
    """A model from a nequip model config (``{"_target_": builder, **kwargs}``,
    the ``model:`` section of a nequip training config), built as nequip's
    training module builds it, in eval mode, on ``device``."""
    from hydra.utils import get_method

    config = dict(config)
    builder = get_method(config.pop("_target_"))
    with global_state():
        model = builder(**config)
    return model.to(device).eval()


def random_model_config(
    dtype: torch.dtype = torch.float64,
    *,
    r_max: float = 4.0,
    atomic_numbers: Sequence[int] = (1, 6, 8),
    seed: int = 0,
) -> dict[str, Any]:
    """The config of a small NequIP GNN (2 layers, ``l_max = 1``, 8 features)
    with non-zero per-type energy shifts and scales (so a dead atom joined to
    a real system would leak)."""
    from ase.data import chemical_symbols

    names = [chemical_symbols[int(z)] for z in atomic_numbers]  # type names = element symbols
    return {
        "_target_": "nequip.model.NequIPGNNModel",
        "seed": seed, "model_dtype": dtype_name(dtype), "type_names": names, "r_max": r_max,
        "num_layers": 2, "l_max": 1, "num_features": 8, "radial_mlp_depth": 1, "radial_mlp_width": 16,
        "num_bessels": 8, "avg_num_neighbors": 10.0,
        "per_type_energy_shifts": {t: -1.0 - 0.8 * i for i, t in enumerate(names)},
        "per_type_energy_scales": {t: 1.5 + 0.25 * i for i, t in enumerate(names)},
    }


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"nequip models are float32 or float64, got {dtype}")
    return "float64" if dtype == torch.float64 else "float32"


def build_random(make_config: Callable[..., dict[str, Any]], dtype: torch.dtype, device: str,
                 config: dict[str, Any]) -> torch.nn.Module:
    """The model of ``make_config(dtype, r_max=, atomic_numbers=, seed=)``
    (those keywords taken from ``config`` when there) with the rest of
    ``config`` replacing its entries."""
    named = {k: config.pop(k) for k in ("r_max", "atomic_numbers", "seed") if k in config}
    return build_model({**make_config(dtype, **named), **config}, device)


def random_model(dtype: torch.dtype = torch.float64, device: str = "cpu", **config: Any) -> torch.nn.Module:
    """A small randomly initialised NequIP model from nequip's own builder
    (:func:`random_model_config`; other keyword arguments replace its
    entries, e.g. ``num_layers=3``)."""
    return build_random(random_model_config, dtype, device, config)


def oam_type_names() -> list[str]:
    """The 89 elements of the nequip.net OAM foundation models (H to Bi, Ac to
    Pu), in their published order; type names are the chemical symbols."""
    from ase.data import chemical_symbols

    return [chemical_symbols[z] for z in (*range(1, 84), *range(89, 95))]


def oam_per_type_energies(type_names: Sequence[str], seed: int = 0) -> dict[str, Any]:
    """Random non-zero per-type energy shifts (-0.01 to -10 eV, the range of the
    OAM models' isolated-atom references) and scales (0.1 to 1.6, their force
    RMS range), from ``seed``: a dead atom joined to a real system, or a dead
    row reaching ``PerTypeScaleShift``, would show. Shifts fixed and scales
    trainable, as the OAM models train them."""
    rng = np.random.default_rng(seed)
    shifts = -np.exp(rng.uniform(np.log(0.01), np.log(10.0), len(type_names)))
    scales = rng.uniform(0.1, 1.6, len(type_names))
    return {
        "per_type_energy_shifts": {t: float(v) for t, v in zip(type_names, shifts)},
        "per_type_energy_scales": {t: float(v) for t, v in zip(type_names, scales)},
        "per_type_energy_shifts_trainable": False, "per_type_energy_scales_trainable": True,
    }


# NequIP-OAM: the size presets nequip ships (PresetNequIPGNNModel) with the
# settings of the published training configs that the presets do not hold
NEQUIP_OAM_PRESETS: dict[str, dict[str, Any]] = {
    "NequIP-OAM-L": {"preset": "L", "type_embed_num_features": 48},  # the L 0.1 config overrides the preset's 32
    "NequIP-OAM-XL": {"preset": "XL"},
}


def foundation_model_config(name: str, seed: int = 0) -> dict[str, Any]:
    """The model config of a NequIP-OAM foundation model (``NEQUIP_OAM_PRESETS``).

    Architecture: nequip's own ``PresetNequIPGNNModel`` at the model's size
    (nequip 0.19: L = 6 layers, ``l_max = 3``, features ``[128, 64, 32, 32]``;
    XL = 6 layers, ``l_max = 4``, ``[320, 96, 64, 32, 32]``; no parity,
    radial MLP 1 x 128). The rest is the published training configs'
    ``model:`` section (nequip-OAM-L-0.1 / nequip-OAM-XL-0.1, as submitted to
    Matbench Discovery): ``r_max = 6`` A, 8 trainable Bessels, polynomial
    cutoff ``p = 5``, ``avg_num_neighbors = 62.01``, a ZBL pair potential,
    float32, the 89 OAM elements. Per-type energy shifts and scales are
    random and non-zero (:func:`oam_per_type_energies`); weights are
    nequip's random initialisation from ``seed``.
    """
    names = oam_type_names()
    return oam_config(
        "nequip.model.PresetNequIPGNNModel", NEQUIP_OAM_PRESETS, name, seed, r_max=6.0, num_bessels=8,
        bessel_trainable=True, polynomial_cutoff_p=5, avg_num_neighbors=62.012104256525795,
        pair_potential={"_target_": "nequip.nn.pair_potential.ZBL", "units": "metal", "chemical_species": names},
    )


def oam_config(target: str, presets: dict[str, dict[str, Any]], name: str, seed: int = 0,
               **settings: Any) -> dict[str, Any]:
    """The config of OAM foundation model ``name`` of ``presets`` (its model
    section) built by ``target``: float32, the 89 OAM elements, random
    per-type energies (:func:`oam_per_type_energies`), ``settings``."""
    if name not in presets:
        raise ValueError(f"unknown foundation model {name!r} for {target}; known: {sorted(presets)}")
    names = oam_type_names()
    return {"_target_": target, **presets[name], "seed": seed, "model_dtype": "float32", "type_names": names,
            **settings, **oam_per_type_energies(names, seed)}


def foundation_models() -> dict[str, Callable[[], torch.nn.Module]]:
    """The nequip.net NequIP foundation architectures users run, by name,
    with random weights (nothing is downloaded): NequIP-OAM-L and
    NequIP-OAM-XL (:func:`foundation_model_config`)."""
    return {name: functools.partial(build_named, foundation_model_config, name) for name in NEQUIP_OAM_PRESETS}


def build_named(make_config: Callable[[str], dict[str, Any]], name: str) -> torch.nn.Module:
    """The model of ``make_config(name)`` (a foundation builder's body)."""
    return build_model(make_config(name))


def load_model(path: str, device: str = "cpu") -> torch.nn.Module:
    """A local nequip checkpoint (``.ckpt``) or package (``.nequip.zip``),
    loaded with nequip's ``load_saved_model`` (eager), in eval mode. Model
    IDs from nequip.net are refused: nothing is downloaded."""
    from nequip.model.saved_models.load_utils import load_saved_model

    if str(path).startswith("nequip.net:"):
        raise ValueError(f"{path!r} is a nequip.net model ID; ddpad loads local files only (download it first)")
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    with global_state():
        model = load_saved_model(str(path), compile_mode="eager")
    return model.to(device).eval()


def default_system() -> Any:
    """Periodic bulk: a rattled 2x2x2 diamond supercell (64 atoms) of C with
    some H and O."""
    from ase.build import bulk

    atoms = bulk("C", "diamond", a=3.57, cubic=True) * (2, 2, 2)
    atoms.numbers[::8] = 1
    atoms.numbers[3::8] = 8
    atoms.rattle(0.05, seed=0)
    return atoms


def _convolutions(model: torch.nn.Module) -> int:
    """NequIP's message-passing layers: its convolution layers."""
    return sum(type(m).__name__ == "ConvNetLayer" for m in model.modules())


def make_adapter(name: str, *, requires: tuple[str, ...], tools: ToolHooks, **engine: Any) -> Adapter:
    """An adapter for a nequip-framework model family (nequip, allegro):
    everything shared; ``tools`` (its own random and saved models) and
    ``engine`` (fields of :class:`~ddpad.adapters.EngineHooks` that differ,
    e.g. allegro's ``message_layers``) are the family's. Its install hint
    comes from the registry entry of ``name``."""
    hooks: dict[str, Any] = {
        "build_input": build_input,
        "tensor_input": tensor_input,
        "stress_option": None,  # nequip computes stress whenever the input has a cell
        "properties": properties,
        "atom_energy_key": "atomic_energy",
        "message_layers": _convolutions,
        "energy_only_options": {"do_derivatives": False},
        "positions_key": "pos",
        "lammps_input": lammps_input,
    }
    return builtin_adapter(
        name,
        requires=requires,
        make_padder=make_padder,
        energy_key="energy",  # of the flat properties (nequip's own: total_energy)
        cutoff=_cutoff,
        prepare_model=prepare_model,
        call=_step,
        evaluate=evaluate,
        dynamo_config={"trace_autograd_ops": True},
        compile_region=compile_region,
        call_forms=({},),  # NequIPCalculator and the torch-sim integration call model(data)
        grad_input=None,  # the native energy's graph is consumed by its own autograd.grad
        engine=EngineHooks(**{**hooks, **engine}),
        tools=dataclasses.replace(tools, default_system=tools.default_system or default_system),
    )


ADAPTER = make_adapter(
    "nequip",
    requires=("nequip",),  # import names, the model package's first
    tools=ToolHooks(random_model=random_model, load_model=load_model, foundation_models=foundation_models),
)
