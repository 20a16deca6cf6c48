"""AIMNet2 (``aimnet`` package): dense neighbour-matrix padding.

The native input is aimnet's flat ("mode 1") batch as its calculator builds
it: ``coord [N+1, 3]``, ``numbers``, ``mol_idx``, per-molecule ``charge``
(and ``mult``), and neighbour matrices ``nbmat[_lr|_coulomb|_dftd3]`` of
shape ``[N+1, K]`` whose last row is the model's pad atom and whose entries
``N`` are sentinels. :class:`ddpad.padding.DensePadder` pads the rows to the atoms
cap and every matrix width ``K`` to its own grow-only cap. Dead atoms
(``numbers = 0``) form their own zero-charge molecule: joined to a real one
they would take part in its charge equilibration.

The output is what aimnet's calculator returns: ``energy [S]``,
``charges [N]`` and, unless ``forces=False``, ``forces [N, 3]`` (autograd
of the energy around the compiled model, so the model itself compiles to
one graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from ddpad.padding import Composition, DensePadder, Fill, Structures
from ddpad.adapters import EngineHooks, ToolHooks
from ddpad.adapters._common import builtin_adapter
from torch import Tensor

__all__ = ["ADAPTER", "build_input", "default_system", "evaluate", "foundation_models", "load_model", "make_padder",
           "random_model", "tensor_input", "wb97m_d3_model"]

NBMAT_KEYS = ("nbmat", "nbmat_lr", "nbmat_coulomb", "nbmat_dftd3")
ATOM_OUTPUTS = ("forces", "charges", "spin_charges")
SYSTEM_OUTPUTS = ("energy",)


def make_padder(model: torch.nn.Module | None = None, **overrides: Any) -> DensePadder:
    """The AIMNet2 padder; keyword arguments override :class:`ddpad.padding.DensePadder`'s."""
    config: dict[str, Any] = dict(
        nbmat=NBMAT_KEYS,
        atom_fields={"coord": 0.0, "numbers": 0, "mol_idx": Fill.LAST_SYSTEM},
        system_fields={"charge": 0.0, "mult": 1.0},
        neighbor_fields={f"shifts{k[5:]}": (k, 0.0) for k in NBMAT_KEYS},
        system_count="charge",
        atom_outputs=ATOM_OUTPUTS,
        system_outputs=SYSTEM_OUTPUTS,
    )
    config.update(overrides)
    return DensePadder(**config)


def _fake_traced(coord: Tensor) -> bool:
    """Whether the step is being traced in fake mode (the ahead-of-time
    route's ``make_fx``), not by Dynamo, which aimnet detects by itself."""
    from torch._subclasses.fake_tensor import is_fake

    return not torch.compiler.is_compiling() and is_fake(coord)


def _tracing_path() -> contextlib.AbstractContextManager[Any]:
    """aimnet's own tracing path, for a fake trace of the step.

    Eager aimnet reads tensor values on the host (``data_ptr()`` to share
    masks between aliased neighbour matrices, ``.item()`` for the neighbour
    mode and the molecule count), which a fake tensor cannot give. Under
    ``torch.compile`` aimnet takes value-free branches instead (the mode
    from the matrices' rank, the molecule count from ``charge``'s length,
    masks recomputed per matrix), the same numbers; its
    ``_symbolic_trace_context`` selects them outside Dynamo too (aimnet's
    own ``make_fx`` training path uses it), for this call only.
    """
    from aimnet import nbops

    enter = getattr(nbops, "_symbolic_trace_context", None)  # (older aimnet: the trace refuses, as before)
    return enter() if enter is not None else contextlib.nullcontext()


def _step(model: Any, data: dict[str, Tensor], *, forces: bool = True) -> dict[str, Tensor]:
    """One evaluation: the model's energy and charges, forces by autograd.

    ``model`` may be compiled; the gradient is taken outside it, so Dynamo
    sees one graph and AOTAutograd compiles its backward.
    """
    coord = data["coord"]
    # coordinates that already require grad belong to a caller who takes
    # derivatives of the energy too (as with the raw aimnet model): keep the graph
    caller_grad = coord.requires_grad
    if forces and not caller_grad:
        coord.requires_grad_(True)
    # aimnet's D3 term counts molecules as int(mol_idx.max()) + 1 unless told (eager aimnet tells it
    # its cached count): a host read, so a graph break under Dynamo (before: the model's forward
    # skipped, its helpers compiled per call site, 15 graphs) and a data-dependent size in a fake
    # trace. Told charge's length: the count aimnet's own compiled path uses
    data = {**data, "_dftd3_num_systems": data["charge"].shape[0]}
    if _fake_traced(coord):
        with _tracing_path():
            out = model(data)
    else:
        out = model(data)
    result = {"energy": out["energy"], "charges": out["charges"]}
    if "spin_charges" in out:
        result["spin_charges"] = out["spin_charges"]
    if forces:
        (grad,) = torch.autograd.grad(out["energy"].sum(), coord, retain_graph=caller_grad)
        result["forces"] = -grad
    return result


def evaluate(model: torch.nn.Module, data: dict[str, Tensor], *, forces: bool = True) -> dict[str, Tensor]:
    """The unpadded eager reference: what the wrapped model returns for ``data``.

    Per-atom outputs drop the model's pad atom (the last row), as aimnet's
    calculator does.
    """
    inp = {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in data.items()}
    out = _step(model, inp, forces=forces)
    n = data["nbmat"].shape[0] - 1
    return {k: (v[:n] if k in ATOM_OUTPUTS else v) for k, v in out.items()}


def _molecules(atoms: Any) -> list[Any]:
    """Molecules of an ``Atoms`` split by its ``mol_id`` array, or of each of
    a list of them (before: a list's ``Atoms`` were one molecule each,
    whatever their ``mol_id``)."""
    if isinstance(atoms, (list, tuple)):
        return [mol for part in atoms for mol in _molecules(part)]
    if "mol_id" not in atoms.arrays:
        return [atoms]
    ids = atoms.arrays["mol_id"]
    order = list(dict.fromkeys(int(i) for i in ids))
    runs = 1 + int((ids[1:] != ids[:-1]).sum()) if len(ids) else 0
    if runs != len(order):  # outputs come back in input order: molecules must be contiguous
        raise ValueError("mol_id must group each molecule's atoms contiguously")
    mols = [atoms[ids == i] for i in order]
    for mol in mols:
        mol.info["charge"] = float(mol.info.get("charge", 0.0))
    return mols


def build_input(
    model: torch.nn.Module,
    atoms: Any,
    *,
    charge: float | Sequence[float] | None = None,
    calculator: Any = None,
    device: str | torch.device | None = None,
    limit: int | None = None,
) -> dict[str, Tensor]:
    """aimnet's own flat input for one ``ase.Atoms`` or a list of molecules.

    The neighbour matrices come from aimnet's calculator pipeline
    (``AIMNet2Calculator.prepare_input``), so the input is exactly what
    aimnet itself would feed the model; atomic numbers past the model's
    per-element tables (``limit``, default: measured from the model) are a
    ``ValueError``. Pass ``calculator`` to reuse one
    across steps; ``charge`` per molecule (default: ``atoms.info["charge"]``
    or 0); ``device`` defaults to the model's.
    """
    mols = _molecules(atoms)
    if not mols or any(len(m) == 0 for m in mols):
        raise ValueError("build_input needs at least one molecule, each with at least one atom")
    if any(bool(getattr(m, "pbc", [False]).any()) for m in mols):
        raise ValueError("the aimnet2 adapter takes molecules (pbc=False); periodic input is not supported")
    if calculator is None:
        calculator = _calculator(model)
    _check_numbers({int(z) for m in mols for z in m.numbers}, limit or max_number(model), calculator)
    if charge is None:
        charges = [float(m.info.get("charge", 0.0)) for m in mols]
    else:
        charges = [float(c) for c in (charge if isinstance(charge, Sequence) else [charge] * len(mols))]
    param = next(model.parameters())
    dtype, device = param.dtype, device if device is not None else param.device
    data = {
        "coord": torch.cat([torch.as_tensor(m.get_positions(), dtype=dtype) for m in mols]),
        "numbers": torch.cat([torch.as_tensor(m.get_atomic_numbers()) for m in mols]),
        "charge": torch.tensor(charges, dtype=dtype),
        "mol_idx": torch.repeat_interleave(torch.arange(len(mols)), torch.tensor([len(m) for m in mols])),
    }
    return calculator.prepare_input({k: v.to(device) for k, v in data.items()})


def tensor_input(model: torch.nn.Module, *, calculator: Any = None) -> Any:
    """``Structures -> aimnet's flat input`` on the structures' device: each
    system a molecule (charge from ``Structures.charge``, default neutral),
    the neighbour matrices from aimnet's own ``prepare_input``, given the
    tensors :func:`build_input` makes from ``ase.Atoms``, so the input is
    the same. Per composition the checks (elements the model knows, finite
    positions, no periodic system); per step no host work but aimnet's."""
    calculator = calculator if calculator is not None else _calculator(model)
    known = _known_numbers(max_number(model), calculator)
    dtype = next(model.parameters()).dtype
    state: dict[str, Any] = {}

    def build(structures: Structures) -> dict[str, Tensor]:
        composition = Composition.of(structures, state.get("composition"), known)
        if composition is not state.get("composition"):
            periodic = [i for i, p in enumerate(composition.pbc) if any(p)]
            if periodic:
                raise ValueError(f"ddpad: system(s) {periodic} are periodic: the aimnet2 adapter takes molecules "
                                 "(pbc=False)")
            state["composition"] = composition
        positions = structures.positions
        charge = structures.charge
        if charge is None:
            charge = torch.zeros(composition.n_systems, dtype=dtype, device=positions.device)
        elif charge.shape != (composition.n_systems,):
            raise ValueError(f"ddpad: charge must be [S] = [{composition.n_systems}] (one per system), "
                             f"got {list(charge.shape)}")
        return calculator.prepare_input({"coord": positions.to(dtype), "numbers": structures.numbers.long(),
                                         "charge": charge.to(dtype), "mol_idx": composition.system})

    return build


def max_number(model: torch.nn.Module) -> int:
    """The largest atomic number every per-element table of ``model`` holds."""
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return min(sizes) - 1 if sizes else 118


def _implemented(calculator: Any) -> list[int]:
    """The elements the model's metadata says it implements ([]: unsaid)."""
    return (getattr(calculator, "metadata", None) or {}).get("implemented_species") or []


def _known_numbers(limit: int, calculator: Any) -> frozenset[int]:
    """The atomic numbers the model has parameters for (1..``limit``, those
    it implements where its metadata says)."""
    implemented = _implemented(calculator)
    return frozenset(z for z in range(1, limit + 1) if not implemented or z in implemented)


def _check_numbers(numbers: set[int], limit: int, calculator: Any) -> None:
    """Reject elements the model has no parameters for: an index past an
    embedding table aborts the process under inductor (no Python error)."""
    implemented = _implemented(calculator)
    bad = sorted(numbers - _known_numbers(limit, calculator))
    if bad:
        known = f"implemented_species {sorted(implemented)}" if implemented else f"atomic numbers 1..{limit}"
        raise ValueError(f"atomic numbers {bad} are not known to this AIMNet2 model ({known})")


def _calculator(model: torch.nn.Module) -> Any:
    from aimnet.calculators import AIMNet2Calculator

    return AIMNet2Calculator(model=model, device=str(next(model.parameters()).device))


def _cutoff(model: torch.nn.Module) -> float:
    return float(model.aev.rc_s)


def ase_calculator(model: torch.nn.Module) -> Any:
    """aimnet's own ASE calculator (``AIMNet2ASE``) around ``model``: one
    ``Atoms``, one neutral molecule."""
    from aimnet.calculators import AIMNet2ASE

    return AIMNet2ASE(_calculator(model), charge=0)


def torchsim_model(model: torch.nn.Module) -> Any:
    """aimnet's own torch-sim model (``AIMNet2TorchSim``) around ``model``."""
    from aimnet.calculators.aimnet2torchsim import AIMNet2TorchSim

    return AIMNet2TorchSim(_calculator(model))


MOLECULES = ("H2O", "CH4", "NH3", "C2H6", "CH3OH", "C6H6", "CH3CHO", "HCOOH")


def random_model(
    dtype: torch.dtype | None = None, device: str = "cpu", *, config: str = "aimnet2.yaml", seed: int = 0
) -> torch.nn.Module:
    """AIMNet2 from a config aimnet ships (``aimnet/models/*.yaml``), randomly
    initialised, with random biases (zero biases would hide padding leaks).

    aimnet casts inputs to torch's default dtype as it was when aimnet was
    imported, so the model takes that dtype; asking for another raises.
    """
    import importlib.resources

    import yaml
    from aimnet.config import build_module
    from aimnet.models.base import AIMNet2Base

    native = AIMNet2Base._required_keys_dtype[0]
    if dtype is not None and dtype != native:
        raise ValueError(
            f"aimnet casts coordinates to {native} (torch's default dtype when aimnet was imported); "
            f"for {dtype} call torch.set_default_dtype({dtype}) before importing aimnet"
        )
    path = importlib.resources.files("aimnet") / "models" / config
    torch.manual_seed(seed)
    model = build_module(yaml.safe_load(path.read_text()))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.3)
    return model.to(dtype=native, device=device)


def load_model(path: str, device: str = "cpu") -> torch.nn.Module:
    """A local aimnet model file (v2 ``.pt`` or trusted legacy ``.jpt``).

    A v2 file whose metadata leaves the long-range Coulomb and DFT-D3 terms
    to aimnet's calculator (``needs_coulomb`` / ``needs_dispersion``: the
    registry's wB97M-D3 models) gets them as its last output modules
    (:func:`_embed_external_terms`), so the model gives the energy
    ``AIMNet2Calculator`` gives (before: the model alone, without them;
    0.67 eV off on a random wB97M-D3 model's molecules).
    """
    from aimnet.models.base import load_model as aimnet_load

    model, _ = aimnet_load(path, device=device)
    return _embed_external_terms(model)


def _embed_external_terms(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with the external ``LRCoulomb`` / ``DFTD3`` that
    ``AIMNet2Calculator`` builds from its metadata appended to its outputs
    (the calculator runs them after the model, in this order), and the
    metadata saying so: a calculator around it adds them no more, and builds
    the same neighbour matrices (tested against the calculator on the
    external model: energies within 4e-7 eV)."""
    meta = getattr(model, "_metadata", None) or {}
    if not (meta.get("needs_coulomb") or meta.get("needs_dispersion")):
        return model
    calculator = _calculator(model)
    for name, module in (("lrcoulomb", calculator.external_coulomb), ("dftd3", calculator.external_dftd3)):
        if module is not None:
            model.outputs[name] = module
    # "full_embedded": aimnet's mode of a model that holds its whole Coulomb term (legacy .jpt models)
    mode = "full_embedded" if calculator.external_coulomb is not None else meta.get("coulomb_mode", "none")
    model._metadata = {**meta, "needs_coulomb": False, "needs_dispersion": False, "coulomb_mode": mode}
    return model


# the elements of the published AIMNet2 wB97M-D3 models (H, B, C, N, O, F, Si, P, S, Cl, As, Se, Br, I)
WB97M_SPECIES = (1, 5, 6, 7, 8, 9, 14, 15, 16, 17, 33, 34, 35, 53)


def foundation_models() -> dict[str, Any]:
    """The published AIMNet2 wB97M-D3 (aimnet's registry: ``aimnet2-wb97m-d3_0``
    .. ``_3``, one architecture) with random weights, made as its files are
    made and loaded as users load them: :func:`wb97m_d3_model`."""
    return {"aimnet2-wb97m-d3": wb97m_d3_model}


def wb97m_d3_model(seed: int = 0) -> torch.nn.Module:
    """AIMNet2 wB97M-D3 as the registry ships it (float32; float64 atomic
    shifts), random weights: the file :func:`_export_wb97m_d3` writes, loaded
    by :func:`load_model` as a user loads the registry's files."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return load_model(str(_export_wb97m_d3(tmp, seed)))


def _export_wb97m_d3(folder: str, seed: int = 0) -> Any:
    """Write ``folder/model.pt``, a random-weight AIMNet2 wB97M-D3 made as the
    registry's files are made: :func:`random_model` of aimnet's
    ``aimnet2_dftd3_wb97m.yaml`` exported by aimnet's own ``aimnet export``
    (``aimnet/train/export_model.py``: the long-range Coulomb and D3 terms
    left to the calculator, a short-range Coulomb term in their place,
    self-atomic energies baked into the float64 atomic shifts, the other
    elements' embedding rows NaN) with random self-atomic energies (-2000
    to -10 eV) for :data:`WB97M_SPECIES`. Returns the file's path."""
    import contextlib
    import importlib.resources
    import io
    import pathlib

    import yaml
    from aimnet.train.export_model import export_model

    config = importlib.resources.files("aimnet") / "models" / "aimnet2_dftd3_wb97m.yaml"
    weights = random_model(config=config.name, seed=seed).state_dict()
    generator = torch.Generator().manual_seed(seed)
    sae = {z: -10.0 - 1990.0 * float(torch.rand((), generator=generator)) for z in WB97M_SPECIES}
    out = pathlib.Path(folder)
    torch.save(weights, out / "weights.pt")
    (out / "model.sae").write_text(yaml.safe_dump(sae))
    args = [str(out / "weights.pt"), str(out / "model.pt"), "--model", str(config), "--sae", str(out / "model.sae")]
    with contextlib.redirect_stdout(io.StringIO()):
        export_model.main(args, standalone_mode=False)
    return out / "model.pt"


def default_system() -> Any:
    """A set of eight small molecules, 10 A apart, as one ``ase.Atoms`` whose
    ``mol_id`` array says which atom belongs to which molecule."""
    import numpy as np
    from ase import Atoms
    from ase.build import molecule

    parts = []
    for i, name in enumerate(MOLECULES):
        mol = molecule(name)
        mol.positions += (10.0 * (i % 4), 10.0 * (i // 4), 0.0)
        mol.set_array("mol_id", np.full(len(mol), i))
        parts.append(mol)
    atoms = Atoms()
    for mol in parts:
        atoms += mol
    return atoms


ADAPTER = builtin_adapter(
    "aimnet2",
    requires=("aimnet",),  # import names, the model package's first
    make_padder=make_padder,
    energy_key="energy",
    cutoff=_cutoff,
    call=_step,
    evaluate=evaluate,
    grad_input="coord",
    call_forms=({},),  # aimnet's AIMNet2Calculator calls model(data), forces by autograd outside
    engine=EngineHooks(
        build_input=build_input,
        tensor_input=tensor_input,
        molecules=True,
        input_context=lambda model: {"calculator": _calculator(model), "limit": max_number(model)},
        message_layers=None,  # its long-range Coulomb term sees every atom: no finite ghost depth
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
