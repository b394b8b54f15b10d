"""The asynchronous modes' rollout pool (archer/rollout/request_pool.py) and the sessions' ``pause`` on the micro
model (CPU, float32): a paused request keeps its tokens, log-probs and entropies and continues as it would have
unpaused, quotas and forced groups, policy versions, partial rollouts off, and every page back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_rollout_fast_engine import TEXTS

from archer.errors import ArcherError
from archer.rollout.base import PAUSED, SamplingParams
from archer.rollout.fast import FastEngine, simulated_lengths
from archer.rollout.fast.sampling import noise_key
from archer.rollout.hf_engine import HFGenerateEngine
from archer.rollout.request_pool import Request, RolloutPool, hand_out

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=40)
STOPPING = SamplingParams(temperature=1.0, max_new_tokens=40, stop=("e",))  # responses of many lengths


@pytest.fixture(scope="module")
def prompts(parts) -> list[list[int]]:
    return [parts[1](t)["input_ids"] for t in TEXTS]


def _engine(parts) -> FastEngine:
    return FastEngine(*parts, max_num_seqs=8, page_size=16, window=4)


def _alone(engine, prompt: list[int], seed: int, budget: int, params: SamplingParams = PARAMS):
    session = engine.session()
    seq = session.add(prompt, seed)
    segment = session.decode([seq], params, [budget])[0]
    session.release(seq)
    return segment


def test_a_paused_decode_keeps_its_tokens_and_continues_as_unpaused(parts, prompts):
    engine = _engine(parts)
    whole = _alone(engine, prompts[0], 5, 30)
    assert whole.finish_reason == "length" and len(whole.tokens) == 30  # the micro model rarely stops by itself
    session = engine.session()
    seq = session.add(prompts[0], 5)
    session.submit(seq, PARAMS, 30)
    assert session.poll() == []  # one window of 4 tokens
    [(paused_seq, part)] = session.pause()
    assert paused_seq == seq and part.finish_reason == PAUSED and not session.busy
    assert part.tokens == whole.tokens[:4] and session.tokens(seq) == prompts[0] + part.tokens
    torch.testing.assert_close(part.log_probs, whole.log_probs[:4], atol=0, rtol=0)
    torch.testing.assert_close(part.entropies, whole.entropies[:4], atol=0, rtol=0)
    rest = session.decode([seq], PARAMS, [30 - 4])[0]  # continues from its cached prefix
    assert part.tokens + rest.tokens == whole.tokens
    torch.testing.assert_close(rest.log_probs, whole.log_probs[4:], atol=1e-5, rtol=0)
    session.release(seq)
    assert engine.cache.free_pages == engine.cache.pages - 1


def test_pause_takes_queued_and_waiting_decodes_back_empty(parts, prompts):
    engine = FastEngine(*parts, max_num_seqs=2, page_size=16, window=4)
    session = engine.session()
    seqs = [session.add(p, i) for i, p in enumerate(prompts[:3])]
    for seq in seqs[:2]:
        session.submit(seq, PARAMS, 20)
    session.poll()  # two decode, the third is submitted after
    session.submit(seqs[2], PARAMS, 20)
    paused = dict(session.pause())
    assert sorted(paused) == seqs and [len(paused[s].tokens) for s in seqs] == [4, 4, 0]
    assert all(s.finish_reason == PAUSED for s in paused.values())
    for seq in seqs:
        session.release(seq)
    assert engine.cache.free_pages == engine.cache.pages - 1


def test_the_pool_hands_out_its_quota_and_resumes_the_rest_under_a_new_version(parts, prompts):
    engine = _engine(parts)
    pool = RolloutPool(max_new_tokens=24)
    for i, prompt in enumerate(prompts):
        pool.admit(f"g{i}", prompt, seeds=[10 * i, 10 * i + 1])
    first = pool.run(engine, STOPPING, version=3, quota=1)
    assert len(first.groups) >= 1 and all(g.complete for g in first.groups) and first.resumed == 0
    assert len(pool) == 4 - len(first.groups)
    waiting = [r for g in pool.groups.values() for r in g.requests if not r.done]
    partial = [r for r in waiting if r.tokens]
    assert first.paused == len(waiting) and partial  # the micro model's responses end at different lengths
    kept = {id(r): (list(r.tokens), list(r.log_probs), list(r.entropies)) for r in partial}
    second = pool.run(engine, STOPPING, version=4, quota=len(pool))
    assert len(pool) == 0 and second.resumed == len(partial) and second.paused == 0
    assert [g.order for g in second.groups] == sorted(g.order for g in second.groups)
    prompt_of = {g.key: prompts[int(g.key[1:])] for g in second.groups}
    for request in partial:  # the earlier tokens and their log-probs are untouched, the new ones follow
        tokens, log_probs, entropies = kept[id(request)]
        assert request.tokens[: len(tokens)] == tokens and request.log_probs[: len(log_probs)] == log_probs
        assert request.entropies[: len(entropies)] == entropies and len(request.tokens) > len(tokens)
        assert (request.first_version, request.last_version) == (3, 4) and request.done
        # the same weights: the continuation is what the request samples unpaused
        alone = _alone(engine, prompt_of[_group_of(second, request)], request.seed, 24, STOPPING)
        assert request.tokens == alone.tokens and request.reason == alone.finish_reason
    for group in first.groups:
        assert {(r.first_version, r.last_version) for r in group.requests} == {(3, 3)}
    assert engine.cache.free_pages == engine.cache.pages - 1


def _group_of(run, request: Request) -> str:
    return next(g.key for g in run.groups if any(r is request for r in g.requests))


def test_forced_groups_finish_and_go_first_and_partial_off_restarts(parts, prompts):
    engine = _engine(parts)
    pool = RolloutPool(max_new_tokens=24)
    for i, prompt in enumerate(prompts[:3]):
        pool.admit(i, prompt, seeds=[i + 2, i + 102])  # seeds whose group 1 outlasts group 0
    run = pool.run(engine, STOPPING, version=0, quota=0, must_finish=frozenset({2}))
    assert [g.key for g in run.groups] == [2]  # the quota is 0: only the forced one, with what else finished
    waiting = [r for g in pool.groups.values() for r in g.requests if not r.done]
    assert run.paused == len(waiting) > 0
    assert [g.age(1) for g in pool.oldest_first()] == [1, 1] and [g.age(0) for g in pool.oldest_first()] == [0, 0]
    started = [r for r in waiting if r.tokens]
    run = pool.run(engine, STOPPING, version=1, quota=0, must_finish=frozenset({0}), partial=False)
    assert [g.key for g in run.groups] == [0] and run.resumed == len(started)
    assert any(not r.done for r in pool.groups[1].requests)
    for request in pool.groups[1].requests:  # paused again, its tokens dropped: it starts afresh next time
        assert request.done or (request.tokens == [] and request.first_version is None and request.started == 0)
    assert pool.groups[1].age(2) == 2  # the bound still sees it in flight since version 0


def test_round_sessions_finish_every_request_in_one_run(parts, prompts):
    """The HF engine decodes whole rounds: nothing is ever paused, and groups are handed out oldest first."""
    pool = RolloutPool(max_new_tokens=8)
    for i, prompt in enumerate(prompts):
        pool.admit(i, prompt, seeds=[i, i + 100])
    run = pool.run(HFGenerateEngine(*parts), PARAMS, version=2, quota=2)
    assert [g.key for g in run.groups] == [0, 1] and run.paused == 0
    assert sorted(pool.groups) == [2, 3] and all(g.complete for g in pool.groups.values())
    assert [(g.key, g.age(4)) for g in pool.oldest_first()] == [(2, 2), (3, 2)]


def test_simulated_lengths_end_responses_at_their_draws_across_a_pause(parts, monkeypatch):
    """bench/async_rl.py's long tail (ARCHER_SIMULATED_LENGTHS): a response ends at the length drawn for its noise
    key, also when it was paused and resumed; the draws follow the lognormal asked for."""
    monkeypatch.setenv(simulated_lengths.ENV, "prompt=6,median=10,sigma=0.8")
    simulated_lengths.from_environment.cache_clear()
    try:
        draws = simulated_lengths.from_environment()
        lengths = np.array([draws.length(noise_key(seed)) for seed in range(4000)])
        assert np.median(lengths) == pytest.approx(10, abs=1) and np.mean(lengths >= 40) == pytest.approx(0.042,
                                                                                                            abs=0.01)
        engine = _engine(parts)
        pool = RolloutPool(max_new_tokens=30)
        prompt = list(range(10, 16))  # 6 tokens, as the setting says
        for key in range(6):
            pool.admit(key, prompt, seeds=[key])
        run = pool.run(engine, PARAMS, version=0, quota=2)
        resumed = pool.run(engine, PARAMS, version=1, quota=len(pool))
        assert run.paused > 0 and resumed.resumed > 0
        for group in run.groups + resumed.groups:
            request = group.requests[0]
            assert len(request.tokens) == min(30, draws.length(noise_key(request.seed)))
        monkeypatch.setenv(simulated_lengths.ENV, "prompt=6,median")
        simulated_lengths.from_environment.cache_clear()
        with pytest.raises(ArcherError, match="cannot be read"):
            simulated_lengths.from_environment()
    finally:
        monkeypatch.delenv(simulated_lengths.ENV)
        simulated_lengths.from_environment.cache_clear()


def test_a_stop_string_that_straddles_a_pause_is_found(parts, prompts):
    """A stop string whose first token was sampled before the pause and whose last after it ends the resumed decode
    where the unpaused one ends (``lookback``); without it the resumed decode would not see it."""
    engine, tokenizer = _engine(parts), parts[1]
    whole = _alone(engine, prompts[0], 5, 30)
    stop = tokenizer.decode(whole.tokens[3:5])  # tokens 3 and 4: the pause comes after the first window of 4
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop=(stop,))
    unpaused = _alone(engine, prompts[0], 5, 30, params)
    assert unpaused.finish_reason == "stop" and len(unpaused.tokens) == 5  # it ends right after the pause

    def resumed(lookback: int) -> list[int]:
        session = engine.session()
        seq = session.add(prompts[0], 5)
        session.submit(seq, params, 30)
        session.poll()
        [(_, part)] = session.pause()
        assert part.tokens == whole.tokens[:4]
        session.submit(seq, params, 26, lookback=lookback)
        rest = {}
        while session.busy:
            rest.update(session.poll())
        session.release(seq)
        return part.tokens + rest[seq].tokens

    assert resumed(4) == unpaused.tokens and resumed(0) != unpaused.tokens


def test_a_call_hands_back_what_must_finish_then_the_oldest_up_to_its_quota():
    assert hand_out([4, 7, 9, 12], frozenset({9}), 2) == [9, 4]
    assert hand_out([4, 7, 9, 12], frozenset({9, 12, 3}), 1) == [9, 12]  # more must finish than the quota
    assert hand_out([4, 7], frozenset(), 5) == [4, 7] and hand_out([4, 7], frozenset(), 0) == []
