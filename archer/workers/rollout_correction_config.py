"""Reads ``algorithm.rollout_correction`` from the config into the pure settings the correction computes with
(``RolloutCorrection``, archer/algorithms/rollout_correction.py), checking every key once: the IS level and its
threshold (a number: TIS; ``"lower_upper"``: IcePop), the rejection options with their thresholds, and the bypass
mode's loss type. The trainer's correction stage, its config check and each rank's actor read it here.
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, ListConfig

from archer.algorithms.policy_loss import BYPASS_LOSS_TYPES, PPO_CLIP
from archer.algorithms.rollout_correction import (
    IS_LEVELS,
    KEY,
    REJECTION_OPTIONS,
    RejectionRule,
    RolloutCorrection,
)
from archer.errors import ArcherError


def read_rollout_correction(c: DictConfig) -> RolloutCorrection:
    """The settings of the ``algorithm.rollout_correction`` section ``c``; an ArcherError names a bad key."""
    level = None if c.rollout_is is None else IS_LEVELS.lookup(str(c.rollout_is))
    if level is not None and c.rollout_is_threshold is None:
        raise ArcherError(f"{KEY}.rollout_is={level.name} needs {KEY}.rollout_is_threshold (null would compute "
                          "no weights)", f"set {KEY}.rollout_is_threshold (e.g. 2.0, or 0.5_5.0 for IcePop), or "
                          "rollout_is=null")
    upper, lower = (2.0, None) if c.rollout_is_threshold is None else parse_is_threshold(c.rollout_is_threshold)
    rules: tuple[RejectionRule, ...] = ()
    if c.rollout_rs is not None:
        rules = parse_rejection(c.rollout_rs, c.rollout_rs_threshold)
    loss_type = str(c.loss_type)
    known = (PPO_CLIP, *BYPASS_LOSS_TYPES)
    if loss_type not in known:
        raise ArcherError(f"unknown {KEY}.loss_type {loss_type!r}", f"set it to one of: {', '.join(known)}")
    if loss_type != PPO_CLIP and not c.bypass_mode:
        raise ArcherError(f"{KEY}.loss_type={loss_type} applies in the bypass mode only (the decoupled mode "
                          "trains with actor.policy_loss.loss_mode)",
                          f"set {KEY}.bypass_mode=true, or loss_type={PPO_CLIP}")
    if not isinstance(c.rollout_is_batch_normalize, bool):
        raise ArcherError(f"{KEY}.rollout_is_batch_normalize={c.rollout_is_batch_normalize!r} is not a boolean",
                          "set it to true or false")
    return RolloutCorrection(level, upper, lower, bool(c.rollout_is_batch_normalize), rules, bool(c.bypass_mode),
                             loss_type)


def _positive(value: float, what: str, key: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ArcherError(f"{key}: {what} must be a positive number, got {value}", f"fix {key}")
    return value


def _number(text: Any, key: str) -> float:
    if isinstance(text, bool):
        raise ArcherError(f"{key}={text!r} is not a threshold", f"set {key} to a number or a lower_upper string")
    try:
        return float(text)
    except (TypeError, ValueError) as e:
        raise ArcherError(f"{key}: {text!r} is not a number", f"set {key} to a number or a lower_upper string "
                          "such as 0.5_2.0") from e


def _bounds(spec: Any, key: str) -> tuple[float, float | None]:
    """(upper, lower or None) of a threshold: a number (upper only) or a "lower_upper" string."""
    text = str(spec).strip() if isinstance(spec, str) else spec
    if isinstance(text, str) and "_" in text:
        low, high = text.split("_", 1)
        lower, upper = _positive(_number(low, key), "the lower bound", key), _positive(_number(high, key),
                                                                                      "the upper bound", key)
        if lower > upper:
            raise ArcherError(f"{key}={spec!r}: the lower bound is above the upper bound", f"fix {key}")
        return upper, lower
    return _positive(_number(text, key), "the threshold", key), None


def parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """rollout_is_threshold: a number (TIS upper bound) or "lower_upper" (IcePop)."""
    return _bounds(spec, f"{KEY}.rollout_is_threshold")


def _comma_string(value: Any) -> Any:
    """A list (``[a,b]`` on the command line, which a comma-separated override needs quoted) as verl's string."""
    return ",".join(str(v) for v in value) if isinstance(value, ListConfig | list | tuple) else value


def parse_rejection(options: Any, thresholds: Any) -> tuple[RejectionRule, ...]:
    """rollout_rs (comma-separated options, duplicates dropped) with rollout_rs_threshold: one entry per option, or
    one for all; k1 options take "lower_upper" ratio bounds (a number: upper, lower its reciprocal), the others an
    upper bound."""
    key = f"{KEY}.rollout_rs"
    options, thresholds = _comma_string(options), _comma_string(thresholds)
    if not isinstance(options, str):
        raise ArcherError(f"{key}={options!r} is not a string", f"set {key} to comma-separated options, e.g. "
                          "token_k1,seq_max_k2")
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    if not names:
        raise ArcherError(f"{key}={options!r} names no option", f"set {key} to options of: "
                          f"{', '.join(REJECTION_OPTIONS)}, or to null")
    chosen = [REJECTION_OPTIONS.lookup(name) for name in names]
    tkey = f"{KEY}.rollout_rs_threshold"
    if thresholds is None:
        raise ArcherError(f"{key}={options} needs {tkey}", f"set {tkey} (one entry per option, or one for all)")
    specs = [s.strip() for s in thresholds.split(",") if s.strip()] if isinstance(thresholds, str) else [thresholds]
    if len(specs) not in (1, len(chosen)):
        raise ArcherError(f"{tkey}={thresholds!r} has {len(specs)} entries for {len(chosen)} options",
                          "give one threshold for all options, or one per option in their order")
    specs = specs * len(chosen) if len(specs) == 1 else specs
    rules = []
    for option, spec in zip(chosen, specs, strict=True):
        upper, lower = _bounds(spec, f"{tkey} ({option.name})")
        if option.divergence.two_sided:
            lower = 1.0 / upper if lower is None else lower
            rules.append(RejectionRule(option, math.log(upper), math.log(lower)))
        elif lower is not None:
            raise ArcherError(f"{tkey}={spec!r}: {option.name} takes an upper bound only", f"give {option.name} one "
                              "number")
        else:
            rules.append(RejectionRule(option, upper, None))
    return tuple(rules)
