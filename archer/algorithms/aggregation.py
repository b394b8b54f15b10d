"""Loss aggregation (`actor.loss_agg_mode`): a [B, R] per-token loss and its mask -> one scalar.

With gradient accumulation the actor computes the normalisers of the whole mini-batch once
(`agg_totals(mini_batch_mask)`) and passes them to every micro-batch, so that the micro-batch losses
add up exactly to the mini-batch loss (token-sum has no normaliser: its micro-batch sums add up as they are).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from archer.algorithms.masked import mask_count, masked_sum
from archer.algorithms.registry import Registry

Number = int | float | torch.Tensor


@dataclass(frozen=True)
class AggScale:
    """Normalisers of a loss aggregation: valid tokens, sequences with a valid token, padded length."""

    num_tokens: Number
    num_seqs: Number
    max_len: Number


AggFn = Callable[[torch.Tensor, torch.Tensor, AggScale], torch.Tensor]

AGG_MODES: Registry[AggFn] = Registry("loss aggregation mode", "actor_rollout_ref.actor.loss_agg_mode")


def agg_totals(mask: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """Normalisers of a (mini-)batch, to pass as agg_kwargs for each of its micro-batches."""
    return {
        "num_tokens": mask_count(mask),
        "num_seqs": (mask_count(mask, dim=-1) > 0).sum(),
        "max_len": mask.shape[-1],
    }


def mini_batch_totals(mask: torch.Tensor) -> dict[str, float | int]:
    """agg_totals of a whole mini-batch as plain numbers, never zero: the agg_kwargs of its micro-batches."""
    totals = agg_totals(mask)
    return {"num_tokens": max(float(totals["num_tokens"]), 1.0), "num_seqs": max(float(totals["num_seqs"]), 1.0),
            "max_len": int(totals["max_len"])}


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    max_len: Number | None = None,
) -> torch.Tensor:
    """Aggregate `loss_mat` over the tokens of `mask` by `mode`; normalisers default to this batch's own."""
    fn = AGG_MODES.lookup(mode)
    own = agg_totals(mask)
    scale = AggScale(
        num_tokens=own["num_tokens"].clamp(min=1) if num_tokens is None else num_tokens,
        num_seqs=own["num_seqs"].clamp(min=1) if num_seqs is None else num_seqs,
        max_len=own["max_len"] if max_len is None else max_len,
    )
    return fn(loss_mat, mask, scale)


@AGG_MODES.register("token-mean")
def _token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, scale: AggScale) -> torch.Tensor:
    """sum(L*m) / num_tokens."""
    return masked_sum(loss_mat, mask) / scale.num_tokens


@AGG_MODES.register("token-sum")
def _token_sum(loss_mat: torch.Tensor, mask: torch.Tensor, scale: AggScale) -> torch.Tensor:
    """sum(L*m), no normaliser: the loss of a mini-batch is the sum over its tokens (as verl's token-sum)."""
    return masked_sum(loss_mat, mask)


@AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat: torch.Tensor, mask: torch.Tensor, scale: AggScale) -> torch.Tensor:
    """sum_i sum_t L*m / num_seqs."""
    return masked_sum(loss_mat, mask) / scale.num_seqs


@AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, scale: AggScale) -> torch.Tensor:
    """sum_i (sum_t L*m / sum_t m) / num_seqs; sequences without a valid token add 0."""
    seq_tokens = mask_count(mask, dim=-1).to(loss_mat.dtype).clamp(min=1)
    return (masked_sum(loss_mat, mask, dim=-1) / seq_tokens).sum() / scale.num_seqs


@AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat: torch.Tensor, mask: torch.Tensor, scale: AggScale) -> torch.Tensor:
    """sum(L*m) / (num_seqs * max_len)  (Dr.GRPO: a constant normaliser)."""
    return masked_sum(loss_mat, mask) / (scale.num_seqs * scale.max_len)
