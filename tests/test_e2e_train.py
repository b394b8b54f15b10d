"""End-to-end tests of the RL trainer: GRPO through the CLI, PPO with a critic and KL, exact gradient
accumulation in the actor, bad input through the CLI, and scoring of ARPO's real validation rows.

Everything runs on CPU with a micro Qwen2 model (2 layers, 64 wide) built from the arithmetic task's texts.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from train_support import task_model
from transformers import AutoConfig, AutoModelForCausalLM
from workers_support import update

from archer import cli
from archer.batch import Batch
from archer.config.loader import load_config
from archer.data.parquet import read_rl_files
from archer.data.tasks import write_task_files
from archer.models.loading import load_tokenizer, load_value_model
from archer.rewards.math import compute_math_score
from archer.rewards.reward_stage import RewardManager
from archer.trace.format import TraceReader
from archer.trainer.ppo import PPOTrainer
from archer.workers.actor import ActorWorker

pytestmark = pytest.mark.slow

ARCHER = [sys.executable, "-m", "archer.cli"]
ARPO_VALID = Path(__file__).resolve().parents[2] / "shared" / "data" / "arpo" / "valid.parquet"
MAX_POSITIONS = 2304  # ARPO's validation prompts reach about 2100 tokens with the micro tokenizer
VAL_KEY = "val-core/archer/arithmetic/acc/mean@1"
SUBPROCESS_TIMEOUT_S = 240

# Score = share of digits in the response (varies between samples, so GRPO advantages are not all zero);
# acc = the built-in math reward; extras: the digit count, whether the response boxes an answer (a bool) and
# its first word (text: dumps only).
DIGIT_REWARD = '''
from archer.rewards.math import compute_math_score
from archer.trace.format import TraceReader


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(c.isdigit() for c in solution_str)
    return {"score": digits / max(len(solution_str), 1), "acc": compute_math_score(solution_str, ground_truth),
            "digits": digits, "boxed": "boxed{" in solution_str, "first_word": solution_str.split(" ")[0]}
'''
NUMERIC_EXTRAS = ("digits", "boxed")

NAN_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float("nan"), "acc": 0.0}
'''

# Raises on its 3rd call.
FAILING_REWARD = '''
calls = 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    if calls == 3:
        raise ValueError(f"reward exploded on call {calls}")
    return 0.0
'''


# -- fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def task_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_task_files("arithmetic", tmp_path_factory.mktemp("arithmetic"), n_train=64, n_val=16, n_sft=64,
                            seed=0, max_operand=9)


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory: pytest.TempPathFactory, task_files: dict[str, Path]) -> Path:
    return task_model(tmp_path_factory.mktemp("micro_model"), task_files["sft"], max_positions=MAX_POSITIONS)


def base_overrides(model: Path, files: dict[str, Path], run: Path) -> list[str]:
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files={files['train']}",
            "data.max_prompt_length=32", "data.max_response_length=16", "trainer.device=cpu",
            f"trainer.default_local_dir={run}"]


def read_metrics(run: Path) -> dict[int, dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    by_step = {r.pop("step"): r for r in records}
    assert len(by_step) == len(records), "one line per step"
    return by_step


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def state_dict_of(folder: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()


def max_weight_change(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def digit_share(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


# -- 1. GRPO end to end through the CLI ------------------------------------------------------------------
@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory: pytest.TempPathFactory, micro_model: Path,
             task_files: dict[str, Path]) -> tuple[Path, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("grpo")
    reward = root / "digit_reward.py"
    reward.write_text(DIGIT_REWARD)
    run = root / "run"
    args = [*base_overrides(micro_model, task_files, run), f"data.val_files={task_files['val']}",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.optim.weight_decay=0.0", "+actor_rollout_ref.actor.clip_ratio_high=0.28",
            f"custom_reward_function.path={reward}", "trainer.total_training_steps=3", "trainer.test_freq=2",
            "trainer.save_freq=2", f"trainer.rollout_data_dir={run / 'rollouts'}",
            f"trainer.validation_data_dir={run / 'val_generations'}",
            # the overrides verl users pass for the traces (docs/traces.md)
            "+trainer.entropy_trace.enable=True", "+trainer.entropy_trace.write_every=1",
            "+trainer.influence_trace.enable=True", f"+trainer.influence_trace.output_dir={run / 'influence'}",
            "+trainer.influence_trace.max_prompts_per_step=3"]
    proc = subprocess.run([*ARCHER, "train", *args], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    return run, proc


TRAIN_KEYS = (
    "critic/score/mean", "critic/score/max", "critic/score/min", "critic/rewards/mean", "critic/advantages/mean",
    "critic/returns/mean", "critic/acc/mean", "actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
    "actor/ppo_kl", "actor/grad_norm", "actor/pg_loss", "actor/lr", "response_length/mean", "response_length/max",
    "response_length/clip_ratio", "prompt_length/mean", "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob",
    "timing_s/adv", "timing_s/update_actor", "timing_s/step", "perf/throughput", "perf/total_num_tokens",
    "perf/time_per_step", "training/global_step",
)


def test_grpo_cli_exits_zero_and_saves_the_resolved_config(grpo_run, micro_model: Path) -> None:
    run, proc = grpo_run
    assert proc.returncode == 0, proc.stderr
    assert f"run directory: {run}" in proc.stdout
    cfg = OmegaConf.load(run / "config.yaml")
    assert cfg.actor_rollout_ref.model.path == str(micro_model)
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.critic.rollout_n == 4  # interpolations are saved resolved
    assert cfg.data.train_batch_size == 8
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 4
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.28  # the "+key=value" override
    assert cfg.actor_rollout_ref.actor.clip_ratio_low is None
    assert cfg.trainer.total_training_steps == 3
    assert cfg.trainer.save_freq == 2 and cfg.trainer.test_freq == 2


def test_grpo_metrics_have_verl_names_and_match_the_rollout_dumps(grpo_run, task_files: dict[str, Path]) -> None:
    run, proc = grpo_run
    assert proc.returncode == 0, proc.stderr
    metrics = read_metrics(run)
    assert sorted(metrics) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        line = metrics[step]
        assert set(TRAIN_KEYS) <= set(line), set(TRAIN_KEYS) - set(line)
        assert all(isinstance(v, float | int) and math.isfinite(v) for v in line.values()), line
        assert line["training/global_step"] == step
        assert line["actor/lr"] == pytest.approx(1e-3)
        assert line["actor/grad_norm"] > 0  # digit-share rewards differ inside groups: a real gradient
        assert 0 < line["response_length/mean"] <= line["response_length/max"] <= 16
        assert line["perf/throughput"] == pytest.approx(line["perf/total_num_tokens"] / line["timing_s/step"])
        assert line["timing_s/gen"] < line["timing_s/step"]
        rollouts = read_jsonl(run / "rollouts" / f"step_{step}.jsonl")
        assert len(rollouts) == 8 * 4
        for r in rollouts:
            assert list(r) == ["input", "output", "gts", "score", "step", "data_source", "acc", "uid", "trained",
                               "digits", "boxed", "first_word"]
            assert r["trained"] is True and r["uid"].startswith(f"{step}-")
            assert r["step"] == step and r["score"] == pytest.approx(digit_share(r["output"]))
            assert r["data_source"] == "archer/arithmetic" and r["acc"] == compute_math_score(r["output"], r["gts"])
            assert r["digits"] == sum(c.isdigit() for c in r["output"]) and r["boxed"] is ("boxed{" in r["output"])
            assert r["first_word"] == r["output"].split(" ")[0]
        assert line["critic/score/mean"] == pytest.approx(np.mean([r["score"] for r in rollouts]))
        assert line["critic/score/max"] == pytest.approx(max(r["score"] for r in rollouts))
        assert line["critic/acc/mean"] == pytest.approx(np.mean([r["acc"] for r in rollouts]))
        for key in NUMERIC_EXTRAS:  # the numeric extras, none named by the trainer; the text one has no metric
            assert line[f"reward/{key}/mean"] == pytest.approx(np.mean([float(r[key]) for r in rollouts]))
        assert not any("first_word" in k for k in line)

    val_steps = [s for s, line in metrics.items() if VAL_KEY in line]
    assert val_steps == [0, 2, 3]  # before training, test_freq=2, and the last step
    assert set(metrics[0]) == {VAL_KEY, "val-aux/archer/arithmetic/score/mean@1", "val-core/all/acc/mean@1",
                               "val-aux/all/score/mean@1", "timing_s/testing",
                               *(f"val-aux/{ds}/{key}/mean@1" for ds in ("archer/arithmetic", "all")
                                 for key in NUMERIC_EXTRAS)}
    generations = read_jsonl(run / "val_generations" / "step_0.jsonl")
    gold = [r["reward_model"]["ground_truth"] for r in pq.read_table(task_files["val"]).to_pylist()]
    assert [g["gts"] for g in generations] == gold  # every validation prompt, in file order
    assert all(g["data_source"] == "archer/arithmetic" and g["step"] == 0 for g in generations)
    for key in NUMERIC_EXTRAS:
        assert metrics[0][f"val-aux/archer/arithmetic/{key}/mean@1"] == pytest.approx(
            np.mean([float(g[key]) for g in generations]))
    assert metrics[0]["val-aux/archer/arithmetic/score/mean@1"] == pytest.approx(
        np.mean([digit_share(g["output"]) for g in generations]))
    assert metrics[0][VAL_KEY] == pytest.approx(
        np.mean([compute_math_score(g["output"], g["gts"]) for g in generations]))


def test_grpo_traces_match_the_rollouts_and_metrics(grpo_run, micro_model: Path) -> None:
    run, proc = grpo_run
    assert proc.returncode == 0, proc.stderr
    metrics = read_metrics(run)
    tokenizer = load_tokenizer(run / "entropy_trace" / "tokenizer")  # the trace carries its tokenizer
    entropy, influence = TraceReader(run / "entropy_trace"), TraceReader(run / "influence")
    assert entropy.steps() == influence.steps() == [1, 2, 3]
    assert entropy.summary["model_path"] == str(micro_model) and entropy.summary["rollout_n"] == 4
    for step in (1, 2, 3):
        rollouts = read_jsonl(run / "rollouts" / f"step_{step}.jsonl")
        arrays = entropy.load_step(step)
        assert arrays["response_index"].tolist() == list(range(32))
        assert arrays["sample_index"].tolist() == [0, 1, 2, 3] * 8
        assert [u for u in arrays["uid"][::4]] == [f"{step}-{i}" for i in range(8)]
        texts = tokenizer.batch_decode([r[m].tolist() for r, m in zip(arrays["responses"], arrays["response_mask"])],
                                       skip_special_tokens=True)
        assert texts == [r["output"] for r in rollouts]
        np.testing.assert_allclose(arrays["reward"], [r["score"] for r in rollouts], rtol=1e-6)
        assert [k for k in arrays if k.startswith("reward_extra/")] == [f"reward_extra/{k}" for k in ("boxed", "digits")]
        for key in NUMERIC_EXTRAS:
            assert arrays[f"reward_extra/{key}"].dtype == np.float32
            assert arrays[f"reward_extra/{key}"].tolist() == [float(r[key]) for r in rollouts]
        prompt = arrays["prompts"][0][-arrays["prompt_length"][0]:]
        question = rollouts[0]["input"][0]["content"]
        assert tokenizer.decode(prompt.tolist(), skip_special_tokens=True) == f"user\n{question}\nassistant\n"
        entry = entropy.entry(step)
        assert entry["num_valid_tokens"] == int(arrays["response_mask"].sum())
        assert entry["entropy_mean"] == pytest.approx(metrics[step]["actor/entropy"], rel=1e-3)
        assert np.all(arrays["old_log_probs"][arrays["response_mask"]] <= 0)

        traced = influence.load_step(step)
        rows = traced["selected_row_id"]
        assert len(rows) == metrics[step]["influence/selected_responses"] <= 3 * 4
        np.testing.assert_array_equal(traced["responses"], arrays["responses"][rows])
        for g in np.unique(traced["group_id"]):
            rewards = traced["reward"][traced["group_id"] == g]
            assert rewards.min() < rewards.max(), "groups with one reward are skipped"
            assert traced["accepted"][traced["group_id"] == g].tolist() == (rewards == rewards.max()).tolist()
        scored = ~np.isnan(traced["influence"].astype(np.float32))
        assert np.array_equal(scored, traced["response_mask"]), "every traced token, and only those, is scored"
        assert influence.entry(step)["num_valid_influence"] == metrics[step]["influence/traced_tokens"]
        assert metrics[step]["timing_s/entropy_trace"] < metrics[step]["timing_s/step"]


def test_traces_leave_training_unchanged(micro_model: Path, task_files: dict[str, Path], tmp_path: Path) -> None:
    """The same seed with and without both traces: identical metrics (timings aside) and final weights."""
    reward = tmp_path / "digit_reward.py"
    reward.write_text(DIGIT_REWARD)
    finals = []
    for name, extra in (("plain", []), ("traced", ["+trainer.entropy_trace.enable=True",
                                                   "+trainer.influence_trace.enable=True"])):
        run = tmp_path / name
        cfg = load_config("ppo_trainer", [
            *base_overrides(micro_model, task_files, run), "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.optim.lr=1e-3",
            f"custom_reward_function.path={reward}", "trainer.total_training_steps=2", "trainer.save_freq=2",
            "trainer.logger=[jsonl]", "trainer.plots=False", *extra])
        PPOTrainer(cfg).fit()
        finals.append((read_metrics(run), load_file(run / "checkpoints" / "global_step_2" / "actor" / "model.safetensors")))
    (plain, plain_weights), (traced, traced_weights) = finals
    for step in (1, 2):
        assert traced[step]["influence/selected_responses"] > 0
        same = {k: v for k, v in traced[step].items() if not k.startswith(("timing_s/", "perf/", "influence/"))}
        assert same == {k: v for k, v in plain[step].items() if not k.startswith(("timing_s/", "perf/"))}
    assert all(torch.equal(plain_weights[k], traced_weights[k]) for k in plain_weights)


def test_grpo_checkpoints_hold_trained_loadable_actors(grpo_run, micro_model: Path) -> None:
    run, proc = grpo_run
    assert proc.returncode == 0, proc.stderr
    ckpt = run / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step_2", "global_step_3", "latest"]
    assert (ckpt / "latest").read_text().strip() == "global_step_3"
    start = state_dict_of(micro_model)
    step2 = state_dict_of(ckpt / "global_step_2" / "actor")
    step3 = state_dict_of(ckpt / "global_step_3" / "actor")
    assert max_weight_change(start, step2) > 1e-4
    assert max_weight_change(step2, step3) > 1e-4
    state = torch.load(ckpt / "global_step_3" / "trainer_state.pt", weights_only=True)
    assert state["global_step"] == 3
    assert state["loader"] == {"epoch": 0, "position": 3}  # 64 prompts / 8 per step: 3 of 8 batches used


def test_grpo_plots_and_summary(grpo_run, micro_model: Path, task_files: dict[str, Path]) -> None:
    run, proc = grpo_run
    assert proc.returncode == 0, proc.stderr
    pngs = {p.name: p for p in (run / "plots").glob("*.png")}
    assert {"reward.png", "entropy.png", "losses.png", "grad_norm.png", "response_length.png",
            "reward_extras.png"} <= set(pngs)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs.values())
    summary = json.loads((run / "summary.json").read_text())
    metrics = read_metrics(run)
    assert summary["steps"] == 3
    assert summary["run_dir"] == str(run)
    assert summary["model_path"] == str(micro_model)
    assert summary["train_files"] == [str(task_files["train"])]
    assert summary["val_files"] == [str(task_files["val"])]
    assert summary["val_before"] == metrics[0]
    assert summary["val_after"] == {k: metrics[3][k] for k in metrics[0]}
    assert summary["latest_checkpoint"] == str(run / "checkpoints" / "global_step_3" / "actor")
    assert summary["wall_time_s"] > 0


# -- 2. PPO with a critic (GAE), KL loss and KL in the reward, in-process ---------------------------------
PPO_VARIANTS = {
    "gae": [],
    "gae+kl_loss": ["actor_rollout_ref.actor.use_kl_loss=True"],
    "gae+kl_in_reward": ["algorithm.use_kl_in_reward=True"],
}
CRITIC_KEYS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/values/mean", "critic/grad_norm",
               "critic/lr", "timing_s/values", "timing_s/update_critic")


@pytest.mark.parametrize("variant", list(PPO_VARIANTS))
def test_ppo_with_critic(variant: str, micro_model: Path, task_files: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = load_config("ppo_trainer", [
        *base_overrides(micro_model, task_files, run), "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=2",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3", "trainer.total_training_steps=2",
        "trainer.save_freq=2", "trainer.logger=[jsonl]", "trainer.plots=False", *PPO_VARIANTS[variant]])
    trainer = PPOTrainer(cfg)
    summary = trainer.fit()
    assert summary["steps"] == 2
    metrics = read_metrics(run)
    assert sorted(metrics) == [1, 2]  # no validation files: no step 0
    for line in metrics.values():
        assert set(CRITIC_KEYS) <= set(line), set(CRITIC_KEYS) - set(line)
        assert all(isinstance(v, float | int) and math.isfinite(v) for v in line.values()), line
        assert line["critic/vf_loss"] >= 0
        assert line["critic/lr"] == pytest.approx(1e-3)

    critic_dir = run / "checkpoints" / "global_step_2" / "critic"
    assert {"config.json", "model.safetensors", "optim_state.pt"} <= {p.name for p in critic_dir.iterdir()}
    saved_head = load_file(str(critic_dir / "model.safetensors"))["score.weight"]
    assert torch.equal(saved_head, trainer.workers.worker.critic.model.score.weight.detach().cpu())
    reloaded = load_value_model(critic_dir, device="cpu", dtype=torch.float32)
    assert torch.equal(reloaded.score.weight.detach(), saved_head)  # the trained head is kept, not re-drawn

    uses_ref = variant != "gae"
    assert (trainer.workers.worker.ref is not None) == uses_ref
    assert all(("timing_s/ref" in line) == uses_ref for line in metrics.values())
    if variant == "gae+kl_loss":
        # low_var_kl against the reference: ~0 while the actor still equals it, > 0 once it has moved.
        assert metrics[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
        assert metrics[2]["actor/kl_loss"] > 1e-6
        assert metrics[2]["actor/kl_coef"] == pytest.approx(0.001)
    else:
        assert all("actor/kl_loss" not in line for line in metrics.values())
    if variant == "gae+kl_in_reward":
        # At step 1 the actor is the reference, so the penalty is exactly zero and rewards equal scores.
        assert metrics[1]["actor/reward_kl_penalty"] == 0.0
        assert metrics[1]["critic/rewards/mean"] == metrics[1]["critic/score/mean"]
        assert metrics[2]["actor/reward_kl_penalty"] != 0.0
        assert metrics[2]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001)
    else:
        assert all("actor/reward_kl_penalty" not in line for line in metrics.values())


def test_packed_token_budget_step_equals_the_padded_step(micro_model: Path, task_files: dict[str, Path],
                                                          tmp_path: Path) -> None:
    """One PPO step (critic, reference, KL loss) padded in every pass, and packed with token-budget micro-batches
    in every pass: the same rollouts, so the same metrics to float rounding."""
    free = ["actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true",
            "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=80",
            "critic.ppo_max_token_len_per_gpu=100"]
    metrics = []
    for name, extra in (("padded", ["actor_rollout_ref.rollout.log_prob_by_tokens=false"]), ("free", free)):
        run = tmp_path / name
        cfg = load_config("ppo_trainer", [
            *base_overrides(micro_model, task_files, run), "algorithm.adv_estimator=gae",
            "actor_rollout_ref.rollout.n=2", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.entropy_coeff=0.01",
            "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.logger=[jsonl]", "trainer.plots=False",
            "trainer.entropy_trace.enable=true", *extra])
        PPOTrainer(cfg).fit()
        metrics.append(read_metrics(run)[1])
    traces = [TraceReader(tmp_path / name / "entropy_trace").load_step(1) for name in ("padded", "free")]
    for field in ("entropies", "old_log_probs"):  # float16 in the trace
        np.testing.assert_allclose(traces[1][field], traces[0][field], atol=2e-3, rtol=0, err_msg=field)
    assert np.abs(traces[0]["entropies"]).max() > 0.1
    padded, free_metrics = metrics
    compared = [k for k in padded if k.split("/")[0] in ("actor", "critic", "response_length")]
    assert {"actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "critic/vf_loss", "critic/values/mean"} <= set(compared)
    for key in compared:
        assert free_metrics[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key


# -- 3. gradient accumulation in the actor is exact -------------------------------------------------------
def hand_built_batch(vocab_size: int) -> Batch:
    """4 rows: left-padded prompts (5 wide) and right-padded responses (6 wide) of different lengths."""
    gen = torch.Generator().manual_seed(0)
    prompt_lengths, response_lengths = [5, 3, 4, 2], [6, 2, 4, 1]
    prompt_mask = torch.tensor([[0] * (5 - n) + [1] * n for n in prompt_lengths])
    response_mask = torch.tensor([[1] * n + [0] * (6 - n) for n in response_lengths])
    prompts = torch.randint(3, vocab_size, (4, 5), generator=gen) * prompt_mask
    responses = torch.randint(3, vocab_size, (4, 6), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return Batch({
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask,
        "advantages": torch.tensor([[1.0], [-0.5], [2.0], [-1.5]]) * response_mask,
    })


def actor_worker(model: Path, files: dict[str, Path], loss_agg_mode: str, micro: int) -> ActorWorker:
    cfg = load_config("ppo_trainer", [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={files['train']}",
        "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.entropy_coeff=0.01", f"actor_rollout_ref.actor.loss_agg_mode={loss_agg_mode}"])
    return ActorWorker(cfg.actor_rollout_ref, device=torch.device("cpu"), total_steps=1)


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_actor_gradient_accumulation_is_exact(loss_agg_mode: str, micro_model: Path,
                                              task_files: dict[str, Path]) -> None:
    whole = actor_worker(micro_model, task_files, loss_agg_mode, micro=4)
    by_one = actor_worker(micro_model, task_files, loss_agg_mode, micro=1)
    batch = hand_built_batch(whole.model.config.vocab_size)
    current = whole.compute_log_prob(batch)["old_log_probs"]
    # Old log-probs off the current ones, so some ratios leave the clip range [0.8, 1.2].
    shift = 0.3 * torch.randn(current.shape, generator=torch.Generator().manual_seed(1))
    batch["old_log_probs"] = (current + shift) * batch["response_mask"]
    start = {k: v.detach().clone() for k, v in whole.model.state_dict().items()}

    metrics_whole = update(whole, batch)
    metrics_by_one = update(by_one, batch)

    after_whole, after_by_one = whole.model.state_dict(), by_one.model.state_dict()
    assert max_weight_change(start, after_whole) > 1e-4  # the update did move the weights
    assert max_weight_change(after_whole, after_by_one) < 1e-5
    assert metrics_whole["actor/pg_clipfrac"] > 0
    for key in ("actor/pg_loss", "actor/entropy_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm"):
        assert metrics_by_one[key] == pytest.approx(metrics_whole[key], abs=1e-5), key


# -- 4. bad input through the CLI --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory: pytest.TempPathFactory, micro_model: Path,
             task_files: dict[str, Path]) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Each bad-input case run once through `archer train` (a few at a time, to save wall time)."""
    root = tmp_path_factory.mktemp("bad_input")
    truncated = root / "truncated_model"
    shutil.copytree(micro_model, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    no_prompt = root / "no_prompt.parquet"
    pq.write_table(pa.table({"data_source": ["archer/arithmetic"], "question": ["Compute 1+2."]}), no_prompt)
    reward = root / "failing_reward.py"
    reward.write_text(FAILING_REWARD)
    nan_reward = root / "nan_reward.py"
    nan_reward.write_text(NAN_REWARD)
    finished = root / "finished_run"
    finished.mkdir()
    (finished / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    # One response a step, so the reward's 3rd call is step 3, after two checkpoints (save_freq=1).
    grpo = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1", "trainer.total_training_steps=4", "trainer.logger=[jsonl]",
            "trainer.plots=False"]
    cases = {
        "missing_model": [f"actor_rollout_ref.model.path={root / 'no_such_model'}"],
        "truncated_weights": [f"actor_rollout_ref.model.path={truncated}"],
        "missing_data": [f"data.train_files={root / 'no_such_file.parquet'}"],
        "no_prompt_column": [f"data.train_files={no_prompt}"],
        "unknown_key": ["actor_rollout_ref.actor.clip_ration=0.3"],
        "unknown_key_plus": ["+actor_rollout_ref.actor.clip_ration=0.3"],
        "reward_raises": [f"custom_reward_function.path={reward}", "trainer.save_freq=1"],
        "reward_nan": [f"custom_reward_function.path={nan_reward}"],
        "resume_disabled": ["trainer.resume_mode=disable", f"trainer.default_local_dir={finished}"],
    }

    def run(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        run_dir = root / name
        args = [*base_overrides(micro_model, task_files, run_dir), *grpo, *cases[name]]
        proc = subprocess.run([*ARCHER, "train", *args], capture_output=True, text=True,
                              timeout=SUBPROCESS_TIMEOUT_S)
        return (finished if name == "resume_disabled" else run_dir), proc

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(cases, pool.map(run, cases)))


BAD_INPUT_MESSAGES = {
    "missing_model": ["no_such_model", "does not exist"],
    "truncated_weights": ["truncated_model", "could not be loaded", "truncated or corrupt"],
    "missing_data": ["no_such_file.parquet", "does not exist"],
    "no_prompt_column": ["no_prompt.parquet", "has no column(s) ['prompt']", "data.prompt_key"],
    "unknown_key": ["unknown config key 'actor_rollout_ref.actor.clip_ration'",
                    "did you mean 'actor_rollout_ref.actor.clip_ratio'?"],
    "unknown_key_plus": ["unknown config key 'actor_rollout_ref.actor.clip_ration'",
                         "did you mean 'actor_rollout_ref.actor.clip_ratio'?"],
    "reward_raises": ["the reward function failed on row 0", "ValueError: reward exploded on call 3",
                      "custom_reward_function.path"],
    "resume_disabled": ["already holds a run", "trainer.resume_mode=disable", "trainer.default_local_dir"],
    "reward_nan": ["the reward function returned score nan for row 0 (data_source 'archer/arithmetic', response ",
                   "a non-finite reward makes every update a no-op", "return a finite number for every response"],
}


@pytest.mark.parametrize("case", list(BAD_INPUT_MESSAGES))
def test_bad_input_gives_one_clear_error(case: str, bad_runs) -> None:
    _, proc = bad_runs[case]
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr[proc.stderr.index("archer: error: "):]
    for fragment in BAD_INPUT_MESSAGES[case]:
        assert fragment in error, (fragment, error)
    assert "\n  fix: " in error
    assert "Traceback" not in proc.stderr + proc.stdout


def test_reward_failure_keeps_earlier_checkpoints_and_metrics(bad_runs) -> None:
    run, _ = bad_runs["reward_raises"]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is complete JSON
    assert [r["step"] for r in records] == [1, 2]
    ckpt = run / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step_1", "global_step_2", "latest"]
    assert (ckpt / "latest").read_text().strip() == "global_step_2"
    assert all((ckpt / f"global_step_{s}" / "COMPLETE").is_file() for s in (1, 2))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt / "global_step_2" / "actor"))
    assert model.config.max_position_embeddings == MAX_POSITIONS


def test_resume_disabled_refuses_an_existing_run_without_touching_it(bad_runs) -> None:
    run, _ = bad_runs["resume_disabled"]
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]  # no config.yaml, no checkpoints
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "critic/score/mean": 0.5}\n'


# -- 5. ARPO's real validation data -------------------------------------------------------------------------
needs_arpo = pytest.mark.skipif(not ARPO_VALID.is_file(), reason=f"{ARPO_VALID} is not present")


@needs_arpo
def test_arpo_validation_scores_real_rows(micro_model: Path, task_files: dict[str, Path], tmp_path: Path) -> None:
    rows = read_rl_files(ARPO_VALID)
    tokenizer = load_tokenizer(micro_model)
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    longest = max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    response_length = 8
    assert longest + response_length <= AutoConfig.from_pretrained(micro_model).max_position_embeddings
    run = tmp_path / "arpo"
    code = cli.main(["train", *base_overrides(micro_model, task_files, run), f"data.val_files={ARPO_VALID}",
                     "trainer.val_only=True", "data.filter_overlong_prompts=True", f"data.max_prompt_length={longest}",
                     f"data.max_response_length={response_length}", "data.train_batch_size=8",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=8", "data.val_batch_size=8",
                     "trainer.logger=[jsonl]", f"trainer.validation_data_dir={run / 'val_generations'}"])
    assert code == 0
    (val,) = read_jsonl(run / "val_only.jsonl")  # val_only appends its figures there, not to metrics.jsonl
    assert (val.pop("step"), val.pop("model")) == (0, str(micro_model))
    assert 0.0 <= val["val-core/DR_grpo_mix/acc/mean@1"] <= 1.0
    generations = read_jsonl(run / "val_generations" / "val_only_step_0.jsonl")
    assert [g["gts"] for g in generations] == [r["reward_model"]["ground_truth"] for r in rows]  # none filtered
    math_scores = [g["score"] for g, r in zip(generations, rows) if r["ability"] == "math"]
    assert math_scores and set(math_scores) <= {0.0, 1.0}
    assert val["val-aux/DR_grpo_mix/score/mean@1"] == pytest.approx(np.mean([g["score"] for g in generations]))


@needs_arpo
def test_reward_manager_scores_real_math_rows(micro_model: Path) -> None:
    rows = [r for r in read_rl_files(ARPO_VALID) if r["ability"] == "math"][:5]
    gold = [r["reward_model"]["ground_truth"] for r in rows]
    assert all(g.isdigit() for g in gold)  # the first math rows have integer answers
    texts = [f"<think>Work it out.</think> The answer is \\boxed{{{g}}}." for g in gold]
    texts += [f"<think>Work it out.</think> The answer is \\boxed{{{int(g) + 1}}}." for g in gold]
    tokenizer = load_tokenizer(micro_model)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    width = max(len(x) for x in ids)
    responses = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    doubled = rows + rows
    batch = Batch({"responses": responses, "response_mask": mask, "attention_mask": mask},
                  {"data_source": [r["data_source"] for r in doubled], "ability": [r["ability"] for r in doubled],
                   "ground_truth": [r["reward_model"]["ground_truth"] for r in doubled],
                   "extra_info": [r["extra_info"] for r in doubled]})
    out = RewardManager(tokenizer)(batch)
    assert out.response_text == texts
    assert out.scores.tolist() == [1.0] * 5 + [0.0] * 5
    assert out.acc.tolist() == [1.0] * 5 + [0.0] * 5
    last = torch.tensor([len(x) - 1 for x in ids])
    assert torch.equal(out.token_level_scores[torch.arange(10), last], torch.tensor([1.0] * 5 + [0.0] * 5))
    assert float(out.token_level_scores.sum()) == 5.0


# -- trainer.critic_warmup counts as verl's (steps from 1; the actor updates from step critic_warmup on) -------
@pytest.mark.parametrize(("warmup", "updated_steps"), [(0, [1, 2, 3]), (1, [1, 2, 3]), (3, [3])])
def test_critic_warmup_skips_warmup_minus_one_actor_updates(warmup: int, updated_steps: list[int], micro_model: Path,
                                                             task_files: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = load_config("ppo_trainer", [
        *base_overrides(micro_model, task_files, run), "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_response_length=4",
        "trainer.total_training_steps=3", f"trainer.critic_warmup={warmup}", "trainer.logger=[jsonl]",
        "trainer.plots=False"])
    PPOTrainer(cfg).fit()
    metrics = read_metrics(run)
    assert [s for s, line in sorted(metrics.items()) if "actor/pg_loss" in line] == updated_steps
    assert all("critic/score/mean" in line for line in metrics.values())  # every step still rolls out
