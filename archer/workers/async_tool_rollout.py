"""The asynchronous modes with multi-turn tool rollouts (docs/async.md), two ways.

``PartialToolRollout`` (trainer.v1.partial_rollout=true, the default): a rank keeps one run of the tool loop
(rollout/agentic.py) across weight syncs. A call admits its prompts, runs every trajectory in flight until its quota
of groups is complete, and pauses the rest: a decoding trajectory keeps the tokens it sampled of its turn (and their
behaviour log-probs), a tool call keeps running, and the next call continues them under the new weights (the
engine prefills them again). Each response records the policy versions of its first and last sampled token. The
longest trajectories of a batch then no longer hold up the step; they finish in a later call.

``WholeBatchRollout`` (partial_rollout=false): every batch admitted to a call is generated to the end under the
weights the engine holds, with the seeds the synchronous loop gives those rows, so every response is sampled by one
policy version; the call hands back ``quota`` complete groups, oldest first, and keeps the rest for later calls. At
num_warmup_batches=1 this is verl's one-step-off.

Either way a trajectory samples with the seed the synchronous loop gives its row, and ``drop`` evicts the groups past
the staleness bound before a call.
"""

from __future__ import annotations

import time

import numpy as np

from archer.batch import Batch
from archer.rollout.agentic_config import branch_settings
from archer.rollout.policy_versions import past_bound
from archer.rollout.request_pool import FIRST_POLICY_VERSION, POLICY_VERSION, hand_out, stamp_policy_version
from archer.rollout.rollout_stats import RolloutStats
from archer.workers.async_rollout import (
    ASYNC_STATS,
    SAMPLE_INDEX,
    AsyncRollout,
    StalenessBound,
)
from archer.workers.results import ROLLOUT_STATS
from archer.workers.rollout import (
    RolloutWorker,
    concat_sequences,
    prompt_token_lists,
    sampling_params,
    tool_rows,
)


class WholeBatchRollout:
    """The complete groups of one rank with tools, over the rollout worker's tool loop."""

    def __init__(self, worker: RolloutWorker, pad_token_id: int) -> None:
        self.worker = worker
        self.pad_token_id = pad_token_id
        self.done: dict[str, Batch] = {}  # uid -> its group's rows, in the order the batches were admitted

    def take(self, admitted: list[Batch], quota: int, version: int, bound: StalenessBound, *, lag: int = 0) -> Batch:
        """Generate this rank's prompt batches (``admitted_share``) under policy ``version``, then hand back its
        ``quota`` of complete groups, the oldest first (as ``AsyncRollout.take``; the bound counts from version
        ``version + lag``, the one the step trains)."""
        with self.worker.engine_turn(release_weights=True):  # one turn: the weight copy goes after the last
            stats = [self._generate(share, version) for share in admitted]
        evicted = self._evict(version + lag, bound)
        parts = [self.done.pop(uid) for uid in list(self.done)[:quota]]
        batch = concat_sequences(parts, self.pad_token_id) if parts else Batch({})
        if any(s is not None for s in stats):
            batch.info[ROLLOUT_STATS] = RolloutStats.merge([s for s in stats if s is not None])
        batch.info[ASYNC_STATS] = {"evicted": evicted, "paused": 0, "resumed": 0, "in_flight": len(self.done),
                                   "prefilled": 0}
        return batch

    def _generate(self, share: Batch, version: int) -> RolloutStats | None:
        """``share``'s responses through the tool loop, each row sampled with the seed of its index in its loader
        batch; its groups go to ``done``. Returns the tool loop's statistics of the call."""
        params = sampling_params(self.worker.cfg, validate=False, seed=int(share.info["seed"]),
                                 first_prompt=int(share[SAMPLE_INDEX][0]))
        out = self.worker.generate_sequences(share, params)
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
               if past_bound(trained, int(rows[FIRST_POLICY_VERSION].min()), bound.max_off_policy_threshold)]
        for uid in old:
            del self.done[uid]
        return old


class PartialToolRollout:
    """The trajectories of one rank with tools, kept across weight syncs."""

    def __init__(self, worker: RolloutWorker, pad_token_id: int) -> None:
        self.worker = worker
        self.pad_token_id = pad_token_id
        params = sampling_params(worker.cfg, validate=False, seed=0)  # each admission brings its batch's seed
        self.n = params.n
        self.run = worker.agentic.open(params, branch_settings(worker.cfg, params, validate=False))
        self.rows: dict[int, Batch] = {}  # a prompt's number in the run -> its row

    def take(self, admitted: list[Batch], quota: int, version: int, bound: StalenessBound, *, lag: int = 0) -> Batch:
        """Admit this rank's prompt batches (``admitted_share``), run every trajectory with policy ``version`` until
        this rank's ``quota`` more groups are complete, pause the rest, and hand back those groups, the oldest
        first (as ``AsyncRollout.take``)."""
        for prompts in admitted:
            self._admit(prompts)
        run = self.run
        old, must_finish = bound.past({prompt: run.started(prompt) for prompt in sorted(run.prompts)}, version + lag)
        evicted = [str(self.rows.pop(p)["uid"][0]) for p in old]
        run.remove(old)
        complete_before = sum(g.done for g in run.groups.values())

        def enough() -> bool:
            completed = sum(g.done for g in run.groups.values()) - complete_before
            return completed >= quota and all(p in run.groups and run.groups[p].done for p in must_finish)

        start, since = time.monotonic(), [s.counters() for s in run.counted]
        for session in run.counted:  # this call's decode occupancy counts this call's largest batch
            session.restart_peak()
        run.version = version
        with self.worker.engine_turn(release_weights=True):
            resumed = run.resume()
            try:
                run.run(enough)
            finally:
                paused = run.pause()
        prefilled = sum(s.counters().prefilled - b.prefilled for s, b in zip(run.counted, since, strict=True))
        done = [p for p, g in sorted(run.groups.items()) if g.done]  # numbered in admission order: oldest first
        chosen = sorted(hand_out(done, must_finish, quota))
        batch = self._layout(chosen, time.monotonic() - start, since)
        run.remove(chosen)
        batch.info[ASYNC_STATS] = {"evicted": evicted, "paused": paused, "resumed": resumed,
                                   "in_flight": len(run.prompts), "prefilled": prefilled}
        return batch

    def _admit(self, share: Batch) -> None:
        """Start ``share``'s prompts, each with the seed the synchronous loop gives its row."""
        ids = prompt_token_lists(share)
        allowed = list(share["tools"]) if "tools" in share else [None] * len(share)  # the data's per-row tools
        numbers = self.run.admit(ids, allowed, int(share.info["seed"]), [int(i) for i in share[SAMPLE_INDEX]])
        for i, prompt in enumerate(numbers):
            self.rows[prompt] = share.index(slice(i, i + 1))

    def _layout(self, prompts: list[int], seconds: float, since: list) -> Batch:
        """The rows of ``prompts``' complete groups, each response tagged with the versions that sampled it."""
        if not prompts:
            return Batch({})
        out = self.run.output(prompts, seconds, since)
        n = self.n
        parts = [tool_rows(self.rows.pop(p), out, n, slice(i * n, (i + 1) * n)) for i, p in enumerate(prompts)]
        batch = concat_sequences(parts, self.pad_token_id)
        batch[FIRST_POLICY_VERSION] = np.asarray(out.first_versions, dtype=np.int64)
        batch[POLICY_VERSION] = np.asarray(out.last_versions, dtype=np.int64)
        batch.info[ROLLOUT_STATS] = out.stats
        return batch


RankRollout = AsyncRollout | WholeBatchRollout | PartialToolRollout


def async_rollout_for(worker: RolloutWorker, pad_token_id: int, *, partial: bool) -> RankRollout:
    """A rank's side of the asynchronous modes: the pool of paused and resumed requests, or with tools configured
    the tool loop's trajectories kept across weight syncs (``partial``: trainer.v1.partial_rollout) or whole
    batches."""
    if worker.agentic is None:
        return AsyncRollout(worker, pad_token_id)
    return (PartialToolRollout if partial else WholeBatchRollout)(worker, pad_token_id)
