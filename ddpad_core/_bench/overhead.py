"""ddpad's own per-call host cost: the wrapper and the padders against the bare model.

For each built-in padder, configured as its adapter configures it, and each
size, three medians on one thread, in one process: a ``PaddedModel(compile=
False)`` call around a trivial model minus the trivial model's own call (the
wrapper's overhead: cap resolution, pad, unpad, restore, stats), a bare
``padder.pad`` call, and a plain ``{k: v.clone()}`` of the input (what moving
the data once costs). The ratios to the clone say whether a cost is data
movement (about 1) or fixed Python work (much more at small sizes).

On a CPU the host also moves the data; on a GPU it launches kernels
instead, a few us each. The last column counts them: the non-view ops a
wrapped call dispatches beyond the model's, on a non-CPU device (``meta``:
the path a GPU takes, sentinels rerouted on the device, no value read on the
host); one ``_foreach_copy_`` of every field counts once. (The host time on
``meta`` itself is no guide: its kernels are Python, 10x a CPU call.)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["PADDERS", "format_table", "overhead_table"]

EDGES_PER_ATOM = 40
QUICK_SIZES = (20, 100, 1000)
QUICK_CALLS = 10
_WARMUP = 3


class _Trivial(torch.nn.Module):
    """A model that costs next to nothing: per-atom "forces" and one energy."""

    def __init__(self, positions: str) -> None:
        super().__init__()
        self.positions = positions

    def forward(self, data: dict[str, Tensor]) -> dict[str, Tensor]:
        pos = data[self.positions]
        return {"energy": pos[:1, 0], "forces": pos}


# -- inputs: each padder's native dict, ``n`` atoms, 40 edges (neighbours) per atom


def _coo_edges(n: int, gen: torch.Generator) -> Tensor:
    return torch.randint(0, n, (2, EDGES_PER_ATOM * n), generator=gen)


def _plain_coo(n: int, gen: torch.Generator) -> dict[str, Tensor]:
    """The issue's measurement: an MPNN-style dict (tests/_mpnn.py)."""
    e = EDGES_PER_ATOM * n
    return {
        "positions": torch.rand(n, 3, generator=gen, dtype=torch.float64) * n ** (1 / 3) * 2,
        "node_attrs": torch.nn.functional.one_hot(torch.randint(0, 3, (n,), generator=gen), 3).double(),
        "edge_index": _coo_edges(n, gen),
        "unit_shifts": torch.randint(-1, 2, (e, 3), generator=gen).double(),
        "cell": torch.eye(3, dtype=torch.float64) * 10,
        "batch": torch.zeros(n, dtype=torch.long),
        "ptr": torch.tensor([0, n]),
    }


def _mace(n: int, gen: torch.Generator) -> dict[str, Tensor]:
    """Every field of mace's own batch dict for one periodic system (float64)."""
    f64 = torch.float64
    data = _plain_coo(n, gen)
    e = data["edge_index"].shape[1]
    data["shifts"] = data["unit_shifts"] * 10
    data.update(
        forces=torch.zeros(n, 3, dtype=f64), charges=torch.zeros(n, dtype=f64),
        density_coefficients=torch.zeros(n, 1, dtype=f64), rcell=torch.eye(3, dtype=f64) / 10,
        pbc=torch.ones(1, 3, dtype=torch.bool), head=torch.zeros(1, dtype=torch.long),
        dipole=torch.zeros(1, 3, dtype=f64), external_field=torch.zeros(1, 3, dtype=f64),
        polarizability=torch.zeros(1, 3, 3, dtype=f64), stress=torch.zeros(1, 3, 3, dtype=f64),
        virials=torch.zeros(1, 3, 3, dtype=f64), dipole_weight=torch.ones(1, 3, dtype=f64),
        polarizability_weight=torch.ones(1, 3, 3, dtype=f64),
    )
    for name in ("energy", "weight", "energy_weight", "forces_weight", "stress_weight", "virials_weight",
                 "charges_weight", "elec_temp", "total_charge", "total_spin", "volume", "fermi_level"):
        data[name] = torch.zeros(1, dtype=f64)
    assert data["shifts"].shape[0] == e
    return data


def _uma(n: int, gen: torch.Generator) -> dict[str, Tensor]:
    """fairchem's graph fields for one system, as UMA's seam sees them (float32)."""
    e = EDGES_PER_ATOM * n
    return {
        "pos": torch.rand(n, 3, generator=gen) * n ** (1 / 3) * 2,
        "atomic_numbers": torch.randint(1, 9, (n,), generator=gen),
        "cell": torch.eye(3).unsqueeze(0) * 10, "pbc": torch.ones(1, 3, dtype=torch.bool),
        "natoms": torch.tensor([n]), "edge_index": _coo_edges(n, gen),
        "cell_offsets": torch.randint(-1, 2, (e, 3), generator=gen).float(), "nedges": torch.tensor([e]),
        "charge": torch.zeros(1, dtype=torch.long), "spin": torch.zeros(1, dtype=torch.long),
        "fixed": torch.zeros(n, dtype=torch.long), "tags": torch.zeros(n, dtype=torch.long),
        "batch": torch.zeros(n, dtype=torch.long),
    }


def _aimnet(n: int, gen: torch.Generator, *, sentinel_row: bool) -> dict[str, Tensor]:
    """aimnet's flat batch: one molecule, short- and long-range neighbour
    matrices (entries ``n`` are sentinels; int32, as aimnet's calculator
    makes them), the pad atom last if ``sentinel_row``."""
    rows = n + 1 if sentinel_row else n
    data = {
        "coord": torch.rand(rows, 3, generator=gen) * n ** (1 / 3) * 2,
        "numbers": torch.randint(1, 9, (rows,), generator=gen),
        "charge": torch.zeros(1), "mult": torch.ones(1),
        "mol_idx": torch.zeros(rows, dtype=torch.long),
        "nbmat": torch.randint(0, n + 1, (rows, EDGES_PER_ATOM), generator=gen, dtype=torch.int32),
        "nbmat_lr": torch.randint(0, n + 1, (rows, 2 * EDGES_PER_ATOM), generator=gen, dtype=torch.int32),
    }
    if sentinel_row:
        data["numbers"][n] = 0
        data["nbmat"][n] = n
        data["nbmat_lr"][n] = n
    return data


def _make_plain_coo() -> Any:
    from .. import _padders

    return _padders.COOPadder(
        3.0, atom_fields={"node_attrs": 0.0}, edge_fields={"unit_shifts": _padders.Fill.DEAD_UNIT_SHIFT},
        system_fields={"cell": _padders.Fill.DEAD_CELL}, atom_outputs=("forces", "node_energy"),
        system_outputs=("energy", "stress"),
    )


def _make_mace() -> Any:
    from ddpad.adapters.mace import make_padder

    return make_padder(SimpleNamespace(r_max=5.0))


def _make_uma() -> Any:
    from ddpad.adapters.uma import make_padder

    return make_padder(SimpleNamespace(backbone=SimpleNamespace(cutoff=6.0)))


def _make_dense() -> Any:
    from ddpad.adapters.aimnet2 import make_padder

    return make_padder()


def _make_dense_batch() -> Any:
    from ddpad.adapters.aimnet2 import make_padder

    from .. import _padders

    dense = make_padder()
    return _padders.DenseBatchPadder(
        nbmat=dense.nbmat, atom_fields=dense.atom_fields, system_fields=dense.system_fields,
        neighbor_fields=dense.neighbor_fields, system_count="charge",
        atom_outputs=dense.atom_outputs, system_outputs=dense.system_outputs,
    )


#: name -> (padder factory, input builder ``(n_atoms, generator) -> dict``, positions key)
PADDERS: dict[str, tuple[Callable[[], Any], Callable[[int, torch.Generator], dict[str, Tensor]], str]] = {
    "coo": (_make_plain_coo, _plain_coo, "positions"),
    "coo-mace": (_make_mace, _mace, "positions"),
    "coo-uma": (_make_uma, _uma, "pos"),
    "dense-aimnet2": (_make_dense, lambda n, g: _aimnet(n, g, sentinel_row=True), "coord"),
    "dense-batch": (_make_dense_batch, lambda n, g: _aimnet(n, g, sentinel_row=False), "coord"),
}


def _median_us(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(_WARMUP):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


class _OpCount(TorchDispatchMode):
    """Counts the non-view ops dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def _ops(fn: Callable[[], Any]) -> int:
    fn()  # steady state: a first call may plan
    with _OpCount() as counter:
        fn()
    return counter.ops


def _path_us(model: torch.nn.Module, make: Callable[[], Any], data: dict[str, Tensor], calls: int,
             bare: float) -> dict[str, float]:
    """A wrapped call's cost over the bare model on each compiled path: the
    ``torch.compile`` (inductor) one, Dynamo's guards included, and the
    ahead-of-time package (``compile_mode="aot"``, built in this process);
    the trivial model's own compiled work is a few us of both."""
    from .._padded import PaddedModel

    common = {"cap_policy": "headroom", "on_recompile": "ignore"}
    dynamo = PaddedModel(model, make(), backend="inductor", **common)
    package = PaddedModel(model, make(), compile_mode="aot", aot_build="foreground", **common)
    dynamo(data)
    package(data)  # (built and checked on its first call)
    if package.stats.aot_refused:
        raise RuntimeError(f"ddpad bench --overhead --paths: the package was refused ({package.manager.refused})")
    return {"compile_path_us": _median_us(lambda: dynamo(data), calls) - bare,
            "aot_path_us": _median_us(lambda: package(data), calls) - bare}


def _measure(name: str, n: int, calls: int, paths: bool = False) -> dict[str, Any]:
    from .._padded import PaddedModel

    make, build, positions = PADDERS[name]
    data = build(n, torch.Generator().manual_seed(n))
    model = _Trivial(positions)
    wrapped = PaddedModel(model, make(), compile=False)
    padder, state = make(), {}
    bare = _median_us(lambda: model(data), calls)
    wrapped_us = _median_us(lambda: wrapped(data), calls)
    pad_us = _median_us(lambda: padder.pad(data, state), calls)
    clone_us = _median_us(lambda: {k: v.clone() for k, v in data.items()}, calls)
    meta = {k: v.to("meta") for k, v in data.items()}
    on_meta = PaddedModel(model, make(), compile=False)
    ops = _ops(lambda: on_meta(meta)) - _ops(lambda: model(meta))
    first = next(k for k in ("edge_index", "nbmat") if k in data)
    compiled = _path_us(model, make, data, calls, bare) if paths else {}
    return {**compiled,
        "padder": name, "atoms": n, "edges": int(data[first].numel() // (2 if first == "edge_index" else 1)),
        "bare_us": bare, "wrapped_us": wrapped_us, "overhead_us": wrapped_us - bare,
        "pad_us": pad_us, "clone_us": clone_us,
        "pad_per_clone": pad_us / clone_us, "overhead_per_clone": (wrapped_us - bare) / clone_us,
        "device_ops": ops,
    }


def overhead_table(
    sizes: Sequence[int] = (20, 100, 1000, 10000, 100000),
    calls: int = 50,
    quick: bool = False,
    padders: Sequence[str] | None = None,
    paths: bool = False,
) -> list[dict[str, Any]]:
    """Measure the per-call host overhead of every built-in padder.

    Parameters
    ----------
    sizes
        Atom counts (40 edges / neighbours per atom).
    calls
        Timed calls per measurement (after a short warm-up); the median counts.
    quick
        Sizes 20 / 100 / 1,000 and at most 10 calls (for tests).
    padders
        Names from :data:`PADDERS`; default all.
    paths
        Also each compiled path's per-call cost (an inductor compile and an
        AOTInductor build per padder and size: minutes).

    Returns
    -------
    list[dict]
        One row per padder and size: ``padder``, ``atoms``, ``edges``,
        ``bare_us`` (the trivial model), ``wrapped_us`` (it through
        ``PaddedModel(compile=False)``), ``overhead_us`` (their difference),
        ``pad_us``, ``clone_us`` (``{k: v.clone()}`` of the input) and the
        ratios ``pad_per_clone``, ``overhead_per_clone``; ``device_ops``,
        the non-view ops a steady wrapped call adds to the model's on a
        non-CPU device (its kernel launches on a GPU). Measured on one
        thread (the thread count is restored afterwards). With ``paths``:
        ``compile_path_us`` and ``aot_path_us``, a wrapped call's cost over
        the bare model through ``torch.compile`` and through the package.
    """
    if quick:
        sizes, calls = tuple(s for s in sizes if s <= max(QUICK_SIZES)) or QUICK_SIZES, min(calls, QUICK_CALLS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [_measure(name, n, calls, paths) for name in (padders or PADDERS) for n in sizes]
    finally:
        torch.set_num_threads(threads)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows of :func:`overhead_table` as an aligned text table."""
    paths = bool(rows) and "aot_path_us" in rows[0]
    head = ("padder", "atoms", "edges", "model us", "overhead us", "pad us", "clone us", "pad/clone", "overhead/clone",
            "device ops", *(("torch.compile path us", "package path us") if paths else ()))
    lines = [head] + [
        (r["padder"], f"{r['atoms']:,}", f"{r['edges']:,}", f"{r['bare_us']:.1f}", f"{r['overhead_us']:.1f}",
         f"{r['pad_us']:.1f}", f"{r['clone_us']:.1f}", f"{r['pad_per_clone']:.2f}", f"{r['overhead_per_clone']:.2f}",
         str(r["device_ops"]), *((f"{r['compile_path_us']:.1f}", f"{r['aot_path_us']:.1f}") if paths else ()))
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        for line in lines
    )
