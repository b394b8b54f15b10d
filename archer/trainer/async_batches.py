"""The trainer's side of trainer.v1.trainer_mode=colocate_async and separate_async (docs/async.md): which prompts
the ranks' pools take in and when, which came back, and what a checkpoint keeps of the rest.

Each step admits the loader's batches up to number step + ``num_warmup_batches`` (the first step of a run that
many more than the others, so that generation runs ahead of training; a dynamic-sampling call after a step's first
admits one more, and later steps then admit nothing until the numbers catch up) and takes back
``data.train_batch_size`` complete prompt groups, the oldest first, sampled by the policy the step updates or by
older ones within the staleness bound. A loader batch keeps
the uids the synchronous loop gives it (batch b: uids ``b-i``) and its batch seed, so the two modes train the same
prompts in the same order (each response's own sampling seed differs between the modes).

A checkpoint records, for every admitted loader batch with groups not yet trained, its data position and those
rows; a resumed run admits them again first (their partial responses are gone with the process that sampled
them: they are sampled anew), then goes on with the loader, so the trained data order is the one an unbroken
run has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from omegaconf import DictConfig

from archer.batch import Batch
from archer.controller.worker_group import PendingCall, WorkerGroup
from archer.data.loader import PromptLoader, collate_prompts
from archer.rollout.policy_versions import engine_version
from archer.workers.async_rollout import ASYNC_STATS, BATCH_ROWS, GENERATION_S, SAMPLE_INDEX, StalenessBound

ASYNC_STATE = "async_pending"  # trainer-state key: the admitted loader batches with untrained groups
GEN_BATCH_SEED_STRIDE = 7_919_993  # sampling-seed offset of a step's 2nd, 3rd, ... generation batch


def prompt_batch_seed(seed: int, step: int, gen_index: int = 0) -> int:
    """The sampling seed of loader batch ``step`` (the ``gen_index``-th generation batch of that step)."""
    return seed * 1_000_003 + step + gen_index * GEN_BATCH_SEED_STRIDE


@dataclass
class Admission:
    """A loader batch in the pools: its number (the step whose batch it is), data position and untrained rows."""

    number: int
    epoch: int
    position: int
    pending: set[int] = field(default_factory=set)

    def to_state(self) -> dict[str, Any]:
        return {"number": self.number, "epoch": self.epoch, "position": self.position, "rows": sorted(self.pending)}


class AsyncBatches:
    """The generation batches of the asynchronous modes, from ``loader`` through the pools of ``workers`` (the
    trainer's ranks in colocate_async, the rollout ranks in separate_async)."""

    def __init__(self, cfg: DictConfig, loader: PromptLoader, workers: WorkerGroup, pad_token_id: int) -> None:
        v1 = cfg.trainer.v1
        self.loader, self.workers, self.pad_token_id = loader, workers, pad_token_id
        self.seed = int(cfg.trainer.seed)
        self.quota = int(cfg.data.train_batch_size)
        self.n = int(cfg.actor_rollout_ref.rollout.n)
        self.calls = 0  # produce calls so far: the ranks take turns at a quota's remainder
        self.warmup = int(v1[str(v1.trainer_mode)].num_warmup_batches)
        self.bound = StalenessBound(int(v1.sampler.max_off_policy_threshold), str(v1.sampler.max_off_policy_strategy),
                                    bool(v1.partial_rollout))
        self.admitted: dict[int, Admission] = {}
        self.next_number: int | None = None  # the loader batch admitted next (None: from the first step on)
        self.restored: list[dict[str, Any]] = []  # a resumed run's pending batches, admitted again at its first step

    def restore(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's pending loader batches (None: a checkpoint of the synchronous loop)."""
        if state:
            self.next_number, self.restored = int(state["next_number"]), list(state["batches"])

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the next loader batch's number and the admitted loader batches with untrained
        rows (plain values)."""
        return {"next_number": self.next_number,
                "batches": [a.to_state() for a in sorted(self.admitted.values(), key=lambda a: a.number)]}

    def next(self, step: int, metrics: dict[str, float], *, quota: int | None = None, extra: bool = False) -> Batch:
        """The generated (unscored) groups of ``step``, which updates policy version step - 1: the pools take the
        loader's batches up to number step + num_warmup_batches (``extra``: one more, for a step that asks again
        after dynamic sampling left too few), and hand back ``quota`` groups (default data.train_batch_size)."""
        return self.finish(self.start(step, quota=quota, extra=extra), metrics)

    def start(self, step: int, *, quota: int | None = None, extra: bool = False, version: int | None = None
              ) -> PendingCall:
        """Start ``next``'s call on the pools and return at once; ``version``: the policy the engines hold (default step - 1; separate_async's rollout ranks are one update
        behind the trainer, and the staleness bound counts from the step's version)."""
        admissions = [self._again(record) for record in self.restored]
        self.restored = []
        if self.next_number is None:
            self.next_number = step
        while self.next_number <= step + self.warmup or extra:
            admissions.append(self._admit(self.next_number))
            self.next_number += 1
            extra = False
        quota = self.quota if quota is None else quota
        version = engine_version(step) if version is None else version
        pending = self.workers.submit("produce_groups", admissions, quota, version, self.bound, self.calls,
                                      engine_version(step) - version)
        self.calls += 1
        return pending

    def finish(self, pending: PendingCall, metrics: dict[str, float]) -> Batch:
        """The groups of a started call, its pools' figures added to ``metrics``."""
        batch = pending.result()
        stats = batch.info.pop(ASYNC_STATS)
        returned = list(dict.fromkeys(batch["uid"])) if len(batch) else []
        for uid in [*returned, *stats["evicted"]]:
            self._trained(str(uid))
        metrics["async/in_flight_groups"] = float(stats["in_flight"])
        summed = {"async/paused_requests": stats["paused"], "async/resumed_requests": stats["resumed"],
                  "async/prefilled_tokens": stats["prefilled"],
                  "training/off_policy/evicted_samples": len(stats["evicted"]) * self.n}
        if GENERATION_S in stats:
            summed["async/generation_s"] = stats[GENERATION_S]
        for name, value in summed.items():  # over the step's calls (dynamic sampling may make several)
            metrics[name] = metrics.get(name, 0.0) + float(value)
        return batch

    def _admit(self, number: int) -> Batch:
        epoch, position = self.loader.epoch, self.loader.position
        items = self.loader.next_batch()
        admission = Admission(number, epoch, position, set(range(len(items))))
        self.admitted[number] = admission
        return self._prompts(items, admission)

    def _again(self, record: dict[str, Any]) -> Batch:
        """A checkpoint's pending loader batch, read again from its data position (the loader's own position is
        put back after)."""
        saved = self.loader.state_dict()
        self.loader.load_state_dict({"epoch": record["epoch"], "position": record["position"]})
        items = self.loader.next_batch()
        self.loader.load_state_dict(saved)
        admission = Admission(int(record["number"]), int(record["epoch"]), int(record["position"]),
                              {int(i) for i in record["rows"]})
        self.admitted[admission.number] = admission
        return self._prompts(items, admission)

    def _prompts(self, items: list[dict[str, Any]], admission: Admission) -> Batch:
        rows = sorted(admission.pending)
        prompts = collate_prompts([items[i] for i in rows], self.pad_token_id)
        prompts["uid"] = [f"{admission.number}-{i}" for i in rows]
        prompts[SAMPLE_INDEX] = np.array(rows, dtype=np.int64)
        prompts.info.update({"validate": False, "seed": prompt_batch_seed(self.seed, admission.number),
                             BATCH_ROWS: len(items)})
        return prompts

    def _trained(self, uid: str) -> None:
        number, row = (int(part) for part in uid.split("-"))
        admission = self.admitted[number]
        admission.pending.discard(row)
        if not admission.pending:
            del self.admitted[number]

