"""A rank's pool in colocate_async (archer/workers/async_rollout.py) on the micro model (CPU, fast engine): admitted
prompts come back as complete groups in the rollout worker's layout with their policy versions; the staleness
bound's ``drop`` evicts groups that passed it and ``wait`` finishes them within the turn."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archer.batch import Batch
from archer.config.loader import load_config
from archer.data.loader import collate_prompts
from archer.rollout.fast import FastEngine
from archer.workers.async_rollout import (
    ASYNC_STATS,
    BATCH_ROWS,
    SAMPLE_INDEX,
    AsyncRollout,
    StalenessBound,
    rank_rows,
)
from archer.workers.rollout import RolloutWorker

TEXTS = ["what is 3 + 5?", "hi", "The quick brown fox jumps", "<python>print(2 ** 10)</python> and", "7 * 6 ="]


def admit(rollout: AsyncRollout, tokenizer, number: int) -> None:
    """Loader batch ``number`` of TEXTS into the pool (uids ``number-i``)."""
    items = [{"prompt_ids": tokenizer(t)["input_ids"], "data_source": "test"} for t in TEXTS]
    prompts = collate_prompts(items, int(tokenizer.pad_token_id))
    prompts["uid"] = [f"{number}-{i}" for i in range(len(items))]
    prompts[SAMPLE_INDEX] = np.arange(len(items))
    prompts.info["seed"] = 11 + number
    rollout.admit(prompts)


@pytest.fixture
def tokenizer(parts):
    return parts[1]


@pytest.fixture
def rollout(tiny_model_dir, parts) -> AsyncRollout:
    model, tokenizer = parts
    cfg = load_config("ppo_trainer", [f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.n=2",
                                      "actor_rollout_ref.rollout.response_length=24",
                                      "actor_rollout_ref.rollout.stop=[e]",
                                      "actor_rollout_ref.rollout.free_cache_engine=false"]).actor_rollout_ref.rollout
    engine = FastEngine(model, tokenizer, max_num_seqs=16, page_size=16, window=4)
    worker = RolloutWorker(engine, cfg, device=torch.device("cpu"))
    pool = AsyncRollout(worker, int(tokenizer.pad_token_id))
    admit(pool, tokenizer, 1)
    return pool


def test_groups_come_back_complete_in_the_rollout_layout(rollout: AsyncRollout) -> None:
    batch = rollout.produce(2, 0, StalenessBound(1, "drop", True))
    stats = batch.info[ASYNC_STATS]
    uids = list(dict.fromkeys(batch["uid"]))
    assert len(uids) >= 2 and len(batch) == 2 * len(uids)  # n rows a group, adjacent
    assert stats["in_flight"] == len(TEXTS) - len(uids) and stats["evicted"] == []
    assert batch["policy_version"].tolist() == [0] * len(batch) == batch["first_policy_version"].tolist()
    width = batch["responses"].shape[1]
    assert batch["input_ids"].shape[1] == batch["prompts"].shape[1] + width
    mask = batch["response_mask"].bool()
    assert torch.all(batch["rollout_log_probs"][~mask] == 0) and torch.all(batch["rollout_log_probs"][mask] < 0)
    assert set(rollout.rows) == set(rollout.pool.groups)  # what is handed out leaves the pool and its rows


def test_drop_evicts_and_wait_finishes_the_groups_past_the_bound(rollout: AsyncRollout, tokenizer) -> None:
    rollout.produce(1, 0, StalenessBound(1, "drop", True))  # the rest paused: started by version 0
    started = {g.key for g in rollout.pool.groups.values() if g.started == 0}
    assert started
    waited = rollout.produce(0, 1, StalenessBound(1, "wait", True))  # at version 2 they would be 2 old: finish now
    assert set(waited["uid"]) == started and waited.info[ASYNC_STATS]["evicted"] == []
    admit(rollout, tokenizer, 2)
    rollout.produce(1, 2, StalenessBound(5, "drop", True))  # starts the new batch under version 2, pauses some
    left = {g.key for g in rollout.pool.groups.values() if g.started == 2}
    assert left
    dropped = rollout.produce(0, 4, StalenessBound(1, "drop", True))
    assert set(dropped.info[ASYNC_STATS]["evicted"]) == left and not set(rollout.rows) & left


def test_a_batch_admitted_again_in_part_splits_over_the_ranks_as_it_first_did() -> None:
    """Rows 0-3 of a loader batch of 4 go 2 and 2 to two ranks; after a resume with rows 1-3 pending, row 2 stays
    rank 1's (a split by the pending rows alone would give it to rank 0)."""
    whole = Batch({}, {SAMPLE_INDEX: np.arange(4)}, {BATCH_ROWS: 4})
    assert [rank_rows(whole, r, 2).tolist() for r in (0, 1)] == [[0, 1], [2, 3]]
    again = Batch({}, {SAMPLE_INDEX: np.array([1, 2, 3])}, {BATCH_ROWS: 4})
    assert [again[SAMPLE_INDEX][rank_rows(again, r, 2)].tolist() for r in (0, 1)] == [[1], [2, 3]]
    assert rank_rows(again, 0, 1).tolist() == [0, 1, 2]


def test_the_bound_evicts_with_drop_and_names_what_must_finish_with_wait():
    started = {"a": 0, "b": 1, "c": None, "d": 2}  # oldest first; c has sampled nothing yet
    assert StalenessBound(1, "drop", True).past(started, 2) == (["a"], frozenset())  # 2 - 0 > 1
    assert StalenessBound(1, "wait", True).past(started, 2) == ([], frozenset({"a", "b"}))  # 3 - 1 > 1 next step
    assert StalenessBound(0, "drop", True).past(started, 2) == (["a", "b"], frozenset())
    assert StalenessBound(5, "drop", True).past(started, 2) == ([], frozenset())
