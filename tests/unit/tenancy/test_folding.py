"""``FoldingTable``: at most ``per_tenant`` rows per tenant; past it the
least recently used row is summed into its other row, exactly, and other
rows are never folded."""

from __future__ import annotations

import pytest

from kvtier.tenancy.folding import OTHER, FoldingTable


def counts(per_tenant: int) -> FoldingTable[str, list[int]]:
    def fold(into: list[int], row: list[int]) -> None:
        into[0] += row[0]

    return FoldingTable(per_tenant, lambda tenant, key: [0], fold, lambda key: OTHER)


def test_the_least_recent_rows_fold_into_the_other_row_and_totals_stay() -> None:
    table = counts(4)
    for name in "abcd":
        table.row("t", name)[0] += 1
    table.row("t", "a")[0] += 1  # a is now the most recent
    table.row("t", "e")[0] += 1  # b folds (other made), then c (the other took b's place)
    assert {key: row[0] for _, key, row in table.items()} == {"a": 2, "d": 1, OTHER: 2, "e": 1}
    assert table.folded == 2
    for n in range(100):
        table.row("t", f"n{n}")[0] += 1
    assert len(table) == 4
    assert sum(row[0] for _, _, row in table.items()) == 106
    assert table.get("t", OTHER) is not None and table.get("t", "a") is None


def test_each_tenant_has_rows_of_its_own() -> None:
    table = counts(4)
    table.row("quiet", "kept")[0] += 1
    for n in range(50):
        table.row("noisy", f"n{n}")[0] += 1
    assert table.get("quiet", "kept") == [1]
    assert sum(1 for tenant, _, _ in table.items() if tenant == "noisy") == 4


def test_a_read_is_not_use() -> None:
    table = counts(4)
    for name in "abcd":
        table.row("t", name)
    assert table.get("t", "a") == [0]  # not moved: a is still the least recent
    table.row("t", "e")
    assert table.get("t", "a") is None


def test_too_few_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 4"):
        counts(3)
