"""Advantage estimators (GAE, GRPO / Dr.GRPO, RLOO, REINFORCE++ and its group baseline), by config name.

Inputs are [B, R] right-padded response tensors; the outcome reward of response i is the sum over t of
`token_level_rewards[i]`. `index` holds the prompt uid of each response: responses sharing a uid form a group.
Every estimator returns (advantages, returns), both [B, R] and zero on masked tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from archer.algorithms.grouping import group_index
from archer.algorithms.masked import masked_whiten
from archer.algorithms.registry import Registry
from archer.errors import ArcherError

T = TypeVar("T")
AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator", "algorithm.adv_estimator")


def register_adv_estimator(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: make an estimator available as `algorithm.adv_estimator=<name>`."""
    return ADV_ESTIMATORS.register(name)


@torch.no_grad()
def compute_advantage(
    estimator: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[object] | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the named estimator, passing it the inputs it declares; returns (advantages, returns)."""
    fn = ADV_ESTIMATORS.lookup(estimator)
    available = {
        "token_level_rewards": token_level_rewards,
        "response_mask": response_mask.to(token_level_rewards.dtype),
        "index": index,
        "values": values,
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
        "epsilon": epsilon,
    }
    wanted = inspect.signature(fn).parameters
    return fn(**{key: value for key, value in available.items() if key in wanted})


def _require(value: T | None, what: str, estimator: str, fix: str) -> T:
    if value is None:
        raise ArcherError(f"adv_estimator '{estimator}' needs {what}, but none was given", fix)
    return value


def _group_ids(index: Sequence[object], batch_size: int) -> torch.Tensor:
    """Dense group id of each response (first-seen order of its uid)."""
    if len(index) != batch_size:
        raise ArcherError(
            f"index has {len(index)} uids for {batch_size} responses",
            "give one prompt uid per response (repeat the prompt's uid for each of its n samples)",
        )
    return torch.from_numpy(group_index(index)[0])


def _group_baseline(
    scores: torch.Tensor, index: Sequence[object]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per response: its group's mean, unbiased std and size; a group of one gets mean 0 and std 1 (as verl)."""
    groups = _group_ids(index, scores.shape[0]).to(scores.device)
    num_groups = int(groups.max()) + 1
    size = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, groups, torch.ones_like(scores)
    )
    mean = torch.zeros_like(size).index_add_(0, groups, scores) / size
    sq_dev = torch.zeros_like(size).index_add_(0, groups, (scores - mean[groups]) ** 2)
    std = (sq_dev / (size - 1).clamp(min=1)).sqrt()
    single = size == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[groups], std[groups], size[groups]


@register_adv_estimator("gae")
def gae_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE; masked tokens (padding, tool output) are skipped in the recursion. Advantages whitened over the batch."""
    values = _require(
        values, "critic values", "gae", "enable the critic, or pick a critic-free estimator such as grpo"
    )
    next_value = torch.zeros_like(token_level_rewards[:, 0])
    last_gae = torch.zeros_like(next_value)
    columns = []
    for t in reversed(range(token_level_rewards.shape[1])):
        m = response_mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = values[:, t] * m + (1 - m) * next_value
        last_gae = gae_t * m + (1 - m) * last_gae
        columns.append(last_gae)
    advantages = torch.stack(columns[::-1], dim=1)
    returns = (advantages + values) * response_mask
    return masked_whiten(advantages, response_mask) * response_mask, returns


@register_adv_estimator("grpo")
def grpo_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[object] | None,
    norm_adv_by_std_in_grpo: bool,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R_i - mean_G) / (std_G + eps); Dr.GRPO (norm_adv_by_std_in_grpo=False): R_i - mean_G."""
    index = _require(index, "prompt uids (index)", "grpo", "pass the batch's uid row as index")
    scores = token_level_rewards.sum(dim=-1)
    mean, std, _ = _group_baseline(scores, index)
    centred = scores - mean
    adv = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
    advantages = adv.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_estimator("rloo")
def rloo_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[object] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """R_i - mean of the other responses of the group = G/(G-1) (R_i - mean_G); R_i for a group of one."""
    index = _require(index, "prompt uids (index)", "rloo", "pass the batch's uid row as index")
    scores = token_level_rewards.sum(dim=-1)
    mean, _, size = _group_baseline(scores, index)
    scale = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.ones_like(size))
    advantages = ((scores - mean) * scale).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted return-to-go G_t of the token rewards, whitened over the batch's valid tokens.

    Masked tokens (padding, tool output) are skipped: they neither add reward nor discount the return.
    """
    running = torch.zeros_like(token_level_rewards[:, 0])
    columns = []
    for t in reversed(range(token_level_rewards.shape[1])):
        m = response_mask[:, t]
        running = (token_level_rewards[:, t] + gamma * running) * m + (1 - m) * running
        columns.append(running * m)
    returns = torch.stack(columns[::-1], dim=1)
    return masked_whiten(returns, response_mask) * response_mask, returns


@register_adv_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[object] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """R_i - mean_G broadcast to the response tokens, then whitened over the batch's valid tokens."""
    index = _require(
        index, "prompt uids (index)", "reinforce_plus_plus_baseline", "pass the batch's uid row as index"
    )
    scores = token_level_rewards.sum(dim=-1)
    mean, _, _ = _group_baseline(scores, index)
    centred = (scores - mean).unsqueeze(-1) * response_mask
    advantages = masked_whiten(centred, response_mask) * response_mask
    return advantages, advantages
