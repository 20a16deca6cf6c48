"""The per-call overhead benchmark (``ddpad._overhead``), in quick mode (issue 15)."""

from __future__ import annotations

import pytest

from ddpad._overhead import PADDERS, QUICK_SIZES, format_table, overhead_table

COLUMNS = {"padder", "atoms", "edges", "bare_us", "wrapped_us", "overhead_us", "pad_us", "clone_us",
           "pad_per_clone", "overhead_per_clone"}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return overhead_table(quick=True)


def test_table_covers_every_padder_and_size(rows: list[dict]) -> None:
    assert [(r["padder"], r["atoms"]) for r in rows] == [(p, n) for p in PADDERS for n in QUICK_SIZES]
    for r in rows:
        assert set(r) == COLUMNS
        assert r["pad_us"] > 0 and r["clone_us"] > 0 and r["wrapped_us"] > 0
        assert r["pad_per_clone"] == pytest.approx(r["pad_us"] / r["clone_us"])
    text = format_table(rows)
    assert len(text.splitlines()) == len(rows) + 1 and "pad/clone" in text


def test_padding_a_thousand_atoms_costs_a_few_copies(rows: list[dict]) -> None:
    """Loose on purpose (a loaded 2-core machine): before the per-layout plans
    a COO pad of 1,000 atoms cost 20-60 clones of the input, now 2-3."""
    for r in rows:
        if r["atoms"] == 1000 and r["padder"] in ("coo", "coo-uma"):
            assert r["pad_per_clone"] < 10, r
