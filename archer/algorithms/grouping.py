"""Prompt groups: the responses of one step that share a prompt uid (GRPO's group, DAPO's and Archer's group
filters, the traces' groups, best@n in validation). The one place rows are grouped by uid.

Uids are compared as strings and groups are numbered in the order their first row appears.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def group_index(uids: Sequence[object] | np.ndarray) -> tuple[np.ndarray, int]:
    """(dense group id of each row, int64 [N]; number of groups), groups numbered by first appearance."""
    ids: dict[str, int] = {}
    out = np.fromiter((ids.setdefault(str(uid), len(ids)) for uid in uids), dtype=np.int64, count=len(uids))
    return out, len(ids)


def count_groups(uids: Sequence[object] | np.ndarray) -> int:
    """Number of distinct uids."""
    return group_index(uids)[1]


def group_rows(uids: Sequence[object] | np.ndarray) -> list[np.ndarray]:
    """The rows of each group (ascending), groups in order of first appearance."""
    groups, num_groups = group_index(uids)
    order = np.argsort(groups, kind="stable")
    return np.split(order, np.cumsum(np.bincount(groups, minlength=num_groups))[:-1]) if num_groups else []


def index_within_group(uids: Sequence[object] | np.ndarray) -> np.ndarray:
    """int32 [N]: the position of each row among the rows of its group, in row order."""
    out = np.empty(len(uids), dtype=np.int32)
    for rows in group_rows(uids):
        out[rows] = np.arange(len(rows))
    return out


def rows_of_groups_where(uids: Sequence[object] | np.ndarray, values: np.ndarray,
                         chosen: Callable[[np.ndarray], bool]) -> np.ndarray:
    """bool [N]: whether ``chosen`` holds for the values of the row's group."""
    values = np.asarray(values)
    out = np.zeros(len(uids), dtype=bool)
    for rows in group_rows(uids):
        out[rows] = chosen(values[rows])
    return out
