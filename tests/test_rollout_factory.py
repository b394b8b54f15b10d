"""rollout.name picks the engine: auto (fast on a GPU for the architectures it runs, hf otherwise), fast, hf,
and verl's vllm/sglang as auto; an unknown name fails before any model loads. Training with the fast engine
on the CPU syncs its weights after every update, so each step's rollouts come from the updated policy."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from workers_support import ppo_config

from archer.config.loader import load_config
from archer.errors import ArcherError
from archer.models.loading import load_causal_lm, load_tokenizer
from archer.models.lora import policy_weights
from archer.rollout.base import SamplingParams
from archer.rollout.factory import _fast_engine_runs, build_engine, check_engine_name
from archer.rollout.fast import ops as fast_ops
from archer.rollout.fast.engine import FastEngine
from archer.rollout.hf_engine import HFGenerateEngine
from archer.trainer.ppo import PPOTrainer

CPU = torch.device("cpu")


@pytest.mark.parametrize(("name", "engine"), [("auto", HFGenerateEngine), ("hf", HFGenerateEngine),
                                              ("fast", FastEngine), ("vllm", HFGenerateEngine),
                                              ("sglang", HFGenerateEngine)])
def test_each_name_builds_its_engine_on_the_cpu(tiny_model_dir: Path, name: str, engine: type) -> None:
    rollout = ppo_config(tiny_model_dir, f"actor_rollout_ref.rollout.name={name}").actor_rollout_ref.rollout
    model, tokenizer = load_causal_lm(tiny_model_dir, device="cpu"), load_tokenizer(tiny_model_dir)
    check_engine_name(name)
    assert type(build_engine(rollout, model, tokenizer, CPU)) is engine


def test_a_standalone_hf_engine_holds_its_own_module_filled_by_the_stream(tiny_model_dir: Path) -> None:
    """build_engine(standalone=True) (a sharded policy's engine): the hf engine gets its own module, which the
    policy's weight stream fills; the default hf engine generates with the policy's module itself."""
    rollout = ppo_config(tiny_model_dir, "actor_rollout_ref.rollout.name=hf").actor_rollout_ref.rollout
    model, tokenizer = load_causal_lm(tiny_model_dir, device="cpu"), load_tokenizer(tiny_model_dir)
    assert build_engine(rollout, model, tokenizer, CPU).model is model
    engine = build_engine(rollout, model, tokenizer, CPU, standalone=True)
    assert isinstance(engine, HFGenerateEngine) and engine.model is not model
    assert engine.model.dtype == torch.float32  # rollout.dtype applies on a GPU only
    engine.sync_weights(policy_weights(model))
    own = dict(engine.model.named_parameters())
    assert all(torch.equal(own[name], tensor) for name, tensor in policy_weights(model))


def test_auto_picks_the_fast_engine_on_a_gpu_only_for_what_it_runs(
        tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_ops, "kernels", None)  # the architecture alone (head sizes: the next test)
    qwen2 = load_causal_lm(tiny_model_dir, device="cpu")
    assert _fast_engine_runs(qwen2, torch.device("cuda"))
    assert not _fast_engine_runs(qwen2, CPU)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with caplog.at_level(logging.WARNING, logger="archer.rollout"):
        assert not _fast_engine_runs(gpt2, torch.device("cuda"))
    assert "generating with the hf engine, because the fast rollout engine does not support GPT2LMHeadModel" in caplog.text


def test_auto_falls_back_to_hf_for_a_head_size_the_gpu_kernels_do_not_run(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_ops, "kernels", object())  # as on a GPU machine with Triton
    odd = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=40, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=2, intermediate_size=64))
    with caplog.at_level(logging.WARNING, logger="archer.rollout"):
        assert not _fast_engine_runs(odd, torch.device("cuda"))
    assert "head_dim=20 on a GPU" in caplog.text
    even = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=2, intermediate_size=64))
    assert _fast_engine_runs(even, torch.device("cuda"))  # head_dim 16
    monkeypatch.setattr(fast_ops, "kernels", None)  # without Triton the torch path runs any head size
    assert _fast_engine_runs(odd, torch.device("cuda"))


def test_an_unknown_engine_is_refused_before_any_model_loads(tmp_path: Path) -> None:
    with pytest.raises(ArcherError, match="unknown rollout engine 'vllm2'") as err:
        check_engine_name("vllm2")
    assert "auto, fast, hf" in str(err.value)


def test_grpo_with_the_fast_engine_generates_from_the_updated_weights(micro_model: Path, task_files: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = load_config("ppo_trainer", [
        f"actor_rollout_ref.model.path={micro_model}", f"data.train_files={task_files['train']}",
        "data.max_prompt_length=32", "data.max_response_length=12", "trainer.device=cpu",
        f"trainer.default_local_dir={run}", "actor_rollout_ref.rollout.name=fast", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.total_training_steps=2", "trainer.logger=[jsonl]",
        "trainer.plots=False"])
    trainer = PPOTrainer(cfg)
    engine = trainer.workers.worker.actor.rollout.engine
    assert isinstance(engine, FastEngine)
    synced = []
    original = engine.sync_weights
    engine.sync_weights = lambda weights: (synced.append(True), original(weights))[1]
    trainer.fit()
    assert synced == [True]  # before step 2's rollout, after step 1's update (none after the last)
    # the engine's copy now holds the actor's updated weights: its greedy tokens and log-probs are the actor's
    prompts = [trainer.tokenizer("Compute 3+4.")["input_ids"]]
    engine.sync_weights(policy_weights(trainer.workers.worker.actor.model))
    greedy = SamplingParams(do_sample=False, max_new_tokens=6)
    fast = engine.generate(prompts, greedy)
    hf = HFGenerateEngine(trainer.workers.worker.actor.model, trainer.tokenizer).generate(prompts, greedy)
    assert fast.responses.tolist() == hf.responses.tolist()
    assert math.isclose(float(fast.log_probs.sum()), float(hf.log_probs.sum()), abs_tol=1e-3)
