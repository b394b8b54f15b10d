"""A worker method's dispatch declaration (archer/workers/dispatch.py): the split of its rows over the ranks as
well as the collection of their results, and the generated rank-side delegation, by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from archer.batch import Batch
from archer.workers.dispatch import (
    collect,
    collector_of,
    concat_batches,
    delegate,
    own_rows,
    rank_zero,
    split_of,
    whole,
)


class Scorer:
    def score(self, batch: Batch, scale: float = 1.0) -> Batch:
        return Batch({"s": batch["x"] * scale})


class Rank:
    score = delegate("scorer", "score", concat_batches, split=own_rows)
    score_all = delegate("scorer", "score", rank_zero)

    @collect(rank_zero)
    def hand_written(self) -> int:
        return 1

    def __init__(self, rank: int, world: int) -> None:
        self.ctx = SimpleNamespace(rank=rank, world_size=world)
        self.scorer = Scorer()


def test_own_rows_gives_each_rank_its_contiguous_rows_and_the_collector_puts_them_back_in_order() -> None:
    batch = Batch({"x": torch.arange(5.0)})
    parts = [Rank(rank, 2).score(batch, scale=2.0) for rank in range(2)]
    assert [p["s"].tolist() for p in parts] == [[0.0, 2.0, 4.0], [6.0, 8.0]]  # shard_bounds: 3 rows, then 2
    assert collector_of(Rank, "score")(parts)["s"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_whole_hands_every_rank_the_whole_batch_and_is_the_default() -> None:
    batch = Batch({"x": torch.arange(3.0)})
    assert Rank(1, 2).score_all(batch)["s"].tolist() == [0.0, 1.0, 2.0]
    assert split_of(Rank, "score") is own_rows and split_of(Rank, "score_all") is whole
    assert split_of(Rank, "hand_written") is whole and collector_of(Rank, "score_all") is rank_zero
    assert Rank.score.__name__ == "score" and "scorer.score" in Rank.score.__doc__


def test_a_split_that_is_not_a_function_is_refused() -> None:
    with pytest.raises(TypeError, match="split"):
        collect(rank_zero, split="rows")  # type: ignore[arg-type]
