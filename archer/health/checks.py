"""The health checks: each reads the run's history (history.py) and the step's responses when it has them
(rows.py), and returns a Finding (severity, message, the figures behind it, pointers) or None.

docs/health.md states every rule with its grounding; the thresholds are ``trainer.health.<check>.*``. A rule
"without accuracy" means the training accuracy (``critic/acc/mean``: the rule reward's, also under a reward
model or a shaped score) rose by less than ``trainer.health.accuracy_rise`` over the same trend. Checks of
metrics a run does not log (tools, rollout correction, staleness) stay silent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from archer.health.figures import (
    LOGP_ADV_COV,
    NEAR_DETERMINISTIC,
    REPEATED_CALLS,
    REPETITION,
    ZERO_ADV,
    repeated_ngrams,
    repetition_shares,
    token_covariance,
)
from archer.health.history import ACC, History, Trend
from archer.health.pointers import Pointer, mean_over_tokens, top_responses, top_tokens
from archer.health.rows import ScoredResponses, StepRows
from archer.health.settings import HealthSettings
from archer.rewards.extras import CORRECT_AT

ENTROPY = "actor/entropy"
SCORE = "critic/score/mean"
LENGTH = "response_length/mean"
TRUNCATED = "response_length/clip_ratio"
CALLS = "tools/calls_per_response"
LIMIT = "tools/call_limit_reached"
STALENESS_MEAN = "training/off_policy/trajectory_staleness/mean"
STALENESS_MAX = "training/off_policy/trajectory_staleness/max"
IS_ESS = "rollout_corr/rollout_is_eff_sample_size"
IS_MEAN = "rollout_corr/rollout_is_mean"
IS_MASKED = "rollout_corr/rollout_rs_masked_fraction"
SKIPPED = "actor/skipped_steps"
PPO_KL = "actor/ppo_kl"
CLIPFRAC = "actor/pg_clipfrac"
KL_LOSS = "actor/kl_loss"
SPIKY = ("actor/grad_norm", "critic/grad_norm", KL_LOSS)  # compared with their own recent median


@dataclass
class Finding:
    severity: str
    message: str
    figures: dict[str, float] = field(default_factory=dict)
    pointers: list[Pointer] = field(default_factory=list)


@dataclass(frozen=True)
class Context:
    """What a check reads at one step."""

    history: History
    rows: StepRows | None
    settings: HealthSettings
    scored: ScoredResponses | None = None  # every generated response with its score, dropped ones too

    def t(self, check: str, key: str) -> float:
        return self.settings.thresholds[check][key]

    @property
    def k(self) -> int:
        return self.settings.pointers

    def accuracy_flat(self) -> tuple[bool, Trend | None]:
        """(the training accuracy did not rise, its trend); not flat when the run logs no accuracy."""
        acc = self.history.trend(ACC)
        return acc is not None and acc.change < self.settings.accuracy_rise, acc


def _f(value: float) -> str:
    return f"{value:.3g}"


def _trend_text(name: str, trend: Trend) -> str:
    return f"{name} {_f(trend.then)} -> {_f(trend.now)}"


def _acc_text(acc: Trend | None) -> str:
    return "" if acc is None else f", training accuracy {_f(acc.then)} -> {_f(acc.now)}"


def _figures(**trends: Trend | float | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in trends.items():
        if isinstance(value, Trend):
            out[f"{name}_then"], out[f"{name}_now"] = value.then, value.now
        elif value is not None:
            out[name] = float(value)
    return out


# -- entropy ---------------------------------------------------------------------------------------------------
def entropy_collapse(ctx: Context) -> Finding | None:
    """Entropy falling fast, the near-deterministic share rising, while accuracy stalls (the entropy spent caps
    it); the covariance of log-prob and advantage as the early sign, whatever the accuracy (Cui et al. 2025)."""
    h, name = ctx.history, "entropy_collapse"
    entropy = h.trend(ENTROPY)
    if entropy is None or entropy.then <= 0:
        return None
    near = h.trend(NEAR_DETERMINISTIC)
    cov = h.now(LOGP_ADV_COV)
    flat, acc = ctx.accuracy_flat()
    ratio = entropy.ratio
    if flat and ratio <= ctx.t(name, "critical_ratio"):
        severity = "critical"
    elif flat and ratio <= ctx.t(name, "warning_ratio") and (
            near is None or near.change >= ctx.t(name, "near_deterministic_rise")):
        severity = "warning"
    elif ratio <= ctx.t(name, "info_ratio") and cov is not None and cov > 0:
        severity = "info"
    else:
        return None
    message = f"{_trend_text('entropy', entropy)} (x{ratio:.2f})"
    if near is not None:
        message += f", {_trend_text('near-deterministic token share', near)}"
    if cov is not None:
        message += f", log-prob/advantage covariance {_f(cov)}" + (" (keeps lowering it)" if cov > 0 else "")
    message += _acc_text(acc)
    pointers = []
    if ctx.rows is not None:
        pointers = top_tokens(ctx.rows, token_covariance(ctx.rows), ctx.k,
                              "largest log-prob x advantage covariance term (a token the update makes surer)")
    return Finding(severity, message,
                   _figures(entropy=entropy, near_deterministic_frac=near, logp_adv_cov=cov, acc=acc), pointers)


def entropy_blowup(ctx: Context) -> Finding | None:
    """Entropy rising without accuracy, with accuracy falling or the responses getting longer or repetitive."""
    h, name = ctx.history, "entropy_blowup"
    entropy = h.trend(ENTROPY)
    flat, acc = ctx.accuracy_flat()
    if entropy is None or acc is None or not flat or entropy.ratio < ctx.t(name, "ratio"):
        return None
    length, repetition = h.trend(LENGTH), h.trend(REPETITION)
    falling = acc.change <= -ctx.settings.accuracy_rise
    longer = length is not None and length.ratio >= 1 + ctx.t(name, "length_rise")
    repeating = repetition is not None and repetition.change >= ctx.t(name, "repetition_rise")
    if not (falling or longer or repeating):
        return None
    severity = "critical" if acc.change <= -ctx.t(name, "critical_acc_drop") else "warning"
    message = f"{_trend_text('entropy', entropy)} (x{entropy.ratio:.2f}){_acc_text(acc)}"
    if length is not None:
        message += f", {_trend_text('mean length', length)}"
    if repeating:
        message += f", {_trend_text('repeated n-gram share', repetition)}"
    pointers = []
    rows = ctx.rows
    if rows is not None and repeating:
        repeats = repeated_ngrams(rows, ctx.settings.repetition_ngram)
        pointers = top_responses(rows, repetition_shares(rows, ctx.settings.repetition_ngram), ctx.k,
                                 "largest share of repeated n-grams", positions=repeats)
    elif rows is not None:
        pointers = top_responses(rows, mean_over_tokens(rows, rows.entropies), ctx.k,
                                 "highest mean token entropy", token_scores=rows.entropies)
    return Finding(severity, message, _figures(entropy=entropy, acc=acc, length=length, repetition_frac=repetition),
                   pointers)


# -- length, reward, tools --------------------------------------------------------------------------------------
def length_hacking(ctx: Context) -> Finding | None:
    """Length, or the share cut at max_response_length, rising without accuracy while the training score does
    not fall (longer responses are being paid for; a run whose score falls as it lengthens degenerates, which
    entropy_blowup says)."""
    h, name = ctx.history, "length_hacking"
    flat, acc = ctx.accuracy_flat()
    score = h.trend(SCORE)
    if not flat or score is None or score.change < 0:
        return None
    length, cut = h.trend(LENGTH), h.trend(TRUNCATED)
    longer = length is not None and length.ratio >= 1 + ctx.t(name, "length_rise")
    truncating = cut is not None and cut.now >= ctx.t(name, "truncated") and cut.change >= ctx.t(name, "truncated_rise")
    if not (longer or truncating):
        return None
    critical = (cut is not None and cut.now >= ctx.t(name, "critical_truncated")
                and acc is not None and acc.change <= -ctx.settings.accuracy_rise)
    parts = [_trend_text("mean length", length)] if length is not None else []
    if cut is not None:
        parts.append(_trend_text("share cut at max_response_length", cut))
    pointers = []
    if ctx.rows is not None:
        rows = ctx.rows
        wrong = rows.acc < CORRECT_AT if rows.acc is not None else None
        extra = np.arange(rows.mask.shape[1])[None, :] >= (0 if length is None else int(length.then))
        pointers = top_responses(rows, rows.lengths.astype(np.float64), ctx.k,
                                 "longest response" + (" among the wrong ones" if wrong is not None else ""),
                                 eligible=wrong, positions=extra & rows.mask)
    parts.append(_trend_text("training score", score))
    return Finding("critical" if critical else "warning", ", ".join(parts) + _acc_text(acc),
                   _figures(length=length, truncated=cut, score=score, acc=acc), pointers)


def reward_hacking(ctx: Context) -> Finding | None:
    """The training score, or one reward extra, rising while accuracy does not; or validation accuracy
    falling while the training score rises."""
    h, name = ctx.history, "reward_hacking"
    flat, acc = ctx.accuracy_flat()
    score = h.trend(SCORE)
    rows = ctx.rows
    wrong = rows.acc < CORRECT_AT if rows is not None and rows.acc is not None else None
    if flat and score is not None and score.change >= ctx.t(name, "reward_rise"):
        critical = acc is not None and acc.change <= -ctx.t(name, "critical_acc_drop")
        return Finding("critical" if critical else "warning", f"{_trend_text('training score', score)}{_acc_text(acc)}",
                       _figures(score=score, acc=acc), _reward_pointers(ctx, None if rows is None else rows.reward, wrong))
    for key in sorted(k for k in (h.values[h.steps[-1]] if h.steps else {}) if _is_extra(k)):
        extra = h.trend(key)
        if flat and extra is not None and extra.change >= ctx.t(name, "extra_rise"):
            label = key.split("/")[1]
            values = rows.extras.get(label) if rows is not None else None
            return Finding("warning", f"reward extra {_trend_text(label, extra)}{_acc_text(acc)}",
                           {**_figures(acc=acc), f"{label}_then": extra.then, f"{label}_now": extra.now},
                           _reward_pointers(ctx, values, wrong, f"highest {label}"))
    return _validation_drop(ctx, wrong)


def _is_extra(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 3 and parts[0] == "reward" and parts[2] == "mean" and parts[1] not in ("score", "acc")


def _validation_drop(ctx: Context, wrong: np.ndarray | None) -> Finding | None:
    """At a validation: accuracy fell by val_drop since the previous one while the training score rose."""
    h, name = ctx.history, "reward_hacking"
    points = h.validations()
    if len(points) < 2 or not h.steps or points[-1][0] != h.steps[-1]:
        return None
    (first, before), (last, after) = points[-2], points[-1]
    scores = [v for s in h.steps if first <= s <= last for v in [h.values[s].get(SCORE)] if v is not None]
    if len(scores) < 2 or before - after < ctx.t(name, "val_drop"):
        return None
    window = h.window
    then, now = float(np.median(scores[:window])), float(np.median(scores[-window:]))
    if now - then < ctx.t(name, "reward_rise"):
        return None
    message = (f"validation accuracy {_f(before)} (step {first}) -> {_f(after)} (step {last}) while the training "
               f"score rose {_f(then)} -> {_f(now)}")
    return Finding("warning", message, {"val_acc_then": before, "val_acc_now": after, "score_then": then,
                                        "score_now": now},
                   _reward_pointers(ctx, None if ctx.rows is None else ctx.rows.reward, wrong))


def _reward_pointers(ctx: Context, values: np.ndarray | None, wrong: np.ndarray | None,
                     why: str = "highest reward") -> list[Pointer]:
    if ctx.rows is None or values is None:
        return []
    return top_responses(ctx.rows, np.asarray(values, dtype=np.float64), ctx.k,
                         why + (" among the wrong ones" if wrong is not None else ""), eligible=wrong)


def tool_abuse(ctx: Context) -> Finding | None:
    """Tool calls per response, or responses hitting call_limit, rising without accuracy; or the same call
    repeated within responses."""
    h, name = ctx.history, "tool_abuse"
    flat, acc = ctx.accuracy_flat()
    calls, limit = h.trend(CALLS), h.trend(LIMIT)
    repeated = h.now(REPEATED_CALLS)
    parts, severity = [], None
    if flat and calls is not None and calls.change >= ctx.t(name, "calls_rise"):
        parts.append(_trend_text("tool calls per response", calls))
        severity = "warning"
    if flat and limit is not None and limit.now >= ctx.t(name, "limit_rate") and limit.change >= ctx.t(name, "limit_rise"):
        parts.append(_trend_text("share of responses asking past call_limit", limit))
        severity = "critical" if limit.now >= ctx.t(name, "critical_limit_rate") else "warning"
    if repeated is not None and repeated >= ctx.t(name, "repeated_calls"):
        parts.append(f"{_f(repeated)} of the calls repeat an earlier identical call of their response")
        severity = severity or "warning"
    if severity is None:
        return None
    pointers = []
    rows = ctx.rows
    if rows is not None and rows.calls is not None:
        counts = np.array([len(c) for c in rows.calls], dtype=np.float64)
        repeats = np.array([len(c) - len(set(c)) for c in rows.calls], dtype=np.float64)
        by_repeats = repeated is not None and repeated >= ctx.t(name, "repeated_calls")
        pointers = top_responses(rows, repeats if by_repeats else counts, ctx.k,
                                 "most repeated calls" if by_repeats else "most tool calls",
                                 eligible=(repeats > 0) if by_repeats else counts > 0)
    return Finding(severity, ", ".join(parts) + _acc_text(acc),
                   _figures(calls=calls, limit=limit, repeated_call_frac=repeated, acc=acc), pointers)


# -- signal and stability --------------------------------------------------------------------------------------
def no_signal(ctx: Context) -> Finding | None:
    """Most prompt groups scored alike over the window: GRPO-style advantages are zero and the step learns little."""
    h, name = ctx.history, "no_signal"
    key = ZERO_ADV
    steps = h.steps[-h.window:]
    values = [h.values[s].get(key) for s in steps]
    if len(steps) < h.window or any(v is None for v in values):
        return None
    share = float(np.median(values))
    if min(values) >= ctx.t(name, "critical"):
        severity = "critical"
    elif share >= ctx.t(name, "warning"):
        severity = "warning"
    else:
        return None
    message = (f"{share:.0%} of the prompt groups scored alike (median of the last {len(steps)} steps): "
               "their advantages are zero")
    pointers = []
    rows = ctx.scored if ctx.scored is not None else ctx.rows  # the dropped groups are the ones scored alike
    if rows is not None and len(rows):
        _, first, group = np.unique(rows.uid, return_index=True, return_inverse=True)
        spread = np.zeros(len(first))
        np.maximum.at(spread, group, np.abs(rows.reward - rows.reward[first][group]))
        alike = np.zeros(len(rows), dtype=bool)
        alike[first[spread == 0]] = True  # one response per group whose rewards are all equal
        pointers = top_responses(rows, rows.reward, ctx.k, "reward its whole group shares", eligible=alike)
    return Finding(severity, message, {"zero_adv_group_frac": share}, pointers)


def instability(ctx: Context) -> Finding | None:
    """Gradient-norm or KL-loss spikes against their recent median, a skipped (non-finite) update, or the
    importance ratio drifting: ppo_kl or the clipped share high over the window."""
    h, name = ctx.history, "instability"
    parts, severity, figures = [], None, {}
    skipped = h.latest(SKIPPED)
    if skipped:
        parts.append("the gradient was not finite: the optimizer step was skipped")
        severity = "critical"
    for key in SPIKY:
        value, before = h.latest(key), h.before(key)
        if value is None or len(before) < h.window or np.median(before) <= 0:
            continue
        factor = value / float(np.median(before))
        figures[key] = value
        if key == KL_LOSS and value < ctx.t(name, "kl_loss_floor"):
            continue  # a policy leaving its reference starts from 0: early KL losses are many medians yet small
        if factor >= ctx.t(name, "spike_factor"):
            parts.append(f"{key} {_f(value)} is {factor:.0f}x its median of the last {len(before)} steps")
            severity = "critical" if factor >= ctx.t(name, "critical_spike_factor") else severity or "warning"
    for key, threshold in ((PPO_KL, "ppo_kl"), (CLIPFRAC, "clipfrac")):
        now = h.now(key)
        if now is not None and abs(now) >= ctx.t(name, threshold):
            parts.append(f"{key} {_f(now)} over the last {h.window} steps (>= {_f(ctx.t(name, threshold))})")
            figures[key] = now
            severity = severity or "warning"
    if severity is None:
        return None
    pointers = []
    if ctx.rows is not None:
        rows = ctx.rows
        weight = np.abs(rows.advantages) * (1 - np.exp(np.minimum(rows.log_probs, 0)))
        pointers = top_tokens(rows, weight, ctx.k, "largest policy-gradient weight |advantage| x (1 - p)")
    return Finding(severity, "; ".join(parts), figures, pointers)


# -- asynchronous runs -------------------------------------------------------------------------------------------
def staleness(ctx: Context) -> Finding | None:
    """Trajectories generated by policies too many versions behind the one trained (verl's off-policy metrics)."""
    h, name = ctx.history, "staleness"
    mean, worst = h.now(STALENESS_MEAN), h.latest(STALENESS_MAX)
    if mean is None and worst is None:
        return None
    parts = []
    if mean is not None and mean >= ctx.t(name, "mean"):
        parts.append(f"mean trajectory staleness {_f(mean)} policy versions over the last {h.window} steps")
    if worst is not None and worst >= ctx.t(name, "max"):
        parts.append(f"the stalest trajectory is {_f(worst)} versions behind")
    if not parts:
        return None
    severity = "critical" if mean is not None and mean >= ctx.t(name, "critical_mean") else "warning"
    return Finding(severity, ", ".join(parts), _figures(staleness_mean=mean, staleness_max=worst))


def importance_weights(ctx: Context) -> Finding | None:
    """Rollout-correction weights collapsing: few effective samples, a mean far from 1, many rejected."""
    h, name = ctx.history, "importance_weights"
    ess, mean, masked = h.now(IS_ESS), h.now(IS_MEAN), h.now(IS_MASKED)
    parts, critical = [], False
    if ess is not None and ess < ctx.t(name, "min_ess"):
        parts.append(f"normalised effective sample size {_f(ess)}")
        critical = ess < ctx.t(name, "critical_ess")
    if mean is not None and abs(mean - 1) > ctx.t(name, "mean_band"):
        parts.append(f"mean importance weight {_f(mean)}")
    if masked is not None and masked >= ctx.t(name, "masked_fraction"):
        parts.append(f"{_f(masked)} of the tokens rejected")
        critical = critical or masked >= ctx.t(name, "critical_masked_fraction")
    if not parts:
        return None
    return Finding("critical" if critical else "warning", ", ".join(parts) + f" (median of the last {h.window} steps)",
                   _figures(ess=ess, is_mean=mean, masked_fraction=masked))


@dataclass(frozen=True)
class Check:
    name: str
    title: str  # how a flag's line names it
    evaluate: Callable[[Context], Finding | None]


CHECKS = (
    Check("entropy_collapse", "entropy collapse risk", entropy_collapse),
    Check("entropy_blowup", "entropy blow-up", entropy_blowup),
    Check("length_hacking", "length hacking", length_hacking),
    Check("reward_hacking", "reward hacking", reward_hacking),
    Check("tool_abuse", "tool-call abuse", tool_abuse),
    Check("no_signal", "no learning signal", no_signal),
    Check("instability", "instability", instability),
    Check("staleness", "stale rollouts", staleness),
    Check("importance_weights", "importance-weight collapse", importance_weights),
)
