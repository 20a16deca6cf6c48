"""The tensor input path: ``ddpad.padding.Structures`` -> an adapter's native input on
the tensors' device (MACE, SevenNet), against the adapter's own ASE pipeline,
its checks, and what it reads from the device. Each adapter's cases run where
its package is installed (the mace and sevennet sessions)."""

from __future__ import annotations

import collections
import sys
import traceback
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("vesin_torch")
from ase import Atoms  # noqa: E402
from ase.build import bulk, molecule  # noqa: E402

from ddpad import Evaluator
from ddpad.padding import Structures
from ddpad.adapters import get  # noqa: E402

class Case(NamedTuple):
    package: str
    model: Any  # adapter -> a random model
    tol: float  # against its pipeline: float64 to 1e-10; sevenn is float32 only and its edges come in another
    #             order, so sums round differently
    unknown: int  # an atomic number the model does not know
    graph_reads: bool = False  # the package's own graph code reads the device while the input is built (orb)
    builder_reads: str = ""  # the adapter's module that reads the device building the input (a size it needs)
    mixed_pbc: bool = True  # takes systems periodic along some axes only (a slab)


ADAPTERS: dict[str, Case] = {
    "mace": Case("mace", lambda a: a.tools.random_model(torch.float64, r_max=3.0), 1e-10, 14),
    "sevennet": Case("sevenn", lambda a: a.tools.random_model(), 2e-5, 14),
    "uma": Case("fairchem.core", lambda a: a.tools.random_model(torch.float64), 1e-10, 0),
    "nequip": Case("nequip", lambda a: a.tools.random_model(torch.float64), 1e-10, 14),
    "allegro": Case("allegro", lambda a: a.tools.random_model(torch.float64), 1e-10, 14),
    "orb": Case("orb_models", lambda a: a.tools.random_model(), 1e-5, 0, graph_reads=True, mixed_pbc=False),
    # float32 only; the triplet count sizes its three-body tensors
    "mattersim": Case("mattersim", lambda a: a.tools.random_model(), 1e-5, 95, builder_reads="mattersim/__init__.py"),
}


@pytest.fixture(scope="module", params=list(ADAPTERS))
def adapter_model(request: pytest.FixtureRequest) -> tuple[Any, torch.nn.Module, float]:
    case = ADAPTERS[request.param]
    pytest.importorskip(case.package)
    adapter = get(request.param)
    return adapter, case.model(adapter), case.tol


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """MACE's (the tests of what one adapter's builder caches)."""
    pytest.importorskip("mace")
    return get("mace").tools.random_model(torch.float64, r_max=3.0)


def close(got: Any, want: Any, tol: float, msg: str) -> None:
    """Equal to ``tol`` relative to the reference's largest magnitude (at least 1)."""
    want = torch.as_tensor(want)
    scale = max(float(want.abs().max()), 1.0) if want.numel() else 1.0
    torch.testing.assert_close(torch.as_tensor(got), want, rtol=0, atol=tol * scale, msg=msg)


def crystal(rep: tuple[int, int, int], seed: int) -> Atoms:
    atoms = bulk("C", "diamond", a=3.57, cubic=True) * rep
    atoms.numbers[::3] = 1
    atoms.rattle(0.1, seed=seed)
    return atoms


def slab() -> Atoms:
    atoms = crystal((2, 2, 1), 3)
    atoms.pbc = (True, True, False)
    return atoms


def water(vacuum: float | None) -> Atoms:
    atoms = molecule("H2O")
    if vacuum is not None:
        atoms.center(vacuum=vacuum)
    return atoms


CASES = {
    "bulk": lambda: [crystal((2, 1, 1), 0)],
    "molecule without cell": lambda: [water(None)],
    "molecule in a box": lambda: [water(3.0)],
    "slab": lambda: [slab()],
    "batch of four": lambda: [crystal((1, 1, 1), 1), water(None), slab(), crystal((2, 2, 1), 2)],
}


def case_atoms(case: str, adapter: Any) -> list[Atoms]:
    """The case's structures; a slab is made periodic along all axes for an
    adapter that takes no mixed periodicity (orb)."""
    atoms = CASES[case]()
    if not ADAPTERS[adapter.name].mixed_pbc:
        for a in atoms:
            if a.pbc.any():
                a.pbc = True
    return atoms


def flat(data: Any) -> dict[str, Any]:
    """A native input as one dict: a dict, a batch with ``keys()`` (fairchem),
    or orb's ``AtomGraphs`` (its feature dicts as ``group:name``, its
    ``senders`` / ``receivers`` as ``edge_index``)."""
    if hasattr(data, "keys"):
        return {k: data[k] for k in data.keys()}
    out = {k: getattr(data, k) for k in ("n_node", "n_edge", "tags", "max_num_neighbors")}
    out["edge_index"] = torch.stack([data.senders, data.receivers])
    for group in ("node_features", "edge_features", "system_features"):
        out.update({f"{group}:{k}": v for k, v in getattr(data, group).items()})
    out["unit_shifts"] = out["edge_features:unit_shifts"]
    return out


def fields(data: Any) -> dict[str, Any]:
    """Each input field's dtype and trailing shape (a tensor), or its value."""
    return {k: (v.dtype, v.shape[1:]) if isinstance(v, torch.Tensor) else v for k, v in flat(data).items()}


def edges(data: Any) -> list[tuple[float, ...]]:
    """The edge set: (sender, receiver, lattice shift or edge vector), sorted."""
    data = flat(data)
    extra = next(data[k] for k in ("unit_shifts", "edge_cell_shift", "edge_vec", "cell_offsets", "pbc_offsets")
                 if k in data)
    rows = torch.cat([data["edge_index"].T.double(), extra.double()], dim=1).round(decimals=4)
    return sorted(map(tuple, rows.tolist()))


@pytest.mark.parametrize("case", CASES)
def test_same_numbers_as_the_adapters_pipeline(adapter_model: Any, case: str) -> None:
    adapter, model, tol = adapter_model
    atoms = case_atoms(case, adapter)
    reference = adapter.engine.build_input(model, atoms)
    data = adapter.engine.tensor_input(model)(Structures.from_atoms(atoms))
    want, got = fields(reference), fields(data)
    assert got == {k: want[k] for k in got}  # (mace's pipeline adds label fields)
    assert edges(data) == edges(reference)
    evaluate = Evaluator(model, adapter, pad=False, compile=False)
    want, got = evaluate(atoms, stress=True), evaluate(Structures.from_atoms(atoms), stress=True)
    periodic = all(a.pbc.all() for a in atoms)  # (stress without a cell: NaN or absent, as the package has it)
    for key in ("energy", "forces", *(["stress"] if periodic else [])):
        close(got[key], want[key], tol, key)


def test_padded_call_same_as_ase_path(adapter_model: Any) -> None:
    adapter, model, tol = adapter_model
    atoms = case_atoms("batch of four", adapter)
    evaluate = Evaluator(model, adapter, compile=False)
    assert evaluate.takes_tensors
    want = evaluate(atoms, stress=True)
    got = evaluate(Structures.from_atoms(atoms), stress=True)
    for key in ("energy", "forces"):
        close(got[key], want[key], tol, key)
    periodic = [i for i, a in enumerate(atoms) if a.pbc.all()]
    close(got["stress"][periodic], want["stress"][periodic], tol, "stress")


def bad(kind: str, unknown: int) -> Structures:
    s = Structures.from_atoms([crystal((1, 1, 1), 0), crystal((1, 1, 1), 1), crystal((1, 1, 1), 2)])
    lo = 8  # system 1's first atom
    if kind == "unknown species":
        s.numbers[lo + 2] = unknown
    elif kind == "NaN position":
        s.positions[lo + 1, 2] = float("nan")
    elif kind == "cell of zeros with pbc":
        s.cell[1] = 0.0
    elif kind == "empty system":
        s.system = torch.where(s.system == 1, 2, s.system)
    return s


@pytest.mark.parametrize("kind", ["unknown species", "NaN position", "cell of zeros with pbc", "empty system"])
def test_bad_input_names_the_system_before_any_compile(adapter_model: Any, kind: str) -> None:
    adapter, model, _ = adapter_model
    evaluate = Evaluator(model, adapter, backend="aot_eager", compile_cache=None)
    with pytest.raises(ValueError, match="system 1|system\\(s\\) \\[1\\]") as info:
        evaluate(bad(kind, ADAPTERS[adapter.name].unknown))
    assert info.value.args[0].startswith("ddpad: ")
    assert evaluate.stats.graphs == 0 and evaluate.stats.calls == 0


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value by the host (``.item()``, ``.tolist()``,
    ``bool(t)``, ``int(t)``: ``aten._local_scalar_dense``), each by who made it:
    the file of ddpad, or ``"outside ddpad"`` when the innermost caller outside
    torch is the model package's own code (sevenn sizes buffers from
    ``num_atoms.sum()``; what the model reads, it reads without ddpad too)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_file: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            frames = [f.filename for f in traceback.extract_stack()[:-1]
                      if "/torch/" not in f.filename and f.filename != __file__]
            caller = frames[-1] if frames else "elsewhere"
            ours = "/ddpad_core/" in caller or "/adapters/" in caller
            self.by_file["/".join(caller.split("/")[-2:]) if ours else "outside ddpad"] += 1
        return func(*args, **(kwargs or {}))


def test_steady_step_reads_the_device_only_where_free(adapter_model: Any) -> None:
    """After the first call, a step with the same atoms reads nothing from the
    device to build its input, and the padded call only in the padders'
    host-device checks (``_padders/_checks.py``, which skip a tensor that is
    not on the CPU) and where the model itself reads: on a GPU, no host read
    but the neighbour list's and the model's own."""
    adapter, model, _ = adapter_model
    structures = Structures.from_atoms(case_atoms("batch of four", adapter))
    build = adapter.engine.tensor_input(model)
    evaluate = Evaluator(model, adapter, compile=False)
    evaluate(structures)
    build(structures)
    for _ in range(2):
        structures.positions = structures.positions + 0.01
        with HostReads() as built:
            build(structures)
        case = ADAPTERS[adapter.name]
        builder = {case.builder_reads} if case.builder_reads else set()
        allowed = ({"outside ddpad"} if case.graph_reads else set()) | builder
        assert set(built.by_file) <= allowed, built.by_file
        with HostReads() as called:
            evaluate(structures, stress=True)
        assert set(called.by_file) - {"outside ddpad"} - builder == {"_padders/_checks.py"}, called.by_file


def test_composition_checked_again_when_atoms_change(model: torch.nn.Module) -> None:
    structures = Structures.from_atoms([crystal((1, 1, 1), 0), crystal((1, 1, 1), 1)])
    build = get("mace").engine.tensor_input(model)
    first = build(structures)
    assert build(structures)["node_attrs"] is first["node_attrs"]  # reused while the atoms stay
    structures.numbers[3] = 8  # in place: a new composition
    changed = build(structures)
    assert changed["node_attrs"] is not first["node_attrs"]
    assert changed["node_attrs"][3].argmax() == 2  # O is the third species
    structures.numbers = structures.numbers.clone()
    structures.numbers[3] = 14  # a new tensor: checked again
    with pytest.raises(ValueError, match="system 0 has atomic numbers \\[14\\]"):
        build(structures)


def test_ase_calculator_takes_the_tensor_path(adapter_model: Any) -> None:
    """``ddpad.ase.Calculator`` builds the input from the atoms' arrays as
    tensors (same numbers as its ASE pipeline, ``tensor_input=False``, over a
    short Langevin run), and checks the composition once while the atoms stay."""
    from ase import units
    from ase.md.langevin import Langevin

    from ddpad.ase import Calculator

    adapter, model, tol = adapter_model
    runs = {}
    for tensors in (True, False):
        atoms = crystal((2, 1, 1), 5)
        atoms.calc = Calculator(model, adapter, compile=False, tensor_input=tensors)
        assert atoms.calc.tensor_input is tensors
        dyn = Langevin(atoms, 1.0 * units.fs, temperature_K=600, friction=0.02, rng=np.random.default_rng(0))
        energies: list[float] = []
        dyn.attach(lambda: energies.append(atoms.get_potential_energy()), interval=1)
        dyn.run(5)
        runs[tensors] = (np.array(energies), atoms.get_forces(), atoms.get_stress())
        if tensors:
            numbers = atoms.calc.structures(atoms).numbers
            assert atoms.calc.structures(atoms).numbers is numbers  # the composition's tensors, reused
    for got, want, name in zip(runs[True], runs[False], ("energies", "forces", "stress")):
        close(got, want, tol, name)


def test_without_vesin_the_engines_use_the_pipeline(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """mace-torch installed without vesin-torch (``pip install ddpad mace-torch``):
    the ASE calculator runs through mace's pipeline, as before the tensor
    path; asking for the tensor path is one error naming what to install
    (before: every calculator call raised ImportError)."""
    from ddpad.ase import Calculator

    monkeypatch.setitem(sys.modules, "vesin_torch", None)  # import fails
    monkeypatch.setitem(sys.modules, "vesin.torch", None)
    atoms = crystal((1, 1, 1), 4)
    atoms.calc = Calculator(model, "mace", compile=False)
    assert atoms.calc.tensor_input is False
    want = Evaluator(model, "mace", pad=False, compile=False, tensor_input=False)(atoms)["energy"]
    close(atoms.get_potential_energy(), float(want.detach().sum()), 1e-10, "energy")
    with pytest.raises(ImportError, match="pip install vesin-torch"):
        Calculator(model, "mace", compile=False, tensor_input=True)
    with pytest.raises(ValueError, match="has no tensor_input"):
        Evaluator(model, "toy", compile=False, tensor_input=True)


def test_nequip_per_edge_type_cutoffs_prune_as_nequip_does() -> None:
    """A model with per-edge-type cutoffs: nequip's own pruning runs on the
    tensor path's pairs (the same, fewer, edges and numbers as its pipeline)."""
    pytest.importorskip("nequip")
    adapter = get("nequip")
    model = adapter.tools.random_model(torch.float64, per_edge_type_cutoff={"H": 2.5, "C": {"H": 3.0, "C": 3.5}})
    atoms = [crystal((2, 1, 1), 0), water(3.0)]
    reference = adapter.engine.build_input(model, atoms)
    data = adapter.engine.tensor_input(model)(Structures.from_atoms(atoms))
    assert edges(data) == edges(reference)
    assert len(edges(data)) < len(edges(adapter.engine.tensor_input(adapter.tools.random_model(torch.float64))(
        Structures.from_atoms(atoms))))  # pruned
    evaluate = Evaluator(model, adapter, pad=False, compile=False)
    want, got = evaluate(atoms), evaluate(Structures.from_atoms(atoms))
    for key in ("energy", "forces"):
        close(got[key], want[key], 1e-10, key)


@pytest.mark.parametrize("pbc", [True, torch.tensor([True, True, True]), torch.tensor([[True] * 3, [True] * 3])],
                         ids=["bool (torch-sim 0.3)", "[3] (torch-sim 0.6)", "[S, 3]"])
def test_every_pbc_form_an_engine_passes(pbc: Any) -> None:
    from ddpad.padding import Composition

    s = Structures.from_atoms([crystal((1, 1, 1), 0), crystal((1, 1, 1), 1)])
    s.pbc = pbc
    assert Composition(s).pbc == [(True, True, True)] * 2
    s.pbc = torch.tensor([True, False])
    with pytest.raises(ValueError, match="pbc must be a bool, \\[3\\] or \\[S, 3\\]"):
        Composition(s)


def test_orb_refuses_a_slab_as_its_pipeline_does() -> None:
    pytest.importorskip("orb_models")
    adapter = get("orb")
    with pytest.raises(ValueError, match="system\\(s\\) \\[1\\] are periodic along some axes only"):
        adapter.engine.tensor_input(adapter.tools.random_model())(Structures.from_atoms([crystal((1, 1, 1), 0), slab()]))
