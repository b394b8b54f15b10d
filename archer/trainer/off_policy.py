"""The trainer's side of off-policy training: the policy version of every response and its staleness at update
time (``training/off_policy/*``), and verl's rollout correction applied to a step's batch
(``algorithm.rollout_correction``, archer/algorithms/rollout_correction.py; docs/algorithms.md).

A policy version counts weight updates: version v is the policy after the update of global step v (0: the
initial model). The engine samples step s's responses with version s - 1 in the synchronous loop, and step s
updates version s - 1, so every response is 0 versions stale. A response carries the newest version that wrote
one of its tokens (``policy_version``, verl's max_global_steps) and the oldest (``first_policy_version``, verl's
min_global_steps); they differ only when a partial rollout resumes a request under newer weights (docs/async.md).

The rollout correction has two modes. Decoupled (the default): the old-log-prob pass gives the proximal policy,
and ``correct_batch`` computes the IS weights (``rollout_is_weights``) and the rejection mask of the whole batch
against the engine's ``rollout_log_probs`` before the advantages, with the ``rollout_corr/*`` metrics; rejected
tokens leave ``response_mask`` (what every later stage learns from) and are kept in ``rollout_rs_rejected`` for
the traces. Bypass: ``rollout_log_probs_as_old`` skips the pass (old_log_probs and entropies are the engine's) and
the actor corrects each micro-batch in its loss.
"""

from __future__ import annotations

import numpy as np
from omegaconf import DictConfig

from archer.algorithms.rollout_correction import RS_REJECTED, correct
from archer.batch import Batch
from archer.rollout.request_pool import FIRST_POLICY_VERSION, POLICY_VERSION
from archer.workers.rollout_correction_config import read_rollout_correction

STALENESS = "staleness"  # row: versions between policy_version and the version the step updates
OFF_POLICY = "training/off_policy/"


def _stats(name: str, values: np.ndarray) -> dict[str, float]:
    return {f"{OFF_POLICY}{name}/mean": float(values.mean()), f"{OFF_POLICY}{name}/max": float(values.max()),
            f"{OFF_POLICY}{name}/min": float(values.min())}


def record_staleness(batch: Batch, trainer_version: int) -> dict[str, float]:
    """Each response's staleness at update time (``trainer_version``: the version the step updates) into the
    batch, and verl's ``training/off_policy/*`` metrics: trajectory_staleness (from the newest version of a
    response), trajectory_staleness_worst (from the oldest), trajectory_spans (versions a response spans), and
    archer's stale_fraction (the share of responses at least one version old)."""
    newest = np.asarray(batch[POLICY_VERSION], dtype=np.int64)
    oldest = np.asarray(batch[FIRST_POLICY_VERSION], dtype=np.int64)
    staleness = trainer_version - newest
    batch[STALENESS] = staleness
    return {**_stats("trajectory_staleness", staleness), **_stats("trajectory_staleness_worst", trainer_version - oldest),
            **_stats("trajectory_spans", newest - oldest + 1), f"{OFF_POLICY}stale_fraction": float(np.mean(staleness > 0))}


class RolloutCorrectionStage:
    """``algorithm.rollout_correction`` on the trainer's batches (checked when built)."""

    def __init__(self, cfg: DictConfig) -> None:
        self.settings = read_rollout_correction(cfg)

    @property
    def bypass(self) -> bool:
        """The bypass mode: no old-log-prob pass; the actor corrects in its loss."""
        return self.settings.bypass_mode

    @staticmethod
    def rollout_log_probs_as_old(batch: Batch) -> Batch:
        """The bypass mode's stand-in for the old-log-prob pass: the engine's log-probs and entropies (the rollout
        policy is the old policy)."""
        return Batch({"old_log_probs": batch["rollout_log_probs"], "entropies": batch["rollout_entropies"]})

    def correct_batch(self, batch: Batch) -> dict[str, float]:
        """The decoupled mode: IS weights and rejection of old_log_probs against rollout_log_probs into
        ``batch``, and the ``rollout_corr/*`` metrics (none in the bypass mode, whose actor reports them)."""
        if self.bypass or not len(batch):
            return {}
        mask = batch["response_mask"]
        result = correct(batch["old_log_probs"], batch["rollout_log_probs"], mask, self.settings)
        if result.weights is not None:
            batch["rollout_is_weights"] = result.weights
        if self.settings.rules:
            batch[RS_REJECTED] = mask.bool() & ~result.mask.bool()
            batch["response_mask"] = result.mask
        return {name: metric.value for name, metric in result.metrics.items()}

