"""Rollout correction (verl's ``algorithm.rollout_correction``; docs/algorithms.md, "Rollout correction"):
importance-sampling (IS) weights and rejection masks for the gap between the policy that sampled the responses
(the engine's ``rollout_log_probs``: another precision, another kernel, older weights) and the policy that
trains on them, with verl's diagnostics under ``rollout_corr/``.

Per response token, ``log r = log pi_train - log pi_rollout``; pi_train is the proximal policy (``old_log_probs``)
in the decoupled mode, where the trainer corrects the whole batch once, and the current policy in the bypass
mode, where the actor corrects each micro-batch inside its loss (old_log_probs are then the rollout's).

- IS weights (``rollout_is``, a level of ``IS_LEVELS``): token ``exp(log r)``, or sequence
  ``exp(sum_t log r)`` on every token of the response; the exponent is clamped to +-20 (``SAFETY_BOUND``),
  the weights are 0 off the mask, then truncated at ``rollout_is_threshold`` (TIS) or, for a ``"lower_upper"``
  threshold, zeroed outside [lower, upper] (IcePop); ``rollout_is_batch_normalize`` divides them by their mean.
- Rejection (``rollout_rs``, comma-separated options of ``REJECTION_OPTIONS``, each
  ``<aggregation>_<divergence>``): a token or a whole response whose divergence statistic leaves its bound
  is set to 0 in the mask; every option must pass.
- Diagnostics (``offpolicy_metrics``): KL, K3-KL, perplexities and chi-squared of pi_train against pi_rollout.

Every metric is declared (archer.algorithms.metric_sums: Mean, Max, Min, Moments), so the actor adds the
micro-batches' metrics of a mini-batch up exactly; the semantics (which items a mean runs over, which
statistics are taken before truncation) are verl's (verl/trainer/ppo/rollout_corr_helper.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from archer.algorithms.masked import mask_count, masked_mean, masked_sum
from archer.algorithms.metric_sums import (
    Mean,
    Metric,
    masked_max_metric,
    masked_mean_metric,
    masked_min_metric,
    masked_moments_metric,
)
from archer.algorithms.policy_loss import BYPASS_LOSS_TYPES, POLICY_LOSSES, PPO_CLIP, PolicyLoss
from archer.algorithms.registry import Registry
from archer.errors import ArcherError

KEY = "algorithm.rollout_correction"
PREFIX = "rollout_corr/"
RS_REJECTED = "rollout_rs_rejected"  # batch and trace field: [B, R] bool, the tokens rejection took out of the mask
SAFETY_BOUND = 20.0  # exponents of IS weights and divergences are clamped to +-20: weights within [2e-9, 5e8]
BATCH_NORM_EPS = 1e-8


# -- IS levels -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IsLevel:
    """A level of IS weights: ``log_ratio(log r [B, R], mask) -> [B, R]`` (token) or ``[B, 1]`` (one per
    response, broadcast to its tokens)."""

    name: str
    log_ratio: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def per_response(self, log_ratio: torch.Tensor) -> bool:
        return log_ratio.shape[-1] == 1


IS_LEVELS: Registry[IsLevel] = Registry("rollout IS level", f"{KEY}.rollout_is")


def register_is_level(name: str) -> Callable[[Callable], Callable]:
    def add(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
        IS_LEVELS.add(name, IsLevel(name, fn))
        return fn
    return add


@register_is_level("token")
def _token_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each token's own ratio pi_train / pi_rollout (biased, low variance)."""
    return log_ratio


@register_is_level("sequence")
def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The product of the response's token ratios (unbiased, high variance), one per response."""
    return masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)


# -- rejection options ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Divergence:
    """A per-token divergence of log r; ``two_sided``: bounded below and above, in ratio units (k1 = -log r,
    whose bounds lower_upper apply to exp(k1) = pi_rollout / pi_train, as verl's code does), else above only."""

    name: str
    of: Callable[[torch.Tensor], torch.Tensor]
    two_sided: bool


DIVERGENCES: dict[str, Divergence] = {d.name: d for d in (
    Divergence("k1", lambda lr: -lr, two_sided=True),
    Divergence("k2", lambda lr: 0.5 * lr.square(), two_sided=False),
    Divergence("k3", lambda lr: lr.exp() - 1.0 - lr, two_sided=False),
)}


def _seq_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The largest value over each response's tokens; 0 for a response without a token."""
    largest = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(largest), torch.zeros_like(largest), largest)


# How a token statistic becomes one per response ("token": it does not).
AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None] = {
    "token": None,
    "seq_sum": lambda values, mask: masked_sum(values, mask, dim=-1),
    "seq_mean": lambda values, mask: masked_mean(values, mask, dim=-1),
    "seq_max": _seq_max,
}


@dataclass(frozen=True)
class RejectionOption:
    """One ``rollout_rs`` option: a divergence, aggregated per token or per response."""

    name: str
    aggregation: str
    divergence: Divergence

    @property
    def per_response(self) -> bool:
        return self.aggregation != "token"

    def statistic(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the statistic on every token [B, R], the per-response statistic [B] or None for a token option)."""
        values = self.divergence.of(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        aggregate = AGGREGATIONS[self.aggregation]
        if aggregate is None:
            return values, None
        per_response = aggregate(values, mask)
        return per_response.unsqueeze(-1).expand_as(values), per_response


REJECTION_OPTIONS: Registry[RejectionOption] = Registry("rollout rejection option", f"{KEY}.rollout_rs")


def register_rejection_option(aggregation: str, divergence: str) -> RejectionOption:
    """Make ``<aggregation>_<divergence>`` a ``rollout_rs`` option; checked here: both parts exist, and a maximum
    is taken of a one-sided divergence only (the largest k1 of a response has no meaningful lower bound)."""
    if aggregation not in AGGREGATIONS or divergence not in DIVERGENCES:
        raise ArcherError(f"rollout rejection option {aggregation}_{divergence} names an unknown part",
                          f"aggregate by one of {', '.join(AGGREGATIONS)} a divergence of {', '.join(DIVERGENCES)}")
    if aggregation == "seq_max" and DIVERGENCES[divergence].two_sided:
        raise ArcherError(f"rollout rejection option seq_max_{divergence}: a maximum takes an upper bound only",
                          "register seq_max with a one-sided divergence (k2, k3)")
    option = RejectionOption(f"{aggregation}_{divergence}", aggregation, DIVERGENCES[divergence])
    REJECTION_OPTIONS.add(option.name, option)
    return option


for _aggregation in AGGREGATIONS:
    for _divergence in DIVERGENCES:
        if not (_aggregation == "seq_max" and DIVERGENCES[_divergence].two_sided):
            register_rejection_option(_aggregation, _divergence)


# -- settings ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RejectionRule:
    """A rejection option with its bounds in the statistic's units (k1: log of the ratio bounds; lower None:
    no lower bound)."""

    option: RejectionOption
    upper: float
    lower: float | None


@dataclass(frozen=True)
class RolloutCorrection:
    """The settings of ``algorithm.rollout_correction`` (read and checked from the config by
    archer/workers/rollout_correction_config.py).

    is_level: the IS level (None: no weights, diagnostics only); is_upper / is_lower: the truncation bound, and
    IcePop's lower bound when set; rules: the rejection options; bypass_mode: old_log_probs are the rollout's
    (the old-log-prob pass is skipped); loss_type: the bypass mode's loss (ppo_clip or a BYPASS_LOSS_TYPES entry).
    """

    is_level: IsLevel | None = None
    is_upper: float = 2.0
    is_lower: float | None = None
    batch_normalize: bool = False
    rules: tuple[RejectionRule, ...] = ()
    bypass_mode: bool = False
    loss_type: str = PPO_CLIP

    @property
    def applies_weights(self) -> bool:
        """Whether the IS weights multiply the policy loss: in the decoupled mode and in the bypass mode's
        REINFORCE; in the bypass mode's ppo_clip the ratio pi_theta / pi_rollout already corrects (verl)."""
        return self.is_level is not None and not (self.bypass_mode and self.loss_type == PPO_CLIP)

    def policy_loss(self, loss_mode: str) -> PolicyLoss:
        """The policy loss the actor trains with: the bypass mode's loss_type, or ``loss_mode``'s."""
        if self.bypass_mode and self.loss_type != PPO_CLIP:
            if loss_mode != "vanilla":
                raise ArcherError(f"{KEY}.loss_type={self.loss_type} replaces the policy loss, but "
                                  f"actor.policy_loss.loss_mode={loss_mode} asks for another",
                                  f"set actor_rollout_ref.actor.policy_loss.loss_mode=vanilla, or {KEY}.loss_type="
                                  f"{PPO_CLIP} to train {loss_mode} against the rollout log-probs")
            return BYPASS_LOSS_TYPES[self.loss_type]
        return POLICY_LOSSES.lookup(loss_mode)


# -- the correction --------------------------------------------------------------------------------------------
@dataclass
class Correction:
    """What a correction yields: ``weights`` (rollout_is_weights [B, R], detached, 0 off the mask; None without
    rollout_is), ``mask`` (the response mask with rejected tokens set to 0) and the ``rollout_corr/`` metrics."""

    weights: torch.Tensor | None
    mask: torch.Tensor
    metrics: dict[str, Metric]


@torch.no_grad()
def correct(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
            settings: RolloutCorrection) -> Correction:
    """IS weights, rejection mask and diagnostics of pi_train against pi_rollout over ``response_mask``."""
    if not train_log_prob.shape == rollout_log_prob.shape == response_mask.shape:
        raise ValueError(f"log-prob and mask shapes differ: {tuple(train_log_prob.shape)}, "
                         f"{tuple(rollout_log_prob.shape)}, {tuple(response_mask.shape)}")
    train_log_prob, rollout_log_prob = train_log_prob.detach(), rollout_log_prob.detach()
    log_ratio = train_log_prob - rollout_log_prob
    metrics: dict[str, Metric] = {}
    weights = None
    if settings.is_level is not None:
        weights, is_metrics = is_weights(log_ratio, response_mask, settings)
        metrics.update(is_metrics)
    mask = response_mask
    if settings.rules:
        mask, rs_metrics = rejection_mask(log_ratio, response_mask, settings.rules)
        metrics.update(rs_metrics)
    metrics.update(offpolicy_metrics(train_log_prob, rollout_log_prob, response_mask))
    return Correction(weights, mask, {PREFIX + name: metric for name, metric in metrics.items()})


def _rows(values: torch.Tensor) -> Mean:
    """The mean of one value per response, over every response (verl's batch means)."""
    return Mean(values.sum(), values.numel())


def _row_max(values: torch.Tensor) -> Metric:
    return masked_max_metric(values, torch.ones_like(values, dtype=torch.bool))


def _row_min(values: torch.Tensor) -> Metric:
    return masked_min_metric(values, torch.ones_like(values, dtype=torch.bool))


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, settings: RolloutCorrection
               ) -> tuple[torch.Tensor, dict[str, Metric]]:
    """The truncated (or IcePop-zeroed) IS weights [B, R] of ``settings.is_level``, batch-normalised when asked,
    and their metrics (taken before the normalisation)."""
    level = settings.is_level
    level_ratio = level.log_ratio(log_ratio, mask)
    raw = level_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(log_ratio) * mask
    upper, lower = settings.is_upper, settings.is_lower
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, level_ratio, mask, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean_metric(((raw < lower) | (raw > upper)).float(), mask)
    if settings.batch_normalize:
        if level.per_response(level_ratio):
            present = mask_count(mask, dim=-1) > 0
            mean = masked_mean(weights, mask, dim=-1)[present].mean() if present.any() else weights.new_zeros(())
        else:
            mean = masked_mean(weights, mask)
        factor = float(mean) if float(mean) > BATCH_NORM_EPS else 1.0
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = Mean(factor, 1)
    return weights, metrics


def _is_metrics(weights: torch.Tensor, raw: torch.Tensor, level_ratio: torch.Tensor, mask: torch.Tensor,
                level: IsLevel, upper: float, lower: float | None) -> dict[str, Metric]:
    """verl's IS metrics: mean, extremes, shares beyond the bounds (per response for the sequence level, from the
    unclamped log ratios), std and effective sample size of the weights clamped to [0, upper], and per-response
    statistics of each response's mean weight."""
    low = 1.0 / upper if lower is None else lower
    metrics: dict[str, Metric] = {"rollout_is_mean": masked_mean_metric(weights, mask)}
    if level.per_response(level_ratio):
        per_response = level_ratio.squeeze(-1)
        metrics["rollout_is_max"] = _row_max(per_response.clamp(max=SAFETY_BOUND).exp())
        metrics["rollout_is_min"] = _row_min(per_response.exp())
        metrics["rollout_is_ratio_fraction_high"] = _rows((per_response > math.log(upper)).float())
        metrics["rollout_is_ratio_fraction_low"] = _rows((per_response < math.log(low)).float())
    else:
        metrics["rollout_is_max"] = masked_max_metric(weights, mask)
        metrics["rollout_is_min"] = masked_min_metric(weights, mask)
        metrics["rollout_is_ratio_fraction_high"] = masked_mean_metric((raw > upper).float(), mask)
        metrics["rollout_is_ratio_fraction_low"] = masked_mean_metric((raw < low).float(), mask)
    clamped = weights.clamp(0.0, upper)
    metrics["rollout_is_std"] = masked_moments_metric(clamped, mask, "std")
    metrics["rollout_is_eff_sample_size"] = masked_moments_metric(clamped, mask, "ess")
    response_mean = masked_mean(weights, mask, dim=-1)
    raw_response_mean = masked_mean(raw, mask, dim=-1)
    metrics.update({
        "rollout_is_seq_mean": _rows(response_mean),
        "rollout_is_seq_std": masked_moments_metric(response_mean, torch.ones_like(response_mean), "sample_std"),
        "rollout_is_seq_max": _row_max(response_mean),
        "rollout_is_seq_min": _row_min(response_mean),
        "rollout_is_seq_max_deviation": _row_max((response_mean - 1.0).abs()),
        "rollout_is_seq_fraction_high": _rows((raw_response_mean > upper).float()),
        "rollout_is_seq_fraction_low": _rows((raw_response_mean < low).float()),
    })
    return metrics


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, rules: tuple[RejectionRule, ...]
                   ) -> tuple[torch.Tensor, dict[str, Metric]]:
    """The mask with every token (or response) some rule rejects set to 0, and verl's rejection metrics."""
    valid = mask.bool()
    present = valid.any(dim=-1)
    keep_all = torch.ones_like(valid)
    metrics: dict[str, Metric] = {}
    for rule in rules:
        statistic, per_response = rule.option.statistic(log_ratio, mask)
        keep = statistic <= rule.upper
        if rule.lower is not None:
            keep &= statistic >= rule.lower
        keep_all &= keep
        metrics.update(_rule_metrics(rule, statistic, per_response, keep, mask, present))
    metrics["rollout_rs_masked_fraction"] = masked_mean_metric((~keep_all).float(), mask)
    metrics["rollout_rs_seq_masked_fraction"] = _rows((valid & ~keep_all).any(dim=-1).float())
    return mask * keep_all.to(mask.dtype), metrics


def _rule_metrics(rule: RejectionRule, statistic: torch.Tensor, per_response: torch.Tensor | None,
                  keep: torch.Tensor, mask: torch.Tensor, present: torch.Tensor) -> dict[str, Metric]:
    """verl's metrics of one option: its statistic's token mean, extremes and shares beyond the bounds (over the
    responses with a token for a per-response option), its std clamped to the bounds, per-response summaries,
    and the shares of tokens and responses it rejects."""
    lower = 0.0 if rule.lower is None else rule.lower
    responses = masked_mean(statistic, mask, dim=-1) if per_response is None else per_response
    present_float = present.float()
    out: dict[str, Metric] = {"mean": masked_mean_metric(statistic, mask)}
    if per_response is not None:
        out["max"] = masked_max_metric(responses, present)
        out["min"] = masked_min_metric(responses, present)
        out["fraction_high"] = masked_mean_metric((responses > rule.upper).float(), present_float)
        out["fraction_low"] = masked_mean_metric((responses < lower).float() if rule.lower is not None
                                                 else torch.zeros_like(responses), present_float)
    else:
        out["max"] = masked_max_metric(statistic, mask)
        out["min"] = masked_min_metric(statistic, mask)
        out["fraction_high"] = masked_mean_metric((statistic > rule.upper).float(), mask)
        out["fraction_low"] = masked_mean_metric((statistic < lower).float() if rule.lower is not None
                                                 else torch.zeros_like(statistic), mask)
    out["std"] = masked_moments_metric(statistic.clamp(lower, rule.upper), mask, "std")
    out["seq_mean"] = masked_mean_metric(responses, present_float)
    out["seq_std"] = masked_moments_metric(responses, present_float, "sample_std")
    out["seq_max"] = masked_max_metric(responses, present)
    out["seq_min"] = masked_min_metric(responses, present)
    out["seq_max_deviation"] = masked_max_metric(responses.abs(), present)
    out["seq_fraction_high"] = masked_mean_metric((responses > rule.upper).float(), present_float)
    if rule.lower is not None:
        out["seq_fraction_low"] = masked_mean_metric((responses < rule.lower).float(), present_float)
    out["masked_fraction"] = masked_mean_metric((~keep).float(), mask)
    out["seq_masked_fraction"] = masked_mean_metric((mask.bool() & ~keep).any(dim=-1).float(), present_float)
    return {f"rollout_rs_{rule.option.name}_{name}": metric for name, metric in out.items()}


def offpolicy_metrics(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
                      ) -> dict[str, Metric]:
    """verl's diagnostics of the gap: perplexities (a response's exp of its mean negative log-prob, averaged over
    responses), kl = E[log pi_rollout - log pi_train] and k3_kl over tokens, the responses' log-perplexity
    differences, and the chi-squared divergence of the token and of the sequence ratios."""
    log_ratio = train_log_prob - rollout_log_prob
    train_mean = masked_mean(train_log_prob, mask, dim=-1)
    rollout_mean = masked_mean(rollout_log_prob, mask, dim=-1)
    log_ppl_diff = rollout_mean - train_mean
    bounded = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    sequence = masked_sum(log_ratio, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": _rows((-train_mean).exp()),
        "training_log_ppl": _rows(-train_mean),
        "kl": masked_mean_metric(-log_ratio, mask),
        "k3_kl": masked_mean_metric(log_ratio.exp() - log_ratio - 1.0, mask),
        "rollout_ppl": _rows((-rollout_mean).exp()),
        "rollout_log_ppl": _rows(-rollout_mean),
        "log_ppl_diff": _rows(log_ppl_diff),
        "log_ppl_abs_diff": _rows(log_ppl_diff.abs()),
        "log_ppl_diff_max": _row_max(log_ppl_diff),
        "log_ppl_diff_min": _row_min(log_ppl_diff),
        "ppl_ratio": _rows(log_ppl_diff.exp()),
        "chi2_token": masked_mean_metric(bounded.exp().square() - 1.0, mask),
        "chi2_seq": _rows((2.0 * sequence).exp() - 1.0),
    }
