"""Which response tokens an entropy-aware loss treats specially: entropy classes, top-entropy tokens and
covariance-selected tokens. Pure functions of detached tensors; masks are bool [B, R].
"""

from __future__ import annotations

import math

import torch

from archer.batch import to_device
from archer.errors import ArcherError


def high_entropy_tokens(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Archer's split: per response, tokens with H above the `quantile` of H over its valid tokens.

    The quantile interpolates linearly (torch.nanquantile); tokens with H <= q are low-entropy. A response
    without valid tokens has none of either class.
    """
    if not 0.0 <= quantile <= 1.0:
        raise ArcherError(f"token_entropy_quantile must lie in [0, 1], got {quantile}",
                          "set actor_rollout_ref.actor.token_entropy_quantile, e.g. 0.8 (the top 20% are high-entropy)")
    valid = mask.bool()
    h = torch.where(valid, entropy.detach().float(), torch.full_like(entropy, math.nan, dtype=torch.float32))
    has_tokens = valid.any(dim=-1, keepdim=True)
    q = torch.nanquantile(torch.where(has_tokens, h, 0.0), quantile, dim=-1, keepdim=True)
    return valid & (h > q)


def top_entropy_count(num_valid: int | float, ratio: float) -> int:
    """ceil(ratio * N) tokens (0 when N is 0): the size of a top-entropy selection."""
    return math.ceil(ratio * float(num_valid) - 1e-9) if num_valid > 0 else 0


def top_entropy_tokens(entropy: torch.Tensor, mask: torch.Tensor, ratio: float) -> torch.Tensor:
    """The top ceil(ratio * N) tokens by H among the N valid tokens of the whole tensor ("Beyond 80/20")."""
    if not 0.0 < ratio <= 1.0:
        raise ArcherError(f"entropy_top_ratio must lie in (0, 1], got {ratio}",
                          "set actor_rollout_ref.actor.entropy_top_ratio, e.g. 0.2, or null to train on every token")
    valid = mask.bool()
    # top_entropy_count's ceil(ratio * N) on the tensor's device (the same float64 arithmetic)
    k = torch.ceil(valid.sum().double() * ratio - 1e-9).clamp(min=0)
    scores = torch.where(valid, entropy.detach().float(), torch.full_like(entropy, -math.inf, dtype=torch.float32))
    return _largest(scores, k) & valid


def _largest(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Where the ``k`` (a 0-d tensor) largest ``scores`` are, ties broken by position. Ranked on the scores' device:
    a count read back as a number (``topk``'s k) would make the host wait for the GPU in the middle of the update
    (docs/architecture.md, "The host never waits inside a pass")."""
    order = scores.reshape(-1).argsort(descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return rank.view(scores.shape) < k


def advantage_logp_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """cov_t = (A_t - mean A) * (logp_t - mean logp) over the valid tokens (detached); -inf elsewhere."""
    valid = mask.bool()
    count = valid.sum().clamp(min=1)
    a = advantages.detach().float()
    lp = log_prob.detach().float()
    a_mean = torch.where(valid, a, 0.0).sum() / count
    lp_mean = torch.where(valid, lp, 0.0).sum() / count
    return torch.where(valid, (a - a_mean) * (lp - lp_mean), -math.inf)


def clip_cov_tokens(cov: torch.Tensor, eligible: torch.Tensor, ratio: float, lower: float, upper: float,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Clip-Cov: max(1, int(ratio*N)) tokens (N = tokens with finite cov) drawn uniformly at random among the
    eligible ones with lower < cov < upper, all of them when there are fewer. The draw ranks a random key per token
    on cov's device (float64 keys: ties at the cut, which go to the earlier position, all but never happen), drawn
    with ``generator`` where it is or with torch's default generator of cov's device, which the trainer seeds."""
    candidates = eligible.bool() & (cov > lower) & (cov < upper)
    keys = torch.rand(cov.shape, generator=generator, dtype=torch.float64,
                      device=cov.device if generator is None else generator.device)
    keys = to_device(keys, cov.device)  # a generator on the host: moved without the host waiting
    return _largest(torch.where(candidates, keys, -math.inf), _covariance_budget(cov, ratio)) & candidates


def kl_cov_tokens(cov: torch.Tensor, ratio: float) -> torch.Tensor:
    """KL-Cov: the max(1, int(ratio*N)) valid tokens of largest covariance (N = tokens with finite cov)."""
    return _largest(cov, _covariance_budget(cov, ratio)) & torch.isfinite(cov)


def _covariance_budget(cov: torch.Tensor, ratio: float) -> torch.Tensor:
    """max(1, int(ratio * N)) for the N tokens with finite cov (0 when N is 0), the Clip-Cov / KL-Cov budget, as a
    0-d tensor on cov's device."""
    if not 0.0 < ratio <= 1.0:
        raise ArcherError(f"a covariance token ratio must lie in (0, 1], got {ratio}",
                          "set actor_rollout_ref.actor.policy_loss.clip_cov_ratio / kl_cov_ratio, e.g. 0.0002")
    count = torch.isfinite(cov).sum().double()
    return torch.where(count > 0, torch.floor(count * ratio).clamp(min=1), 0.0)
