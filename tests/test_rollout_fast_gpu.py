"""FastEngine on a CUDA GPU (Triton kernels, CUDA graphs): the CPU tests' guarantees where the fast paths run.
Skipped without a GPU; run on the device machine."""

from __future__ import annotations

import pytest
import torch
from test_rollout_hf_engine import _full_sequences
from transformers import Qwen2Config, Qwen2ForCausalLM

from archer.models.loading import load_tokenizer
from archer.models.logprobs import response_logprobs
from archer.models.lora import policy_weights
from archer.rollout.base import SamplingParams
from archer.rollout.fast import FastEngine, ops
from archer.rollout.hf_engine import HFGenerateEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or ops.kernels is None,
                                reason="needs a CUDA GPU and Triton")

TEXTS = ["what is 3 + 5?", "hi", "The quick brown fox jumps", "<python>print(2 ** 10)</python> and"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _model(tokenizer, dtype=torch.float32):
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=256, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return Qwen2ForCausalLM(config).to(dtype).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def _training_pass(model, tokenizer, prompts, out, temperature):
    ids, mask, positions = (t.cuda() for t in _full_sequences(prompts, out, tokenizer.pad_token_id))
    with torch.no_grad():
        logp, entropy = response_logprobs(model, ids, mask, positions, out.responses.shape[1],
                                          temperature=temperature)
    return logp.cpu(), entropy.cpu()


def test_graphs_match_hf_and_the_training_pass(tokenizer, prompts):
    model = _model(tokenizer)
    engine = FastEngine(model, tokenizer, dtype=torch.float32, max_num_seqs=16, page_size=16)
    assert engine.runner.use_graphs
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=40)
    fast, hf = engine.generate(prompts, greedy), HFGenerateEngine(model, tokenizer).generate(prompts, greedy)
    assert torch.equal(fast.responses, hf.responses)
    torch.testing.assert_close(fast.log_probs, hf.log_probs, atol=1e-4, rtol=0)
    for params in (SamplingParams(n=3, temperature=0.8, top_k=30, top_p=0.9, max_new_tokens=30, seed=3),
                   SamplingParams(n=3, temperature=1.2, max_new_tokens=30, seed=4)):
        out = engine.generate(prompts, params)
        logp, entropy = _training_pass(model, tokenizer, prompts, out, params.temperature)
        torch.testing.assert_close(out.log_probs, logp, atol=1e-4, rtol=0)
        torch.testing.assert_close(out.entropies, entropy, atol=1e-4, rtol=0)
        # a row's tokens do not depend on its neighbours, its slot or whether graphs run
        for other in (FastEngine(model, tokenizer, dtype=torch.float32, max_num_seqs=2, page_size=16, window=5),
                      FastEngine(model, tokenizer, dtype=torch.float32, max_num_seqs=16, page_size=16,
                                 enforce_eager=True)):
            assert torch.equal(other.generate(prompts, params).responses, out.responses)


def test_more_graph_buckets_than_window_columns(tokenizer, prompts):
    """Capturing runs each bucket once eagerly, and each run writes one window column: 64 slots give 9 buckets,
    more than a window of 4 columns, which once wrote out of bounds (a device-side assert)."""
    model = _model(tokenizer)
    params = SamplingParams(n=2, max_new_tokens=12, seed=2)
    engine = FastEngine(model, tokenizer, dtype=torch.float32, max_num_seqs=64, page_size=16, window=4)
    assert len(engine.runner.buckets) > engine.runner.window
    eager = FastEngine(model, tokenizer, dtype=torch.float32, max_num_seqs=64, page_size=16, window=4,
                       enforce_eager=True)
    assert torch.equal(engine.generate(prompts, params).responses, eager.generate(prompts, params).responses)


def test_memory_release_weight_sync_and_sessions(tokenizer, prompts):
    model = _model(tokenizer)
    engine = FastEngine(model, tokenizer, dtype=torch.float32, max_num_seqs=8, page_size=16)
    params = SamplingParams(n=2, max_new_tokens=20, seed=1)
    before = engine.generate(prompts, params)
    engine.release_memory()
    assert engine.cache is None and not engine.runner.graphs
    allocated = torch.cuda.memory_allocated()
    engine.reclaim_memory()
    assert torch.cuda.memory_allocated() > allocated
    assert torch.equal(engine.generate(prompts, params).responses, before.responses)

    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.sync_weights(policy_weights(model))
    greedy = SamplingParams(do_sample=False, max_new_tokens=20)
    assert torch.equal(engine.generate(prompts, greedy).responses,
                       HFGenerateEngine(model, tokenizer).generate(prompts, greedy).responses)

    session = engine.session()
    a = session.add(prompts[0], seed=1)
    session.decode([a], greedy, [6])
    session.extend(a, prompts[1])
    child, copy = session.fork(a, seed=5), session.add(session.tokens(a), seed=5)
    one, two = session.decode([child, copy], SamplingParams(max_new_tokens=12), [12, 12])
    assert one.tokens == two.tokens
    for seq in (a, child, copy):
        session.release(seq)
    assert engine.cache.free_pages == engine.cache.pages - 1


def test_bfloat16_log_probs_near_the_training_pass(tokenizer, prompts):
    model = _model(tokenizer, torch.bfloat16)
    out = FastEngine(model, tokenizer, max_num_seqs=8).generate(prompts, SamplingParams(n=2, max_new_tokens=30,
                                                                                        seed=2))
    logp, _ = _training_pass(model, tokenizer, prompts, out, 1.0)
    diff = (out.log_probs - logp.float())[out.response_mask.bool()].abs()
    assert diff.mean() < 5e-2


def test_an_engine_built_from_a_model_on_the_host_generates_as_one_built_on_the_gpu(tokenizer, prompts):
    """separate_async's rollout ranks read the policy on the host and build the engine's copy on the card."""
    on_gpu = _model(tokenizer)
    on_host = _model(tokenizer).cpu()
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=24)
    want = FastEngine(on_gpu, tokenizer, dtype=torch.float32, max_num_seqs=8, page_size=16).generate(prompts, greedy)
    engine = FastEngine(on_host, tokenizer, device=torch.device("cuda"), dtype=torch.float32, max_num_seqs=8,
                        page_size=16)
    assert engine.model.embed.is_cuda and engine.model.rope[0][0].is_cuda
    got = engine.generate(prompts, greedy)
    assert torch.equal(got.responses, want.responses)
    torch.testing.assert_close(got.log_probs, want.log_probs, atol=1e-5, rtol=0)
