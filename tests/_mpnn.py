"""A small MPNN-like potential and a trajectory whose shapes change every step.

The model has what makes padding hard in real MLIPs: message passing over
edges with a smooth cutoff, per-atom energies with a per-atom constant shift
(so a dead atom joined to a real system would leak), forces and stress by
autograd through a symmetric strain, and per-system sums.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

CUTOFF = 3.0


class MPNN(torch.nn.Module):
    def __init__(self, n_species: int = 3, width: int = 16, cutoff: float = CUTOFF, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.cutoff = cutoff
        self.embed = torch.nn.Linear(n_species, width, bias=False)
        self.radial = torch.nn.Linear(8, width)
        self.update = torch.nn.Linear(width, width)
        self.readout = torch.nn.Linear(width, 1)
        self.shift = torch.nn.Parameter(torch.tensor(0.37))  # per-atom energy shift
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)  # random biases too
        self.double()

    def forward(self, data: dict[str, Tensor], compute_stress: bool = True) -> dict[str, Tensor]:
        data["positions"].requires_grad_(True)  # as MACE does: forces by autograd
        pos, cell, batch = data["positions"], data["cell"], data["batch"]
        sender, receiver = data["edge_index"]
        n_sys = data["ptr"].shape[0] - 1
        strain = torch.zeros(n_sys, 3, 3, dtype=pos.dtype, device=pos.device, requires_grad=True)
        sym = 0.5 * (strain + strain.transpose(1, 2))
        pos = pos + torch.einsum("ni,nij->nj", pos, sym[batch])
        cell = cell + torch.bmm(cell, sym)
        shifts = torch.einsum("ei,eij->ej", data["unit_shifts"], cell[batch[sender]])
        vec = pos[receiver] - pos[sender] + shifts
        r = vec.norm(dim=-1)
        env = torch.where(r < self.cutoff, 0.5 * (torch.cos(torch.pi * r / self.cutoff) + 1.0), 0.0)
        freqs = torch.arange(1, 9, dtype=pos.dtype, device=pos.device)
        basis = torch.sin(freqs * torch.pi * r[:, None] / self.cutoff) / r[:, None] * env[:, None]
        h = self.embed(data["node_attrs"])
        for _ in range(2):
            msg = self.radial(basis) * h[sender]
            agg = torch.zeros_like(h).index_add(0, receiver, msg)
            h = h + torch.tanh(self.update(agg))
        node_energy = self.readout(h).squeeze(-1) + self.shift
        energy = torch.zeros(n_sys, dtype=pos.dtype, device=pos.device).index_add(0, batch, node_energy)
        grads = torch.autograd.grad(energy.sum(), [data["positions"], strain], create_graph=self.training)
        out = {"energy": energy, "node_energy": node_energy, "forces": -grads[0]}
        if compute_stress:
            volume = torch.linalg.det(data["cell"]).abs()
            out["stress"] = -grads[1] / volume[:, None, None]
        return out


def neighbour_list(pos: Tensor, cell: Tensor, cutoff: float) -> tuple[Tensor, Tensor]:
    """All pairs (and periodic images) within ``cutoff``: brute force, exact."""
    images = torch.tensor(list(itertools.product((-1, 0, 1), repeat=3)), dtype=pos.dtype)
    offsets = images @ cell
    vec = pos[None, :, None, :] - pos[:, None, None, :] + offsets[None, None]  # [i, j, image, 3]
    d = vec.norm(dim=-1)
    i, j, k = torch.nonzero((d < cutoff) & (d > 1e-8), as_tuple=True)
    return torch.stack([i, j]), images[k]


def system(n: int, box: float, species: int, gen: torch.Generator) -> dict[str, Tensor]:
    pos = torch.rand(n, 3, generator=gen, dtype=torch.float64) * box
    cell = torch.eye(3, dtype=torch.float64) * box
    edge_index, unit = neighbour_list(pos, cell, CUTOFF)
    z = torch.randint(0, species, (n,), generator=gen)
    return {"positions": pos, "cell": cell, "edge_index": edge_index, "unit_shifts": unit,
            "node_attrs": torch.nn.functional.one_hot(z, species).double()}


def batch_of(systems: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Concatenate systems the way graph libraries batch them."""
    offsets = itertools.accumulate([0] + [s["positions"].shape[0] for s in systems])
    offsets = list(offsets)
    counts = torch.tensor([s["positions"].shape[0] for s in systems])
    return {
        "positions": torch.cat([s["positions"] for s in systems]),
        "node_attrs": torch.cat([s["node_attrs"] for s in systems]),
        "edge_index": torch.cat([s["edge_index"] + o for s, o in zip(systems, offsets)], dim=1),
        "unit_shifts": torch.cat([s["unit_shifts"] for s in systems]),
        "cell": torch.stack([s["cell"] for s in systems]),
        "batch": torch.repeat_interleave(torch.arange(len(systems)), counts),
        "ptr": torch.tensor(offsets),
    }


def trajectory(steps: int, n_systems: int | tuple[int, int] = 1, seed: int = 0, n0: int = 40) -> list[dict[str, Tensor]]:
    """``steps`` batches: atoms vary by up to +-10 %, edges by up to +-25 %
    (the box breathes), and the system count within ``n_systems``."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (n_systems, n_systems) if isinstance(n_systems, int) else n_systems
    out = []
    for _ in range(steps):
        s = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        systems = []
        for _ in range(s):
            n = n0 + int(torch.randint(-n0 // 10, n0 // 10 + 1, (1,), generator=gen))
            density = 1.0 + 0.25 * (2 * float(torch.rand(1, generator=gen)) - 1)
            box = (n / (0.12 * density)) ** (1 / 3)
            systems.append(system(n, box, 3, gen))
        out.append(batch_of(systems))
    return out
