"""Packages for ``pair_style ddpad``: a model's whole LAMMPS step, ahead of time.

One AOTInductor package per rung of a cap ladder. Its inputs are what a
LAMMPS pair style holds, at fixed caps: the rank's local + ghost atoms'
positions and element indices, the pairs within the cutoff (from LAMMPS's
full neighbour list, ghost neighbours included), and three counts (atoms,
pairs, owned atoms). The traced step pads itself: rows past the counts are
dead atoms in a system of their own and dead edges on the anchor pair
``caps - 2 -> caps - 1`` (as ddpad's padders place them), builds the
adapter's native input from these tensors (its ``lammps_input`` hook), runs
the model, and differentiates the owned atoms' energy with respect to every
row (:class:`~ddpad.engines.lammps.OwnedEnergy`) and to every edge vector
(per-atom virials: each edge's ``-r (x) dE/dr`` half on each end, LAMMPS's
``xx yy zz xy xz yz`` order, ghost rows included). So the C++ side is the
same for every adapter: copy the rows in, run the smallest rung that fits,
write forces on local and ghost rows back for LAMMPS's reverse
communication.

A package is checked when it is built: on an example graph cut to fit its
caps, its outputs must equal the eager model's on the unpadded graph (and
hold no NaN or inf in any row), or it is not written. What it was built for
(adapter, elements, cutoff, layers, dtype, units, caps, ddpad's version) is
in its metadata, which the pair style reads and checks.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .._aot import _own_build_files, _scalar_constants
from .._compile import run_step
from .._noise import quiet_warnings
from .._registry import resolve_adapter
from .._verify import disagreement, nonfinite
from .._version import __version__

__all__ = ["GhostGraph", "LammpsPackage", "build_ladder", "build_package", "ghost_graph", "ladder_caps",
           "read_metadata"]

#: The package layout the pair style reads (metadata ``ddpad.lammps``); 2: per-atom virials.
FORMAT = "2"
#: Dead atom rows every package keeps past the real ones: the anchor pair of the dead edges.
RESERVED = 2


@dataclasses.dataclass(frozen=True)
class GhostGraph:
    """One rank's graph as LAMMPS holds it: owned atoms first, then ghosts
    (explicit periodic images: no cell), and the directed pairs within the
    cutoff, both ways (``edges[0]`` sender, ``edges[1]`` receiver)."""

    positions: np.ndarray  # (n, 3) float64
    species: np.ndarray  # (n,) int64, indices into the package's elements
    edges: np.ndarray  # (2, e) int64
    owned: int

    @property
    def n_atoms(self) -> int:
        return int(self.positions.shape[0])

    @property
    def n_edges(self) -> int:
        return int(self.edges.shape[1])

    def pruned(self, layers: int) -> GhostGraph:
        """The part the owned atoms' energy depends on: the edges of atoms
        within ``layers - 1`` hops of an owned atom (both ways: models
        gather on either end of an edge, MACE on ``edges[1]``, nequip's on
        ``edges[0]``), and the atoms they join (owned atoms first, ghosts in
        their order). A message-passing model's owned energies, and so
        their gradient, are exactly those of the whole graph; the pair style
        prunes each step the same way."""
        hops = np.full(self.n_atoms, layers + 1, dtype=np.int64)
        hops[: self.owned] = 0
        senders, receivers = self.edges
        for level in range(1, layers + 1):
            into = hops[receivers] == level - 1
            reached = senders[into]
            hops[reached] = np.minimum(hops[reached], level)
        keep_edges = np.minimum(hops[senders], hops[receivers]) <= layers - 1
        keep = hops <= layers
        index = np.cumsum(keep) - 1
        return GhostGraph(self.positions[keep], self.species[keep], index[self.edges[:, keep_edges]], self.owned)

    def cut(self, atoms: int, edges: int) -> GhostGraph:
        """The graph of its first atoms, as many as fit ``atoms`` rows with
        their pairs within ``edges``: an example for a smaller rung."""
        n = min(self.n_atoms, atoms)
        while n > 0:
            keep = (self.edges < n).all(axis=0)
            if int(keep.sum()) <= edges:
                return GhostGraph(self.positions[:n], self.species[:n], self.edges[:, keep], min(self.owned, n))
            n -= max(1, n // 16)
        raise ValueError(f"no part of the example fits {atoms} atoms and {edges} edges")


def ghost_graph(atoms: Any, elements: Sequence[int], cutoff: float, ghost_cutoff: float) -> GhostGraph:
    """``atoms`` (an ``ase.Atoms``) as one LAMMPS rank holding the whole box
    sees it: its atoms, then every periodic image within ``ghost_cutoff`` of
    the cell (LAMMPS's ghosts, in fractional coordinates as for a triclinic
    box), and the pairs within ``cutoff``."""
    table = {int(z): i for i, z in enumerate(elements)}
    unknown = sorted({int(z) for z in atoms.numbers} - set(table))
    if unknown:
        raise ValueError(f"the example holds elements the model does not know: atomic numbers {unknown}")
    species = np.array([table[int(z)] for z in atoms.numbers], dtype=np.int64)
    positions = np.asarray(atoms.positions, dtype=np.float64)
    rows, kinds = [positions], [species]
    cell = np.asarray(atoms.cell.array, dtype=np.float64)
    if any(atoms.pbc):
        scaled = np.linalg.solve(cell.T, positions.T).T
        volume = abs(np.linalg.det(cell))
        heights = [volume / np.linalg.norm(np.cross(cell[(k + 1) % 3], cell[(k + 2) % 3])) for k in range(3)]
        reach = [ghost_cutoff / h if p else 0.0 for h, p in zip(heights, atoms.pbc)]
        ranges = [range(-math.ceil(r), math.ceil(r) + 1) for r in reach]
        for shift in np.array(np.meshgrid(*ranges, indexing="ij")).reshape(3, -1).T:
            if not shift.any():
                continue
            image = scaled + shift
            inside = ((image > -np.array(reach) - 1e-12) & (image < 1 + np.array(reach) + 1e-12)).all(axis=1)
            rows.append(image[inside] @ cell)
            kinds.append(species[inside])
    everything = np.concatenate(rows)
    return GhostGraph(everything, np.concatenate(kinds), _pairs(everything, cutoff), len(atoms))


def _pairs(positions: np.ndarray, cutoff: float) -> np.ndarray:
    """Directed pairs (i != j) closer than ``cutoff``, by blocks of rows."""
    found = []
    for start in range(0, len(positions), 512):
        block = positions[start:start + 512]
        d2 = ((block[:, None, :] - positions[None, :, :]) ** 2).sum(-1)
        i, j = np.nonzero(d2 < cutoff * cutoff)
        i = i + start
        keep = i != j
        found.append(np.stack([j[keep], i[keep]]))  # sender j, receiver i
    return np.concatenate(found, axis=1).astype(np.int64) if found else np.zeros((2, 0), dtype=np.int64)


def ladder_caps(graph: GhostGraph, rungs: int, margin: float = 1.25, step: float = 0.8) -> list[tuple[int, int]]:
    """``rungs`` caps (atoms, edges), largest first: the example graph with
    ``margin`` of head room (and the reserved dead rows), then ``step``
    times the one above (a rank of a decomposed box holds a part of it; a
    step runs the smallest rung that holds it, and a step's cost follows
    the rung's size, so rungs close together waste little)."""
    if rungs < 1:
        raise ValueError(f"a ladder needs at least one rung, got {rungs}")
    atoms, edges = graph.n_atoms * margin, graph.n_edges * margin
    caps = []
    for k in range(rungs):
        a = _round_up(int(math.ceil(atoms * step ** k)) + RESERVED, 8)
        e = _round_up(int(math.ceil(edges * step ** k)) + 1, 64)
        caps.append((a, e))
    return caps


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class LammpsPackage:
    """A package written for ``pair_style ddpad``: its file and caps."""

    path: str
    atoms: int
    edges: int
    seconds: float


def _lammps_step(model: torch.nn.Module, adapter: Any, build: Callable[..., dict[str, Any]],
                 edge_length: float) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The package's step: pad past the counts, build the native input, run
    the adapter's step with the owned atoms' energy differentiated. Returns
    the owned energy, forces ``(n, 3)``, per-atom energies ``(n,)`` and
    per-atom virials ``(n, 6)``."""
    from .lammps import OwnedEnergy

    engine = adapter.engine
    owned_energy = OwnedEnergy(adapter.call, engine.atom_energy_key, engine.positions_key)
    options = dict(engine.energy_only_options)
    config = adapter.dynamo_config

    def step(positions: torch.Tensor, species: torch.Tensor, edges: torch.Tensor,
             counts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, e, device = positions.shape[0], edges.shape[1], positions.device
        dead = torch.arange(n, device=device) >= counts[0]
        dead_edge = torch.arange(e, device=device) >= counts[1]
        anchor = torch.tensor([[n - 2], [n - 1]], device=device)
        # the anchor pair, one dead edge's length apart along x (no in-place write: Inductor's
        # select_scatter lowering fails on a constant)
        last = torch.arange(n, device=device)[:, None] == n - 1
        along_x = torch.arange(3, device=device)[None, :] == 0
        spot = (last & along_x).to(positions.dtype) * edge_length
        positions = positions.detach().requires_grad_(True)
        placed = torch.where(dead[:, None], spot, positions)
        pairs = torch.where(dead_edge, anchor, edges)
        shifts = torch.zeros(e, 3, dtype=torch.float64, device=device, requires_grad=True)
        data = build(placed, torch.where(dead, 0, species), dead, pairs, shifts)
        out = run_step(model, owned_energy, config, data, (counts[2],), {**options, "edge_shifts": shifts})
        energies = out[engine.atom_energy_key]
        return (out["owned_energy"], out["forces"], energies.reshape(n, -1).sum(dim=1),
                _atom_virials(placed.detach(), pairs, out["edge_gradient"]))

    return step


def _atom_virials(positions: torch.Tensor, pairs: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """Per-atom virials ``(n, 6)``: each edge's ``-r (x) dE/dr`` (``r`` from
    sender to receiver), symmetrised, half on each end (as mace's atomic
    virials), in LAMMPS's order xx yy zz xy xz yz. Their sum is the virial
    ``sum_i r_i (x) f_i`` (the energy depends on the positions through the
    edge vectors alone, and is rotation invariant: the sum is symmetric)."""
    r = positions[pairs[1]] - positions[pairs[0]]
    g = gradient.to(r.dtype)

    def sym(a: int, b: int) -> torch.Tensor:
        return 0.5 * (r[:, a] * g[:, b] + r[:, b] * g[:, a])

    w = -0.5 * torch.stack([r[:, 0] * g[:, 0], r[:, 1] * g[:, 1], r[:, 2] * g[:, 2],
                            sym(0, 1), sym(0, 2), sym(1, 2)], dim=1)
    virials = torch.zeros(positions.shape[0], 6, dtype=r.dtype, device=r.device)
    return virials.index_add(0, pairs[0], w).index_add(0, pairs[1], w)


def _inputs(graph: GhostGraph, atoms: int, edges: int) -> list[torch.Tensor]:
    """The package's four inputs for ``graph`` at caps (zeros past the counts).
    Positions are float64, as LAMMPS holds them; the model's input builder
    casts them to the model's dtype."""
    positions = torch.zeros(atoms, 3, dtype=torch.float64)
    positions[: graph.n_atoms] = torch.as_tensor(graph.positions, dtype=torch.float64)
    species = torch.zeros(atoms, dtype=torch.long)
    species[: graph.n_atoms] = torch.as_tensor(graph.species)
    pairs = torch.zeros(2, edges, dtype=torch.long)
    pairs[:, : graph.n_edges] = torch.as_tensor(graph.edges)
    counts = torch.tensor([graph.n_atoms, graph.n_edges, graph.owned], dtype=torch.long)
    return [positions, species, pairs, counts]


def _metadata(adapter: Any, model: torch.nn.Module, elements: Sequence[int], atoms: int, edges: int,
              layers: int, dtype: torch.dtype) -> dict[str, str]:
    from ase.data import chemical_symbols

    return {
        "ddpad.lammps": FORMAT, "ddpad.version": __version__, "ddpad.adapter": adapter.name,
        "ddpad.elements": " ".join(chemical_symbols[int(z)] for z in elements),
        "ddpad.cutoff": repr(float(adapter.cutoff(model))), "ddpad.layers": str(int(layers)),
        "ddpad.dtype": str(dtype).removeprefix("torch."), "ddpad.units": "metal",
        "ddpad.atoms": str(atoms), "ddpad.edges": str(edges), "ddpad.reserved": str(RESERVED),
    }


def build_package(model: torch.nn.Module, adapter: Any, atoms: int, edges: int, path: str | os.PathLike[str],
                  example: GhostGraph) -> LammpsPackage:
    """Trace, export and compile the step at caps ``(atoms, edges)``, check
    it against the eager model on ``example`` cut to fit, and write it to
    ``path`` only if it agrees. Raises ``ValueError`` saying what differed."""
    from torch.fx.experimental.proxy_tensor import make_fx

    adapter = resolve_adapter(adapter)
    hook = adapter.engine.lammps_input
    if hook is None:
        raise ValueError(f"adapter {adapter.name!r} has no lammps_input hook: its model cannot be packaged for "
                         "pair_style ddpad (use ddpad.engines.lammps.Potential, the fix external route)")
    if atoms <= RESERVED or edges < 1:
        raise ValueError(f"caps ({atoms} atoms, {edges} edges) leave no room: atoms must exceed {RESERVED}")
    t0 = time.perf_counter()
    dtype = next(model.parameters()).dtype
    layers = adapter.engine.message_layers(model) if adapter.engine.message_layers is not None else 1
    elements, _ = hook(model)
    edge_length = adapter.make_padder(model).dead.edge_length
    prepare = adapter.prepare_model or (lambda m: m)
    traced_model = prepare(model)
    step = _lammps_step(traced_model, adapter, hook(traced_model)[1], edge_length)
    graph = example.cut(atoms - RESERVED, edges)
    inputs = _inputs(graph, atoms, edges)
    gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)
    configs: dict[str, Any] = {"aot_inductor.metadata": _metadata(adapter, model, elements, atoms, edges, layers,
                                                                  dtype)}
    if _scalar_constants(gm):  # (as ddpad's own packages: Inductor inlines them where some lowerings cannot)
        configs["always_keep_tensor_constants"] = True
    # _own_build_files: the generated files named for this build alone (two builds of one architecture at
    # once overwrote each other's, weights included)
    with quiet_warnings(), tempfile.TemporaryDirectory(prefix="ddpad-lammps-") as tmp, _own_build_files(configs):
        exported = torch.export.export(gm, tuple(inputs), strict=False)
        built = torch._inductor.aoti_compile_and_package(exported, package_path=os.path.join(tmp, "step.pt2"),
                                                         inductor_configs=configs)
        runner = torch._C._aoti.AOTIModelPackageLoader(built, "model", False, 1, -1)
        got = runner.run(_inputs(graph, atoms, edges))
        # the eager step on a copy prepared afresh (the adapter's step runs on prepared models; the
        # traced copy went through a fake trace)
        reference = prepare(model)
        eager = _lammps_step(reference, adapter, hook(reference)[1], edge_length)(
            *_inputs(graph, graph.n_atoms, graph.n_edges))
        bad = nonfinite(got)
        n = graph.n_atoms
        why = (f"NaN or inf in {bad}" if bad else
               disagreement([got[0], *(t[:n] for t in got[1:])], [t.detach() for t in eager], model))
        if why is not None:
            raise ValueError(f"the {adapter.name} package at caps ({atoms} atoms, {edges} edges) disagrees with "
                             f"the eager model ({why}): not written")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        staging = f"{path}.{os.getpid()}.tmp"
        with open(built, "rb") as src, open(staging, "wb") as dst:
            dst.write(src.read())
        os.replace(staging, path)
    return LammpsPackage(os.fspath(path), atoms, edges, time.perf_counter() - t0)


def build_ladder(model: torch.nn.Module, adapter: Any, folder: str | os.PathLike[str], example: GhostGraph,
                 rungs: int = 3, caps: Sequence[tuple[int, int]] | None = None,
                 on_built: Callable[[LammpsPackage], None] | None = None) -> list[LammpsPackage]:
    """One package per rung into ``folder`` (named ``<adapter>-<atoms>x<edges>.pt2``):
    ``caps`` or :func:`ladder_caps` of the example."""
    adapter = resolve_adapter(adapter)
    built = []
    for atoms, edges in caps if caps is not None else ladder_caps(example, rungs):
        package = build_package(model, adapter, atoms, edges,
                                os.path.join(folder, f"{adapter.name}-{atoms}x{edges}.pt2"), example)
        built.append(package)
        if on_built is not None:
            on_built(package)
    return built


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """A package's metadata (what ``pair_style ddpad`` checks)."""
    return dict(torch._C._aoti.AOTIModelPackageLoader.load_metadata_from_package(os.fspath(path), "model"))
