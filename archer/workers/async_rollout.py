"""A rank's side of trainer.v1.trainer_mode=colocate_async (docs/async.md): its share of the prompt groups in
flight across steps (a RolloutPool), admitted as the trainer hands it prompts and handed back as complete groups
in the rollout worker's layout, each response tagged with the policy versions that sampled it.

Each call decodes with the policy the engine holds (``version``) until the rank's quota of groups is complete,
applying the staleness bound first (``drop``: evict groups older than it; ``wait``: finish the groups that would
pass it at the next step), and pauses the rest for the next call, which resumes them under the new weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from archer.batch import Batch
from archer.rollout.base import padded_samples
from archer.rollout.policy_versions import past_bound
from archer.rollout.prompt_rounds import stream_seed
from archer.rollout.request_pool import FIRST_POLICY_VERSION, POLICY_VERSION, K, PoolGroup, RolloutPool
from archer.workers.dispatch import concat_batches, place, rank_share
from archer.workers.rollout import RolloutWorker, concat_sequences, layout_sequences, sampling_params

ASYNC_STATS = "async_rollout"  # info key: what the call did (evicted uids, paused and resumed requests, counts)
SAMPLE_INDEX = "sample_index"  # row of an admitted prompt: its index in its loader batch (its sampling seeds)
BATCH_ROWS = "batch_rows"  # info of admitted prompts: the rows of their whole loader batch (which rank takes which)
GENERATION_S = "generation_s"  # async stats of a standalone rollout rank: its seconds in the call
_SAMPLE_STREAM = 3  # seed stream of the asynchronous modes' requests


def merge_async_stats(stats: list[dict]) -> dict:
    """The ranks' pool figures of one call: counts summed, evicted uids joined, the slowest rank's seconds."""
    merged: dict = {}
    for key in stats[0]:
        values = [s[key] for s in stats]
        merged[key] = max(values) if key == GENERATION_S else sum(values, [] if key == "evicted" else 0)
    return merged


def concat_produced(results: list[Batch]) -> Batch:
    """The collector of a colocated rank's ``produce_groups``: every rank's complete prompt groups in rank order,
    with what the ranks' pools did summed (evicted uids joined)."""
    stats = [b.info.pop(ASYNC_STATS) for b in results]
    batch = concat_batches([b for b in results if len(b)] or results[:1])
    batch.info[ASYNC_STATS] = merge_async_stats(stats)
    return batch


def rank_quota(quota: int, rank: int, world: int, rotation: int) -> int:
    """How many of a call's ``quota`` groups ``rank`` of ``world`` hands back: an even share (``rank_share``), the
    remainder going to the ranks from ``rotation`` on (calls take turns at it)."""
    share = rank_share(quota, (rank - rotation) % world, world)
    return share.stop - share.start


def rank_rows(prompts: Batch, rank: int, world: int) -> np.ndarray:
    """The rows of admitted ``prompts`` that ``rank`` of ``world`` takes: those whose index in their whole loader
    batch falls in the rank's share of it (``rank_share``), so that a batch admitted again in part after a resume
    splits over the ranks as it first did."""
    share = rank_share(int(prompts.info.get(BATCH_ROWS, len(prompts))), rank, world)
    index = np.asarray(prompts[SAMPLE_INDEX])
    return np.flatnonzero((index >= share.start) & (index < share.stop))


def admitted_share(admissions: list[Batch], worker: Any) -> list[Batch]:
    """``split`` of ``produce_groups`` (workers/dispatch.py): this rank's rows of each admitted prompt batch
    (``rank_rows``), the batches where it has none left out."""
    rank, world = place(worker)
    return [prompts.index(mine) for prompts in admissions if len(mine := rank_rows(prompts, rank, world))]


@dataclass(frozen=True)
class StalenessBound:
    """trainer.v1.sampler and partial_rollout: how many policy versions a group may lag the trainer, what
    happens past it (``drop`` | ``wait``), and whether paused requests keep their tokens."""

    max_off_policy_threshold: int
    strategy: str
    partial_rollout: bool

    def past(self, started: Mapping[K, int | None], trained: int) -> tuple[list[K], frozenset[K]]:
        """For the step that trains version ``trained``, of groups (keys, oldest first) whose sampling began at the
        ``started`` versions (None: not yet): with ``drop`` the ones already past the bound, to evict now; with
        ``wait`` the ones the next step would find past it, which must finish now."""
        def older(key: K, version: int) -> bool:
            return past_bound(version, started[key], self.max_off_policy_threshold)

        if self.strategy == "drop":
            return [key for key in started if older(key, trained)], frozenset()
        return [], frozenset(key for key in started if older(key, trained + 1))


class AsyncRollout:
    """The pool of one rank, over the rollout worker's engine and sampling keys."""

    def __init__(self, worker: RolloutWorker, pad_token_id: int) -> None:
        self.worker = worker
        self.pad_token_id = pad_token_id
        self.pool = RolloutPool(int(worker.cfg.response_length))
        self.rows: dict[str, Batch] = {}  # uid -> its prompt (one row)
        self.n = int(worker.cfg.n)

    def admit(self, prompts: Batch) -> None:
        """Prompt groups of this rank: each row answered n times, with seeds from the batch's ``seed`` and the
        row's ``sample_index``."""
        seed = int(prompts.info["seed"])
        for i, uid in enumerate(prompts["uid"]):
            row = prompts.index(slice(i, i + 1))
            ids = row["input_ids"][0][row["attention_mask"][0].bool()].tolist()
            index = int(prompts[SAMPLE_INDEX][i])
            self.pool.admit(uid, ids, [stream_seed(seed, _SAMPLE_STREAM, index, j) for j in range(self.n)])
            self.rows[uid] = row

    def take(self, admitted: list[Batch], quota: int, version: int, bound: StalenessBound, *, lag: int = 0) -> Batch:
        """Admit this rank's prompt batches (``admitted_share``), then produce its ``quota`` of complete groups
        (``rank_quota``)."""
        for prompts in admitted:
            self.admit(prompts)
        return self.produce(quota, version, bound, lag=lag)

    def produce(self, quota: int, version: int, bound: StalenessBound, *, lag: int = 0) -> Batch:
        """This rank's complete groups sampled up to policy ``version`` (the engine's weights), for the step that
        updates version ``version + lag`` (colocated: 0; separate_async: the trainer is one update ahead of the
        rollout ranks): the staleness bound counts from that version."""
        evicted, must_finish = bound.past({g.key: g.started for g in self.pool.oldest_first()}, version + lag)
        self.pool.evict(evicted)
        for uid in evicted:
            del self.rows[uid]
        params = sampling_params(self.worker.cfg, validate=False, seed=0)  # the requests carry their own seeds
        run = self.worker.run_pool(self.pool, params, version, quota, must_finish=must_finish,
                                   partial=bound.partial_rollout)
        batch = self._layout(run.groups, version)
        batch.info[ASYNC_STATS] = {"evicted": evicted, "paused": run.paused, "resumed": run.resumed,
                                   "in_flight": len(self.pool), "prefilled": run.counters.prefilled}
        return batch

    def _layout(self, groups: list[PoolGroup], version: int) -> Batch:
        parts = [self._group_rows(group, version) for group in groups]
        if not parts:
            return Batch({})
        return concat_sequences(parts, self.pad_token_id)

    def _group_rows(self, group: PoolGroup, version: int) -> Batch:
        requests = group.requests
        responses, mask, log_probs, entropies = padded_samples(requests, self.pad_token_id)
        batch = layout_sequences(self.rows.pop(group.key), responses, mask, len(requests))
        batch["rollout_log_probs"] = log_probs
        batch["rollout_entropies"] = entropies
        batch["finish_reason"] = [r.reason for r in requests]
        versions = [(version, version) if r.first_version is None else (r.first_version, r.last_version)
                    for r in requests]  # a request that sampled nothing (an empty budget) counts as this version's
        batch[FIRST_POLICY_VERSION] = np.array([first for first, _ in versions], dtype=np.int64)
        batch[POLICY_VERSION] = np.array([last for _, last in versions], dtype=np.int64)
        return batch
