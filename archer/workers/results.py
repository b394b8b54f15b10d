"""What the workers hand back to the driver besides tensors: the typed result of an update, and the info key of
the agentic loop's statistics on a generated batch, with the collectors that join the ranks' generations and
updates (workers/dispatch.py). The trainer reads worker results from here only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from archer.batch import Batch
from archer.rollout.rollout_stats import RolloutStats
from archer.trace.influence_capture import FactorGroup, merge_rank_factors
from archer.workers.dispatch import concat_batches

ROLLOUT_STATS = "rollout_stats"  # info key of a generated batch: the agentic loop's RolloutStats


def concat_generations(results: list[Batch], concat: Callable[[list[Batch]], Batch]) -> Batch:
    """The ranks' generated batches joined by ``concat``, their agentic loop's statistics merged."""
    stats = [b.info.pop(ROLLOUT_STATS) for b in results if ROLLOUT_STATS in b.info]
    batch = concat(results)
    if stats:
        batch.info[ROLLOUT_STATS] = RolloutStats.merge(stats)
    return batch


def concat_generated(results: list[Batch]) -> Batch:
    """The collector of a generation: every rank's generated rows in rank order (padded to one width by the
    ranks), the agentic loop's statistics merged over the ranks."""
    return concat_generations(results, concat_batches)


@dataclass
class UpdateResult:
    """The result of ``update_actor`` / ``update_critic``.

    ``metrics``: verl-named metrics averaged over the optimiser steps (every rank's are the same, all-reduced).
    ``influence``: the actor's captured gradient factors of the influence tokens it was given, per group of
    modules (None when none were asked for). ``captured``: on a rank of a data-parallel run, the tokens each
    module captured for the rank's own rows, which the driver needs to merge the ranks' factors (None in one
    process and once merged)."""

    metrics: dict[str, float]
    influence: list[FactorGroup] | None = None
    captured: dict[str, int] | None = None


def merge_updates(results: list[UpdateResult]) -> UpdateResult:
    """The collector of the actor's update: its metrics (every rank's are the same, all-reduced) and, when
    influence was traced on several ranks, the factors every rank captured for its rows, merged into those of the
    whole batch."""
    first = results[0]
    if first.captured is None:
        return first
    captured = [(r.influence, r.captured) for r in results]
    return UpdateResult(first.metrics, influence=merge_rank_factors(captured, first.influence[0].u.shape[1]))
