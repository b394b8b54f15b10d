"""Issue 44: a KV cache smaller than its share asks for (the card had less free) changes no token. Generation
queues the rows the cache cannot hold; a session's idle sequences give their pages back when the next turn
would not fit otherwise; the engine warns once with the figures."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

import archer.rollout.fast.engine as fast_engine
from archer.rollout.base import SamplingParams
from archer.rollout.fast import FastEngine
from archer.rollout.fast.pages import CacheBudget, page_bytes
from archer.units import GIB

MAX_LEN = 64
PAGE = 16
ONE_SEQUENCE = MAX_LEN // PAGE + 2  # the engine's minimum: one sequence of max_model_len tokens, its prompt's
# partly filled last page, and page 0


@pytest.fixture
def prompts(parts) -> list[list[int]]:
    tokenizer = parts[1]
    return [tokenizer(text)["input_ids"] for text in ("what is 3 + 5?", "hi", "The quick brown fox jumps")]


def _one_sequence_budget(spec, page_size, dtype, device, utilization, workspace, max_pages, min_pages=2):
    """budget_pages on a card with 8.5 GiB free: one sequence's pages where the share asks for 1,000."""
    return CacheBudget(min_pages, 1000, page_bytes(spec, page_size, dtype), free=int(8.5 * GIB), total=80 * GIB)


def _engine(parts) -> FastEngine:
    return FastEngine(*parts, max_num_seqs=8, page_size=PAGE, max_model_len=MAX_LEN)


def test_a_one_sequence_cache_generates_the_same_rows(parts, prompts, monkeypatch, caplog):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=40, seed=5)
    expected = _engine(parts).generate(prompts, params)
    with monkeypatch.context() as patch:
        patch.setattr(fast_engine, "budget_pages", _one_sequence_budget)
        with caplog.at_level(logging.WARNING, logger="archer.rollout"):
            engine = _engine(parts)
            assert engine.cache.pages == ONE_SEQUENCE
            first = engine.generate(prompts, params)
            engine.release_memory()
            second = engine.generate(prompts, params)  # sized again: the same cut, no second warning
    for out in (first, second):
        assert torch.equal(out.responses, expected.responses)
        assert out.finish_reasons == expected.finish_reasons
        torch.testing.assert_close(out.log_probs, expected.log_probs, atol=1e-5, rtol=0)
    warnings = [r.getMessage() for r in caplog.records if "KV cache gets" in r.getMessage()]
    assert len(warnings) == 1
    assert "not the " in warnings[0] and "rollout.gpu_memory_utilization=0.5 gives it" in warnings[0]
    assert "the GPU has 8.5 GiB free" in warnings[0] and "gpu_memory_utilization=" in warnings[0]
    assert engine.cache_bytes == ONE_SEQUENCE * page_bytes(engine.model.spec, PAGE, engine.dtype)


def test_idle_session_sequences_give_their_pages_back_for_the_next_turn(parts, prompts, monkeypatch):
    """Two sequences decoded earlier keep their pages for their next turn and fill the one-sequence cache; a
    third decodes all the same (the idle ones' pages go back), and the idle ones then continue as they would
    have with their pages kept (prefilled again)."""
    params = SamplingParams(do_sample=False, max_new_tokens=12)
    roomy = _engine(parts)
    with monkeypatch.context() as patch:
        patch.setattr(fast_engine, "budget_pages", _one_sequence_budget)
        small = _engine(parts)
    results = []
    for engine in (roomy, small):
        session = engine.session()
        a, b = session.add(prompts[0], seed=1), session.add(prompts[1], seed=2)
        first = [session.decode([seq], params, [6])[0].tokens for seq in (a, b)]
        c = session.add(prompts[2], seed=3)
        third = session.decode([c], params, [12])[0].tokens
        again = [session.decode([seq], params, [6])[0].tokens for seq in (a, b)]
        results.append((first, third, again, session.tokens(a), session.tokens(b)))
    assert small.cache.pages == ONE_SEQUENCE < roomy.cache.pages
    assert results[1] == results[0]


def test_release_memory_leaves_no_reference_to_the_cache(parts, prompts):
    """Issue 44: the scheduler kept the last generation's KV cache after release_memory, so the update and the
    next cache sizing ran beside it (31.4 GiB of the 1.5B run on an H100). Released, nothing holds it; the next
    generation makes a new one; the same for a session's running batch."""
    engine = _engine(parts)
    engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=1))
    session = engine.session()
    seq = session.add(prompts[0], seed=3)
    session.decode([seq], SamplingParams(do_sample=False), [4])
    cache = weakref.ref(engine.cache)
    engine.release_memory(weights=True)
    gc.collect()
    assert cache() is None and engine.scheduler.cache is None
