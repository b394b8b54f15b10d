"""The asynchronous modes with multi-turn tool rollouts (docs/async.md): a rank's admitted prompt batches are
generated whole through the tool loop, and a call hands back the oldest complete groups.

A tool trajectory is never paused across a weight sync (its tool answers would straddle two policies): each call
generates every batch admitted to it to the end, under the weights the engine holds, with the seeds the synchronous
loop gives those rows, and keeps the complete groups, oldest first; the call hands back ``quota`` of them and keeps
the rest for later calls (``drop`` evicts those past the staleness bound first). At num_warmup_batches=1 this is
verl's one-step-off: the batch a step trains was generated, whole, while the step before was being trained (or,
colocated, in the turn before it).
"""

from __future__ import annotations

import numpy as np

from archer.batch import Batch
from archer.rollout.request_pool import FIRST_POLICY_VERSION, stamp_policy_version
from archer.rollout.rollout_stats import RolloutStats
from archer.workers.async_rollout import (
    ASYNC_STATS,
    SAMPLE_INDEX,
    AsyncRollout,
    StalenessBound,
    rank_quota,
    rank_rows,
)
from archer.workers.results import ROLLOUT_STATS
from archer.workers.rollout import FIRST_PROMPT, RolloutWorker, concat_sequences


class WholeBatchRollout:
    """The complete groups of one rank with tools, over the rollout worker's tool loop."""

    def __init__(self, worker: RolloutWorker, pad_token_id: int) -> None:
        self.worker = worker
        self.pad_token_id = pad_token_id
        self.done: dict[str, Batch] = {}  # uid -> its group's rows, in the order the batches were admitted

    def take(self, admissions: list[Batch], quota: int, version: int, bound: StalenessBound, *, rank: int,
             world: int, rotation: int = 0, lag: int = 0) -> Batch:
        """Generate this rank's rows of each prompt batch of ``admissions`` under policy ``version``, then hand
        back its share of ``quota`` complete groups, the oldest first (as ``AsyncRollout.take``; the bound counts
        from version ``version + lag``, the one the step trains)."""
        stats = [self._generate(prompts.index(mine), version)
                 for prompts in admissions if len(mine := rank_rows(prompts, rank, world))]
        evicted = self._evict(version + lag, bound)
        parts = [self.done.pop(uid) for uid in list(self.done)[: rank_quota(quota, rank, world, rotation)]]
        batch = concat_sequences(parts, self.pad_token_id) if parts else Batch({})
        if any(s is not None for s in stats):
            batch.info[ROLLOUT_STATS] = RolloutStats.merge([s for s in stats if s is not None])
        batch.info[ASYNC_STATS] = {"evicted": evicted, "paused": 0, "resumed": 0, "in_flight": len(self.done),
                                   "prefilled": 0}
        return batch

    def _generate(self, share: Batch, version: int) -> RolloutStats | None:
        """``share``'s responses through the tool loop, each row sampled with the seed of its index in its loader
        batch; its groups go to ``done``. Returns the tool loop's statistics of the call."""
        share.info[FIRST_PROMPT] = int(share[SAMPLE_INDEX][0])
        out = self.worker.generate_for(share)
        stats = out.info.pop(ROLLOUT_STATS, None)
        stamp_policy_version(out, version)
        uids = np.asarray(out["uid"])
        for uid in dict.fromkeys(uids.tolist()):
            self.done[str(uid)] = out.index(np.flatnonzero(uids == uid))
        return stats

    def _evict(self, trained: int, bound: StalenessBound) -> list[str]:
        """``drop``: the complete groups older than the bound at version ``trained`` leave (``wait`` has nothing
        to wait for: every kept group is complete)."""
        if bound.strategy != "drop":
            return []
        old = [uid for uid, rows in self.done.items()
               if trained - int(rows[FIRST_POLICY_VERSION].min()) > bound.max_off_policy_threshold]
        for uid in old:
            del self.done[uid]
        return old


def async_rollout_for(worker: RolloutWorker, pad_token_id: int) -> AsyncRollout | WholeBatchRollout:
    """A rank's side of the asynchronous modes: the pool of paused and resumed requests, or with tools configured
    whole batches through the tool loop."""
    if worker.agentic is not None:
        return WholeBatchRollout(worker, pad_token_id)
    return AsyncRollout(worker, pad_token_id)
