"""Policy versions of the training loop (docs/async.md), each rule once: which version an engine holds at a step,
how old a group is, when it is past the staleness bound, and how old the oldest group a mode trains is.

Version 0 is the initial model; step k's update turns version k - 1 into version k.
"""

from __future__ import annotations


def engine_version(step: int) -> int:
    """The version step ``step`` updates, which the engines hold when it begins: the weights of step - 1's update
    (separate_async's rollout ranks hold it once the step's sync is done)."""
    return step - 1


def version_age(version: int, started: int | None) -> int:
    """Versions between ``version`` and the one that sampled a group's first token (0 before its first token)."""
    return 0 if started is None else version - started


def past_bound(version: int, started: int | None, max_off_policy_threshold: int) -> bool:
    """Whether a group begun at version ``started`` is older than the staleness bound when version ``version``
    trains it."""
    return version_age(version, started) > max_off_policy_threshold


def oldest_trained_age(num_warmup_batches: int, engine_lag: int) -> int:
    """The age the oldest groups a mode trains reach: its warm-up's loader batches ahead of training, plus the
    versions its engines lag the trainer by (colocate_async 0; separate_async 1: the trainer is one update ahead
    of the rollout ranks)."""
    return num_warmup_batches + engine_lag
