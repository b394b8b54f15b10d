"""Critic loss: clipped value regression, aggregated like the policy loss."""

from __future__ import annotations

from typing import Any

import torch

from archer.algorithms.aggregation import agg_loss
from archer.algorithms.metric_sums import Mean, masked_mean_metric


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    agg_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, Mean]:
    """0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)); also the fraction of the tokens where
    the clip wins (a Mean over them, archer.algorithms.metric_sums).

    vpreds: current critic output V; values: V_old from rollout time; returns: R.
    """
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_loss = (vpreds - returns).square()
    clipped_loss = (clipped - returns).square()
    token_losses = torch.maximum(unclipped_loss, clipped_loss)
    loss = 0.5 * agg_loss(token_losses, response_mask, loss_agg_mode, **(agg_kwargs or {}))
    clipfrac = masked_mean_metric((clipped_loss > unclipped_loss).float(), response_mask)
    return loss, clipfrac
