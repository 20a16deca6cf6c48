"""The graph a ``pair_style ddpad`` package is sized and checked on: one
LAMMPS rank's owned atoms and ghost images (no LAMMPS needed here; the
packages themselves run in tests/test_lammps_plugin.py)."""

from __future__ import annotations

import numpy as np
import pytest
from ase.build import bulk
from ase.neighborlist import neighbor_list

from ddpad.engines.lammps_package import RESERVED, GhostGraph, ghost_graph, ladder_caps


@pytest.mark.parametrize("cell", ["cubic", "triclinic"])
def test_owned_atoms_see_every_neighbour_a_periodic_system_gives_them(cell: str) -> None:
    atoms = bulk("C", "diamond", a=3.57, cubic=cell == "cubic").repeat((2, 2, 2))
    atoms.rattle(0.05, seed=3)
    cutoff = 2.6
    graph = ghost_graph(atoms, (1, 6, 8), cutoff, 2 * cutoff + 1.0)
    i, d = neighbor_list("id", atoms, cutoff)
    receivers = graph.edges[1]
    senders = graph.edges[0]
    owned = receivers < graph.owned
    # every owned atom has as many neighbours as in the periodic system, at the same distances
    assert np.array_equal(np.bincount(receivers[owned], minlength=len(atoms)), np.bincount(i, minlength=len(atoms)))
    lengths = np.linalg.norm(graph.positions[senders[owned]] - graph.positions[receivers[owned]], axis=1)
    assert np.allclose(np.sort(lengths), np.sort(d))
    # ghosts are images of owned atoms, two layers of messages deep: their own neighbours are there too
    assert graph.n_atoms > len(atoms) and (graph.species == 1).all()
    assert graph.owned == len(atoms)


def test_an_element_the_model_does_not_know_is_named() -> None:
    with pytest.raises(ValueError, match=r"atomic numbers \[14\]"):
        ghost_graph(bulk("Si", "diamond", a=5.43), (1, 6, 8), 2.6, 6.2)


def test_the_ladder_steps_down_from_the_example_with_head_room_and_reserved_rows() -> None:
    graph = ghost_graph(bulk("C", "diamond", a=3.57, cubic=True).repeat((2, 2, 2)), (6,), 2.6, 6.2)
    caps = ladder_caps(graph, 3)
    assert len(caps) == 3 and caps == sorted(caps, reverse=True)
    atoms, edges = caps[0]
    assert atoms >= graph.n_atoms * 1.25 + RESERVED and edges >= graph.n_edges * 1.25
    assert caps[1][0] < atoms and caps[2][0] < caps[1][0]
    cut = graph.cut(caps[2][0] - RESERVED, caps[2][1])
    assert cut.n_atoms <= caps[2][0] - RESERVED and cut.n_edges <= caps[2][1]
    assert (cut.edges < cut.n_atoms).all() and cut.owned <= cut.n_atoms
    with pytest.raises(ValueError, match="at least one rung"):
        ladder_caps(graph, 0)


def test_precompile_lammps_says_in_one_line_what_cannot_be_packaged(capsys: pytest.CaptureFixture[str]) -> None:
    from ddpad import cli

    # the toy adapter has no lammps_input hook: the fix external route is named instead
    assert cli.main(["precompile", "toy", "--lammps"]) == 2
    assert "cannot be packaged for pair_style ddpad" in capsys.readouterr().err
    assert cli.main(["precompile", "toy", "--lammps", "--rung", "2048"]) == 2
    assert "--rung takes ATOMS:EDGES" in capsys.readouterr().err


@pytest.mark.parametrize("layers", [1, 2])
def test_pruning_keeps_every_edge_the_owned_energy_depends_on(layers: int) -> None:
    atoms = bulk("C", "diamond", a=3.57, cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.05, seed=4)
    full = ghost_graph(atoms, (6,), 2.6, layers * 2.6 + 1.0)
    part = full.pruned(layers)
    assert part.owned == full.owned and np.array_equal(part.positions[: part.owned], full.positions[: full.owned])
    assert part.n_atoms < full.n_atoms and part.n_edges < full.n_edges

    def key(position: np.ndarray) -> tuple[float, ...]:
        return tuple(position.round(9))

    def edges_into(graph: GhostGraph, receivers: np.ndarray) -> set[tuple[tuple[float, ...], tuple[float, ...]]]:
        """The edges whose receiver is one of ``receivers``, by their atoms' positions."""
        s, r = graph.edges
        mask = np.isin(r, receivers)
        return {(key(graph.positions[a]), key(graph.positions[b])) for a, b in zip(s[mask], r[mask])}

    # every edge into an owned atom is kept (a strictly local model's only ones), both ways
    assert edges_into(part, np.arange(part.owned)) == edges_into(full, np.arange(full.owned))
    assert len(edges_into(part, np.arange(part.owned))) == int((part.edges[0] < part.owned).sum())
    if layers == 1:
        assert (np.minimum(*part.edges) < part.owned).all()
    else:  # and every edge into an atom one hop from an owned atom
        near = np.unique(full.edges[0][full.edges[1] < full.owned])
        near_keys = {key(full.positions[i]) for i in near}
        near_part = np.flatnonzero([key(p) in near_keys for p in part.positions])
        assert len(near_part) == len(near_keys)
        assert edges_into(part, near_part) == edges_into(full, near)
