"""Declared metrics: a Mean adds sums and counts and divides at the end, a Total adds up, anything else is refused."""

import pytest
import torch

from archer.algorithms.metric_sums import Mean, MetricSums, Total, masked_mean_metric

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


@pytest.mark.parametrize("second", [torch.tensor(1.0), 1.0, Total(1.0)])
def test_an_undeclared_metric_or_a_change_of_kind_is_refused(second):
    sums = MetricSums()
    sums.add({"m": Mean(1.0, 2.0)})
    with pytest.raises(TypeError, match="'m' must be declared as"):
        sums.add({"m": second})
