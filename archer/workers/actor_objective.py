"""The actor's objective on one micro-batch: the policy loss with the token selections an entropy-aware
method asks for (Archer/ASPO entropy classes, top-entropy tokens), the entropy bonus and the KL loss.

Every term is normalised over its whole mini-batch (the normalisers come from `mini_batch_normalisers`), so
the micro-batch losses add up to the mini-batch loss. Token entropies come from the training forward pass
(detached) whenever a term needs them, whatever entropy_coeff is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

from archer.algorithms.aggregation import mini_batch_totals
from archer.algorithms.entropy import entropy_loss
from archer.algorithms.kl import kl_loss, kl_penalty
from archer.algorithms.masked import masked_mean
from archer.algorithms.policy_loss import ENTROPY_SPLIT_LOSSES, POLICY_LOSSES, compute_policy_loss
from archer.algorithms.token_selection import high_entropy_tokens, top_entropy_count, top_entropy_tokens

ENTROPY_CLASS_KEYS = ("low_entropy_clip_ratio_low", "low_entropy_clip_ratio_high",
                      "high_entropy_clip_ratio_low", "high_entropy_clip_ratio_high")
COVARIANCE_KEYS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")


@dataclass(frozen=True)
class ActorObjective:
    """The loss settings of `actor_rollout_ref.actor`, read once."""

    loss_mode: str
    loss_agg_mode: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    entropy_top_ratio: float | None
    token_entropy_quantile: float
    high_entropy_kl_loss_scale_coef: float
    loss_kwargs: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, a: DictConfig) -> ActorObjective:
        POLICY_LOSSES.lookup(a.policy_loss.loss_mode)  # an unknown loss fails before any model work
        clip = float(a.clip_ratio)
        kwargs = {k: float(a[k]) for k in ENTROPY_CLASS_KEYS}
        kwargs.update({k: float(a.policy_loss[k]) for k in COVARIANCE_KEYS})
        return cls(
            loss_mode=str(a.policy_loss.loss_mode), loss_agg_mode=str(a.loss_agg_mode),
            clip_ratio_low=float(a.clip_ratio_low if a.clip_ratio_low is not None else clip),
            clip_ratio_high=float(a.clip_ratio_high if a.clip_ratio_high is not None else clip),
            clip_ratio_c=float(a.clip_ratio_c), entropy_coeff=float(a.entropy_coeff),
            use_kl_loss=bool(a.use_kl_loss), kl_loss_coef=float(a.kl_loss_coef), kl_loss_type=str(a.kl_loss_type),
            entropy_top_ratio=None if a.entropy_top_ratio is None else float(a.entropy_top_ratio),
            token_entropy_quantile=float(a.token_entropy_quantile),
            high_entropy_kl_loss_scale_coef=float(a.high_entropy_kl_loss_scale_coef), loss_kwargs=kwargs)

    @property
    def splits_by_entropy(self) -> bool:
        return self.loss_mode in ENTROPY_SPLIT_LOSSES

    @property
    def needs_entropy(self) -> bool:
        """Whether the training forward pass must return token entropies."""
        return self.entropy_coeff != 0 or self.splits_by_entropy or self.entropy_top_ratio is not None

    def mini_batch_normalisers(self, mask: torch.Tensor, micro: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Normalisers of a whole mini-batch (its loss mask, split into micro-batches of `micro` rows):
        (for the entropy and KL terms, for the policy loss).

        With entropy_top_ratio the policy loss counts only the selected tokens: ceil(ratio * N) of each
        micro-batch, known before the forward pass.
        """
        common = mini_batch_totals(mask)
        if self.entropy_top_ratio is None:
            return common, common
        selected = sum(top_entropy_count(int(m.bool().sum()), self.entropy_top_ratio) for m in mask.split(micro))
        return common, {**common, "num_tokens": max(float(selected), 1.0)}

    def micro_batch_loss(self, *, log_prob: torch.Tensor, entropy: torch.Tensor | None, old_log_prob: torch.Tensor,
                         advantages: torch.Tensor, mask: torch.Tensor, ref_log_prob: torch.Tensor | None,
                         agg_kwargs: dict[str, Any], pg_agg_kwargs: dict[str, Any]
                         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(total loss, policy loss, metrics without the "actor/" prefix) of one micro-batch."""
        metrics: dict[str, torch.Tensor] = {}
        pg_mask = mask
        if self.entropy_top_ratio is not None:
            selected = top_entropy_tokens(entropy, mask, self.entropy_top_ratio)
            pg_mask = mask * selected
            metrics["top_entropy_selected_frac"] = masked_mean(selected.float(), mask)
            metrics["top_entropy_selected_tokens"] = selected.sum().float()
        high = high_entropy_tokens(entropy, mask, self.token_entropy_quantile) if self.splits_by_entropy else None
        pg_loss, pg_metrics = compute_policy_loss(
            self.loss_mode, old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
            response_mask=pg_mask, loss_agg_mode=self.loss_agg_mode, clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high, clip_ratio_c=self.clip_ratio_c, agg_kwargs=pg_agg_kwargs,
            high_entropy_mask=high, **self.loss_kwargs)
        metrics.update(pg_metrics)
        loss = pg_loss
        if self.entropy_coeff != 0:
            ent_loss = entropy_loss(entropy.float(), mask, self.loss_agg_mode, agg_kwargs)
            loss = loss - self.entropy_coeff * ent_loss
            metrics["entropy_loss"] = ent_loss.detach()
        if self.use_kl_loss:
            if high is None:
                kl_term = kl_loss(log_prob, ref_log_prob, mask, self.kl_loss_type, self.loss_agg_mode, agg_kwargs)
            else:
                kl_term = self._split_kl(log_prob, ref_log_prob, mask, high, agg_kwargs)
            loss = loss + self.kl_loss_coef * kl_term
            metrics["kl_loss"] = kl_term.detach()
        return loss, pg_loss, metrics

    def _split_kl(self, log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor,
                  high: torch.Tensor, agg_kwargs: dict[str, Any]) -> torch.Tensor:
        """Archer's KL: tokenmean_low(KL) + scale * tokenmean_high(KL), each over its own class's tokens.

        Each class mean is taken over the micro-batch and weighted by the micro-batch's share of the
        mini-batch's tokens, so that equal micro-batches add up to the mini-batch means.
        """
        kl = kl_penalty(log_prob, ref_log_prob, self.kl_loss_type)
        valid = mask.bool()
        share = float(valid.sum()) / agg_kwargs["num_tokens"]
        low_mean = masked_mean(kl, valid & ~high)
        high_mean = masked_mean(kl, valid & high)
        return share * (low_mean + self.high_entropy_kl_loss_scale_coef * high_mean)
