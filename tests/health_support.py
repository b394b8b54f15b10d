"""Builders for the health checks' tests: settings with a few keys changed, a step's responses from plain lists,
and a metric stream run through the engine step by step (as training runs it, or as a replay does)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from archer.health.engine import Flag, HealthEngine
from archer.health.rows import StepRows
from archer.health.settings import HealthSettings, default_health_config


def settings(**changes: Any) -> HealthSettings:
    """The default trainer.health settings with ``changes`` (dotted keys written with __: entropy_blowup__ratio)."""
    node = default_health_config()
    for key, value in changes.items():
        OmegaConf.update(node, key.replace("__", "."), value)
    return HealthSettings.from_config(node)


def make_rows(entropies: Sequence[Sequence[float]], *, mask: Sequence[Sequence[int]] | None = None,
              log_probs: Sequence[Sequence[float]] | None = None, advantages: Sequence[Sequence[float]] | None = None,
              responses: Sequence[Sequence[int]] | None = None, uid: Sequence[str] | None = None,
              reward: Sequence[float] | None = None, acc: Sequence[float] | None = None,
              extras: dict[str, Sequence[float]] | None = None, calls: list[list[str]] | None = None,
              row: Sequence[int] | None = None) -> StepRows:
    """A step's responses; unset arrays are all-valid masks, zeros, and one prompt group per response."""
    h = np.asarray(entropies, dtype=np.float32)
    n, length = h.shape
    zeros = np.zeros((n, length), dtype=np.float32)
    return StepRows(
        entropies=h, mask=np.ones((n, length), bool) if mask is None else np.asarray(mask, dtype=bool),
        log_probs=zeros if log_probs is None else np.asarray(log_probs, dtype=np.float32),
        advantages=zeros if advantages is None else np.asarray(advantages, dtype=np.float32),
        responses=np.arange(n * length).reshape(n, length) if responses is None else np.asarray(responses),
        uid=np.asarray([f"g{i}" for i in range(n)] if uid is None else list(uid)),
        reward=np.zeros(n) if reward is None else np.asarray(reward, dtype=np.float64),
        row=np.arange(n) if row is None else np.asarray(row),
        acc=None if acc is None else np.asarray(acc, dtype=np.float64),
        extras={k: np.asarray(v, dtype=np.float64) for k, v in (extras or {}).items()}, calls=calls)


def run_stream(stream: Sequence[dict[str, float]], health: HealthSettings | None = None,
               rows: dict[int, StepRows] | None = None, first_step: int = 1) -> tuple[HealthEngine, list[Flag]]:
    """Each dict of ``stream`` is one step's metrics (steps from ``first_step``), ``rows`` the responses of the
    steps that have them; returns the engine after the last step and every flag raised."""
    engine = HealthEngine(health or settings())
    flags: list[Flag] = []
    for step, metrics in enumerate(stream, start=first_step):
        flags += engine.step(step, dict(metrics), (rows or {}).get(step))[1]
    return engine, flags


def flagged(flags: Sequence[Flag]) -> list[tuple[int, str, str]]:
    """(step, check, severity) of each flag."""
    return [(f.step, f.check, f.severity) for f in flags]


# A run folder for the explorer's Health tab: an entropy trace of steps 1-3 (trace_support), metrics.jsonl and
# two flags in health.jsonl, each pointing at responses of a traced step.
HEALTH_FLAGS = [
    {"step": 2, "check": "instability", "severity": "warning", "message": "actor/ppo_kl 0.2 over the last 3 steps",
     "figures": {"actor/ppo_kl": 0.2},
     "pointers": [{"row": 4, "uid": "s2-g1", "value": 1.5, "why": "largest policy-gradient weight", "positions": [1, 3]}]},
    {"step": 3, "check": "entropy_blowup", "severity": "critical", "message": "entropy 0.5 -> 1.2 (x2.40)",
     "figures": {"entropy_then": 0.5, "entropy_now": 1.2},
     "pointers": [{"row": 5, "uid": "s3-g1", "value": 2.1, "why": "highest mean token entropy", "positions": [0, 2]},
                  {"row": 0, "uid": "s3-g0", "value": 1.9, "why": "highest mean token entropy", "positions": [4]}]},
]


def write_health_run(folder: Path, tokenizer: Any, flags: Sequence[dict] = tuple(HEALTH_FLAGS)) -> Path:
    """The run folder; returns its entropy trace."""
    import trace_support

    trace = trace_support.write_trace(folder / "entropy_trace", tokenizer, kind="entropy", steps=(1, 2, 3))
    metrics = [{"step": s, "actor/entropy": 0.5 * s, "critic/score/mean": 0.4 / s, "critic/acc/mean": 0.4 / s,
                "response_length/mean": 10.0 + s} for s in (1, 2, 3)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (folder / "health.jsonl").write_text("".join(json.dumps(f) + "\n" for f in flags))
    return trace
