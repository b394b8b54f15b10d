import pytest
import torch

from archer.algorithms.aggregation import AGG_MODES, agg_loss, agg_totals
from archer.errors import ArcherError

LOSS = torch.tensor(
    [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [10.0, 11.0, 12.0]], dtype=torch.float64
)
# last row has no valid token: it counts neither as a token nor as a sequence
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.float64)
# token sums per row: 6, 9, 7, 0 -> total 22 over 6 tokens and 3 sequences; token means 2, 4.5, 7
EXPECTED = {
    "token-mean": 22 / 6,
    "token-sum": 22,  # verl's token-sum: no normaliser
    "seq-mean-token-sum": 22 / 3,
    "seq-mean-token-mean": (2 + 4.5 + 7) / 3,
    "seq-mean-token-sum-norm": 22 / (3 * 3),
}


def test_the_registry_holds_exactly_the_five_modes():
    assert set(AGG_MODES) == set(EXPECTED)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_each_mode_by_hand(mode: str):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(EXPECTED[mode], rel=1e-12)
    assert agg_loss(LOSS, MASK.bool(), mode).item() == pytest.approx(EXPECTED[mode], rel=1e-12)


def test_agg_totals_of_a_batch():
    totals = agg_totals(MASK)
    assert totals["num_tokens"].item() == 6
    assert totals["num_seqs"].item() == 3
    assert totals["max_len"] == 3


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_micro_batches_with_mini_batch_totals_add_up_to_the_mini_batch_loss(mode: str):
    totals = agg_totals(MASK)
    # the second micro-batch is padded only to its own longest response (1 token)
    micro = [(LOSS[:2], MASK[:2]), (LOSS[2:, :1], MASK[2:, :1])]
    summed = sum(agg_loss(loss, mask, mode, **totals) for loss, mask in micro)
    torch.testing.assert_close(summed, agg_loss(LOSS, MASK, mode), rtol=1e-12, atol=0)
    assert summed.item() == pytest.approx(EXPECTED[mode], rel=1e-12)


def test_micro_batches_with_their_own_counts_do_not_add_up():
    summed = sum(agg_loss(LOSS[i : i + 2], MASK[i : i + 2], "token-mean") for i in (0, 2))
    assert summed.item() == pytest.approx(15 / 5 + 7 / 1)


def test_explicit_normalisers_override_the_batch_counts():
    assert agg_loss(LOSS, MASK, "token-mean", num_tokens=11).item() == pytest.approx(2.0)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", num_seqs=2, max_len=11).item() == pytest.approx(
        1.0
    )


def test_an_all_masked_batch_gives_zero_not_nan():
    for mode in EXPECTED:
        assert agg_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0


def test_gradient_of_token_mean_is_mask_over_num_tokens():
    loss = LOSS.clone().requires_grad_(True)
    agg_loss(loss, MASK, "token-mean", num_tokens=8).backward()
    torch.testing.assert_close(loss.grad, MASK / 8)


def test_token_sum_ignores_the_normalisers_and_its_gradient_is_the_mask():
    loss = LOSS.clone().requires_grad_(True)
    assert agg_loss(loss, MASK, "token-sum", num_tokens=8, num_seqs=2, max_len=11).item() == 22
    agg_loss(loss, MASK, "token-sum").backward()
    torch.testing.assert_close(loss.grad, MASK)


def test_unknown_mode_lists_the_known_modes():
    with pytest.raises(ArcherError, match="unknown loss aggregation mode 'seq-mean'") as err:
        agg_loss(LOSS, MASK, "seq-mean")
    assert "token-mean" in err.value.fix and "loss_agg_mode" in err.value.fix
