"""Sliding windows on a CUDA GPU, where the CPU tests cannot reach: torch's flash varlen kernel with a window behind
archer's packed attention against float32 SDPA with the banded mask, and the fast engine (Triton decode kernel,
CUDA graphs) on windowed Mistral and Gemma 3 models in float32 against the HF engine and the training pass. Skipped
without a GPU; run on the device machine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_rollout_hf_engine import _full_sequences
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

from archer.models.loading import load_tokenizer
from archer.models.logprobs import response_logprobs
from archer.models.packed_attention import packed_attention, uses_flash_varlen, window_mask
from archer.rollout.base import SamplingParams
from archer.rollout.fast import FastEngine, ops
from archer.rollout.hf_engine import HFGenerateEngine

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or ops.kernels is None, reason="needs a CUDA GPU and Triton"
)
CUDA = torch.device("cuda")
TEXTS = [
    "what is 3 + 5?",
    "The quick brown fox jumps over the lazy dog",
    "<python>print(2 ** 10)</python> and",
]


@pytest.mark.parametrize("window", [1, 7, 64])
def test_flash_varlen_with_a_window_equals_banded_sdpa_per_sequence(window):
    lengths = [1, 300, 17, 64]
    gen = torch.Generator(device=CUDA).manual_seed(0)
    query, key, value = (
        torch.randn(1, h, sum(lengths), 64, device=CUDA, dtype=torch.bfloat16, generator=gen)
        for h in (8, 2, 2)
    )
    assert uses_flash_varlen(query, 64**-0.5)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    out, _ = packed_attention(
        None,
        query,
        key,
        value,
        None,
        scaling=64**-0.5,
        cu_seq_lens_q=cu,
        max_length_q=300,
        sliding_window=window,
    )
    want, start = [], 0
    for length in lengths:
        part = slice(start, start + length)
        want.append(
            F.scaled_dot_product_attention(
                query[:, :, part].float(),
                key[:, :, part].float().repeat_interleave(4, 1),
                value[:, :, part].float().repeat_interleave(4, 1),
                attn_mask=window_mask(length, window, CUDA),
            ).transpose(1, 2)
        )
        start += length
    torch.testing.assert_close(out.float(), torch.cat(want, dim=1), atol=2e-2, rtol=2e-2)


def _mistral(vocab: int):
    config = MistralConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=5,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return MistralForCausalLM(config).to(CUDA).eval()


def _gemma3(vocab: int):
    config = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=6,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model.to(CUDA).eval()


@pytest.mark.parametrize("build", [_mistral, _gemma3], ids=["mistral", "gemma3"])
def test_fast_engine_on_a_gpu_runs_windowed_models_like_transformers(tiny_model_dir, build):
    tokenizer = load_tokenizer(tiny_model_dir)
    model = build(len(tokenizer))
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=40)  # past two 16-token pages
    engine = FastEngine(model, tokenizer, dtype=torch.float32, max_num_seqs=8)
    fast = engine.generate(prompts, greedy)
    assert torch.equal(fast.responses, HFGenerateEngine(model, tokenizer).generate(prompts, greedy).responses)
    ids, mask, pos = (t.to(CUDA) for t in _full_sequences(prompts, fast, tokenizer.pad_token_id))
    with torch.no_grad():  # the training pass on the model's device (the engine's outputs are on the host)
        logp, entropy = (t.cpu() for t in response_logprobs(model, ids, mask, pos, fast.responses.shape[1]))
    torch.testing.assert_close(fast.log_probs, logp, atol=1e-3, rtol=0)
    torch.testing.assert_close(fast.entropies, entropy, atol=1e-3, rtol=0)
