"""Metrics that declare how they reduce over the micro-batches of a mini-batch.

A loss returns each metric as a `Mean` (a sum and the count it is a mean over, e.g. a clipped fraction over the
valid tokens) or a `Total` (a quantity that adds up: a token count, or a loss already normalised over the whole
mini-batch). `MetricSums` adds the micro-batch values and divides each Mean's sums only at the end, so the
metrics of a mini-batch do not depend on how it was split into micro-batches. A bare number or tensor is
refused: a new metric cannot be averaged the wrong way by accident.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from archer.algorithms.masked import mask_count, masked_sum

Number = float | torch.Tensor


@dataclass(frozen=True)
class Mean:
    """A mean over `count` items whose values add up to `total`."""

    total: Number
    count: Number

    @property
    def value(self) -> float:
        """total / count; 0 when there is nothing to average."""
        count = float(self.count)
        return float(self.total) / count if count else 0.0


@dataclass(frozen=True)
class Total:
    """A quantity whose micro-batch values add up to the mini-batch value."""

    total: Number

    @property
    def value(self) -> float:
        return float(self.total)


Metric = Mean | Total


def masked_mean_metric(x: torch.Tensor, mask: torch.Tensor) -> Mean:
    """The mean of x (detached) over the set entries of `mask`."""
    return Mean(masked_sum(x.detach(), mask), mask_count(mask))


def total_metric(x: torch.Tensor) -> Total:
    """A detached scalar that adds up over micro-batches."""
    return Total(x.detach())


class MetricSums:
    """Adds up the declared metrics of the micro-batches of one mini-batch."""

    def __init__(self) -> None:
        self._sums: dict[str, Metric] = {}

    def add(self, metrics: Mapping[str, Metric], weight: float = 1.0) -> None:
        """Add a micro-batch's metrics; ``weight`` 0 adds their names with nothing in them (a data-parallel
        rank's padding pass, archer/workers/data_parallel.py)."""
        for name, metric in metrics.items():
            if weight != 1.0:
                metric = (Mean(metric.total * weight, metric.count * weight) if isinstance(metric, Mean)
                          else Total(metric.total * weight) if isinstance(metric, Total) else metric)
            kept = self._sums.get(name)
            if not isinstance(metric, Mean | Total) or (kept is not None and type(kept) is not type(metric)):
                raise TypeError(f"metric {name!r} must be declared as archer.algorithms.metric_sums.Mean or Total "
                                f"(the same kind in every micro-batch), got {type(metric).__name__}")
            if kept is None:
                self._sums[name] = metric
            elif isinstance(metric, Mean):
                self._sums[name] = Mean(kept.total + metric.total, kept.count + metric.count)
            else:
                self._sums[name] = Total(kept.total + metric.total)

    def reduce(self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every total and count by its sum over the ranks of a data-parallel update, in one call of
        ``sum_over_ranks`` on a float64 vector (every rank holds the same names: the order is by name)."""
        names = sorted(self._sums)
        values = []
        for name in names:
            metric = self._sums[name]
            values += [float(metric.total), float(metric.count) if isinstance(metric, Mean) else 0.0]
        summed = sum_over_ranks(torch.tensor(values, dtype=torch.float64)).tolist()
        for i, name in enumerate(names):
            total, count = summed[2 * i], summed[2 * i + 1]
            self._sums[name] = Mean(total, count) if isinstance(self._sums[name], Mean) else Total(total)

    def result(self) -> dict[str, float]:
        """Each metric of the mini-batch as a float."""
        return {name: metric.value for name, metric in self._sums.items()}
