"""A third-party adapter: a pairwise Morse potential on a COO graph.

This is what a plugin looks like: the model package ships an ``Adapter`` and
declares it under the ``ddpad.adapters`` entry-point group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ddpad.padding import COOPadder
from ddpad.adapters import Adapter, EngineHooks, ToolHooks


class Morse(torch.nn.Module):
    """Morse pair energy with a smooth cosine cutoff; forces by autograd."""

    def __init__(self, cutoff: float = 3.0) -> None:
        super().__init__()
        self.cutoff = cutoff
        self.depth = torch.nn.Parameter(torch.tensor(0.7, dtype=torch.float64))
        self.shift = torch.nn.Parameter(torch.tensor(-0.3, dtype=torch.float64))

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pos = data["pos"]
        if not pos.requires_grad:
            pos.requires_grad_(True)
        src, dst = data["edge_index"]
        r = (pos[dst] - pos[src]).norm(dim=-1)
        env = torch.where(r < self.cutoff, 0.5 * (torch.cos(torch.pi * r / self.cutoff) + 1), 0.0)
        pair = self.depth * ((1 - torch.exp(-(r - 1.2))) ** 2 - 1) * env
        atom_e = torch.zeros_like(pos[:, 0]).index_add(0, dst, 0.5 * pair) + self.shift
        n_sys = data["ptr"].shape[0] - 1
        energy = torch.zeros(n_sys, dtype=pos.dtype).index_add(0, data["batch"], atom_e)
        (grad,) = torch.autograd.grad(energy.sum(), pos, create_graph=self.training)
        return {"energy": energy, "forces": -grad, "atom_energy": atom_e}


def _padder(model: torch.nn.Module) -> COOPadder:
    return COOPadder(
        model.cutoff, positions="pos", atom_outputs=("forces", "atom_energy"),
        system_outputs=("energy",),
    )


def _build_input(model: torch.nn.Module, atoms: Any, **_: Any) -> dict[str, torch.Tensor]:
    """Non-periodic graph of one ``ase.Atoms``-like object or a batch (list)
    of them (all pairs within the cutoff)."""
    structures = list(atoms) if isinstance(atoms, (list, tuple)) else [atoms]
    if not structures or any(len(a) == 0 for a in structures):
        raise ValueError("the toy model needs at least one structure, each with at least one atom")
    positions, edges, offset = [], [], 0
    for a in structures:
        pos = torch.as_tensor(a.get_positions(), dtype=model.depth.dtype)
        dist = torch.cdist(pos, pos)
        src, dst = torch.nonzero((dist < model.cutoff) & (dist > 0), as_tuple=True)
        positions.append(pos)
        edges.append(torch.stack([src, dst]) + offset)
        offset += pos.shape[0]
    sizes = torch.tensor([p.shape[0] for p in positions])
    return {
        "pos": torch.cat(positions),
        "edge_index": torch.cat(edges, dim=1),
        "batch": torch.repeat_interleave(torch.arange(len(positions)), sizes),
        "ptr": torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]),
    }


def _random_model(dtype: torch.dtype | None = None, device: str = "cpu") -> torch.nn.Module:
    return Morse().to(dtype=dtype or torch.float64, device=device).eval()


def _load_model(path: str, device: str = "cpu") -> torch.nn.Module:
    return torch.load(path, map_location=device, weights_only=False)


def _default_system() -> Any:
    """A small, non-periodic 3x3x3 cubic cluster, 1.3 apart."""
    from ase import Atoms

    grid = torch.stack(torch.meshgrid(*[torch.arange(3.0)] * 3, indexing="ij"), -1).reshape(-1, 3)
    return Atoms("Ar27", positions=(grid * 1.3).numpy())


ADAPTER = Adapter(
    name="toy",
    make_padder=_padder,
    energy_key="energy",
    atom_outputs=("forces", "atom_energy"),
    system_outputs=("energy",),
    cutoff=lambda model: float(model.cutoff),
    install_hint="pip install ./tests/plugin_pkg",
    engine=EngineHooks(build_input=_build_input),
    tools=ToolHooks(random_model=_random_model, load_model=_load_model, default_system=_default_system),
)

# A plugin whose model package is not installed: listed, with its install hint.
NEEDS_MISSING_PACKAGE = dataclasses.replace(
    ADAPTER, name="toymissing", requires=("no_such_model_package",), install_hint="pip install toy-missing-extra"
)
