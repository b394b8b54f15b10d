"""Policy losses (`actor.policy_loss.loss_mode`), by name: PPO clip with dual-clip ("vanilla"), GSPO, Archer's
dual-token constraints, ASPO, Clip-Cov and KL-Cov (docs/algorithms.md), and AEPO's
entropy-balanced clipping as a switch of the losses that clip the token ratio (section 7).

Each loss is registered with what it needs (`PolicyLoss`): verl's shared clip settings it reads, its own
config knobs with their defaults, the per-micro-batch inputs the actor must compute for it, and the actor
switches it supports. Its function is its formula: it takes exactly those, plus the common arguments, as keyword
arguments (checked when it is registered), and returns ([B, R] token losses, metrics): pg_clipfrac, ppo_kl and
pg_clipfrac_lower plus the metrics of its own mechanism, each declared as a `Mean` or a `Total`
(archer.algorithms.metric_sums). `compute_policy_loss` then does what every loss shares, once: each token's loss
times its ``rollout_is_weights`` when they are given (verl's rollout correction, algorithms/rollout_correction.py;
`is_weighted`), aggregated by the loss's fixed agg_mode or by ``loss_agg_mode`` (`agg_loss`).
Adding a loss touches one function, its registration and its YAML keys.

The bypass mode of the rollout correction has its own loss types (``algorithm.rollout_correction.loss_type``):
``ppo_clip`` trains with the configured loss against the rollout log-probs; the others (REINFORCE) are
registered in BYPASS_LOSS_TYPES with the same declaration check.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from archer.algorithms.aggregation import agg_loss
from archer.algorithms.masked import masked_mean
from archer.algorithms.metric_sums import Metric, Total, masked_mean_metric
from archer.algorithms.registry import Registry
from archer.algorithms.token_selection import (
    advantage_logp_covariance,
    clip_cov_tokens,
    kl_cov_tokens,
)
from archer.errors import ArcherError

LOG_RATIO_CLAMP = 20.0
GSPO_LOG_RATIO_MAX = 10.0

# Keyword arguments every loss takes.
COMMON_ARGUMENTS = ("old_log_prob", "log_prob", "advantages", "response_mask")
# verl's actor settings shared by several losses; each has one default, in the YAML (clip_ratio_low/high: null
# means clip_ratio).
SHARED_SETTINGS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
# Per-micro-batch tensors the actor computes for a loss that declares them.
LOSS_INPUTS = {
    "high_entropy_mask": "bool [B, R]: Archer's high-entropy tokens, above the per-response "
                         "token_entropy_quantile of the token entropies",
}

# Boolean actor settings (keys under actor_rollout_ref.actor) that turn on a variant of the losses that
# support it. A loss that declares one takes it as a keyword (False when not passed); the actor refuses a
# switch that is on for a loss that does not declare it.
BALANCED_CLIPPING = "enable_entropy_balanced_clipping"
LOSS_SWITCHES = {
    BALANCED_CLIPPING: "AEPO: the upper clip bound 1+eps_h becomes (1+eps_h) * r / sg(r), so a token with "
                       "A > 0 clipped above keeps the gradient -A*(1+eps_h)*grad logp",
}

# A loss's formula: its keyword arguments -> ([B, R] token losses, metrics); compute_policy_loss aggregates them.
PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, Metric]]]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss and what it needs.

    settings: the SHARED_SETTINGS it reads. options: its own knobs, as config key under
    actor_rollout_ref.actor -> default; the YAML leaves them null, meaning "this loss's default", so two losses
    can default the same key differently; the keyword is the key's last part. inputs: names from LOSS_INPUTS.
    switches: names from LOSS_SWITCHES it supports. agg_mode: the aggregation the loss always uses (GSPO's
    sequence-level objective), None for loss_agg_mode.
    """

    name: str
    fn: PolicyLossFn
    settings: tuple[str, ...] = ()
    options: Mapping[str, float] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    agg_mode: str | None = None
    switches: tuple[str, ...] = ()

    @property
    def option_defaults(self) -> dict[str, float]:
        """keyword -> default of each option."""
        return {option_keyword(key): default for key, default in self.options.items()}

    @property
    def declared(self) -> tuple[str, ...]:
        """The keyword arguments it takes besides COMMON_ARGUMENTS."""
        return (*self.settings, *self.option_defaults, *self.inputs, *self.switches)

    def arguments(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Its keyword arguments besides the common ones: `given`, plus the defaults of the options left out
        (and False for the switches left out)."""
        unknown = sorted(set(given) - set(self.declared))
        if unknown:
            raise ArcherError(f"policy loss '{self.name}' takes no argument {', '.join(unknown)}",
                              f"pass only what it declares: {', '.join(self.declared)}")
        missing = [k for k in (*self.settings, *self.inputs) if k not in given]
        if missing:
            raise ArcherError(f"policy loss '{self.name}' was called without {', '.join(missing)}",
                              f"pass {', '.join(missing)} (the actor computes them from its config and each "
                              "micro-batch)")
        return {**self.option_defaults, **dict.fromkeys(self.switches, False), **given}


def option_keyword(key: str) -> str:
    """The keyword argument of a loss option: the last part of its config key."""
    return key.rsplit(".", 1)[-1]


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode")
# The bypass mode's loss types besides PPO_CLIP, which is the configured loss (POLICY_LOSSES) itself.
PPO_CLIP = "ppo_clip"
BYPASS_LOSS_TYPES: Registry[PolicyLoss] = Registry("bypass-mode loss type", "algorithm.rollout_correction.loss_type")


def register_policy_loss(
    name: str,
    *,
    settings: tuple[str, ...] = (),
    options: Mapping[str, float] | None = None,
    inputs: tuple[str, ...] = (),
    agg_mode: str | None = None,
    switches: tuple[str, ...] = (),
    registry: Registry[PolicyLoss] = POLICY_LOSSES,
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: make a policy loss available as `actor.policy_loss.loss_mode=<name>` (or, with ``registry``
    BYPASS_LOSS_TYPES, as a bypass-mode loss_type), with what it needs.

    The function's keyword-only parameters must be exactly COMMON_ARGUMENTS plus the declared settings,
    option keywords, inputs and switches, so that nothing is passed to it undeclared or silently dropped.
    """

    def add(fn: PolicyLossFn) -> PolicyLossFn:
        entry = PolicyLoss(name, fn, tuple(settings), dict(options or {}), tuple(inputs), agg_mode,
                           tuple(switches))
        _check_declaration(entry)
        registry.add(name, entry)
        return fn

    return add


def _check_declaration(entry: PolicyLoss) -> None:
    params = inspect.signature(entry.fn).parameters.values()
    takes = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    declared = {*COMMON_ARGUMENTS, *entry.declared}
    bad_settings = set(entry.settings) - set(SHARED_SETTINGS)
    bad_inputs = set(entry.inputs) - set(LOSS_INPUTS)
    bad_switches = set(entry.switches) - set(LOSS_SWITCHES)
    others = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    if takes != declared or bad_settings or bad_inputs or bad_switches or others:
        raise ArcherError(
            f"policy loss '{entry.name}' does not match its declaration: it takes {sorted(takes)}"
            + (f" and {others}" if others else "") + f", declares {sorted(declared)}",
            "make its parameters keyword-only: the common arguments "
            f"({', '.join(COMMON_ARGUMENTS)}), settings from {', '.join(SHARED_SETTINGS)}, its options, "
            f"inputs from {', '.join(LOSS_INPUTS)} and switches from {', '.join(LOSS_SWITCHES)}, exactly as "
            "registered",
        )


def compute_policy_loss(
    loss_mode: str | PolicyLoss,
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    agg_kwargs: dict[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **named: Any,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Run the named policy loss (or a registered entry). `named` holds the settings and inputs it declares
    (required) and any of its options (omitted ones take the loss's default) and switches (omitted ones are off);
    a loss with a fixed aggregation ignores `loss_agg_mode`. `rollout_is_weights` [B, R] (detached) multiply
    each token's loss; None leaves it as it is. Returns (scalar loss, the loss's metrics)."""
    entry = loss_mode if isinstance(loss_mode, PolicyLoss) else POLICY_LOSSES.lookup(loss_mode)
    token_losses, metrics = entry.fn(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        **entry.arguments(named),
    )
    loss = agg_loss(is_weighted(token_losses, rollout_is_weights), response_mask, entry.agg_mode or loss_agg_mode,
                    **(agg_kwargs or {}))
    return loss, metrics


def is_weighted(token_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """Each token's loss times its rollout-correction IS weight (verl's ``pg_losses * rollout_is_weights``);
    unchanged without weights."""
    return token_losses if rollout_is_weights is None else token_losses * rollout_is_weights


Bound = float | torch.Tensor


def clipped_token_losses(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_ratio_low: Bound, clip_ratio_high: Bound,
    balanced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clip per token: (max(-A*r, -A*clip(r, 1-eps_l, 1+eps_h)), bool where the clipped term is active).

    balanced (AEPO's entropy-balanced clipping): the upper bound is (1+eps_h) * r / sg(r), whose value is
    exactly 1+eps_h and whose gradient is (1+eps_h) * grad logp. Values, the clipped share and the lower side
    stay as they are; a token with A > 0 and r > 1+eps_h (the only one the upper bound clips) gets the
    gradient -A*(1+eps_h)*grad logp instead of 0.
    """
    unclipped = -advantages * ratio
    if balanced:
        upper = (1 + clip_ratio_high) * (ratio / ratio.detach())
        clipped = -advantages * torch.minimum(ratio.clamp(min=1 - clip_ratio_low), upper)
    else:
        clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _balanced_clip_metrics(
    clip_active: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, Metric]:
    """The share of the loss's tokens whose gradient the entropy-balanced clip kept: clipped with A > 0 (above
    1+eps_h; plain PPO gives them no gradient)."""
    kept = clip_active & (advantages > 0)
    return {"entropy_balanced_clip_kept_frac": masked_mean_metric(kept.float(), response_mask)}


@register_policy_loss("vanilla", settings=SHARED_SETTINGS, switches=(BALANCED_CLIPPING,))
def vanilla_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    enable_entropy_balanced_clipping: bool,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """PPO clip, plus dual-clip on A < 0 tokens: L = min(L, -A*c); optionally AEPO's entropy-balanced clip."""
    token_losses, log_ratio, clip_active, dual_active = _dual_clip_losses(
        old_log_prob, log_prob, advantages, clip_ratio_low, clip_ratio_high, clip_ratio_c,
        enable_entropy_balanced_clipping)
    metrics = _metrics(log_ratio, clip_active, dual_active, response_mask)
    if enable_entropy_balanced_clipping:
        metrics.update(_balanced_clip_metrics(clip_active, advantages, response_mask))
    return token_losses, metrics


def _check_dual_clip(clip_ratio_c: float) -> None:
    if clip_ratio_c <= 1.0:
        raise ArcherError(
            f"clip_ratio_c must be greater than 1.0 for dual-clip PPO, got {clip_ratio_c}",
            "set actor_rollout_ref.actor.clip_ratio_c to a value > 1 (default 3.0)",
        )


def _dual_clip_losses(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
    clip_ratio_low: Bound, clip_ratio_high: Bound, clip_ratio_c: float, balanced: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token dual-clip PPO losses (`balanced`: with the entropy-balanced upper bound), the clamped
    log-ratio, and where the clip / the dual-clip is active."""
    _check_dual_clip(clip_ratio_c)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ppo_losses, clip_active = clipped_token_losses(
        log_ratio.exp(), advantages, clip_ratio_low, clip_ratio_high, balanced)
    dual_bound = -advantages * clip_ratio_c
    dual_active = (advantages < 0) & (ppo_losses > dual_bound)
    return torch.where(dual_active, dual_bound, ppo_losses), log_ratio, clip_active, dual_active


def _entropy_split_bounds(
    high_entropy_mask: torch.Tensor, like: torch.Tensor, low_entropy_clip_ratio_low: float,
    low_entropy_clip_ratio_high: float, high_entropy_clip_ratio_low: float, high_entropy_clip_ratio_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Archer's and ASPO's per-token (eps_l, eps_h) in the dtype of `like`: the high-entropy class's bounds on
    high-entropy tokens, the low-entropy class's elsewhere."""

    def split(low: float, high: float) -> torch.Tensor:
        return like.new_full(high_entropy_mask.shape, low).masked_fill_(high_entropy_mask, high)

    return (split(low_entropy_clip_ratio_low, high_entropy_clip_ratio_low),
            split(low_entropy_clip_ratio_high, high_entropy_clip_ratio_high))


@register_policy_loss("archer", settings=("clip_ratio_c",), inputs=("high_entropy_mask",),
                      options={"low_entropy_clip_ratio_low": 0.2, "low_entropy_clip_ratio_high": 0.2,
                               "high_entropy_clip_ratio_low": 0.5, "high_entropy_clip_ratio_high": 0.5},
                      switches=(BALANCED_CLIPPING,))
def archer_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_c: float,
    high_entropy_mask: torch.Tensor,
    low_entropy_clip_ratio_low: float,
    low_entropy_clip_ratio_high: float,
    high_entropy_clip_ratio_low: float,
    high_entropy_clip_ratio_high: float,
    enable_entropy_balanced_clipping: bool,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Archer's dual-token constraints: dual-clip PPO whose clip range depends on the token's entropy class
    (the paper's 0.2 for low-entropy and 0.5 for high-entropy tokens). The entropy-balanced clip, when on,
    rewrites the upper bound of every token, each with its class's eps_h."""
    eps_low, eps_high = _entropy_split_bounds(
        high_entropy_mask, log_prob, low_entropy_clip_ratio_low, low_entropy_clip_ratio_high,
        high_entropy_clip_ratio_low, high_entropy_clip_ratio_high)
    token_losses, log_ratio, clip_active, dual_active = _dual_clip_losses(
        old_log_prob, log_prob, advantages, eps_low, eps_high, clip_ratio_c, enable_entropy_balanced_clipping)
    metrics = _metrics(log_ratio, clip_active, dual_active, response_mask)
    metrics.update(_entropy_class_metrics(high_entropy_mask, clip_active, response_mask))
    if enable_entropy_balanced_clipping:
        metrics.update(_balanced_clip_metrics(clip_active, advantages, response_mask))
    return token_losses, metrics


@register_policy_loss("aspo", settings=("clip_ratio_c",), inputs=("high_entropy_mask",),
                      options={"low_entropy_clip_ratio_low": 0.2, "low_entropy_clip_ratio_high": 0.2,
                               "high_entropy_clip_ratio_low": 0.4, "high_entropy_clip_ratio_high": 0.4})
def aspo_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_c: float,
    high_entropy_mask: torch.Tensor,
    low_entropy_clip_ratio_low: float,
    low_entropy_clip_ratio_high: float,
    high_entropy_clip_ratio_low: float,
    high_entropy_clip_ratio_high: float,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """ASPO (Archer2.0): asymmetric importance sampling with a soft dual-clip, on the entropy split (the
    paper's clip 0.2 for low-entropy and 0.4 for high-entropy tokens).

    A < 0: r_hat = max(r, 1-eps_l), loss -A*r_hat; where r_hat > c the loss is -A*c*logp (gradient -c*A).
    A >= 0 (flipped ratio): r_hat = min(r, 1+eps_h), loss -A*(r_hat/sg(r_hat))/sg(r_hat), value -A/r_hat,
    gradient -A/r * grad logp below the clip and 0 above it; where 1/r_hat > c the loss is -A*c*logp.
    """
    _check_dual_clip(clip_ratio_c)
    eps_low, eps_high = _entropy_split_bounds(
        high_entropy_mask, log_prob, low_entropy_clip_ratio_low, low_entropy_clip_ratio_high,
        high_entropy_clip_ratio_low, high_entropy_clip_ratio_high)
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
    metrics = _metrics(log_ratio, clip_active, soft_active, response_mask)
    metrics.update(_entropy_class_metrics(high_entropy_mask, clip_active, response_mask))
    return token_losses, metrics


@register_policy_loss("clip_cov", settings=("clip_ratio_low", "clip_ratio_high"),
                      options={"policy_loss.clip_cov_ratio": 0.0002, "policy_loss.clip_cov_lb": 1.0,
                               "policy_loss.clip_cov_ub": 5.0}, switches=(BALANCED_CLIPPING,))
def clip_cov_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_cov_ratio: float,
    clip_cov_lb: float,
    clip_cov_ub: float,
    enable_entropy_balanced_clipping: bool,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Clip-Cov: PPO clip, and the gradient of a few random tokens with lb < cov(A, logp) < ub is cut off (drawn
    with torch's default generator of their device, which the trainer seeds). With the entropy-balanced clip the
    clipped tokens keep a gradient; the candidates are still the tokens the PPO clip did not clip."""
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ppo_losses, clip_active = clipped_token_losses(
        log_ratio.exp(), advantages, clip_ratio_low, clip_ratio_high, enable_entropy_balanced_clipping)
    cov = advantage_logp_covariance(advantages, log_prob, response_mask)
    cut = clip_cov_tokens(cov, response_mask.bool() & ~clip_active, clip_cov_ratio, clip_cov_lb, clip_cov_ub)
    token_losses = torch.where(cut, 0.0, ppo_losses)
    metrics = _metrics(log_ratio, clip_active, torch.zeros_like(clip_active), response_mask)
    metrics["cov_selected_tokens"] = Total(cut.sum().float())
    if enable_entropy_balanced_clipping:
        metrics.update(_balanced_clip_metrics(clip_active, advantages, response_mask))
    return token_losses, metrics


@register_policy_loss("kl_cov", options={"policy_loss.kl_cov_ratio": 0.0002, "policy_loss.ppo_kl_coef": 0.1})
def kl_cov_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    kl_cov_ratio: float,
    ppo_kl_coef: float,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """KL-Cov: unclipped -A*r, plus ppo_kl_coef * |logp - old_logp| on the tokens of largest cov(A, logp).

    The defaults are verl's (ratio 2e-4, coefficient 0.1); the kl_cov preset sets the paper's 7B values.
    """
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    pg_losses = -advantages * log_ratio.exp()
    cov = advantage_logp_covariance(advantages, log_prob, response_mask)
    penalised = kl_cov_tokens(cov, kl_cov_ratio)
    token_losses = torch.where(penalised, pg_losses + ppo_kl_coef * log_ratio.abs(), pg_losses)
    no_clip = torch.zeros_like(penalised)
    metrics = _metrics(log_ratio, no_clip, no_clip, response_mask)
    metrics["cov_selected_tokens"] = Total(penalised.sum().float())
    return token_losses, metrics


GSPO_AGG_MODE = "seq-mean-token-mean"


@register_policy_loss("gspo", settings=("clip_ratio_low", "clip_ratio_high"), agg_mode=GSPO_AGG_MODE)
def gspo_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """GSPO: the token ratio is replaced by sg(s_i) * pi_t / sg(pi_t), s_i = exp(mean_t(logp - old_logp)).

    Registered with a fixed seq-mean-token-mean aggregation, the paper's sequence-level objective (the mean over
    responses of each response's token mean), whatever actor.loss_agg_mode says; archer warns when it says
    otherwise. (verl 0.9.1 aggregates GSPO with the configured loss_agg_mode instead.) Its log-ratio is clamped
    at 10 before exp; there is no dual-clip.
    """
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1).detach().unsqueeze(-1)
    token_log_ratio = (log_prob - log_prob.detach() + seq_log_ratio).clamp(max=GSPO_LOG_RATIO_MAX)
    token_losses, clip_active = clipped_token_losses(
        token_log_ratio.exp(), advantages, clip_ratio_low, clip_ratio_high
    )
    no_dual = torch.zeros_like(clip_active)
    return token_losses, _metrics(log_ratio, clip_active, no_dual, response_mask)


@register_policy_loss("reinforce", registry=BYPASS_LOSS_TYPES)
def reinforce_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """The bypass mode's REINFORCE (verl's loss_type=reinforce): L = -A * sg(w) * logp per token, no clipping,
    with w the rollout-correction IS weight pi_theta / pi_rollout (1 without rollout_is); ``old_log_prob`` are the
    rollout log-probs, read for ppo_kl only."""
    token_losses = -advantages * log_prob
    return token_losses, {"ppo_kl": masked_mean_metric(old_log_prob - log_prob, response_mask)}


def _entropy_class_metrics(
    high_entropy_mask: torch.Tensor, clip_active: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, Metric]:
    """Share of valid tokens in each entropy class, and the clipped share within each class."""
    valid = response_mask.bool()
    high = high_entropy_mask & valid
    low = ~high_entropy_mask & valid
    return {
        "entropy_low_frac": masked_mean_metric(low.float(), response_mask),
        "entropy_high_frac": masked_mean_metric(high.float(), response_mask),
        "entropy_low_clipfrac": masked_mean_metric(clip_active.float(), low),
        "entropy_high_clipfrac": masked_mean_metric(clip_active.float(), high),
    }


def _metrics(
    log_ratio: torch.Tensor, clip_active: torch.Tensor, dual_active: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, Metric]:
    """Means over the loss's tokens: the clipped share, the approximate KL to the old policy, the dual-clipped share."""
    return {
        "pg_clipfrac": masked_mean_metric(clip_active.float(), response_mask),
        "ppo_kl": masked_mean_metric(-log_ratio, response_mask),
        "pg_clipfrac_lower": masked_mean_metric(dual_active.float(), response_mask),
    }
