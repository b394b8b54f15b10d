"""Sliding-window models in the fast engine and in packed attention (CPU, float32), on small random models whose
windows (3 to 5 keys) are much shorter than their sequences: Mistral (every layer windowed), Qwen2 with
``use_sliding_window`` / ``max_window_layers``, Qwen3 with ``layer_types``, Gemma 3 (local and global layers, each
kind with its RoPE theta, soft-capped logits). The engine's greedy tokens equal the HF engine's and its log-probs
and entropies the training pass's (they do not without the windows); the windowed decode attention against a
hand computation (and the Triton kernel against it where Triton runs); packed log-probs, entropies and gradients
equal transformers' own padded forward; two GRPO steps of a windowed Mistral through the fast engine, trained
packed."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from test_moe import _moe_run
from test_rollout_fast_engine import TEXTS, _training_pass
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from archer.errors import ArcherError
from archer.models.loading import load_causal_lm
from archer.models.logprobs import layout_logprobs
from archer.models.packed_attention import supports_packing
from archer.models.sequence_layout import SequenceLayout
from archer.rollout.base import SamplingParams
from archer.rollout.fast import FastEngine, ops
from archer.rollout.fast.model import model_spec, weight_bytes
from archer.rollout.hf_engine import HFGenerateEngine

SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def _randomised(model):
    """The model with random norm weights too (transformers starts them at 1, Gemma's at 0), so that every weight
    matters."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
    return model.eval()


def _mistral(vocab: int):
    torch.manual_seed(0)
    return _randomised(
        MistralForCausalLM(
            MistralConfig(
                vocab_size=vocab, num_hidden_layers=2, sliding_window=4, tie_word_embeddings=False, **SIZES
            )
        )
    )


def _qwen2(vocab: int):  # layers from max_window_layers on are windowed
    torch.manual_seed(0)
    return _randomised(
        Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=vocab,
                num_hidden_layers=3,
                use_sliding_window=True,
                sliding_window=5,
                max_window_layers=1,
                **SIZES,
            )
        )
    )


def _qwen3(vocab: int):
    torch.manual_seed(0)
    kinds = ["sliding_attention", "full_attention", "sliding_attention"]
    return _randomised(
        Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=vocab,
                num_hidden_layers=3,
                head_dim=16,
                use_sliding_window=True,
                sliding_window=3,
                layer_types=kinds,
                tie_word_embeddings=False,
                **SIZES,
            )
        )
    )


def _gemma3(vocab: int, softcap: float | None = None):
    torch.manual_seed(0)
    kinds = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    config = Gemma3TextConfig(
        vocab_size=vocab,
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=4,
        layer_types=kinds,
        query_pre_attn_scalar=12,
        rope_parameters=rope,
        final_logit_softcapping=softcap,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        **SIZES,
    )
    return _randomised(Gemma3ForCausalLM(config))


BUILDS = {
    "mistral": (_mistral, (4, 4)),
    "qwen2": (_qwen2, (0, 5, 5)),
    "qwen3": (_qwen3, (3, 0, 3)),
    "gemma3": (_gemma3, (4, 4, 0, 4)),
}
EACH = pytest.mark.parametrize("name", list(BUILDS))


@EACH
def test_each_layers_window_is_read_from_the_config(name):
    build, windows = BUILDS[name]
    model = build(64)
    spec = model_spec(model)
    assert spec.windows == windows and spec.layers == len(windows)
    assert weight_bytes(spec, torch.float32) == sum(p.numel() for p in model.parameters()) * 4
    if name == "gemma3":
        assert spec.gemma and spec.logit_softcap is None and spec.attention_scale == pytest.approx(12**-0.5)
        assert model_spec(_gemma3(64, softcap=2.0)).logit_softcap == 2.0
    plain = Qwen2Config(
        vocab_size=64, num_hidden_layers=2, sliding_window=4, **SIZES
    )  # Qwen2.5's: window off
    assert model_spec(Qwen2ForCausalLM(plain)).windows == ()


@EACH
def test_fast_engine_runs_windowed_models_like_transformers(parts, name):
    tokenizer = parts[1]
    model = BUILDS[name][0](len(tokenizer))
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert max(map(len, prompts)) > 8  # every prompt and answer longer than the windows (3 to 5)
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=16)
    engine = FastEngine(model, tokenizer, max_num_seqs=4, page_size=16)
    fast = engine.generate(prompts, greedy)
    assert torch.equal(fast.responses, HFGenerateEngine(model, tokenizer).generate(prompts, greedy).responses)
    params = SamplingParams(n=2, max_new_tokens=16, seed=3)
    sampled = engine.generate(prompts, params)
    for out in (fast, sampled):  # log-probs and entropies: the whole next-token distributions agree
        logp, entropy = _training_pass(model, tokenizer, prompts, out, 1.0)
        torch.testing.assert_close(out.log_probs, logp, atol=1e-4, rtol=0)
        torch.testing.assert_close(out.entropies, entropy, atol=1e-4, rtol=0)
    engine.model.windows = (0,) * len(engine.model.windows)  # the same engine attending to every key
    unwindowed = engine.generate(prompts, params)
    logp, _ = _training_pass(model, tokenizer, prompts, unwindowed, 1.0)
    assert (unwindowed.log_probs - logp).abs().max() > 1e-2


def test_session_turns_of_a_windowed_model_equal_a_fresh_prefill(parts):
    # the second turn's prefill attends to cached keys (not a fresh prompt): its window reaches into them
    tokenizer = parts[1]
    engine = FastEngine(_gemma3(len(tokenizer)), tokenizer, max_num_seqs=4, page_size=16)
    greedy = SamplingParams(do_sample=False, max_new_tokens=8)
    prompt, tool = tokenizer(TEXTS[2])["input_ids"], tokenizer("<answer>42</answer>")["input_ids"]
    session = engine.session()
    seq = session.add(prompt, seed=0)
    first = session.decode([seq], greedy, [8])[0]
    session.extend(seq, tool)
    second = session.decode([seq], greedy, [8])[0]
    whole = prompt + first.tokens + tool
    again = engine.generate([whole], greedy)
    assert second.tokens == again.responses[0].tolist()
    torch.testing.assert_close(second.log_probs, again.log_probs[0], atol=1e-5, rtol=0)
    session.release(seq)


@pytest.mark.parametrize("window", [1, 3, 16, 21, 100])
def test_windowed_decode_attention_reads_the_last_window_keys(window):
    gen = torch.Generator().manual_seed(2)
    page, heads, kv_heads, dim = 16, 4, 2, 8
    k_cache, v_cache = (torch.randn(8, kv_heads, page, dim, generator=gen) for _ in range(2))
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [2, 4, 6, 5]], dtype=torch.int32)
    ctx = torch.tensor([40, 1, 64])
    q = torch.randn(3, heads, dim, generator=gen)
    got = ops.decode_attention(q, k_cache, v_cache, tables, ctx, dim**-0.5, 1, window=window)
    for row in range(3):  # by hand: the row's keys in order, the last `window` of them
        keys = torch.cat([k_cache[p] for p in tables[row].tolist()], dim=1)[:, : int(ctx[row])]
        values = torch.cat([v_cache[p] for p in tables[row].tolist()], dim=1)[:, : int(ctx[row])]
        keys, values = keys[:, -window:].repeat_interleave(2, 0), values[:, -window:].repeat_interleave(2, 0)
        probs = torch.softmax(q[row].unsqueeze(1) @ keys.transpose(1, 2) * dim**-0.5, dim=-1)
        torch.testing.assert_close(got[row], (probs @ values).flatten(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 30])
@pytest.mark.parametrize("splits", [1, 4])
def test_windowed_decode_kernel_matches_torch(window, splits):
    kernels = pytest.importorskip("archer.rollout.fast.kernels", reason="Triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1)")
    torch.manual_seed(3)
    page, heads, kv_heads, dim = 16, 8, 2, 32
    k_cache, v_cache = (torch.randn(12, kv_heads, page, dim, device=device) for _ in range(2))
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [2, 4, 6, 8]], dtype=torch.int32, device=device)
    ctx = torch.tensor([40, 1, 64], device=device)
    q = torch.randn(3, heads, dim, device=device)
    for tile in (16, 64):
        got = kernels.decode_attention(
            q, k_cache, v_cache, tables, ctx, dim**-0.5, splits, tile, window=window
        )
        want = ops.paged_attention(
            q.unsqueeze(2),
            k_cache,
            v_cache,
            tables,
            (ctx - 1).unsqueeze(1),
            ctx,
            dim**-0.5,
            max_kv=64,
            window=window,
        ).squeeze(1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _long_batch(vocab: int) -> tuple[torch.Tensor, ...]:
    """Rows of prompts (3, 12, 9 tokens, left-padded to 12) and responses (8, 5, 8, right-padded to 8): up to 20
    tokens, several windows long."""
    prompts, responses = (3, 12, 9), (8, 5, 8)
    columns = torch.arange(20)
    attention = torch.stack(
        [(columns >= 12 - p) & (columns < 12 + r) for p, r in zip(prompts, responses, strict=True)]
    ).long()
    ids = torch.randint(3, vocab, (3, 20), generator=torch.Generator().manual_seed(7)) * attention
    return ids, attention, (attention.cumsum(1) - 1).clamp(min=0)


@EACH
def test_packed_passes_of_windowed_models_equal_transformers_padded_forward(name, tmp_path):
    reference = BUILDS[name][0](64).train()
    reference.save_pretrained(tmp_path / name)
    model = load_causal_lm(tmp_path / name, device="cpu", dtype=torch.float32).train()
    assert supports_packing(model)  # archer's attention, windows and all: its passes run packed
    rows = (*_long_batch(64), 8)
    weights = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    results = []
    for net, layout in (
        (reference, {"packed": False, "aligned": False}),
        (model, {"packed": True}),
        (model, {"packed": False}),
    ):
        net.zero_grad(set_to_none=True)
        logp, entropy = layout_logprobs(net, SequenceLayout.build(*rows, **layout), temperature=0.8)
        ((logp * weights).sum() + 0.3 * entropy.sum()).backward()
        results.append(
            (logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in net.named_parameters()})
        )
    (logp, entropy, grads), *others = results  # transformers' own masks and SDPA, padded, against archer's
    assert torch.all(logp[rows[1][:, 12:] == 1] < 0)
    for other_logp, other_entropy, other_grads in others:
        torch.testing.assert_close(other_logp, logp, atol=1e-5, rtol=0)
        torch.testing.assert_close(other_entropy, entropy, atol=1e-5, rtol=0)
        for param, grad in grads.items():
            torch.testing.assert_close(other_grads[param], grad, atol=1e-5, rtol=1e-4, msg=param)
    with torch.no_grad():  # the window matters here: without it the scores differ
        model.config.sliding_window = 10**6
        for layer in model.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = 10**6
        unwindowed, _ = layout_logprobs(model, SequenceLayout.build(*rows, packed=True))
    assert (
        unwindowed - layout_logprobs(reference, SequenceLayout.build(*rows, packed=False, aligned=False))[0]
    ).abs().max() > 1e-3


def test_a_windowed_architecture_packed_attention_does_not_know_runs_padded_with_a_warning(tmp_path, caplog):
    config = Gemma2Config(
        vocab_size=64,
        num_hidden_layers=2,
        head_dim=8,
        sliding_window=4,
        final_logit_softcapping=None,
        **SIZES,
    )
    assert config.attn_logit_softcapping is not None  # soft-capped scores: SDPA's path, not archer's
    Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    with caplog.at_level(logging.WARNING, logger="archer.models"):
        model = load_causal_lm(tmp_path / "gemma2", device="cpu", dtype=torch.float32)
    assert not supports_packing(model) and "windowed attention layers" in caplog.text
    with pytest.raises(ArcherError, match="gemma2"):
        model_spec(model)
    capped = _gemma3(64)
    capped.config.attn_logit_softcapping = 50.0
    with pytest.raises(ArcherError, match="attn_logit_softcapping"):
        model_spec(capped)


def test_grpo_trains_a_windowed_mistral_packed_through_the_fast_engine(
    micro_model, task_files, tmp_path, caplog
):
    """Two GRPO steps of a Mistral with a 4-key window (prompts of about 20 tokens): the fast engine samples, the
    actor trains packed (use_remove_padding); the engine's log-probs of its samples agree with the trainer's old
    log-probs (same weights, same windows), also at step 2, after the engine synced the updated weights."""
    from archer.trainer.ppo import PPOTrainer

    run, cfg = _moe_run(
        _mistral,
        micro_model,
        task_files,
        tmp_path,
        "actor_rollout_ref.model.use_remove_padding=true",
        "data.max_response_length=16",
    )
    with caplog.at_level(logging.WARNING, logger="archer.models"):
        PPOTrainer(cfg).fit()
    assert "run padded" not in caplog.text
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    assert all(m["rollout_corr/log_ppl_abs_diff"] < 1e-4 for m in metrics)


def test_softcapped_logits_are_the_engines_and_the_trainers(parts):
    # a Gemma 3 with its final logits soft-capped at 2.0: the engine's log-probs come from capped logits (within
    # (-2, 2)), and the training pass caps them too
    tokenizer = parts[1]
    model = _gemma3(len(tokenizer), softcap=2.0)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=8)
    engine = FastEngine(model, tokenizer, max_num_seqs=4, page_size=16)
    out = engine.generate(prompts, greedy)
    assert torch.equal(out.responses, HFGenerateEngine(model, tokenizer).generate(prompts, greedy).responses)
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]])).logits[0, -1]
    assert float(logits.abs().max()) < 2.0
    torch.testing.assert_close(out.log_probs[0, 0], F.log_softmax(logits, -1).max(), atol=1e-5, rtol=0)
    logp, entropy = _training_pass(model, tokenizer, prompts, out, 1.0)
    torch.testing.assert_close(out.log_probs, logp, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.entropies, entropy, atol=1e-4, rtol=0)
