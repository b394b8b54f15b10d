"""The actor's objective on one micro-batch: the policy loss with the settings, options, inputs and switches
its registration declares (archer.algorithms.policy_loss), top-entropy token selection, AEPO's entropy-aware
advantage, the entropy bonus and the KL loss (Archer's split KL for a loss on the entropy split), and verl's
rollout correction (archer.algorithms.rollout_correction): in the decoupled mode the trainer's IS weights
(``rollout_is_weights``) multiply the policy loss; in the bypass mode (old_log_probs are the rollout's) each
micro-batch is corrected here, against the current policy, and the bypass loss type may replace the policy loss.

Every term is normalised over its whole mini-batch (the normalisers come from `mini_batch_normalisers`), so
the micro-batch losses add up to the mini-batch loss, and every metric is declared (a Mean, a Total, or for
the bypass mode's rollout_corr/* also a Max, Min or Moments: archer.algorithms.metric_sums), so the micro-batch
metrics add up to the mini-batch's too. (AEPO's entropy-aware advantage standardises the entropy over each
micro-batch, as its paper's code does, and the bypass mode's rollout_is_batch_normalize divides by each
micro-batch's mean weight, as verl's; those steps alone depend on the split.) Token entropies come from the training forward pass
(detached) whenever a term
needs them, whatever entropy_coeff is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from archer.algorithms.aggregation import AGG_MODES, mini_batch_totals
from archer.algorithms.entropy import entropy_loss
from archer.algorithms.entropy_advantage import entropy_advantage_metrics, entropy_advantage_scale
from archer.algorithms.kl import KL_ESTIMATORS, kl_loss, kl_penalty
from archer.algorithms.masked import masked_mean
from archer.algorithms.metric_sums import Metric, Total, masked_mean_metric, total_metric
from archer.algorithms.policy_loss import (
    LOSS_SWITCHES,
    POLICY_LOSSES,
    PolicyLoss,
    compute_policy_loss,
    option_keyword,
)
from archer.algorithms.rollout_correction import RolloutCorrection, correct
from archer.algorithms.token_selection import high_entropy_tokens, top_entropy_count, top_entropy_tokens
from archer.errors import ArcherError

log = logging.getLogger(__name__)

ACTOR_KEY = "actor_rollout_ref.actor"


@dataclass(frozen=True)
class ActorObjective:
    """The loss settings of `actor_rollout_ref.actor`, read once.

    policy_loss: the loss it trains with (actor.policy_loss.loss_mode's, or the bypass mode's loss type).
    loss_kwargs: the keyword arguments of the policy loss that come from the config (the shared settings it
    declares, its options, a null option resolved to the loss's own default, and the switches it supports).
    entropy_balanced_advantage(_coef): AEPO's entropy-aware advantage and its coefficient.
    bypass: the rollout correction when its bypass mode is on (each micro-batch corrected in the loss), else None.
    """

    policy_loss: PolicyLoss
    loss_agg_mode: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    entropy_top_ratio: float | None
    token_entropy_quantile: float
    high_entropy_kl_loss_scale_coef: float
    entropy_balanced_advantage: bool
    entropy_balanced_advantage_coef: float
    loss_kwargs: dict[str, float | bool] = field(default_factory=dict)
    bypass: RolloutCorrection | None = None

    @classmethod
    def from_config(cls, a: DictConfig, rollout_correction: RolloutCorrection | None = None) -> ActorObjective:
        """Read and check the settings (``rollout_correction``: algorithm.rollout_correction's, read by the
        caller); unknown names fail here, before any model work."""
        correction = rollout_correction or RolloutCorrection()
        loss = correction.policy_loss(str(a.policy_loss.loss_mode))
        agg_mode = str(a.loss_agg_mode)
        AGG_MODES.lookup(agg_mode)
        if a.use_kl_loss:
            KL_ESTIMATORS.lookup(a.kl_loss_type)
        if loss.agg_mode is not None and agg_mode != loss.agg_mode:
            log.warning("policy_loss.loss_mode=%s always aggregates %s (its objective); actor.loss_agg_mode=%s "
                        "applies to the entropy and KL terms only", loss.name, loss.agg_mode, agg_mode)
        kwargs: dict[str, float | bool] = {name: shared_setting(a, name) for name in loss.settings}
        kwargs.update(loss_options(loss, a))
        kwargs.update(loss_switches(loss, a))
        return cls(
            policy_loss=loss, loss_agg_mode=agg_mode, entropy_coeff=float(a.entropy_coeff),
            use_kl_loss=bool(a.use_kl_loss), kl_loss_coef=float(a.kl_loss_coef), kl_loss_type=str(a.kl_loss_type),
            entropy_top_ratio=None if a.entropy_top_ratio is None else float(a.entropy_top_ratio),
            token_entropy_quantile=float(a.token_entropy_quantile),
            high_entropy_kl_loss_scale_coef=float(a.high_entropy_kl_loss_scale_coef),
            entropy_balanced_advantage=bool(a.enable_entropy_balanced_advantage),
            entropy_balanced_advantage_coef=float(a.entropy_balanced_advantage_coef), loss_kwargs=kwargs,
            bypass=correction if correction.bypass_mode else None)

    @property
    def loss_mode(self) -> str:
        """The name of the policy loss it trains with."""
        return self.policy_loss.name

    @property
    def splits_by_entropy(self) -> bool:
        """A loss on Archer's entropy split; its KL loss is the split KL too."""
        return "high_entropy_mask" in self.policy_loss.inputs

    @property
    def chooses_per_micro_batch(self) -> bool:
        """Whether a step of the loss depends on which rows share a micro-batch: top-entropy tokens, Archer's
        entropy split (and its split KL's class weights), AEPO's entropy standardisation, the bypass mode's
        batch-normalised weights (see the module docstring)."""
        return (self.entropy_top_ratio is not None or self.splits_by_entropy or self.entropy_balanced_advantage
                or (self.bypass is not None and self.bypass.batch_normalize))

    @property
    def needs_entropy(self) -> bool:
        """Whether the training forward pass must return token entropies."""
        return (self.entropy_coeff != 0 or self.splits_by_entropy or self.entropy_top_ratio is not None
                or self.entropy_balanced_advantage)

    def mini_batch_normalisers(self, mask: torch.Tensor, parts: Sequence[torch.Tensor]
                               ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Normalisers of a whole mini-batch (its loss mask; ``parts``: the rows of each of its micro-batches):
        (for the entropy and KL terms, for the policy loss).

        With entropy_top_ratio the policy loss counts only the selected tokens: ceil(ratio * N) of each
        micro-batch, known before the forward pass.
        """
        common = mini_batch_totals(mask)
        if self.entropy_top_ratio is None:
            return common, common
        selected = sum(top_entropy_count(int(mask[rows].bool().sum()), self.entropy_top_ratio) for rows in parts)
        return common, {**common, "num_tokens": max(float(selected), 1.0)}

    def micro_batch_loss(self, *, log_prob: torch.Tensor, entropy: torch.Tensor | None, old_log_prob: torch.Tensor,
                         advantages: torch.Tensor, mask: torch.Tensor, ref_log_prob: torch.Tensor | None,
                         agg_kwargs: dict[str, Any], pg_agg_kwargs: dict[str, Any],
                         rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Metric]]:
        """(total loss, metrics without the "actor/" prefix, the policy loss as pg_loss; the bypass mode's
        rollout_corr/* under their own names) of one micro-batch. ``rollout_is_weights``: the decoupled mode's
        IS weights of its rows."""
        metrics: dict[str, Metric] = {}
        pg_mask = mask
        if self.entropy_top_ratio is not None:
            selected = top_entropy_tokens(entropy, mask, self.entropy_top_ratio)
            pg_mask = mask * selected
            metrics["top_entropy_selected_frac"] = masked_mean_metric(selected.float(), mask)
            metrics["top_entropy_selected_tokens"] = Total(selected.sum().float())
        if self.entropy_balanced_advantage:
            scale = entropy_advantage_scale(entropy, mask, self.entropy_balanced_advantage_coef)
            metrics.update(entropy_advantage_metrics(scale, advantages, pg_mask))
            advantages = advantages * scale
        if self.bypass is not None:  # old_log_prob are the rollout's: pi_theta against pi_rollout, per micro-batch
            correction = correct(log_prob, old_log_prob, pg_mask, self.bypass)
            metrics.update(correction.metrics)
            pg_mask = correction.mask
            rollout_is_weights = correction.weights if self.bypass.applies_weights else None
        inputs = {name: INPUT_BUILDERS[name](self, entropy, mask) for name in self.policy_loss.inputs}
        pg_loss, pg_metrics = compute_policy_loss(
            self.policy_loss, old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
            response_mask=pg_mask, loss_agg_mode=self.loss_agg_mode, agg_kwargs=pg_agg_kwargs,
            rollout_is_weights=rollout_is_weights, **self.loss_kwargs, **inputs)
        metrics["pg_loss"] = total_metric(pg_loss)
        metrics.update(pg_metrics)
        loss = pg_loss
        if self.entropy_coeff != 0:
            ent_loss = entropy_loss(entropy.float(), mask, self.loss_agg_mode, agg_kwargs)
            loss = loss - self.entropy_coeff * ent_loss
            metrics["entropy_loss"] = total_metric(ent_loss)
        if self.use_kl_loss:
            if self.splits_by_entropy:
                kl_term = self._split_kl(log_prob, ref_log_prob, mask, inputs["high_entropy_mask"], agg_kwargs)
            else:
                kl_term = kl_loss(log_prob, ref_log_prob, mask, self.kl_loss_type, self.loss_agg_mode, agg_kwargs)
            loss = loss + self.kl_loss_coef * kl_term
            metrics["kl_loss"] = total_metric(kl_term)
        return loss, metrics

    def _split_kl(self, log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor,
                  high: torch.Tensor, agg_kwargs: dict[str, Any]) -> torch.Tensor:
        """Archer's KL: tokenmean_low(KL) + scale * tokenmean_high(KL), each over its own class's tokens.

        Each class mean is taken over the micro-batch and weighted by the micro-batch's share of the
        mini-batch's tokens, so that equal micro-batches add up to the mini-batch means.
        """
        kl = kl_penalty(log_prob, ref_log_prob, self.kl_loss_type)
        valid = mask.bool()
        share = (valid.sum().double() / agg_kwargs["num_tokens"]).float()  # a tensor: the host does not wait
        low_mean = masked_mean(kl, valid & ~high)
        high_mean = masked_mean(kl, valid & high)
        return share * (low_mean + self.high_entropy_kl_loss_scale_coef * high_mean)


def _high_entropy_mask(objective: ActorObjective, entropy: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    return high_entropy_tokens(entropy, mask, objective.token_entropy_quantile)


# How the actor builds each per-micro-batch input a loss can declare (the names of policy_loss.LOSS_INPUTS).
InputBuilder = Callable[[ActorObjective, torch.Tensor | None, torch.Tensor], torch.Tensor]
INPUT_BUILDERS: dict[str, InputBuilder] = {"high_entropy_mask": _high_entropy_mask}


def shared_setting(a: DictConfig, name: str) -> float:
    """One of verl's shared loss settings; clip_ratio_low/high fall back to clip_ratio when null."""
    value = a[name]
    if value is None and name in ("clip_ratio_low", "clip_ratio_high"):
        value = a.clip_ratio
    return float(value)


def loss_options(loss: PolicyLoss, a: DictConfig) -> dict[str, float]:
    """The loss's options from the actor config: keyword -> value, null meaning the loss's own default."""
    out = {}
    for key, default in loss.options.items():
        value = OmegaConf.select(a, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ArcherError(f"{ACTOR_KEY}.{key}={value!r} is not a number",
                              f"set it to a number, or to null for the {loss.name} loss's default ({default})")
        out[option_keyword(key)] = float(default if value is None else value)
    return out


def loss_switches(loss: PolicyLoss, a: DictConfig) -> dict[str, bool]:
    """The switches the loss supports, from the actor config; a switch that is on for a loss that does not
    support it is an error."""
    for name in LOSS_SWITCHES:
        if a[name] and name not in loss.switches:
            supported = sorted(n for n, entry in POLICY_LOSSES.items() if name in entry.switches)
            raise ArcherError(f"{ACTOR_KEY}.{name}=true does not apply to policy_loss.loss_mode={loss.name}",
                              f"use it with loss_mode {' | '.join(supported)}, or set it to false "
                              "(docs/presets.md says why)")
    return {name: bool(a[name]) for name in loss.switches}
