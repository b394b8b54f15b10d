"""The update's epoch / mini-batch loop: the rows each mini-batch holds, by hand, and the step averages."""

from __future__ import annotations

import pytest
import torch

from archer.batch import Batch
from archer.workers.mini_batches import StepAverages, mini_batches


def rows_of(batches) -> list[tuple[int, list[int]]]:
    return [(epoch, mb["row"].tolist()) for epoch, mb in batches]


def test_in_order_without_shuffle_and_the_last_mini_batch_holds_the_rest() -> None:
    data = Batch({"row": torch.arange(5)})
    assert rows_of(mini_batches(data, 2, epochs=2, shuffle=False, seed=3)) == [
        (0, [0, 1]), (0, [2, 3]), (0, [4]), (1, [0, 1]), (1, [2, 3]), (1, [4])]


def test_shuffled_epochs_draw_one_permutation_each_from_the_seed() -> None:
    data = Batch({"row": torch.arange(6)})
    generator = torch.Generator().manual_seed(7)
    first, second = (torch.randperm(6, generator=generator).tolist() for _ in range(2))
    assert rows_of(mini_batches(data, 3, epochs=2, shuffle=True, seed=7)) == [
        (0, first[:3]), (0, first[3:]), (1, second[:3]), (1, second[3:])]
    assert first != second  # each epoch its own order
    other_seed = rows_of(mini_batches(data, 3, epochs=2, shuffle=True, seed=8))
    assert other_seed != rows_of(mini_batches(data, 3, epochs=2, shuffle=True, seed=7))


def test_step_averages_count_each_metric_over_the_steps_that_report_it() -> None:
    averages = StepAverages()
    averages.add({"a": 1.0, "b": 4.0})
    averages.add({"a": 2.0})
    averages.add({"a": 6.0, "b": 0.0})
    assert averages.result() == pytest.approx({"a": 3.0, "b": 2.0})
