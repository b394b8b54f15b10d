"""The trainer's side of off-policy training (archer/trainer/off_policy.py): policy versions and the
training/off_policy/* staleness metrics by hand, and the rollout correction on a hand-built batch (the decoupled
mode's weights, rejection and metrics; the bypass mode's engine log-probs as the old ones)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from workers_support import hand_batch

from archer.batch import Batch
from archer.rollout.request_pool import stamp_policy_version
from archer.trainer.off_policy import RolloutCorrectionStage, record_staleness

# hand_batch's RESPONSE_MASK [[1,1,0],[1,1,1],[1,0,0]]; log(old / rollout) on its tokens: ln 3, 0 | 0, ln 0.25, 0 | 0
OLD = torch.tensor([[-1.0, -0.5, 0.0], [-0.2, -1.5, -0.7], [-0.9, 0.0, 0.0]])
LOG_R = torch.tensor([[math.log(3.0), 0.0, 0.0], [0.0, math.log(0.25), 0.0], [0.0, 0.0, 0.0]])


def correction(**values) -> RolloutCorrectionStage:
    base = {"rollout_is": None, "rollout_is_threshold": "2.0", "rollout_is_batch_normalize": False,
            "rollout_rs": None, "rollout_rs_threshold": None, "bypass_mode": False, "loss_type": "ppo_clip"}
    return RolloutCorrectionStage(OmegaConf.create({**base, **values}))


def scored_batch() -> Batch:
    batch = hand_batch()
    batch["old_log_probs"] = OLD
    batch["rollout_log_probs"] = OLD - LOG_R
    batch["rollout_entropies"] = torch.full((3, 3), 0.5)
    return batch


def test_the_sync_loop_stamps_every_response_with_the_previous_steps_version_and_zero_staleness():
    batch = hand_batch()
    stamp_policy_version(batch, 6)
    assert batch["policy_version"].tolist() == [6, 6, 6] and batch["first_policy_version"].tolist() == [6, 6, 6]
    metrics = record_staleness(batch, trainer_version=6)
    assert batch["staleness"].tolist() == [0, 0, 0]
    assert metrics == {f"training/off_policy/{name}/{stat}": value
                       for name, value in (("trajectory_staleness", 0.0), ("trajectory_staleness_worst", 0.0),
                                           ("trajectory_spans", 1.0)) for stat in ("mean", "max", "min")
                       } | {"training/off_policy/stale_fraction": 0.0}


def test_staleness_of_responses_sampled_across_versions_by_hand():
    """What the asynchronous modes will hand the trainer: versions 4..6, one response resumed across 3 -> 5."""
    batch = hand_batch()
    batch["policy_version"] = np.array([6, 5, 4])
    batch["first_policy_version"] = np.array([6, 3, 4])
    metrics = record_staleness(batch, trainer_version=6)
    assert batch["staleness"].tolist() == [0, 1, 2]
    expected = {"trajectory_staleness": (1.0, 2.0, 0.0), "trajectory_staleness_worst": (5 / 3, 3.0, 0.0),
                "trajectory_spans": (5 / 3, 3.0, 1.0)}  # spans 1, 5 - 3 + 1, 1
    for name, (mean, high, low) in expected.items():
        assert [metrics[f"training/off_policy/{name}/{s}"] for s in ("mean", "max", "min")] == pytest.approx(
            [mean, high, low]), name
    assert metrics["training/off_policy/stale_fraction"] == pytest.approx(2 / 3)


def test_the_decoupled_mode_puts_weights_and_rejection_into_the_batch():
    batch = scored_batch()
    stage = correction(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    assert not stage.bypass
    metrics = stage.correct_batch(batch)
    # weights min(r, 2) on the mask: 2, 1 | 1, 0.25, 1 | 1
    torch.testing.assert_close(batch["rollout_is_weights"], torch.tensor([[2.0, 1.0, 0.0], [1.0, 0.25, 1.0],
                                                                          [1.0, 0.0, 0.0]]))
    # token_k1 keeps 1 / r in [0.5, 2]: rejects r = 3 and r = 0.25
    assert batch["response_mask"].tolist() == [[0, 1, 0], [1, 0, 1], [1, 0, 0]]
    assert batch["response_mask"].dtype == torch.long
    assert batch["rollout_rs_rejected"].tolist() == [[True, False, False], [False, True, False], [False] * 3]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 6)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(6.25 / 6)
    assert metrics["rollout_corr/kl"] == pytest.approx(-math.log(3 * 0.25) / 6)
    assert all(isinstance(v, float) for v in metrics.values())


def test_diagnostics_alone_change_nothing_in_the_batch():
    batch = scored_batch()
    before = {k: v.clone() for k, v in batch.tensors.items()}
    metrics = correction().correct_batch(batch)
    assert batch.tensors.keys() == before.keys(), "no weights, no rejection"
    assert all(torch.equal(batch[k], v) for k, v in before.items())
    assert metrics["rollout_corr/chi2_token"] == pytest.approx((9 + 1 + 1 + 1 / 16 + 1 + 1) / 6 - 1)
    assert not any(k.startswith(("rollout_corr/rollout_is", "rollout_corr/rollout_rs")) for k in metrics)


def test_the_bypass_mode_takes_the_engines_log_probs_as_the_old_ones():
    batch = scored_batch()
    stage = correction(bypass_mode=True, rollout_is="token")
    assert stage.bypass
    old = stage.rollout_log_probs_as_old(batch)
    assert torch.equal(old["old_log_probs"], batch["rollout_log_probs"])
    assert torch.equal(old["entropies"], batch["rollout_entropies"])
    assert stage.correct_batch(batch) == {}, "the actor corrects in its loss"
    assert "rollout_is_weights" not in batch
