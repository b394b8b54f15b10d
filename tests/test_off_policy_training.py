"""The rollout correction and the policy versions in training (GRPO on CPU with a micro model, 2 steps each): the
decoupled mode's rollout_corr/* metrics and rejected tokens in the trace, the bypass mode without the
old-log-prob pass, the training/off_policy/* metrics of the synchronous loop, and the trace's policy versions.

On the CPU the hf engine's log-probs match the trainer's to float rounding (tests/test_workers_rollout.py), so
the IS weights are 1 to about 1e-5 and the bypass mode's first update is the decoupled mode's. The micro model and
the task come from conftest.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from archer.config.loader import load_config
from archer.trace.format import TraceReader
from archer.trainer.ppo import PPOTrainer

pytestmark = pytest.mark.slow

RC = "algorithm.rollout_correction."
OFF_POLICY_KEYS = [f"training/off_policy/{name}/{stat}" for name in ("trajectory_staleness",
                   "trajectory_staleness_worst", "trajectory_spans") for stat in ("mean", "max", "min")]


def train(root: Path, name: str, model: Path, files: dict[str, Path], *extra: str) -> tuple[Path, dict[int, dict]]:
    run = root / name
    cfg = load_config("ppo_trainer", [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={files['train']}", "data.max_prompt_length=32",
        "data.max_response_length=12", "trainer.device=cpu", f"trainer.default_local_dir={run}",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.total_training_steps=2", "trainer.logger=[jsonl]", "trainer.plots=False",
        "trainer.val_before_train=False", "+trainer.entropy_trace.enable=True", *extra])
    PPOTrainer(cfg).fit()
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return run, {record.pop("step"): record for record in lines}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, micro_model: Path, task_files: dict[str, Path]
         ) -> dict[str, tuple[Path, dict[int, dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("off_policy")
    return {
        "plain": train(root, "plain", micro_model, task_files),
        # k2 above 1e-20 is any difference at all between the engine's and the trainer's log-prob of a token
        "decoupled": train(root, "decoupled", micro_model, task_files, RC + "rollout_is=token",
                           RC + "rollout_rs=token_k2", RC + "rollout_rs_threshold=1e-20"),
        "bypass": train(root, "bypass", micro_model, task_files, RC + "bypass_mode=true", RC + "rollout_is=token"),
    }


def test_the_sync_loop_reports_fresh_responses_and_traces_their_versions(runs) -> None:
    run, metrics = runs["plain"]
    for step in (1, 2):
        assert [metrics[step][k] for k in OFF_POLICY_KEYS] == [0.0] * 6 + [1.0] * 3
        assert metrics[step]["training/off_policy/stale_fraction"] == 0.0
        arrays = TraceReader(run / "entropy_trace").load_step(step)
        assert arrays["policy_version"].tolist() == [step - 1] * 16 and arrays["staleness"].tolist() == [0] * 16
        assert "rollout_rs_rejected" not in arrays
    # the diagnostics are logged in the default decoupled mode, IS weights and rejection are not
    assert abs(metrics[1]["rollout_corr/kl"]) < 1e-4 and metrics[1]["rollout_corr/training_ppl"] > 1
    assert not any(k.startswith(("rollout_corr/rollout_is", "rollout_corr/rollout_rs")) for k in metrics[1])


def test_the_decoupled_mode_weights_and_rejects_before_the_update(runs) -> None:
    run, metrics = runs["decoupled"]
    plain = runs["plain"][1][1]  # the plain run's first step
    first = metrics[1]
    assert first["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
    assert first["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0, abs=1e-4)
    assert "timing_s/old_log_prob" in first
    for step in (1, 2):
        arrays = TraceReader(run / "entropy_trace").load_step(step)
        rejected, written = arrays["rollout_rs_rejected"], arrays["response_mask"]
        assert not np.any(rejected & ~written), "a rejected token is still one the policy wrote"
        fraction = metrics[step]["rollout_corr/rollout_rs_masked_fraction"]
        assert rejected.sum() == pytest.approx(fraction * written.sum()), "the trace marks what was rejected"
    assert 0 < first["rollout_corr/rollout_rs_masked_fraction"] < 1
    # the same responses as the plain run (same seeds, same weights at step 1), fewer learned tokens
    assert first["response_length/mean"] == plain["response_length/mean"]
    assert first["critic/score/mean"] == plain["critic/score/mean"]


def test_the_bypass_mode_skips_the_old_log_prob_pass_and_corrects_in_the_actor(runs) -> None:
    run, metrics = runs["bypass"]
    plain = runs["plain"][1][1]  # the plain run's first step
    for step in (1, 2):
        assert "timing_s/old_log_prob" not in metrics[step] and "timing_s/old_log_prob" in runs["plain"][1][step]
        assert {"rollout_corr/rollout_is_mean", "rollout_corr/kl", "rollout_corr/chi2_token"} <= metrics[step].keys()
        assert metrics[step]["training/off_policy/trajectory_staleness/max"] == 0.0
    # old = the engine's log-probs, equal to the trainer's here: the same first update as the decoupled default
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm", "actor/entropy", "critic/score/mean"):
        assert metrics[1][key] == pytest.approx(plain[key], rel=1e-3, abs=1e-6), key
    assert metrics[1]["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-2), "mini-batch 2 has moved"
