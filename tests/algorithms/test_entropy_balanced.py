"""AEPO's entropy-balanced policy optimisation (docs/algorithms.md, AEPO): the entropy-balanced clip of the losses
that clip the token ratio (forward values unchanged, gradients by hand and against the formula with autograd),
and the entropy-aware advantage scale with its metrics, on hand-computed tokens."""

import pytest
import torch

from archer.algorithms.entropy_advantage import (
    entropy_advantage_metrics,
    entropy_advantage_scale,
    standardised_entropy,
)
from archer.algorithms.metric_sums import Metric, Total
from archer.algorithms.policy_loss import POLICY_LOSSES, compute_policy_loss, register_policy_loss
from archer.errors import ArcherError

F64 = torch.float64
BALANCED = "enable_entropy_balanced_clipping"


def tokens(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(old_log_prob, log_prob requiring grad) with pi/pi_old = ratios."""
    old = torch.full((len(ratios), len(ratios[0])), -2.0, dtype=F64)
    return old, (old + torch.tensor(ratios, dtype=F64).log()).requires_grad_(True)


def run(loss_mode: str, ratios, adv, mask, **kwargs) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """(loss, metric values, d loss / d log_prob) of one token-mean call."""
    old, new = tokens(ratios)
    loss, metrics = compute_policy_loss(loss_mode, old_log_prob=old, log_prob=new,
                                        advantages=torch.as_tensor(adv, dtype=F64),
                                        response_mask=torch.as_tensor(mask, dtype=F64), **kwargs)
    (grad,) = torch.autograd.grad(loss, new)
    return loss, {k: v.value for k, v in metrics.items()}, grad


# ---------------------------------------------------------------- entropy-balanced clipping, vanilla
# eps 0.2 / 0.2, dual-clip c = 3. Row 0 A = +1: r = 1.5 clipped above, 1.1 inside, 0.5 below (A > 0: unclipped).
# Row 1 A = -1: r = 0.5 clipped below, 1.5 above (A < 0: unclipped), 5 dual-clipped. Row 2: A = +2 with r = 2
# clipped above, A = 0 with r = 2, and a padded token.
RATIOS = [[1.5, 1.1, 0.5], [0.5, 1.5, 5.0], [2.0, 2.0, 3.0]]
ADV = [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0], [2.0, 0.0, 100.0]]
MASK = [[1, 1, 1], [1, 1, 1], [1, 1, 0]]
N = 8
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
# both modes: -A*min(r, 1.2) above, max(r, 0.8) below for A < 0, dual-clip min(., 3)
TOKEN_LOSSES = [-1.2, -1.1, -0.5, 0.8, 1.5, 3.0, -2.4, 0.0]
# d/dlogp: -A*r unclipped; clipped above with A > 0: plain 0, balanced -A*(1+eps_h); lower clip, dual-clip: 0
PLAIN_GRAD = [[0.0, -1.1, -0.5], [0.0, 1.5, 0.0], [0.0, 0.0, 0.0]]
BALANCED_GRAD = [[-1.2, -1.1, -0.5], [0.0, 1.5, 0.0], [-2.4, 0.0, 0.0]]


def test_balanced_clip_keeps_the_value_and_gives_clipped_positive_tokens_the_gradient_minus_a_one_plus_eps():
    plain, plain_metrics, plain_grad = run("vanilla", RATIOS, ADV, MASK, **CLIP)
    loss, metrics, grad = run("vanilla", RATIOS, ADV, MASK, **CLIP, **{BALANCED: True})
    assert loss.item() == pytest.approx(sum(TOKEN_LOSSES) / N)
    assert loss.item() == plain.item()  # the forward value is exactly the same
    torch.testing.assert_close(plain_grad, torch.tensor(PLAIN_GRAD, dtype=F64) / N)
    torch.testing.assert_close(grad, torch.tensor(BALANCED_GRAD, dtype=F64) / N)
    # the clipped share is that of PPO; the balanced clip kept (0, 0) and (2, 0), the A > 0 ones
    assert metrics == pytest.approx({**plain_metrics, "entropy_balanced_clip_kept_frac": 2 / N})
    assert metrics["pg_clipfrac"] == pytest.approx(3 / N) and metrics["pg_clipfrac_lower"] == pytest.approx(1 / N)
    assert "entropy_balanced_clip_kept_frac" not in plain_metrics


def test_switches_default_to_off_when_not_passed():
    assert POLICY_LOSSES["vanilla"].arguments(CLIP) == {**CLIP, BALANCED: False}
    _, metrics, grad = run("vanilla", RATIOS, ADV, MASK, **CLIP)
    torch.testing.assert_close(grad, torch.tensor(PLAIN_GRAD, dtype=F64) / N)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_clip_gradient_matches_the_formula_on_random_tokens(seed):
    g = torch.Generator().manual_seed(seed)
    ratios = (torch.rand(6, 7, generator=g, dtype=F64) * 4.0 + 0.05)  # r in (0.05, 4.05): every branch
    adv = torch.randn(6, 7, generator=g, dtype=F64)
    mask = (torch.rand(6, 7, generator=g) < 0.8).to(F64)
    eps_l, eps_h, c = 0.2, 0.28, 3.0
    settings = {"clip_ratio_low": eps_l, "clip_ratio_high": eps_h, "clip_ratio_c": c}
    plain, _, _ = run("vanilla", ratios.tolist(), adv, mask, **settings)
    loss, metrics, grad = run("vanilla", ratios.tolist(), adv, mask, **settings, **{BALANCED: True})
    assert loss.item() == plain.item()
    r = ratios
    upper = (adv > 0) & (r > 1 + eps_h)
    lower = (adv < 0) & (r < 1 - eps_l)
    dual = (adv < 0) & (torch.maximum(r, torch.tensor(1 - eps_l, dtype=F64)) > c)
    factor = torch.where(upper, 1 + eps_h, torch.where(lower | dual, 0.0, r))
    expected = -adv * factor * mask / mask.sum()
    torch.testing.assert_close(grad, expected)
    assert metrics["entropy_balanced_clip_kept_frac"] == pytest.approx(float((upper * mask).sum() / mask.sum()))
    assert 0 < metrics["entropy_balanced_clip_kept_frac"] < 1


# ---------------------------------------------------------------- archer: each class's own eps_h
def test_archer_balanced_clip_uses_each_entropy_class_upper_bound():
    # low-entropy (L) eps 0.2, high-entropy (H) eps 0.5, dual-clip 10. Row 0 A = +1: r = 1.3 L (clipped at 1.2),
    # 1.3 H (inside 1.5), 1.7 H (clipped at 1.5). Row 1 A = -1: r = 0.6 L (clipped at 0.8), 0.6 H (inside 0.5),
    # 12 L (dual-clipped at 10).
    high = torch.tensor([[False, True, True], [False, True, False]])
    options = {"low_entropy_clip_ratio_low": 0.2, "low_entropy_clip_ratio_high": 0.2,
               "high_entropy_clip_ratio_low": 0.5, "high_entropy_clip_ratio_high": 0.5}
    args = ("archer", [[1.3, 1.3, 1.7], [0.6, 0.6, 12.0]], [[1.0] * 3, [-1.0] * 3], [[1] * 3] * 2)
    plain, plain_metrics, _ = run(*args, clip_ratio_c=10.0, high_entropy_mask=high, **options)
    loss, metrics, grad = run(*args, clip_ratio_c=10.0, high_entropy_mask=high, **options, **{BALANCED: True})
    assert loss.item() == pytest.approx((-1.2 - 1.3 - 1.5 + 0.8 + 0.6 + 10.0) / 6) and loss.item() == plain.item()
    torch.testing.assert_close(grad, torch.tensor([[-1.2, -1.3, -1.5], [0.0, 0.6, 0.0]], dtype=F64) / 6)
    assert metrics == pytest.approx({**plain_metrics, "entropy_balanced_clip_kept_frac": 2 / 6})
    assert metrics["entropy_low_clipfrac"] == pytest.approx(2 / 3)  # (0,0) and (1,0)
    assert metrics["entropy_high_clipfrac"] == pytest.approx(1 / 3)  # (0,2)


# ---------------------------------------------------------------- clip_cov: the clipped tokens are never cut
def test_clip_cov_with_balanced_clip_cuts_the_unclipped_tokens_and_keeps_the_clipped_ones():
    # a covariance window that holds every token and a ratio of 1: Clip-Cov cuts every token the PPO clip did
    # not clip; what is left is the clipped tokens, of which the A > 0 ones keep -A*(1+eps_h)
    settings = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_cov_ratio": 1.0, "clip_cov_lb": -1e9,
                "clip_cov_ub": 1e9}
    loss, metrics, grad = run("clip_cov", RATIOS, ADV, MASK, **settings, **{BALANCED: True})
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.4) / N)  # the three clipped tokens
    torch.testing.assert_close(grad, torch.tensor([[-1.2, 0, 0], [0, 0, 0], [-2.4, 0, 0]], dtype=F64) / N)
    assert metrics["cov_selected_tokens"] == 5  # the five unclipped valid tokens
    assert metrics["entropy_balanced_clip_kept_frac"] == pytest.approx(2 / N)


@pytest.mark.parametrize("loss_mode", ["gspo", "aspo", "kl_cov"])
def test_losses_without_a_token_ratio_clip_do_not_take_the_switch(loss_mode):
    assert BALANCED not in POLICY_LOSSES[loss_mode].switches
    with pytest.raises(ArcherError, match=f"policy loss '{loss_mode}' takes no argument {BALANCED}"):
        POLICY_LOSSES[loss_mode].arguments({BALANCED: True})


def test_a_registered_switch_is_passed_when_given_and_off_otherwise():
    @register_policy_loss("test_switched", switches=(BALANCED,))
    def switched(*, old_log_prob, log_prob, advantages, response_mask,
                 enable_entropy_balanced_clipping) -> tuple[torch.Tensor, dict[str, Metric]]:
        return advantages * (2.0 if enable_entropy_balanced_clipping else 1.0), {"n": Total(1.0)}

    ones = torch.ones(1, 2, dtype=F64)
    common = {"old_log_prob": ones, "log_prob": ones, "advantages": ones, "response_mask": ones,
              "loss_agg_mode": "token-sum"}
    try:
        assert compute_policy_loss("test_switched", **common)[0].item() == 2.0
        assert compute_policy_loss("test_switched", **common, **{BALANCED: True})[0].item() == 4.0
    finally:
        del POLICY_LOSSES["test_switched"]


# ---------------------------------------------------------------- entropy-aware advantage
# valid entropies 2.5, 2.5, 1.5 | 0.5, 0.5: mean 1.5, deviations 1, 1, 0, -1, -1, unbiased var 4 / 4 = 1
ENTROPY = torch.tensor([[2.5, 2.5, 1.5, float("nan")], [0.5, 0.5, 7.0, 7.0]], dtype=F64)
ENT_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=F64)
H_HAT = [[1.0, 1.0, 0.0, 0.0], [-1.0, -1.0, 0.0, 0.0]]


def test_standardised_entropy_by_hand_is_zero_outside_the_mask_and_detached():
    entropy = ENTROPY.clone().requires_grad_(True)
    h_hat = standardised_entropy(entropy, ENT_MASK)
    assert not h_hat.requires_grad
    # / sqrt(var + 1e-8): within 1e-8 of the plain standardisation
    torch.testing.assert_close(h_hat, torch.tensor(H_HAT, dtype=F64), rtol=0, atol=1e-8)
    scale = entropy_advantage_scale(entropy, ENT_MASK, 0.2)
    torch.testing.assert_close(scale, torch.tensor([[1.2, 1.2, 1.0, 1.0], [0.8, 0.8, 1.0, 1.0]], dtype=F64),
                               rtol=0, atol=1e-8)


@pytest.mark.parametrize("mask", [[[1, 0, 0, 0], [0, 0, 0, 0]], [[0, 0, 0, 0], [0, 0, 0, 0]]])
def test_fewer_than_two_valid_tokens_leave_the_advantage_as_it_is(mask):
    scale = entropy_advantage_scale(ENTROPY, torch.tensor(mask, dtype=F64), 0.2)
    assert torch.equal(scale, torch.ones_like(ENTROPY))


def test_equal_entropies_leave_the_advantage_as_it_is():
    scale = entropy_advantage_scale(torch.full((2, 4), 0.7, dtype=F64), ENT_MASK, 0.2)
    assert torch.equal(scale, torch.ones(2, 4, dtype=F64))


def test_advantage_scale_metrics_by_hand():
    adv = torch.tensor([[2.0, 2.0, 2.0, 50.0], [-1.0, -1.0, 9.0, 9.0]], dtype=F64)
    scale = entropy_advantage_scale(ENTROPY, ENT_MASK, 0.2)  # 1.2, 1.2, 1.0 | 0.8, 0.8
    values = {k: v.value for k, v in entropy_advantage_metrics(scale, adv, ENT_MASK).items()}
    assert values == pytest.approx({
        "entropy_adv_scale_mean": (2 * 3.4 + 1 * 1.6) / (3 * 2 + 2 * 1),  # sum |A|*s / sum |A| = 1.05
        "entropy_adv_scale_pos": 3.4 / 3,
        "entropy_adv_scale_neg": 0.8,
        "entropy_adv_flipped_frac": 0.0,
    })
    # coefficient 2: the low-entropy row's scale is 1 - 2 = -1, its two tokens' advantages change sign
    flipped = entropy_advantage_metrics(entropy_advantage_scale(ENTROPY, ENT_MASK, 2.0), adv, ENT_MASK)
    assert flipped["entropy_adv_flipped_frac"].value == pytest.approx(2 / 5)
    assert flipped["entropy_adv_scale_neg"].value == pytest.approx(-1.0)
