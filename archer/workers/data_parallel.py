"""Data parallelism inside a worker: which micro-batches a rank runs, and metrics summed over ranks.

Every rank receives the whole batch (docs/architecture.md) and takes its contiguous rows (``shard_bounds``).
A sharded model (FSDP2) gathers each layer's weights in every forward and reduces its gradients in every
backward, so every rank must run the same number of passes: ``rank_passes`` splits each rank's rows into
micro-batches (computing the split of every rank, which each can do from the whole batch) and pads a rank that
has fewer with passes over rows it already ran. A padding pass changes nothing: its log-probs overwrite the same
values, and its loss and metrics are weighted by zero.

``reduce_metric_sums`` adds the declared metric sums (archer/algorithms/metric_sums.py) of every rank, so that a
metric of the whole mini-batch is the single-process one whatever the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archer.algorithms.metric_sums import MetricSums
from archer.distributed.context import DistContext, shard_bounds
from archer.models.micro_batches import MicroBatching


@dataclass(frozen=True)
class RankPasses:
    """The micro-batches a rank runs over a batch: row indices into the whole batch, its own first
    (``own`` of them), then padding passes; ``rows``: the rank's slice [start, stop) of the batch;
    ``every_rank``: the micro-batches of all ranks together (padding excluded), e.g. for normalisers that count
    per micro-batch."""

    parts: list[torch.Tensor]
    own: int
    rows: slice
    every_rank: list[torch.Tensor]

    def padding(self, index: int) -> bool:
        """Whether pass ``index`` only keeps the ranks' pass counts equal."""
        return index >= self.own


def rank_passes(attention_mask: torch.Tensor, micro: MicroBatching, ctx: DistContext) -> RankPasses:
    """The passes ``ctx.rank`` runs over the rows of ``attention_mask`` (the whole batch) split by ``micro``.
    At world 1: ``micro.split`` as it is. A rank without rows repeats row 0 of the batch."""
    n = int(attention_mask.shape[0])
    counts, every_rank, own_parts, own_rows = [], [], [], slice(0, 0)
    for rank in range(ctx.world_size):
        start, stop = shard_bounds(n, rank, ctx.world_size)
        parts = [rows + start for rows in micro.split(attention_mask[start:stop])] if stop > start else []
        counts.append(len(parts))
        every_rank += parts
        if rank == ctx.rank:
            own_parts, own_rows = parts, slice(start, stop)
    filler = own_parts[-1] if own_parts else torch.zeros(1, dtype=torch.long)
    padding = [filler] * (max(counts) - len(own_parts)) if n else []
    return RankPasses(parts=own_parts + padding, own=len(own_parts), rows=own_rows, every_rank=every_rank)


def reduce_metric_sums(sums: MetricSums, ctx: DistContext) -> None:
    """Sum every rank's metric sums (and take the extremes over the ranks) in place; each rank must hold the same
    metric names."""
    if ctx.distributed:
        sums.reduce(ctx.all_reduce_sum, ctx.all_reduce_max)
