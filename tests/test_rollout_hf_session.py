"""HFGenerateEngine sessions (the agentic loop's engine interface) on the micro model: a sequence's tokens are
its prompt, segments and extensions in order; its samples depend on its own seed only; budgets, stops, forks and
release; log-probs equal the training forward over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from archer.errors import ArcherError
from archer.models.loading import load_causal_lm, load_tokenizer
from archer.models.logprobs import response_logprobs
from archer.rollout.base import SamplingParams
from archer.rollout.hf_engine import HFGenerateEngine

SAMPLE = SamplingParams(temperature=1.0, max_new_tokens=64)
GREEDY = SamplingParams(do_sample=False, max_new_tokens=64)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> HFGenerateEngine:
    return HFGenerateEngine(load_causal_lm(tiny_model_dir, device="cpu"), load_tokenizer(tiny_model_dir))


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    return [engine.tokenizer(t)["input_ids"] for t in ("what is 3 + 5?", "hi", "The quick brown fox")]


def test_greedy_session_decode_equals_generate(engine, prompts):
    session = engine.session()
    seqs = [session.add(p, seed=0) for p in prompts]
    segments = session.decode(seqs, GREEDY, [6, 6, 6])
    out = engine.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=6))
    for i, (seq, segment) in enumerate(zip(seqs, segments)):
        length = int(out.response_mask[i].sum())
        assert segment.tokens == out.responses[i, :length].tolist()
        torch.testing.assert_close(segment.log_probs, out.log_probs[i, :length], atol=1e-5, rtol=0)
        torch.testing.assert_close(segment.entropies, out.entropies[i, :length], atol=1e-5, rtol=0)
        assert segment.finish_reason == out.finish_reasons[i]
        assert session.tokens(seq) == prompts[i] + segment.tokens


def test_a_sequence_samples_from_its_own_seed_whatever_decodes_beside_it(engine, prompts):
    alone = engine.session()
    a = alone.add(prompts[0], seed=7)
    together = engine.session()
    b = together.add(prompts[1], seed=1)
    c = together.add(prompts[0], seed=7)
    d = together.add(prompts[2], seed=2)
    first = alone.decode([a], SAMPLE, [8])[0]
    second = together.decode([b, c, d], SAMPLE, [8, 8, 8])[1]
    assert first.tokens == second.tokens
    torch.testing.assert_close(first.log_probs, second.log_probs, atol=1e-5, rtol=0)
    other = engine.session()
    assert other.decode([other.add(prompts[0], seed=8)], SAMPLE, [8])[0].tokens != first.tokens


def test_extend_then_decode_continues_the_whole_sequence(engine, prompts):
    session = engine.session()
    seq = session.add(prompts[0], seed=3)
    first = session.decode([seq], SAMPLE, [5])[0]
    tool = engine.tokenizer(" <result>\n8\n</result>", add_special_tokens=False)["input_ids"]
    session.extend(seq, tool)
    second = session.decode([seq], SAMPLE, [5])[0]
    tokens = session.tokens(seq)
    assert tokens == prompts[0] + first.tokens + tool + second.tokens
    # the second segment's log-probs and entropies are those of the training forward over the whole sequence
    ids = torch.tensor([tokens])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logp, entropy = response_logprobs(engine.model, ids, mask, (mask.cumsum(1) - 1), len(second.tokens))
    torch.testing.assert_close(second.log_probs, logp[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(second.entropies, entropy[0], atol=1e-4, rtol=0)


def test_fork_copies_the_tokens_and_samples_from_its_own_seed(engine, prompts):
    session = engine.session()
    parent = session.add(prompts[1], seed=4)
    session.decode([parent], SAMPLE, [4])
    child = session.fork(parent, seed=9)
    assert session.tokens(child) == session.tokens(parent)
    twin = session.add(session.tokens(parent), seed=9)  # the same tokens, the same seed
    child_next, twin_next = session.decode([child, twin], SAMPLE, [6, 6])
    assert child_next.tokens == twin_next.tokens
    assert session.tokens(child) != session.tokens(parent)  # the parent did not move


def test_budgets_stops_and_release(engine, prompts):
    session = engine.session()
    seqs = [session.add(p, seed=i) for i, p in enumerate(prompts)]
    segments = session.decode(seqs, SAMPLE, [2, 0, 5])
    assert [len(s.tokens) for s in segments][:2] == [2, 0] and len(segments[2].tokens) <= 5
    assert segments[0].finish_reason == segments[1].finish_reason == "length"
    # a stop string ends the segment at the token that completes it, which is kept
    full = engine.session()
    probe = full.add(prompts[0], seed=11)
    tokens = full.decode([probe], SAMPLE, [12])[0].tokens
    stop = engine.tokenizer.decode(tokens[4:6])
    cut = next(j for j in range(len(tokens)) if stop in engine.tokenizer.decode(tokens[: j + 1]))
    stopped = engine.session()
    seq = stopped.add(prompts[0], seed=11)
    segment = stopped.decode([seq], SamplingParams(temperature=1.0, max_new_tokens=64, stop=(stop,)), [12])[0]
    assert segment.finish_reason == "stop" and segment.tokens == tokens[: cut + 1]
    stopped.release(seq)
    with pytest.raises(KeyError, match="no sequence"):
        stopped.tokens(seq)
    with pytest.raises(ArcherError, match="empty"):
        stopped.add([], seed=0)
