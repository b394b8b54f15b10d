"""Data parallelism inside a worker (workers/data_parallel.py): the passes each rank runs over an uneven split,
and two ranks simulated in one process (a rank's context without a process group: nothing is sharded or
all-reduced) whose gradients and policy loss add up to the single process's. That sum holds only when every
rank normalises by the whole mini-batch (the top-entropy token count over every rank's micro-batches) and its
padding passes weigh 0 (actor and critic)."""

from __future__ import annotations

import pytest
import torch
from workers_support import ppo_config, unequal_batch

from archer.distributed.context import DistContext
from archer.models.micro_batches import MicroBatching
from archer.workers.actor import ActorWorker
from archer.workers.critic import CriticWorker
from archer.workers.data_parallel import RankTokens, balanced_shards, rank_passes

CPU = torch.device("cpu")


def rank(index: int, world: int) -> DistContext:
    """Rank ``index`` of ``world`` with no process group (what rank_passes and the workers read: rank, world)."""
    return DistContext(rank=index, world_size=world, local_rank=index, device=CPU)


def lists(parts: list[torch.Tensor]) -> list[list[int]]:
    return [p.tolist() for p in parts]


def test_an_uneven_split_pads_the_rank_with_fewer_micro_batches():
    """5 rows over 2 ranks, 2 rows a micro-batch: rank 0 takes rows 0-2 (2 passes), rank 1 rows 3-4 (1 pass and
    1 padding pass over its last micro-batch again); both know every rank's micro-batches."""
    mask = torch.ones(5, 4, dtype=torch.long)
    micro = MicroBatching(2, None, packed=False)
    first, second = (rank_passes(mask, micro, rank(r, 2)) for r in (0, 1))
    assert lists(first.parts) == [[0, 1], [2]] and first.own == 2 and first.rows == slice(0, 3)
    assert lists(second.parts) == [[3, 4], [3, 4]] and second.own == 1 and second.rows == slice(3, 5)
    assert [first.padding(i) for i in range(2)] == [False, False]
    assert [second.padding(i) for i in range(2)] == [False, True]
    assert lists(first.every_rank) == lists(second.every_rank) == [[0, 1], [2], [3, 4]]
    single = rank_passes(mask, micro, rank(0, 1))
    assert lists(single.parts) == lists(micro.split(mask)) and single.own == 3 and single.rows == slice(0, 5)


def test_a_token_budget_splits_each_rank_by_its_own_lengths():
    """Packed, token budget 6: rank 0's rows (lengths 6, 1, 1) make two micro-batches (the 6 alone, then 1 + 1),
    rank 1's (2, 2) one; rank 1 pads with its micro-batch again."""
    lengths = [6, 1, 1, 2, 2]
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    micro = MicroBatching(None, 6, packed=True)
    first, second = (rank_passes(mask, micro, rank(r, 2)) for r in (0, 1))
    assert lists(first.parts) == [[0], [1, 2]] and first.own == 2
    assert lists(second.parts) == [[3, 4], [3, 4]] and second.own == 1
    assert lists(first.every_rank) == [[0], [1, 2], [3, 4]]


def test_a_rank_without_rows_repeats_row_zero_as_padding():
    mask = torch.ones(1, 3, dtype=torch.long)
    passes = rank_passes(mask, MicroBatching(None, None, packed=False), rank(1, 2))
    assert lists(passes.parts) == [[0]] and passes.own == 0 and passes.padding(0) and passes.rows == slice(1, 1)
    assert lists(passes.every_rank) == [[0]]


def test_balanced_shards_deal_the_longest_rows_to_the_rank_with_the_fewest_tokens():
    """Lengths 10, 9, 8, 1, 1, 1 over 2 ranks of 3 rows: 10 -> rank 0, 9 -> 1, 8 -> 1 (9 < 10), then the 1s to
    rank 0 until it is full (11, 12 against 17) and the last to rank 1: 12 and 18 tokens, where contiguous rows
    give 27 and 3 (and no split of 3 + 3 rows does better than 18)."""
    lengths = torch.tensor([10, 9, 8, 1, 1, 1])
    assert lists(balanced_shards(lengths, 2)) == [[0, 3, 4], [1, 2, 5]]
    assert lists(balanced_shards(torch.tensor([5, 5, 1, 1, 1]), 2)) == [[0, 2, 4], [1, 3]]  # 3 + 2 rows: 7 and 6
    assert lists(balanced_shards(lengths, 1)) == [[0, 1, 2, 3, 4, 5]]
    assert lists(balanced_shards(torch.tensor([4]), 2)) == [[0], []]


def test_balanced_rank_passes_split_each_rank_shard_into_its_micro_batches():
    lengths = [10, 9, 8, 1, 1, 1]
    mask = torch.tensor([[1] * n + [0] * (10 - n) for n in lengths])
    micro = MicroBatching(2, None, packed=False)
    first, second = (rank_passes(mask, micro, rank(r, 2), balance=True) for r in (0, 1))
    assert lists(first.parts) == [[0, 3], [4]] and first.rows.tolist() == [0, 3, 4]
    assert lists(second.parts) == [[1, 2], [5]] and second.rows.tolist() == [1, 2, 5]
    assert lists(first.every_rank) == lists(second.every_rank) == [[0, 3], [4], [1, 2], [5]]
    assert lists(rank_passes(mask, micro, rank(0, 1), balance=True).parts) == [[0, 1], [2, 3], [4, 5]]


def test_rank_token_totals_under_verls_global_seqlen_names():
    """Two mini-batches over 2 ranks: lengths 10, 9, 8, 1, 1, 1 (contiguous 27 | 3, balanced 12 | 18), then 4, 4
    (4 | 4 both ways): totals 31 | 7 and 16 | 22."""
    tokens = RankTokens(2)
    for lengths in ([10, 9, 8, 1, 1, 1], [4, 4]):
        tokens.add(torch.tensor([[1] * n + [0] * (10 - n) for n in lengths]))
    assert tokens.metrics() == {"global_seqlen/min": 7.0, "global_seqlen/max": 31.0,
                                "global_seqlen/minmax_diff": 24.0, "global_seqlen/balanced_min": 16.0,
                                "global_seqlen/balanced_max": 22.0, "global_seqlen/mean": 19.0}


def recording_steps(worker) -> dict[str, torch.Tensor]:
    """The gradients the worker's owner steps on (the last step's), recorded before its optimiser step."""
    grads: dict[str, torch.Tensor] = {}
    step = worker.owner.step

    def record(grad_clip: float, **kwargs):
        grads.update({n: p.grad.clone() for n, p in worker.model.named_parameters() if p.grad is not None})
        return step(grad_clip, **kwargs)

    worker.owner.step = record
    return grads


def assert_ranks_add_up(runs: dict[str, tuple[dict[str, float], dict[str, torch.Tensor]]], loss: str) -> None:
    (single, want), (first, got0), (second, got1) = runs["single"], runs["rank0"], runs["rank1"]
    assert first[loss] + second[loss] == pytest.approx(single[loss], abs=1e-6)
    assert first[loss] != 0 and second[loss] != 0
    assert want.keys() == got0.keys() == got1.keys() and len(want) > 10
    for name, grad in want.items():
        torch.testing.assert_close(got0[name] + got1[name], grad, rtol=1e-5, atol=1e-7, msg=name)


SIMULATED = (("single", None), ("rank0", rank(0, 2)), ("rank1", rank(1, 2)))


@pytest.mark.parametrize("balance", [False, True])
def test_two_simulated_actor_ranks_add_up_to_one_process(tiny_model_dir, balance):
    """One mini-batch of 5 rows, one row a micro-batch (so that the ranks' micro-batches are the single
    process's): the gradients and policy losses of rank 0 (rows 0-2, or with ``balance`` its balanced shard) and
    rank 1 (rows 3-4 and a padding pass) sum to the single process's, which FSDP's summed gradients rely on.
    Without balance the loss takes top-entropy tokens (ratio 0.5, chosen and counted per micro-batch)."""
    top_entropy = [] if balance else ["actor_rollout_ref.actor.entropy_top_ratio=0.5"]
    cfg = ppo_config(tiny_model_dir, "actor_rollout_ref.rollout.n=1", "data.train_batch_size=5",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=5", "actor_rollout_ref.actor.shuffle=false",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *top_entropy).actor_rollout_ref
    runs = {}
    for name, ctx in SIMULATED:
        actor = ActorWorker(cfg, device=CPU, total_steps=1, ctx=ctx, start_rollout=False, balance_ranks=balance)
        assert actor.balance_ranks is balance  # no per-micro-batch choice to keep: balanced as asked
        if name == "single":
            batch = unequal_batch(actor.model.config.vocab_size).index(slice(0, 5))
            shards = rank_passes(batch["attention_mask"], actor.update_micro, rank(0, 2), balance=balance).rows
            assert (shards == slice(0, 3)) if not balance else shards.tolist() != [0, 1, 2]
            batch = batch.union(actor.compute_log_prob(batch).select(["old_log_probs"]))
            batch["advantages"] = torch.linspace(-1.0, 1.5, 5)[:, None] * batch["response_mask"]
        grads = recording_steps(actor)
        runs[name] = (actor.update_actor(batch).metrics, grads)
    assert_ranks_add_up(runs, "actor/pg_loss")
    # sequences of 6, 7, 6, 6, 6 tokens: rows 0-2 | 3-4 hold 19 | 12; balanced, 7 + 6 + 6 | 6 + 6 as well
    assert "global_seqlen/min" not in runs["single"][0]
    for name in ("rank0", "rank1"):
        assert {k: v for k, v in runs[name][0].items() if k.startswith("global_seqlen/")} == {
            "global_seqlen/min": 12.0, "global_seqlen/max": 19.0, "global_seqlen/minmax_diff": 7.0,
            "global_seqlen/balanced_min": 12.0, "global_seqlen/balanced_max": 19.0, "global_seqlen/mean": 15.5}


def test_a_loss_that_chooses_per_micro_batch_keeps_contiguous_rows(tiny_model_dir, caplog):
    """Top-entropy tokens are chosen within each micro-batch: balanced shards would regroup them, so the actor
    keeps contiguous rows on several ranks and says so once (rank 0)."""
    cfg = ppo_config(tiny_model_dir, "actor_rollout_ref.actor.entropy_top_ratio=0.5").actor_rollout_ref
    with caplog.at_level("WARNING", logger="archer.actor"):
        first = ActorWorker(cfg, device=CPU, total_steps=1, ctx=rank(0, 2), start_rollout=False, balance_ranks=True)
        second = ActorWorker(cfg, device=CPU, total_steps=1, ctx=rank(1, 2), start_rollout=False, balance_ranks=True)
    assert not first.balance_ranks and not second.balance_ranks
    warnings = [r.getMessage() for r in caplog.records if "balance_batch" in r.getMessage()]
    assert len(warnings) == 1 and "leaves the actor's rows contiguous" in warnings[0]


def test_two_simulated_critic_ranks_add_up_to_one_process(tiny_model_dir):
    """The critic's value loss over 5 rows, 2 rows a micro-batch: rank 0 (rows 0-2, 2 passes) and rank 1 (rows
    3-4 and a padding pass) sum to the single process's gradients and vf_loss."""
    cfg = ppo_config(tiny_model_dir, "critic.ppo_mini_batch_size=5", "critic.shuffle=false",
                     "critic.ppo_micro_batch_size_per_gpu=2", "data.train_batch_size=5").critic
    runs = {}
    for name, ctx in SIMULATED:
        torch.manual_seed(0)  # the value head's initial weights, the same in every process
        critic = CriticWorker(cfg, rollout_n=1, device=CPU, total_steps=1, ctx=ctx)
        if name == "single":
            batch = unequal_batch(critic.model.config.vocab_size).index(slice(0, 5))
            batch["values"] = critic.compute_values(batch)["values"]
            batch["returns"] = torch.linspace(0.5, -0.5, 5)[:, None] * batch["response_mask"]
        grads = recording_steps(critic)
        runs[name] = (critic.update_critic(batch).metrics, grads)
    assert_ranks_add_up(runs, "critic/vf_loss")
