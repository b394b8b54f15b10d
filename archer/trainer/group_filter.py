"""Which prompt groups a step trains on: DAPO's dynamic sampling (keep groups whose metric varies, generate
more batches until enough are kept, then trim) and Archer's rejection sampling (drop groups whose accuracies
are all 0 or all 1, no refill). A group is all responses that share a prompt uid.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from archer.algorithms.grouping import rows_of_groups_where
from archer.errors import ArcherError

FILTER_METRICS = ("acc", "score")


def informative_rows(uids: Sequence[str], values: np.ndarray) -> np.ndarray:
    """Rows of groups whose `values` are not all equal (max > min; std > 0 without rounding), or that hold a
    single response."""
    return rows_of_groups_where(uids, np.asarray(values, dtype=np.float64),
                                lambda v: len(v) == 1 or bool(np.ptp(v) > 0))


def uniform_accuracy_rows(uids: Sequence[str], acc: np.ndarray) -> np.ndarray:
    """Rows of groups whose accuracies are all 0 or all 1 (what Archer's rejection sampling drops)."""
    return rows_of_groups_where(uids, np.asarray(acc, dtype=np.float64),
                                lambda v: bool(np.all(v == 0) or np.all(v == 1)))


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
