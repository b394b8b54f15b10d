"""The run's per-step values (verl's metrics and the health figures) and the windows the checks compare.

A trend compares "now", the median of a value over the last ``window`` training steps, with "then", the median
over the ``window`` steps that end ``horizon`` steps before now's last step; while the run is younger than that,
"then" is step 1, whose rollouts come from the policy before any update. Medians keep one noisy step from
making or hiding a trend. Validation values come every ``trainer.test_freq`` steps and are read point by point.
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
from dataclasses import dataclass

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
        self.steps: list[int] = []  # the training steps recorded (step 0 is validation only), in order
        self._validations: dict[int, float] = {}
        self._trends: dict[str, Trend | None] = {}  # of the last step, computed once per key

    def add(self, step: int, values: dict[str, float]) -> None:
        if step >= 1 and step not in self.values:
            bisect.insort(self.steps, step)
        self.values.setdefault(step, {}).update(values)
        self._trends.clear()
        found = {match.group(1): float(v) for k, v in self.values[step].items()
                 if (match := VAL_ACC.match(k)) and _finite(v) is not None}
        if found:
            self._validations[step] = found["all"] if "all" in found else statistics.fmean(found.values())

    def latest(self, key: str) -> float | None:
        """The value of ``key`` at the last training step, when it is finite there."""
        return _finite(self.values[self.steps[-1]].get(key)) if self.steps else None

    def _median(self, key: str, steps: list[int]) -> float | None:
        values = [v for v in (_finite(self.values[s].get(key)) for s in steps) if v is not None]
        return float(statistics.median(values)) if len(values) == len(steps) and values else None

    def now(self, key: str) -> float | None:
        """Median of ``key`` over the last ``window`` training steps (None unless every one has it)."""
        return self._median(key, self.steps[-self.window:]) if len(self.steps) >= self.window else None

    def before(self, key: str) -> list[float]:
        """The finite values of ``key`` at the ``horizon`` training steps before the last one."""
        steps = self.steps[:-1][-self.horizon:]
        return [v for v in (_finite(self.values[s].get(key)) for s in steps) if v is not None]

    def trend(self, key: str) -> Trend | None:
        """(then, now) of ``key``; None until now's window follows step 1 or when a step in either lacks it."""
        if key not in self._trends:
            self._trends[key] = self._trend(key)
        return self._trends[key]

    def _trend(self, key: str) -> Trend | None:
        steps = self.steps
        if len(steps) < self.window + 1:
            return None
        now = self._median(key, steps[-self.window:])
        end = bisect.bisect_right(steps, steps[-1] - self.horizon)
        earlier = steps[max(end - self.window, 0):end]
        then = self._median(key, earlier if len(earlier) == self.window else steps[:1])
        return None if now is None or then is None else Trend(then, now)

    def validations(self) -> list[tuple[int, float]]:
        """(step, validation accuracy) of each validation: ``val-core/all/acc/mean@n`` when the run logs it,
        else the mean over its data sources."""
        return sorted(self._validations.items())


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None
