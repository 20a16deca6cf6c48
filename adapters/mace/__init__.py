"""MACE (``mace-torch``): COO edge-list padding of mace's own batch dict.

The native input is what mace's data pipeline produces
(``AtomicData.from_config`` -> batch -> ``.to_dict()``): ``positions``,
``node_attrs``, ``edge_index [2, E]``, ``shifts``, ``unit_shifts``, ``cell
[S*3, 3]``, ``batch``, ``ptr``, ``head`` and the per-system label fields.

- Dead atoms form their own dead graph (all-zero one-hot, far away): joined
  to a real graph they would add ScaleShiftMACE's per-atom shift to its
  energy.
- Dead edges are self-loops on the dead atom with lattice shift ``(1, 0, 0)``
  through the dead graph's cubic cell of edge ``2 r_max + 1``, so the edge
  is longer than ``r_max`` both as given (``shifts``) and as mace recomputes
  it for stress (``unit_shifts @ cell``): the Bessel basis never sees
  ``r = 0`` and the polynomial envelope is exactly zero.
- For compiling, the model is rebuilt the way mace itself prepares it
  (``extract_model`` under ``disable_e3nn_codegen``, then ``simplify``), and
  ``torch._dynamo.config.trace_autograd_ops`` is switched on around each
  compiled call only, so energy, forces and stress trace into one graph.

Compared with mace's own padding (``mace/data/padding_tools.py``, used by
``MACECalculator(compile_mode=...)``): caps are grow-only buckets (no second
compile when the real count reaches the target), the dead graph never joins
a real graph, caps can be agreed across ranks and saved for restarts.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from ddpad.padding import COOPadder, Composition, Fill, NeighborList, Structures
from ddpad.adapters import EngineHooks, ToolHooks
from ddpad.adapters._common import builtin_adapter, detach, diamond_carbon, unknown_elements
from torch import Tensor

__all__ = [
    "ADAPTER", "build_input", "default_system", "foundation_models", "lammps_input", "load_model", "make_padder",
    "prepare_model", "random_model", "tensor_input",
]

ATOM_FIELDS = {"node_attrs": 0.0, "forces": 0.0, "charges": 0.0, "density_coefficients": 0.0}
EDGE_FIELDS = {"shifts": Fill.DEAD_SHIFT, "unit_shifts": Fill.DEAD_UNIT_SHIFT}
SYSTEM_FIELDS: dict[str, Any] = {
    "cell": Fill.DEAD_CELL, "rcell": 0.0, "pbc": True, "head": 0, "weight": 0.0,
    "energy_weight": 0.0, "forces_weight": 0.0, "stress_weight": 0.0, "virials_weight": 0.0,
    "dipole_weight": 0.0, "charges_weight": 0.0, "polarizability_weight": 0.0, "energy": 0.0,
    "stress": 0.0, "virials": 0.0, "dipole": 0.0, "polarizability": 0.0, "elec_temp": 0.0,
    "total_charge": 0.0, "total_spin": 0.0, "volume": 0.0, "fermi_level": 0.0, "external_field": 0.0,
}
ATOM_OUTPUTS = ("forces", "node_energy", "node_feats", "atomic_virials", "atomic_stresses", "charges")
SYSTEM_OUTPUTS = ("energy", "interaction_energy", "virials", "stress", "displacement", "dipole", "polarizability")
EDGE_OUTPUTS = ("edge_forces",)
# the elements the random model is built for by default (H, C, O)
ELEMENTS: tuple[int, ...] = (1, 6, 8)


def _cutoff(model: torch.nn.Module) -> float:
    return float(model.r_max)


def make_padder(model: torch.nn.Module, **overrides: Any) -> COOPadder:
    """The MACE padder for ``model`` (cutoff ``model.r_max``); keyword arguments
    override :class:`ddpad.padding.COOPadder`'s."""
    config: dict[str, Any] = dict(
        atom_fields=ATOM_FIELDS, edge_fields=EDGE_FIELDS, system_fields=SYSTEM_FIELDS,
        atom_outputs=ATOM_OUTPUTS, system_outputs=SYSTEM_OUTPUTS, edge_outputs=EDGE_OUTPUTS,
    )
    config.update(overrides)
    return COOPadder(_cutoff(model), **config)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` within, restored on an error too
    (mace's ``torch_tools.default_dtype`` leaves it set when the body raises)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """A compile-ready copy of ``model``, built as mace prepares models for
    ``torch.compile``: rebuilt from its config without e3nn's TorchScript
    code generation (which Dynamo cannot trace) and fx-simplified. The
    global switches mace's ``prepare`` flips are not touched: the autograd
    tracing flag is scoped to each call (``dynamo_config``). The copy is
    built in the model's dtype, as under mace's calculator (which sets it as
    torch's default): built in float32, a float64 model's weights were
    rounded to float32 when loaded into it (1.5e-6 eV off on a random
    MACE-OFF23 configuration; now the copy's outputs equal the model's)."""
    from mace.tools.compile import disable_e3nn_codegen, simplify
    from mace.tools.scripts_utils import extract_model

    param = next(model.parameters())
    with disable_e3nn_codegen(), _default_dtype(param.dtype):
        rebuilt = extract_model(model, map_location=str(param.device))
    rebuilt = simplify(rebuilt.to(param.dtype))
    rebuilt.train(model.training)
    for p in rebuilt.parameters():  # inference: no parameter gradients
        p.requires_grad_(False)
    return rebuilt


# outputs that mace takes by autograd: detached when the caller asked for
# ``training=False``, as mace's own evaluation returns them
DERIVATIVES = ("forces", "virials", "stress", "hessian", "edge_forces", "atomic_virials", "atomic_stresses")
CALL_FORMS = (
    {"training": False, "compute_force": True, "compute_stress": True},  # mace's eval / torch-sim
    {"compute_stress": True, "training": True},  # its calculator with compile_mode
    {"compute_stress": False},
)


def _step(model: Any, data: dict[str, Tensor], *args: Any, training: bool = True, **kwargs: Any) -> dict[str, Any]:
    """One call, arranged as mace's calculator arranges compiled calls: inputs
    that forces and stress differentiate already require grad, and the model
    always runs with ``training=True`` (a retained autograd graph, which the
    traced ``autograd.grad`` needs; with ``training=False`` the compiled
    backward runs twice over a freed graph). ``training`` changes no value, only
    whether derivatives keep their graph: for ``training=False`` they are
    detached, as mace returns them."""
    data["positions"].requires_grad_(True)
    data["node_attrs"].requires_grad_(True)
    out = model(data, *args, training=True, **kwargs)
    if not training:
        out = detach(out, DERIVATIVES)
    return out


def evaluate(model: torch.nn.Module, data: dict[str, Tensor], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The unpadded eager model exactly as the caller calls it (``training``
    passed through): the reference for every call form."""
    data["positions"].requires_grad_(True)
    data["node_attrs"].requires_grad_(True)
    return model(data, *args, **kwargs)


def build_input(
    model: torch.nn.Module,
    atoms: Any,
    *,
    head: str | None = None,
    device: str | torch.device | None = None,
) -> dict[str, Tensor]:
    """mace's own batch dict for one ``ase.Atoms`` or a list of them.

    Built with mace's data pipeline (``config_from_atoms`` ->
    ``AtomicData.from_config`` with the model's ``r_max`` and atomic-number
    table -> batched), i.e. exactly what mace's calculator feeds the model.
    Its neighbour list is matscipy's, on the CPU; the dict is then moved to
    ``device`` (default: the model's).
    """
    from mace import data as mace_data
    from mace.tools import torch_geometric, torch_tools, utils

    structures = list(atoms) if isinstance(atoms, (list, tuple)) else [atoms]
    if not structures:
        raise ValueError("build_input needs at least one structure")
    if any(len(a) == 0 for a in structures):
        raise ValueError("build_input got a structure with no atoms; every structure needs at least one")
    param = next(model.parameters())
    z_table = utils.AtomicNumberTable([int(z) for z in model.atomic_numbers])
    unknown = sorted({int(z) for a in structures for z in a.numbers} - set(z_table.zs))
    if unknown:
        raise unknown_elements(unknown, z_table.zs)
    heads = list(getattr(model, "heads", None) or ["Default"])
    dtype_name = "float64" if param.dtype == torch.float64 else "float32"
    with torch_tools.default_dtype(dtype_name):
        graphs = [
            mace_data.AtomicData.from_config(
                mace_data.config_from_atoms(a, head_name=head or heads[0]),
                z_table=z_table, cutoff=_cutoff(model), heads=heads,
            )
            for a in structures
        ]
    loader = torch_geometric.dataloader.DataLoader(graphs, batch_size=len(graphs), shuffle=False)
    batch = next(iter(loader)).to(device if device is not None else param.device)
    return batch.to_dict()


def tensor_input(model: torch.nn.Module, *, head: str | None = None) -> Any:
    """``Structures -> mace's batch dict`` on the structures' device: the
    fields mace's model reads (``positions``, ``node_attrs``, ``edge_index``,
    ``shifts``, ``unit_shifts``, ``cell``, ``batch``, ``ptr``, ``head``,
    ``pbc``), the neighbour list from vesin-torch. The same numbers as
    :func:`build_input` (edges in another order); per composition the one-hot
    species, ``ptr`` and the checks, per step only the neighbour list."""
    zs = [int(z) for z in model.atomic_numbers]
    heads = list(getattr(model, "heads", None) or ["Default"])
    head_index = heads.index(head) if head is not None else 0
    cutoff = _cutoff(model)
    dtype = next(model.parameters()).dtype
    pairs = NeighborList(cutoff)  # (vesin-torch: an ImportError here, not at the first step)
    state: dict[str, Any] = {}

    def build(structures: Structures) -> dict[str, Tensor]:
        composition = Composition.of(structures, state.get("composition"), frozenset(zs))
        if composition is not state.get("composition"):
            device = structures.positions.device
            table = torch.full((max(zs) + 1,), -1, dtype=torch.long, device=device)
            table[torch.tensor(zs, device=device)] = torch.arange(len(zs), device=device)
            state.update(
                composition=composition,
                node_attrs=torch.nn.functional.one_hot(table[structures.numbers.long()], len(zs)).to(dtype),
                head=torch.full((composition.n_systems,), head_index, dtype=torch.long, device=device),
                pbc=torch.tensor(composition.pbc, dtype=torch.bool, device=device),
            )
        edge_index, unit_shifts, shifts = pairs(structures, composition)
        positions = structures.positions.to(dtype)
        cell = structures.cells.to(dtype)
        if not all(all(p) for p in composition.pbc):  # as mace's get_neighborhood: a box around the atoms
            extent = torch.zeros(composition.n_systems, dtype=dtype, device=positions.device).scatter_reduce(
                0, composition.system, positions.detach().abs().amax(dim=1), "amax")
            box = torch.eye(3, dtype=dtype, device=positions.device) * ((extent + 1) * 5 * cutoff)[:, None, None]
            cell = torch.where(state["pbc"][:, :, None], cell, box)
        return {
            "positions": positions, "node_attrs": state["node_attrs"],
            "edge_index": edge_index, "shifts": shifts.to(dtype), "unit_shifts": unit_shifts.to(dtype),
            "cell": cell.reshape(-1, 3), "batch": composition.system,
            "ptr": composition.ptr, "head": state["head"], "pbc": state["pbc"],
        }

    return build


def lammps_input(model: torch.nn.Module) -> tuple[tuple[int, ...], Any]:
    """The model's atomic numbers, and ``(positions, species, dead,
    edge_index, shifts) -> mace's batch dict`` for one graph of explicit
    ghost atoms (``pair_style ddpad``): traceable, no neighbour list, the
    edge displacements ``shifts`` (zeros: the package differentiates them)
    as mace's shifts; dead atoms (all-zero one-hot, as the padder makes
    them) in a second graph."""
    zs = tuple(int(z) for z in model.atomic_numbers)
    dtype = next(model.parameters()).dtype

    def build(positions: Tensor, species: Tensor, dead: Tensor, edge_index: Tensor,
              shifts: Tensor) -> dict[str, Tensor]:
        n, device = positions.shape[0], positions.device
        alive = (~dead).to(dtype)[:, None]
        zero = torch.zeros((), dtype=torch.long, device=device)
        return {
            "positions": positions.to(dtype),
            "node_attrs": torch.nn.functional.one_hot(species, len(zs)).to(dtype) * alive,
            "edge_index": edge_index, "shifts": shifts.to(dtype),
            "unit_shifts": torch.zeros(edge_index.shape[1], 3, dtype=dtype, device=device),
            "cell": torch.zeros(6, 3, dtype=dtype, device=device), "batch": dead.long(),
            "ptr": torch.stack([zero, (~dead).sum(), zero + n]),
            "head": torch.zeros(2, dtype=torch.long, device=device),
            "pbc": torch.zeros(2, 3, dtype=torch.bool, device=device),
        }

    return zs, build


def native_padding(model: torch.nn.Module) -> Any:
    """mace-torch's own padding, as ``MACECalculator(compile_mode=...)`` does it
    (``mace/data/padding_tools.py``): pad targets set from the first structure
    (atoms: its count; edges: x1.25 rounded up to 64, bumped when exceeded), a
    fake graph appended, and one extra fake atom whenever only edges need
    padding. Returns ``atoms -> batch dict``; for ``ddpad bench``."""
    from mace import data as mace_data
    from mace.calculators.mace import _EDGE_PAD_HEADROOM, _EDGE_PAD_MULTIPLE, _round_up
    from mace.data.padding_tools import build_fake_padding_graph
    from mace.tools import torch_geometric, torch_tools, utils

    z_table = utils.AtomicNumberTable([int(z) for z in model.atomic_numbers])
    heads = list(getattr(model, "heads", None) or ["Default"])
    param = next(model.parameters())
    dtype_name = "float64" if param.dtype == torch.float64 else "float32"
    targets: dict[str, int] = {}

    def build(atoms: Any) -> dict[str, Tensor]:
        with torch_tools.default_dtype(dtype_name):
            real = mace_data.AtomicData.from_config(
                mace_data.config_from_atoms(atoms, head_name=heads[0]), z_table=z_table,
                cutoff=_cutoff(model), heads=heads,
            )
        n, e = int(real["node_attrs"].shape[0]), int(real["edge_index"].shape[1])
        if not targets:
            targets.update(atoms=n, edges=_round_up(int(e * _EDGE_PAD_HEADROOM), _EDGE_PAD_MULTIPLE))
        elif e > targets["edges"]:
            targets["edges"] = _round_up(int(e * _EDGE_PAD_HEADROOM), _EDGE_PAD_MULTIPLE)
        pad_atoms, pad_edges = max(n, targets["atoms"]) - n, max(e, targets["edges"]) - e
        graphs = [real]
        if pad_atoms > 0 or pad_edges > 0:
            if pad_edges > 0 >= pad_atoms:  # mace's rule: the extra atom that changes the shape
                pad_atoms = 1
            graphs.append(build_fake_padding_graph(real, num_atoms=pad_atoms, num_edges=pad_edges, r_max=_cutoff(model)))
        batch = torch_geometric.Batch.from_data_list(graphs).to(param.device)
        return batch.to_dict()

    return build


def random_model(
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
    *,
    r_max: float = 4.0,
    atomic_numbers: tuple[int, ...] = ELEMENTS,
    seed: int = 0,
) -> torch.nn.Module:
    """A small randomly initialised ``ScaleShiftMACE`` (2 interactions, non-zero
    per-atom shift and E0s), built from mace's own classes."""
    import numpy as np
    from mace import modules  # before e3nn: mace makes e3nn 0.4's torch.load work on torch >= 2.6

    torch.manual_seed(seed)
    from e3nn import o3  # (not in the import block above: isort would move it before mace)

    block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    model = modules.ScaleShiftMACE(
        r_max=r_max, num_bessel=8, num_polynomial_cutoff=6, max_ell=2, interaction_cls=block,
        interaction_cls_first=block, num_interactions=2, num_elements=len(atomic_numbers),
        hidden_irreps=o3.Irreps("8x0e + 8x1o"), MLP_irreps=o3.Irreps("8x0e"), gate=torch.nn.functional.silu,
        atomic_energies=-1.0 - np.arange(len(atomic_numbers), dtype=float) * 0.8,
        avg_num_neighbors=10.0, atomic_numbers=list(atomic_numbers), correlation=2, radial_type="bessel",
        atomic_inter_scale=1.5, atomic_inter_shift=0.7,
    )
    return model.to(dtype=dtype, device=device)


# The published foundation models' architecture flags, as their training
# commands passed them to ``mace_run_train`` (the wheel ships no config, only
# the checkpoints' URLs in ``mace/calculators/foundations_models.py``).
# MACE-MP-0: github.com/ACEsuit/mace-mp, mace_mp_0/2023-12-10-mace-128-L0_energy.sh
# (small) and 2023-12-03-mace-128-L1.sh (medium), which differ only in max_L.
_MP0_FLAGS = (
    "--model=ScaleShiftMACE", "--interaction_first=RealAgnosticResidualInteractionBlock",
    "--interaction=RealAgnosticResidualInteractionBlock", "--num_interactions=2", "--correlation=3", "--max_ell=3",
    "--r_max=6.0", "--num_channels=128", "--num_radial_basis=10", "--MLP_irreps=16x0e",
    "--scaling=rms_forces_scaling",
)
# MACE-OFF23: github.com/ACEsuit/mace-off, mace_off23/train_scripts/medium.sh
# (model "MACE", 2 interactions, correlation 3, r_max 5; the rest mace's
# defaults). The repository's small.sh is a copy of medium.sh; the small
# model's width (96 channels, L=0) is the MACE-OFF paper's (arXiv:2312.15211).
_OFF23_FLAGS = ("--model=MACE", "--num_interactions=2", "--correlation=3", "--r_max=5.0")
# MACE-MP-0's 89 elements (H-Bi, Ac-Pu); MACE-OFF's 10 organic ones
_MP0_ELEMENTS = (*range(1, 84), *range(89, 95))
_OFF_ELEMENTS = (1, 6, 7, 8, 9, 15, 16, 17, 35, 53)
# the mean neighbour count mace computes from the training set (not shipped):
# MPtrj's at 6 A, the value the MACE-MP-0 checkpoints carry, and a
# representative one for SPICE-like molecules and liquids at 5 A
_MP0_AVG_NEIGHBOURS = 61.96
_OFF_AVG_NEIGHBOURS = 20.0


def _configured_model(
    flags: tuple[str, ...], atomic_numbers: tuple[int, ...], avg_num_neighbors: float,
    dtype: torch.dtype, seed: int,
) -> torch.nn.Module:
    """A foundation architecture built the way ``mace_run_train`` builds it:
    ``flags`` through mace's argument parser (its defaults fill the rest) and
    ``check_args`` (``num_channels`` and ``max_L`` -> ``hidden_irreps``), then
    ``configure_model`` (``mace/tools/model_script_utils.py``), in float64 as
    the models were trained, cast to ``dtype`` as mace's calculators cast them.
    Random weights; what training fits from data (E0s, scale and shift) is
    drawn at random and non-zero, so a dead atom that leaked would show."""
    import numpy as np
    from mace import tools  # before e3nn: mace makes e3nn 0.4's torch.load work on torch >= 2.6
    from mace.tools.model_script_utils import configure_model

    parser = tools.build_default_arg_parser()
    args, _ = tools.check_args(parser.parse_args(["--name=foundation", "--train_file=none.xyz", *flags]))
    args.compute_energy, args.compute_dipole, args.compute_polarizability = True, False, False  # as run_train sets them
    rng = np.random.default_rng(seed)
    # given, so configure_model computes no scaling from a training set
    args.mean, args.std = float(rng.uniform(0.1, 0.5)), float(rng.uniform(0.5, 1.5))
    args.avg_num_neighbors = avg_num_neighbors
    e0s = -rng.uniform(1.0, 10.0, size=(1, len(atomic_numbers)))  # [heads, elements]
    torch.manual_seed(seed)
    with _default_dtype(getattr(torch, args.default_dtype)):
        model, _ = configure_model(
            args, None, e0s, heads=["Default"], z_table=tools.AtomicNumberTable(list(atomic_numbers)))
        with torch.no_grad():  # model "MACE" fixes the shift at 0: a non-zero one, as for ScaleShiftMACE
            model.scale_shift.shift.fill_(args.mean)
    return model.to(dtype).eval()


def foundation_models() -> dict[str, Any]:
    """The architectures of the MACE foundation models users run, by name,
    with random weights (no download): MACE-MP-0 small (128x0e, 3.85M
    parameters) and medium (128x0e+128x1o, 4.69M) on 89 elements with
    r_max 6, in float32 (``mace_mp``'s default dtype); MACE-OFF23 small
    (96x0e) and medium (128x0e+128x1o) on 10 organic elements with r_max 5,
    in float64 (``mace_off``'s default). Built by mace-torch 0.3's own
    training code from the published training flags (see
    :func:`_configured_model`)."""
    mp = functools.partial(_configured_model, atomic_numbers=_MP0_ELEMENTS,
                           avg_num_neighbors=_MP0_AVG_NEIGHBOURS, dtype=torch.float32)
    off = functools.partial(_configured_model, atomic_numbers=_OFF_ELEMENTS,
                            avg_num_neighbors=_OFF_AVG_NEIGHBOURS, dtype=torch.float64)
    return {
        "mace-mp-0-small": functools.partial(mp, (*_MP0_FLAGS, "--max_L=0"), seed=1),
        "mace-mp-0-medium": functools.partial(mp, (*_MP0_FLAGS, "--max_L=1"), seed=2),
        "mace-off23-small": functools.partial(off, (*_OFF23_FLAGS, "--num_channels=96", "--max_L=0"), seed=3),
        "mace-off23-medium": functools.partial(off, (*_OFF23_FLAGS, "--num_channels=128", "--max_L=1"), seed=4),
    }


def load_model(path: str, device: str = "cpu") -> torch.nn.Module:
    """A mace model saved with ``torch.save(model)`` (mace's ``.model`` files)."""
    model = torch.load(path, map_location=device, weights_only=False)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{path} holds a {type(model).__name__}, not a mace model")
    return model


default_system = diamond_carbon


def ase_calculator(model: torch.nn.Module) -> Any:
    """mace's own ``MACECalculator`` around ``model``, in its dtype and on its device."""
    from mace.calculators import MACECalculator

    param = next(model.parameters())
    dtype = "float64" if param.dtype == torch.float64 else "float32"
    return MACECalculator(models=model, device=str(param.device), default_dtype=dtype)


def compiled_ase_calculator(model: torch.nn.Module) -> Any:
    """mace's own compiled route: ``MACECalculator(..., compile_mode="default")``
    (``torch.compile`` of mace's prepared model, shapes as they come), in
    the model's dtype: mace's route rebuilds the model under torch's default
    dtype (a float64 model ran in float32 under the default float32,
    measured: its energy 4e-5 eV off the eager calculator's), so the default
    is the model's while it is built, and restored after."""
    from mace.calculators import MACECalculator

    param = next(model.parameters())
    dtype = "float64" if param.dtype == torch.float64 else "float32"
    before = torch.get_default_dtype()
    torch.set_default_dtype(param.dtype)
    try:
        return MACECalculator(models=model, device=str(param.device), default_dtype=dtype, compile_mode="default")
    finally:
        torch.set_default_dtype(before)


def torchsim_model(model: torch.nn.Module) -> Any:
    """torch-sim's own ``MaceModel`` around ``model``, in its dtype and on its device."""
    from torch_sim.models.mace import MaceModel

    param = next(model.parameters())
    return MaceModel(model, device=param.device, dtype=param.dtype)


ADAPTER = builtin_adapter(
    "mace",
    requires=("mace", "e3nn"),  # import names, the model package's first
    make_padder=make_padder,
    energy_key="energy",
    cutoff=_cutoff,
    prepare_model=prepare_model,
    call=_step,
    dynamo_config={"trace_autograd_ops": True},
    call_forms=CALL_FORMS,
    grad_input="positions",
    evaluate=evaluate,
    engine=EngineHooks(
        build_input=build_input,
        tensor_input=tensor_input,
        stress_option="compute_stress",
        atom_energy_key="node_energy",
        message_layers=lambda model: int(model.num_interactions),
        energy_only_options={"compute_force": False, "compute_stress": False},
        lammps_input=lammps_input,
    ),
    tools=ToolHooks(
        random_model=random_model,
        random_model_elements=ELEMENTS,
        default_dtype=torch.float64,  # what ddpad run builds the random model in (mace's own tools run float64)
        load_model=load_model,
        default_system=default_system,
        native_padding=native_padding,
        ase_calculator=ase_calculator,
        compiled_ase_calculator=compiled_ase_calculator,
        torchsim_model=torchsim_model,
        foundation_models=foundation_models,
    ),
)
