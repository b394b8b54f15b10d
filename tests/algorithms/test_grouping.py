"""Tests of archer.algorithms.grouping: rows grouped by prompt uid, the one helper every stage uses."""

from __future__ import annotations

import numpy as np

from archer.algorithms.grouping import (
    count_groups,
    group_index,
    group_rows,
    index_within_group,
    rows_of_groups_where,
)

UIDS = ["a", "b", "a", "a", "c", "b"]


def test_group_index_numbers_groups_by_first_appearance() -> None:
    ids, n = group_index(UIDS)
    assert ids.dtype == np.int64 and ids.tolist() == [0, 1, 0, 0, 2, 1] and n == 3
    ids, n = group_index(np.array(["x", 7, "x", "7"], dtype=object))  # uids compare as strings
    assert ids.tolist() == [0, 1, 0, 1] and n == 2
    ids, n = group_index([])
    assert ids.tolist() == [] and n == 0


def test_count_groups() -> None:
    assert count_groups(UIDS) == 3
    assert count_groups(np.array(["1-0", "1-0", "1.1-0"], dtype=object)) == 2
    assert count_groups([]) == 0


def test_group_rows_lists_each_group_in_row_order() -> None:
    assert [r.tolist() for r in group_rows(UIDS)] == [[0, 2, 3], [1, 5], [4]]
    assert group_rows([]) == []


def test_index_within_group_counts_in_row_order() -> None:
    out = index_within_group(UIDS)
    assert out.dtype == np.int32 and out.tolist() == [0, 0, 1, 2, 0, 1]
    assert index_within_group([]).tolist() == []


def test_rows_of_groups_where_broadcasts_the_group_verdict() -> None:
    values = np.array([1.0, 0.0, 0.0, 1.0, 5.0, 0.0])
    mixed = rows_of_groups_where(UIDS, values, lambda v: bool(np.ptp(v) > 0))
    assert mixed.tolist() == [True, False, True, True, False, False]
    assert rows_of_groups_where([], np.zeros(0), lambda v: True).tolist() == []
