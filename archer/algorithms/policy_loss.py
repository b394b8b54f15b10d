"""Policy losses (`actor.policy_loss.loss_mode`), by name: PPO clip with dual-clip ("vanilla"), GSPO, Archer's
dual-token constraints, ASPO, Clip-Cov and KL-Cov (REFERENCE.md sections 1, 2 and 5).

A loss function takes keyword arguments (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
clip_ratio_low, clip_ratio_high, clip_ratio_c, agg_kwargs, plus any of its own) and returns
(scalar loss, metrics) with metrics pg_clipfrac, ppo_kl and pg_clipfrac_lower as detached tensors, plus
the metrics of its own mechanism. Metric names ending in "_tokens" are counts (summed over micro-batches);
the others are fractions or means over the valid tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from archer.algorithms.aggregation import agg_loss
from archer.algorithms.masked import masked_mean
from archer.algorithms.registry import Registry
from archer.algorithms.token_selection import (
    advantage_logp_covariance,
    clip_cov_tokens,
    kl_cov_tokens,
)
from archer.errors import ArcherError

LOG_RATIO_CLAMP = 20.0
GSPO_LOG_RATIO_MAX = 10.0

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES = Registry("policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode")
ENTROPY_SPLIT_LOSSES = frozenset({"archer", "aspo"})  # losses that take high_entropy_mask


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: make a policy loss available as `actor.policy_loss.loss_mode=<name>`."""
    return POLICY_LOSSES.register(name)


def compute_policy_loss(
    loss_mode: str,
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    agg_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the named policy loss; extra keyword arguments go to losses that declare them."""
    fn = POLICY_LOSSES.lookup(loss_mode)
    return fn(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        agg_kwargs=agg_kwargs or {},
        **kwargs,
    )


Bound = float | torch.Tensor


def clipped_token_losses(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_ratio_low: Bound, clip_ratio_high: Bound
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clip per token: (max(-A*r, -A*clip(r, 1-eps_l, 1+eps_h)), bool where the clipped term is active)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    agg_kwargs: dict[str, Any],
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clip, plus dual-clip on A < 0 tokens: L = min(L, -A*c)."""
    token_losses, log_ratio, clip_active, dual_active = _dual_clip_losses(
        old_log_prob, log_prob, advantages, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    loss = agg_loss(token_losses, response_mask, loss_agg_mode, **agg_kwargs)
    return loss, _metrics(log_ratio, clip_active, dual_active, response_mask)


def _check_dual_clip(clip_ratio_c: float) -> None:
    if clip_ratio_c <= 1.0:
        raise ArcherError(
            f"clip_ratio_c must be greater than 1.0 for dual-clip PPO, got {clip_ratio_c}",
            "set actor_rollout_ref.actor.clip_ratio_c to a value > 1 (default 3.0)",
        )


def _dual_clip_losses(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
    clip_ratio_low: Bound, clip_ratio_high: Bound, clip_ratio_c: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token dual-clip PPO losses, the clamped log-ratio, and where the clip / the dual-clip is active."""
    _check_dual_clip(clip_ratio_c)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ppo_losses, clip_active = clipped_token_losses(log_ratio.exp(), advantages, clip_ratio_low, clip_ratio_high)
    dual_bound = -advantages * clip_ratio_c
    dual_active = (advantages < 0) & (ppo_losses > dual_bound)
    return torch.where(dual_active, dual_bound, ppo_losses), log_ratio, clip_active, dual_active


def _split_bounds(
    high_entropy_mask: torch.Tensor | None, low: float, high: float, like: torch.Tensor
) -> torch.Tensor:
    """Per-token clip bound in the dtype of `like`: `high` on high-entropy tokens, `low` elsewhere."""
    if high_entropy_mask is None:
        raise ArcherError("an entropy-split policy loss was called without high_entropy_mask",
                          "compute it with archer.algorithms.token_selection.high_entropy_tokens")
    return torch.where(high_entropy_mask, like.new_tensor(high), like.new_tensor(low))


@register_policy_loss("archer")
def archer_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    clip_ratio_c: float,
    agg_kwargs: dict[str, Any],
    high_entropy_mask: torch.Tensor | None = None,
    low_entropy_clip_ratio_low: float = 0.2,
    low_entropy_clip_ratio_high: float = 0.2,
    high_entropy_clip_ratio_low: float = 0.5,
    high_entropy_clip_ratio_high: float = 0.5,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Archer's dual-token constraints: dual-clip PPO whose clip range depends on the token's entropy class."""
    eps_low = _split_bounds(high_entropy_mask, low_entropy_clip_ratio_low, high_entropy_clip_ratio_low, log_prob)
    eps_high = _split_bounds(high_entropy_mask, low_entropy_clip_ratio_high, high_entropy_clip_ratio_high, log_prob)
    token_losses, log_ratio, clip_active, dual_active = _dual_clip_losses(
        old_log_prob, log_prob, advantages, eps_low, eps_high, clip_ratio_c)
    loss = agg_loss(token_losses, response_mask, loss_agg_mode, **agg_kwargs)
    metrics = _metrics(log_ratio, clip_active, dual_active, response_mask)
    metrics.update(_entropy_class_metrics(high_entropy_mask, clip_active, response_mask))
    return loss, metrics


@register_policy_loss("aspo")
def aspo_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    clip_ratio_c: float,
    agg_kwargs: dict[str, Any],
    high_entropy_mask: torch.Tensor | None = None,
    low_entropy_clip_ratio_low: float = 0.2,
    low_entropy_clip_ratio_high: float = 0.2,
    high_entropy_clip_ratio_low: float = 0.4,
    high_entropy_clip_ratio_high: float = 0.4,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ASPO (Archer2.0): asymmetric importance sampling with a soft dual-clip, on the entropy split.

    A < 0: r_hat = max(r, 1-eps_l), loss -A*r_hat; where r_hat > c the loss is -A*c*logp (gradient -c*A).
    A >= 0 (flipped ratio): r_hat = min(r, 1+eps_h), loss -A*(r_hat/sg(r_hat))/sg(r_hat), value -A/r_hat,
    gradient -A/r * grad logp below the clip and 0 above it; where 1/r_hat > c the loss is -A*c*logp.
    """
    _check_dual_clip(clip_ratio_c)
    eps_low = _split_bounds(high_entropy_mask, low_entropy_clip_ratio_low, high_entropy_clip_ratio_low, log_prob)
    eps_high = _split_bounds(high_entropy_mask, low_entropy_clip_ratio_high, high_entropy_clip_ratio_high, log_prob)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    negative = advantages < 0
    neg_ratio = torch.maximum(ratio, 1 - eps_low)
    pos_ratio = torch.minimum(ratio, 1 + eps_high)
    neg_soft = neg_ratio.detach() > clip_ratio_c
    pos_soft = 1 / pos_ratio.detach() > clip_ratio_c
    soft_loss = -advantages * clip_ratio_c * log_prob
    neg_loss = torch.where(neg_soft, soft_loss, -advantages * neg_ratio)
    pos_loss = torch.where(pos_soft, soft_loss, -advantages * (pos_ratio / pos_ratio.detach()) / pos_ratio.detach())
    token_losses = torch.where(negative, neg_loss, pos_loss)
    clip_active = torch.where(negative, ratio < 1 - eps_low, ratio > 1 + eps_high)
    soft_active = torch.where(negative, neg_soft, pos_soft)
    loss = agg_loss(token_losses, response_mask, loss_agg_mode, **agg_kwargs)
    metrics = _metrics(log_ratio, clip_active, soft_active, response_mask)
    metrics.update(_entropy_class_metrics(high_entropy_mask, clip_active, response_mask))
    return loss, metrics


@register_policy_loss("clip_cov")
def clip_cov_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    clip_ratio_low: float,
    clip_ratio_high: float,
    agg_kwargs: dict[str, Any],
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO clip, and the gradient of a few random tokens with lb < cov(A, logp) < ub is cut off."""
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ppo_losses, clip_active = clipped_token_losses(log_ratio.exp(), advantages, clip_ratio_low, clip_ratio_high)
    cov = advantage_logp_covariance(advantages, log_prob, response_mask)
    cut = clip_cov_tokens(cov, response_mask.bool() & ~clip_active, clip_cov_ratio, clip_cov_lb, clip_cov_ub,
                          generator)
    token_losses = torch.where(cut, 0.0, ppo_losses)
    loss = agg_loss(token_losses, response_mask, loss_agg_mode, **agg_kwargs)
    metrics = _metrics(log_ratio, clip_active, torch.zeros_like(clip_active), response_mask)
    metrics["cov_selected_tokens"] = cut.sum().float()
    return loss, metrics


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    agg_kwargs: dict[str, Any],
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: unclipped -A*r, plus ppo_kl_coef * |logp - old_logp| on the tokens of largest cov(A, logp)."""
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    pg_losses = -advantages * log_ratio.exp()
    cov = advantage_logp_covariance(advantages, log_prob, response_mask)
    penalised = kl_cov_tokens(cov, kl_cov_ratio)
    token_losses = torch.where(penalised, pg_losses + ppo_kl_coef * log_ratio.abs(), pg_losses)
    loss = agg_loss(token_losses, response_mask, loss_agg_mode, **agg_kwargs)
    no_clip = torch.zeros_like(penalised)
    metrics = _metrics(log_ratio, no_clip, no_clip, response_mask)
    metrics["cov_selected_tokens"] = penalised.sum().float()
    return loss, metrics


@register_policy_loss("gspo")
def gspo_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    agg_kwargs: dict[str, Any],
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the token ratio is replaced by sg(s_i) * pi_t / sg(pi_t), s_i = exp(mean_t(logp - old_logp)).

    As in verl, the loss is always aggregated seq-mean-token-mean (the sequence-level objective), whatever
    loss_agg_mode says; its log-ratio is clamped at 10 before exp; there is no dual-clip.
    """
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1).detach().unsqueeze(-1)
    token_log_ratio = (log_prob - log_prob.detach() + seq_log_ratio).clamp(max=GSPO_LOG_RATIO_MAX)
    token_losses, clip_active = clipped_token_losses(
        token_log_ratio.exp(), advantages, clip_ratio_low, clip_ratio_high
    )
    loss = agg_loss(token_losses, response_mask, "seq-mean-token-mean", **agg_kwargs)
    no_dual = torch.zeros_like(clip_active)
    return loss, _metrics(log_ratio, clip_active, no_dual, response_mask)


def _entropy_class_metrics(
    high_entropy_mask: torch.Tensor, clip_active: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Share of valid tokens in each entropy class, and the clipped share within each class."""
    valid = response_mask.bool()
    high = high_entropy_mask & valid
    low = ~high_entropy_mask & valid
    return {
        "entropy_low_frac": masked_mean(low.float(), response_mask).detach(),
        "entropy_high_frac": masked_mean(high.float(), response_mask).detach(),
        "entropy_low_clipfrac": masked_mean(clip_active.float(), low).detach(),
        "entropy_high_clipfrac": masked_mean(clip_active.float(), high).detach(),
    }


def _metrics(
    log_ratio: torch.Tensor, clip_active: torch.Tensor, dual_active: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    return {
        "pg_clipfrac": masked_mean(clip_active.float(), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "pg_clipfrac_lower": masked_mean(dual_active.float(), response_mask).detach(),
    }
