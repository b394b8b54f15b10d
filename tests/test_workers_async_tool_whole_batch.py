"""The staleness bound of whole tool batches (trainer.v1.partial_rollout=false with tools: workers/async_tool_rollout.py's
WholeBatchRollout), without an engine: a complete group is evicted under ``drop`` exactly when the version the step
trains is more than max_off_policy_threshold versions past the one that sampled it, and kept at the bound itself."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from archer.batch import Batch
from archer.rollout.request_pool import FIRST_POLICY_VERSION
from archer.workers.async_rollout import ASYNC_STATS, StalenessBound
from archer.workers.async_tool_rollout import WholeBatchRollout


class NoEngine:
    """A rollout worker whose engine turn does nothing: a call without admissions generates nothing."""

    @contextmanager
    def engine_turn(self, *, release_weights: bool) -> Iterator[None]:
        yield


def pool_of(started: dict[str, int]) -> WholeBatchRollout:
    """A pool holding one complete group of two rows per uid, sampled from version ``started[uid]`` on."""
    pool = WholeBatchRollout(NoEngine(), pad_token_id=0)
    for uid, version in started.items():
        pool.done[uid] = Batch({}, {"uid": [uid, uid], FIRST_POLICY_VERSION: np.array([version, version + 1])})
    return pool


@pytest.mark.parametrize(("trained", "evicted"), [(4, []), (5, ["a"]), (6, ["a", "b"]), (9, ["a", "b", "c"])])
def test_drop_evicts_a_group_only_past_the_bound(trained: int, evicted: list[str]) -> None:
    # threshold 2: at version 4 the group sampled from 2 is exactly 2 versions old and stays; at 5 it is 3 old
    started = {"a": 2, "b": 3, "c": 6}
    pool = pool_of(started)
    bound = StalenessBound(max_off_policy_threshold=2, strategy="drop", partial_rollout=False)
    out = pool.take([], 0, trained - 1, bound, lag=1)  # the step trains version + lag
    assert out.info[ASYNC_STATS]["evicted"] == evicted
    assert list(pool.done) == [uid for uid in started if uid not in evicted]
    assert out.info[ASYNC_STATS]["in_flight"] == len(started) - len(evicted)


def test_wait_evicts_nothing() -> None:
    pool = pool_of({"a": 0})
    out = pool.take([], 0, 10, StalenessBound(1, "wait", False))
    assert out.info[ASYNC_STATS]["evicted"] == [] and list(pool.done) == ["a"]
