"""Built-in padders: property-based checks over random graphs (SPEC sections 5-6)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpad.padding import COOPadder, DenseBatchPadder, DensePadder, Fill, GraphPadder

CUTOFF = 2.5
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def coo_graphs(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """A random batched COO graph: S systems, some sentinel edges."""
    sizes = draw(st.lists(st.integers(1, 12), min_size=1, max_size=4))
    n = sum(sizes)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    e = draw(st.integers(0, 80))
    n_sentinel = draw(st.integers(0, 4))
    edge_index = torch.randint(0, n, (2, e), generator=gen)
    if n_sentinel and e:  # the reference marks invalid edges by an endpoint >= n_real
        rows = torch.randint(0, 2, (n_sentinel,), generator=gen)
        cols = torch.randint(0, e, (n_sentinel,), generator=gen)
        edge_index[rows, cols] = n + torch.randint(0, 3, (n_sentinel,), generator=gen)
    counts = torch.tensor(sizes)
    unit = torch.randint(-1, 2, (e, 3), generator=gen).double()
    cell = torch.randn(len(sizes) * 3, 3, generator=gen, dtype=torch.float64) * 4
    batch = torch.repeat_interleave(torch.arange(len(sizes)), counts)
    return {
        "positions": torch.randn(n, 3, generator=gen, dtype=torch.float64) * 5,
        "node_attrs": torch.nn.functional.one_hot(torch.randint(0, 3, (n,), generator=gen), 3).double(),
        "batch": batch,
        "ptr": torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]),
        "edge_index": edge_index,
        "unit_shifts": unit,
        "shifts": torch.einsum("ec,ecd->ed", unit, cell.view(-1, 3, 3)[batch[edge_index[0].clamp(max=n - 1)]]),
        "cell": cell,
        "head": torch.zeros(len(sizes), dtype=torch.long),
    }


def mace_like(placement: str = "own", **kw: object) -> COOPadder:
    return COOPadder(
        CUTOFF,
        atom_fields={"node_attrs": 0.0},
        edge_fields={"shifts": Fill.DEAD_SHIFT, "unit_shifts": Fill.DEAD_UNIT_SHIFT},
        system_fields={"cell": Fill.DEAD_CELL, "head": 0},
        placement=placement,  # type: ignore[arg-type]
        atom_outputs=("forces", "node_energy"),
        system_outputs=("energy", "stress"),
        **kw,  # type: ignore[arg-type]
    )


def edge_vectors(out: dict[str, torch.Tensor], self_loop: bool = True) -> torch.Tensor:
    s, r = out["edge_index"]
    vec = out["positions"][r] - out["positions"][s]
    return vec + out["shifts"] if self_loop else vec


def check_coo(data: dict[str, torch.Tensor], out: dict[str, torch.Tensor], padder: COOPadder, placement: str) -> None:
    n, e, s = data["positions"].shape[0], data["edge_index"].shape[1], data["ptr"].shape[0] - 1
    n_cap, e_cap = out["positions"].shape[0], out["edge_index"].shape[1]
    s_cap = out["ptr"].shape[0] - 1
    assert n_cap > n and e_cap >= e and s_cap >= s + (placement == "own")
    # real rows unchanged
    for key in ("positions", "node_attrs", "batch"):
        assert torch.equal(out[key][:n], data[key])
    assert torch.equal(out["cell"][: 3 * s], data["cell"]) and torch.equal(out["head"][:s], data["head"])
    invalid = (data["edge_index"] >= n).any(0)
    assert torch.equal(out["edge_index"][:, :e][:, ~invalid], data["edge_index"][:, ~invalid])
    assert torch.equal(out["shifts"][:e][~invalid], data["shifts"][~invalid])
    # every dead or invalid edge: a dead atom, non-zero length beyond the cutoff
    dead_edges = torch.ones(e_cap, dtype=torch.bool)
    dead_edges[:e] = invalid
    ends = out["edge_index"][:, dead_edges]
    assert bool((ends >= n).all())
    lengths = edge_vectors(out).norm(dim=-1)[dead_edges]
    assert bool((lengths > CUTOFF).all())
    # the lattice shift reproduces the dead edge through the dead system's cell
    cells = out["cell"].view(-1, 3, 3)[out["batch"][out["edge_index"][0]]]
    recomputed = torch.einsum("ec,ecd->ed", out["unit_shifts"], cells)
    assert torch.allclose(recomputed[dead_edges], out["shifts"][dead_edges])
    # dead atoms out of every real atom's cutoff, in the dead atoms' system
    if n:
        dist = torch.cdist(out["positions"][n:], data["positions"])
        assert bool((dist > CUTOFF).all())
    dead_sys = s_cap - 1 if placement == "own" else s - 1
    assert bool((out["batch"][n:] == dead_sys).all())
    counts = torch.bincount(out["batch"], minlength=s_cap)
    assert torch.equal(out["ptr"][1:] - out["ptr"][:-1], counts)
    if placement == "own":
        eye = torch.eye(3, dtype=torch.float64) * padder.dead_length
        assert torch.equal(out["cell"][3 * s :].view(-1, 3, 3), eye.expand(s_cap - s, 3, 3))
    assert not any(bool(torch.isnan(v).any()) for v in out.values() if v.is_floating_point())


@SETTINGS
@given(graphs=st.lists(coo_graphs(), min_size=1, max_size=4), placement=st.sampled_from(["own", "join"]))
def test_coo_padder_properties(graphs: list[dict[str, torch.Tensor]], placement: str) -> None:
    padder = mace_like(placement)
    assert isinstance(padder, GraphPadder)
    state: dict[str, int] = {}
    previous: dict[str, int] = {}
    for data in graphs:
        snapshot = {k: v.clone() for k, v in data.items()}
        out = padder.pad(data, state)
        assert all(torch.equal(data[k], snapshot[k]) for k in data)  # input untouched
        check_coo(data, out, padder, placement)
        assert all(state[k] >= previous.get(k, 0) for k in state)  # grow only
        previous = dict(state)
        n, s = data["positions"].shape[0], data["ptr"].shape[0] - 1
        model_out = {
            "forces": out["positions"] * 2, "node_energy": out["positions"][:, 0],
            "energy": torch.arange(out["ptr"].shape[0] - 1.0), "stress": torch.ones(out["ptr"].shape[0] - 1, 3, 3),
            "other": torch.ones(7),
        }
        back = padder.unpad(model_out)
        assert torch.equal(back["forces"], data["positions"] * 2)
        assert torch.equal(back["node_energy"], data["positions"][:, 0])
        assert back["energy"].shape == (s,) and back["stress"].shape == (s, 3, 3)
        assert back["other"] is model_out["other"]
        assert padder.unpad(out["positions"], n_real=3).shape == (min(3, out["positions"].shape[0]), 3)
        assert n == padder.n_atoms


@SETTINGS
@given(data=coo_graphs(), layout=st.sampled_from(["2E", "E2"]))
def test_coo_anchor_pair_without_shifts(data: dict[str, torch.Tensor], layout: str) -> None:
    """No shift field: dead edges join an anchor pair dead_length apart."""
    ei = data["edge_index"] if layout == "2E" else data["edge_index"].t().contiguous()
    inp = {"positions": data["positions"], "edge_index": ei, "batch": data["batch"], "ptr": data["ptr"]}
    padder = COOPadder(CUTOFF, edge_layout=layout)  # type: ignore[arg-type]
    out = padder.pad(inp, {})
    n, e = data["positions"].shape[0], data["edge_index"].shape[1]
    n_cap = out["positions"].shape[0]
    assert n_cap - n >= 2
    ei_out = out["edge_index"] if layout == "2E" else out["edge_index"].t()
    dead = torch.ones(ei_out.shape[1], dtype=torch.bool)
    dead[:e] = (data["edge_index"] >= n).any(0)
    assert bool((ei_out[0, dead] == n_cap - 2).all()) and bool((ei_out[1, dead] == n_cap - 1).all())
    vec = out["positions"][ei_out[1]] - out["positions"][ei_out[0]]
    assert bool((vec[dead].norm(dim=-1) > CUTOFF).all())


def test_coo_dead_edges_at_the_cutoff() -> None:
    """``dead_edge_length``: dead edges exactly as long as the cutoff (where a
    polynomial envelope that grows beyond it, sevenn's, is zero), self-loop
    shifts and the anchor pair alike; the dead atoms still sit
    ``dead_length`` out; shorter than the cutoff is refused."""
    pos = torch.rand(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    base = {"positions": pos, "edge_index": torch.tensor([[0, 1], [1, 0]]), "batch": torch.zeros(5, dtype=torch.long),
            "ptr": torch.tensor([0, 5])}
    loop = COOPadder(CUTOFF, edge_fields={"shifts": Fill.DEAD_SHIFT}, dead_edge_length=CUTOFF)
    out = loop.pad(dict(base, shifts=torch.zeros(2, 3, dtype=torch.float64)), {})
    assert torch.equal(out["shifts"][2:], torch.tensor([[CUTOFF, 0.0, 0.0]], dtype=torch.float64).expand(
        out["shifts"].shape[0] - 2, 3))
    assert float(out["positions"][5:].min()) >= float(pos.max()) + loop.dead_length - 1e-12
    pair = COOPadder(CUTOFF, dead_edge_length=CUTOFF)
    out = pair.pad(dict(base), {})
    dead = out["positions"][-2:]
    # (to rounding: the pair sits at p and p + cutoff, whose difference is the cutoff to an ulp of p)
    assert abs(float((dead[1] - dead[0]).norm()) - CUTOFF) <= 1e-12 and loop.dead_length == 2 * CUTOFF + 1
    with pytest.raises(ValueError, match="dead_edge_length 2.4 is inside the cutoff 2.5"):
        COOPadder(CUTOFF, dead_edge_length=CUTOFF - 0.1)


def test_coo_none_is_noop_and_overflow_names_key() -> None:
    padder = mace_like()
    assert padder.pad(None, {}) is None
    data = {
        "positions": torch.zeros(20, 3, dtype=torch.float64), "node_attrs": torch.zeros(20, 3),
        "batch": torch.zeros(20, dtype=torch.long), "ptr": torch.tensor([0, 20]),
        "edge_index": torch.zeros(2, 40, dtype=torch.long), "shifts": torch.ones(40, 3),
        "unit_shifts": torch.zeros(40, 3), "cell": torch.eye(3), "head": torch.zeros(1, dtype=torch.long),
    }
    with pytest.raises(RuntimeError, match=r"'edges'.*real 40.*cap 32"):
        padder.pad_to(data, {"atoms": 32, "edges": 32, "systems": 4})
    with pytest.raises(RuntimeError, match=r"'atoms'.*real 20.*cap 20"):
        padder.pad_to(data, {"atoms": 20, "edges": 64, "systems": 4})


def test_coo_cap_atoms_false_pads_only_edges() -> None:
    padder = mace_like()
    data = {
        "positions": torch.randn(10, 3, dtype=torch.float64), "batch": torch.zeros(10, dtype=torch.long),
        "ptr": torch.tensor([0, 10]), "edge_index": torch.randint(0, 10, (2, 30)),
        "shifts": torch.zeros(30, 3), "unit_shifts": torch.zeros(30, 3), "cell": torch.eye(3),
    }
    state: dict[str, int] = {}
    out = padder.pad(data, state, cap_atoms=False)
    assert out["positions"].shape[0] == 11 and "atoms" not in state and state["edges"] == 48


def test_coo_buffers_are_reused_until_a_cap_grows() -> None:
    padder = mace_like()
    state: dict[str, int] = {}

    def graph(n: int, e: int) -> dict[str, torch.Tensor]:
        return {
            "positions": torch.randn(n, 3, dtype=torch.float64), "batch": torch.zeros(n, dtype=torch.long),
            "ptr": torch.tensor([0, n]), "edge_index": torch.randint(0, n, (2, e)),
            "shifts": torch.zeros(e, 3), "unit_shifts": torch.zeros(e, 3), "cell": torch.eye(3),
        }

    first = padder.pad(graph(50, 200), state)
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    second = padder.pad(graph(48, 190), state)
    assert {k: v.data_ptr() for k, v in second.items()} == ptrs
    grown = padder.pad(graph(50, 400), state)
    assert grown["edge_index"].data_ptr() != ptrs["edge_index"]
    assert grown["positions"].data_ptr() == ptrs["positions"]


@st.composite
def dense_graphs(draw: st.DrawFn, sentinel_row: bool) -> dict[str, torch.Tensor]:
    sizes = draw(st.lists(st.integers(1, 10), min_size=1, max_size=3))
    n = sum(sizes)
    k = draw(st.integers(1, 12))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rows = n + 1 if sentinel_row else n
    # n is the sentinel, and anything above it; AIMNet2's matrices are int32
    # (the CPU reroutes those with arithmetic, others with where)
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    nbmat = torch.randint(0, n + 3, (rows, k), generator=gen).to(dtype)
    if sentinel_row:
        nbmat[n] = n
    mol = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return {
        "coord": torch.randn(rows, 3, generator=gen),
        "numbers": torch.randint(1, 9, (rows,), generator=gen),
        "mol_idx": torch.cat([mol, mol[-1:]]) if sentinel_row else mol,
        "charge": torch.randn(len(sizes), generator=gen),
        "nbmat": nbmat,
        "shifts": torch.randn(rows, k, 3, generator=gen),
    }


def dense_padder(cls: type[DensePadder], placement: str) -> DensePadder:
    return cls(
        nbmat=("nbmat",),
        atom_fields={"coord": 0.0, "numbers": 0, "mol_idx": Fill.LAST_SYSTEM},
        system_fields={"charge": 0.0},
        neighbor_fields={"shifts": ("nbmat", 0.0)},
        system_count="charge",
        placement=placement,  # type: ignore[arg-type]
        atom_outputs=("forces", "charges"),
        system_outputs=("energy",),
    )


@SETTINGS
@given(
    graphs=st.lists(st.booleans(), min_size=1, max_size=3).flatmap(
        lambda _: st.tuples(st.sampled_from([DensePadder, DenseBatchPadder]), st.sampled_from(["own", "join"]))
    ).flatmap(lambda cp: st.tuples(st.just(cp), st.lists(dense_graphs(cp[0] is DensePadder), min_size=1, max_size=3)))
)
def test_dense_padder_properties(graphs: tuple) -> None:
    (cls, placement), datas = graphs
    padder = dense_padder(cls, placement)
    state: dict[str, int] = {}
    previous: dict[str, int] = {}
    for data in datas:
        rows = data["nbmat"].shape[0]
        n = rows - 1 if cls is DensePadder else rows
        s = data["charge"].shape[0]
        out = padder.pad(data, state)
        n_cap, k_cap = out["nbmat"].shape
        pad_index = n_cap - 1 if cls is DensePadder else n_cap
        assert n_cap >= n + (cls is DensePadder) and k_cap >= data["nbmat"].shape[1]
        assert torch.equal(out["coord"][:n], data["coord"][:n])
        assert torch.equal(out["numbers"][:n], data["numbers"][:n]) and bool((out["numbers"][n:] == 0).all())
        sentinel = data["nbmat"][:n] >= n
        k = data["nbmat"].shape[1]
        assert torch.equal(out["nbmat"][:n, :k][~sentinel], data["nbmat"][:n][~sentinel])
        assert bool((out["nbmat"][:n, :k][sentinel] == pad_index).all())
        assert bool((out["nbmat"][:n, k:] == pad_index).all()) and bool((out["nbmat"][n:] == pad_index).all())
        assert bool((out["shifts"][:n, :k][sentinel] == 0).all())
        assert torch.equal(out["shifts"][:n, :k][~sentinel], data["shifts"][:n][~sentinel])
        dead_sys = out["charge"].shape[0] - 1 if placement == "own" else s - 1
        assert bool((out["mol_idx"][n:] == dead_sys).all())
        assert torch.equal(out["charge"][:s], data["charge"])
        assert bool((out["charge"][s:] == 0).all())
        assert all(state[key] >= previous.get(key, 0) for key in state)
        previous = dict(state)
        back = padder.unpad({"forces": torch.ones(n_cap, 3), "energy": torch.ones(out["charge"].shape[0])})
        assert back["forces"].shape == (n, 3) and back["energy"].shape == (s,)


def test_dense_second_matrix_gets_its_own_width_cap() -> None:
    padder = DenseBatchPadder(nbmat=("nbmat", "nbmat_lr"), atom_fields={"numbers": 0}, system_count="charge")
    data = {
        "numbers": torch.ones(5, dtype=torch.long), "charge": torch.zeros(1),
        "nbmat": torch.full((5, 3), 5), "nbmat_lr": torch.full((5, 9), 5),
    }
    state: dict[str, int] = {}
    out = padder.pad(data, state)
    assert state["neighbors"] == 8 and state["neighbors_nbmat_lr"] == 16
    assert out["nbmat_lr"].shape == (16, 16)
    assert bool((out["nbmat_lr"] == 16).all())


def test_coo_positions_that_require_grad_stay_connected() -> None:
    """An engine that differentiates the energy itself (LAMMPS: forces of
    owned energy on ghosts) passes positions that require grad."""
    padder = COOPadder(CUTOFF, ptr=None, system_index=None)
    positions = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    padded = padder.pad({"positions": positions, "edge_index": torch.randint(0, 6, (2, 9))}, {})
    (grad,) = torch.autograd.grad((padded["positions"] ** 2).sum(), positions)
    assert torch.equal(grad, 2 * positions.detach())
    # the anchor pair still sits dead_length apart
    dead = padded["positions"][-2:].detach()
    assert float((dead[1] - dead[0]).norm()) == pytest.approx(padder.dead_length)


# -- the steady state: fixed storage, incremental dead rows, no host reads (issue 15)


def _coo_step(n: int, e: int, gen: torch.Generator, shift: float = 0.0, sentinels: int = 0) -> dict[str, torch.Tensor]:
    edge_index = torch.randint(0, n, (2, e), generator=gen)
    if sentinels:
        edge_index[0, :sentinels] = n + 1
    return {
        "positions": torch.randn(n, 3, generator=gen, dtype=torch.float64) * 3 + shift,
        "node_attrs": torch.rand(n, 3, generator=gen, dtype=torch.float64),
        "batch": torch.zeros(n, dtype=torch.long), "ptr": torch.tensor([0, n]),
        "edge_index": edge_index,
        "shifts": torch.randn(e, 3, generator=gen, dtype=torch.float64),
        "unit_shifts": torch.randn(e, 3, generator=gen, dtype=torch.float64),
        "cell": torch.eye(3, dtype=torch.float64) * 9, "head": torch.zeros(1, dtype=torch.long),
    }


def _dense_step(cls: type[DensePadder], n: int, k: int, gen: torch.Generator,
                dtype: torch.dtype = torch.int64) -> dict[str, torch.Tensor]:
    rows = n + 1 if cls is DensePadder else n
    nbmat = torch.randint(0, n + 2, (rows, k), generator=gen).to(dtype)
    return {
        "coord": torch.randn(rows, 3, generator=gen), "numbers": torch.randint(1, 9, (rows,), generator=gen),
        "mol_idx": torch.zeros(rows, dtype=torch.long), "charge": torch.zeros(1),
        "nbmat": nbmat, "shifts": torch.randn(rows, k, 3, generator=gen),
    }


@SETTINGS
@given(
    steps=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 150), st.integers(0, 3)), min_size=2, max_size=6),
    placement=st.sampled_from(["own", "join"]), layout=st.sampled_from(["2E", "E2"]), seed=st.integers(0, 1000),
)
def test_coo_reused_buffers_equal_a_fresh_pad(steps: list[tuple[int, int, int]], placement: str, layout: str,
                                             seed: int) -> None:
    """Counts going up and down under fixed caps: a padder that rewrites only
    stale dead rows gives exactly what a fresh padder (writing all) gives."""
    gen = torch.Generator().manual_seed(seed)
    caps = {"atoms": 48, "edges": 160, "systems": 4}
    reused = mace_like(placement, edge_layout=layout)
    ptrs = None
    for n, e, sentinels in steps:
        data = _coo_step(n, e, gen, shift=float(n), sentinels=min(sentinels, e))
        if layout == "E2":
            data["edge_index"] = data["edge_index"].t().contiguous()
        out = reused.pad_to(data, caps)
        ref = mace_like(placement, edge_layout=layout).pad_to(data, caps)
        assert out.keys() == ref.keys()
        for key in ref:
            assert torch.equal(out[key], ref[key]), key
        now = {k: v.data_ptr() for k, v in out.items() if k in ref and v is not data.get(k)}
        assert ptrs is None or now == ptrs  # same storage at the same caps
        ptrs = now


@SETTINGS
@given(
    steps=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=2, max_size=6),
    cls=st.sampled_from([DensePadder, DenseBatchPadder]), placement=st.sampled_from(["own", "join"]),
    seed=st.integers(0, 1000), dtype=st.sampled_from([torch.int64, torch.int32]),
)
def test_dense_reused_buffers_equal_a_fresh_pad(steps: list[tuple[int, int]], cls: type[DensePadder], placement: str,
                                               seed: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(seed)
    caps = {"atoms": 48, "neighbors": 16, "systems": 4}
    reused = dense_padder(cls, placement)
    for n, k in steps:
        data = _dense_step(cls, n, k, gen, dtype)
        out = reused.pad_to(data, caps)
        ref = dense_padder(cls, placement).pad_to(data, caps)
        for key in ref:
            assert torch.equal(out[key], ref[key]), key


@pytest.mark.parametrize("cls", [DensePadder, DenseBatchPadder])
def test_a_dense_padders_dead_system_always_holds_a_dead_atom(cls: type[DensePadder]) -> None:
    """placement='own' pads a dead system; a cap that leaves room for the pad
    row alone left it empty, and AIMNet2 (eager) counts its systems from the
    atoms' labels: 'The size of tensor a (12) must match the size of tensor
    b (8)' at 50 atoms and an atom cap of 51. Now the atoms cap keeps a row
    for the dead system at any need, tight or head room."""
    gen = torch.Generator().manual_seed(0)
    padder = dense_padder(cls, "own")
    data = _dense_step(cls, 20, 5, gen)
    rows = 21 if cls is DensePadder else 20  # real atoms plus the pad row, no more
    state = {"atoms": rows, "neighbors": 8, "systems": 4}
    out = padder.pad(data, state)
    dead = state["systems"] - 1
    labels = out["mol_idx"][:-1] if cls is DensePadder else out["mol_idx"]
    assert bool((labels == dead).any()), (state, out["mol_idx"].tolist())
    assert state["atoms"] > rows


POISON = -777


def _poison(t: torch.Tensor, rows: slice, dim: int = 0) -> None:
    """Write into a padded tensor's storage without moving its version counter
    (as stale content the padder cannot know about)."""
    index = [slice(None)] * t.dim()
    index[dim] = rows
    t.data[tuple(index)] = POISON


def test_coo_rewrites_only_rows_between_the_old_and_new_count() -> None:
    gen = torch.Generator().manual_seed(0)
    caps = {"atoms": 64, "edges": 256, "systems": 4}
    padder = mace_like()
    out = padder.pad_to(_coo_step(40, 200, gen), caps)
    for key in ("node_attrs", "batch"):
        _poison(out[key], slice(40, 64))  # dead rows beyond the first count
    _poison(out["shifts"], slice(200, 256))
    _poison(out["edge_index"], slice(200, 256), dim=1)

    data = _coo_step(30, 150, gen)  # counts drop: rows 30..40 and edges 150..200 go dead
    out = padder.pad_to(data, caps)
    assert torch.equal(out["node_attrs"][:30], data["node_attrs"])
    assert bool((out["node_attrs"][30:40] == 0).all()) and bool((out["batch"][30:40] == 3).all())
    assert bool((out["edge_index"][:, 150:200] == 63).all())
    assert torch.equal(out["shifts"][150:200], torch.tensor([[padder.dead_length, 0.0, 0.0]]).expand(50, 3))
    # rows that were dead already were not rewritten
    assert bool((out["node_attrs"][40:] == POISON).all()) and bool((out["batch"][40:] == POISON).all())
    assert bool((out["shifts"][200:] == POISON).all()) and bool((out["edge_index"][:, 200:] == POISON).all())
    # dead positions follow the real atoms' bounding box every call
    assert bool((torch.cdist(out["positions"][30:], data["positions"]) > CUTOFF).all())

    data = _coo_step(50, 220, gen)  # counts grow: rows up to the new count become real
    out = padder.pad_to(data, caps)
    assert torch.equal(out["node_attrs"][:50], data["node_attrs"]) and torch.equal(out["shifts"][:220], data["shifts"])
    assert bool((out["node_attrs"][50:] == POISON).all()) and bool((out["shifts"][220:] == POISON).all())


@pytest.mark.parametrize("cls", [DensePadder, DenseBatchPadder])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_dense_sentinels_point_at_the_pad_index_at_every_size(cls: type[DensePadder], dtype: torch.dtype) -> None:
    """Large int32 matrices take the arithmetic reroute on the CPU, small
    ones and int64 ``where``: every entry ``>= n`` (sentinels, and larger
    ones) becomes the pad index and every other entry stays, at the sizes
    on both sides of the switch, with the counts going down and up."""
    gen = torch.Generator().manual_seed(3)
    padder = dense_padder(cls, "own")
    state: dict[str, int] = {}
    for n in (20, 2000, 150, 1500):
        data = _dense_step(cls, n, 40, gen, dtype)
        data["nbmat"][:n] = torch.randint(0, n + 4, (n, 40), generator=gen).to(dtype)  # negatives: an error
        out = padder.pad(data, state)
        n_cap = out["nbmat"].shape[0]
        pad_index = n_cap - 1 if cls is DensePadder else n_cap
        real = data["nbmat"][:n]
        expected = torch.where(real >= n, torch.tensor(pad_index, dtype=dtype), real)
        assert out["nbmat"].dtype == dtype
        assert torch.equal(out["nbmat"][:n, :40], expected), n
        assert bool((out["nbmat"][:, 40:] == pad_index).all()) and bool((out["nbmat"][n:] == pad_index).all())
        sentinel = (real >= n)[..., None].expand(n, 40, 3)
        assert bool((out["shifts"][:n, :40][sentinel] == 0).all())
        assert torch.equal(out["shifts"][:n, :40][~sentinel], data["shifts"][:n][~sentinel])


def test_dense_rewrites_only_the_stale_block() -> None:
    gen = torch.Generator().manual_seed(1)
    caps = {"atoms": 48, "neighbors": 16, "systems": 4}
    padder = dense_padder(DensePadder, "own")
    out = padder.pad_to(_dense_step(DensePadder, 30, 10, gen), caps)
    out["nbmat"].data[30:, :] = POISON
    out["nbmat"].data[:30, 10:] = POISON
    data = _dense_step(DensePadder, 20, 6, gen)
    out = padder.pad_to(data, caps)
    sentinel = data["nbmat"][:20] >= 20
    assert torch.equal(out["nbmat"][:20, :6], torch.where(sentinel, 47, data["nbmat"][:20]))
    assert bool((out["nbmat"][20:30, :10] == 47).all()) and bool((out["nbmat"][:20, 6:10] == 47).all())
    assert bool((out["nbmat"][30:] == POISON).all()) and bool((out["nbmat"][:30, 10:] == POISON).all())


def test_a_model_writing_into_its_input_gets_fresh_dead_rows() -> None:
    """A buffer written by someone else (its version counter moved) is rewritten whole."""
    gen = torch.Generator().manual_seed(2)
    caps = {"atoms": 32, "edges": 128, "systems": 4}
    padder = mace_like()
    data = _coo_step(20, 100, gen)
    out = padder.pad_to(data, caps)
    out["node_attrs"][25:] = 5.0  # in place, as a careless model might
    out["node_attrs"].requires_grad_(True)
    again = padder.pad_to(data, caps)
    assert bool((again["node_attrs"][20:] == 0).all())
    assert not again["node_attrs"].requires_grad  # flags set on an earlier call do not stick
    assert again["node_attrs"].data_ptr() == out["node_attrs"].data_ptr()


def test_padding_reads_no_device_value() -> None:
    """Meta tensors have no values: padding them proves no ``.item()`` /
    ``.tolist()`` / ``int(t)`` happens on a device (counts come from shapes)."""
    meta = torch.device("meta")
    coo = mace_like()
    data = {k: torch.empty(v.shape, dtype=v.dtype, device=meta) for k, v in _coo_step(20, 90, torch.Generator()).items()}
    state: dict[str, int] = {}
    for _ in range(2):
        out = coo.pad(data, state)
    assert out["positions"].device == meta and out["edge_index"].shape == (2, state["edges"])
    for cls in (DensePadder, DenseBatchPadder):
        dense = dense_padder(cls, "own")
        step = _dense_step(cls, 20, 7, torch.Generator())
        out = dense.pad({k: torch.empty(v.shape, dtype=v.dtype, device=meta) for k, v in step.items()}, {})
        assert out["nbmat"].device == meta


def test_steady_state_allocates_nothing_and_keeps_storage() -> None:
    gen = torch.Generator().manual_seed(3)
    padder, state = mace_like(), {}
    first = padder.pad(_coo_step(40, 200, gen), state)
    allocations = padder.allocations
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    for n, e in ((38, 190), (41, 210), (40, 180)):
        out = padder.pad(_coo_step(n, e, gen), state)
        assert {k: v.data_ptr() for k, v in out.items()} == ptrs
    assert padder.allocations == allocations


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that read a device value on the host (a synchronisation on a GPU)."""

    SYNCING = frozenset({"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"})

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        masks = name.startswith(("aten.index_put", "aten.index.")) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        if name in self.SYNCING or masks:  # boolean-mask indexing runs nonzero inside the kernel
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sentinels", [0, 3])
def test_steady_state_reads_at_most_the_cpu_input_checks(sentinels: int) -> None:
    """Values are read on the CPU only (free there, skipped on other devices,
    see the meta test): the edge index's smallest and largest entries (a
    negative one is an error, a sentinel takes the masked copies), the
    system labels' (within the systems), a dense matrix's smallest; no
    boolean-mask indexing (a ``nonzero`` inside the kernel) anywhere."""
    gen = torch.Generator().manual_seed(4)
    padder, state = mace_like(), {}
    padder.pad(_coo_step(30, 120, gen, sentinels=sentinels), state)
    with _HostReads() as mode:
        padder.pad(_coo_step(29, 118, gen, sentinels=sentinels), state)
    assert mode.reads == ["aten._local_scalar_dense.default"] * 4
    dense = dense_padder(DensePadder, "own")
    dense.pad(_dense_step(DensePadder, 20, 7, gen), state)
    with _HostReads() as mode:
        dense.pad(_dense_step(DensePadder, 19, 6, gen), state)
    assert mode.reads == ["aten._local_scalar_dense.default"] * 3


class _Reductions(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each reduction op and the dims it reduces over."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        if name.startswith(("aten.max", "aten.amax", "aten.min", "aten.amin", "aten.aminmax")):
            dims = (kwargs or {}).get("dim", args[1] if len(args) > 1 else [])
            self.calls.append((name.split(".")[1], list(dims) if isinstance(dims, (list, tuple)) else [dims]))
        return func(*args, **(kwargs or {}))


def test_steady_coo_pad_reduces_whole_tensors_with_amax() -> None:
    """The reductions of a steady CPU call (is any edge a sentinel or
    negative; are the labels within the systems; how far out go the dead
    atoms) are whole-tensor: one ``aminmax`` per index field, ``amax`` of
    the positions (torch's CPU ``max`` of int64 is not vectorised: 189 vs 53
    us over 400,000 edges, and a reduction over dim 0 of ``[N, 3]``
    positions took 82 us at 10,000 atoms, issue 15). The dead atoms still
    clear every real atom's cutoff."""
    gen = torch.Generator().manual_seed(5)
    padder, state = mace_like(), {}
    padder.pad(_coo_step(30, 120, gen), state)
    data = _coo_step(29, 118, gen, shift=-40.0)
    data["positions"][:, 2] += 80.0  # a box far from the origin, long in z
    with _Reductions() as mode:
        out = padder.pad(data, state)
    assert mode.calls == [("aminmax", []), ("aminmax", []), ("amax", [])]
    assert bool((torch.cdist(out["positions"][29:], data["positions"]) > CUTOFF).all())


@SETTINGS
@given(
    steps=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 150)), min_size=2, max_size=6),
    placement=st.sampled_from(["own", "join"]), written=st.integers(-1, 5), seed=st.integers(0, 1000),
)
def test_count_fields_under_reuse_equal_a_fresh_pad(steps: list[tuple[int, int]], placement: str, written: int,
                                                   seed: int) -> None:
    """Per-system atom and edge counts (fairchem's ``natoms`` / ``nedges``):
    the dead system's count is rewritten only when its count changes, a
    joined system's every call; after a write into the padded counts (the
    model's alias) the next pad still equals a fresh one."""
    gen = torch.Generator().manual_seed(seed)
    caps = {"atoms": 48, "edges": 160, "systems": 3}

    def padder() -> COOPadder:
        return mace_like(placement, ptr=None, system_count="natoms", atom_counts="natoms", edge_counts="nedges")

    reused = padder()
    for i, (n, e) in enumerate(steps):
        data = _coo_step(n, e, gen)
        del data["ptr"]
        data["natoms"], data["nedges"] = torch.tensor([n]), torch.tensor([e])
        out = reused.pad_to(data, caps)
        ref = padder().pad_to(data, caps)
        for key in ref:
            assert torch.equal(out[key], ref[key]), key
        assert int(out["natoms"].sum()) == 48 and int(out["nedges"].sum()) == 160
        if i == written:
            out["natoms"].add_(7)  # in place through the alias: its version counter moves


# -- dead rows: decided in one place (ddpad._padders._dead), issue 24


def _fake_model(name: str) -> torch.nn.Module:
    """Just what each adapter's make_padder reads (its cutoff, sevenn's type map)."""
    model = torch.nn.Module()
    if name == "mace":
        model.r_max = 5.0
    elif name == "uma":
        model.backbone = torch.nn.Module()
        model.backbone.cutoff = 6.0
    elif name in ("nequip", "allegro"):
        model.metadata = {"r_max": "4.0"}
    elif name == "sevennet":
        model.cutoff, model.type_map = 5.0, {6: 0, 8: 1}
    elif name == "mattersim":
        model.model = torch.nn.Module()
        model.model.model_args, model.model.graph_conv = {"cutoff": 5.0, "threebody_cutoff": 4.0}, None
    return model  # orb: no system_config, orb's envelope radius


# today's choice of every built-in COO adapter: dead self-loops, or the anchor pair
ADAPTER_SELF_LOOPS = {"mace": True, "uma": False, "nequip": True, "allegro": True, "sevennet": True, "orb": True,
                      "mattersim": False}
# adapters whose dead edges sit at the cutoff (sevenn's envelopes grow beyond it), by the fake model's cutoff
ADAPTER_EDGE_AT_CUTOFF = {"sevennet": 5.0}


@pytest.mark.parametrize("name", sorted(ADAPTER_SELF_LOOPS))
def test_each_adapters_dead_rows_come_from_the_one_rule(name: str) -> None:
    """Every built-in adapter's padder takes its self-loop / anchor-pair choice,
    and the dead atom rows that needs, from ``_dead.coo_dead_rows`` (nequip
    and allegro through ``vectors_from_cell``, not an ``__init__`` of their
    own); the choices are the ones the adapters made before the rule moved."""
    import importlib

    from ddpad._padders import _dead

    padder = importlib.import_module(f"ddpad.adapters.{name}").ADAPTER.make_padder(_fake_model(name))
    rule = _dead.coo_dead_rows(padder.placement, padder.edge_fields, padder.system_fields, padder.dead_length,
                               vectors_from_cell=type(padder).vectors_from_cell,
                               edge_length=ADAPTER_EDGE_AT_CUTOFF.get(name))
    assert padder.dead == rule and padder.self_loop is ADAPTER_SELF_LOOPS[name]
    assert rule.rows_needed == (1 if rule.self_loop else 2)
    # joined to a real system every adapter falls back to the anchor pair
    joined = _dead.coo_dead_rows("join", padder.edge_fields, padder.system_fields, padder.dead_length,
                                 vectors_from_cell=type(padder).vectors_from_cell)
    assert not joined.self_loop and joined.rows_needed == 2
    # check_fits (and cap_atoms=False) count the rule's dead rows
    n = 10
    counts = {padder.atoms_key: n, padder.systems_key: 1, "edges": 0, "triplets": 0}
    caps = {padder.atoms_key: n + rule.rows_needed, padder.systems_key: 2, "edges": 16, "triplets": 64}
    padder.check_fits(counts, caps)
    with pytest.raises(RuntimeError, match="'atoms' overflows"):
        padder.check_fits(counts, {**caps, padder.atoms_key: n + rule.rows_needed - 1})


def test_a_changed_dead_row_rule_changes_the_coo_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The COO padder asks ``_dead`` for the dead edge pair, the dead
    positions, the dead shift fills and the dead rows needed: a rule that
    turns mace's self-loops into the anchor pair changes all of them."""
    from ddpad._padders import _dead, coo

    gen = torch.Generator().manual_seed(11)
    data = _coo_step(20, 60, gen, sentinels=2)
    loops = mace_like().pad(data, {})
    n_cap = loops["positions"].shape[0]
    assert torch.equal(loops["edge_index"][:, 60:], torch.full((2, loops["edge_index"].shape[1] - 60), n_cap - 1))
    assert bool((loops["shifts"][60:, 0] > CUTOFF).all())

    def anchor_rule(placement, edge_fields, system_fields, dead_length, **_):  # type: ignore[no-untyped-def]
        return _dead.DeadRows(self_loop=False, rows_needed=2, dead_length=dead_length)

    monkeypatch.setattr(coo, "coo_dead_rows", anchor_rule)
    padder = mace_like()
    assert padder.dead.rows_needed == 2 and padder.atoms_policy.extra == 1
    out = padder.pad(data, {})
    n_cap = out["positions"].shape[0]
    dead = out["edge_index"][:, 60:]
    assert bool((dead[0] == n_cap - 2).all()) and bool((dead[1] == n_cap - 1).all())
    assert bool((out["edge_index"][0, :2] == n_cap - 2).all())  # the sentinels too
    assert bool((out["shifts"][60:] == 0).all()) and bool((out["unit_shifts"][60:] == 0).all())
    vec = out["positions"][n_cap - 1] - out["positions"][n_cap - 2]
    assert float(vec.norm()) > CUTOFF
    assert padder.pad(data, {}, cap_atoms=False)["positions"].shape[0] == 20 + 2


def test_edge_pair_and_ptr_outputs_are_sliced() -> None:
    """``edge_pair_outputs`` ([2, E], sliced on the last axis) and
    ``ptr_outputs`` ([S + 1]): what nequip's and sevenn's padders did in
    their own ``unpad``."""
    padder = COOPadder(CUTOFF, edge_pair_outputs=("edge_index", "not_a_pair"), ptr_outputs=("ptr",))
    data = _coo_step(12, 30, torch.Generator().manual_seed(2))
    out = padder.pad({k: data[k] for k in ("positions", "edge_index", "batch", "ptr")}, {})
    back = padder.unpad({"edge_index": out["edge_index"], "ptr": out["ptr"], "not_a_pair": torch.zeros(7),
                         "nested": {"edge_index": out["edge_index"]}})
    assert torch.equal(back["edge_index"], data["edge_index"]) and torch.equal(back["ptr"], data["ptr"])
    assert torch.equal(back["nested"]["edge_index"], data["edge_index"])
    assert back["not_a_pair"].shape == (7,)  # not [2, E]: left as is
