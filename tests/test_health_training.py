"""The health checks in real training runs of a micro model warm-started on the arithmetic task (every answer
boxed, so a few samples are right and the policy is fairly sure of itself): the blow-up the issue describes (a
large learning rate, no clipping, 4 PPO epochs), a reward that pays for length, and a constant reward that stops
the run with trainer.health.stop_on=critical. Each is flagged within a stated number of steps and its pointers
are checked against the run's entropy trace; the replay (`archer health`) gives the flags training wrote."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from train_support import task_model

from archer.config.loader import load_config
from archer.data.tasks import write_task_files
from archer.health.offline import replay
from archer.step_lines import read_step_records
from archer.trace.format import TraceReader
from archer.trainer.ppo import PPOTrainer
from archer.trainer.sft import run_sft

pytestmark = pytest.mark.slow

LENGTH_REWARD = '''
from archer.rewards.math import compute_math_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": min(len(solution_str), 120) / 120, "acc": compute_math_score(solution_str, ground_truth)}
'''
CONSTANT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
'''


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """The micro model after 300 SFT steps on 200 boxed solutions of two-operand sums and differences up to 12."""
    root = tmp_path_factory.mktemp("health_warm")
    files = write_task_files("arithmetic", root / "data", n_train=64, n_val=16, n_sft=200, seed=0, max_operand=12,
                             num_operands=2, unboxed_fraction=0.0)
    model = task_model(root / "model", files["sft"], max_positions=128)
    cfg = load_config("sft_trainer", [
        f"model.partial_pretrain={model}", f"data.train_files={files['sft']}", f"trainer.default_local_dir={root / 'sft'}",
        "data.train_batch_size=32", "data.micro_batch_size_per_gpu=32", "data.max_length=64", "optim.lr=3e-3",
        "optim.warmup_steps_ratio=0.05", "trainer.total_training_steps=300", "trainer.logger=[console]",
        "model.enable_gradient_checkpointing=false", "trainer.device=cpu"])
    return run_sft(cfg), files


def train(run: Path, model: Path, files: dict[str, Path], *extra: str) -> dict:
    cfg = load_config("ppo_trainer", [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={files['train']}", "data.max_prompt_length=32",
        "data.max_response_length=32", "trainer.device=cpu", f"trainer.default_local_dir={run}",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.use_kl_loss=false",
        "trainer.logger=[jsonl]", "trainer.save_freq=-1", "trainer.entropy_trace.enable=true", "trainer.plots=false",
        *extra])
    return PPOTrainer(cfg).fit()


def flags_of(run: Path) -> list[dict]:
    return read_step_records(run / "health.jsonl")


def same_but_values(flag: dict) -> dict:
    """A flag record without its pointers' values."""
    return {**flag, "pointers": [{k: v for k, v in p.items() if k != "value"} for p in flag["pointers"]]}


def repetition_share(ids: list[int], n: int = 4) -> float:
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def test_the_issues_blowup_is_flagged_by_step_4_with_the_responses_that_carry_it(
        warm, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, files = warm
    run = tmp_path / "blowup"
    with caplog.at_level(logging.INFO, logger="archer.health"):
        train(run, model, files, "trainer.total_training_steps=4", "actor_rollout_ref.actor.optim.lr=1e-3",
              "actor_rollout_ref.actor.clip_ratio_low=10", "actor_rollout_ref.actor.clip_ratio_high=10",
              "actor_rollout_ref.actor.ppo_epochs=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2")
    flags = flags_of(run)
    blowup = [f for f in flags if f["check"] == "entropy_blowup"]
    assert blowup and blowup[0]["step"] <= 4 and blowup[0]["severity"] == "critical", flags
    figures = blowup[0]["figures"]
    assert figures["entropy_now"] >= 1.5 * figures["entropy_then"] and figures["acc_now"] < figures["acc_then"]
    assert any(f["check"] == "instability" and f["step"] <= 4 for f in flags)  # the ratio runs away: ppo_kl
    # the pointers are the responses carrying it, by the measure they name, against the trace
    arrays = TraceReader(run / "entropy_trace").load_step(blowup[0]["step"])
    mask = arrays["response_mask"]
    pointed = [p["row"] for p in blowup[0]["pointers"]]
    if blowup[0]["pointers"][0]["why"].startswith("largest share of repeated"):
        measure = [repetition_share(arrays["responses"][i][mask[i]].tolist()) for i in range(len(mask))]
    else:
        measure = [float(np.mean(arrays["entropies"][i][mask[i]].astype(np.float64))) for i in range(len(mask))]
    others = [m for i, m in enumerate(measure) if i not in pointed]
    assert len(pointed) == 5 and min(measure[i] for i in pointed) >= max(others) - 1e-3
    # one console line per flag, health/* metrics in metrics.jsonl, and the replay finds the same flags
    lines = [r.getMessage() for r in caplog.records if r.name == "archer.health"]
    assert len(lines) == len(flags) and any(line.startswith("entropy blow-up at step") for line in lines)
    metrics = {r["step"]: r for r in read_step_records(run / "metrics.jsonl")}
    assert metrics[blowup[0]["step"]]["health/entropy_blowup"] == 3.0 and "timing_s/health" in metrics[1]
    replayed = [f.to_json() for f in replay(run).flags]
    assert [same_but_values(f) for f in replayed] == [same_but_values(f) for f in flags]
    assert [p["value"] for f in replayed for p in f["pointers"]] == pytest.approx(
        [p["value"] for f in flags for p in f["pointers"]], rel=1e-5)  # a token's advantage: its response's mean


def test_a_reward_paying_for_length_is_flagged_by_step_10_at_the_longest_wrong_responses(warm, tmp_path: Path) -> None:
    model, files = warm
    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    run = tmp_path / "length"
    train(run, model, files, "trainer.total_training_steps=10", "actor_rollout_ref.actor.optim.lr=1e-3",
          f"custom_reward_function.path={reward}")
    flags = [f for f in flags_of(run) if f["check"] == "length_hacking"]
    assert flags and flags[0]["step"] <= 10, flags_of(run)
    flag = flags[0]
    assert flag["figures"]["length_now"] > flag["figures"]["length_then"] or (
        flag["figures"]["truncated_now"] > flag["figures"]["truncated_then"])
    arrays = TraceReader(run / "entropy_trace").load_step(flag["step"])
    lengths, wrong = arrays["response_mask"].sum(axis=1), arrays["acc"] < 0.5
    pointed = [p["row"] for p in flag["pointers"]]
    assert pointed and all(wrong[i] for i in pointed)
    assert min(lengths[pointed]) >= max(lengths[[i for i in np.flatnonzero(wrong) if i not in pointed]])


def test_a_constant_reward_stops_the_run_at_step_3_with_a_checkpoint_and_resumes_without_a_second_flag(
        warm, tmp_path: Path) -> None:
    model, files = warm
    reward = tmp_path / "constant.py"
    reward.write_text(CONSTANT_REWARD)
    run = tmp_path / "constant"
    summary = train(run, model, files, "trainer.total_training_steps=6", f"custom_reward_function.path={reward}",
                    "trainer.health.stop_on=critical")
    flags = flags_of(run)
    assert [(f["step"], f["check"], f["severity"]) for f in flags] == [(3, "no_signal", "critical")]
    assert flags[0]["message"].startswith("100% of the prompt groups scored alike")
    # one response of each of the 8 groups, all scored 1
    assert sorted(p["row"] for p in flags[0]["pointers"]) == [0, 8, 16, 24, 32] and {
        p["value"] for p in flags[0]["pointers"]} == {1.0}
    assert summary["steps"] == 3 and summary["stopped_by_health"] == flags[0]
    assert (run / "checkpoints" / "global_step_3" / "COMPLETE").is_file()
    assert sorted(r["step"] for r in read_step_records(run / "metrics.jsonl")) == [1, 2, 3]
    assert json.loads((run / "summary.json").read_text())["latest_checkpoint"].endswith("global_step_3/actor")
    # resumed without stop_on: step 4 still has no signal, but that condition was flagged already
    train(run, model, files, "trainer.total_training_steps=4", f"custom_reward_function.path={reward}")
    assert flags_of(run) == flags
    assert read_step_records(run / "metrics.jsonl")[-1]["health/no_signal"] == 3.0
