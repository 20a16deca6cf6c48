"""UMA (``fairchem-core``): padding at the model's own graph seam.

UMA (``HydraModelV2`` over ``eSCNMDBackbone`` / ``eSCNMDMoeBackbone``) builds
its radius graph inside ``forward`` (``otf_graph=True``). ddpad wraps the
instance in :class:`PaddedUMA`, whose ``forward`` runs fairchem's own
``generate_graph`` eagerly, then pads at that seam through
``current_dd_context().maybe_pad_graph(...)`` (SPEC sections 6-7), then
calls the compiled model on the padded graph (a copy with
``otf_graph=False``, which takes a supplied graph). Only the part after the
seam is compiled, so it always sees the same shapes. That part
(:class:`UMACore`) takes the padded graph as a dict of tensors and the task
names, and makes fairchem's ``AtomicData`` batch itself, so that under
``compile_mode="aot"`` it is what an ahead-of-time package is built of
(graph generation stays eager, before the seam). No fairchem class is
patched; the user's model is not modified.

Dead atoms form their own dead system with an anchor pair (``extra=2``)
placed far outside the real atoms and ``2 * cutoff + 1`` apart; dead edges
join that pair (zero lattice offsets), so they are non-degenerate, longer
than the cutoff and their envelope is exactly zero. The dead system copies
the last real system's charge, spin and task (valid embedding inputs).

Mixture-of-linear-experts: the expert coefficients are per system, so the
dead system's routing never touches the real systems'. With
``merge_mole=True`` fairchem merges the experts once, for the composition
of the data it is prepared with, before wrapping: the merged model has no
routing left and the dead system runs through the merged weights (its
outputs are dropped). fairchem's predict unit checks that later batches
keep that composition; call ``PaddedUMA`` only with the composition the
model was merged for, as fairchem requires.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from ddpad.padding import COOPadder, CapPolicy, Composition, Fill, Structures, current_dd_context
from ddpad.adapters import EngineHooks, ToolHooks
from ddpad.adapters._common import builtin_adapter
from torch import Tensor

__all__ = [
    "ADAPTER", "UMA_S_1P1_CONFIG", "PaddedUMA", "UMACore", "build_input", "foundation_models", "make_padder",
    "prepare_model", "tensor_input", "uma_s",
]

ATOM_FIELDS = {"atomic_numbers": 0, "fixed": 0, "tags": 0}
SYSTEM_FIELDS: dict[str, Any] = {"cell": Fill.DEAD_CELL, "pbc": False, "charge": Fill.LAST_REAL, "spin": Fill.LAST_REAL}
GRAPH_FIELDS = ("pos", "atomic_numbers", "cell", "pbc", "natoms", "edge_index", "cell_offsets", "nedges",
                "charge", "spin", "fixed", "tags", "batch")
ATOM_OUTPUTS = ("forces", "embeddings")
SYSTEM_OUTPUTS = ("energy", "stress")

# the reference framework's numbers (SPEC section 6, in-forward padding)
ATOMS_POLICY = CapPolicy(initial_factor=1.15, grow_factor=1.15, stride=64, extra=2)
EDGES_POLICY = CapPolicy(initial_factor=1.15, grow_factor=1.15, stride=1024)


def _backbone(model: torch.nn.Module) -> Any:
    return model.backbone if hasattr(model, "backbone") else model.core.model.backbone


def _cutoff(model: torch.nn.Module) -> float:
    return float(_backbone(model).cutoff)


def make_padder(model: torch.nn.Module, **overrides: Any) -> COOPadder:
    """The UMA padder (anchor-pair dead edges, fairchem field names);
    keyword arguments override :class:`ddpad.padding.COOPadder`'s."""
    config: dict[str, Any] = dict(
        positions="pos", atom_fields=ATOM_FIELDS, edge_fields={"cell_offsets": 0.0},
        system_fields=SYSTEM_FIELDS, system_index="batch", ptr=None, system_count="natoms",
        atom_counts="natoms", edge_counts="nedges", atom_outputs=ATOM_OUTPUTS,
        system_outputs=SYSTEM_OUTPUTS, atoms_policy=ATOMS_POLICY, edges_policy=EDGES_POLICY,
    )
    config.update(overrides)
    return COOPadder(_cutoff(model), **config)


# what AtomicData.__init__ sets besides its fields (its batching bookkeeping, unused by the model)
_BATCH_SLOTS = ("__slices__", "__cumsum__", "__cat_dims__", "__natoms_list__")


def _present_tasks(model: torch.nn.Module, output: dict[str, Any], datasets: list[str] | None) -> dict[str, Any]:
    """``output`` without the per-task outputs of datasets absent from the
    batch. fairchem's dataset-specific heads (``DatasetSpecificSingleHeadWrapper``,
    what the published UMA models carry) return ``{dataset}_{property}`` for
    every dataset they know: zeros for the absent ones, NaN on a merged
    model (``merge_mole``), which would read as a non-finite output."""
    known = {name for head in getattr(model, "output_heads", {}).values()
             for name in (getattr(head, "dataset_names", None) or ())}
    if not known or datasets is None:
        return output
    present = set(datasets)
    return {key: value for key, value in output.items()
            if (task := key.rsplit("_", 1)[0]) not in known or task in present}


class UMACore(torch.nn.Module):
    """What comes after the seam: fairchem's model (a copy taking a supplied
    graph) on the padded graph, given as a dict of tensors and the task name
    of each system.

    The ``AtomicData`` batch is made here without its constructor's
    ``validate()`` (which reads sizes from tensors: a trace at fixed caps
    cannot take it; the padded graph is checked where it is made), so that
    the whole part is a function of tensors and constants: what
    ``torch.compile`` and an ahead-of-time package take alike.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, graph: dict[str, Tensor], dataset: list[str] | None) -> Any:
        from fairchem.core.datasets.atomic_data import AtomicData

        batch = AtomicData.__new__(AtomicData)
        object.__setattr__(batch, "__keys__", set())
        for name in _BATCH_SLOTS:
            object.__setattr__(batch, name, None)
        for name, value in graph.items():
            setattr(batch, name, value)
        if dataset is not None:
            batch.dataset = dataset
        batch.sid = [""] * graph["natoms"].shape[0]
        return _present_tasks(self.model, self.model(batch), dataset)


class PaddedUMA(torch.nn.Module):
    """A UMA model that pads its graph at the seam after graph generation.

    ``core`` (compiled by ``ddpad.wrap``, or its packages under
    ``compile_mode="aot"``) is a :class:`UMACore` around a copy of the model
    that takes a supplied graph. Outside a ddpad context nothing is padded: the module
    then equals the original model, less the per-task outputs of datasets
    absent from the batch (zeros, or NaN on a merged model).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        backbone = model.backbone
        self.otf_graph = bool(backbone.otf_graph)
        self.graph_settings = dict(
            cutoff=backbone.cutoff, max_neighbors=backbone.max_neighbors,
            enforce_max_neighbors_strictly=backbone.enforce_max_neighbors_strictly,
            radius_pbc_version=backbone.radius_pbc_version,
        )
        self.always_use_pbc = bool(backbone.always_use_pbc)
        core = copy.deepcopy(model)
        core.backbone.otf_graph = False
        # HydraModelV2 sets .device on its first call: a spurious recompile
        param = next(core.parameters())
        if hasattr(core, "device"):
            core.device = param.device.type
        self.core = UMACore(core)

    def _graph(self, data: Any) -> dict[str, Tensor]:
        """The graph fields of ``data``, built by fairchem when the model builds its own."""
        fields = {name: data[name] for name in GRAPH_FIELDS}
        if not self.otf_graph:
            return fields
        from fairchem.core.graph.compute import generate_graph

        n_sys = fields["natoms"].shape[0]
        pbc = torch.ones(n_sys, 3, dtype=torch.bool) if self.always_use_pbc else fields["pbc"]
        graph = generate_graph(data, pbc=pbc, **self.graph_settings)
        fields.update(edge_index=graph["edge_index"], cell_offsets=graph["cell_offsets"].to(fields["pos"].dtype),
                      nedges=graph["neighbors"])
        return fields

    def forward(self, data: Any) -> dict[str, Any]:
        fields = self._graph(data)
        n_sys = fields["natoms"].shape[0]
        padded = current_dd_context().maybe_pad_graph(fields)  # the seam
        s_cap = padded["natoms"].shape[0]
        dataset = list(data.dataset) if hasattr(data, "dataset") else None
        if dataset is not None:  # the dead systems share the last real system's task
            dataset = dataset + [dataset[-1]] * (s_cap - n_sys)
        graph = dict(padded)
        graph["cell"] = graph["cell"].to(graph["pos"].dtype)  # (as AtomicData's constructor does)
        return self.core(graph, dataset)


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``model`` (left unmodified) in :class:`PaddedUMA`."""
    if isinstance(model, PaddedUMA):
        return model
    if not hasattr(model, "backbone"):
        raise TypeError(f"the uma adapter takes a fairchem HydraModelV2, got {type(model).__name__}")
    return PaddedUMA(model)


def _compile_core(model: PaddedUMA, compile_fn: Any) -> PaddedUMA:
    model.core = compile_fn(model.core)
    return model


def _evaluate(model: torch.nn.Module, data: Any) -> Any:
    """The unpadded eager reference: the original model on a copy of ``data``
    (the outputs of datasets absent from it dropped, as :class:`UMACore` does)."""
    return _present_tasks(model, model(data.clone()), list(data.dataset) if hasattr(data, "dataset") else None)


def properties(output: dict[str, Any]) -> dict[str, Tensor]:
    """Flat ``energy`` / ``forces`` / ``stress`` from fairchem's output: per
    task, ``{dataset}_{property}: {property: tensor}`` (the published UMA
    models' dataset-specific heads with ``pass_through_head_outputs``; each
    holds zeros in the other datasets' rows, so a batch of several tasks is
    their sum, exactly), or nested per head, ``{head: {property: {property:
    tensor}}}`` (the first head with an energy)."""
    if any(key.endswith("_energy") for key in output):
        flat: dict[str, Tensor] = {}
        for key, value in output.items():
            name = key.rsplit("_", 1)[-1]
            value = value.get(name) if isinstance(value, dict) else value
            if isinstance(value, Tensor):
                flat[name] = value if name not in flat else flat[name] + value
        return flat
    for head in output.values():
        if isinstance(head, dict) and "energy" in head:
            return {k: (v[k] if isinstance(v, dict) else v) for k, v in head.items()}
    raise KeyError(f"no head with an energy in the output (heads: {sorted(output)})")


def build_input(
    model: torch.nn.Module, atoms: Any, *, task: str = "omat", dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Any:
    """fairchem's ``AtomicData`` batch for one ``ase.Atoms`` or a list, as its
    own pipeline builds it (``AtomicData.from_ase`` + ``atomicdata_list_to_batch``);
    the graph is left to the model (``otf_graph``). ``charge`` / ``spin`` come
    from ``atoms.info``."""
    from fairchem.core.datasets.atomic_data import AtomicData, atomicdata_list_to_batch

    structures = list(atoms) if isinstance(atoms, (list, tuple)) else [atoms]
    if not structures or any(len(a) == 0 for a in structures):
        raise ValueError("build_input needs at least one structure, each with at least one atom")
    limit = int(getattr(_backbone(model), "max_num_elements", 0) or 0)
    unknown = sorted({int(z) for a in structures for z in a.numbers if z < 1 or (limit and z >= limit)})
    if unknown:
        raise ValueError(f"atomic numbers {unknown} are not known to this UMA model (its embedding holds 1..{limit - 1})")
    param = next(model.parameters())
    target = dtype or param.dtype  # the model's own dtype unless asked otherwise
    graphs = [AtomicData.from_ase(a, task_name=task, r_edges=False, target_dtype=target) for a in structures]
    return atomicdata_list_to_batch(graphs).to(device if device is not None else param.device)


def tensor_input(model: torch.nn.Module, *, task: str = "omat", charge: int = 0, spin: int = 0) -> Any:
    """``Structures -> fairchem's AtomicData batch`` on the structures' device,
    as :func:`build_input` makes it (``AtomicData.from_ase``: positions
    wrapped into the cell along periodic directions, a missing cell vector
    completed, ``charge`` / ``spin`` per system, the graph left to the
    model). No neighbour list here: UMA builds its graph in ``forward``, on
    the input's device. The batch is made once per composition (fairchem's
    ``AtomicData`` checks itself when made, reading the device) and checked;
    each step replaces its positions (wrapped) and cells."""
    from fairchem.core.datasets.atomic_data import AtomicData

    limit = int(getattr(_backbone(model), "max_num_elements", 0) or 0)
    known = frozenset(range(1, limit)) if limit else None
    dtype = next(model.parameters()).dtype
    state: dict[str, Any] = {}

    def build(structures: Structures) -> Any:
        composition = Composition.of(structures, state.get("composition"), known)
        device, system, n_sys = structures.positions.device, composition.system, composition.n_systems
        if composition is not state.get("composition"):
            state.update(composition=composition, data=None,
                         pbc=torch.tensor(composition.pbc, dtype=torch.bool, device=device))
        cells = structures.cells.detach()
        missing = cells.abs().sum(dim=2, keepdim=True) == 0  # ASE's complete cell: unit vectors for those
        cells = torch.where(missing, torch.eye(3, dtype=cells.dtype, device=device), cells)
        # ase's wrap_positions, as from_ase: fractional coordinates mod 1 along periodic directions
        fractional = torch.linalg.solve(cells.transpose(1, 2)[system],
                                        structures.positions.detach().unsqueeze(-1)).squeeze(-1)
        fractional = torch.where(state["pbc"][system], fractional % 1.0, fractional)
        positions = torch.einsum("ni,nij->nj", fractional, cells[system]).to(dtype)
        if state["data"] is None:  # once per composition: AtomicData checks itself, reading the device
            atom_zeros = torch.zeros(positions.shape[0], dtype=torch.long, device=device)
            state["data"] = AtomicData(
                pos=positions, atomic_numbers=structures.numbers.long(), cell=cells.to(dtype), pbc=state["pbc"],
                natoms=composition.ptr.diff(), edge_index=torch.zeros(2, 0, dtype=torch.long, device=device),
                cell_offsets=torch.zeros(0, 3, dtype=dtype, device=device),
                nedges=torch.zeros(n_sys, dtype=torch.long, device=device),
                charge=torch.full((n_sys,), charge, dtype=torch.long, device=device),
                spin=torch.full((n_sys,), spin, dtype=torch.long, device=device), fixed=atom_zeros,
                tags=atom_zeros, batch=system, sid=[""] * n_sys, dataset=[task] * n_sys,
            )
        data = state["data"]
        data.pos, data.cell = positions, cells.to(dtype)
        return data

    return build


def random_model(
    dtype: torch.dtype | None = None, device: str = "cpu", *, moe: bool = False, cutoff: float = 4.0, seed: int = 0,
) -> torch.nn.Module:
    """A tiny randomly initialised UMA from fairchem's own classes: an
    ``eSCNMDBackbone`` (or ``eSCNMDMoeBackbone`` with 4 experts) and the
    energy / force / stress head, random biases too."""
    from fairchem.core.models.base import HydraModelV2
    from fairchem.core.models.uma.escn_md import MLP_EFS_Head, eSCNMDBackbone
    from fairchem.core.models.uma.escn_moe import eSCNMDMoeBackbone

    torch.manual_seed(seed)
    kwargs: dict[str, Any] = dict(
        max_num_elements=100, sphere_channels=16, lmax=2, mmax=2, otf_graph=True, max_neighbors=60,
        cutoff=cutoff, edge_channels=16, num_distance_basis=16, num_layers=2, hidden_channels=16,
        direct_forces=False, regress_forces=True, regress_stress=True,
        dataset_mapping={"omol": "omol", "omat": "omat"}, always_use_pbc=False,
    )
    if moe:
        backbone = eSCNMDMoeBackbone(num_experts=4, **kwargs)
    else:
        backbone = eSCNMDBackbone(**kwargs)
    model = HydraModelV2(backbone, {"efs": MLP_EFS_Head(backbone)})
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.3)
    return model.eval().to(dtype=dtype or torch.float32, device=device)


def default_system() -> Any:
    """Periodic bulk: a rattled 3x3x3 fcc-Cu supercell (108 atoms), task ``omat``."""
    from ase.build import bulk

    atoms = bulk("Cu", cubic=True) * (3, 3, 3)
    atoms.rattle(0.05, seed=0)
    atoms.info.update(charge=0, spin=0)
    return atoms


# UMA-S 1.1's ``model_config`` (``uma-s-1p1.pt``, which fairchem downloads and its wheel does not
# ship): the backbone of fairchem's release config ``configs/uma/training_release/backbone/K4L2.yaml``
# (32 experts), the conserving fine-tune's settings and heads
# (``configs/uma/training_release/uma_sm_conserve_finetune.yaml``: stress, no direct forces, 300
# neighbours, one ``DatasetSpecificSingleHeadWrapper`` over ``MLP_EFS_Head``, outputs passed through)
# and the 1.1 tag ``backbone.model_version`` (fairchem PR 2049). Training-only keys (dropouts
# inactive in eval, gradient flags) are kept as released; K4L2's later solvent-embedding keys are not
# in UMA-S 1.1 (nor in the installed fairchem's backbone).
UMA_S_1P1_CONFIG: dict[str, Any] = {
    "_target_": "fairchem.core.models.base.HydraModel",
    "backbone": {
        "model": "fairchem.core.models.uma.escn_moe.eSCNMDMoeBackbone",
        "moe_dropout": 0.05, "moe_layer_type": "pytorch", "num_experts": 32, "use_composition_embedding": True,
        "use_global_embedding": False, "max_num_elements": 100, "sphere_channels": 128, "lmax": 2, "mmax": 2,
        "otf_graph": True, "max_neighbors": 300, "use_pbc": True, "use_pbc_single": True, "cutoff": 6.0,
        "edge_channels": 128, "distance_function": "gaussian", "num_distance_basis": 64, "regress_forces": True,
        "regress_stress": True, "direct_forces": False, "num_layers": 4, "hidden_channels": 128,
        "norm_type": "rms_norm_sh", "act_type": "gate", "ff_type": "spectral", "chg_spin_emb_type": "rand_emb",
        "cs_emb_grad": True, "dataset_list": ["oc20", "omol", "omat", "odac", "omc"], "model_version": "1.1",
    },
    "heads": {
        "energyandforcehead": {
            "module": "fairchem.core.models.uma.escn_moe.DatasetSpecificSingleHeadWrapper",
            "head_cls": "fairchem.core.models.uma.escn_md.MLP_EFS_Head",
            "head_kwargs": {"wrap_property": False},
            "dataset_names": ["omol", "omat", "oc20", "omc", "odac"],
        },
    },
    "pass_through_head_outputs": True,
}


def uma_s(
    config: dict[str, Any] | None = None, *, merge_for: Any = None, task: str = "omat", seed: int = 0,
) -> torch.nn.Module:
    """A published UMA architecture (default UMA-S 1.1, :data:`UMA_S_1P1_CONFIG`)
    with random weights, built as fairchem's ``MLIPPredictUnit`` builds it on a
    CPU: ``load_inference_model``'s steps without the checkpoint
    (``apply_uma_compat_fixups``, the backbone overrides of the inference
    settings, ``eSCNMDMoeBackbone.build_inference_settings``, applied with
    ``update_configs``, then ``hydra.utils.instantiate``), and on its first
    prediction ``prepare_for_inference`` under the settings fairchem runs
    on a CPU (``inference_settings_multigpu``: ``merge_mole=True``, the
    ``"default"`` nitro preset's fallback), which merges the experts for
    ``merge_for`` (an ``ase.Atoms``; default :func:`default_system`, fcc Cu)
    and ``task``. float32, as published. Parameters that fairchem
    initialises to zero (radial-MLP, norm and SO(3)-linear biases) get
    random values, so that a padding leak through them shows."""
    import types

    import hydra
    from fairchem.core.models.uma.compat import apply_uma_compat_fixups
    from fairchem.core.models.uma.escn_moe import eSCNMDMoeBackbone
    from fairchem.core.units.mlip_unit.api.inference import inference_settings_multigpu
    from fairchem.core.units.mlip_unit.utils import update_configs

    settings = inference_settings_multigpu()
    checkpoint = types.SimpleNamespace(model_config=copy.deepcopy(config or UMA_S_1P1_CONFIG))
    apply_uma_compat_fixups(checkpoint)  # UMA 1.1: model_id "UMA-1.1", as on load
    overrides = {"backbone": eSCNMDMoeBackbone.build_inference_settings(settings)}
    torch.manual_seed(seed)
    model = hydra.utils.instantiate(update_configs(checkpoint.model_config, overrides))
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.normal_(0.0, 0.1)
    model.eval()
    atoms = merge_for if merge_for is not None else default_system()
    model.prepare_for_inference(build_input(model, atoms, task=task), settings)
    model.requires_grad_(False)  # (as the predict unit: outputs are differentiated by inputs only)
    return model.to(settings.base_precision_dtype).eval()


def foundation_models() -> dict[str, Any]:
    """The published UMA configurations users run, by name, with random
    weights (no download): ``uma-s-1p1`` (:func:`uma_s`: UMA-S 1.1, 147M
    parameters, its 32 experts merged for fcc Cu, task ``omat``, as
    fairchem's CPU inference settings merge them). An unmerged mixture of
    experts is not among them: it recompiles whenever a system's edge count
    changes, whatever the padding (see the adapter page)."""
    return {"uma-s-1p1": functools.partial(uma_s, UMA_S_1P1_CONFIG)}


def _load_model(path: str, device: str = "cpu") -> torch.nn.Module:
    """A local fairchem checkpoint (``.pt``), loaded by fairchem's own loader."""
    from fairchem.core.units.mlip_unit import load_predict_unit

    unit = load_predict_unit(path, device=device)
    return unit.model.module


ADAPTER = builtin_adapter(
    "uma",
    requires=("fairchem.core",),  # import names, the model package's first
    make_padder=make_padder,
    energy_key="energy",
    cutoff=_cutoff,
    pad_in_forward=True,
    prepare_model=prepare_model,
    compile_region=_compile_core,
    evaluate=_evaluate,
    dynamo_config={"trace_autograd_ops": True},
    call_forms=({},),  # fairchem's MLIPPredictUnit (behind its ASE calculator) calls model(data)
    engine=EngineHooks(
        build_input=build_input,
        tensor_input=tensor_input,
        properties=properties,
        message_layers=lambda model: int(_backbone(model).num_layers),
    ),
    tools=ToolHooks(
        random_model=random_model,
        load_model=_load_model,
        default_system=default_system,
        foundation_models=foundation_models,
    ),
)
