"""The PPO update's loop over epochs and mini-batches, shared by the actor and the critic: each epoch visits
the batch's rows in a seeded random order (``shuffle``) or in order, cut into mini-batches of ``mini_size``
rows, one optimiser step each; and the average of each metric over those steps.

``ppo_epochs`` is that loop whole: for each mini-batch the rank's micro-batch passes (workers/data_parallel.py),
each pass's loss backward at weight 1 (a padding pass, which only keeps FSDP's collectives in step, at weight 0),
the passes' metric sums reduced over the ranks, then the optimiser step. What differs between the actor and the
critic (which passes, the normalisers, the loss, the step and its metrics) is an ``UpdateObjective``.

Every caller draws the same permutation from the same seed, so a data-parallel rank can take its slice of each
whole mini-batch (and normalise by the whole mini-batch) and the ranks together make the single-process update.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from typing import Any, Protocol

import torch

from archer.algorithms.metric_sums import MetricSums
from archer.batch import Batch
from archer.distributed.context import DistContext
from archer.workers.data_parallel import RankPasses, reduce_metric_sums


def mini_batches(data: Batch, mini_size: int, *, epochs: int, shuffle: bool, seed: int) -> Iterator[tuple[int, Batch]]:
    """(epoch, mini-batch) pairs: ``epochs`` passes over ``data``, each in the order a generator seeded with
    ``seed`` draws (one permutation per epoch) or, without ``shuffle``, in row order; the last mini-batch of an
    epoch holds the rows left over."""
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(len(data), generator=generator) if shuffle else torch.arange(len(data))
        for mini_batch in data.index(order).split(mini_size):
            yield epoch, mini_batch


class StepAverages:
    """The mean of each metric over the optimiser steps that reported it."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.sums[name] += value
            self.counts[name] += 1

    def result(self) -> dict[str, float]:
        return {name: self.sums[name] / self.counts[name] for name in self.sums}


class UpdateObjective(Protocol):
    """One worker's side of ``ppo_epochs``."""

    def plan(self, epoch: int, mini_batch: Batch) -> tuple[RankPasses, Any]:
        """The rank's passes over ``mini_batch`` and the mini-batch's normalisers (handed to each ``loss``)."""

    def loss(self, rows: Batch, normalisers: Any, *, epoch: int, weight: float, scope: ExitStack
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """A pass's loss over ``rows`` and its metric sums; what it enters on ``scope`` spans the backward."""

    def step(self, sums: dict[str, float]) -> dict[str, float]:
        """The optimiser step after a mini-batch's passes whose reduced metric sums are ``sums``; the step's
        metrics."""


def ppo_epochs(data: Batch, mini_size: int, objective: UpdateObjective, ctx: DistContext, *, epochs: int,
               shuffle: bool, seed: int) -> dict[str, float]:
    """The update: ``mini_batches``' mini-batches, each one optimiser step of ``objective`` over the passes of
    this rank (``ctx``); the average of each step's metrics."""
    averages = StepAverages()
    for epoch, mini_batch in mini_batches(data, mini_size, epochs=epochs, shuffle=shuffle, seed=seed):
        passes, normalisers = objective.plan(epoch, mini_batch)
        sums = MetricSums()
        for index, rows in enumerate(passes.parts):
            weight = 0.0 if passes.padding(index) else 1.0
            with ExitStack() as scope:
                loss, metrics = objective.loss(mini_batch.index(rows), normalisers, epoch=epoch, weight=weight,
                                               scope=scope)
                (loss * weight).backward()
            sums.add(metrics, weight)
        reduce_metric_sums(sums, ctx)
        averages.add(objective.step(sums.result()))
    return averages.result()
