"""FastEngine on the micro model (CPU, float32): agreement with the HF engine and the training log-prob pass,
per-row seeds, stops and eos ids, continuous batching, prefix sharing, memory release, weight sync and
refusals."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from test_rollout_hf_engine import _full_sequences
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from archer.errors import ArcherError
from archer.models.loading import load_causal_lm
from archer.models.logprobs import response_logprobs
from archer.models.lora import policy_weights
from archer.rollout.base import RoundSession, SamplingParams
from archer.rollout.fast import FastEngine
from archer.rollout.hf_engine import HFGenerateEngine

TEXTS = ["what is 3 + 5?", "hi", "The quick brown fox jumps", "<python>print(2 ** 10)</python> and"]


@pytest.fixture(scope="module")
def prompts(parts) -> list[list[int]]:
    return [parts[1](t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def engine(parts) -> FastEngine:
    return FastEngine(*parts, max_num_seqs=8, page_size=16)


def _training_pass(model, tokenizer, prompts, out, temperature):
    ids, mask, pos = _full_sequences(prompts, out, tokenizer.pad_token_id)
    with torch.no_grad():
        return response_logprobs(model, ids, mask, pos, out.responses.shape[1], temperature=temperature)


def test_greedy_equals_hf_engine(engine, parts, prompts):
    params = SamplingParams(n=2, do_sample=False, max_new_tokens=24)
    fast, hf = engine.generate(prompts, params), HFGenerateEngine(*parts).generate(prompts, params)
    assert torch.equal(fast.responses, hf.responses)
    assert torch.equal(fast.response_mask, hf.response_mask)
    assert fast.finish_reasons == hf.finish_reasons
    assert fast.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    torch.testing.assert_close(fast.log_probs, hf.log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.entropies, hf.entropies, atol=1e-5, rtol=0)


def test_sampled_rows_equal_the_hf_engines(engine, parts, prompts):
    """Both engines sample with the same per-row noise: the same seed gives the same tokens (float32 logits)."""
    params = SamplingParams(n=2, temperature=0.9, top_k=40, max_new_tokens=16, seed=4, first_prompt=3)
    fast, hf = engine.generate(prompts, params), HFGenerateEngine(*parts).generate(prompts, params)
    assert torch.equal(fast.responses, hf.responses) and fast.finish_reasons == hf.finish_reasons
    torch.testing.assert_close(fast.log_probs, hf.log_probs, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12, seed=3),
        SamplingParams(n=3, temperature=1.3, max_new_tokens=12, seed=4),
        SamplingParams(do_sample=False, max_new_tokens=12),
    ],
)
def test_log_probs_match_training_pass(engine, parts, prompts, params):
    out = engine.generate(prompts, params)
    assert out.responses.dtype == out.response_mask.dtype == torch.long
    assert out.log_probs.dtype == out.entropies.dtype == torch.float32
    logp, entropy = _training_pass(*parts, prompts, out, 1.0 if params.greedy else params.temperature)
    torch.testing.assert_close(out.log_probs, logp, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.entropies, entropy, atol=1e-4, rtol=0)
    valid = out.response_mask.bool()
    assert torch.all(out.log_probs[valid] < 0) and torch.all(out.entropies[valid] > 0)
    assert torch.all(out.log_probs[~valid] == 0) and torch.all(out.responses[~valid] == engine.pad_token_id)


def test_rows_follow_their_own_seed(parts, prompts):
    params = SamplingParams(n=3, max_new_tokens=10, seed=7)
    wide = FastEngine(*parts, max_num_seqs=16, page_size=16)
    one_slot = FastEngine(*parts, max_num_seqs=1, page_size=16, window=3)
    first, again = wide.generate(prompts, params), wide.generate(prompts, params)
    assert torch.equal(first.responses, again.responses) and torch.equal(first.log_probs, again.log_probs)
    # one slot: every row decodes alone, in another order of admissions and window reads
    alone = one_slot.generate(prompts, params)
    assert torch.equal(alone.responses, first.responses)
    torch.testing.assert_close(alone.log_probs, first.log_probs, atol=1e-5, rtol=0)
    # the first prompt's rows do not depend on the prompts after it
    head = wide.generate(prompts[:1], params)
    assert torch.equal(head.responses, first.responses[:3, : head.responses.shape[1]])
    other = wide.generate(prompts, SamplingParams(n=3, max_new_tokens=10, seed=8))
    assert not torch.equal(other.responses, first.responses)
    for i in range(len(prompts)):
        assert len({tuple(r) for r in first.responses[3 * i : 3 * i + 3].tolist()}) == 3
    torch.manual_seed(0)
    unseeded = wide.generate(prompts, SamplingParams(n=3, max_new_tokens=10))
    torch.manual_seed(0)
    assert torch.equal(wide.generate(prompts, SamplingParams(n=3, max_new_tokens=10)).responses, unseeded.responses)


def test_top_k_one_and_tiny_top_p_are_greedy_with_unfiltered_log_probs(engine, prompts):
    greedy = engine.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=8))
    top_k = engine.generate(prompts, SamplingParams(top_k=1, max_new_tokens=8, seed=1))
    top_p = engine.generate(prompts, SamplingParams(top_p=1e-6, max_new_tokens=8, seed=2))
    assert torch.equal(top_k.responses, greedy.responses) and torch.equal(top_p.responses, greedy.responses)
    torch.testing.assert_close(top_k.log_probs, greedy.log_probs, atol=1e-5, rtol=0)
    assert torch.all(top_k.log_probs[top_k.response_mask.bool()] < -0.1)


def test_stop_string_cuts_after_the_completing_token(engine, parts, prompts):
    tokenizer = parts[1]
    full = engine.generate(prompts[:1], SamplingParams(max_new_tokens=20, seed=11)).responses[0].tolist()
    stop = tokenizer.decode(full[9:11])
    cut = next(j for j in range(len(full)) if stop in tokenizer.decode(full[: j + 1]))
    out = engine.generate(prompts[:1], SamplingParams(max_new_tokens=20, seed=11, stop=(stop, "\x00never")))
    assert out.finish_reasons == ["stop"]
    assert out.responses[0].tolist() == full[: cut + 1]
    # greedy with a stop string: the HF engine's cut and reasons
    params = SamplingParams(n=2, do_sample=False, max_new_tokens=20, stop=(tokenizer.decode(full[2:3]), " the"))
    fast, hf = engine.generate(prompts, params), HFGenerateEngine(*parts).generate(prompts, params)
    assert torch.equal(fast.responses, hf.responses) and fast.finish_reasons == hf.finish_reasons


def test_every_eos_id_ends_a_row_and_is_kept(parts, prompts):
    model, tokenizer = parts
    params = SamplingParams(n=4, max_new_tokens=16, seed=5)
    full = FastEngine(model, tokenizer, max_num_seqs=8, page_size=16).generate(prompts[:2], params)
    first, second = full.responses[0].tolist(), full.responses[1].tolist()
    eos_a = next(t for j, t in enumerate(first) if j >= 3 and t not in first[:j])
    eos_b = next(t for j, t in enumerate(second) if j >= 2 and t not in second[:j] and t != eos_a)
    model.generation_config.eos_token_id = [eos_a, eos_b]
    try:
        engine = FastEngine(model, tokenizer, max_num_seqs=8, page_size=16)
    finally:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    assert set(engine.eos_token_ids) == {tokenizer.eos_token_id, eos_a, eos_b}
    out = engine.generate(prompts[:2], params)
    for row in range(8):
        tokens = full.responses[row, : full.response_mask[row].sum()].tolist()
        ends = [j for j, t in enumerate(tokens) if t in engine.eos_token_ids]
        expected = tokens[: ends[0] + 1] if ends else tokens
        assert out.responses[row, : len(expected)].tolist() == expected
        assert out.response_mask[row].sum() == len(expected)
        assert out.finish_reasons[row] == ("eos" if ends else "length")
    assert out.finish_reasons[0] == out.finish_reasons[1] == "eos"


def test_prompt_prefilled_once_and_pages_returned(parts, prompts, monkeypatch):
    engine = FastEngine(*parts, max_num_seqs=3, page_size=16)
    prefilled = []
    original = engine.model.prefill

    def counting(tokens, positions, slots, tables, kv_len, kv, **kw):
        prefilled.append(int((slots >= engine.page_size).sum()))
        original(tokens, positions, slots, tables, kv_len, kv, **kw)

    monkeypatch.setattr(engine.model, "prefill", counting)
    free = engine.cache.free_pages
    out = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=6, seed=0))
    assert sum(prefilled) == sum(len(p) - 1 for p in prompts)  # not n times
    assert out.responses.shape[0] == 16
    assert engine.cache.free_pages == free == engine.cache.pages - 1


def test_release_and_reclaim_memory(parts, prompts):
    engine = FastEngine(*parts, max_num_seqs=4, page_size=16)
    params = SamplingParams(n=2, max_new_tokens=6, seed=1)
    before = engine.generate(prompts, params)
    engine.release_memory()
    assert engine.cache is None
    engine.reclaim_memory()
    assert engine.cache is not None and engine.cache.free_pages == engine.cache.pages - 1
    assert torch.equal(engine.generate(prompts, params).responses, before.responses)
    engine.release_memory()
    assert torch.equal(engine.generate(prompts, params).responses, before.responses)  # reclaims by itself


def test_release_with_weights_frees_the_copy_until_the_next_sync(tiny_model_dir, parts, prompts):
    model, tokenizer = load_causal_lm(tiny_model_dir, device="cpu"), parts[1]
    engine = FastEngine(model, tokenizer, max_num_seqs=4, page_size=16)
    params = SamplingParams(n=2, max_new_tokens=6, seed=1)
    before = engine.generate(prompts, params)
    engine.release_memory(weights=True)
    assert engine.cache is None and engine.model.released and engine.model.embed is None
    with pytest.raises(ArcherError, match="call sync_weights"):
        engine.generate(prompts, params)
    engine.sync_weights(policy_weights(model))
    assert torch.equal(engine.generate(prompts, params).responses, before.responses)


def test_sync_weights_copies_in_place(tiny_model_dir, parts, prompts):
    model, tokenizer = load_causal_lm(tiny_model_dir, device="cpu"), parts[1]
    engine = FastEngine(model, tokenizer, max_num_seqs=4, page_size=16)
    pointers = [engine.model.embed.data_ptr(), engine.model.layers[0].qkv_w.data_ptr()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    params = SamplingParams(do_sample=False, max_new_tokens=10)
    engine.sync_weights(policy_weights(model))
    assert [engine.model.embed.data_ptr(), engine.model.layers[0].qkv_w.data_ptr()] == pointers
    assert torch.equal(engine.generate(prompts, params).responses,
                       HFGenerateEngine(model, tokenizer).generate(prompts, params).responses)
    with pytest.raises(ArcherError, match=r"the fast engine's model.embed_tokens.weight is \(\d+, \d+\), the weight "
                       r"given is \(\d+, 64\)"):  # every tensor checked by name and shape
        engine.sync_weights(policy_weights(_tiny(Qwen2ForCausalLM, Qwen2Config, len(tokenizer), hidden_size=64)))
    with pytest.raises(ArcherError, match="has no place for the weight 'extra'"):
        engine.sync_weights([("extra", torch.zeros(1))])
    with pytest.raises(ArcherError, match="lack"):
        engine.sync_weights(list(policy_weights(model))[:-1])


def test_session_turns_fork_and_release(engine, parts, prompts):
    model, tokenizer = parts
    greedy = SamplingParams(do_sample=False, max_new_tokens=8)
    session = engine.session()
    a, b = session.add(prompts[0], seed=1), session.add(prompts[2], seed=2)
    segments = session.decode([a, b], greedy, [5, 8])
    reference = engine.generate([prompts[0], prompts[2]], greedy)
    assert segments[0].tokens == reference.responses[0, :5].tolist() and segments[0].finish_reason == "length"
    assert segments[1].tokens == reference.responses[1].tolist()
    torch.testing.assert_close(segments[1].log_probs, reference.log_probs[1], atol=1e-5, rtol=0)
    assert session.tokens(a) == prompts[0] + segments[0].tokens

    tool = tokenizer("<answer>42</answer>")["input_ids"]
    session.extend(a, tool)
    second = session.decode([a], greedy, [6])[0]
    whole = prompts[0] + segments[0].tokens + tool
    assert second.tokens == engine.generate([whole], SamplingParams(do_sample=False, max_new_tokens=6)).responses[0].tolist()

    sampled = SamplingParams(max_new_tokens=7)
    child = session.fork(a, seed=9)
    copy = session.add(session.tokens(a), seed=9)  # the same tokens prefilled from scratch
    one, two, parent = session.decode([child, copy, a], sampled, [7, 7, 7])
    assert one.tokens == two.tokens and one.tokens != parent.tokens
    torch.testing.assert_close(one.log_probs, two.log_probs, atol=1e-5, rtol=0)
    assert session.tokens(a) == whole + second.tokens + parent.tokens
    ids, mask, pos = (torch.tensor([session.tokens(child)]), torch.ones(1, len(session.tokens(child)), dtype=torch.long),
                      torch.arange(len(session.tokens(child))).unsqueeze(0))
    with torch.no_grad():
        logp, _ = response_logprobs(model, ids, mask, pos, len(one.tokens))
    torch.testing.assert_close(one.log_probs, logp[0], atol=1e-4, rtol=0)

    for seq in (a, b, child, copy):
        session.release(seq)
    assert engine.cache.free_pages == engine.cache.pages - 1
    with pytest.raises(ArcherError, match="not in this session"):
        session.tokens(a)


def test_a_sessions_running_batch_takes_turns_as_they_come(parts, prompts):
    """submit / poll: a turn submitted while others decode, and one released mid-turn; each sequence gets the
    tokens it gets alone, forks waiting for their parent's prefill share it (prefilled once), and every page
    comes back."""
    engine = FastEngine(*parts, max_num_seqs=8, page_size=16, window=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=64)

    def alone(prompt: list[int], seed: int) -> list[int]:
        session = engine.session()
        seq = session.add(prompt, seed)
        tokens = session.decode([seq], params, [20])[0].tokens
        session.release(seq)
        return tokens

    expected = [alone(p, seed) for seed, p in enumerate(prompts[:3])]
    session = engine.session()
    root = session.add(prompts[0], seed=99)
    a = session.fork(root, seed=0)  # waits for the root's prefill (at the next poll)
    b, c = session.add(prompts[1], seed=1), session.add(prompts[2], seed=2)
    prefilled = engine.scheduler.counters.prefilled
    session.submit(a, params, 20)
    session.submit(b, params, 20)
    assert session.poll() == [] and session.busy  # 4 of 20 steps
    session.submit(c, params, 20)  # joins the running batch
    session.release(b)  # leaves it mid-turn
    ended = {}
    while session.busy:
        ended.update(session.poll())
    assert set(ended) == {a, c}
    assert ended[a].tokens == expected[0] and ended[c].tokens == expected[2]
    assert session.tokens(a) == prompts[0] + expected[0]
    assert engine.scheduler.counters.prefilled - prefilled == sum(len(p) - 1 for p in prompts[:3])
    for seq in (root, a, c):
        session.release(seq)
    assert engine.cache.free_pages == engine.cache.pages - 1
    with pytest.raises(ArcherError, match="different parameters"):
        session.submit(session.add(prompts[0], 0), SamplingParams(do_sample=False), 4)


def test_session_stop_and_weight_sync_recompute(engine, parts, prompts):
    tokenizer = parts[1]
    session = engine.session()
    seq = session.add(prompts[3], seed=0)
    full = session.decode([seq], SamplingParams(max_new_tokens=12, seed=0), [12])[0]
    session.release(seq)
    seq = session.add(prompts[3], seed=0)
    stop = tokenizer.decode(full.tokens[4:6])
    cut = next(j for j in range(len(full.tokens)) if stop in tokenizer.decode(full.tokens[: j + 1]))
    segment = session.decode([seq], SamplingParams(max_new_tokens=12, stop=(stop,)), [12])[0]
    assert segment.finish_reason == "stop" and segment.tokens == full.tokens[: cut + 1]
    engine.sync_weights(policy_weights(parts[0]))  # same weights: the dropped keys/values are recomputed identically
    engine.release_memory()
    after = session.decode([seq], SamplingParams(do_sample=False, max_new_tokens=5), [5])[0]
    expected = engine.generate([session.tokens(seq)[: -len(after.tokens)]], SamplingParams(do_sample=False,
                                                                                            max_new_tokens=5))
    assert after.tokens == expected.responses[0].tolist()
    session.release(seq)


def _tiny(model_cls, config_cls, vocab: int, **extra):
    sizes = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    return model_cls(config_cls(**(sizes | extra))).eval()


@pytest.mark.parametrize("build", [
    lambda v: _tiny(Qwen3ForCausalLM, Qwen3Config, v, head_dim=16),
    lambda v: _tiny(LlamaForCausalLM, LlamaConfig, v, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 10000.0}),
], ids=["qwen3", "llama-linear-rope"])
def test_other_family_members(parts, prompts, build):
    tokenizer = parts[1]
    model = build(len(tokenizer))
    params = SamplingParams(n=2, do_sample=False, max_new_tokens=10)
    fast = FastEngine(model, tokenizer, max_num_seqs=4, page_size=16).generate(prompts, params)
    assert torch.equal(fast.responses, HFGenerateEngine(model, tokenizer).generate(prompts, params).responses)
    logp, entropy = _training_pass(model, tokenizer, prompts, fast, 1.0)
    torch.testing.assert_close(fast.log_probs, logp, atol=1e-4, rtol=0)
    torch.testing.assert_close(fast.entropies, entropy, atol=1e-4, rtol=0)


def test_unsupported_models_name_the_hf_engine(parts):
    tokenizer = parts[1]
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ArcherError, match="GPT2LMHeadModel") as err:
        FastEngine(gpt2, tokenizer)
    assert "rollout.name=hf" in str(err.value)
    chunked = _tiny(Qwen2ForCausalLM, Qwen2Config, len(tokenizer), use_sliding_window=True, sliding_window=16,
                    max_window_layers=0)
    chunked.config.layer_types = ["chunked_attention", "full_attention"]  # windows of another kind than sliding
    with pytest.raises(ArcherError, match="chunked_attention"):
        FastEngine(chunked, tokenizer)


def test_lengths_limits_and_bad_input(parts, prompts):
    engine = FastEngine(*parts, max_num_seqs=2, page_size=16, max_model_len=30)
    out = engine.generate([prompts[2]], SamplingParams(do_sample=False, max_new_tokens=50))
    assert out.finish_reasons == ["length"]
    assert out.response_mask.sum() == 30 - len(prompts[2]) + 1
    with pytest.raises(ArcherError, match="longer than rollout.max_model_len=30"):
        engine.generate([list(range(31))], SamplingParams(max_new_tokens=2))
    with pytest.raises(ArcherError, match="prompt 1 is empty"):
        engine.generate([[5], []], SamplingParams(max_new_tokens=2))
    with pytest.raises(ArcherError, match="gpu_memory_utilization=0"):
        FastEngine(*parts, gpu_memory_utilization=0)
    empty = engine.generate([], SamplingParams())
    assert empty.responses.shape == (0, 0) and empty.finish_reasons == []


def test_from_config_reads_verl_keys(parts):
    rollout = OmegaConf.create({"gpu_memory_utilization": 0.3, "max_num_seqs": 6, "max_num_batched_tokens": 64,
                                "max_model_len": None, "prompt_length": 40, "response_length": 24,
                                "enforce_eager": True, "dtype": "bfloat16"})
    engine = FastEngine.from_config(*parts, rollout, device="cpu")
    assert (engine.utilization, engine.max_num_seqs, engine.max_num_batched_tokens) == (0.3, 6, 64)
    assert engine.max_model_len == 64 and engine.dtype == torch.float32 and engine.runner.slots == 6
    assert engine.cache.pages == 7 * 2 + 1  # every slot (and one prompt) at max_model_len in 32-token pages, + trash


def test_finished_rows_return_their_pages_at_once(parts, prompts):
    # two slots and pages for three rows at most: twelve rows only fit if each frees its pages when it ends
    engine = FastEngine(*parts, max_num_seqs=2, page_size=16, max_model_len=48)
    assert engine.cache.pages == 3 * 3 + 1
    params = SamplingParams(n=3, max_new_tokens=20, seed=6)
    out = engine.generate(prompts, params)
    wide = FastEngine(*parts, max_num_seqs=16, page_size=16, max_model_len=48).generate(prompts, params)
    assert torch.equal(out.responses, wide.responses)
    assert engine.cache.free_pages == engine.cache.pages - 1


def test_every_row_starts_in_the_first_window_when_parents_and_forks_pass_the_page_cap(parts) -> None:
    """The cache holds (max_num_seqs + 1) x blocks pages, but a prompt's parent keeps its pages until its forks
    start: with n = 1 the first admission fits one row fewer, and the next (after the forks free their parents)
    starts it in the same window, so 8 rows of 48 tokens take 3 windows of 16 steps, not 4."""
    model, tokenizer = parts
    engine = FastEngine(model, tokenizer, max_num_seqs=8, max_model_len=64 + 48, max_num_batched_tokens=1024)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size - 8, (8, 64), generator=generator).tolist()
    before = engine.scheduler.counters.steps
    out = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=48, seed=0))
    assert int(out.response_mask.sum(1).max()) == 48  # a row ran to the limit: 48 steps at least
    assert engine.scheduler.counters.steps - before == 48


def test_after_new_weights_forks_share_their_prompt_and_branch_point_again(parts, prompts):
    """A root, two samples forked from it and a branch forked from one sample mid-way, each decoded, then the cache
    dropped (weights synced): decoding again prefills the prompt once for all three and the branch's shared part
    once (from its parent, which decodes in the same poll), and every sequence continues exactly as a copy
    prefilled alone would."""
    engine = FastEngine(*parts, max_num_seqs=8, page_size=16)
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    session = engine.session()
    prompt = (prompts[0] + prompts[2]) * 3  # a few pages
    root = session.add(prompt, seed=0)
    a, b = session.fork(root, seed=1), session.fork(root, seed=2)
    session.decode([a, b], params, [6, 6])
    branch = session.fork(a, seed=3)  # shares the prompt and a's first turn
    session.decode([a, branch], params, [5, 5])
    session.release(b)  # b's lineage goes; the others keep theirs
    b = session.fork(root, seed=4)
    engine.sync_weights(policy_weights(parts[0]))  # the same weights: keys and values dropped, recomputed alike
    copies = {seq: session.add(session.tokens(seq), seed=seed) for seq, seed in ((a, 1), (b, 4), (branch, 3))}
    before = engine.scheduler.counters.prefilled
    shared = session.decode([a, b, branch], params, [4, 4, 4])
    prefilled = engine.scheduler.counters.prefilled - before
    length = {seq: len(session.tokens(seq)) - len(segment.tokens)
              for seq, segment in zip((a, b, branch), shared, strict=True)}
    branch_point = length[a] - 5  # a had its second turn after the branch was forked
    # the prompt once (root, not decoding), a's first turn once (a decodes now), the branch's own turn, b nothing
    assert prefilled == (len(prompt) - 1) + (length[a] - len(prompt)) + (length[branch] - branch_point)
    assert [len(session.tokens(s)) for s in (a, branch)] == [length[a] + 4, length[branch] + 4]
    alone = session.decode(list(copies.values()), params, [4, 4, 4])
    for one, two in zip(shared, alone, strict=True):
        assert one.tokens == two.tokens
        torch.testing.assert_close(one.log_probs, two.log_probs, atol=1e-5, rtol=0)
    for seq in (root, a, b, branch, *copies.values()):
        session.release(seq)
    assert engine.cache.free_pages == engine.cache.pages - 1


def test_restart_peak_counts_the_largest_batch_from_then_on(engine, parts, prompts):
    params = SamplingParams(do_sample=False, max_new_tokens=4)
    fast = engine.session()
    rounds = RoundSession(HFGenerateEngine(*parts).session())
    def turn(session, seqs):  # submit and poll, as the tool loop runs them
        for seq in seqs:
            session.submit(seq, params, 4)
        while session.busy:
            session.poll()

    for session in (fast, rounds):
        seqs = [session.add(p, seed=i) for i, p in enumerate(prompts[:3])]
        turn(session, seqs)
        assert session.counters().peak == 3
        session.restart_peak()
        assert session.counters().peak == 0
        turn(session, seqs[:1])
        assert session.counters().peak == 1 and session.counters().tokens == 16  # the totals keep counting
        for seq in seqs:
            session.release(seq)


def test_after_new_weights_a_branch_of_an_idle_branch_point_shares_past_it(parts, prompts):
    """ARPO keeps a branch point (a fork that never decodes) and forks branches from it: after the cache is dropped a
    branch shares from the point's parent, which decodes in the same poll, not from the point (whose prefill would
    start at its first token)."""
    engine = FastEngine(*parts, max_num_seqs=8, page_size=16)
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    session = engine.session()
    prompt = (prompts[0] + prompts[2]) * 3
    root = session.add(prompt, seed=0)
    a = session.fork(root, seed=1)
    session.decode([a], params, [6])
    session.extend(a, parts[1]("<answer>42</answer>")["input_ids"])  # a tool answer
    point = session.fork(a, seed=0)
    branch = session.fork(point, seed=2)
    session.decode([a, branch], params, [5, 5])
    engine.sync_weights(policy_weights(parts[0]))
    before = engine.scheduler.counters.prefilled
    shared = session.decode([a, branch], params, [3, 3])
    prefilled = engine.scheduler.counters.prefilled - before
    a_len, branch_len = (len(session.tokens(s)) - 3 for s in (a, branch))
    point_len = len(session.tokens(point))
    # the prompt (root), a's own tokens after it, the branch's own after the point: each once
    assert prefilled == (len(prompt) - 1) + (a_len - len(prompt)) + (branch_len - point_len)
    copies = [session.add(session.tokens(s)[:-3], seed=seed) for s, seed in ((a, 1), (branch, 2))]
    for one, two in zip(shared, session.decode(copies, params, [3, 3]), strict=True):
        assert one.tokens == two.tokens
        torch.testing.assert_close(one.log_probs, two.log_probs, atol=1e-5, rtol=0)
    for seq in (root, a, point, branch, *copies):
        session.release(seq)
    assert engine.cache.free_pages == engine.cache.pages - 1


def test_an_untied_lm_head_sharded_by_fsdp_is_not_taken_for_tied(tmp_path) -> None:
    """A DTensor's data_ptr is 0, so two sharded weights looked like one storage: an untied policy on several
    ranks (Qwen2.5-7B's shape, or an MoE) failed with "no place for the weight 'lm_head.weight'". One gloo rank
    shards a tiny untied Qwen2 and a tied one."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from archer.rollout.fast.model import model_spec

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        specs = {}
        for tied in (False, True):
            config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
            model = Qwen2ForCausalLM(config)
            fully_shard(model)
            assert type(model.lm_head.weight).__name__ == "DTensor"
            specs[tied] = model_spec(model).tied
    finally:
        dist.destroy_process_group()
    assert specs == {False: False, True: True}
