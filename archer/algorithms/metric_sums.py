"""Metrics that declare how they reduce over the micro-batches of a mini-batch.

A loss returns each metric as a `Mean` (a sum and the count it is a mean over, e.g. a clipped fraction over the
valid tokens), a `Total` (a quantity that adds up: a token count, or a loss already normalised over the whole
mini-batch), a `Max` / `Min` (an extreme over the items), or `Moments` (sums of x and x^2 over the items, for a
standard deviation or an effective sample size). `MetricSums` adds the micro-batch values and divides each
Mean's sums only at the end, so the metrics of a mini-batch do not depend on how it was split into
micro-batches. A bare number or tensor is refused: a new metric cannot be averaged the wrong way by accident.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace

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


@dataclass(frozen=True)
class Max:
    """The largest of a set of values (-inf for none, reported as 0)."""

    largest: Number

    @property
    def value(self) -> float:
        largest = float(self.largest)
        return largest if largest != float("-inf") else 0.0


@dataclass(frozen=True)
class Min:
    """The smallest of a set of values (inf for none, reported as 0)."""

    smallest: Number

    @property
    def value(self) -> float:
        smallest = float(self.smallest)
        return smallest if smallest != float("inf") else 0.0


MOMENT_STATISTICS = ("std", "sample_std", "ess")


@dataclass(frozen=True)
class Moments:
    """Sums of x (``total``) and x^2 (``total_sq``) over ``count`` items, reported as ``statistic``:

    std         the population standard deviation, sqrt(max(E[x^2] - E[x]^2, 0)); 0 for fewer than 2 items
    sample_std  the Bessel-corrected one, sqrt(max((sum x^2 - (sum x)^2 / n) / (n - 1), 0)); 0 for n < 2
    ess         the effective sample size of weights x as a fraction of n: (E[x] + 1e-8)^2 / E[x^2]
                (1 / E[(x / (E[x] + 1e-8))^2], verl's formula); 0 when every weight is 0
    """

    total: Number
    total_sq: Number
    count: Number
    statistic: str

    def __post_init__(self) -> None:
        if self.statistic not in MOMENT_STATISTICS:
            raise ValueError(f"Moments.statistic must be one of {MOMENT_STATISTICS}, got {self.statistic!r}")

    @property
    def value(self) -> float:
        total, total_sq, count = float(self.total), float(self.total_sq), float(self.count)
        if self.statistic == "ess":
            return (total / count + 1e-8) ** 2 / (total_sq / count) if count and total_sq else 0.0
        if count < 2:
            return 0.0
        if self.statistic == "std":
            return max(total_sq / count - (total / count) ** 2, 0.0) ** 0.5
        return max((total_sq - total * total / count) / (count - 1), 0.0) ** 0.5


Metric = Mean | Total | Max | Min | Moments


def masked_mean_metric(x: torch.Tensor, mask: torch.Tensor) -> Mean:
    """The mean of x (detached) over the set entries of `mask`."""
    return Mean(masked_sum(x.detach(), mask), mask_count(mask))


def total_metric(x: torch.Tensor) -> Total:
    """A detached scalar that adds up over micro-batches."""
    return Total(x.detach())


def masked_max_metric(x: torch.Tensor, mask: torch.Tensor) -> Max:
    """The largest entry of x (detached) where ``mask`` is set."""
    return Max(x.detach().masked_fill(~mask.bool(), float("-inf")).max() if x.numel() else float("-inf"))


def masked_min_metric(x: torch.Tensor, mask: torch.Tensor) -> Min:
    """The smallest entry of x (detached) where ``mask`` is set."""
    return Min(x.detach().masked_fill(~mask.bool(), float("inf")).min() if x.numel() else float("inf"))


def masked_moments_metric(x: torch.Tensor, mask: torch.Tensor, statistic: str) -> Moments:
    """The Moments of x (detached) over the entries where ``mask`` is set, summed in float64: a variance is a
    difference of the two sums, which float32 would leave with few correct digits for values near each other."""
    x = x.detach().double()
    return Moments(masked_sum(x, mask), masked_sum(x * x, mask), mask_count(mask), statistic)


def _weighted(metric: Metric, weight: float) -> Metric:
    """``metric`` counted ``weight`` times (0: a data-parallel rank's padding pass, which adds nothing)."""
    if weight == 1.0:
        return metric
    if isinstance(metric, Mean):
        return Mean(metric.total * weight, metric.count * weight)
    if isinstance(metric, Total):
        return Total(metric.total * weight)
    if isinstance(metric, Moments):
        return Moments(metric.total * weight, metric.total_sq * weight, metric.count * weight, metric.statistic)
    if isinstance(metric, Max | Min) and weight != 0.0:
        raise ValueError(f"an extreme ({type(metric).__name__}) can be counted once or not at all, not {weight} times")
    if isinstance(metric, Max):
        return Max(float("-inf"))
    if isinstance(metric, Min):
        return Min(float("inf"))
    return metric


def _extreme(a: Number, b: Number, *, larger: bool) -> Number:
    """The larger (or smaller) of two values, a tensor's kept on its device (reading it would make the host wait
    for the GPU in the middle of a mini-batch)."""
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        return max(a, b) if larger else min(a, b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.maximum(a, b.to(a.device)) if larger else torch.minimum(a, b.to(a.device))
    tensor, number = (a, b) if isinstance(a, torch.Tensor) else (b, a)
    return tensor.clamp(min=number) if larger else tensor.clamp(max=number)


def _as_floats(values: list[Number]) -> list[float]:
    """``values`` as floats, the tensors among them read back from their devices in one transfer a device."""
    out = [v if not isinstance(v, torch.Tensor) else None for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    for places in by_device.values():
        read = torch.stack([values[i].detach().double().reshape(()) for i in places]).tolist()
        for i, value in zip(places, read, strict=True):
            out[i] = value
    return [float(v) for v in out]


def _combined(kept: Metric, metric: Metric) -> Metric:
    """Two micro-batches' values of one metric as one."""
    if isinstance(metric, Mean):
        return Mean(kept.total + metric.total, kept.count + metric.count)
    if isinstance(metric, Total):
        return Total(kept.total + metric.total)
    if isinstance(metric, Max):
        return Max(_extreme(kept.largest, metric.largest, larger=True))
    if isinstance(metric, Min):
        return Min(_extreme(kept.smallest, metric.smallest, larger=False))
    return Moments(kept.total + metric.total, kept.total_sq + metric.total_sq, kept.count + metric.count,
                   metric.statistic)


class MetricSums:
    """Adds up the declared metrics of the micro-batches of one mini-batch."""

    def __init__(self) -> None:
        self._sums: dict[str, Metric] = {}

    def add(self, metrics: Mapping[str, Metric], weight: float = 1.0) -> None:
        """Add a micro-batch's metrics; ``weight`` 0 adds their names with nothing in them (a data-parallel
        rank's padding pass, archer/workers/data_parallel.py)."""
        for name, metric in metrics.items():
            kept = self._sums.get(name)
            if not isinstance(metric, Metric) or (kept is not None and type(kept) is not type(metric)) or (
                    isinstance(metric, Moments) and kept is not None and kept.statistic != metric.statistic):
                raise TypeError(f"metric {name!r} must be declared as archer.algorithms.metric_sums.Mean, Total, Max, Min "
                                f"or Moments (the same kind in every micro-batch), got {type(metric).__name__}")
            metric = _weighted(metric, weight)
            self._sums[name] = metric if kept is None else _combined(kept, metric)

    def reduce(self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor],
               max_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Replace every metric by its value over the ranks of a data-parallel update: totals and counts summed in
        one call of ``sum_over_ranks`` on a float64 vector, extremes in one call of ``max_over_ranks`` (a Min as
        the maximum of its negation); every rank holds the same names, so the order is by name."""
        self._read_back()
        names = sorted(self._sums)
        sums, extremes = [], []
        for name in names:
            metric = self._sums[name]
            if isinstance(metric, Max | Min):
                extremes.append(float(metric.largest) if isinstance(metric, Max) else -float(metric.smallest))
            else:
                sums += [float(metric.total), float(metric.total_sq) if isinstance(metric, Moments) else 0.0,
                         float(metric.count) if isinstance(metric, Mean | Moments) else 0.0]
        if extremes and max_over_ranks is None:
            raise ValueError("metrics declared as Max or Min need max_over_ranks to be reduced over ranks")
        summed = sum_over_ranks(torch.tensor(sums, dtype=torch.float64)).tolist() if sums else []
        maxima = max_over_ranks(torch.tensor(extremes, dtype=torch.float64)).tolist() if extremes else []
        for name in names:
            metric = self._sums[name]
            if isinstance(metric, Max):
                self._sums[name] = Max(maxima.pop(0))
            elif isinstance(metric, Min):
                self._sums[name] = Min(-maxima.pop(0))
            else:
                total, total_sq, count = summed[:3]
                del summed[:3]
                self._sums[name] = (Mean(total, count) if isinstance(metric, Mean) else Total(total)
                                    if isinstance(metric, Total) else Moments(total, total_sq, count, metric.statistic))

    def result(self) -> dict[str, float]:
        """Each metric of the mini-batch as a float."""
        self._read_back()
        return {name: metric.value for name, metric in self._sums.items()}

    def _read_back(self) -> None:
        """Every metric's sums as floats, the tensors among them read in one transfer a device."""
        places = [(name, f.name) for name, metric in self._sums.items() for f in fields(metric)
                  if f.name != "statistic"]
        values = _as_floats([getattr(self._sums[name], attribute) for name, attribute in places])
        for (name, attribute), value in zip(places, values, strict=True):
            self._sums[name] = replace(self._sums[name], **{attribute: value})
