"""The PPO update's loop over epochs and mini-batches, shared by the actor and the critic: each epoch visits
the batch's rows in a seeded random order (``shuffle``) or in order, cut into mini-batches of ``mini_size``
rows, one optimiser step each; and the average of each metric over those steps.

Every caller draws the same permutation from the same seed, so a data-parallel rank can take its slice of each
whole mini-batch (and normalise by the whole mini-batch) and the ranks together make the single-process update.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping

import torch

from archer.batch import Batch


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
