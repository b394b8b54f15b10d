"""Token selections of the entropy-aware losses, checked against hand computations (docs/algorithms.md, entropy-aware methods)."""

import math

import pytest
import torch

from archer.algorithms.token_selection import (
    advantage_logp_covariance,
    clip_cov_tokens,
    high_entropy_tokens,
    kl_cov_tokens,
    top_entropy_count,
    top_entropy_tokens,
)
from archer.errors import ArcherError

INF = math.inf
PAD = 7.0  # the entropy of padded positions: larger than any valid one, so selecting it would show

# row 0: five valid tokens, sorted H = 0.1, 0.2, 0.4, 0.5, 0.9, then one padded position
# row 1: three valid tokens of equal entropy; row 2: no valid token
ENTROPY = torch.tensor(
    [[0.1, 0.5, 0.2, 0.9, 0.4, PAD], [0.3, 0.3, 0.3, PAD, PAD, PAD], [PAD] * 6], dtype=torch.float64
)
MASK = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [0] * 6])


def rows(selected: torch.Tensor) -> list[list[int]]:
    return selected.int().tolist()


@pytest.mark.parametrize(
    ("quantile", "high_in_row0"),
    [
        # position q*(5-1) in the sorted valid H, interpolated linearly:
        (0.8, [0, 0, 0, 1, 0, 0]),  # pos 3.2: q = 0.5 + 0.2*(0.9-0.5) = 0.58 -> only 0.9 is above
        (0.7, [0, 1, 0, 1, 0, 0]),  # pos 2.8: q = 0.4 + 0.8*(0.5-0.4) = 0.48 -> 0.5 and 0.9 (nearest would give 0.5)
        (0.75, [0, 0, 0, 1, 0, 0]),  # pos 3.0: q = 0.5 exactly; H <= q is low, so 0.5 stays low
        (0.0, [0, 1, 1, 1, 1, 0]),  # q = min = 0.1: every token but the smallest
        (1.0, [0, 0, 0, 0, 0, 0]),  # q = max = 0.9: none is strictly above
    ],
)
def test_quantile_split_per_response_by_linear_interpolation(quantile, high_in_row0):
    high = high_entropy_tokens(ENTROPY, MASK, quantile)
    assert high.dtype == torch.bool
    assert rows(high)[0] == high_in_row0
    assert rows(high)[1] == [0] * 6  # equal entropies: every token equals q, so none is high
    assert rows(high)[2] == [0] * 6  # a response without valid tokens has no high-entropy token


def test_quantile_is_taken_per_response_not_over_the_batch():
    # row 1's entropies all lie below row 0's quantile, yet its own top token is high-entropy
    entropy = torch.tensor([[5.0, 6.0, 7.0, 8.0, 9.0], [0.1, 0.3, 0.2, 0.5, 0.4]])
    high = high_entropy_tokens(entropy, torch.ones(2, 5), 0.8)
    assert rows(high) == [[0, 0, 0, 0, 1], [0, 0, 0, 1, 0]]


def test_ten_tokens_at_quantile_08_give_two_high_entropy_tokens():
    entropy = torch.tensor([[0.3, 1.0, 0.1, 0.6, 0.9, 0.2, 0.4, 0.8, 0.5, 0.7]])
    high = high_entropy_tokens(entropy, torch.ones(1, 10), 0.8)  # pos 7.2: q = 0.8 + 0.2*0.1 = 0.82
    assert rows(high) == [[0, 1, 0, 0, 1, 0, 0, 0, 0, 0]]


def test_padding_neither_moves_the_quantile_nor_is_selected():
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    padded_huge = high_entropy_tokens(torch.tensor([[0.1, 0.5, 0.2, 0.9, 0.4, 100.0]]), mask, 0.7)
    padded_tiny = high_entropy_tokens(torch.tensor([[0.1, 0.5, 0.2, 0.9, 0.4, -100.0]]), mask, 0.7)
    assert rows(padded_huge) == rows(padded_tiny) == [[0, 1, 0, 1, 0, 0]]


def test_entropy_split_is_detached():
    entropy = ENTROPY.clone().requires_grad_(True)
    assert not high_entropy_tokens(entropy, MASK, 0.8).requires_grad


@pytest.mark.parametrize("quantile", [-0.1, 1.5])
def test_quantile_outside_unit_interval_is_an_archer_error(quantile):
    with pytest.raises(ArcherError, match="token_entropy_quantile"):
        high_entropy_tokens(ENTROPY, MASK, quantile)


@pytest.mark.parametrize(
    ("num_valid", "ratio", "count"),
    [(10, 0.2, 2), (7, 0.2, 2), (15, 0.2, 3), (25, 0.28, 7), (1, 0.2, 1), (4, 1.0, 4), (0, 0.2, 0)],
)
def test_top_entropy_count_is_ceil_of_ratio_times_n(num_valid, ratio, count):
    # 0.28*25 is 7.000000000000001 in floating point: still 7 tokens, not 8
    assert top_entropy_count(num_valid, ratio) == count


# 7 valid tokens over the whole tensor; padded positions carry the largest entropy
TOP_ENTROPY = torch.tensor([[0.3, 1.2, 0.1, 0.8], [1.5, 0.2, 0.9, 9.0]])
TOP_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [
        (0.2, [[0, 1, 0, 0], [1, 0, 0, 0]]),  # ceil(1.4) = 2: H 1.5 and 1.2
        (0.5, [[0, 1, 0, 1], [1, 0, 1, 0]]),  # ceil(3.5) = 4: 1.5, 1.2, 0.9, 0.8
        (1.0, [[1, 1, 1, 1], [1, 1, 1, 0]]),  # every valid token, never the padded one
    ],
)
def test_top_entropy_tokens_over_the_whole_tensor(ratio, expected):
    selected = top_entropy_tokens(TOP_ENTROPY, TOP_MASK, ratio)
    assert selected.dtype == torch.bool
    assert rows(selected) == expected


@pytest.mark.parametrize(("num_valid", "ratio"), [(25, 0.28), (7, 0.2), (40, 0.5), (1, 0.01), (33, 1.0)])
def test_top_entropy_tokens_select_exactly_the_count_the_normaliser_uses_even_with_ties(num_valid, ratio):
    # selected on the tensor's device without reading N back: as many as top_entropy_count (the loss's normaliser,
    # counted on the host), the largest entropies, ties broken by position; 0.28 * 25 = 7.000000000000001 -> 7
    gen = torch.Generator().manual_seed(num_valid)
    entropy = torch.randint(0, 4, (5, 9), generator=gen).float()  # many ties
    mask = torch.zeros(5, 9, dtype=torch.long)
    mask.view(-1)[torch.randperm(45, generator=gen)[:num_valid]] = 1
    selected = top_entropy_tokens(entropy, mask, ratio)
    k = top_entropy_count(num_valid, ratio)
    assert int(selected.sum()) == k and not (selected & ~mask.bool()).any()
    if k < num_valid:  # nothing left out has a larger entropy than anything selected
        assert float(entropy[selected].min()) >= float(entropy[mask.bool() & ~selected].max())


@pytest.mark.parametrize(("num_valid", "ratio"), [(25, 0.28), (40, 0.05), (3, 0.1), (33, 1.0)])
def test_kl_cov_tokens_select_exactly_the_covariance_count_even_with_ties(num_valid, ratio):
    gen = torch.Generator().manual_seed(num_valid)
    cov = torch.full((5, 9), -INF, dtype=torch.float64)
    cov.view(-1)[torch.randperm(45, generator=gen)[:num_valid]] = torch.randint(-2, 3, (num_valid,),
                                                                                 generator=gen).double()
    selected = kl_cov_tokens(cov, ratio)
    finite = torch.isfinite(cov)
    assert int(selected.sum()) == max(1, int(ratio * num_valid)) and not (selected & ~finite).any()
    if int(selected.sum()) < num_valid:
        assert float(cov[selected].min()) >= float(cov[finite & ~selected].max())


def test_top_entropy_tokens_of_an_empty_mask_select_nothing():
    assert not top_entropy_tokens(TOP_ENTROPY, torch.zeros(2, 4), 0.2).any()


@pytest.mark.parametrize("ratio", [0.0, -0.2, 1.5])
def test_top_entropy_ratio_outside_zero_one_is_an_archer_error(ratio):
    with pytest.raises(ArcherError, match="entropy_top_ratio"):
        top_entropy_tokens(TOP_ENTROPY, TOP_MASK, ratio)


def test_covariance_by_hand_over_valid_tokens_only():
    # valid A = 2, 0, 4, -2 (mean 1) and logp = -1, -2, -0.5, -0.5 (mean -1); the padded token would shift both
    adv = torch.tensor([[2.0, 0.0, 4.0], [-2.0, 100.0, 100.0]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.5, 50.0, 50.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    cov = advantage_logp_covariance(adv, logp, mask)
    # (A - 1) * (logp + 1): 1*0, -1*-1, 3*0.5, -3*0.5
    assert cov[0].tolist() == pytest.approx([0.0, 1.0, 1.5])
    assert cov[1, 0].item() == pytest.approx(-1.5)
    assert cov[1, 1:].tolist() == [-INF, -INF]


def test_covariance_is_detached():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    assert not advantage_logp_covariance(torch.tensor([[1.0, -1.0]]), logp, torch.ones(1, 2)).requires_grad


@pytest.mark.parametrize(("num_valid", "ratio", "count"), [(5, 0.45, 2), (5, 0.01, 1), (1000, 0.002, 2), (0, 0.5, 0)])
def test_both_covariance_selections_take_max_one_int_ratio_times_n_tokens(num_valid, ratio, count):
    cov = torch.full((1, 1000), -INF)
    cov[0, :num_valid] = torch.linspace(1.5, 2.5, num_valid)  # all inside Clip-Cov's window (1, 5)
    assert int(kl_cov_tokens(cov, ratio).sum()) == count
    assert int(clip_cov_tokens(cov, torch.ones_like(cov, dtype=torch.bool), ratio, 1.0, 5.0).sum()) == count


# five valid tokens (one padded); covariances distinct
KL_COV = torch.tensor([[0.5, -2.0, 3.0], [1.0, 2.5, -INF]])


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [
        (0.45, [[0, 0, 1], [0, 1, 0]]),  # int(2.25) = 2: cov 3.0 and 2.5
        (0.01, [[0, 0, 1], [0, 0, 0]]),  # at least one: the largest, 3.0
        (1.0, [[1, 1, 1], [1, 1, 0]]),  # all five valid ones, negative covariance included, never the padding
    ],
)
def test_kl_cov_picks_the_largest_covariance_valid_tokens(ratio, expected):
    assert rows(kl_cov_tokens(KL_COV, ratio)) == expected


def test_kl_cov_without_valid_tokens_selects_nothing():
    assert not kl_cov_tokens(torch.full((2, 3), -INF), 0.5).any()


# six valid tokens; window (1, 5): 2.0 and 3.0 are candidates, 1.0 and 5.0 sit on the open bounds,
# 4.0 is in the window but not eligible (the PPO clip already clipped it), 0.5 is outside
CLIP_COV = torch.tensor([[2.0, 3.0, 1.0, 5.0], [4.0, 0.5, -INF, -INF]])
ELIGIBLE = torch.tensor([[True, True, True, True], [False, True, True, True]])


@pytest.mark.parametrize(
    ("ratio", "count"),
    [(0.34, 2), (0.2, 1), (0.0001, 1), (1.0, 2)],  # int(2.04), int(1.2), max(1, 0); 6 wanted but 2 candidates
)
def test_clip_cov_picks_only_eligible_tokens_strictly_inside_the_window(ratio, count):
    for seed in range(10):
        selected = clip_cov_tokens(CLIP_COV, ELIGIBLE, ratio, 1.0, 5.0, torch.Generator().manual_seed(seed))
        assert int(selected.sum()) == count
        assert not (selected & ~torch.tensor([[True, True, False, False], [False, False, False, False]])).any()


def test_clip_cov_draws_exactly_max_one_int_ratio_n_at_random_reproducibly():
    cov = torch.full((4, 5), 2.0)
    cov[3, 3:] = -INF  # 18 valid tokens, all candidates
    eligible = torch.ones(4, 5, dtype=torch.bool)

    def draw(seed: int) -> torch.Tensor:
        return clip_cov_tokens(cov, eligible, 0.25, 1.0, 5.0, torch.Generator().manual_seed(seed))

    draws = [draw(seed) for seed in range(5)]
    for selected in draws:
        assert int(selected.sum()) == 4  # int(0.25 * 18) = 4
        assert not selected[3, 3:].any()
    assert torch.equal(draw(3), draws[3])  # the same seed draws the same tokens
    assert any(not torch.equal(draws[0], other) for other in draws[1:])  # different seeds draw differently


def test_clip_cov_draws_every_candidate_equally_often():
    # 4 of 12 candidates a draw: over 3,000 draws each is cut about 1,000 times (binomial sd ~26); the other
    # tokens never are
    cov = torch.tensor([[2.0] * 6 + [0.5, 7.0], [3.0] * 6 + [-INF, -INF]])
    generator = torch.Generator().manual_seed(0)
    counts = sum(clip_cov_tokens(cov, torch.ones_like(cov, dtype=torch.bool), 0.3, 1.0, 5.0, generator).long()
                 for _ in range(3000))  # int(0.3 * 14) = 4
    candidates = (cov > 1.0) & (cov < 5.0)
    assert int(counts.sum()) == 4 * 3000 and not counts[~candidates].any()
    assert counts[candidates].min() > 900 and counts[candidates].max() < 1100


def test_clip_cov_without_candidates_selects_nothing():
    assert not clip_cov_tokens(CLIP_COV, ELIGIBLE, 0.5, 10.0, 20.0).any()


@pytest.mark.parametrize("ratio", [1.2, 3.0, -0.5])
@pytest.mark.parametrize("select", ["kl_cov", "clip_cov"])
def test_covariance_ratio_outside_unit_interval_is_an_archer_error(select, ratio):
    with pytest.raises(ArcherError):
        if select == "kl_cov":
            kl_cov_tokens(KL_COV, ratio)
        else:
            clip_cov_tokens(KL_COV, torch.ones(2, 3, dtype=torch.bool), ratio, 0.0, 10.0)
