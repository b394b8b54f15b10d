"""Archer, ASPO, Clip-Cov and KL-Cov policy losses: forward values, gradients w.r.t. log_prob and metrics,
checked against the formulas of docs/algorithms.md on a few hand-computed tokens."""

import math

import pytest
import torch

from archer.algorithms.metric_sums import Mean, Metric
from archer.algorithms.policy_loss import compute_policy_loss
from archer.errors import ArcherError

F64 = torch.float64
OLD = -3.0  # old log-prob of every token; logp = OLD + ln r


def tokens(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(old_log_prob, log_prob requiring grad) with pi/pi_old = ratios."""
    old = torch.full((len(ratios), len(ratios[0])), OLD, dtype=F64)
    return old, (old + torch.tensor(ratios, dtype=F64).log()).requires_grad_(True)


def run(loss_mode: str, ratios, adv, mask=None, **kwargs):
    """(loss, metrics, d loss / d log_prob) of one call with token-mean aggregation."""
    old, new = tokens(ratios)
    adv = torch.tensor(adv, dtype=F64)
    mask = torch.ones_like(adv) if mask is None else torch.tensor(mask, dtype=F64)
    loss, metrics = compute_policy_loss(loss_mode, old_log_prob=old, log_prob=new, advantages=adv,
                                        response_mask=mask, loss_agg_mode="token-mean", **kwargs)
    (grad,) = torch.autograd.grad(loss, new)
    return loss, metrics, grad


def values(metrics: dict[str, Metric]) -> dict[str, float]:
    return {k: v.value for k, v in metrics.items()}


# ---------------------------------------------------------------- Archer: dual-token constraints
# eps 0.2 on low-entropy (L) tokens, 0.5 on high-entropy (H) tokens, dual-clip c = 10; last column of row 1 padded
ARCHER_RATIOS = [[1.3, 1.3, 0.6, 0.6, 1.0], [12.0, 12.0, 4.0, 1.7, 5.0]]
ARCHER_ADV = [[1.0, 1.0, -1.0, -1.0, 0.5], [-1.0, -1.0, -2.0, 1.0, 100.0]]
ARCHER_HIGH = torch.tensor([[False, True, False, True, False], [False, True, False, True, True]])
ARCHER_MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
ARCHER_TOKEN_LOSSES = [
    # A=1 r=1.3 L: max(-1.3, -1.2) = -1.2 (clipped) | H: clip(1.3, 0.5, 1.5) = 1.3 -> -1.3 (not clipped)
    # A=-1 r=0.6 L: max(0.6, 0.8) = 0.8 (clipped)    | H: max(0.6, 0.6) = 0.6 ; A=0.5 r=1: -0.5
    [-1.2, -1.3, 0.8, 0.6, -0.5],
    # A=-1 r=12 (L and H): max(12, 1.2 or 1.5) = 12 -> dual-clip min(12, 10) = 10
    # A=-2 r=4 L: max(8, 2.4) = 8 < 20 ; A=1 r=1.7 H: max(-1.7, -1.5) = -1.5 (clipped)
    [10.0, 10.0, 8.0, -1.5],
]
ARCHER_N = 9
# d/dlogp of -A*r is -A*r where the unclipped term is the one taken, 0 where clip or dual-clip is active
ARCHER_GRAD = [[0.0, -1.3, 0.0, 0.6, -0.5], [0.0, 0.0, 8.0, 0.0, 0.0]]


def archer(clip_ratio_c: float = 10.0):
    return run("archer", ARCHER_RATIOS, ARCHER_ADV, ARCHER_MASK, clip_ratio_c=clip_ratio_c,
               high_entropy_mask=ARCHER_HIGH, low_entropy_clip_ratio_low=0.2, low_entropy_clip_ratio_high=0.2,
               high_entropy_clip_ratio_low=0.5, high_entropy_clip_ratio_high=0.5)


def test_archer_forward_uses_the_clip_range_of_each_entropy_class_and_dual_clip():
    loss, _, _ = archer()
    assert loss.item() == pytest.approx(sum(map(sum, ARCHER_TOKEN_LOSSES)) / ARCHER_N, rel=1e-6)


def test_archer_gradient_is_minus_a_r_over_n_where_unclipped_and_zero_where_clipped():
    _, _, grad = archer()
    assert grad.tolist()[0] == pytest.approx([g / ARCHER_N for g in ARCHER_GRAD[0]], rel=1e-6)
    assert grad.tolist()[1] == pytest.approx([g / ARCHER_N for g in ARCHER_GRAD[1]], rel=1e-6)


def test_archer_metrics_by_hand():
    _, metrics, _ = archer()
    log_ratios = [math.log(r) for row, m in zip(ARCHER_RATIOS, ARCHER_MASK) for r, v in zip(row, m) if v]
    # clipped: (0,0) and (0,2) among the 5 low tokens, (1,3) among the 4 high ones; dual-clip: (1,0), (1,1)
    assert values(metrics) == pytest.approx({
        "pg_clipfrac": 3 / 9, "pg_clipfrac_lower": 2 / 9, "ppo_kl": -sum(log_ratios) / 9,
        "entropy_low_frac": 5 / 9, "entropy_high_frac": 4 / 9,
        "entropy_low_clipfrac": 2 / 5, "entropy_high_clipfrac": 1 / 4,
    }, rel=1e-6)
    assert all(isinstance(m, Mean) and not m.total.requires_grad for m in metrics.values())
    # each class clipfrac is a mean over its own class: 5 low and 4 high tokens
    assert (float(metrics["entropy_low_clipfrac"].count), float(metrics["entropy_high_clipfrac"].count)) == (5, 4)


def test_archer_dual_clip_bound_follows_clip_ratio_c():
    # with c = 3 the two A=-1, r=12 tokens cost 3 and A=-2, r=4 costs min(8, 6) = 6, whose gradient is now 0
    loss, metrics, grad = archer(clip_ratio_c=3.0)
    expected = sum(ARCHER_TOKEN_LOSSES[0]) + 3.0 + 3.0 + 6.0 - 1.5
    assert loss.item() == pytest.approx(expected / ARCHER_N, rel=1e-6)
    assert grad[1, 2].item() == 0.0
    assert metrics["pg_clipfrac_lower"].value == pytest.approx(3 / 9)


def test_archer_float64_inputs_keep_float64_clip_bounds():
    loss, _, _ = run("archer", [[1.3]], [[1.0]], high_entropy_mask=torch.tensor([[False]]), clip_ratio_c=3.0,
                     low_entropy_clip_ratio_low=0.2, low_entropy_clip_ratio_high=0.2)
    assert loss.item() == pytest.approx(-1.2, rel=1e-12, abs=0)


@pytest.mark.parametrize("loss_mode", ["archer", "aspo"])
def test_entropy_split_losses_need_the_high_entropy_mask(loss_mode):
    with pytest.raises(ArcherError, match="called without high_entropy_mask"):
        run(loss_mode, [[1.0]], [[1.0]], clip_ratio_c=3.0)


@pytest.mark.parametrize("loss_mode", ["archer", "aspo"])
def test_entropy_split_losses_reject_a_dual_clip_bound_not_above_one(loss_mode):
    with pytest.raises(ArcherError, match="clip_ratio_c"):
        run(loss_mode, [[1.0]], [[1.0]], high_entropy_mask=torch.tensor([[False]]), clip_ratio_c=1.0)


# ---------------------------------------------------------------- ASPO: asymmetric importance sampling
# eps 0.2 (low-entropy) / 0.4 (high-entropy), soft dual-clip c = 3; logp = -3 + ln r
def logp(r: float) -> float:
    return OLD + math.log(r)


ASPO_CASES = [
    # (name, A, r, high-entropy, forward value, gradient w.r.t. logp)
    ("neg unclipped", -1.0, 1.5, False, 1.5, 1.5),  # r_hat = r: -A*r, grad -A*r
    ("neg unclipped wide", -2.0, 2.5, True, 5.0, 5.0),  # 2.5 <= c: no upper clamp
    ("neg below 1-eps low", -1.0, 0.7, False, 0.8, 0.0),  # r_hat = 0.8: constant
    ("neg 0.7 inside high range", -1.0, 0.7, True, 0.7, 0.7),  # 1-0.4 = 0.6 < 0.7
    ("neg below 1-eps high", -1.0, 0.5, True, 0.6, 0.0),  # r_hat = 0.6
    ("neg soft dual-clip", -1.0, 4.0, False, 3.0 * logp(4.0), 3.0),  # r_hat 4 > 3: -A*c*logp, grad -c*A
    ("neg soft dual-clip high", -0.5, 6.0, True, 1.5 * logp(6.0), 1.5),
    ("pos unclipped", 1.0, 1.1, False, -1 / 1.1, -1 / 1.1),  # flipped: value -A/r, grad -A/r
    ("pos unclipped below one", 2.0, 0.5, False, -4.0, -4.0),  # 1/0.5 = 2 <= c
    ("pos above 1+eps low", 1.0, 1.3, False, -1 / 1.2, 0.0),  # r_hat = 1.2: value -A/1.2, grad 0
    ("pos 1.3 inside high range", 1.0, 1.3, True, -1 / 1.3, -1 / 1.3),
    ("pos above 1+eps high", 1.0, 1.5, True, -1 / 1.4, 0.0),  # r_hat = 1.4
    ("pos soft dual-clip", 1.0, 0.25, False, -3.0 * logp(0.25), -3.0),  # 1/r_hat = 4 > 3: -c*A*logp
    ("pos soft dual-clip high", 0.5, 0.2, True, -1.5 * logp(0.2), -1.5),
]
ASPO_EPS = {"low_entropy_clip_ratio_low": 0.2, "low_entropy_clip_ratio_high": 0.2,
            "high_entropy_clip_ratio_low": 0.4, "high_entropy_clip_ratio_high": 0.4}


def aspo(ratios, adv, high, mask=None):
    return run("aspo", ratios, adv, mask, clip_ratio_c=3.0, high_entropy_mask=torch.tensor(high), **ASPO_EPS)


@pytest.mark.parametrize(("adv", "ratio", "high", "value", "grad"), [c[1:] for c in ASPO_CASES],
                         ids=[c[0] for c in ASPO_CASES])
def test_aspo_single_token_value_and_gradient(adv, ratio, high, value, grad):
    loss, _, g = aspo([[ratio]], [[adv]], [[high]])
    assert loss.item() == pytest.approx(value, rel=1e-6)
    assert g.item() == pytest.approx(grad, rel=1e-6, abs=1e-12)


def test_aspo_token_mean_over_all_cases_divides_values_and_gradients_by_n():
    n = len(ASPO_CASES)
    # one row of all cases plus a padded token whose garbage must not count
    ratios = [[c[2] for c in ASPO_CASES] + [9.0]]
    adv = [[c[1] for c in ASPO_CASES] + [-50.0]]
    high = [[c[3] for c in ASPO_CASES] + [True]]
    mask = [[1] * n + [0]]
    loss, metrics, grad = aspo(ratios, adv, high, mask)
    assert loss.item() == pytest.approx(sum(c[4] for c in ASPO_CASES) / n, rel=1e-6)
    assert grad[0].tolist() == pytest.approx([c[5] / n for c in ASPO_CASES] + [0.0], rel=1e-6, abs=1e-12)
    clipped = {"neg below 1-eps low", "neg below 1-eps high", "pos above 1+eps low", "pos above 1+eps high"}
    soft = {c[0] for c in ASPO_CASES if "soft" in c[0]}
    high_names = {c[0] for c in ASPO_CASES if c[3]}
    assert values(metrics) == pytest.approx({
        "pg_clipfrac": len(clipped) / n, "pg_clipfrac_lower": len(soft) / n,
        "ppo_kl": -sum(math.log(c[2]) for c in ASPO_CASES) / n,
        "entropy_low_frac": (n - len(high_names)) / n, "entropy_high_frac": len(high_names) / n,
        "entropy_low_clipfrac": len(clipped - high_names) / (n - len(high_names)),
        "entropy_high_clipfrac": len(clipped & high_names) / len(high_names),
    }, rel=1e-6)


# ---------------------------------------------------------------- Clip-Cov
# six valid tokens + one padded; A = 2, 2, -2, -2, 1, -1 (mean 0), logp = -1, -0.5, -3.5, -4, -1.5, -1.5 (mean -2)
# cov = A * (logp + 2) = 2, 3, 3, 4, 0.5, -0.5: tokens 0-3 lie in the window (1, 5)
COV_ADV = [[2.0, 2.0, -2.0, -2.0, 1.0, -1.0, 80.0]]
COV_LOGP = [-1.0, -0.5, -3.5, -4.0, -1.5, -1.5, 2.0]
# token 1 (A>0, r=1.5 > 1.2) is clipped by PPO, so never a Clip-Cov candidate; the others are not clipped
COV_RATIOS = [1.1, 1.5, 0.9, 1.0, 0.7, 1.3, 3.0]
COV_MASK = [[1, 1, 1, 1, 1, 1, 0]]
# PPO-clip gradient / 6: -A*r where unclipped, 0 for the clipped token 1 and the padded one
PPO_GRAD = [-2.2 / 6, 0.0, 1.8 / 6, 2.0 / 6, -0.7 / 6, 1.3 / 6, 0.0]


def clip_cov(ratio: float, seed: int):
    """One Clip-Cov call with torch's global generator seeded by `seed` (as the trainer seeds it)."""
    old = torch.tensor([[lp - math.log(r) for lp, r in zip(COV_LOGP, COV_RATIOS)]], dtype=F64)
    new = torch.tensor([COV_LOGP], dtype=F64, requires_grad=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loss, metrics = compute_policy_loss(
            "clip_cov", old_log_prob=old, log_prob=new, advantages=torch.tensor(COV_ADV, dtype=F64),
            response_mask=torch.tensor(COV_MASK, dtype=F64), clip_ratio_low=0.2, clip_ratio_high=0.2,
            clip_cov_ratio=ratio, clip_cov_lb=1.0, clip_cov_ub=5.0)
    (grad,) = torch.autograd.grad(loss, new)
    return loss, metrics, grad[0].tolist()


@pytest.mark.parametrize("seed", range(8))
def test_clip_cov_zeroes_the_gradient_of_selected_tokens_only(seed):
    _, metrics, grad = clip_cov(0.4, seed)  # int(0.4 * 6) = 2 of the candidates 0, 2, 3
    cut = [i for i in (0, 2, 3) if grad[i] == 0.0]
    assert len(cut) == 2
    assert metrics["cov_selected_tokens"].value == 2
    expected = [0.0 if i in cut else g for i, g in enumerate(PPO_GRAD)]
    assert grad == pytest.approx(expected, rel=1e-12)


def test_clip_cov_selection_is_reproducible_with_a_seeded_global_generator():
    grads = [clip_cov(0.2, seed)[2] for seed in range(12)]  # int(1.2) = 1 token cut
    assert clip_cov(0.2, 5)[2] == grads[5]
    cut_sets = {tuple(i for i in (0, 2, 3) if g[i] == 0.0) for g in grads}
    assert all(len(c) == 1 for c in cut_sets)
    assert len(cut_sets) > 1  # the draw depends on the seed


def test_clip_cov_never_selects_an_already_clipped_token():
    # ratio 1: every candidate is cut; token 1 (cov 3, in the window) keeps its (zero) clipped gradient,
    # and tokens 4, 5 (outside the window) keep their PPO gradient
    loss, metrics, grad = clip_cov(1.0, 0)
    assert metrics["cov_selected_tokens"].value == 3
    assert grad == pytest.approx([0.0, 0.0, 0.0, 0.0, PPO_GRAD[4], PPO_GRAD[5], 0.0], rel=1e-12)
    assert metrics["pg_clipfrac"].value == pytest.approx(1 / 6)


# ---------------------------------------------------------------- KL-Cov
# four valid tokens + one padded; A = 1, -1, 2, -2 (mean 0), logp = -1, -3, -0.5, -2.5 (mean -1.75)
# cov = A * (logp + 1.75) = 0.75, 1.25, 2.5, 1.5: the top two are tokens 2 and 3
KL_ADV = [[1.0, -1.0, 2.0, -2.0, 50.0]]
KL_LOGP = [-1.0, -3.0, -0.5, -2.5, 10.0]
KL_RATIOS = [2.0, 0.3, 1.5, 0.5, 4.0]  # far outside any clip range: KL-Cov does not clip


def kl_cov(ratio: float, coef: float):
    old = torch.tensor([[lp - math.log(r) for lp, r in zip(KL_LOGP, KL_RATIOS)]], dtype=F64)
    new = torch.tensor([KL_LOGP], dtype=F64, requires_grad=True)
    loss, metrics = compute_policy_loss(
        "kl_cov", old_log_prob=old, log_prob=new, advantages=torch.tensor(KL_ADV, dtype=F64),
        response_mask=torch.tensor([[1, 1, 1, 1, 0]], dtype=F64), kl_cov_ratio=ratio, ppo_kl_coef=coef)
    (grad,) = torch.autograd.grad(loss, new)
    return loss, metrics, grad[0].tolist()


@pytest.mark.parametrize("coef", [1.0, 0.5])
def test_kl_cov_value_adds_the_kl_term_only_on_the_largest_covariance_tokens(coef):
    loss, metrics, _ = kl_cov(0.5, coef)  # int(0.5 * 4) = 2 tokens: 2 and 3
    unclipped = -2.0 + 0.3 - 3.0 + 1.0  # -A*r of every valid token
    assert loss.item() == pytest.approx((unclipped + coef * (math.log(1.5) + math.log(2.0))) / 4, rel=1e-12)
    assert metrics["cov_selected_tokens"].value == 2
    assert metrics["pg_clipfrac"].value == 0.0


@pytest.mark.parametrize("coef", [1.0, 0.5])
def test_kl_cov_gradient_is_unclipped_minus_a_r_plus_coef_sign_on_selected(coef):
    _, _, grad = kl_cov(0.5, coef)
    # unselected: -A*r even at r = 2 and 0.3 ; selected: -A*r + coef * sign(logp - old)
    expected = [-2.0 / 4, 0.3 / 4, (-3.0 + coef) / 4, (1.0 - coef) / 4, 0.0]
    assert grad == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_kl_cov_selects_at_least_one_token():
    loss, metrics, grad = kl_cov(0.0002, 1.0)  # max(1, int(0.0008)) = 1: token 2 (cov 2.5)
    assert metrics["cov_selected_tokens"].value == 1
    assert loss.item() == pytest.approx((-2.0 + 0.3 - 3.0 + 1.0 + math.log(1.5)) / 4, rel=1e-12)
    assert grad[3] == pytest.approx(1.0 / 4, rel=1e-12)


# ---------------------------------------------------------------- asymmetric clip ranges per entropy class
# clip_ratio_low != clip_ratio_high in both classes: low-entropy (L) tokens eps 0.1 below / 0.3 above, high-entropy
# (H) tokens 0.4 below / 0.6 above, so that swapping a class's low and high bound changes every token below.
ASYMMETRIC = {"low_entropy_clip_ratio_low": 0.1, "low_entropy_clip_ratio_high": 0.3,
              "high_entropy_clip_ratio_low": 0.4, "high_entropy_clip_ratio_high": 0.6}
# (A, r, high-entropy) of five tokens, one per row
ASYMMETRIC_TOKENS = [(-1.0, 0.85, False), (1.0, 1.25, False), (-1.0, 0.55, True), (1.0, 1.5, True), (1.0, 1.35, False)]


def asymmetric(loss_mode: str, clip_ratio_c: float):
    adv, ratios, high = ([[token[i]] for token in ASYMMETRIC_TOKENS] for i in range(3))
    return run(loss_mode, ratios, adv, clip_ratio_c=clip_ratio_c, high_entropy_mask=torch.tensor(high), **ASYMMETRIC)


def test_archer_takes_each_classes_lower_and_upper_bound_apart():
    # L A=-1 r=0.85: max(0.85, 1-0.1=0.9) = 0.9 (clipped) | L A=1 r=1.25 < 1+0.3: -1.25
    # H A=-1 r=0.55: max(0.55, 1-0.4=0.6) = 0.6 (clipped) | H A=1 r=1.5 < 1+0.6: -1.5
    # L A=1 r=1.35 > 1.3: -1.3 (clipped); the dual-clip bound -A*c = 10 is never reached
    loss, metrics, grad = asymmetric("archer", clip_ratio_c=10.0)
    assert loss.item() == pytest.approx((0.9 - 1.25 + 0.6 - 1.5 - 1.3) / 5, rel=1e-12)
    assert grad.flatten().tolist() == pytest.approx([0.0, -1.25 / 5, 0.0, -1.5 / 5, 0.0], abs=1e-12)
    assert values(metrics)["pg_clipfrac"] == pytest.approx(3 / 5)


def test_aspo_takes_each_classes_lower_and_upper_bound_apart():
    # A < 0: r_hat = max(r, 1-eps_l), loss -A*r_hat, gradient -A*r unless clamped
    #   L r=0.85 -> 0.9 (clamped, gradient 0) | H r=0.55 -> 0.6 (clamped)
    # A > 0: r_hat = min(r, 1+eps_h), value -A/r_hat, gradient -A/r unless clamped
    #   L r=1.25 < 1.3: -0.8, gradient -0.8 | H r=1.5 < 1.6: -1/1.5 | L r=1.35 -> 1.3: -1/1.3, gradient 0
    loss, metrics, grad = asymmetric("aspo", clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((0.9 - 0.8 + 0.6 - 1 / 1.5 - 1 / 1.3) / 5, rel=1e-12)
    assert grad.flatten().tolist() == pytest.approx([0.0, -0.8 / 5, 0.0, -1 / 1.5 / 5, 0.0], abs=1e-12)
    assert values(metrics)["pg_clipfrac"] == pytest.approx(3 / 5)


def test_clip_cov_takes_its_lower_and_upper_bound_apart():
    # clip_ratio_low 0.1, clip_ratio_high 0.3 (swapping them changes the first two tokens); the covariance window
    # (100, 200) holds no token, so nothing is cut and the loss is PPO clip's
    #   A=-1 r=0.85: max(0.85, 0.9) = 0.9 (clipped) | A=1 r=1.25 < 1.3: -1.25 | A=1 r=1.35 -> -1.3 (clipped)
    #   A=-1 r=0.95 > 0.9: 0.95
    loss, metrics, grad = run("clip_cov", [[0.85, 1.25, 1.35, 0.95]], [[-1.0, 1.0, 1.0, -1.0]],
                              clip_ratio_low=0.1, clip_ratio_high=0.3, clip_cov_ratio=1.0, clip_cov_lb=100.0,
                              clip_cov_ub=200.0)
    assert loss.item() == pytest.approx((0.9 - 1.25 - 1.3 + 0.95) / 4, rel=1e-12)
    assert grad.flatten().tolist() == pytest.approx([0.0, -1.25 / 4, 0.0, 0.95 / 4], abs=1e-12)
    assert values(metrics) == pytest.approx({"pg_clipfrac": 2 / 4, "pg_clipfrac_lower": 0.0,
                                             "ppo_kl": -math.log(0.85 * 1.25 * 1.35 * 0.95) / 4,
                                             "cov_selected_tokens": 0.0}, rel=1e-12)
