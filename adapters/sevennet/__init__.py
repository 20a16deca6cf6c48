"""SevenNet (``sevenn``): COO edge-list padding of sevenn's own batch dict.

The native input is what sevenn's pipeline produces: each structure through
``unlabeled_atoms_to_graph`` -> ``AtomGraphData`` (as ``SevenNetCalculator``
builds it), collated into one batch (as sevenn's torch-sim model and
inference script batch graphs), as a dict: ``x``, ``node_attr`` and
``atomic_numbers`` (atomic numbers, ``[N]``), ``pos``, ``edge_index [2, E]``,
``edge_vec [E, 3]`` (computed on the CPU with the lattice shifts applied),
``cell_volume [S]``, ``num_atoms [S]``, ``batch``, ``ptr``. The model runs in
batch mode; its output is that dict with ``inferred_total_energy [S]``,
``inferred_force``, ``inferred_stress [S, 6]`` (sevenn's order and sign) and
``atomic_energy [N, 1]`` added.

- **float32 only**: sevenn's one-hot embedding casts to ``float32``
  (``OnehotEmbedding``), so a float64 model fails inside sevenn ("both inputs
  should have same dtype"); :func:`random_model` refuses other dtypes.
- Dead atoms form their own dead system and carry a real element (the
  smallest atomic number the model knows): atomic number 0 maps to the
  one-hot index -1, which ``one_hot`` rejects. Joined to a real system they
  would add the species-wise energy shift to its energy.
- Dead edges are self-loops on the last dead atom whose ``edge_vec`` is
  ``(cutoff, 0, 0)``: exactly at the cutoff, where sevenn's envelopes
  (``PolynomialCutoff``, ``XPLORCutoff``) are zero. Beyond it they are
  polynomials that grow without bound (``poly_cut`` with p = 6 is -2726 at
  ``2 cutoff + 1``), and on SevenNet-0 (5 interactions, hundreds of dead
  edges on one atom) the dead atom's features overflowed to NaN: real rows
  stayed exact, but every first-use check saw NaN. No real edge touches a
  dead atom and the dead atoms are a system of their own; the length keeps
  the Bessel basis away from ``r = 0``. The dead system counts the dead
  atoms in ``num_atoms`` (sevenn sizes its force buffer with their sum) and
  has ``cell_volume`` 1.
- Forces and stress come from ``autograd.grad`` of the energy with respect
  to ``edge_vec`` inside ``forward`` (``ForceStressOutputFromEdge``). For
  one compiled graph the compile copy of the model (:func:`prepare_model`)
  keeps that module in training mode (a retained autograd graph that the
  traced ``autograd.grad`` needs), and ``trace_autograd_ops`` and
  ``capture_scalar_outputs`` are set around each compiled call only.
- Fixed sizes: sevenn sizes its energy, force and stress buffers from the
  data (``int(batch.max()) + 1`` systems, ``num_atoms.sum()`` atoms), which
  an ahead-of-time trace cannot fix (``compile_mode="aot"`` refused:
  "data-dependent expression u0"). The compile copy's ``AtomReduce`` and
  ``ForceStressOutputFromEdge`` take both from the padded input's shapes
  instead (the same numbers: the dead system is the last and counts the
  dead atoms), so the step is one graph of fixed shapes, packaged ahead of
  time; ``capture_scalar_outputs`` stays for sevenn variants with other
  data-read sizes.
- The energy is not connected to ``pos`` (sevenn differentiates the edge
  vectors it is given), so there is no position gradient to take: forces
  come from the model's own ``inferred_force``.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping
from typing import Any

import torch
from ddpad.padding import COOPadder, Composition, Fill, NeighborList, Structures
from ddpad.adapters import EngineHooks, ToolHooks
from ddpad.adapters._common import builtin_adapter, detach, diamond_carbon, unknown_elements, voigt_to_full
from torch import Tensor

__all__ = [
    "ADAPTER", "build_input", "default_system", "evaluate", "load_model", "make_padder",
    "prepare_model", "properties", "random_config", "random_model", "save_checkpoint", "tensor_input",
]

ENERGY = "inferred_total_energy"
FORCE = "inferred_force"
STRESS = "inferred_stress"
ATOMIC_ENERGY = "atomic_energy"
EDGE_VEC = "edge_vec"
NUM_ATOMS = "num_atoms"
BATCH = "batch"
MODAL_TYPE = "modal_type"  # multi-fidelity models: each system's modality index (sevenn's KEY.MODAL_TYPE)
# the elements the random model is built for by default (H, C, O)
ELEMENTS: tuple[int, ...] = (1, 6, 8)

ATOM_OUTPUTS = (
    "x", "node_attr", "atomic_numbers", "pos", "batch", "atom_type", "scaled_atomic_energy",
    ATOMIC_ENERGY, FORCE, "inferred_atomic_virial",
)
SYSTEM_OUTPUTS = (ENERGY, STRESS, "cell_volume", "num_atoms", MODAL_TYPE)
EDGE_OUTPUTS = (EDGE_VEC, "edge_length", "edge_embedding", "edge_attr")


def _cutoff(model: torch.nn.Module) -> float:
    return float(model.cutoff)


def _type_map(model: torch.nn.Module) -> dict[int, int]:
    type_map = getattr(model, "type_map", None)
    if not type_map:
        raise ValueError("the sevenn model has no type_map (atomic number -> species index)")
    return {int(z): int(i) for z, i in type_map.items()}


def _modal_map(model: torch.nn.Module) -> dict[str, int]:
    """A multi-fidelity model's modality name -> index (empty for the rest)."""
    return dict(getattr(model, "modal_map", None) or {})


def _modal_types(model: torch.nn.Module, systems: int) -> Tensor | None:
    """``modal_type [S]`` for a multi-fidelity model (None for the rest):
    every system in the model's ``default_modal`` (set by :func:`load_model`,
    as ``SevenNetCalculator`` takes one ``modal`` for all it computes)."""
    modal_map = _modal_map(model)
    if not modal_map:
        return None
    modal = getattr(model, "default_modal", None)
    if modal not in modal_map:
        raise ValueError(f"modality {modal!r} is not one of this multi-fidelity model's {sorted(modal_map)}: "
                         "load it with load_model(..., modal=NAME) or set model.default_modal = NAME")
    return torch.full((systems,), modal_map[modal], dtype=torch.int64)


def make_padder(model: torch.nn.Module, **overrides: Any) -> COOPadder:
    """The SevenNet padder for ``model`` (cutoff ``model.cutoff``); keyword
    arguments override :class:`ddpad.padding.COOPadder`'s.

    Dead atoms get the smallest atomic number in the model's ``type_map`` (a
    valid species: 0 breaks sevenn's one-hot); dead edges are self-loops whose
    ``edge_vec`` is as long as the cutoff, where sevenn's envelopes are zero
    (beyond it they are not: ``dead_edge_length`` of :class:`ddpad.padding.COOPadder`). ``unpad`` also slices the two
    fields sevenn passes through from its input that are not sliced by
    rows: the edge index ``[2, E]`` (along edges) and ``ptr [S + 1]``.
    """
    dead_z = min(_type_map(model))
    config: dict[str, Any] = {
        "positions": "pos",
        "atom_fields": {"x": dead_z, "node_attr": dead_z, "atomic_numbers": dead_z},
        "edge_fields": {EDGE_VEC: Fill.DEAD_SHIFT},
        "system_fields": {"cell_volume": 1.0, **({MODAL_TYPE: 0} if _modal_map(model) else {})},
        "atom_counts": "num_atoms", "dead_edge_length": _cutoff(model),
        "atom_outputs": ATOM_OUTPUTS, "system_outputs": SYSTEM_OUTPUTS, "edge_outputs": EDGE_OUTPUTS,
    }
    config.update(overrides)
    # the input's own edge index and ptr (COOPadder's defaults unless overridden)
    ptr = config.get("ptr", "ptr")
    config.setdefault("edge_pair_outputs", (config.get("edge_index", "edge_index"),))
    config.setdefault("ptr_outputs", () if ptr is None else (ptr,))
    return COOPadder(_cutoff(model), **config)


def _reduce_forward(self: Any, data: dict[str, Tensor]) -> dict[str, Tensor]:
    """``AtomReduce.forward`` in batch mode, with ``len(num_atoms)`` systems
    where sevenn counts ``int(batch.max()) + 1``."""
    if not self._is_batch_data or NUM_ATOMS not in data:
        return type(self).__bases__[0].forward(self, data)
    src = data[self.key_input].squeeze(1)
    output = torch.zeros(data[NUM_ATOMS].shape[0], dtype=src.dtype, device=src.device)
    output.scatter_reduce_(0, data[BATCH], src, reduce="sum")
    data[self.key_output] = output * self.constant
    return data


def _force_stress_forward(self: Any, data: dict[str, Tensor]) -> dict[str, Tensor]:
    """``ForceStressOutputFromEdge.forward`` in batch mode, with ``len(batch)``
    atoms where sevenn sums ``num_atoms`` and ``len(num_atoms)`` systems where
    it counts ``int(batch.max()) + 1``; otherwise sevenn's operations in
    sevenn's order (its ``broadcast`` of a 1-d index is the ``unsqueeze`` /
    ``expand_as`` here)."""
    if not self._is_batch_data:
        return type(self).__bases__[0].forward(self, data)
    batch = data[BATCH]
    n_atoms, n_systems = batch.shape[0], data[NUM_ATOMS].shape[0]
    rij = data[self.key_edge]
    energy = [data[self.key_energy].sum()]
    edge_idx = data[self.key_edge_idx]
    fij = torch.autograd.grad(energy, [rij], create_graph=self.training, allow_unused=True)[0]
    if fij is not None:
        pf = torch.zeros(n_atoms, 3, dtype=fij.dtype, device=fij.device)
        nf = torch.zeros(n_atoms, 3, dtype=fij.dtype, device=fij.device)
        pf.scatter_reduce_(0, edge_idx[0].unsqueeze(-1).expand_as(fij), fij, reduce="sum")
        nf.scatter_reduce_(0, edge_idx[1].unsqueeze(-1).expand_as(fij), fij, reduce="sum")
        data[self.key_force] = pf - nf
        diag = rij * fij
        s12 = rij[..., 0] * fij[..., 1]
        s23 = rij[..., 1] * fij[..., 2]
        s31 = rij[..., 2] * fij[..., 0]
        virial = torch.cat([diag, s12.unsqueeze(-1), s23.unsqueeze(-1), s31.unsqueeze(-1)], dim=-1)
        s = torch.zeros(n_atoms, 6, dtype=fij.dtype, device=fij.device)
        s.scatter_reduce_(0, edge_idx[1].unsqueeze(-1).expand_as(virial), virial, reduce="sum")
        if self.use_atomic_virial:
            data[self.key_atomic_virial] = torch.neg(s)
        sout = torch.zeros((n_systems, 6), dtype=virial.dtype, device=virial.device)
        sout.scatter_reduce_(0, batch.unsqueeze(-1).expand_as(s), s, reduce="sum")
        volume = data[self.key_cell_volume]
        volume[volume < 1e-3] = 1e-3  # sevenn's floor for non-periodic structures (volume 0), in place as sevenn
        data[self.key_stress] = torch.neg(sout) / volume.unsqueeze(-1)
    return data


# sevenn's modules that size a buffer from the data, and their fixed-size forwards
_FIXED_SIZE = {"AtomReduce": ("sevenn.nn.linear", _reduce_forward),
               "ForceStressOutputFromEdge": ("sevenn.nn.force_output", _force_stress_forward)}


@functools.cache
def _fixed_size_class(name: str) -> type:
    """sevenn's module class ``name`` with its fixed-size forward: a subclass,
    so the store's key (the modules' classes) tells the two apart."""
    import importlib

    module, forward = _FIXED_SIZE[name]
    base = getattr(importlib.import_module(module), name)
    return type(f"FixedSize{name}", (base,), {
        "forward": forward, "__module__": __name__, "__qualname__": f"FixedSize{name}",
        "__doc__": f"sevenn's ``{name}`` with the sizes the padded input fixes (ddpad's compile copy).",
    })


def __getattr__(name: str) -> type:
    """The fixed-size classes by name (what unpickling a prepared model looks up)."""
    if name.startswith("FixedSize") and name[len("FixedSize"):] in _FIXED_SIZE:
        return _fixed_size_class(name[len("FixedSize"):])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """A compile-ready copy of ``model``: batch mode, evaluation mode except
    the force module, which stays in training mode (``create_graph=True``:
    the traced ``autograd.grad`` needs the retained graph; in evaluation
    mode Dynamo broke the model into 22 graphs in 12 frames), and no
    parameter gradients.

    sevenn sizes its energy and stress buffers with ``int(batch.max()) + 1``
    systems and its force buffers with ``num_atoms.sum()`` atoms: sizes read
    from the data, which an ahead-of-time trace cannot fix (a data-dependent
    size). On a padded input both are what its shapes already say (the dead
    system is the last and counts the dead atoms), so the copy's
    ``AtomReduce`` and ``ForceStressOutputFromEdge`` take them from the
    shapes (:func:`_fixed_size_class`; the same operations otherwise)."""
    prepared = copy.deepcopy(model)
    for module in prepared.modules():
        name = type(module).__name__
        if name in _FIXED_SIZE and type(module).__module__ == _FIXED_SIZE[name][0]:
            module.__class__ = _fixed_size_class(name)
    prepared.set_is_batch_data(True)
    prepared.eval_modal_map = False  # the input carries each system's modal_type (build_input)
    prepared.eval()
    force = prepared._modules.get("force_output")
    if force is not None:
        force.train(True)
    for p in prepared.parameters():  # inference: no parameter gradients
        p.requires_grad_(False)
    return prepared


# outputs of the force module that an evaluation-mode sevenn returns without
# an autograd graph (``create_graph=False``)
DERIVATIVES = (FORCE, "inferred_atomic_virial")


def _step(model: Any, data: dict[str, Tensor], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """One call: ``edge_vec`` (what forces and stress differentiate) requires
    grad before the compiled call, as the eager model sets it itself. The
    compile copy keeps its force module in training mode; forces are
    detached after, as sevenn's evaluation mode returns them."""
    data[EDGE_VEC].requires_grad_(True)
    out = model(data, *args, **kwargs)
    return detach(out, DERIVATIVES)


def evaluate(model: torch.nn.Module, data: dict[str, Tensor], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The unpadded eager model on ``data`` in batch mode (switched on for this
    call only: a model prepared for ``SevenNetCalculator`` runs unbatched),
    a multi-fidelity model reading ``modal_type`` from ``data`` (not its
    modality names) for this call only."""
    batched = bool(getattr(model, "is_batch_data", True))
    by_name = bool(getattr(model, "eval_modal_map", False))
    model.set_is_batch_data(True)
    model.eval_modal_map = False  # the input carries each system's modal_type (build_input)
    try:
        return model(data, *args, **kwargs)
    finally:
        model.set_is_batch_data(batched)
        model.eval_modal_map = by_name


def build_input(
    model: torch.nn.Module,
    atoms: Any,
    *,
    device: str | torch.device | None = None,
) -> dict[str, Tensor]:
    """sevenn's own batch dict for one ``ase.Atoms`` or a list of them.

    Each structure goes through ``unlabeled_atoms_to_graph`` (sevenn's
    neighbour list, matscipy or ase, on the CPU, with the model's cutoff) and
    ``AtomGraphData.from_numpy_dict`` exactly as ``SevenNetCalculator`` does;
    the graphs are collated into one batch as sevenn's torch-sim model does.
    For a multi-fidelity model (SevenNet-MF-0) every system's ``modal_type``
    is the model's ``default_modal`` (:func:`load_model`). The tensors are
    moved to ``device`` (default: the model's); the
    per-structure ``data_info`` (a list of dicts) is dropped.

    Raises
    ------
    ValueError
        No structure, a structure without atoms, or an atomic number the
        model's ``type_map`` does not know; a multi-fidelity model whose
        ``default_modal`` is not one of its modalities.
    """
    from sevenn.atom_graph_data import AtomGraphData
    from sevenn.train.dataload import unlabeled_atoms_to_graph
    from torch_geometric.loader.dataloader import Collater

    structures = list(atoms) if isinstance(atoms, (list, tuple)) else [atoms]
    if not structures:
        raise ValueError("build_input needs at least one structure")
    empty = [i for i, a in enumerate(structures) if len(a) == 0]
    if empty:
        raise ValueError(f"structure(s) {empty} have no atoms; sevenn needs at least one atom per structure")
    known = _type_map(model)
    unknown = sorted({int(z) for a in structures for z in a.numbers} - set(known))
    if unknown:
        raise unknown_elements(unknown, known)
    cutoff = _cutoff(model)
    graphs = [AtomGraphData.from_numpy_dict(unlabeled_atoms_to_graph(a, cutoff)) for a in structures]
    batch = Collater([], follow_batch=None, exclude_keys=None)(graphs)
    modal_type = _modal_types(model, len(structures))
    target = device if device is not None else next(model.parameters()).device
    data = {k: v.to(target) for k, v in batch.to_dict().items() if isinstance(v, Tensor)}
    if modal_type is not None:
        data[MODAL_TYPE] = modal_type.to(target)
    return data


def tensor_input(model: torch.nn.Module) -> Any:
    """``Structures -> sevenn's batch dict`` on the structures' device: the
    fields of :func:`build_input`, the neighbour list from vesin-torch
    (sevenn's pairs: ``edge_vec = pos[dst] - pos[src] + shift``, computed in
    the positions' dtype, then cast to the model's, as sevenn casts its
    numpy graph). Per composition the atomic-number fields, ``num_atoms``,
    ``ptr`` and the checks; per step the neighbour list, ``edge_vec`` and
    ``cell_volume``."""
    known = frozenset(_type_map(model))
    cutoff = _cutoff(model)
    dtype = next(model.parameters()).dtype
    pairs = NeighborList(cutoff)  # (vesin-torch: an ImportError here, not at the first step)
    state: dict[str, Any] = {}

    def build(structures: Structures) -> dict[str, Tensor]:
        composition = Composition.of(structures, state.get("composition"), known)
        if composition is not state.get("composition"):
            state.update(composition=composition, numbers=structures.numbers.long(),
                         num_atoms=composition.ptr.diff())
        edge_index, _, shifts = pairs(structures, composition)
        positions = structures.positions.detach()
        edge_vec = positions[edge_index[1]] - positions[edge_index[0]] + shifts
        numbers = state["numbers"]
        data = {
            "x": numbers, "edge_index": edge_index, "pos": positions.to(dtype), "node_attr": numbers,
            "atomic_numbers": numbers, "edge_vec": edge_vec.to(dtype),
            "cell_volume": torch.linalg.det(structures.cells.detach()).abs().to(dtype),
            "num_atoms": state["num_atoms"], "batch": composition.system, "ptr": composition.ptr,
        }
        modal_type = _modal_types(model, len(state["num_atoms"]))  # read each step: default_modal may change
        if modal_type is not None:
            data[MODAL_TYPE] = modal_type.to(numbers.device)
        return data

    return build


def properties(output: Mapping[str, Any]) -> dict[str, Any]:
    """Flat ``energy [S]``, ``forces [N, 3]``, ``stress [S, 3, 3]`` (ASE's
    sign and layout: sevenn's ``-inferred_stress`` reordered as its calculator
    does) and per-atom ``energies [N]``, beside sevenn's own energy key."""
    flat: dict[str, Any] = {"energy": output[ENERGY], ENERGY: output[ENERGY]}
    if output.get(FORCE) is not None:
        flat["forces"] = output[FORCE]
    if output.get(STRESS) is not None:
        stress = output[STRESS]
        # sevenn's (xx yy zz xy yz zx), sign of -stress, to ASE's Voigt order and sign
        flat["stress"] = voigt_to_full(-stress[..., [0, 1, 2, 4, 5, 3]])
    if output.get(ATOMIC_ENERGY) is not None:
        flat["energies"] = output[ATOMIC_ENERGY].squeeze(-1)
    return flat


def random_config(
    *,
    cutoff: float = 4.0,
    atomic_numbers: tuple[int, ...] = ELEMENTS,
    channels: int = 16,
    lmax: int = 2,
    num_convolutions: int = 2,
) -> dict[str, Any]:
    """A small sevenn model config, completed with sevenn's own defaults
    (``DEFAULT_E3_EQUIVARIANT_MODEL_CONFIG``, ``chemical_species_preprocess``),
    with non-zero species-wise energy shifts and scales and biases in the
    linear layers. Saved beside the weights it makes a sevenn checkpoint
    (:func:`save_checkpoint`)."""
    import sevenn
    import sevenn._const as const
    import sevenn._keys as KEY
    from ase.data import chemical_symbols
    from sevenn.util import chemical_species_preprocess

    config = copy.deepcopy(const.DEFAULT_E3_EQUIVARIANT_MODEL_CONFIG)
    config.update(chemical_species_preprocess([chemical_symbols[int(z)] for z in atomic_numbers]))
    n = config[KEY.NUM_SPECIES]
    config.update({
        KEY.CUTOFF: float(cutoff),
        KEY.NODE_FEATURE_MULTIPLICITY: channels,
        KEY.LMAX: lmax,
        KEY.NUM_CONVOLUTION: num_convolutions,
        KEY.CONVOLUTION_WEIGHT_NN_HIDDEN_NEURONS: [16, 16],
        KEY.CONV_DENOMINATOR: 12.0,  # training sets it to the average neighbour count
        KEY.SHIFT: [-1.0 - 0.7 * i for i in range(n)],  # species-wise, non-zero
        KEY.SCALE: [1.3 + 0.2 * i for i in range(n)],
        KEY.USE_BIAS_IN_LINEAR: True,
        "version": sevenn.__version__,
    })
    return config


def random_model(
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    *,
    atomic_numbers: tuple[int, ...] = ELEMENTS,
    seed: int = 0,
    **config: Any,
) -> torch.nn.Module:
    """A small randomly initialised SevenNet (``AtomGraphSequential``) built by
    sevenn's ``build_E3_equivariant_model`` from :func:`random_config`
    (``atomic_numbers`` and keyword arguments pass to it), in batch and
    evaluation mode. The linear
    layers' biases, zero-initialised by e3nn, are made random so a padding
    leak would show.

    Raises
    ------
    ValueError
        For a dtype other than ``torch.float32`` (sevenn is float32 only).
    """
    from sevenn.model_build import build_E3_equivariant_model

    if dtype != torch.float32:
        raise ValueError(f"sevenn models are float32 only (its one-hot embedding casts to float32); got {dtype}")
    torch.manual_seed(seed)
    model = build_E3_equivariant_model(random_config(atomic_numbers=atomic_numbers, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.3)
    model.set_is_batch_data(True)
    return model.eval().to(device)


def save_checkpoint(model: torch.nn.Module, config: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``model`` as a sevenn checkpoint (the dict sevenn's trainer writes:
    ``config``, ``model_state_dict``, ``epoch``, ``time``, ``hash``), readable by
    :func:`load_model` and by ``sevenn.util.load_checkpoint``."""
    import uuid
    from datetime import datetime

    torch.save({
        "config": dict(config), "model_state_dict": model.state_dict(), "optimizer_state_dict": {},
        "scheduler_state_dict": {}, "epoch": 0, "time": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "hash": uuid.uuid4().hex,
    }, path)


# sevenn's pretrained names (``pretrained_name_to_path``'s rules: the heads
# "sevennet" and "7net", any case) -> the ``sevenn._const`` constant of the file
_PRETRAINED = {
    "0": "SEVENNET_0_11Jul2024", "0_22may2024": "SEVENNET_0_22May2024", "l3i5": "SEVENNET_l3i5",
    "mf-0": "SEVENNET_MF_0", "mf-ompa": "SEVENNET_MF_ompa", "omat": "SEVENNET_omat", "omni": "SEVENNET_omni",
    "omni-i8": "SEVENNET_omni_i8", "omni-i12": "SEVENNET_omni_i12",
}
_ALIASES = {"0_11july2024": "0", "0_11jul2024": "0"}


def _pretrained_paths(tail: str) -> list[str]:
    """Where sevenn keeps the file of the pretrained model ``7net-<tail>``
    (the wheel's folder, then its download cache); empty for another name."""
    import sevenn._const as const

    path = getattr(const, _PRETRAINED.get(_ALIASES.get(tail, tail), ""), None)
    if path is None:
        return []
    return [path, path.replace(const._prefix, os.path.expanduser("~/.cache/sevennet"))]


def _pretrained_file(name: str) -> str | None:
    """The local file of sevenn's pretrained model ``name`` (in the wheel's
    ``pretrained_potentials`` or sevenn's download cache), None for a name
    that is not sevenn's.

    Raises
    ------
    FileNotFoundError
        A pretrained name whose file is not on this machine (sevenn would
        download it; ddpad never does).
    """
    head, _, tail = name.lower().partition("-")
    paths = _pretrained_paths(tail) if head in ("7net", "sevennet") else []
    if not paths:
        return None
    for candidate in paths:
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"{name!r} is a sevenn pretrained model that is not on this machine: sevenn would download it, ddpad "
        f"never does. Download it with sevenn (sevenn.util.pretrained_name_to_path({name!r})) and pass the "
        f"file, or use one this machine has: {', '.join(shipped_models())}")


def shipped_models() -> list[str]:
    """The names of sevenn's pretrained models whose files are on this machine
    (the wheel ships ``7net-0``, ``7net-0_22may2024``, ``7net-l3i5`` and
    ``7net-mf-0``), each taken by :func:`load_model` without a download."""
    return [f"7net-{tail}" for tail in _PRETRAINED if any(map(os.path.isfile, _pretrained_paths(tail)))]


def load_model(path: str, device: str = "cpu", *, modal: str | None = None) -> torch.nn.Module:
    """A model from a sevenn checkpoint (``checkpoint_*.pth``) or one of sevenn's
    pretrained names whose file is on this machine (``7net-0``,
    ``7net-l3i5``, ``7net-mf-0``: :func:`shipped_models`), built with
    ``SevenNetCheckpoint.build_model`` as ``SevenNetCalculator`` builds it, in
    batch and evaluation mode. Never downloads: a pretrained name whose file
    is missing is a ``FileNotFoundError`` saying so.

    A multi-fidelity model (``7net-mf-0``) runs every structure in the
    modality ``modal`` (default: the checkpoint's ``default_modal``, PBE for
    SevenNet-MF-0; R2SCAN is its other), kept as the model's
    ``default_modal``: set that attribute to change it."""
    from sevenn.checkpoint import SevenNetCheckpoint

    file = path if os.path.isfile(path) else _pretrained_file(str(path))
    if file is None:
        raise FileNotFoundError(f"no sevenn checkpoint at {path!r}: give a file, or a pretrained name this "
                                f"machine has ({', '.join(shipped_models())})")
    checkpoint = SevenNetCheckpoint(file)
    model = checkpoint.build_model()
    model.set_is_batch_data(True)
    if _modal_map(model):
        model.default_modal = modal if modal is not None else checkpoint.config.get("default_modal")
        _modal_types(model, 1)  # a modality the model does not know: refused here
    elif modal is not None:
        raise ValueError(f"modal={modal!r} given, but {path!r} is not a multi-fidelity model")
    return model.eval().to(device)


def foundation_models() -> dict[str, Any]:
    """The trained models sevenn's wheel ships that users run, by name:
    SevenNet-0 (11Jul2024; the 22May2024 one shares its architecture),
    SevenNet-l3i5, and the multi-fidelity SevenNet-MF-0 in its default
    modality (PBE)."""
    return {name: functools.partial(load_model, name) for name in ("7net-0", "7net-l3i5", "7net-mf-0")}


default_system = diamond_carbon


def ase_calculator(model: torch.nn.Module) -> Any:
    """sevenn's own ``SevenNetCalculator`` around ``model``, on its device."""
    from sevenn.calculator import SevenNetCalculator

    return SevenNetCalculator(model, device=str(next(model.parameters()).device))


def torchsim_model(model: torch.nn.Module) -> Any:
    """torch-sim's own ``SevenNetModel`` around ``model`` (torch-sim 0.3.0's
    imports a name sevenn 0.13 no longer has: an ``ImportError`` then)."""
    from torch_sim.models.sevennet import SevenNetModel

    param = next(model.parameters())
    return SevenNetModel(model, device=param.device, dtype=param.dtype)


ADAPTER = builtin_adapter(
    "sevennet",
    requires=("sevenn",),  # import names, the model package's first
    make_padder=make_padder,
    energy_key=ENERGY,
    cutoff=_cutoff,
    prepare_model=prepare_model,
    call=_step,
    evaluate=evaluate,
    dynamo_config={"trace_autograd_ops": True, "capture_scalar_outputs": True},
    call_forms=({},),
    grad_input=None,
    engine=EngineHooks(
        build_input=build_input,
        tensor_input=tensor_input,
        properties=properties,
        atom_energy_key=ATOMIC_ENERGY,
        positions_key=None,  # its input holds edge vectors made from positions: LAMMPS cannot differentiate it
        message_layers=lambda model: sum(type(m).__name__ == "IrrepsConvolution" for m in model.modules()),
    ),
    tools=ToolHooks(
        random_model=random_model,
        random_model_elements=ELEMENTS,
        load_model=load_model,
        default_system=default_system,
        ase_calculator=ase_calculator,
        torchsim_model=torchsim_model,
        foundation_models=foundation_models,
    ),
)
