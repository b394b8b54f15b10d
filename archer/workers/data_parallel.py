"""Data parallelism inside a worker: which micro-batches a rank runs, and metrics summed over ranks.

Every rank receives the whole batch (docs/architecture.md) and takes its contiguous rows (``rank_share``,
workers/dispatch.py). A sharded model (FSDP2) gathers each layer's weights in every forward and reduces its gradients in every
backward, so every rank must run the same number of passes: ``rank_passes`` splits each rank's rows into
micro-batches (computing the split of every rank, which each can do from the whole batch) and pads a rank that
has fewer with passes over rows it already ran. A padding pass changes nothing: its log-probs overwrite the same
values, and its loss and metrics are weighted by zero. The no-grad passes declare the split ``own_passes``
(workers/dispatch.py): their method is handed the whole batch with the rank's passes over it (``PassShare``); an
update cuts each mini-batch with ``rank_passes``.

With ``balance`` (verl's ``trainer.balance_batch``, on by default, for the update passes of the actor and the
critic) a rank takes instead a balanced shard of rows (``balanced_shards``): the same number of rows as
``rank_share`` gives it, chosen so that the ranks' real tokens come out as even as a greedy pass can make
them, longest row first, so that no rank waits for one that drew the long responses. The rows of each
mini-batch stay the ones a single process trains on (verl reorders the whole batch before it splits
mini-batches; archer keeps a run on N ranks the run of one process), so only the float summation order moves,
except where a loss makes choices per micro-batch: the actor then keeps contiguous rows (workers/actor.py).
The no-grad passes keep contiguous rows (the driver concatenates their results in rank order). On several ranks
the actor's update reports both splits' token totals under verl's ``global_seqlen/*`` names (``RankTokens``).

``reduce_metric_sums`` adds the declared metric sums (archer/algorithms/metric_sums.py) of every rank, so that a
metric of the whole mini-batch is the single-process one whatever the number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from archer.algorithms.metric_sums import MetricSums
from archer.batch import Batch
from archer.distributed.context import DistContext
from archer.models.micro_batches import MicroBatching
from archer.workers.dispatch import rank_share


@dataclass(frozen=True)
class RankPasses:
    """The micro-batches a rank runs over a batch: row indices into the whole batch, its own first
    (``own`` of them), then padding passes; ``rows``: the rank's slice [start, stop) of the batch, or with
    balanced shards its row indices; ``every_rank``: the micro-batches of all ranks together (padding excluded),
    e.g. for normalisers that count per micro-batch."""

    parts: list[torch.Tensor]
    own: int
    rows: slice | torch.Tensor  # a balanced shard's row indices
    every_rank: list[torch.Tensor]

    def padding(self, index: int) -> bool:
        """Whether pass ``index`` only keeps the ranks' pass counts equal."""
        return index >= self.own


def balanced_shards(lengths: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Row indices (ascending) of each rank's shard of rows of ``lengths`` tokens: as many rows as
    ``rank_share`` gives the rank, the rows dealt longest first, each to the rank with the fewest tokens so far
    among those with room (ties to the lowest rank)."""
    room = [share.stop - share.start for share in (rank_share(len(lengths), rank, world) for rank in range(world))]
    tokens = [0] * world
    shards: list[list[int]] = [[] for _ in range(world)]
    sizes = lengths.tolist()
    for row in torch.argsort(lengths, descending=True, stable=True).tolist():
        rank = min((r for r in range(world) if room[r]), key=lambda r: (tokens[r], r))
        shards[rank].append(row)
        tokens[rank] += sizes[row]
        room[rank] -= 1
    return [torch.tensor(sorted(shard), dtype=torch.long) for shard in shards]


def rank_token_totals(attention_mask: torch.Tensor, world: int, *, balance: bool) -> list[int]:
    """Each rank's real tokens among the rows of ``attention_mask``: its contiguous rows, or (``balance``) its
    balanced shard, as ``rank_passes`` hands them out."""
    lengths = attention_mask.sum(dim=1).cpu()
    if balance:
        return [int(lengths[shard].sum()) for shard in balanced_shards(lengths, world)]
    return [int(lengths[rank_share(len(lengths), rank, world)].sum()) for rank in range(world)]


class RankTokens:
    """The ranks' real tokens over an update's mini-batches, as verl's ``global_seqlen/*`` metrics report them:
    min, max, minmax_diff and mean of the contiguous split, balanced_min and balanced_max of the balanced one."""

    def __init__(self, world: int) -> None:
        self.contiguous = [0] * world
        self.balanced = [0] * world

    def add(self, attention_mask: torch.Tensor) -> None:
        for totals, balance in ((self.contiguous, False), (self.balanced, True)):
            for rank, tokens in enumerate(rank_token_totals(attention_mask, len(totals), balance=balance)):
                totals[rank] += tokens

    def metrics(self) -> dict[str, float]:
        contiguous, balanced = self.contiguous, self.balanced
        return {"global_seqlen/min": float(min(contiguous)), "global_seqlen/max": float(max(contiguous)),
                "global_seqlen/minmax_diff": float(max(contiguous) - min(contiguous)),
                "global_seqlen/balanced_min": float(min(balanced)), "global_seqlen/balanced_max": float(max(balanced)),
                "global_seqlen/mean": sum(contiguous) / len(contiguous)}


def rank_passes(attention_mask: torch.Tensor, micro: MicroBatching, ctx: DistContext, *, balance: bool = False
                ) -> RankPasses:
    """The passes ``ctx.rank`` runs over the rows of ``attention_mask`` (the whole batch) split by ``micro``:
    over its contiguous rows, or with ``balance`` over its balanced shard (``balanced_shards``). At world 1:
    ``micro.split`` as it is. A rank without rows repeats row 0 of the batch."""
    n, world = int(attention_mask.shape[0]), ctx.world_size
    balanced = balanced_shards(attention_mask.sum(dim=1).cpu(), world) if balance and world > 1 else None
    counts, every_rank, own_parts, own_rows = [], [], [], slice(0, 0)
    for rank in range(world):
        if balanced is None:
            shard: slice | torch.Tensor = rank_share(n, rank, world)
            index = torch.arange(shard.start, shard.stop)
        else:
            shard = index = balanced[rank]
        parts = [index[rows] for rows in micro.split(attention_mask[shard])] if len(index) else []
        counts.append(len(parts))
        every_rank += parts
        if rank == ctx.rank:
            own_parts, own_rows = parts, shard
    filler = own_parts[-1] if own_parts else torch.zeros(1, dtype=torch.long)
    padding = [filler] * (max(counts) - len(own_parts)) if n else []
    return RankPasses(parts=own_parts + padding, own=len(own_parts), rows=own_rows, every_rank=every_rank)


@dataclass(frozen=True)
class PassShare:
    """What a no-grad pass declared with ``own_passes`` works on: the whole ``batch`` and the rank's ``passes``
    over it (``rows``: the rows whose results the rank hands back)."""

    batch: Batch
    passes: RankPasses

    def own(self, values: torch.Tensor) -> torch.Tensor:
        """The rank's rows of ``values``, a tensor over the whole batch's rows."""
        return values[self.passes.rows]


def own_passes(micro: str) -> Callable[[Batch, Any], PassShare]:
    """``split`` of a sharded model's no-grad pass (workers/dispatch.py): the whole batch with the rank's passes
    over its contiguous rows (``rank_passes``), split by the worker's ``MicroBatching`` attribute ``micro``."""
    def split(batch: Batch, worker: Any) -> PassShare:
        return PassShare(batch, rank_passes(batch["attention_mask"], getattr(worker, micro), worker.ctx))

    split.__name__ = split.__qualname__ = f"own_passes({micro!r})"
    return split


def reduce_metric_sums(sums: MetricSums, ctx: DistContext) -> None:
    """Sum every rank's metric sums (and take the extremes over the ranks) in place; each rank must hold the same
    metric names."""
    if ctx.distributed:
        sums.reduce(ctx.all_reduce_sum, ctx.all_reduce_max)
