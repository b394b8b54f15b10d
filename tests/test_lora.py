"""LoRA (actor_rollout_ref.model.lora_rank > 0, and model.lora_rank for SFT) on the micro model: an update moves
only the adapters; the reference is the base exactly; both engines generate what the merged model generates,
synced in place; the checkpoint holds the adapters beside an ordinary merged HF folder and resumes exactly;
influence hooks sit on the LoRA layers; `archer train` and `archer sft` run with LoRA end to end; bad LoRA
settings and mismatched checkpoints give one clear error."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from test_sft_trainer import _cfg as sft_cfg
from test_sft_trainer import _row
from test_workers_actor import make_actor, policy_batch, random_advantages
from transformers import AutoModelForCausalLM
from workers_support import float64_logprobs, hand_batch, ppo_config, update

from archer.batch import Batch
from archer.config.loader import load_config
from archer.data.sft_dataset import SFTDataset
from archer.data.sft_formats import RowFormat
from archer.errors import ArcherError
from archer.models import owner as owner_module
from archer.models.loading import load_causal_lm, load_tokenizer
from archer.models.lora import ADAPTER_DIR, LoraSettings, policy_weights
from archer.rollout.base import SamplingParams
from archer.rollout.fast.engine import FastEngine
from archer.rollout.hf_engine import HFGenerateEngine
from archer.trace.format import TraceReader
from archer.trace.influence_capture import CaptureSettings, TracedTokens, select_modules
from archer.trainer.ppo import PPOTrainer
from archer.trainer.sft import response_logprobs, run_sft
from archer.workers.generator import GenerationWorker
from archer.workers.reference import ReferenceWorker

CPU = torch.device("cpu")
LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.actor.optim.lr=0.01")
PROMPTS = [[11, 12, 13], [14, 15], [16, 17, 18, 19, 20]]


def lora_actor(model_dir: Path, *overrides: str):
    return make_actor(model_dir, *LORA, *overrides)


def trained_lora_actor(model_dir: Path, *overrides: str):
    """A LoRA actor after three updates (B moves in the first, A from the second on)."""
    actor = lora_actor(model_dir, *overrides)
    for seed in range(3):
        update(actor, policy_batch(actor, random_advantages(seed)))
    return actor


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


# -- settings --------------------------------------------------------------------------------------------------
def test_settings_follow_verls_keys_and_refuse_bad_values(tiny_model_dir):
    cfg = ppo_config(tiny_model_dir)
    assert LoraSettings.from_config(cfg.actor_rollout_ref.model) is None  # verl's default: lora_rank 0
    cfg = ppo_config(tiny_model_dir, "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
                     "actor_rollout_ref.model.target_modules=[q_proj,v_proj]")
    settings = LoraSettings.from_config(cfg.actor_rollout_ref.model)
    assert settings == LoraSettings(8, 32.0, ("q_proj", "v_proj"))
    peft_cfg = settings.peft_config()
    assert peft_cfg.r == 8 and peft_cfg.lora_alpha == 32.0 and set(peft_cfg.target_modules) == {"q_proj", "v_proj"}
    for override, problem in (("lora_rank=-1", "lora_rank=-1"),
                              ("lora_alpha=0", "lora_alpha=0"), ("target_modules=[]", "names no module")):
        cfg = ppo_config(tiny_model_dir, "actor_rollout_ref.model.lora_rank=4", f"actor_rollout_ref.model.{override}")
        with pytest.raises(ArcherError, match=problem.replace("[", r"\[")) as err:
            LoraSettings.from_config(cfg.actor_rollout_ref.model)
        assert "actor_rollout_ref.model." in err.value.problem


def test_exclude_modules_leaves_those_layers_plain(tiny_model_dir):
    actor = lora_actor(tiny_model_dir, "actor_rollout_ref.model.exclude_modules=[down_proj,o_proj]")
    adapted = {name.rsplit(".", 1)[-1] for name, m in actor.model.named_modules() if isinstance(m, LoraLayer)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    actor = lora_actor(tiny_model_dir, "actor_rollout_ref.model.exclude_modules='.*layers\\.0\\..*'")
    layers = {name.split(".")[2] for name, m in actor.model.named_modules() if isinstance(m, LoraLayer)}
    assert layers == {"1"}


def test_unknown_target_module_is_one_clear_error(tiny_model_dir):
    with pytest.raises(ArcherError, match="target_modules") as err:
        lora_actor(tiny_model_dir, "actor_rollout_ref.model.target_modules=[qkv]")
    assert "q_proj" in err.value.fix  # names the model's linear layers


# -- the update --------------------------------------------------------------------------------------------------
def test_a_lora_step_changes_only_the_adapters(tiny_model_dir):
    actor = lora_actor(tiny_model_dir)
    before = {k: v.detach().clone() for k, v in actor.model.named_parameters()}
    trainable = {k for k, v in actor.model.named_parameters() if v.requires_grad}
    assert trainable and all(is_adapter(k) for k in trainable)
    assert all(v.dtype == torch.float32 for k, v in actor.model.named_parameters() if k in trainable)
    # the optimiser holds exactly the adapters
    assert sum(len(g["params"]) for g in actor.optimizer.param_groups) == len(trainable)
    # every linear layer but the LM head carries an adapter (all-linear), 7 per decoder layer
    layers = {k.split(".lora_")[0] for k in trainable}
    assert len(layers) == 7 * actor.model.config.num_hidden_layers and not any("lm_head" in k for k in layers)
    start = actor.compute_log_prob(hand_batch())["old_log_probs"]
    for seed in range(2):
        update(actor, policy_batch(actor, random_advantages(seed)))
    after = dict(actor.model.named_parameters())
    for name, value in before.items():
        if name in trainable and ".lora_B." in name:
            assert not torch.equal(after[name], value), name  # B starts at 0 and moves
        elif name not in trainable:
            assert torch.equal(after[name], value), name  # the base, bit for bit
    assert any(not torch.equal(after[k], before[k]) for k in trainable if ".lora_A." in k)
    assert not torch.allclose(actor.compute_log_prob(hand_batch())["old_log_probs"], start, atol=1e-4)


def test_gpu_dtype_policy_bf16_base_and_float32_adapters(tiny_model_dir, monkeypatch):
    """On a GPU the base is loaded in bf16 (default_dtype), the adapters stay float32; here on the CPU with the
    GPU's dtype forced: the update runs, moves only the adapters, and the engine takes the merged weights."""
    monkeypatch.setattr(owner_module, "default_dtype", lambda device: torch.bfloat16)
    actor = lora_actor(tiny_model_dir)
    dtypes = {is_adapter(k): v.dtype for k, v in actor.model.named_parameters()}
    assert dtypes == {True: torch.float32, False: torch.bfloat16}
    before = {k: v.detach().clone() for k, v in actor.model.named_parameters() if not is_adapter(k)}
    for seed in range(2):
        update(actor, policy_batch(actor, random_advantages(seed)))
    assert all(torch.equal(v, before[k]) for k, v in actor.model.named_parameters() if not is_adapter(k))
    merged = dict(policy_weights(actor.model))
    assert merged["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert not torch.equal(merged["model.layers.0.mlp.up_proj.weight"],
                           before["model.layers.0.mlp.up_proj.base_layer.weight"])


def test_reference_is_the_base_model_with_the_adapters_off(tiny_model_dir):
    actor = trained_lora_actor(tiny_model_dir)
    cfg = actor.cfg
    ref = actor.make_reference()
    assert ref.model is actor.model  # no second copy
    plain = ReferenceWorker(cfg, device=CPU)  # its own copy of the base, loaded from model.path
    batch = hand_batch()
    ref_logp = ref.compute_ref_log_prob(batch)["ref_log_prob"]
    assert torch.equal(ref_logp, plain.compute_ref_log_prob(batch)["ref_log_prob"])
    # outside the reference pass the adapters are on again: the policy differs from the base
    policy_logp = actor.compute_log_prob(batch)["old_log_probs"]
    assert not torch.allclose(policy_logp, ref_logp, atol=1e-4)
    assert actor.model.training  # compute_log_probs restored the mode


# -- generation --------------------------------------------------------------------------------------------------
def merged_model(actor, folder: Path):
    actor.save(folder, load_tokenizer(actor.cfg.model.path))
    return load_causal_lm(folder, device=CPU, dtype=torch.float32)


@pytest.mark.parametrize("engine_kind", ["hf", "fast"])
def test_engine_generates_what_the_merged_model_generates(engine_kind, tiny_model_dir, tmp_path):
    # free_cache_engine=false: the engine keeps its weights between steps, so the sync is in place
    actor = lora_actor(tiny_model_dir, f"actor_rollout_ref.rollout.name={engine_kind}",
                       "actor_rollout_ref.rollout.free_cache_engine=false")
    engine = actor.rollout.engine
    assert isinstance(engine, HFGenerateEngine if engine_kind == "hf" else FastEngine)
    tokenizer = load_tokenizer(tiny_model_dir)
    params = SamplingParams(do_sample=False, max_new_tokens=8)
    base_out = engine.generate(PROMPTS, params)
    pointers = [engine.model.layers[0].qkv_w.data_ptr()] if engine_kind == "fast" else []
    with torch.no_grad():  # adapters far from zero, so that the merged model generates something else
        for name, p in actor.model.named_parameters():
            if is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    actor._engine_is_stale = True
    out = actor.generate_sequences(_prompt_batch(tokenizer))  # syncs the engine as a step does
    assert out["responses"].shape[0] == len(PROMPTS)
    lora_out = engine.generate(PROMPTS, params)
    merged = merged_model(actor, tmp_path / "merged")
    reference = (HFGenerateEngine(merged, tokenizer) if engine_kind == "hf"
                 else FastEngine(merged, tokenizer, max_num_seqs=4, page_size=16))
    merged_out = reference.generate(PROMPTS, params)
    assert not torch.equal(merged_out.responses, base_out.responses)  # the adapters matter
    assert torch.equal(lora_out.responses, merged_out.responses)
    torch.testing.assert_close(lora_out.log_probs, merged_out.log_probs, atol=1e-5, rtol=0)
    if engine_kind == "fast":
        assert [engine.model.layers[0].qkv_w.data_ptr()] == pointers  # synced in place


def _prompt_batch(tokenizer) -> Batch:
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
                 info={"validate": True, "seed": 0})


def test_policy_weights_are_the_merged_weights_under_plain_names(tiny_model_dir):
    actor = trained_lora_actor(tiny_model_dir)
    plain = load_causal_lm(tiny_model_dir, device=CPU, dtype=torch.float32)
    weights = dict(policy_weights(actor.model))
    assert weights.keys() == dict(plain.named_parameters()).keys()
    layer = actor.model.model.layers[1].mlp.down_proj
    assert isinstance(layer, LoraLayer)
    by_hand = layer.base_layer.weight + (8 / 4) * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(weights["model.layers.1.mlp.down_proj.weight"], by_hand, atol=1e-6, rtol=0)
    assert torch.equal(weights["model.norm.weight"], plain.model.norm.weight)


def test_fast_engine_refuses_a_weight_stream_that_does_not_fit(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, device=CPU)
    engine = FastEngine(model, load_tokenizer(tiny_model_dir), max_num_seqs=4, page_size=16)
    weights = list(policy_weights(model))
    with pytest.raises(ArcherError, match="lack 1 tensors"):
        engine.model.load(weights[1:])
    with pytest.raises(ArcherError, match="no place for the weight 'extra.weight'"):
        engine.model.load([*weights, ("extra.weight", torch.zeros(2))])
    with pytest.raises(ArcherError, match="given twice"):
        engine.model.load([*weights, weights[0]])
    name, tensor = weights[-1]
    with pytest.raises(ArcherError, match="the weight given is"):
        engine.model.load([*weights[:-1], (name, tensor[:1])])


# -- checkpoints -------------------------------------------------------------------------------------------------
def test_checkpoint_holds_adapters_and_an_ordinary_merged_model(tiny_model_dir, tmp_path):
    actor = trained_lora_actor(tiny_model_dir)
    folder = tmp_path / "actor"
    actor.save(folder, load_tokenizer(tiny_model_dir))
    adapter_cfg = json.loads((folder / ADAPTER_DIR / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4 and adapter_cfg["lora_alpha"] == 8
    reloaded = AutoModelForCausalLM.from_pretrained(folder)  # a plain model: the adapters sit in a subfolder
    assert not any(isinstance(m, LoraLayer) for m in reloaded.modules())
    merged = {k: v.detach() for k, v in policy_weights(actor.model)}
    assert dict(reloaded.named_parameters()).keys() == merged.keys()
    for name, value in reloaded.named_parameters():
        assert torch.equal(value, merged[name]), name
    batch = hand_batch()
    with torch.no_grad():
        mine = actor.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"]).logits
        theirs = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          position_ids=batch["position_ids"]).logits
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    # the chunked log-prob / entropy kernel on the LoRA module gives the merged model's numbers
    logp, ent = float64_logprobs(reloaded, batch, temperature=1.0)
    out = actor.compute_log_prob(batch)
    torch.testing.assert_close(out["old_log_probs"].double(), logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out["entropies"].double(), ent, atol=1e-5, rtol=0)
    # the adapters load with peft's own API onto the base
    with_peft = PeftModel.from_pretrained(load_causal_lm(tiny_model_dir, device=CPU), folder / ADAPTER_DIR)
    with torch.no_grad():
        peft_logits = with_peft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                position_ids=batch["position_ids"]).logits
    torch.testing.assert_close(mine, peft_logits, atol=1e-6, rtol=0)


def test_save_load_round_trip_resumes_exactly(tiny_model_dir, tmp_path):
    actor = trained_lora_actor(tiny_model_dir)
    folder = tmp_path / "actor"
    actor.save(folder, load_tokenizer(tiny_model_dir))
    saved = {k: v.detach().clone() for k, v in actor.model.named_parameters()}
    saved_optim = copy.deepcopy(actor.optimizer.state_dict())
    next_batch = policy_batch(actor, random_advantages(5))
    update(actor, next_batch)
    after_one_more = {k: v.detach().clone() for k, v in actor.model.named_parameters()}

    fresh = lora_actor(tiny_model_dir)  # a new process would build it from model.path, then load
    fresh.load(folder)
    for name, value in fresh.model.named_parameters():
        assert torch.equal(value, saved[name]), name
    state = fresh.optimizer.state_dict()
    for index, slots in saved_optim["state"].items():
        for slot, value in slots.items():
            assert torch.equal(state["state"][index][slot], value), (index, slot)
    update(fresh, next_batch)
    for name, value in fresh.model.named_parameters():
        assert torch.equal(value, after_one_more[name]), name


def test_mismatched_checkpoints_are_one_clear_error(tiny_model_dir, tmp_path):
    actor = trained_lora_actor(tiny_model_dir)
    actor.save(tmp_path / "lora", load_tokenizer(tiny_model_dir))
    with pytest.raises(ArcherError, match="LoRA run") as err:
        make_actor(tiny_model_dir).load(tmp_path / "lora")
    assert "lora_rank" in err.value.fix
    with pytest.raises(ArcherError, match="do not fit|do not match"):
        make_actor(tiny_model_dir, "actor_rollout_ref.model.lora_rank=2").load(tmp_path / "lora")
    full = make_actor(tiny_model_dir)
    full.save(tmp_path / "full", load_tokenizer(tiny_model_dir))
    with pytest.raises(ArcherError, match="holds no LoRA adapters"):
        lora_actor(tiny_model_dir).load(tmp_path / "full")


# -- influence ---------------------------------------------------------------------------------------------------
def test_influence_hooks_sit_on_the_lora_layers(tiny_model_dir):
    actor = lora_actor(tiny_model_dir)
    plain = load_causal_lm(tiny_model_dir, device=CPU, dtype=torch.float32)
    names = ["self_attn.q_proj", "mlp.down_proj"]
    hooked = select_modules(actor.model, names, None, -1)
    assert list(hooked) == list(select_modules(plain, names, None, -1))
    assert all(isinstance(m, LoraLayer) for m in hooked.values())


@pytest.mark.parametrize("output_function", ["training_loss", "log_prob"])
def test_influence_factors_equal_the_merged_models(output_function, tiny_model_dir, tmp_path):
    """The captured per-token gradient factors of the LoRA policy are those of a plain model holding its merged
    weights, in the training backward and in the extra pass alike."""
    lora = trained_lora_actor(tiny_model_dir)
    lora.save(tmp_path / "merged", load_tokenizer(tiny_model_dir))
    plain = make_actor(tmp_path / "merged", *LORA[2:])
    trace = ppo_config(tiny_model_dir, f"trainer.influence_trace.output_function={output_function}",
                       "trainer.influence_trace.projection_dim_factor=0").trainer.influence_trace
    settings = CaptureSettings.from_config(trace)
    assert lora.setup_influence(settings) == plain.setup_influence(settings)
    tokens = TracedTokens(rows=np.array([0, 1, 2]), token_response=np.array([0, 0, 1, 1, 1, 2]),
                          token_position=np.array([0, 1, 0, 1, 2, 0]))
    batch = policy_batch(lora, random_advantages(7))
    groups = {name: out for name, out in
              (("lora", lora.update_actor(batch, tokens).influence),
               ("plain", plain.update_actor(batch, tokens).influence))}
    assert sum(len(group.modules) for group in groups["lora"]) == 14  # 7 linear layers x 2 decoder layers
    for mine, theirs in zip(groups["lora"], groups["plain"], strict=True):
        assert mine.modules == theirs.modules
        assert mine.u.abs().sum() > 0 and mine.v.abs().sum() > 0
        torch.testing.assert_close(mine.u, theirs.u, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(mine.v, theirs.v, atol=1e-5, rtol=1e-4)


# -- end to end --------------------------------------------------------------------------------------------------
# Dense, so that GRPO groups have non-zero advantages from the first step: the share of digits in the response.
DIGIT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""


def train_overrides(model: Path, files: dict[str, Path], run: Path, steps: int) -> list[str]:
    reward = run.parent / "digit_reward.py"
    reward.parent.mkdir(parents=True, exist_ok=True)
    reward.write_text(DIGIT_REWARD)
    return [f"actor_rollout_ref.model.path={model}", f"custom_reward_function.path={reward}", f"data.train_files={files['train']}",
            "data.max_prompt_length=32", "data.max_response_length=12", "trainer.device=cpu",
            f"trainer.default_local_dir={run}", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2", *LORA,
            "actor_rollout_ref.actor.use_kl_loss=true", f"trainer.total_training_steps={steps}",
            "trainer.save_freq=1", "trainer.logger=[jsonl]", "trainer.plots=false", "trainer.val_before_train=false",
            "+trainer.influence_trace.enable=true", "+trainer.influence_trace.projection_dim_factor=16"]


@pytest.mark.slow
def test_archer_train_with_lora_runs_two_steps(micro_model, task_files, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "archer.cli", "train",
                           *train_overrides(micro_model, task_files, run, 2)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # the policy moves away from the reference (the base) from the second mini-batch of step 1 on
    assert all(m["actor/grad_norm"] > 0 and m["actor/kl_loss"] > 0 for m in metrics)
    step2 = run / "checkpoints" / "global_step_2" / "actor"
    assert (step2 / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(step2)
    reader = TraceReader(run / "influence_trace")
    assert reader.steps() == [1, 2]
    influence = reader.load_step(2)["influence"]
    assert torch.isfinite(torch.as_tensor(influence.astype("float32"))).any()


@pytest.mark.slow
def test_lora_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run(micro_model, task_files, tmp_path):
    def fit(run: Path, steps: int) -> None:
        PPOTrainer(load_config("ppo_trainer", train_overrides(micro_model, task_files, run, steps))).fit()

    fit(tmp_path / "whole", 3)
    fit(tmp_path / "parts", 2)
    fit(tmp_path / "parts", 3)  # resume_mode=auto: continues from global_step_2

    def step3(run: Path) -> dict:
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {k: v for k, v in lines[-1].items() if not k.startswith(("timing_s/", "perf/"))}

    assert step3(tmp_path / "whole") == step3(tmp_path / "parts")
    adapter = Path("checkpoints/global_step_3/actor") / ADAPTER_DIR / "adapter_model.safetensors"
    whole, parts = load_file(tmp_path / "whole" / adapter), load_file(tmp_path / "parts" / adapter)
    assert whole.keys() == parts.keys() and all(torch.equal(whole[k], parts[k]) for k in whole)


def test_sft_with_lora_trains_the_adapters_and_exports_a_merged_model(tmp_path, tiny_model_dir):
    cfg = sft_cfg(tmp_path, tiny_model_dir, **{"model.lora_rank": 8, "model.lora_alpha": 32,
                                                "model.enable_gradient_checkpointing": False,
                                                "trainer.total_epochs": 4, "optim.lr": 0.01})
    out = run_sft(cfg)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["train/loss"] < metrics[0]["train/loss"] - 0.2  # 5.80 -> 5.48: slower than full fine-tuning
    assert (out / ADAPTER_DIR / "adapter_config.json").is_file()
    base = dict(load_causal_lm(tiny_model_dir, device=CPU, dtype=torch.float32).named_parameters())
    trained = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    assert trained.keys() == base.keys()
    for name, value in trained.items():  # only the adapted linear layers moved
        adapted = name.endswith("proj.weight")
        assert torch.equal(value, base[name]) != adapted, name
    tokenizer = load_tokenizer(out)
    ds = SFTDataset([RowFormat.of("prompt_response").conversation(_row(2, 3), "row 0")], tokenizer, max_length=64)
    with torch.no_grad():
        merged_nll = -float(response_logprobs(AutoModelForCausalLM.from_pretrained(out), ds.collate([ds[0]])).mean())
        base_nll = -float(response_logprobs(load_causal_lm(tiny_model_dir, device=CPU), ds.collate([ds[0]])).mean())
    assert merged_nll < base_nll  # the merged export carries what the adapters learned
    saved = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert saved.model.lora_rank == 8


def test_rl_starts_from_the_sft_adapters(tmp_path, tiny_model_dir, caplog):
    """model.lora_adapter_path: the SFT run's adapters (rank, alpha, targets and weights) start the RL policy."""
    cfg = sft_cfg(tmp_path, tiny_model_dir, **{"model.lora_rank": 4, "model.lora_alpha": 8,
                                                "model.target_modules": "[q_proj,v_proj]", "trainer.total_epochs": 1,
                                                "model.enable_gradient_checkpointing": False})
    hf_model = run_sft(cfg)
    actor = make_actor(tiny_model_dir, f"actor_rollout_ref.model.lora_adapter_path={hf_model}",
                       "actor_rollout_ref.model.lora_rank=16")  # the adapters' own rank wins, with a warning
    assert "have rank 4 and alpha 8" in caplog.text
    trainable = {k for k, v in actor.model.named_parameters() if v.requires_grad}
    assert {k.split(".")[-4] for k in trainable} == {"q_proj", "v_proj"}
    merged = AutoModelForCausalLM.from_pretrained(hf_model)
    for name, value in policy_weights(actor.model):  # the policy is SFT's merged model
        torch.testing.assert_close(value, dict(merged.named_parameters())[name], atol=1e-6, rtol=0)
    # archer eval / trainer.val_only: the adapters go on model.path, never on another folder (a checkpoint's
    # actor/ holds its merged adapters already)
    generator = GenerationWorker(actor.cfg, tiny_model_dir, device=CPU, tokenizer=load_tokenizer(tiny_model_dir))
    for name, value in policy_weights(generator.model):
        torch.testing.assert_close(value, dict(merged.named_parameters())[name], atol=1e-6, rtol=0)
    on_merged = GenerationWorker(actor.cfg, hf_model, device=CPU, tokenizer=load_tokenizer(tiny_model_dir))
    assert not any(isinstance(m, LoraLayer) for m in on_merged.model.modules())
    with pytest.raises(ArcherError, match="lora_adapter_path: .* holds no LoRA adapters"):
        make_actor(tiny_model_dir, f"actor_rollout_ref.model.lora_adapter_path={tiny_model_dir}")


def test_sft_refuses_bad_lora_settings(tmp_path, tiny_model_dir):
    with pytest.raises(ArcherError, match=r"model.lora_alpha=-1"):
        run_sft(sft_cfg(tmp_path, tiny_model_dir, **{"model.lora_rank": 4, "model.lora_alpha": -1}))
