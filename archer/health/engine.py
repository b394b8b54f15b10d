"""One step of the health checks, the same while training (monitor.py) and afterwards (offline.py).

``HealthEngine.step`` takes the step's metrics (verl's names) and, when it has them, the step's responses; it
computes the figures (figures.py), records both in the history, runs every check (checks.py) and returns the
``health/*`` metrics and the new flags. A check flags when its finding is more severe than its current state
(a new condition, or one that got worse); the state returns to 0 once the check has found nothing for
``window`` steps in a row, so a condition that lasts is one flag, not one per step. ``health/<check>`` is the
severity the check found at the step (0 none, 1 info, 2 warning, 3 critical), whatever was flagged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from archer.health.checks import CHECKS, Check, Context, Finding
from archer.health.figures import ZERO_ADV, step_figures
from archer.health.history import History
from archer.health.pointers import Pointer
from archer.health.rows import ScoredResponses, StepRows
from archer.health.settings import LEVELS, HealthSettings

FIGURE_PREFIX = "health/"
FLAG_COUNT = "health/flags"
CANDIDATES, KEPT = "train/num_candidate_groups", "train/num_kept_groups"


@dataclass
class Flag:
    step: int
    check: str
    title: str
    severity: str
    message: str
    figures: dict[str, float] = field(default_factory=dict)
    pointers: list[Pointer] = field(default_factory=list)

    def line(self) -> str:
        """The console line: ``<title> at step N (<severity>): <message>; see responses r1, r2 (step N)``."""
        rows = ", ".join(str(p.row) for p in self.pointers)
        return (f"{self.title} at step {self.step} ({self.severity}): {self.message}"
                + (f"; responses {rows} of the step carry it" if rows else ""))

    def to_json(self) -> dict[str, Any]:
        """One line of <run>/health.jsonl."""
        return {"step": self.step, "check": self.check, "severity": self.severity, "message": self.message,
                "figures": {k: v if math.isfinite(v) else None for k, v in self.figures.items()},
                "pointers": [p.to_json() for p in self.pointers]}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Flag:
        titles = {c.name: c.title for c in CHECKS}
        return cls(int(record["step"]), str(record["check"]), titles.get(record["check"], record["check"]),
                   str(record["severity"]), str(record["message"]),
                   {k: float("nan") if v is None else float(v) for k, v in record.get("figures", {}).items()},
                   [Pointer(**p) for p in record.get("pointers", [])])


def level_key(check: Check) -> str:
    return f"{FIGURE_PREFIX}{check.name}"


class HealthEngine:
    def __init__(self, settings: HealthSettings) -> None:
        self.settings = settings
        self.history = History(settings.window, settings.horizon)
        self.state = {c.name: 0 for c in CHECKS}
        self.quiet = {c.name: 0 for c in CHECKS}  # steps in a row without a finding

    def figures(self, metrics: dict[str, float], rows: StepRows | None) -> dict[str, float]:
        """The step's figures from its responses, or those recorded in its metrics (a replay without them)."""
        if rows is None:
            not_figures = {FLAG_COUNT, *(level_key(c) for c in CHECKS)}
            figures = {k: v for k, v in metrics.items() if k.startswith(FIGURE_PREFIX) and k not in not_figures}
        else:
            figures = step_figures(rows, near_deterministic_entropy=self.settings.near_deterministic_entropy,
                                   ngram=self.settings.repetition_ngram)
        share = generated_zero_share(metrics, figures.get(ZERO_ADV))
        if share is not None:
            figures[ZERO_ADV] = share
        return figures

    def restore(self, step: int, metrics: dict[str, float]) -> None:
        """Take a step logged before a resume: its values join the history and its levels become the states."""
        self.history.add(step, metrics)
        if step >= 1:
            for check in CHECKS:
                level = metrics.get(level_key(check))
                self.state[check.name] = int(level) if level is not None and math.isfinite(level) else 0

    def step(self, step: int, metrics: dict[str, float], rows: StepRows | None,
             figures: dict[str, float] | None = None, scored: ScoredResponses | None = None
             ) -> tuple[dict[str, float], list[Flag]]:
        """The step's health/* metrics and the flags it raises (``figures``: the step's, when the caller has
        them already; ``scored``: every response it generated, trained or dropped). Step 0, the validation
        before training, only joins the history."""
        if step < 1:
            self.history.add(step, metrics)
            return {}, []
        figures = self.figures(metrics, rows) if figures is None else figures
        self.history.add(step, {**metrics, **figures})
        context = Context(self.history, rows, self.settings, scored)
        out, flags = dict(figures), []
        for check in CHECKS:
            finding: Finding | None = check.evaluate(context)
            level = LEVELS[finding.severity] if finding else 0
            out[level_key(check)] = float(level)
            if finding is not None and level > self.state[check.name]:
                flags.append(Flag(step, check.name, check.title, finding.severity, finding.message, finding.figures,
                                  finding.pointers))
                self.state[check.name] = level
            self.quiet[check.name] = 0 if finding else self.quiet[check.name] + 1
            if self.quiet[check.name] >= self.settings.window:
                self.state[check.name] = 0
        out[FLAG_COUNT] = float(len(flags))
        return out, flags


def generated_zero_share(metrics: dict[str, float], batch_share: float | None) -> float | None:
    """The share of the step's generated prompt groups without signal. Groups that dynamic sampling or
    rejection sampling dropped before the batch (train/num_candidate_groups minus train/num_kept_groups) count
    as such: an upper bound with dynamic sampling, whose last generation batch may hold more informative
    groups than it kept. Without the batch's own share (a replay of metrics alone), a step whose advantages are
    all zero (critic/advantages/max = min = 0) counts as 1, any other as unknown."""
    if batch_share is None and metrics.get("critic/advantages/max") == metrics.get("critic/advantages/min") == 0:
        batch_share = 1.0
    candidates, kept = metrics.get(CANDIDATES), metrics.get(KEPT)
    if not candidates or kept is None or kept >= candidates:
        return batch_share
    if kept == 0:
        return 1.0
    return None if batch_share is None else (candidates - kept + batch_share * kept) / candidates
