"""The update's epoch / mini-batch loop: the rows each mini-batch holds, by hand, and the step averages; the
shared PPO loop (``ppo_epochs``): its passes, the padding pass's zero weight, the gradient each step sees."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import pytest
import torch

from archer.algorithms.metric_sums import Total
from archer.batch import Batch
from archer.distributed.context import DistContext
from archer.workers.data_parallel import RankPasses
from archer.workers.mini_batches import StepAverages, mini_batches, ppo_epochs


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


class SumObjective:
    """loss = w * sum of the pass's rows' x; passes: each row its own, then one padding pass repeating the last
    row; the step records w's gradient and zeroes it."""

    def __init__(self) -> None:
        self.w = torch.zeros((), requires_grad=True)
        self.events: list[str] = []
        self.grads: list[float] = []

    def plan(self, epoch: int, mini_batch: Batch) -> tuple[RankPasses, float]:
        parts = [torch.tensor([i]) for i in range(len(mini_batch))]
        return RankPasses(parts=[*parts, parts[-1]], own=len(parts), rows=slice(0, len(parts)), every_rank=parts), 10.0

    def loss(self, rows: Batch, normalisers: float, *, epoch: int, weight: float, scope: ExitStack):
        @contextmanager
        def traced():
            self.events.append(f"enter {epoch} {weight}")
            yield
            self.events.append("exit")  # after the backward: the gradient is there already
            assert self.w.grad is not None

        scope.enter_context(traced())
        total = rows["x"].sum()
        return self.w * total / normalisers, {"x": Total(total)}

    def step(self, sums: dict[str, float]) -> dict[str, float]:
        self.grads.append(float(self.w.grad))
        self.w.grad = None
        return {"x": sums["x"], "g": self.grads[-1]}


def test_ppo_epochs_backs_each_pass_weighted_and_the_padding_pass_adds_nothing() -> None:
    data = Batch({"x": torch.tensor([1.0, 2.0, 4.0])})
    objective = SumObjective()
    metrics = ppo_epochs(data, 2, objective, DistContext.single(torch.device("cpu")), epochs=2, shuffle=False, seed=0)
    # mini-batches [1, 2], [4] twice: grads (1 + 2) / 10 and 4 / 10; the padding pass repeats 2 and 4 at weight 0
    assert objective.grads == pytest.approx([0.3, 0.4, 0.3, 0.4])
    assert metrics == pytest.approx({"x": (3.0 + 4.0) / 2, "g": 0.35})
    assert objective.events == ["enter 0 1.0", "exit", "enter 0 1.0", "exit", "enter 0 0.0", "exit",
                                "enter 0 1.0", "exit", "enter 0 0.0", "exit"] + [
                                "enter 1 1.0", "exit", "enter 1 1.0", "exit", "enter 1 0.0", "exit",
                                "enter 1 1.0", "exit", "enter 1 0.0", "exit"]
