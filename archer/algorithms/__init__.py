"""Pure RL math: advantage estimators, policy / value / KL / entropy losses, loss aggregation and the metrics
the losses return (each declared as a Mean or a Total).

Torch functions with no model or worker imports, each registered under the name the config uses.
"""

from archer.algorithms.advantages import ADV_ESTIMATORS, compute_advantage, register_adv_estimator
from archer.algorithms.aggregation import AGG_MODES, agg_loss, agg_totals
from archer.algorithms.entropy import entropy_loss
from archer.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)
from archer.algorithms.metric_sums import Mean, MetricSums, Total
from archer.algorithms.policy_loss import POLICY_LOSSES, PolicyLoss, compute_policy_loss, register_policy_loss
from archer.algorithms.value_loss import compute_value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "Mean",
    "MetricSums",
    "PolicyLoss",
    "Total",
    "agg_loss",
    "agg_totals",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_policy_loss",
    "compute_value_loss",
    "entropy_loss",
    "kl_loss",
    "kl_penalty",
    "make_kl_controller",
    "register_adv_estimator",
    "register_policy_loss",
]
