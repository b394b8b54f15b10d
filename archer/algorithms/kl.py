"""KL between policy and reference: per-token estimators by `kl_penalty` name, KL coefficient controllers,
the KL penalty in the reward (`algorithm.use_kl_in_reward`) and the KL loss (`actor.use_kl_loss`).

Every estimator name also exists with a "+" appended (verl's straight-through estimators, e.g. `k3+`): the
value of the named estimator with the gradient of k2, 0.5 * x^2, whose gradient x is the unbiased one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from archer.algorithms.aggregation import agg_loss
from archer.algorithms.masked import masked_mean
from archer.algorithms.registry import Registry
from archer.errors import ArcherError

K3_LOG_RATIO_CLAMP = 20.0
K3_RESULT_CLAMP = 10.0

KLEstimator = Callable[[torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry(
    "KL estimator", "algorithm.kl_penalty / actor_rollout_ref.actor.kl_loss_type"
)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of kind kl|k1, abs, mse|k2, low_var_kl|k3 (each also with "+"), from x = logp - ref_logp."""
    return KL_ESTIMATORS.lookup(kind)(log_prob - ref_log_prob)


@KL_ESTIMATORS.register("kl", "k1")
def _k1(x: torch.Tensor) -> torch.Tensor:
    return x


@KL_ESTIMATORS.register("abs")
def _abs(x: torch.Tensor) -> torch.Tensor:
    return x.abs()


@KL_ESTIMATORS.register("mse", "k2")
def _k2(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x.square()


@KL_ESTIMATORS.register("low_var_kl", "k3")
def _k3(x: torch.Tensor) -> torch.Tensor:
    x = x.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.exp(-x) + x - 1).clamp(-K3_RESULT_CLAMP, K3_RESULT_CLAMP)


def _straight_through(estimator: KLEstimator) -> KLEstimator:
    """The estimator's value, k2's gradient: k2(x) - sg(k2(x)) + sg(estimator(x))."""

    def estimate(x: torch.Tensor) -> torch.Tensor:
        k2 = _k2(x)
        return k2 - k2.detach() + estimator(x).detach()

    return estimate


for _name, _estimator in list(KL_ESTIMATORS.items()):
    KL_ESTIMATORS.add(_name + "+", _straight_through(_estimator))


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """A fixed coefficient ignores the observed KL."""


class AdaptiveKLController:
    """beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon  (Ziegler et al., as verl)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ArcherError(
                f"adaptive KL control needs target_kl > 0 and horizon > 0, got {target_kl} and {horizon}",
                "set algorithm.kl_ctrl.target_kl and algorithm.kl_ctrl.horizon to positive values",
            )
        self.value = init_kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta towards the value that keeps the observed KL at the target."""
        error = min(max(current_kl / self.target_kl - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


KL_CONTROLLERS: Registry[Callable[[float, float, int], KLController]] = Registry("KL controller type",
                                                                                 "algorithm.kl_ctrl.type")
KL_CONTROLLERS.add("fixed", lambda kl_coef, target_kl, horizon: FixedKLController(kl_coef))
KL_CONTROLLERS.add("adaptive", AdaptiveKLController)


def make_kl_controller(
    type: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000
) -> KLController:
    """The controller named by `algorithm.kl_ctrl.type` (fixed | adaptive)."""
    return KL_CONTROLLERS.lookup(type)(kl_coef, target_kl, horizon)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    controller: KLController,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards = scores - beta * KL per valid token; then the controller sees the batch KL (as verl).

    The batch KL is the mean over responses of each response's token-mean KL; n_steps = batch size.
    """
    kl = kl_penalty(old_log_prob, ref_log_prob, kind) * response_mask
    beta = controller.value
    rewards = token_level_scores - beta * kl
    current_kl = masked_mean(kl, response_mask, dim=-1).mean().item()
    controller.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    agg_kwargs: dict[str, Any] | None = None,
) -> torch.Tensor:
    """The KL loss term of the actor (multiplied by kl_loss_coef by the caller), aggregated like the policy loss."""
    return agg_loss(
        kl_penalty(log_prob, ref_log_prob, kind), response_mask, loss_agg_mode, **(agg_kwargs or {})
    )
