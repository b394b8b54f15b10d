"""The run's per-step values (verl's metrics and the health figures) and the windows the checks compare.

A trend compares "now", the median of a value over the last ``window`` training steps, with "then", the median
over the ``window`` steps that end ``horizon`` steps before now's last step; while the run is younger than that,
"then" is step 1, whose rollouts come from the policy before any update. Medians keep one noisy step from
making or hiding a trend. Validation values come every ``trainer.test_freq`` steps and are read point by point.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

ACC = "critic/acc/mean"
VAL_ACC = re.compile(r"val-core/(.+)/acc/mean@\d+$")


@dataclass(frozen=True)
class Trend:
    then: float
    now: float

    @property
    def change(self) -> float:
        return self.now - self.then

    @property
    def ratio(self) -> float:
        """now / then (inf when then is 0 and now is not, 1 when both are)."""
        if self.then == 0:
            return 1.0 if self.now == 0 else math.inf
        return self.now / self.then


class History:
    """Values by training step (step 0, validation before training, counts only for validation)."""

    def __init__(self, window: int, horizon: int) -> None:
        self.window = window
        self.horizon = horizon
        self.values: dict[int, dict[str, float]] = {}

    def add(self, step: int, values: dict[str, float]) -> None:
        self.values.setdefault(step, {}).update(values)

    @property
    def steps(self) -> list[int]:
        """The training steps recorded (step 0 is validation only)."""
        return sorted(s for s in self.values if s >= 1)

    def latest(self, key: str) -> float | None:
        """The value of ``key`` at the last training step, when it is finite there."""
        steps = self.steps
        return _finite(self.values[steps[-1]].get(key)) if steps else None

    def _median(self, key: str, steps: list[int]) -> float | None:
        values = [v for v in (_finite(self.values[s].get(key)) for s in steps) if v is not None]
        return float(np.median(values)) if len(values) == len(steps) and values else None

    def now(self, key: str) -> float | None:
        """Median of ``key`` over the last ``window`` training steps (None unless every one has it)."""
        steps = self.steps
        return self._median(key, steps[-self.window:]) if len(steps) >= self.window else None

    def before(self, key: str) -> list[float]:
        """The finite values of ``key`` at the training steps before the window's, up to ``horizon`` of them."""
        steps = self.steps[:-self.window][-self.horizon:]
        return [v for v in (_finite(self.values[s].get(key)) for s in steps) if v is not None]

    def trend(self, key: str) -> Trend | None:
        """(then, now) of ``key``; None until now's window follows step 1 or when a step in either lacks it."""
        steps = self.steps
        if len(steps) < self.window + 1:
            return None
        now = self._median(key, steps[-self.window:])
        end = steps[-1] - self.horizon
        earlier = [s for s in steps if s <= end][-self.window:]
        then_steps = earlier if len(earlier) == self.window else steps[:1]
        then = self._median(key, then_steps)
        return None if now is None or then is None else Trend(then, now)

    def validations(self) -> list[tuple[int, float]]:
        """(step, validation accuracy) of each validation: ``val-core/all/acc/mean@n`` when the run logs it,
        else the mean over its data sources."""
        points = []
        for step in sorted(self.values):
            found: dict[str, float] = {}
            for key, value in self.values[step].items():
                match = VAL_ACC.match(key)
                if match and _finite(value) is not None:
                    found[match.group(1)] = float(value)
            if found:
                points.append((step, found["all"] if "all" in found else float(np.mean(list(found.values())))))
        return points


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None
