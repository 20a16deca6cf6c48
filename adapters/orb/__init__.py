"""Orb (``orb-models``): COO padding of orb's own featurised graph (``AtomGraphs``).

The native input is what orb's calculator builds
(``ase_atoms_to_atom_graphs`` with the model's ``system_config``, batched by
``batch_graphs``): ``senders`` / ``receivers``, ``n_node`` / ``n_edge`` and
the ``node_features`` (``positions``, ``atomic_numbers``,
``atomic_numbers_embedding``, ...), ``edge_features`` (``vectors``,
``unit_shifts``) and ``system_features`` (``cell``, ``pbc``, ``lattice``,
...) dicts. The graph is built before the model runs, so it is padded
before the model, like MACE's: :class:`OrbPadder` flattens the
``AtomGraphs`` into one dict, pads it with :class:`ddpad.padding.COOPadder` and
rebuilds an ``AtomGraphs`` of the same class.

- Dead atoms form their own dead system (one more ``n_node`` / ``n_edge`` /
  cell entry), all-zero one-hot embedding, atomic number 0, placed beyond
  the real atoms' bounding box. Joined to a real system they would add their
  energy-head output (and reference energy) to that system's energy.
- Dead edges are self-loops on the dead atom with ``unit_shifts = (1, 0, 0)``
  through the dead system's cubic cell of edge ``2 * cutoff + 1``; their
  stored ``vectors`` are ``(2 * cutoff + 1, 0, 0)``, exactly what the
  conservative models recompute from positions, unit shifts and cell
  (``compute_differentiable_edge_vectors``, which finds each edge's cell
  through ``n_edge``: the dead edges are counted by the dead system). The
  length is beyond both the graph radius and orb's hard-wired 6 A envelope
  (Bessel basis and attention cutoff), so the envelope is exactly zero and
  nothing divides by zero; the ZBL pair term uses ``Z + 1`` (finite for 0).
- The wrapped model is called as orb's calculator calls it:
  ``model.predict(batch)`` (absolute energies; ``grad_forces`` /
  ``grad_stress`` for conservative heads, ``forces`` / ``stress`` for
  direct ones). :func:`prepare_model` compiles :class:`OrbPredict` over a
  private copy of the model. For conservative heads it is orb's
  ``predict`` rebuilt from orb's own modules and functions with the stress
  displacement and rotation generator (leaves that require grad, a graph
  break when made inside) created by :func:`_step` outside the compiled
  region: energy, autograd forces and stress are ONE graph
  (``trace_autograd_ops`` scoped to each call). orb sums per-system values
  with ``repeat_interleave(n_node)``, whose output length is data-dependent:
  ``capture_dynamic_output_shape_ops`` (scoped too) keeps it in the graph.
  Direct heads run orb's ``predict`` unchanged: its net-torque removal
  branches on ``torch.any(cell == 0)`` in Python, so they compile as a
  fixed set of frames, each once (+ once per growth).

Tested with orb-models 0.5.5, the last release that installs on Python
3.11 (0.6 and later require Python >= 3.12 and moved the featurisation to
``orb_models.common``; they are not supported yet).
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any

import torch
from ddpad.padding import COOPadder, Composition, Fill, Structures
from ddpad.adapters import EngineHooks, ToolHooks
from ddpad.adapters._common import builtin_adapter, diamond_carbon, voigt_to_full
from torch import Tensor

__all__ = [
    "ADAPTER", "OrbPadder", "OrbPredict", "build_input", "default_system", "foundation_models", "load_model",
    "make_padder", "prepare_model", "pretrained_architecture", "properties", "random_model", "tensor_input",
]

# fills of the dead rows, by feature dict; unlisted tensors get 0
NODE_FIELDS: dict[str, Any] = {"atomic_numbers": 0, "atomic_numbers_embedding": 0.0, "atom_identity": 0}
EDGE_FIELDS: dict[str, Any] = {"vectors": Fill.DEAD_SHIFT, "unit_shifts": Fill.DEAD_UNIT_SHIFT}
SYSTEM_FIELDS: dict[str, Any] = {"cell": Fill.DEAD_CELL, "pbc": True, "total_charge": 0.0, "total_spin": Fill.LAST_REAL}
ATOM_OUTPUTS = ("grad_forces", "forces", "confidence")
SYSTEM_OUTPUTS = ("energy", "free_energy", "grad_stress", "stress", "rotational_grad")
ENVELOPE_RADIUS = 6.0  # orb's hard-wired envelope radius (nn_util.get_cutoff, BesselBasis r_max)
_SEP = ":"  # flat key = "<group>:<name>"


def _cutoff(model: torch.nn.Module) -> float:
    """The graph radius, or orb's envelope radius if larger (dead edges must clear both)."""
    inner = model.model if isinstance(model, OrbPredict) else model
    config = getattr(inner, "system_config", None)
    radius = float(config.radius) if config is not None else ENVELOPE_RADIUS
    return max(radius, ENVELOPE_RADIUS)


class OrbPadder(COOPadder):
    """:class:`ddpad.padding.COOPadder` for orb's ``AtomGraphs``.

    The graph is flattened to ``{"node:<name>", "edge:<name>",
    "system:<name>", "node_target:<name>", ..., "edge_index", "n_node",
    "n_edge", "max_num_neighbors", "system_id", "fix_atoms", "tags"}``,
    padded, and rebuilt as the input's class. Per-atom tensors other than
    those in :data:`NODE_FIELDS` get 0 in dead rows; per-system ones the
    fill in :data:`SYSTEM_FIELDS` or 0; ``n_node`` / ``n_edge`` of the dead
    system count the dead atoms / edges.
    """

    def __init__(self, cutoff: float, **overrides: Any) -> None:
        config: dict[str, Any] = {
            "positions": "node:positions", "edge_index": "edge_index", "system_index": None, "ptr": None,
            "system_count": "n_node", "atom_counts": "n_node", "edge_counts": "n_edge",
            "atom_outputs": ATOM_OUTPUTS, "system_outputs": SYSTEM_OUTPUTS,
            # a placeholder that switches on dead self-loops (the real specs are set per graph)
            "edge_fields": {"edge:vectors": Fill.DEAD_SHIFT},
        }
        config.update(overrides)
        super().__init__(cutoff, **config)

    # -- AtomGraphs <-> flat dict -------------------------------------------

    @staticmethod
    def flatten(graph: Any) -> dict[str, Tensor]:
        """One flat dict of every tensor of ``graph``."""
        if not hasattr(graph, "senders") or not hasattr(graph, "node_features"):
            raise TypeError(f"the orb padder takes an orb AtomGraphs, got {type(graph).__name__}")
        flat: dict[str, Tensor] = {"edge_index": torch.stack([graph.senders, graph.receivers])}
        for group in ("node_features", "edge_features", "system_features", "node_targets", "edge_targets",
                      "system_targets"):
            for name, value in (getattr(graph, group) or {}).items():
                if isinstance(value, Tensor):
                    flat[f"{_group_prefix(group)}{_SEP}{name}"] = value
        for name in ("n_node", "n_edge", "max_num_neighbors", "system_id", "fix_atoms", "tags"):
            value = getattr(graph, name, None)
            if isinstance(value, Tensor):
                flat[name] = value
        return flat

    @staticmethod
    def rebuild(graph: Any, flat: dict[str, Tensor]) -> Any:
        """An ``AtomGraphs`` like ``graph`` holding the tensors of ``flat``."""
        values: dict[str, Any] = {name: getattr(graph, name) for name in _constructor_args(type(graph))}
        values["senders"], values["receivers"] = flat["edge_index"][0], flat["edge_index"][1]
        for group in ("node_features", "edge_features", "system_features", "node_targets", "edge_targets",
                      "system_targets"):
            old = getattr(graph, group)
            if old is None:
                continue
            prefix = _group_prefix(group) + _SEP
            values[group] = {
                name: flat.get(prefix + name, value) for name, value in old.items()
            }
        for name in ("n_node", "n_edge", "max_num_neighbors", "system_id", "fix_atoms", "tags"):
            if name in flat:
                values[name] = flat[name]
        return type(graph)(**{k: v for k, v in values.items() if k in _constructor_args(type(graph))})

    # -- COOPadder hooks ------------------------------------------------------

    def count(self, data: Any) -> dict[str, int]:
        return super().count(self.flatten(data))

    def write_padded(self, data: Any, counts: dict[str, int], caps: Any) -> Any:
        flat = self.flatten(data)
        self.atom_fields, self.edge_fields, self.system_fields = _field_specs(flat)
        return self.rebuild(data, super().write_padded(flat, counts, caps))


def _group_prefix(group: str) -> str:
    return group.replace("_features", "").replace("_targets", "_target")


def _constructor_args(cls: type) -> tuple[str, ...]:
    fields = getattr(cls, "_fields", None)  # orb 0.5: a NamedTuple
    if fields is not None:
        return tuple(fields)
    return tuple(p for p in inspect.signature(cls).parameters if p != "self")


def _field_specs(flat: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Fill specs for the tensors present: per-atom, per-edge, per-system."""
    atoms: dict[str, Any] = {"fix_atoms": False, "tags": 0}
    edges: dict[str, Any] = {}
    systems: dict[str, Any] = {"max_num_neighbors": Fill.LAST_REAL, "system_id": 0}
    for key in flat:
        group, _, name = key.partition(_SEP)
        if group in ("node", "node_target") and key != "node:positions":
            atoms[key] = NODE_FIELDS.get(name, 0) if group == "node" else 0
        elif group in ("edge", "edge_target"):
            edges[key] = EDGE_FIELDS.get(name, 0) if group == "edge" else 0
        elif group in ("system", "system_target"):
            systems[key] = SYSTEM_FIELDS.get(name, 0) if group == "system" else 0
    return atoms, edges, systems


def make_padder(model: torch.nn.Module, **overrides: Any) -> OrbPadder:
    """The orb padder for ``model`` (cutoff: :func:`_cutoff`); keyword
    arguments override :class:`ddpad.padding.COOPadder`'s."""
    return OrbPadder(_cutoff(model), **overrides)


class OrbPredict(torch.nn.Module):
    """``forward(batch) = model.predict(batch)``: what orb's calculator calls,
    as a module ``torch.compile`` can compile whole.

    For a conservative model, orb's ``predict`` creates its stress
    displacement and rotation generator (leaf tensors that require grad)
    inside ``forward`` and checks its normaliser's std with a Python ``if``:
    both break a compiled graph. :meth:`conservative` is the same
    computation with the leaves passed in (made by the caller, outside the
    compiled region) and without the check, from orb's own modules and
    functions (the GNS, heads, ZBL term, ``compute_gradient_forces_and_stress``),
    in orb's order of operations: the eager model and this give the same
    numbers. ``forward`` with no leaves is orb's ``predict`` unchanged.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def system_config(self) -> Any:
        return getattr(self.model, "system_config", None)

    def forward(
        self, batch: Any, displacement: Tensor | None = None, generator: Tensor | None = None,
    ) -> dict[str, Tensor]:
        if displacement is None or generator is None:
            return self.model.predict(batch)
        return self.conservative(batch, displacement, generator)

    def conservative(self, batch: Any, displacement: Tensor, generator: Tensor) -> dict[str, Tensor]:
        """orb's ``ConservativeForcefieldRegressor.predict`` with the
        displacement and generator leaves given."""
        from orb_models.forcefield.forcefield_utils import (
            compute_gradient_forces_and_stress,
        )

        model = self.model
        positions = batch.node_features["positions"]
        vectors = _edge_vectors(batch, positions, displacement, generator)
        batch.system_features["stress_displacement"] = displacement
        batch.system_features["generator"] = generator
        batch.edge_features["vectors"] = vectors
        out = model.model(batch)
        node_features = out["node_features"]
        energy_head = model.heads[model.energy_name]
        raw_energy = energy_head.denormalize(energy_head(node_features, batch), batch)
        if model.pair_repulsion:
            raw_energy = raw_energy + model.pair_repulsion_fn(batch)["energy"]
        forces, stress, rotational_grad = compute_gradient_forces_and_stress(
            energy=raw_energy, positions=positions, displacement=displacement, cell=batch.system_features["cell"],
            # a retained graph (orb: training=True), which the traced autograd.grad needs, as mace's
            training=True, compute_stress=model.has_stress, generator=generator,
        )
        # predict() returns denormalize(normalize(raw)): the same round trip, minus the std check
        normalizer = energy_head.normalizer.bn
        reference = energy_head.reference(batch.atomic_numbers, batch.n_node)
        x = raw_energy - reference
        if energy_head.atom_avg:  # systems padding the system cap hold no atoms: no 0 / 0
            n_node = batch.n_node
            x = x / torch.where(n_node > 0, n_node, torch.ones_like(n_node))
        x = (x - normalizer.running_mean) / torch.sqrt(normalizer.running_var)
        result = {model.energy_name: energy_head.denormalize(x, batch), model.grad_forces_name: forces}
        if model.has_stress:
            result[model.grad_stress_name] = stress
        result[model.grad_rotation_name] = rotational_grad
        for name in model.extra_properties:
            head = model.heads[name]
            pred = head(node_features, batch)
            if hasattr(head, "denormalize"):
                result[name] = head.denormalize(pred, batch)
            elif name == "confidence":
                result[name] = torch.softmax(pred, dim=-1)
            else:
                raise ValueError(f"Expected normalizer or confidence head, got {name}.")
        return result


def _edge_vectors(batch: Any, positions: Tensor, displacement: Tensor, generator: Tensor) -> Tensor:
    """orb's ``compute_differentiable_edge_vectors`` with given leaves."""
    from orb_models.forcefield.featurization_utilities import rotation_from_generator

    cell = batch.system_features["cell"]
    node_system = batch._get_per_node_graph_indices()
    symmetric = 0.5 * (displacement + displacement.transpose(-1, -2))
    positions = positions + torch.bmm(positions.unsqueeze(1), symmetric[node_system]).squeeze(1)
    cell = cell + torch.bmm(cell, symmetric)
    rotation = rotation_from_generator(generator)
    positions = torch.bmm(positions.unsqueeze(1), rotation[node_system]).squeeze(1)
    cell = torch.bmm(cell, rotation)
    shifts = torch.bmm(batch.edge_features["unit_shifts"].unsqueeze(1), cell[batch._get_per_edge_graph_indices()])
    return positions[batch.receivers] - positions[batch.senders] + shifts.squeeze(1)


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """A compile-ready copy of ``model`` (left unmodified) in :class:`OrbPredict`.

    The ZBL term reads its envelope power from a 0-d buffer with
    ``float(p)``, a graph break (or, with captured scalars, a data-dependent
    guard in ``pow``'s backward): the copy holds it as the Python number it is.
    """
    if isinstance(model, OrbPredict):
        return model
    if not hasattr(model, "predict") or not hasattr(model, "heads"):
        raise TypeError(f"the orb adapter takes an orb forcefield regressor, got {type(model).__name__}")
    core = copy.deepcopy(model)
    zbl = getattr(core, "pair_repulsion_fn", None)
    if zbl is not None and isinstance(zbl._buffers.get("p"), Tensor):
        power = int(zbl._buffers.pop("p"))
        zbl.p = power
    return OrbPredict(core)


def _step(model: Any, batch: Any, *, split: bool = False) -> dict[str, Tensor]:
    """One call as orb's calculator makes it (``predict(batch, split=False)``).
    Positions already require grad (the conservative heads differentiate
    them), so that flag is not set inside the compiled region."""
    if split:
        raise ValueError("the padded orb model returns batched outputs: split=True is not supported "
                         "(split the unpadded outputs with n_node instead)")
    batch.node_features["positions"].requires_grad_(True)
    core = getattr(model, "_orig_mod", model)  # under torch.compile
    inner = core.model if isinstance(core, OrbPredict) else core
    if not isinstance(core, OrbPredict) or not hasattr(inner, "grad_forces_name"):  # orb's predict as is
        return model(batch)
    cell = batch.system_features["cell"]
    displacement = torch.zeros_like(cell, requires_grad=True)
    generator = torch.zeros_like(cell, requires_grad=True)
    return model(batch, displacement, generator)


def _evaluate(model: torch.nn.Module, batch: Any, *, split: bool = False) -> dict[str, Tensor]:
    """The unpadded eager reference: ``model.predict`` on a copy of ``batch``."""
    inner = model.model if isinstance(model, OrbPredict) else model
    return inner.predict(batch.clone(), split=split)


def properties(output: dict[str, Tensor]) -> dict[str, Tensor]:
    """Flat ``energy`` / ``forces`` / ``stress`` (``[S, 3, 3]``, ASE's sign, as
    orb's calculator reports it in Voigt form): the conservative (gradient) forces and stress when
    the model has them, else the direct ones."""
    flat = dict(output)
    if "grad_forces" in output:
        flat["forces"] = output["grad_forces"]
        if "forces" in output:
            flat["direct_forces"] = output["forces"]
    if "grad_stress" in output:
        flat["stress"] = output["grad_stress"]
        if "stress" in output:
            flat["direct_stress"] = output["stress"]
    if "stress" in flat:  # orb's Voigt [S, 6] (xx yy zz yz xz xy) -> [S, 3, 3], as mace's
        flat["stress"] = voigt_to_full(flat["stress"])
    return flat


def build_input(
    model: torch.nn.Module, atoms: Any, *, device: str | torch.device | None = None,
    edge_method: Any = None, max_num_neighbors: int | None = None,
) -> Any:
    """orb's ``AtomGraphs`` batch for one ``ase.Atoms`` or a list of them.

    Built as orb's calculator builds it: ``ase_atoms_to_atom_graphs`` with the
    model's ``system_config`` (its radius and neighbour limit; the default
    edge method, scipy on the CPU), in the model's dtype, then
    ``batch_graphs`` and moved to ``device`` (default: the model's).

    Raises
    ------
    ValueError
        No structure, a structure without atoms, or an atomic number orb's
        118-wide one-hot embedding cannot hold.
    """
    batch_graphs, ase_atoms_to_atom_graphs = _featurisation()
    structures = list(atoms) if isinstance(atoms, (list, tuple)) else [atoms]
    if not structures:
        raise ValueError("build_input needs at least one structure")
    for i, a in enumerate(structures):
        if len(a) == 0:
            raise ValueError(f"structure {i} has no atoms; orb cannot featurise an empty structure")
        bad = sorted({int(z) for z in a.numbers if not 1 <= int(z) < 118})
        if bad:
            raise ValueError(f"structure {i}: atomic numbers {bad} are outside orb's elements 1..117")
    inner = model.model if isinstance(model, OrbPredict) else model
    param = next(inner.parameters())
    config = inner.system_config
    graphs = [
        ase_atoms_to_atom_graphs(a, config, edge_method=edge_method, max_num_neighbors=max_num_neighbors,
                                 output_dtype=param.dtype)
        for a in structures
    ]
    batch = batch_graphs(graphs) if len(graphs) > 1 else graphs[0]
    return batch.to(device if device is not None else param.device)


def _cellpar(cell: Tensor) -> Tensor:
    """``[6]`` lengths and angles (degrees) of ``cell``'s rows, as ASE's
    ``cell_to_cellpar`` (90 where a vector has no length)."""
    lengths = cell.norm(dim=1)
    angles = []
    for j, k in ((2, 1), (0, 2), (1, 0)):  # alpha (b, c), beta (a, c), gamma (a, b), as ASE pairs them
        ll = lengths[j] * lengths[k]
        cosine = (cell[j] @ cell[k]) / torch.where(ll > 1e-16, ll, 1.0)
        angles.append(torch.where(ll > 1e-16, torch.rad2deg(torch.arccos(cosine)), 90.0))
    return torch.cat([lengths, torch.stack(angles)])


def tensor_input(model: torch.nn.Module, *, edge_method: Any = None,
                 max_num_neighbors: int | None = None) -> Any:
    """``Structures -> orb's AtomGraphs batch`` on the structures' device, as
    :func:`build_input` makes it (``ase_atoms_to_atom_graphs`` then
    ``batch_graphs``): positions wrapped into periodic cells, the one-hot
    embedding, lattice parameters, and each system's graph from orb's own
    ``compute_pbc_radius_graph`` (its nearest ``max_num_neighbors`` within the
    radius). ``edge_method=None`` is orb's choice for the tensors' device, as
    its calculator makes it: scipy's k-d tree on the CPU (the pipeline's
    graph, exactly), brute force on a GPU (equal distances, such as a
    small cell's own images, may then pick another of the tied neighbours).
    Per composition the atom fields and the checks; per step the positions,
    cells and graphs."""
    from orb_models.forcefield import featurization_utilities as feat_util
    from orb_models.forcefield.base import AtomGraphs

    batch_graphs, _ = _featurisation()
    inner = model.model if isinstance(model, OrbPredict) else model
    dtype = next(inner.parameters()).dtype
    config = inner.system_config
    neighbours = max_num_neighbors or config.max_num_neighbors
    state: dict[str, Any] = {}

    def build(structures: Structures) -> Any:
        composition = Composition.of(structures, state.get("composition"), frozenset(range(1, 118)))
        device = structures.positions.device
        if composition is not state.get("composition"):
            mixed = [i for i, pbc in enumerate(composition.pbc) if len(set(pbc)) > 1]
            if mixed:  # as ase_atoms_to_atom_graphs
                raise ValueError(f"ddpad: system(s) {mixed} are periodic along some axes only; orb takes periodic "
                                 "or non-periodic systems (pad a slab with vacuum and make it periodic)")
            numbers = structures.numbers.long()
            state.update(composition=composition, systems=[{
                "atomic_numbers": numbers[lo:hi],
                "atomic_numbers_embedding": torch.nn.functional.one_hot(numbers[lo:hi], 118).to(dtype),
                "atom_identity": torch.arange(hi - lo, device=device),
                "pbc": torch.tensor(pbc, dtype=torch.bool, device=device),
            } for (lo, hi), pbc in zip(composition.ranges, composition.pbc)])
        graphs = []
        for (lo, hi), periodic, atom in zip(composition.ranges, composition.pbc, state["systems"]):
            index = len(graphs)
            cell = structures.cells[index].detach().double()
            positions = structures.positions[lo:hi].detach().double()
            if any(periodic):  # (a periodic cell has a volume: Composition checked it)
                positions = feat_util.map_to_pbc_cell(positions, cell)
            edge_index, vectors, unit_shifts = feat_util.compute_pbc_radius_graph(
                positions=positions, cell=cell, pbc=atom["pbc"], radius=config.radius,
                max_number_neighbors=neighbours, edge_method=edge_method, device=device,
                float_dtype=torch.get_default_dtype())  # (the pipeline's graph dtype)
            graphs.append(AtomGraphs(
                senders=edge_index[0], receivers=edge_index[1],
                n_node=torch.tensor([hi - lo], device=device),
                n_edge=torch.tensor([edge_index.shape[1]], device=device),
                node_features={"positions": positions, "atomic_numbers": atom["atomic_numbers"],
                               "atomic_numbers_embedding": atom["atomic_numbers_embedding"],
                               "atom_identity": atom["atom_identity"]},
                edge_features={"vectors": vectors, "unit_shifts": unit_shifts},
                system_features={"cell": cell.unsqueeze(0), "pbc": atom["pbc"].unsqueeze(0),
                                 "lattice": _cellpar(cell).unsqueeze(0)},
                node_targets={}, edge_targets={}, system_targets={}, fix_atoms=None,
                tags=torch.zeros(hi - lo, device=device), radius=config.radius,
                max_num_neighbors=torch.tensor([neighbours], device=device), system_id=None,
            ).to(device=device, dtype=dtype))
        return batch_graphs(graphs) if len(graphs) > 1 else graphs[0]

    return build


def _featurisation() -> tuple[Any, Any]:
    """orb's ``batch_graphs`` and ``ase_atoms_to_atom_graphs``."""
    try:
        from orb_models.forcefield.atomic_system import ase_atoms_to_atom_graphs
        from orb_models.forcefield.base import batch_graphs
    except ImportError as exc:  # orb-models >= 0.6 (Python >= 3.12) moved them
        raise ImportError(
            "the ddpad orb adapter supports orb-models 0.5.x (orb_models.forcefield.atomic_system); "
            f"this orb-models has another layout: {exc}"
        ) from exc

    return batch_graphs, ase_atoms_to_atom_graphs


def random_model(
    dtype: torch.dtype | None = None, device: str = "cpu", *, conservative: bool = True, radius: float = 6.0,
    max_num_neighbors: int = 20, latent_dim: int = 32, steps: int = 2, seed: int = 0,
) -> torch.nn.Module:
    """A small randomly initialised Orb v3 model from orb's own architecture
    builders (``orb_v3_conservative_architecture`` or
    ``orb_v3_direct_architecture``), with random biases, norm weights and
    energy normaliser statistics (zero biases would hide a padding leak) and
    orb's default reference energies."""
    from orb_models.forcefield import pretrained
    from orb_models.forcefield.atomic_system import SystemConfig

    torch.manual_seed(seed)
    builder = pretrained.orb_v3_conservative_architecture if conservative else pretrained.orb_v3_direct_architecture
    model = builder(
        latent_dim=latent_dim, base_mlp_hidden_dim=2 * latent_dim, head_mlp_hidden_dim=latent_dim,
        num_message_passing_steps=steps, system_config=SystemConfig(radius=radius, max_num_neighbors=max_num_neighbors),
        device="cpu",
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("normalizer.bn.running_mean"):
                b.normal_(0.0, 1.0)
            elif name.endswith("normalizer.bn.running_var"):
                b.uniform_(0.5, 2.0)
    model = model.to(dtype=dtype or torch.float32, device=device).eval()
    for p in model.parameters():  # inference, as orb's loaders leave it
        p.requires_grad_(False)
    return model


def load_model(path: str, device: str = "cpu", *, architecture: str | None = None) -> torch.nn.Module:
    """A local orb checkpoint.

    Either a whole module saved with ``torch.save(model)``, or an orb
    state-dict checkpoint (``orb-v3-conservative-20-omat-20250404.ckpt``)
    loaded by orb's own loader for ``architecture`` (a key of
    ``orb_models.forcefield.pretrained.ORB_PRETRAINED_MODELS``; by default
    the longest key the file name starts with), uncompiled, float32.
    """
    import os

    from orb_models.forcefield import pretrained

    obj = torch.load(path, map_location=device, weights_only=False)
    if isinstance(obj, torch.nn.Module):
        model = obj.eval()
    elif isinstance(obj, dict):
        loaders = pretrained.ORB_PRETRAINED_MODELS
        if architecture is None:
            stem = os.path.basename(path)
            matches = sorted((k for k in loaders if stem.startswith(k)), key=len)
            if not matches:
                raise ValueError(
                    f"{path}: a state dict; name its architecture (load_model(path, architecture=...)), "
                    f"one of {sorted(loaders)}"
                )
            architecture = matches[-1]
        if architecture not in loaders:
            raise ValueError(f"unknown orb architecture {architecture!r}; known: {sorted(loaders)}")
        # orb's loader sets the global default dtype and matmul precision: scoped here
        default_dtype, matmul = torch.get_default_dtype(), torch.get_float32_matmul_precision()
        try:
            model = loaders[architecture](weights_path=path, device=device, compile=False)
        finally:
            torch.set_default_dtype(default_dtype)
            torch.set_float32_matmul_precision(matmul)
    else:
        raise TypeError(f"{path} holds a {type(obj).__name__}, not an orb model or state dict")
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# the published models the kit checks -> orb's architecture builder whose parameters their
# constructors in ``orb_models.forcefield.pretrained`` load (checked: the load is strict)
FOUNDATION_ARCHITECTURES = {
    "orb-v3-conservative-inf-omat": "orb_v3_conservative_architecture",
    "orb-v3-direct-20-omat": "orb_v3_direct_architecture",
}


def pretrained_architecture(name: str, device: str = "cpu", *, seed: int = 0) -> torch.nn.Module:
    """Published orb model ``name`` (a key of :data:`FOUNDATION_ARCHITECTURES`)
    with random weights, built by orb's own constructor for it
    (``pretrained.ORB_PRETRAINED_MODELS[name]``: its ``SystemConfig``, its
    architecture builder at orb's default sizes, ``load_model``'s float32
    precision, eval mode, frozen parameters), uncompiled. The constructor
    downloads its checkpoint from a URL by default; here it is given a local
    one instead, saved from the architecture builder with random weights
    (orb's initialisation, its default reference energies; the normalisers'
    statistics, zero mean and unit variance at initialisation, made random),
    and loads it strictly."""
    import os
    import tempfile

    from orb_models.forcefield import pretrained

    torch.manual_seed(seed)
    architecture = getattr(pretrained, FOUNDATION_ARCHITECTURES[name])()
    with torch.no_grad():
        for key, buffer in architecture.named_buffers():
            if key.endswith("normalizer.bn.running_mean"):
                buffer.normal_(0.0, 1.0)
            elif key.endswith("normalizer.bn.running_var"):
                buffer.uniform_(0.5, 2.0)
    with tempfile.TemporaryDirectory(prefix="ddpad-orb-") as folder:
        path = os.path.join(folder, f"{name}-random.ckpt")
        torch.save(architecture.state_dict(), path)
        return load_model(path, device, architecture=name)


def foundation_models() -> dict[str, Any]:
    """The published Orb v3 models users run, by name, with random weights
    (:func:`pretrained_architecture`, no download; orb-models 0.5.5): the
    conservative model with unlimited neighbours (``orb-v3-conservative-inf-omat``,
    120 within 6 A) and the direct one with 20 (``orb-v3-direct-20-omat``);
    25.5M and 25.6M parameters, float32."""
    return {name: functools.partial(pretrained_architecture, name) for name in FOUNDATION_ARCHITECTURES}


default_system = diamond_carbon


def ase_calculator(model: torch.nn.Module) -> Any:
    """orb's own ``ORBCalculator`` around ``model``, on its device."""
    from orb_models.forcefield.calculator import ORBCalculator

    return ORBCalculator(model, device=str(next(model.parameters()).device))


def torchsim_model(model: torch.nn.Module) -> Any:
    """torch-sim's own ``OrbModel`` around ``model`` (torch-sim 0.3.0's imports
    a module orb-models 0.5 does not have: an ``ImportError`` then)."""
    from torch_sim.models.orb import OrbModel

    param = next(model.parameters())
    return OrbModel(model, device=param.device, dtype=param.dtype)


ADAPTER = builtin_adapter(
    "orb",
    requires=("orb_models",),  # import names, the model package's first
    make_padder=make_padder,
    energy_key="energy",
    cutoff=_cutoff,
    prepare_model=prepare_model,
    call=_step,
    evaluate=_evaluate,
    dynamo_config={"trace_autograd_ops": True, "capture_dynamic_output_shape_ops": True},
    # at one thread Inductor lowers orb's scatter_mean count (scatter_add_, then count[count < 1] = 1) to its
    # own loop and writes the where before the scatter: every count one too high, the energy 1e-3 off
    # (torch 2.13); dynamic_threads keeps the scatter on ATen's kernel, as at two threads (exact, no slower)
    inductor_options={"cpp.dynamic_threads": True},
    call_forms=({}, {"split": False}),
    grad_input=None,
    engine=EngineHooks(
        build_input=build_input,
        tensor_input=tensor_input,
        properties=properties,
        message_layers=lambda model: int(next(m.num_message_passing_steps for m in model.modules()
                                              if hasattr(m, "num_message_passing_steps"))),
    ),
    tools=ToolHooks(
        random_model=random_model,
        load_model=load_model,
        default_system=default_system,
        ase_calculator=ase_calculator,
        torchsim_model=torchsim_model,
        foundation_models=foundation_models,
    ),
)
