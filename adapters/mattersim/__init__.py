"""MatterSim (``mattersim``): COO padding of mattersim's M3GNet input dict, triplets included.

The native input is what mattersim's calculator builds: its
``build_dataloader`` (``GraphConvertor``: pymatgen neighbour search within
the cutoff, three-body indices within the three-body cutoff) and
``batch_to_dict``: ``atom_pos [N, 3]``, ``atom_attr [N, 1]`` (atomic
numbers), ``batch [N]``, ``edge_index [2, E]``, ``pbc_offsets [E, 3]``
(lattice shifts), ``num_triple_ij [E, 1]``, ``three_body_indices [T, 2]``
(each system's own edge numbers), ``bond_index_bias [T, 1]`` (its system's
first edge), ``three_body_edge_map [T]`` (the edge each triplet sums into),
``cell [S, 3, 3]``, ``num_atoms`` / ``num_bonds`` / ``num_three_body [S]``,
``num_graphs`` and the host-side totals ``total_num_atoms`` /
``total_num_bonds``. The model is mattersim's ``Potential`` (an M3GNet):
the wrapped model is called as ``MatterSimCalculator`` calls it,
``potential.forward(input, include_forces=True, include_stresses=...)``,
and returns ``total_energy [S]``, ``forces [N, 3]``, ``stresses [S, 3, 3]``
(GPa, mattersim's sign).

Caps: ``atoms``, ``edges`` (with one slot always spare, see below),
``systems`` and ``triplets`` (initial 1.5, grow 1.30, stride 64: a triplet
count grows about as the square of the neighbour count).

- Dead atoms (``Z = 0``: mattersim's one-hot has a class 0) form their own
  dead system (one more cell and count entry), beyond the real atoms'
  bounding box. Joined to a real system they would add their per-atom
  energy (the normaliser's shift and scale of ``Z = 0``) to it (tested).
- Dead edges join the dead anchor pair ``n_cap - 2 -> n_cap - 1``, placed
  ``2 * cutoff + 1`` apart with zero lattice shifts (never zero-length: no
  NaN through ``norm``, ``sin(r) / r`` or ``1 / (r_ij r_ik)``). M3GNet's
  two-body radial basis (``SmoothBesselBasis``) is *not* zero beyond the
  cutoff, so dead edges carry messages, but only between dead atoms: real
  atoms stay exact because no real edge touches a dead atom and the dead
  atoms are a system of their own. Its three-body envelope (``polynomial``,
  clamped at 0) *is* exactly zero beyond the three-body cutoff, value and
  gradient.
- **Dead triplets**: rows ``T .. t_cap - 1`` of ``three_body_indices`` are
  ``(0, 0)`` with ``bond_index_bias = e_cap - 1``, so both of their edges
  (``ij`` and ``ik``) are edge ``e_cap - 1``; ``three_body_edge_map`` is
  ``e_cap - 1`` too (their sum lands on that edge). That edge is always
  dead: the edges cap reserves one slot (``CapPolicy(extra=1)``), so
  ``E < e_cap`` holds on every step. Its length is beyond the three-body
  cutoff, so the envelope ``polynomial(r_ij) * polynomial(r_ik)`` is exactly
  0 and the dead triplets' spherical basis (finite: ``cos`` of the edge
  with itself is clamped to ``1 - 1e-7`` by mattersim) is multiplied to 0;
  even nonzero, it would only reach the dead edge. The counts follow:
  ``num_triple_ij`` of edge ``e_cap - 1`` and ``num_three_body`` of the
  dead system count the dead triplets, so ``three_body_edge_map`` is still
  ``repeat_interleave(arange(e_cap), num_triple_ij)``.
- Host-side sizes: mattersim reads ``total_num_atoms``, ``total_num_bonds``
  and ``num_graphs`` as sizes; in the padded input they are the caps, as
  Python ints (fixed between growths, so no graph depends on the data).
  ``M3Gnet.forward`` still evaluates ``int(num_atoms.sum())`` as the default
  of ``input.get("total_num_atoms", ...)`` (Python evaluates it even when
  the key is given), and ``int(num_bonds.sum())`` likewise: the step gives
  it one-element host tensors of the caps instead (:func:`_host_counts`;
  mattersim reads them nowhere else), so the ahead-of-time route's trace
  (``make_fx``, fake) reads no size from the data, and a GPU step no longer
  syncs on them. ``capture_scalar_outputs`` (scoped to each compiled call)
  stays for inputs without the host totals.
- Pickling: a background build's worker gets the model pickled, and
  mattersim's ``Potential`` holds torch_ema's EMA, whose weak references
  do not pickle. The potentials built here (:func:`random_model`,
  :func:`load_model`) carry the same EMA in a class that pickles; a
  ``Potential`` built by mattersim itself still does not (its background
  builds fail with that reason and run ``torch.compile``; ``aot_build=
  "foreground"`` builds in the process).
- One graph: ``Potential.forward`` makes its strain (a leaf that requires
  grad) inside ``forward`` and takes forces and stress by
  ``autograd.grad`` there. :func:`prepare_model` compiles
  :class:`MatterSimForward` (the same computation over a private copy of
  the M3GNet, strain made outside the compiled region by :func:`_step`, a
  retained autograd graph) with ``trace_autograd_ops`` scoped to each call:
  energy, forces and stress are one graph, plus one per growth (and one per
  call form: with or without forces / stress).
- ``atom_attr`` is given as int64 by :func:`build_input` (mattersim's
  convertor stores float32 and reads ``atom_attr.long()``: the same values);
  the padder takes either.
- float32 only: mattersim casts to ``.float()`` inside ``forward`` (the
  lattice shifts, the one-hot), so a float64 model fails in mattersim
  itself. Exactness is against the eager model's own run-to-run noise,
  measured on CPU (2 threads) with the random test model (forces ~0.02
  eV/A, stresses ~1 GPa, energies ~50 eV): forces differ by up to 1e-8
  eV/A and stresses by up to 5e-7 GPa between two eager runs of the same
  input; energies repeat bit for bit. The padded, compiled model
  (``aot_eager``) stays within that noise (tests: ``atol`` 1e-5, ``rtol``
  1e-6).

Tested with mattersim 1.2.3.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch
from ase.units import GPa
from ddpad.padding import COOPadder, CapPolicy, Composition, Fill, NeighborList, Structures
from ddpad.adapters import EngineHooks, ToolHooks
from ddpad.adapters._common import builtin_adapter, detach, diamond_carbon
from torch import Tensor

from ._models import ase_calculator, load_model, m3gnet_of, random_model, torchsim_model

__all__ = [
    "ADAPTER", "MatterSimForward", "MatterSimPadder", "build_input", "default_system", "evaluate", "load_model",
    "make_padder", "prepare_model", "properties", "random_model", "tensor_input",
]

ENERGY = "total_energy"
FORCES = "forces"
STRESSES = "stresses"
ATOM_OUTPUTS = (FORCES,)
SYSTEM_OUTPUTS = (ENERGY, STRESSES)
# per-triplet fields ``[T, ...]``, padded to the triplets cap (dead rows: see MatterSimPadder)
TRIPLET_FIELDS = ("three_body_indices", "bond_index_bias", "three_body_edge_map")

_TRIPLETS = CapPolicy(initial_factor=1.5, grow_factor=1.30, stride=64)


def _cutoff(model: torch.nn.Module) -> float:
    """The two-body cutoff (the three-body cutoff is never larger)."""
    args = m3gnet_of(model).model_args
    return float(max(args["cutoff"], args["threebody_cutoff"]))


class MatterSimPadder(COOPadder):
    """:class:`ddpad.padding.COOPadder` for mattersim's input dict, plus a triplet cap.

    Atoms, edges and systems are padded by the COO machinery (dead anchor
    pair, own dead system). Afterwards the triplet fields are padded to the
    ``"triplets"`` cap: dead triplets are ``(0, 0)`` in
    ``three_body_indices`` with ``bond_index_bias = e_cap - 1`` and
    ``three_body_edge_map = e_cap - 1``: both of their edges are the last
    edge row, which is always dead (the edges cap keeps one slot spare).
    The per-edge ``num_triple_ij`` and per-system ``num_three_body`` count
    them (on that edge and on the dead system), and the host-side totals
    the model reads (``total_num_atoms``, ``total_num_bonds``,
    ``num_graphs``) become the padded sizes, as Python ints.
    """

    def __init__(
        self, cutoff: float, *, triplets_policy: CapPolicy = _TRIPLETS, triplets_key: str = "triplets",
        **overrides: Any,
    ) -> None:
        config: dict[str, Any] = {
            "positions": "atom_pos", "edge_index": "edge_index", "edge_layout": "2E",
            "atom_fields": {"atom_attr": 0},
            "edge_fields": {"pbc_offsets": 0.0},
            "system_fields": {"cell": Fill.DEAD_CELL},
            "system_index": "batch", "ptr": None, "system_count": "num_atoms",
            "atom_counts": "num_atoms", "edge_counts": "num_bonds",
            "atom_outputs": ATOM_OUTPUTS, "system_outputs": SYSTEM_OUTPUTS,
        }
        config.update(overrides)
        super().__init__(cutoff, **config)
        if "edges_policy" not in overrides:  # COOPadder's, with a dead edge for the dead triplets
            self.edges_policy = dataclasses.replace(self.edges_policy, extra=1)
        if self.edges_policy.extra < 1:
            raise ValueError("the mattersim padder needs edges_policy.extra >= 1 (a dead edge for dead triplets)")
        self.triplets_policy = triplets_policy
        self.triplets_key = triplets_key
        self.n_triplets: int | None = None

    def count(self, data: Mapping[str, Tensor]) -> dict[str, int]:
        counts = super().count(data)
        tbi = data.get("three_body_indices")
        if tbi is None:
            raise KeyError("ddpad: mattersim input has no 'three_body_indices' (build it with batch_to_dict)")
        counts[self.triplets_key] = int(tbi.shape[0])
        return counts

    def extra_requests(self, counts: dict[str, int]) -> dict[str, tuple[int, CapPolicy]]:
        requests = super().extra_requests(counts)
        requests[self.triplets_key] = (counts[self.triplets_key], self.triplets_policy)
        return requests

    def check_fits(self, counts: Mapping[str, int], caps: Mapping[str, int]) -> None:
        super().check_fits(counts, caps)
        e, cap = counts[self.edges_key], caps[self.edges_key]
        if e + self.edges_policy.extra > cap:
            raise RuntimeError(
                f"ddpad: {self.edges_key!r} overflows its cap: real {e} (needs {e + self.edges_policy.extra} "
                f"with the dead edge of dead triplets) > cap {cap}; grow the cap or preset a larger one"
            )

    def write_padded(
        self, data: Mapping[str, Tensor], counts: dict[str, int], caps: Mapping[str, int],
    ) -> dict[str, Any]:
        data = _complete(data)
        own = ("num_triple_ij", "num_three_body", *TRIPLET_FIELDS)
        out = super().write_padded({k: v for k, v in data.items() if k not in own}, counts, caps)
        n_cap = int(out[self.positions].shape[0])
        e_cap = int(out[self.edge_index].shape[1])
        s_cap = int(out[self.system_count].shape[0])
        s, t, t_cap = counts[self.systems_key], counts[self.triplets_key], caps[self.triplets_key]
        self.n_triplets = t
        dead_edge = e_cap - 1
        for name in TRIPLET_FIELDS:
            out[name] = self._rows(name, data[name], t_cap, 0 if name == "three_body_indices" else dead_edge)
        per_edge = self._rows("num_triple_ij", data["num_triple_ij"], e_cap, 0)
        per_edge[dead_edge] = t_cap - t
        per_system = self._rows("num_three_body", data["num_three_body"], s_cap, 0)
        if self.placement == "own":
            per_system[self.dead_system(s, s_cap)] = t_cap - t
        else:
            per_system[s - 1] += t_cap - t
        out["num_triple_ij"], out["num_three_body"] = per_edge, per_system
        # the sizes mattersim reads on the host: fixed by the caps, so Python ints
        out["total_num_atoms"], out["total_num_bonds"], out["num_graphs"] = n_cap, e_cap, s_cap
        return out

    def _rows(self, name: str, real: Tensor, cap: int, fill: int) -> Tensor:
        """``real`` in a persistent ``cap``-row buffer whose other rows are ``fill``."""
        buf = self.buffer(name, (cap, *real.shape[1:]), real)
        n = real.shape[0]
        buf[:n].copy_(real)
        buf[n:].fill_(fill)
        return buf


def _complete(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``bond_index_bias`` and ``three_body_edge_map`` as mattersim's
    ``batch_to_dict`` computes them, when an input lacks them."""
    if "bond_index_bias" in data and "three_body_edge_map" in data:
        return data
    data = dict(data)
    num_bonds = data["num_bonds"]
    if "bond_index_bias" not in data:
        cumsum = torch.cumsum(num_bonds, dim=0) - num_bonds
        data["bond_index_bias"] = torch.repeat_interleave(cumsum, data["num_three_body"], dim=0).unsqueeze(-1)
    if "three_body_edge_map" not in data:
        index = torch.arange(int(num_bonds.sum()), device=num_bonds.device)
        data["three_body_edge_map"] = torch.repeat_interleave(index, data["num_triple_ij"].view(-1))
    return data


def make_padder(model: torch.nn.Module, **overrides: Any) -> MatterSimPadder:
    """The mattersim padder for ``model`` (cutoff: the larger of its two- and
    three-body cutoffs); keyword arguments override :class:`MatterSimPadder`'s
    and :class:`ddpad.padding.COOPadder`'s."""
    return MatterSimPadder(_cutoff(model), **overrides)


def _host_counts(input: dict[str, Any]) -> None:
    """``num_atoms`` / ``num_bonds`` as one-element host tensors of their
    totals, where the input gives those totals as Python ints (the padded
    input: the caps).

    ``M3Gnet.forward`` evaluates ``int(num_atoms.sum())`` and
    ``int(num_bonds.sum())`` as the unused defaults of
    ``input.get("total_num_atoms", ...)``: a value read from the data, which
    ``make_fx`` (the ahead-of-time route) cannot trace, and a device sync
    on a GPU. mattersim reads these two tensors nowhere else once
    ``total_num_atoms``, ``total_num_bonds``, ``bond_index_bias`` and
    ``three_body_edge_map`` are given (its blocks take them as arguments
    and use them only when those are missing), so a tensor holding the same
    total (the padded counts add up to the caps) changes no number; built
    from a Python int on the host, its sum is a constant to the tracer.
    """
    for counts, total in (("num_atoms", "total_num_atoms"), ("num_bonds", "total_num_bonds")):
        n = input.get(total)
        if isinstance(n, int) and counts in input and "bond_index_bias" in input and "three_body_edge_map" in input:
            input[counts] = torch.tensor([n])


class MatterSimForward(torch.nn.Module):
    """``Potential.forward`` with the strain leaf given: what ``torch.compile`` compiles.

    mattersim's ``Potential.forward`` makes its strain (a leaf that requires
    grad) inside ``forward``; this is the same computation, in the same order
    of operations, with the strain made by the caller outside the compiled
    region. It holds a private copy of the potential's M3GNet.
    """

    def __init__(self, potential: torch.nn.Module) -> None:
        super().__init__()
        self.model = copy.deepcopy(m3gnet_of(potential)).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    def forward(
        self, input: dict[str, Any], strain: Tensor, include_forces: bool = True, include_stresses: bool = True,
        dataset_idx: int = -1,
    ) -> dict[str, Tensor]:
        input = dict(input)  # mattersim writes into its input
        _host_counts(input)
        output: dict[str, Tensor] = {}
        cell = input["cell"]
        volume = torch.linalg.det(cell)
        if include_stresses:
            eye = torch.eye(3, dtype=cell.dtype, device=cell.device)[None, ...]
            input["cell"] = torch.matmul(cell, eye + strain)
            input["atom_pos"] = torch.einsum("bi, bij -> bj", input["atom_pos"], eye + strain[input["batch"]])
            volume = torch.linalg.det(input["cell"])
        energies = self.model.forward(input, dataset_idx)
        output[ENERGY] = energies
        if include_forces:
            inputs = [input["atom_pos"], strain] if include_stresses else [input["atom_pos"]]
            # a retained graph (create_graph=True), which the traced autograd.grad needs
            grad = torch.autograd.grad([energies], inputs, [torch.ones_like(energies)], create_graph=True)
            output[FORCES] = torch.neg(grad[0])
            if include_stresses:
                output[STRESSES] = 1 / volume[:, None, None] * grad[1] / GPa
        return output


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """A compile-ready :class:`MatterSimForward` over a private copy of the
    potential's M3GNet (``model`` is left unmodified)."""
    if isinstance(model, MatterSimForward):
        return model
    return MatterSimForward(model)


# outputs that mattersim's evaluation-mode potential returns without an
# autograd graph (``create_graph=False``)
DERIVATIVES = (FORCES, STRESSES)


def _step(
    model: Any, data: dict[str, Any], include_forces: bool = True, include_stresses: bool = True,
    dataset_idx: int = -1,
) -> dict[str, Tensor]:
    """One call as mattersim's calculator makes it (``potential.forward(input,
    include_forces=True, include_stresses=...)``). The strain leaf and the
    positions' grad flag are set here, outside the compiled region; forces
    and stresses come back detached, as the evaluation-mode potential gives them."""
    cell = data["cell"]
    strain = torch.zeros_like(cell)
    if include_forces:
        data["atom_pos"].requires_grad_(True)
    if include_stresses:
        strain.requires_grad_(True)
    out = model(data, strain, include_forces, include_stresses, dataset_idx)
    return detach(out, DERIVATIVES)


def evaluate(
    model: torch.nn.Module, data: dict[str, Any], include_forces: bool = True, include_stresses: bool = True,
    dataset_idx: int = -1,
) -> dict[str, Tensor]:
    """The unpadded eager reference: mattersim's own ``Potential.forward`` (on
    a private copy of the input dict, which it writes into)."""
    if isinstance(model, MatterSimForward):  # the compile copy, run eagerly
        return _step(model, dict(data), include_forces, include_stresses, dataset_idx)
    return model.forward(dict(data), include_forces=include_forces, include_stresses=include_stresses,
                         dataset_idx=dataset_idx)


def properties(output: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Flat ``energy`` / ``forces`` / ``stress``: stress ``[S, 3, 3]`` in
    eV/A^3 with ASE's sign (mattersim's calculator reports ``GPa * stresses``)."""
    flat: dict[str, Tensor] = dict(output)
    flat["energy"] = output[ENERGY]
    if STRESSES in output:
        flat["stress"] = output[STRESSES] * GPa
    return flat


def build_input(model: torch.nn.Module, atoms: Any, *, device: str | torch.device | None = None) -> dict[str, Any]:
    """mattersim's input dict for one ``ase.Atoms`` or a list of them.

    Built as ``MatterSimCalculator`` builds it: mattersim's
    ``build_dataloader`` (its ``GraphConvertor``: pymatgen neighbour search
    within the model's cutoff, three-body indices within its three-body
    cutoff; non-periodic structures get mattersim's large cubic box) and
    ``batch_to_dict``, all structures in one batch, on ``device`` (default:
    the model's). ``atom_attr`` holds the atomic numbers as int64 (mattersim
    stores them as float32 and reads ``atom_attr.long()``: the same values).

    Raises
    ------
    ValueError
        No structure, a structure without atoms, or an atomic number outside
        the model's ``1 .. max_z``.
    """
    from mattersim.datasets.utils.build import build_dataloader
    from mattersim.forcefield.potential import batch_to_dict

    structures = list(atoms) if isinstance(atoms, (list, tuple)) else [atoms]
    if not structures:
        raise ValueError("build_input needs at least one structure")
    m3gnet = m3gnet_of(model)
    max_z = int(m3gnet.max_z)
    for i, a in enumerate(structures):
        if len(a) == 0:
            raise ValueError(f"structure {i} has no atoms; mattersim cannot build a graph of an empty structure")
        bad = sorted({int(z) for z in a.numbers if not 1 <= int(z) <= max_z})
        if bad:
            raise ValueError(f"structure {i}: atomic numbers {bad} are outside the model's elements 1..{max_z}")
    args = m3gnet.model_args
    if device is None:
        device = next(m3gnet.parameters()).device
    loader = build_dataloader(
        structures, model_type="m3gnet", cutoff=args["cutoff"], threebody_cutoff=args["threebody_cutoff"],
        batch_size=len(structures), only_inference=True,
    )
    (batch,) = list(loader)
    data = batch_to_dict(batch, device=device)
    data["atom_attr"] = data["atom_attr"].long()
    return data


def tensor_input(model: torch.nn.Module) -> Any:
    """``Structures -> mattersim's input dict`` on the structures' device, as
    :func:`build_input` makes it through mattersim's ``GraphConvertor``: a
    structure periodic along no direction is put in mattersim's cubic box
    (its extent plus five cutoffs, then periodic), positions are wrapped into
    the cell (fractional coordinates mod 1, along every direction, as
    mattersim does), the pairs within the cutoff come from vesin-torch,
    grouped by centre (within a centre in vesin's order, not pymatgen's: the
    same pairs, the sums in another order) and the three-body indices (every
    ordered pair of a centre's bonds within the three-body cutoff) are made on
    the device. Per composition the species and counts; per step the
    neighbour list and the triplets (their number is read from the device:
    it sizes them)."""
    m3gnet = m3gnet_of(model)
    args = m3gnet.model_args
    cutoff, three_body = float(args["cutoff"]), float(args["threebody_cutoff"])
    known = frozenset(range(1, int(m3gnet.max_z) + 1))
    pairs = NeighborList(cutoff)  # (vesin-torch: an ImportError here, not at the first step)
    state: dict[str, Any] = {}

    def build(structures: Structures) -> dict[str, Any]:
        composition = Composition.of(structures, state.get("composition"), known)
        device, system = structures.positions.device, composition.system
        if composition is not state.get("composition"):
            boxed = [not any(p) for p in composition.pbc]
            state.update(composition=composition, graph=None, boxed=torch.tensor(boxed, device=device),
                         any_boxed=any(boxed), atom_attr=structures.numbers.long().unsqueeze(-1),
                         num_atoms=composition.ptr.diff(),
                         pbc=torch.tensor([[True] * 3 if b else p for b, p in zip(boxed, composition.pbc)],
                                          device=device))
        positions, cells = structures.positions.detach().double(), structures.cells.detach().double()
        if state["any_boxed"]:  # mattersim's box around a structure periodic nowhere
            index = system[:, None].expand(-1, 3)
            low = torch.full_like(cells[:, 0], torch.inf).scatter_reduce(0, index, positions, "amin")
            high = torch.full_like(cells[:, 0], -torch.inf).scatter_reduce(0, index, positions, "amax")
            side = ((high - low) + 5 * max(cutoff, three_body)).amax(dim=1)
            box = torch.eye(3, dtype=cells.dtype, device=device) * side[:, None, None]
            cells = torch.where(state["boxed"][:, None, None], box, cells)
        fractional = torch.linalg.solve(cells.transpose(1, 2)[system], positions.unsqueeze(-1)).squeeze(-1)
        positions = torch.einsum("ni,nij->nj", fractional % 1.0, cells[system])
        wrapped = Structures(positions, structures.numbers, cells, state["pbc"], structures.system)
        graph = state["graph"] = Composition.of(wrapped, state["graph"])  # (the boxed systems periodic)
        edge_index, unit_shifts, shifts = pairs(wrapped, graph)
        order = torch.sort(edge_index[0], stable=True).indices  # grouped by centre, as the triplets need
        edge_index, unit_shifts = edge_index[:, order], unit_shifts[order]
        vectors = positions[edge_index[1]] - positions[edge_index[0]] + shifts[order]
        data = _three_body(edge_index, vectors.norm(dim=1) <= three_body, system, composition.n_systems)
        n_atoms, n_bonds = positions.shape[0], edge_index.shape[1]
        data.update(
            atom_pos=positions.float(), cell=cells.float(), pbc_offsets=unit_shifts.float(),
            atom_attr=state["atom_attr"], edge_index=edge_index, num_atoms=state["num_atoms"],
            num_graphs=torch.tensor(composition.n_systems, device=device), batch=system,
            total_num_atoms=n_atoms, total_num_bonds=n_bonds,
        )
        return data

    return build


def _three_body(edge_index: Tensor, within: Tensor, system: Tensor, n_systems: int) -> dict[str, Tensor]:
    """mattersim's three-body fields (``compute_threebody_indices``) from
    pairs sorted by centre: for each centre, every ordered pair of its bonds
    ``within`` the three-body cutoff, bond-major; indices are each system's
    own bond numbers (``bond_index_bias``: its first bond)."""
    device = edge_index.device
    n_bonds = edge_index.shape[1]
    bond_system = system[edge_index[0]]
    num_bonds = torch.bincount(bond_system, minlength=n_systems)
    first_bond = num_bonds.cumsum(0) - num_bonds
    valid = within.nonzero().squeeze(1)  # the bonds that form angles, in bond order (grouped by centre)
    centre = edge_index[0, valid]
    per_centre = torch.bincount(centre, minlength=system.shape[0])
    group_start = (per_centre.cumsum(0) - per_centre)[centre]  # the centre's first valid bond, in ``valid``
    partners = per_centre[centre] - 1  # the other bonds of its centre
    first = torch.repeat_interleave(torch.arange(valid.shape[0], device=device), partners)  # (a read: the count)
    start = group_start[first]
    offset = torch.arange(first.shape[0], device=device) - (partners.cumsum(0) - partners)[first]
    second = start + offset + (offset >= first - start).long()  # every other bond of the centre, in order
    ij, ik = valid[first], valid[second]
    bias = first_bond[bond_system[ij]]
    num_triple_ij = torch.zeros(n_bonds, dtype=torch.long, device=device)
    num_triple_ij[valid] = partners
    return {
        "three_body_indices": torch.stack((ij - bias, ik - bias), dim=1),
        "num_three_body": torch.zeros(n_systems, dtype=torch.long, device=device).index_add_(
            0, bond_system[valid], partners),
        "num_bonds": num_bonds, "num_triple_ij": num_triple_ij.unsqueeze(-1),
        "bond_index_bias": bias.unsqueeze(-1), "three_body_edge_map": ij,
    }


def foundation_models() -> dict[str, Any]:
    """MatterSim v1.0.0 1M and 5M (float32): :func:`random_model` at the
    published checkpoints' ``model_args`` (mattersim 1.2.3 ships none:
    ``Potential.from_checkpoint`` downloads them), the rest ``M3Gnet``'s
    defaults; they give the published sizes, 890,034 trainable parameters
    (1M, as mattersim's ``train_model`` logs it) and 4,549,142 with the basis
    and normaliser buffers (5M)."""
    args = {"mattersim-v1.0.0-1M": (3, 128), "mattersim-v1.0.0-5M": (4, 256)}  # (num_blocks, units)
    return {name: functools.partial(random_model, num_blocks=b, units=u) for name, (b, u) in args.items()}


default_system = diamond_carbon


ADAPTER = builtin_adapter(
    "mattersim",
    requires=("mattersim",),  # import names, the model package's first
    make_padder=make_padder,
    energy_key=ENERGY,
    cutoff=_cutoff,
    prepare_model=prepare_model,
    call=_step,
    evaluate=evaluate,
    dynamo_config={"trace_autograd_ops": True, "capture_scalar_outputs": True},
    call_forms=(
        {"include_forces": True, "include_stresses": True},  # MatterSimCalculator (compute_stress=True)
        {"include_forces": True, "include_stresses": False},  # MatterSimCalculator(compute_stress=False)
        {"include_forces": False, "include_stresses": False},  # Potential.predict_properties' default
    ),
    grad_input="atom_pos",
    engine=EngineHooks(
        build_input=build_input,
        tensor_input=tensor_input,
        stress_option="include_stresses",
        properties=properties,
        positions_key="atom_pos",
        # M3GNet's interaction blocks, each a cutoff deep (its three-body angles lie within a smaller one)
        message_layers=lambda model: len(next(m.graph_conv for m in model.modules() if hasattr(m, "graph_conv"))),
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
