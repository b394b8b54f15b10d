"""Micro-batches of a worker pass: fixed rows in order, or rows sorted by length under a token budget (no
micro-batch above it unless a single row is longer), read from verl's keys."""

from __future__ import annotations

import pytest
import torch
from workers_support import ppo_config

from archer.models.micro_batches import MicroBatching, token_budget_split


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


def test_split_counts_the_width_each_row_takes():
    mask = lengths_mask([3, 8, 5, 2], width=10)
    # padding-free: a row takes its own length; 8 + 5 wide -> 2 x 8 = 16 fits a budget of 16
    assert as_lists(MicroBatching(None, 16, remove_padding=True).split(mask)) == [[1, 2], [0, 3]]
    # padded: every row is 10 wide, so 16 tokens hold one row, 20 hold two, in batch order
    assert as_lists(MicroBatching(None, 16, remove_padding=False).split(mask)) == [[0], [1], [2], [3]]
    assert as_lists(MicroBatching(None, 20, remove_padding=False).split(mask)) == [[0, 1], [2, 3]]
    # fixed sizes keep the batch order; None is the whole batch
    assert as_lists(MicroBatching(3, None, remove_padding=True).split(mask)) == [[0, 1, 2], [3]]
    assert as_lists(MicroBatching(None, None, remove_padding=False).split(mask)) == [[0, 1, 2, 3]]


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
    got = MicroBatching.from_config(cfg.actor, size_key="ppo_micro_batch_size", dynamic_key="use_dynamic_bsz",
                                    budget_key="ppo_max_token_len_per_gpu",
                                    remove_padding=bool(cfg.model.use_remove_padding))
    assert got == expected


def test_log_prob_budgets_follow_the_actors_as_in_verl(tiny_model_dir):
    cfg = ppo_config(tiny_model_dir, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=300", "critic.ppo_max_token_len_per_gpu=500")
    for section in (cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref):
        assert section.log_prob_use_dynamic_bsz is True and section.log_prob_max_token_len_per_gpu == 300
    assert cfg.critic.use_dynamic_bsz is True and cfg.critic.forward_max_token_len_per_gpu == 500
