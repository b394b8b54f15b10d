"""Tool trajectories kept across weight syncs (trainer.v1.partial_rollout=true with tools:
workers/async_tool_rollout.py's PartialToolRollout) on the fast engine with tests/tool_model_support.py's
tool-calling micro model and ARPO's branching: calls that hand back one group each pause the other trajectories
mid-turn or mid-tool-call, and under unchanged weights (synced again between calls, so every sequence is prefilled
again) they continue to exactly the responses of one unpaused call; the policy versions of each response's first and
last sampled token; drop evicts a group past the bound with its sequences and tool calls; wait finishes it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from test_rollout_agentic_hf import ROLLOUT, arpo_prompts, make_actor
from tool_model_support import TRAIN_FILE, tool_model

from archer.batch import Batch
from archer.rollout.agentic_config import branch_settings
from archer.rollout.request_pool import FIRST_POLICY_VERSION, POLICY_VERSION
from archer.workers.async_rollout import ASYNC_STATS, SAMPLE_INDEX, StalenessBound
from archer.workers.async_tool_rollout import PartialToolRollout, WholeBatchRollout, async_rollout_for
from archer.workers.results import ROLLOUT_STATS
from archer.workers.rollout import sampling_params, tool_rows

pytestmark = pytest.mark.skipif(not TRAIN_FILE.is_file(), reason="ARPO's data is not in ../shared/data/arpo")

ARPO = [f"{ROLLOUT}.name=fast", f"{ROLLOUT}.n=4", f"{ROLLOUT}.initial_rollouts=2", f"{ROLLOUT}.beam_size=2",
        f"{ROLLOUT}.branch_probability=1.0", f"{ROLLOUT}.entropy_weight=0.0"]
FAR = StalenessBound(max_off_policy_threshold=100, strategy="drop", partial_rollout=True)
ROW_FIELDS = ("responses", "response_mask", "tool_mask", "num_tool_calls", "num_turns", "branch_parent",
              "branch_position", "finish_reason")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return tool_model(tmp_path_factory.mktemp("tool_model"))


def admission(model_dir, count: int, seed: int) -> Batch:
    """A loader batch as the asynchronous modes admit it: each row's index in it, the batch's seed."""
    prompts = arpo_prompts(model_dir, count)
    prompts[SAMPLE_INDEX] = np.arange(count)
    prompts.info.update(validate=False, seed=seed)
    return prompts


def row_values(batch: Batch, key: str, row: int) -> list:
    """A row's values of ``key``, a response-aligned tensor up to the row's end."""
    value = batch[key]
    if not isinstance(value, torch.Tensor):
        return [value[row]]
    end = int((batch["response_mask"][row] + batch["tool_mask"][row]).sum())
    return value[row, :end].tolist()


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Responses of long-tailed lengths whose turns end in calls (rollout/simulated_turns.py): the micro model's
    own responses are all alike, so its groups would complete together and nothing would be left to pause."""
    monkeypatch.setenv("ARCHER_SIMULATED_TURNS", "median=24,sigma=0.8,limit=96,tool_rate=0.7")


def test_paused_tool_trajectories_continue_to_the_responses_of_one_unpaused_call(model_dir, scripted) -> None:
    """The run is paused after every decode window (or wait for the tools), the engine's memory released (each sequence prefilled
    again) and the policy version raised, until every group is done."""
    actor = make_actor(model_dir, *ARPO)
    prompts = admission(model_dir, 3, seed=5)
    want = actor.generate_sequences(prompts)
    worker = actor.rollout
    params = sampling_params(worker.cfg, validate=False, seed=0)
    run = worker.agentic.open(params, branch_settings(worker.cfg, params, validate=False))
    ids = [row[m.bool()].tolist() for row, m in zip(prompts["input_ids"], prompts["attention_mask"], strict=True)]
    numbers = run.admit(ids, [None] * 3, 5, range(3))
    paused, resumed = [], []

    def one_poll() -> Callable[[], bool]:  # run's check before its first poll says no, the next says yes
        polls = iter(range(1))
        return lambda: next(polls, None) is None

    while not run.all_done:
        with actor._generating(), worker.engine_turn(release_weights=True):  # weights synced again each time
            run.version = len(paused)
            resumed.append(run.resume())
            run.run(one_poll())
            paused.append(run.pause())
    assert len(paused) > 2 and sum(paused) > 0 and resumed[1:] == paused[:-1]
    out = run.output(numbers, 0.0)
    got = tool_rows(prompts, out, 4)
    for key in ROW_FIELDS:
        assert [row_values(got, key, r) for r in range(12)] == [row_values(want, key, r) for r in range(12)], key
    for r in range(12):
        torch.testing.assert_close(torch.tensor(row_values(got, "rollout_log_probs", r)),
                                   torch.tensor(row_values(want, "rollout_log_probs", r)), atol=1e-4, rtol=0)
    assert int(got["num_tool_calls"].sum()) > 0 and max(got["branch_parent"].tolist()) >= 0  # tools and branches
    first, last = np.asarray(out.first_versions), np.asarray(out.last_versions)
    assert (first <= last).all() and (last < len(paused)).all()
    assert (last > first).any()  # some response was sampled by several versions: it outlived a pause
    run.remove(numbers)
    assert not run.prompts and not run.groups and not run.session_of and not run.group_of and not run.by_seq


def test_a_group_removed_while_a_branch_point_waits_for_its_prefill_is_released(model_dir, scripted) -> None:
    """A tool answer forks a branch point, which waits for the next poll to share its parent's pages; a run stopped
    right then, its engine's memory released, then evicted (drop), releases the parent before the fork."""
    actor = make_actor(model_dir, *ARPO)
    worker = actor.rollout
    params = sampling_params(worker.cfg, validate=False, seed=0)
    run = worker.agentic.open(params, branch_settings(worker.cfg, params, validate=False))
    prompts = admission(model_dir, 3, seed=5)
    ids = [row[m.bool()].tolist() for row, m in zip(prompts["input_ids"], prompts["attention_mask"], strict=True)]
    numbers = run.admit(ids, [None] * 3, 5, range(3))

    def a_fork_waits() -> bool:  # a fork of a trajectory's own sequence (not of a prompt's root)
        own = {s.inner._seqs[seq] for s in run.sessions for (session, seq) in run.by_seq if session == id(s)}
        return any(origin in own for s in run.sessions for origin, _ in s.inner._origins.values())

    with actor._generating(), worker.engine_turn(release_weights=True):
        run.run(a_fork_waits)
        run.pause()
    assert a_fork_waits() and worker.engine.cache is None
    run.remove(numbers)
    assert not run.by_seq and all(not s.inner._seqs and not s.inner._origins for s in run.sessions)


def test_a_call_hands_back_its_quota_with_each_responses_versions(model_dir, scripted) -> None:
    actor = make_actor(model_dir, *ARPO)
    pool = async_rollout_for(actor.rollout, actor.pad_token_id, partial=True)
    assert isinstance(pool, PartialToolRollout)
    got, calls, admissions = [], [], [admission(model_dir, 3, seed=1)]
    for version in range(4):
        with actor._generating():
            out = pool.take(admissions, 1, version, FAR)
        admissions = []
        calls.append(out.info[ASYNC_STATS])
        got.append(out)
        assert (out[FIRST_POLICY_VERSION] <= out[POLICY_VERSION]).all() and (out[POLICY_VERSION] <= version).all()
        assert out.info[ROLLOUT_STATS].calls_per_response == out["num_tool_calls"].tolist()
        if not pool.run.prompts:
            break
    assert [len(b) for b in got] == [4, 4, 4]  # one group a call
    assert [c["in_flight"] for c in calls] == [2, 1, 0]
    assert sorted(b["uid"][0] for b in got) == ["u0", "u1", "u2"]  # each group once, whichever completes first
    assert all(c["resumed"] == p["paused"] for p, c in zip(calls, calls[1:]))


def test_drop_evicts_the_groups_past_the_bound_with_their_sequences_and_wait_finishes_them(model_dir,
                                                                                         scripted) -> None:
    actor = make_actor(model_dir, *ARPO)
    for strategy in ("drop", "wait"):
        pool = async_rollout_for(actor.rollout, actor.pad_token_id, partial=True)
        with actor._generating():
            assert len(pool.take([admission(model_dir, 3, seed=1)], 1, 0, FAR)) == 4
        left = {p: pool.run.started(p) for p in pool.run.prompts}
        assert len(left) == 2 and set(left.values()) == {0}  # both started under version 0
        uids = [str(pool.rows[p]["uid"][0]) for p in left]
        bound = StalenessBound(max_off_policy_threshold=1, strategy=strategy, partial_rollout=True)
        with actor._generating():  # drop: at version 3 they are 3 versions old; wait: at 1 they would pass it at 2
            out = pool.take([], 1, 3 if strategy == "drop" else 1, bound)
        stats = out.info[ASYNC_STATS]
        if strategy == "drop":
            assert len(out) == 0 and stats["evicted"] == uids and stats["in_flight"] == 0
        else:
            assert out["uid"].tolist() == [uids[0]] * 4 + [uids[1]] * 4 and stats["evicted"] == []
        assert not pool.run.prompts and not pool.run.tool_calls and not pool.run.partials
        assert all(not s.plans and not s.inner._seqs for s in pool.run.sessions)  # every sequence released


def test_partial_rollout_off_keeps_whole_batches() -> None:
    class Worker:
        agentic = object()

    assert isinstance(async_rollout_for(Worker(), 0, partial=False), WholeBatchRollout)


def test_whole_batches_release_the_engines_weight_copy_after_the_turn(model_dir, scripted) -> None:
    """partial_rollout=false in colocate_async: the update that follows a turn must not find the engine's weight
    copy still on the card (the memory plan counts it released under free_cache_engine, the default)."""
    actor = make_actor(model_dir, *ARPO)
    pool = async_rollout_for(actor.rollout, actor.pad_token_id, partial=False)
    for version in range(2):  # the second turn syncs the weights again first
        with actor._generating():
            out = pool.take([admission(model_dir, 2, seed=version)] if version == 0 else [], 1, version, FAR)
        assert len(out) == 4 and actor.rollout.engine.model.released
