"""AEPO's entropy-aware advantage (docs/algorithms.md, AEPO): A_tilde = A * (1 + coef * sg(H_hat)), H_hat the
token entropy standardised over the valid tokens of one micro-batch, and the metrics that show what it did.

Pure functions of detached tensors; the actor scales the advantages with them before the policy loss, so the
switch works with every loss. The standardisation is over the micro-batch, as AEPO's code does it: the scaled
advantages depend on how a mini-batch is split (everything downstream is normalised over the mini-batch).
"""

from __future__ import annotations

import torch

from archer.algorithms.masked import masked_sum, masked_whiten
from archer.algorithms.metric_sums import Mean, Metric, masked_mean_metric


def standardised_entropy(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """H_hat = (H - mean) / sqrt(var + 1e-8) over the valid tokens (unbiased var), detached; 0 on the other
    tokens, and on every token when fewer than two are valid (nothing to standardise against)."""
    valid = mask.bool()
    h = entropy.detach()
    if int(valid.sum()) < 2:
        return torch.zeros_like(h)
    return torch.where(valid, masked_whiten(h, valid), 0.0)


def entropy_advantage_scale(entropy: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """1 + coef * H_hat per token (1 on tokens outside the mask): the factor AEPO multiplies A by."""
    return 1 + coef * standardised_entropy(entropy, mask)


def entropy_advantage_metrics(scale: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
                              ) -> dict[str, Metric]:
    """What the scaling did to the tokens of `mask` (those that receive policy gradient).

    entropy_adv_scale_mean: the |A|-weighted mean scale, sum |A|*s / sum |A| (= mean |A_tilde| / mean |A|
    while no sign flips); entropy_adv_scale_pos / _neg: the mean scale of the tokens with A > 0 / A < 0;
    entropy_adv_flipped_frac: the share of tokens whose advantage changed sign (s < 0, i.e. H_hat < -1/coef).
    """
    valid = mask.bool()
    a = advantages.detach()
    s = scale.detach()
    return {
        "entropy_adv_scale_mean": Mean(masked_sum(a.abs() * s, valid), masked_sum(a.abs(), valid)),
        "entropy_adv_scale_pos": masked_mean_metric(s, valid & (a > 0)),
        "entropy_adv_scale_neg": masked_mean_metric(s, valid & (a < 0)),
        "entropy_adv_flipped_frac": masked_mean_metric(((s < 0) & (a != 0)).float(), valid),
    }
