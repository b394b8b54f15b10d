"""MoE (Qwen3-MoE, OLMoE): archer's grouped expert kernel against a hand loop and transformers' own modules, and the
fast engine on small random MoE models against the HF engine and the training log-prob pass (CPU, float32)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from test_rollout_fast_engine import TEXTS, _training_pass
from transformers import OlmoeConfig, OlmoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from archer.models.moe import grouped_experts, route, use_grouped_experts
from archer.rollout.base import SamplingParams
from archer.rollout.fast import FastEngine
from archer.rollout.fast.model import model_spec, weight_bytes
from archer.rollout.hf_engine import HFGenerateEngine


def _hand_moe(x, ids, weights, gate_up, down):
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = (gate_up[ids[n, j]] @ x[n]).chunk(2)
            out[n] += weights[n, j] * (down[ids[n, j]] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("inter", [8, 6], ids=["grouped_mm", "bmm-fallback"])  # 6 floats: strides not 16-byte
def test_grouped_experts_equal_a_hand_loop(inter):
    torch.manual_seed(0)
    x = torch.randn(9, 16, requires_grad=True)
    gate_up, down = torch.randn(4, 2 * inter, 16, requires_grad=True), torch.randn(4, 16, inter, requires_grad=True)
    logits = torch.randn(9, 4)
    logits[:, 3] = -30  # expert 3 gets no token: an empty group
    weights, ids = route(logits, 2, normalise=True)
    assert torch.allclose(weights.sum(-1), torch.ones(9)) and not bool((ids == 3).any())
    got = grouped_experts(x, ids, weights, gate_up, down)
    want = _hand_moe(x, ids, weights, gate_up, down)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    grads = torch.autograd.grad(got.square().sum(), (x, gate_up, down))
    for g, w in zip(grads, torch.autograd.grad(want.square().sum(), (x, gate_up, down)), strict=True):
        torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-4)


def test_route_follows_norm_topk_prob():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    weights, ids = route(logits, 2, normalise=False)
    assert ids.tolist() == [[0, 1]] and torch.allclose(weights, torch.tensor([[0.5, 0.3]]))
    weights, _ = route(logits, 2, normalise=True)
    assert torch.allclose(weights, torch.tensor([[0.625, 0.375]]))


def _qwen3_moe(vocab: int):
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                            max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(config).eval()


def _olmoe(vocab: int):
    torch.manual_seed(0)
    config = OlmoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
                         clip_qkv=2.0, max_position_embeddings=128, pad_token_id=0, eos_token_id=1)
    return OlmoeForCausalLM(config).eval()


BUILDS = pytest.mark.parametrize("build", [_qwen3_moe, _olmoe], ids=["qwen3_moe", "olmoe"])


@BUILDS
def test_trainer_experts_match_transformers(build):
    reference = build(64)
    model = copy.deepcopy(reference)
    assert use_grouped_experts(model) == sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)
    model(ids).logits.square().mean().backward()
    reference(ids).logits.square().mean().backward()
    name = "model.layers.0.mlp.experts.gate_up_proj"
    got, want = dict(model.named_parameters())[name].grad, dict(reference.named_parameters())[name].grad
    assert want.abs().sum() > 0
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


@BUILDS
def test_fast_engine_runs_moe_like_transformers(parts, build):
    tokenizer = parts[1]
    model = build(len(tokenizer))
    spec = model_spec(model)
    sparse = (True, False, True) if build is _qwen3_moe else (True, True)  # Qwen3-MoE's mlp_only_layers=[1]
    assert spec.experts == 8 and spec.sparse_layers == sparse
    assert weight_bytes(spec, torch.float32) == sum(p.numel() for p in model.parameters()) * 4
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    params = SamplingParams(n=2, do_sample=False, max_new_tokens=10)
    fast = FastEngine(model, tokenizer, max_num_seqs=4, page_size=16).generate(prompts, params)
    assert torch.equal(fast.responses, HFGenerateEngine(model, tokenizer).generate(prompts, params).responses)
    logp, entropy = _training_pass(model, tokenizer, prompts, fast, 1.0)
    torch.testing.assert_close(fast.log_probs, logp, atol=1e-4, rtol=0)
    torch.testing.assert_close(fast.entropies, entropy, atol=1e-4, rtol=0)


def _moe_run(build, micro_model, task_files, tmp_path, *extra: str, **config_changes):
    from test_lora import DIGIT_REWARD

    from archer.config.loader import load_config
    from archer.models.loading import load_tokenizer, save_hf

    tokenizer = load_tokenizer(micro_model)
    model = build(len(tokenizer))
    for key, value in config_changes.items():
        setattr(model.config, key, value)
    folder = save_hf(model, tokenizer, tmp_path / "moe_model")
    reward = tmp_path / "digit_reward.py"
    reward.write_text(DIGIT_REWARD)
    run = tmp_path / "run"
    return run, load_config("ppo_trainer", [
        f"actor_rollout_ref.model.path={folder}", f"custom_reward_function.path={reward}",
        f"data.train_files={task_files['train']}", "data.max_prompt_length=32", "data.max_response_length=8",
        "trainer.device=cpu", f"trainer.default_local_dir={run}", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.name=fast", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.logger=[jsonl]", "trainer.plots=false",
        "trainer.val_before_train=false", *extra])


@pytest.mark.parametrize("build, lora", [(_qwen3_moe, False), (_olmoe, False), (_olmoe, True)],
                         ids=["qwen3_moe", "olmoe", "olmoe-lora"])
def test_grpo_trains_a_moe_model_through_the_fast_engine(build, lora, micro_model, task_files, tmp_path):
    """Two GRPO steps (the fast engine on the CPU; full fine-tuning, or LoRA on the attention projections): the
    update moves the weights, the engine's log-probs of its own samples agree with the trainer's old log-probs
    (same weights, same expert kernel), also at step 2, after the engine synced the updated (merged) weights."""
    from archer.trainer.ppo import PPOTrainer

    extra = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8") if lora else ()
    run, cfg = _moe_run(build, micro_model, task_files, tmp_path, *extra)
    PPOTrainer(cfg).fit()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    assert all(m["rollout_corr/log_ppl_abs_diff"] < 1e-4 for m in metrics)


def test_a_model_asking_for_the_router_loss_is_refused(micro_model, task_files, tmp_path):
    from archer.errors import ArcherError
    from archer.trainer.ppo import PPOTrainer

    _, cfg = _moe_run(_olmoe, micro_model, task_files, tmp_path, output_router_logits=True)
    with pytest.raises(ArcherError, match="router's auxiliary loss"):
        PPOTrainer(cfg).fit()


def test_memory_plan_counts_the_routed_experts_width():
    from archer.models.moe import token_intermediate

    qwen = Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts_per_tok=6)
    olmoe = OlmoeConfig(intermediate_size=16, num_experts_per_tok=3)
    assert (token_intermediate(qwen), token_intermediate(olmoe)) == (96, 48)
    assert token_intermediate(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16,
                                             num_experts_per_tok=2)) == 64


def test_bench_moe_smoke_runs_on_a_tiny_shape(tmp_path, monkeypatch):
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    sys.modules.pop("moe", None)
    import moe as bench_moe

    out = tmp_path / "moe.json"
    record = bench_moe.main(["--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                             "--experts", "4", "--top-k", "2", "--expert-intermediate", "32", "--vocab", "256",
                             "--prompts", "2", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1",
                             "--json", str(out)])
    assert json.loads(out.read_text()) == record and record["device"] == "cpu"
    assert all(record[k] > 0 for k in ("decode_tok_s/fast", "decode_tok_s/hf", "update_s/grouped",
                                       "update_s/transformers"))
