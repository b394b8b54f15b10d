"""Micro-batches of a worker pass: fixed rows in order, or rows under a token budget (no micro-batch above it unless
a single row is longer; packed: the sum of lengths, first-fit decreasing), read from verl's keys; the no-grad passes'
token budgets by default, and the key that keeps the micro-batch keys exactly."""

from __future__ import annotations

import logging

import pytest
import torch
from workers_support import ppo_config

from archer.models.micro_batches import (
    ACTOR_UPDATE,
    LOG_PROB,
    MicroBatching,
    no_grad_micro_batching,
    packed_budget_split,
    token_budget_split,
)


def as_lists(parts: list[torch.Tensor]) -> list[list[int]]:
    return [part.tolist() for part in parts]


def lengths_mask(lengths: list[int], width: int) -> torch.Tensor:
    """Rows of ``lengths`` tokens, right-aligned in ``width`` columns (only the counts matter here)."""
    return (torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]).long()


def test_token_budget_split_by_hand():
    # sorted: 9 (row 1), 9 (row 3), 5 (row 0), 3 (row 2), 2 (row 4); 2 x 9 = 18 fits, 3 x 9 does not;
    # then 5 wide: 3 x 5 = 15 fits
    assert as_lists(token_budget_split(torch.tensor([5, 9, 3, 9, 2]), 18)) == [[1, 3], [0, 2, 4]]
    assert as_lists(token_budget_split(torch.tensor([5, 9, 3, 9, 2]), 100)) == [[1, 3, 0, 2, 4]]
    # a row longer than the budget goes alone, as in verl
    assert as_lists(token_budget_split(torch.tensor([4, 30, 4]), 16)) == [[1], [0, 2]]
    assert as_lists(token_budget_split(torch.tensor([7, 7, 7]), 6)) == [[0], [1], [2]]


def test_no_micro_batch_is_above_the_budget_and_every_row_is_in_one():
    gen = torch.Generator().manual_seed(0)
    for budget in (64, 300, 1000):
        lengths = torch.randint(1, 200, (97,), generator=gen)
        parts = token_budget_split(lengths, budget)
        assert sorted(torch.cat(parts).tolist()) == list(range(97))
        for part in parts:
            widest = int(lengths[part].max())
            assert len(part) * widest <= budget or len(part) == 1
        # greedy over the sorted rows: the next micro-batch's first row would not have fitted
        for part, following in zip(parts, parts[1:]):
            assert (len(part) + 1) * int(lengths[part].max()) > budget
            assert int(lengths[following].max()) <= int(lengths[part].min())


def test_packed_budget_split_by_hand():
    # first-fit decreasing over 9 (row 1), 9 (row 3), 5 (row 0), 3 (row 2), 2 (row 4) with 12 tokens:
    # 9 opens [1], 9 opens [3], 5 opens [0], 3 joins [1] (12), 2 joins [3] (11)
    assert as_lists(packed_budget_split(torch.tensor([5, 9, 3, 9, 2]), 12)) == [[1, 2], [3, 4], [0]]
    assert as_lists(packed_budget_split(torch.tensor([5, 9, 3, 9, 2]), 100)) == [[1, 3, 0, 2, 4]]
    # a row longer than the budget goes alone
    assert as_lists(packed_budget_split(torch.tensor([4, 30, 4]), 16)) == [[1], [0, 2]]


def test_packed_micro_batches_hold_at_most_the_budget_and_every_row_once():
    gen = torch.Generator().manual_seed(0)
    for budget in (64, 300, 1000):
        lengths = torch.randint(1, 200, (97,), generator=gen)
        parts = packed_budget_split(lengths, budget)
        assert sorted(torch.cat(parts).tolist()) == list(range(97))
        assert all(int(lengths[part].sum()) <= budget or len(part) == 1 for part in parts)
        # packing by sums beats rows x longest on long-tailed lengths
        assert len(parts) <= len(token_budget_split(lengths, budget))


def test_split_counts_the_tokens_each_row_takes():
    mask = lengths_mask([3, 8, 5, 2], width=10)
    # packed: a row takes its own length; 8 + 5 + 3 = 16 fits a budget of 16
    assert as_lists(MicroBatching(None, 16, packed=True).split(mask)) == [[1, 2, 0], [3]]
    # padded: every row is 10 wide, so 16 tokens hold one row, 20 hold two, in batch order
    assert as_lists(MicroBatching(None, 16, packed=False).split(mask)) == [[0], [1], [2], [3]]
    assert as_lists(MicroBatching(None, 20, packed=False).split(mask)) == [[0, 1], [2, 3]]
    # fixed sizes keep the batch order; None is the whole batch
    assert as_lists(MicroBatching(3, None, packed=True).split(mask)) == [[0, 1, 2], [3]]
    assert as_lists(MicroBatching(None, None, packed=False).split(mask)) == [[0, 1, 2, 3]]


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], MicroBatching(None, None, False)),
    (["actor_rollout_ref.actor.ppo_micro_batch_size=8"], MicroBatching(8, None, False)),
    (["actor_rollout_ref.actor.ppo_micro_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"],
     MicroBatching(2, None, False)),
    (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=300",
      "actor_rollout_ref.model.use_remove_padding=true"], MicroBatching(None, 300, True)),
])
def test_from_config_reads_verls_keys(tiny_model_dir, overrides, expected):
    cfg = ppo_config(tiny_model_dir, *overrides).actor_rollout_ref
    got = MicroBatching.from_config(cfg.actor, ACTOR_UPDATE, packed=bool(cfg.model.use_remove_padding))
    assert got == expected


def test_log_prob_budgets_follow_the_actors_as_in_verl(tiny_model_dir):
    cfg = ppo_config(tiny_model_dir, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=300", "critic.ppo_max_token_len_per_gpu=500")
    for section in (cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref):
        assert section.log_prob_use_dynamic_bsz is True and section.log_prob_max_token_len_per_gpu == 300
    assert cfg.critic.use_dynamic_bsz is True and cfg.critic.forward_max_token_len_per_gpu == 500


def no_grad(cfg, **kwargs) -> MicroBatching:
    options = {"remove_padding": False, "can_pack": True, "planned_tokens": None, "announce": True, **kwargs}
    return no_grad_micro_batching(cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout", LOG_PROB, **options)


def test_no_grad_passes_pack_to_a_token_budget_by_default(tiny_model_dir, caplog):
    cfg = ppo_config(tiny_model_dir)
    assert no_grad(cfg) == MicroBatching(None, 16384, True)  # the budget key's value without a plan (the CPU)
    assert no_grad(cfg, planned_tokens=5000) == MicroBatching(None, 5000, True)  # the memory plan's
    assert no_grad(cfg, can_pack=False) == MicroBatching(None, 16384, False)
    assert not caplog.records  # the keys set no rows: nothing is overridden
    # the section's own budget when its token-budget switch is on
    dynamic = ppo_config(tiny_model_dir, "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                         "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=700")
    assert no_grad(dynamic, planned_tokens=5000) == MicroBatching(None, 700, True)


def test_rows_per_micro_batch_that_tokens_replace_are_said_once(tiny_model_dir, caplog):
    one_row = ppo_config(tiny_model_dir, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1")
    with caplog.at_level(logging.WARNING, logger="archer.micro_batches"):
        assert no_grad(one_row, planned_tokens=5000) == MicroBatching(None, 5000, True)
    [record] = caplog.records
    assert ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1 is not used" in record.getMessage()
            and "at most 5000 tokens" in record.getMessage()
            and "actor_rollout_ref.rollout.log_prob_by_tokens=false" in record.getMessage())
    caplog.clear()
    assert no_grad(one_row, planned_tokens=5000, announce=False) == MicroBatching(None, 5000, True)
    assert not caplog.records  # another rank's worker keeps quiet


def test_by_tokens_off_keeps_the_keys_exactly(tiny_model_dir, caplog):
    kept = ppo_config(tiny_model_dir, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                      "actor_rollout_ref.rollout.log_prob_by_tokens=false")
    assert no_grad(kept, planned_tokens=5000) == MicroBatching(1, None, False)
    assert no_grad(kept, remove_padding=True) == MicroBatching(1, None, True)
    assert no_grad(kept, remove_padding=True, can_pack=False) == MicroBatching(1, None, False)
    assert not caplog.records
    # one key turns it off for every no-grad pass
    assert kept.actor_rollout_ref.ref.log_prob_by_tokens is False
    assert kept.critic.forward_by_tokens is False and kept.reward_model.forward_by_tokens is False
