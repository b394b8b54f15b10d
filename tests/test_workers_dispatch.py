"""A worker method's dispatch declaration (archer/workers/dispatch.py): the split of its rows over the ranks as
well as the collection of their results, and the generated rank-side delegation, checked by hand on 10 rows over
3 ranks (``rank_share``: 4, 3 and 3 rows, as ``numpy.array_split``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archer.batch import Batch
from archer.controller.worker_group import LocalWorkerGroup
from archer.models.micro_batches import MicroBatching
from archer.workers.async_rollout import BATCH_ROWS, SAMPLE_INDEX, admitted_share, rank_quota
from archer.workers.data_parallel import PassShare, balanced_shards, own_passes, rank_passes
from archer.workers.dispatch import (
    FIRST_ROW,
    STAND_IN,
    Seat,
    collect,
    collector_of,
    concat_batches,
    delegate,
    own_rows,
    own_rows_or_stand_in,
    rank_share,
    rank_zero,
    split_of,
    whole,
)


class Scorer:
    """A role worker: its method declares its split, made from its ``ctx`` on every call."""

    def __init__(self, rank: int, world: int) -> None:
        self.ctx = Seat(rank, world)
        self.micro = MicroBatching(3, None, packed=False)

    @collect(concat_batches, split=own_rows)
    def score(self, batch: Batch, scale: float = 1.0) -> Batch:
        return Batch({"s": batch["x"] * scale}, info={"first": batch.info.get(FIRST_ROW, 0)})

    @collect(concat_batches, split=own_passes("micro"))
    def passes(self, share: PassShare) -> Batch:
        return Batch({"s": share.own(share.batch["x"] * 10)})

    def undeclared(self, batch: Batch) -> int:
        return len(batch)


class Rank:
    """The rank's side: one-line delegations generated from the role's declarations."""

    score = delegate("scorer", Scorer.score)
    first_score = delegate("scorer", Scorer.score, rank_zero)

    def __init__(self, rank: int, world: int) -> None:
        self.ctx = Seat(rank, world)
        self.scorer = Scorer(rank, world)


def ten_rows() -> Batch:
    return Batch({"x": torch.arange(10.0), "attention_mask": torch.ones(10, 2, dtype=torch.long)}, info={"seed": 7})


def test_rank_share_deals_ten_rows_over_three_ranks_as_array_split() -> None:
    assert [rank_share(10, rank, 3) for rank in range(3)] == [slice(0, 4), slice(4, 7), slice(7, 10)]
    assert [rank_share(2, rank, 3) for rank in range(3)] == [slice(0, 1), slice(1, 2), slice(2, 2)]
    assert [rank_quota(10, rank, 3, rotation=1) for rank in range(3)] == [3, 4, 3]  # the extra group to rank 1


def test_whole_hands_every_rank_the_argument_as_it_came() -> None:
    batch = ten_rows()
    assert whole(batch, Scorer(2, 3)) is batch
    assert split_of(Scorer, "undeclared") is whole and split_of(Rank, "score") is whole


def test_own_rows_gives_each_rank_its_contiguous_rows_and_the_collector_puts_them_back_in_order() -> None:
    batch = ten_rows()
    parts = [Scorer(rank, 3).score(batch, scale=2.0) for rank in range(3)]
    assert [p["s"].tolist() for p in parts] == [[0.0, 2.0, 4.0, 6.0], [8.0, 10.0, 12.0], [14.0, 16.0, 18.0]]
    assert [p.info["first"] for p in parts] == [0, 4, 7]
    assert collector_of(Scorer, "score")(parts)["s"].tolist() == [2.0 * i for i in range(10)]
    assert FIRST_ROW not in batch.info  # the rank's rows carry their own info
    assert own_rows(batch, Scorer(0, 1)) is batch  # world 1: the batch as it came


def test_own_rows_or_stand_in_hands_a_rank_without_rows_row_zero_marked() -> None:
    batch = ten_rows().index(slice(0, 2))
    shares = [own_rows_or_stand_in(batch, Scorer(rank, 3)) for rank in range(3)]
    assert [s["x"].tolist() for s in shares] == [[0.0], [1.0], [0.0]]
    assert [s.info.get(STAND_IN, False) for s in shares] == [False, False, True]
    assert [s.info[FIRST_ROW] for s in shares] == [0, 1, 2]
    assert own_rows_or_stand_in(batch, Scorer(0, 1)) is batch


def test_own_passes_hand_the_whole_batch_with_the_ranks_micro_batches_padded_to_the_most() -> None:
    batch = ten_rows()
    shares = [own_passes("micro")(batch, Scorer(rank, 3)) for rank in range(3)]
    assert all(share.batch is batch for share in shares)
    # 3 rows a micro-batch: rank 0's 4 rows take 2 passes; ranks 1 and 2 repeat their one pass
    assert [[p.tolist() for p in s.passes.parts] for s in shares] == [
        [[0, 1, 2], [3]], [[4, 5, 6], [4, 5, 6]], [[7, 8, 9], [7, 8, 9]]]
    assert [s.passes.own for s in shares] == [2, 1, 1]
    parts = [Scorer(rank, 3).passes(batch) for rank in range(3)]
    assert [p["s"].tolist() for p in parts] == [[0.0, 10.0, 20.0, 30.0], [40.0, 50.0, 60.0], [70.0, 80.0, 90.0]]


def test_balanced_rows_are_dealt_longest_first_to_the_rank_with_fewest_tokens() -> None:
    lengths = torch.tensor([5, 1, 9, 3, 7, 2, 8, 4, 6, 10])
    # room 4, 3, 3 (rank_share); 10->r0, 9->r1, 8->r2, 7->r2, 6->r1, 5->r0, 4->r0 (tie), 3->r1, 2->r2, 1->r0
    assert [s.tolist() for s in balanced_shards(lengths, 3)] == [[0, 1, 7, 9], [2, 3, 8], [4, 5, 6]]
    mask = (torch.arange(10)[None, :] < lengths[:, None]).long()
    rows = [rank_passes(mask, MicroBatching(None, None, packed=False), Seat(r, 3), balance=True).rows for r in range(3)]
    assert [int(lengths[r].sum()) for r in rows] == [20, 18, 17]


def test_admitted_share_takes_each_ranks_rows_by_their_index_in_the_whole_loader_batch() -> None:
    # a batch of 10 admitted again in part after a resume (rows 0-2 already trained), and one of rank 0's rows only
    again = Batch({}, {SAMPLE_INDEX: np.arange(3, 10), "uid": [f"a{i}" for i in range(3, 10)]}, {BATCH_ROWS: 10})
    small = Batch({}, {SAMPLE_INDEX: np.array([0, 1]), "uid": ["b0", "b1"]}, {BATCH_ROWS: 10})
    shares = [admitted_share([again, small], Scorer(rank, 3)) for rank in range(3)]
    assert [[list(b["uid"]) for b in s] for s in shares] == [
        [["a3"], ["b0", "b1"]], [["a4", "a5", "a6"]], [["a7", "a8", "a9"]]]


def test_delegate_hands_the_call_to_the_role_with_its_declaration() -> None:
    batch = ten_rows()
    parts = [Rank(rank, 3).score(batch, scale=1.0) for rank in range(3)]
    assert collector_of(Rank, "score")(parts)["s"].tolist() == list(map(float, range(10)))
    assert collector_of(Rank, "score") is concat_batches and collector_of(Rank, "first_score") is rank_zero
    assert Rank.score.__name__ == "score" and "scorer.score" in Rank.score.__doc__


def test_a_method_without_a_declaration_is_refused() -> None:
    with pytest.raises(TypeError, match="Scorer.undeclared declares no collector"):
        collector_of(Scorer, "undeclared")
    with pytest.raises(TypeError, match="declares no collector and none was given"):
        delegate("scorer", Scorer.undeclared)
    with pytest.raises(TypeError, match="declares no collector"):
        LocalWorkerGroup(Scorer(0, 1)).call("undeclared", ten_rows())
    assert LocalWorkerGroup(Scorer(0, 1)).call("score", ten_rows())["s"].tolist() == list(map(float, range(10)))


def test_a_split_that_is_not_a_function_is_refused() -> None:
    with pytest.raises(TypeError, match="split"):
        collect(rank_zero, split="rows")  # type: ignore[arg-type]
