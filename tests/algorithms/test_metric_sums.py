"""Declared metrics: a Mean adds sums and counts and divides at the end, a Total adds up, Max / Min keep the
extreme, Moments add x and x^2 for a std or an effective sample size; over ranks too; anything else is refused."""

import math

import pytest
import torch

from archer.algorithms.metric_sums import (
    Max,
    Mean,
    MetricSums,
    Min,
    Moments,
    Total,
    masked_max_metric,
    masked_mean_metric,
    masked_min_metric,
    masked_moments_metric,
)

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])  # 6 valid tokens: mean (1+2+3+4+7+8) / 6 = 25 / 6


def test_a_mean_of_unequal_micro_batches_is_the_mean_of_the_whole():
    sums = MetricSums()
    for rows in (slice(0, 2), slice(2, 3)):  # 4 and 2 tokens, means 2.5 and 7.5 (averaged: 5, not 25 / 6)
        sums.add({"m": masked_mean_metric(VALUES[rows], MASK[rows]), "t": Total(MASK[rows].sum())})
    assert sums.result() == pytest.approx({"m": 25 / 6, "t": 6.0})
    assert masked_mean_metric(VALUES, MASK).value == pytest.approx(25 / 6)


def test_a_mean_over_no_items_is_zero():
    sums = MetricSums()
    sums.add({"m": masked_mean_metric(VALUES, torch.zeros_like(MASK))})
    assert sums.result() == {"m": 0.0}


def test_a_masked_mean_metric_is_detached():
    x = VALUES.clone().requires_grad_(True)
    assert not masked_mean_metric(x * 2, MASK).total.requires_grad


@pytest.mark.parametrize("second", [torch.tensor(1.0), 1.0, Total(1.0), Max(1.0), Moments(1.0, 1.0, 1.0, "ess")])
def test_an_undeclared_metric_or_a_change_of_kind_is_refused(second):
    sums = MetricSums()
    sums.add({"m": Mean(1.0, 2.0)})
    with pytest.raises(TypeError, match="'m' must be declared as"):
        sums.add({"m": second})


VALID = (1, 2, 3, 4, 7, 8)  # the values MASK keeps


def extremes_and_moments(rows: slice) -> dict:
    return {"max": masked_max_metric(VALUES[rows], MASK[rows]), "min": masked_min_metric(VALUES[rows], MASK[rows]),
            **{s: masked_moments_metric(VALUES[rows], MASK[rows], s) for s in ("std", "sample_std", "ess")}}


def test_extremes_and_moments_of_micro_batches_are_those_of_the_whole():
    sums = MetricSums()
    for rows in (slice(0, 2), slice(2, 3)):
        sums.add(extremes_and_moments(rows))
    mean = sum(VALID) / 6
    mean_sq = sum(v * v for v in VALID) / 6
    assert sums.result() == pytest.approx({
        "max": 8.0, "min": 1.0, "std": math.sqrt(mean_sq - mean ** 2),
        "sample_std": math.sqrt(sum((v - mean) ** 2 for v in VALID) / 5), "ess": (mean + 1e-8) ** 2 / mean_sq})


def test_a_padding_pass_adds_nothing_to_extremes_and_moments():
    sums = MetricSums()
    sums.add(extremes_and_moments(slice(1, 2)))  # the single value 4
    sums.add({"max": Max(100.0), "min": Min(-100.0), "std": Moments(9.0, 81.0, 1.0, "std"),
              "sample_std": Moments(9.0, 81.0, 1.0, "sample_std"), "ess": Moments(9.0, 81.0, 1.0, "ess")}, weight=0.0)
    assert sums.result() == pytest.approx({"max": 4.0, "min": 4.0, "std": 0.0, "sample_std": 0.0,
                                           "ess": (4 + 1e-8) ** 2 / 16})


def test_empty_extremes_and_moments_report_zero():
    empty = torch.zeros_like(MASK)
    assert masked_max_metric(VALUES, empty).value == 0.0 and masked_min_metric(VALUES, empty).value == 0.0
    assert all(masked_moments_metric(VALUES, empty, s).value == 0.0 for s in ("std", "sample_std", "ess"))
    assert masked_moments_metric(torch.zeros(3), torch.ones(3), "ess").value == 0.0, "all weights 0"


def test_reduce_over_ranks_sums_totals_and_takes_the_extremes():
    """Two ranks hold rows 0-1 and row 2; each reduces with what all_reduce SUM / MAX over both vectors gives."""
    def metrics(rows: slice) -> dict:
        return {"mean": masked_mean_metric(VALUES[rows], MASK[rows]), **extremes_and_moments(rows)}

    ranks = [MetricSums(), MetricSums()]
    vectors: dict[str, list[torch.Tensor]] = {"sum": [], "max": []}
    for sums, rows in zip(ranks, (slice(0, 2), slice(2, 3)), strict=True):
        sums.add(metrics(rows))
        sums.reduce(lambda t: vectors["sum"].append(t.clone()) or t, lambda t: vectors["max"].append(t.clone()) or t)
    summed, maxed = vectors["sum"][0] + vectors["sum"][1], torch.maximum(*vectors["max"])
    whole = MetricSums()
    whole.add(metrics(slice(0, 3)))
    for rows in (slice(0, 2), slice(2, 3)):
        rank = MetricSums()
        rank.add(metrics(rows))
        rank.reduce(lambda t: summed, lambda t: maxed)
        assert rank.result() == pytest.approx(whole.result())


def test_extremes_need_a_max_reduction():
    sums = MetricSums()
    sums.add({"max": Max(1.0)})
    with pytest.raises(ValueError, match="need max_over_ranks"):
        sums.reduce(lambda t: t)
