"""Malformed input gets a ValueError naming the field, not a wrong answer or a
torch error from deep inside the padder (issue 27, items 2-4).

The value checks (negative indices, system labels past the system count) run
on the CPU, where reading a value costs no synchronisation; shapes are
checked on every device.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from ddpad.padding import COOPadder, DenseBatchPadder, DensePadder, Fill

CUTOFF = 2.5


def cluster(n: int = 12, e: int = 40, systems: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """A non-periodic COO graph of ``systems`` equal systems, mace's field names."""
    gen = torch.Generator().manual_seed(seed)
    per = n // systems
    batch = torch.arange(systems).repeat_interleave(per)
    return {
        "positions": torch.randn(n, 3, generator=gen, dtype=torch.float64) * 3,
        "node_attrs": torch.rand(n, 3, generator=gen, dtype=torch.float64),
        "batch": batch, "ptr": torch.arange(systems + 1) * per,
        "edge_index": torch.randint(0, n, (2, e), generator=gen),
        "shifts": torch.zeros(e, 3, dtype=torch.float64),
        "cell": torch.zeros(3 * systems, 3, dtype=torch.float64),
    }


def coo(layout: str = "2E", **kw: object) -> COOPadder:
    return COOPadder(CUTOFF, edge_layout=layout, atom_fields={"node_attrs": 0.0},  # type: ignore[arg-type]
                     edge_fields={"shifts": Fill.DEAD_SHIFT}, system_fields={"cell": Fill.DEAD_CELL}, **kw)


def with_layout(data: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    return data if layout == "2E" else {**data, "edge_index": data["edge_index"].t().contiguous()}


def dense(cls: type[DensePadder], n: int = 20, k: int = 6, dtype: torch.dtype = torch.int64,
          seed: int = 0) -> tuple[DensePadder, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    rows = n + 1 if cls is DensePadder else n
    padder = cls(atom_fields={"coord": 0.0, "numbers": 0, "mol_idx": Fill.LAST_SYSTEM}, system_fields={"charge": 0.0},
                 neighbor_fields={"shifts": ("nbmat", 0.0)}, system_count="charge")
    data = {
        "coord": torch.randn(rows, 3, generator=gen), "numbers": torch.randint(1, 9, (rows,), generator=gen),
        "mol_idx": torch.zeros(rows, dtype=torch.long), "charge": torch.zeros(1),
        "nbmat": torch.randint(0, n + 1, (rows, k), generator=gen).to(dtype),
        "shifts": torch.randn(rows, k, 3, generator=gen),
    }
    return padder, data


# -- item 2: negative indices -------------------------------------------------


@pytest.mark.parametrize("layout", ["2E", "E2"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_coo_negative_edge_index_is_a_value_error(layout: str, where: str) -> None:
    """Eager reads ``pos[-1]``, the last real atom; padded it would be a dead
    atom (0.122 eV off on a 12-atom cluster, with no error)."""
    data = cluster()
    data["edge_index"][0, 0 if where == "first" else -1] = -1
    padder = coo(layout)
    with pytest.raises(ValueError, match=r"'edge_index'.*negative.*-1"):
        padder.pad(with_layout(data, layout), {})
    clean = cluster()  # the padder still works afterwards, on the same plan's caps
    assert padder.pad(with_layout(clean, layout), {})["edge_index"].shape[-1 if layout == "2E" else 0] >= 40


def test_coo_negative_index_next_to_sentinels_is_still_caught() -> None:
    data = cluster()
    data["edge_index"][1, 3] = 12  # a sentinel: rerouted to the dead atoms, fine
    data["edge_index"][0, 5] = -2
    with pytest.raises(ValueError, match="'edge_index'"):
        coo().pad(data, {})


@pytest.mark.parametrize("cls", [DensePadder, DenseBatchPadder])
@pytest.mark.parametrize(("n", "dtype"), [(20, torch.int64), (20, torch.int32), (400, torch.int32)],
                         ids=["int64", "int32-where", "int32-arithmetic"])
def test_dense_negative_neighbour_is_a_value_error(cls: type[DensePadder], n: int, dtype: torch.dtype) -> None:
    """A -1 in a neighbour matrix would point at padded row ``n_cap - 1``
    (``where`` and the arithmetic reroute only move entries ``>= n``)."""
    padder, data = dense(cls, n=n, k=12, dtype=dtype)
    data["nbmat"][n // 2, 3] = -1
    with pytest.raises(ValueError, match=r"'nbmat'.*negative"):
        padder.pad(data, {})


def test_dense_negative_entry_of_a_second_matrix_names_it() -> None:
    padder = DenseBatchPadder(nbmat=("nbmat", "nbmat_lr"), atom_fields={"numbers": 0}, system_count="charge")
    data = {"numbers": torch.ones(10, dtype=torch.long), "charge": torch.zeros(1),
            "nbmat": torch.randint(0, 11, (10, 4)), "nbmat_lr": torch.randint(0, 11, (10, 8))}
    data["nbmat_lr"][9, 7] = -3
    with pytest.raises(ValueError, match="'nbmat_lr'"):
        padder.pad(data, {})


# -- item 3: system labels outside [0, n_systems) -----------------------------


@pytest.mark.parametrize("label", [1, 5, -1])
def test_coo_batch_label_outside_the_systems_is_a_value_error(label: int) -> None:
    """``ptr`` declares one system, ``batch[-1] = 1``: eager raises
    IndexError, padded the atom would join the dead system (or another)."""
    data = cluster()
    data["batch"][-1] = label
    with pytest.raises(ValueError, match=rf"'batch'.*{label}.*1 system"):
        coo().pad(data, {})


def test_coo_labels_within_the_systems_pass() -> None:
    data = cluster(n=12, systems=3)
    out = coo().pad(data, {})
    assert torch.equal(out["batch"][:12], data["batch"])


def test_coo_labels_counted_from_the_labels_must_not_be_negative() -> None:
    """Without ``ptr`` the system count is the largest label + 1 (read on any
    device); a negative label is an error there too."""
    data = cluster(n=12, systems=2)
    del data["ptr"]
    data["batch"][0] = -1
    with pytest.raises(ValueError, match="'batch'"):
        coo(ptr=None).pad(data, {})


@pytest.mark.parametrize("cls", [DensePadder, DenseBatchPadder])
@pytest.mark.parametrize("label", [1, -1])
def test_dense_system_label_outside_the_systems_is_a_value_error(cls: type[DensePadder], label: int) -> None:
    padder, data = dense(cls)
    data["mol_idx"][3] = label
    with pytest.raises(ValueError, match="'mol_idx'"):
        padder.pad(data, {})


def test_dense_sentinel_row_label_is_not_checked() -> None:
    """DensePadder's last input row is the model's pad atom, not a real atom."""
    padder, data = dense(DensePadder)
    data["mol_idx"][-1] = 7
    padder.pad(data, {})


# -- item 4: malformed shapes -------------------------------------------------


@pytest.mark.parametrize(("layout", "make", "shape"), [
    ("2E", lambda ei: ei.reshape(-1), "(80,)"),
    ("2E", lambda ei: torch.cat([ei, ei[:1]]), "(3, 40)"),
    ("2E", lambda ei: ei.t().contiguous(), "(40, 2)"),
    ("E2", lambda ei: ei, "(2, 40)"),
    ("E2", lambda ei: ei.reshape(-1), "(80,)"),
], ids=["1d", "3xE", "Ex2-for-2E", "2xE-for-E2", "1d-E2"])
def test_coo_malformed_edge_index_is_a_value_error(
    layout: str, make: Callable[[torch.Tensor], torch.Tensor], shape: str,
) -> None:
    data = cluster()
    data["edge_index"] = make(data["edge_index"])
    expected = "(2, E)" if layout == "2E" else "(E, 2)"
    with pytest.raises(ValueError, match=re.escape(f"'edge_index' has shape {shape}") + ".*" + re.escape(expected)):
        coo(layout).pad(data, {})


@pytest.mark.parametrize("shape", [(36,), (12, 3, 1), (12, 2)], ids=["flat", "3d", "2-columns"])
def test_coo_malformed_positions_are_a_value_error(shape: tuple[int, ...]) -> None:
    data = cluster()
    data["positions"] = torch.zeros(shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'positions' has shape .*expected [(]N, 3[)]"):
        coo().pad(data, {})


@pytest.mark.parametrize("cls", [DensePadder, DenseBatchPadder])
@pytest.mark.parametrize("shape", ["flat", "3d"])
def test_dense_malformed_neighbour_matrix_is_a_value_error(cls: type[DensePadder], shape: str) -> None:
    padder, data = dense(cls)
    data["nbmat"] = data["nbmat"].reshape(-1) if shape == "flat" else data["nbmat"][..., None]
    with pytest.raises(ValueError, match=r"'nbmat' has shape .*expected [(]rows, K[)]"):
        padder.pad(data, {})


@pytest.mark.parametrize("cls", [DensePadder, DenseBatchPadder])
def test_dense_neighbour_field_of_another_width_is_a_value_error(cls: type[DensePadder]) -> None:
    padder, data = dense(cls)
    data["shifts"] = data["shifts"][:, :-1]
    with pytest.raises(ValueError, match=r"'shifts' has shape .*expected .*'nbmat'"):
        padder.pad(data, {})
