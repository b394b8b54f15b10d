"""Which prompt groups a step trains on: DAPO's dynamic sampling (keep groups whose metric varies, generate
more batches until enough are kept, then trim) and Archer's rejection sampling (drop groups whose accuracies
are all 0 or all 1, no refill). A group is all responses that share a prompt uid.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from archer.errors import ArcherError

FILTER_METRICS = ("acc", "score")


def _group_ids(uids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(group index of each row, first-seen order), groups numbered in order of first appearance."""
    _, first, inverse = np.unique(np.asarray(uids, dtype=object).astype(str), return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))
    return order[inverse], first


def informative_rows(uids: Sequence[str], values: np.ndarray) -> np.ndarray:
    """Rows of groups whose `values` are not all equal (max > min; std > 0 without rounding), or that hold a
    single response."""
    groups, _ = _group_ids(uids)
    values = np.asarray(values, dtype=np.float64)
    keep_group = np.array([bool(np.ptp(values[groups == g]) > 0) or int((groups == g).sum()) == 1
                           for g in range(groups.max() + 1)]) if len(groups) else np.zeros(0, bool)
    return keep_group[groups] if len(groups) else np.zeros(0, bool)


def uniform_accuracy_rows(uids: Sequence[str], acc: np.ndarray) -> np.ndarray:
    """Rows of groups whose accuracies are all 0 or all 1 (what Archer's rejection sampling drops)."""
    groups, _ = _group_ids(uids)
    acc = np.asarray(acc, dtype=np.float64)
    uniform = np.array([bool(np.all(acc[groups == g] == 0) or np.all(acc[groups == g] == 1))
                        for g in range(groups.max() + 1)]) if len(groups) else np.zeros(0, bool)
    return uniform[groups] if len(groups) else np.zeros(0, bool)


def count_groups(uids: Sequence[str]) -> int:
    return len(set(np.asarray(uids, dtype=object).astype(str).tolist()))


def check_filter_metric(metric: str) -> None:
    if metric not in FILTER_METRICS:
        raise ArcherError(f"unknown algorithm.filter_groups.metric {metric!r}",
                          f"set it to one of: {', '.join(FILTER_METRICS)}")


def too_many_batches_error(num_batches: int, kept: int, needed: int) -> ArcherError:
    return ArcherError(
        f"dynamic sampling generated {num_batches} batches (algorithm.filter_groups.max_num_gen_batches) and kept "
        f"only {kept} of the {needed} prompt groups a step needs: too few groups have responses that differ",
        "raise algorithm.filter_groups.max_num_gen_batches (0: no limit) or data.gen_batch_size, or use prompts of "
        "a difficulty the model sometimes solves",
    )
