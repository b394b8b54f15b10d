"""verl's rollout correction (archer/algorithms/rollout_correction.py) against hand computations: token and
sequence IS (TIS, IcePop, batch normalisation), the rejection options, the diagnostics, the settings' checks
(archer/workers/rollout_correction_config.py), and the policy losses in the decoupled mode (AReaL's decoupled
PPO) and the bypass mode (PPO clip, REINFORCE).

Two responses of 3 and 2 tokens; the ratios r = pi_train / pi_rollout are 3, 1, 0.4 and 0.25, 1.5 (no value on
a threshold, so no comparison depends on rounding).
"""

import math

import pytest
import torch
from omegaconf import OmegaConf

from archer.algorithms.metric_sums import MetricSums
from archer.algorithms.policy_loss import BYPASS_LOSS_TYPES, compute_policy_loss, register_policy_loss
from archer.algorithms.rollout_correction import (
    REJECTION_OPTIONS,
    RolloutCorrection,
    correct,
    register_rejection_option,
)
from archer.errors import ArcherError
from archer.workers.rollout_correction_config import read_rollout_correction

F64 = torch.float64
RATIOS = [[3.0, 1.0, 0.4], [0.25, 1.5, 1.0]]  # the last entry is padding
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
TRAIN = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, 0.0]], dtype=F64)
LOG_R = torch.tensor(RATIOS, dtype=F64).log()
ROLLOUT = TRAIN - LOG_R


def settings(**values) -> RolloutCorrection:
    base = {"rollout_is": None, "rollout_is_threshold": "2.0", "rollout_is_batch_normalize": False,
            "rollout_rs": None, "rollout_rs_threshold": None, "bypass_mode": False, "loss_type": "ppo_clip"}
    return read_rollout_correction(OmegaConf.create({**base, **values}))


def values(metrics) -> dict[str, float]:
    return {name.removeprefix("rollout_corr/"): metric.value for name, metric in metrics.items()}


def run(**config):
    result = correct(TRAIN, ROLLOUT, MASK, settings(**config))
    return result, values(result.metrics)


# ---------------------------------------------------------------- IS weights
def test_token_is_truncates_each_token_and_reports_verls_statistics():
    result, m = run(rollout_is="token", rollout_is_threshold=2.0)
    # raw 3, 1, 0.4 | 0.25, 1.5 -> truncated at 2; padding 0
    torch.testing.assert_close(result.weights, torch.tensor([[2.0, 1.0, 0.4], [0.25, 1.5, 0.0]], dtype=F64))
    assert torch.equal(result.mask, MASK), "no rejection configured"
    assert m["rollout_is_mean"] == pytest.approx(5.15 / 5)
    assert (m["rollout_is_max"], m["rollout_is_min"]) == pytest.approx((2.0, 0.25))  # of the truncated weights
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # raw 3 > 2
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(2 / 5)  # raw 0.4, 0.25 < 1 / 2
    mean_sq = (4 + 1 + 0.16 + 0.0625 + 2.25) / 5
    assert m["rollout_is_std"] == pytest.approx(math.sqrt(mean_sq - 1.03 ** 2))
    assert m["rollout_is_eff_sample_size"] == pytest.approx((1.03 + 1e-8) ** 2 / mean_sq)
    row0, row1 = 3.4 / 3, 1.75 / 2  # each response's mean weight
    assert m["rollout_is_seq_mean"] == pytest.approx((row0 + row1) / 2)
    assert m["rollout_is_seq_std"] == pytest.approx(abs(row0 - row1) / math.sqrt(2))  # Bessel-corrected
    assert (m["rollout_is_seq_max"], m["rollout_is_seq_min"]) == pytest.approx((row0, row1))
    assert m["rollout_is_seq_max_deviation"] == pytest.approx(row0 - 1)
    # raw means 4.4 / 3 and 0.875: neither above 2 nor below 0.5
    assert (m["rollout_is_seq_fraction_high"], m["rollout_is_seq_fraction_low"]) == (0.0, 0.0)


def test_sequence_is_puts_the_product_on_every_token_and_takes_extremes_before_truncation():
    result, m = run(rollout_is="sequence", rollout_is_threshold=1.2)
    # products 3 * 1 * 0.4 = 1.2... exactly: log-sum ln 1.2 -> weight 1.2 (at the bound); 0.25 * 1.5 = 0.375
    torch.testing.assert_close(result.weights, torch.tensor([[1.2, 1.2, 1.2], [0.375, 0.375, 0.0]], dtype=F64))
    assert m["rollout_is_mean"] == pytest.approx((3 * 1.2 + 2 * 0.375) / 5)
    assert (m["rollout_is_max"], m["rollout_is_min"]) == pytest.approx((1.2, 0.375))
    result, m = run(rollout_is="sequence", rollout_is_threshold=1.1)
    assert result.weights[0].tolist() == pytest.approx([1.1, 1.1, 1.1])
    assert m["rollout_is_max"] == pytest.approx(1.2), "from the unclamped log ratios, as verl"
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 2)  # per response: 1.2 > 1.1
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 2)  # 0.375 < 1 / 1.1
    mean = (3 * 1.1 + 2 * 0.375) / 5
    mean_sq = (3 * 1.21 + 2 * 0.140625) / 5
    assert m["rollout_is_std"] == pytest.approx(math.sqrt(mean_sq - mean ** 2))
    assert m["rollout_is_eff_sample_size"] == pytest.approx((mean + 1e-8) ** 2 / mean_sq)


def test_icepop_zeroes_the_weights_outside_its_bounds():
    result, m = run(rollout_is="token", rollout_is_threshold="0.5_2.0")
    torch.testing.assert_close(result.weights, torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.5, 0.0]], dtype=F64))
    assert m["rollout_is_oob_ratio"] == pytest.approx(3 / 5)
    assert m["rollout_is_mean"] == pytest.approx(2.5 / 5)
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(2 / 5)  # below the given lower bound 0.5
    assert torch.equal(result.mask, MASK), "IcePop changes weights, never the mask"


@pytest.mark.parametrize("level, factor", [("token", 5.15 / 5), ("sequence", (1.2 + 0.375) / 2)])
def test_batch_normalisation_divides_by_the_mean_weight(level, factor):
    threshold = 2.0 if level == "token" else 1.5
    plain, _ = run(rollout_is=level, rollout_is_threshold=threshold)
    normalised, m = run(rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=True)
    torch.testing.assert_close(normalised.weights, plain.weights / factor)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(factor)
    assert m["rollout_is_mean"] == pytest.approx(values(plain.metrics)["rollout_is_mean"]), "taken before"


# ---------------------------------------------------------------- rejection
def test_token_k1_bounds_apply_to_the_rollout_over_train_ratio():
    # k1 = -log r = log(pi_rollout / pi_train): 1 / r = 1/3, 1, 2.5 | 4, 2/3 within [0.2, 2.0]? (bounds on 1 / r)
    result, m = run(rollout_rs="token_k1", rollout_rs_threshold="0.2_2.0")
    assert result.mask.tolist() == [[1, 1, 0], [0, 1, 0]]
    assert m["rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    assert m["rollout_rs_token_k1_masked_fraction"] == pytest.approx(2 / 5)
    k1 = [-math.log(r) for r in (3.0, 1.0, 0.4, 0.25, 1.5)]
    assert m["rollout_rs_token_k1_mean"] == pytest.approx(sum(k1) / 5)
    assert (m["rollout_rs_token_k1_max"], m["rollout_rs_token_k1_min"]) == pytest.approx((math.log(4), -math.log(3)))
    assert m["rollout_rs_token_k1_fraction_high"] == pytest.approx(2 / 5)  # log 2.5, log 4 > log 2
    assert m["rollout_rs_token_k1_fraction_low"] == 0.0  # none below log 0.2
    # a single number is the upper bound, its reciprocal the lower: 1 / r within [0.5, 2]
    result, _ = run(rollout_rs="token_k1", rollout_rs_threshold=2.0)
    assert result.mask.tolist() == [[0, 1, 0], [0, 1, 0]]


def test_sequence_options_reject_whole_responses():
    # seq_max_k2: max 0.5 (log r)^2 = 0.5 ln^2 3 = 0.603 | 0.5 ln^2 4 = 0.961 -> the second is above 0.7
    result, m = run(rollout_rs="seq_max_k2", rollout_rs_threshold=0.7)
    assert result.mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert m["rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    row0, row1 = 0.5 * math.log(3) ** 2, 0.5 * math.log(4) ** 2
    assert m["rollout_rs_seq_max_k2_mean"] == pytest.approx((3 * row0 + 2 * row1) / 5)  # token-weighted
    assert m["rollout_rs_seq_max_k2_max"] == pytest.approx(row1)
    assert m["rollout_rs_seq_max_k2_seq_mean"] == pytest.approx((row0 + row1) / 2)
    assert m["rollout_rs_seq_max_k2_fraction_high"] == pytest.approx(1 / 2)
    assert "rollout_rs_seq_max_k2_seq_fraction_low" not in m, "one-sided"
    # geometric (seq_mean_k1): mean -log r = -ln(1.2) / 3 | -ln(0.375) / 2 = 0.49 -> outside [ln 0.8, ln 1.25]
    result, m = run(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.8_1.25")
    assert result.mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert m["rollout_rs_seq_mean_k1_seq_fraction_low"] == 0.0
    # seq_sum_k3: sums of r - 1 - log r are 1.22 | 0.73 -> the first is above 1.0
    k3 = [r - 1 - math.log(r) for r in (3.0, 1.0, 0.4, 0.25, 1.5)]
    result, m = run(rollout_rs="seq_sum_k3", rollout_rs_threshold=1.0)
    assert sum(k3[3:]) < 1.0 < sum(k3[:3])
    assert result.mask.tolist() == [[0, 0, 0], [1, 1, 0]]
    assert m["rollout_rs_seq_sum_k3_seq_max"] == pytest.approx(sum(k3[:3]))
    assert m["rollout_rs_seq_sum_k3_seq_min"] == pytest.approx(sum(k3[3:]))


def test_every_option_must_pass_and_thresholds_go_in_order():
    result, m = run(rollout_rs="token_k2,seq_mean_k1", rollout_rs_threshold="0.5,0.8_1.25")
    # token_k2 <= 0.5: rejects 0.5 ln^2 3 = 0.60 and 0.5 ln^2 4 = 0.96; seq_mean_k1 rejects the second response
    assert result.mask.tolist() == [[0, 1, 1], [0, 0, 0]]
    assert m["rollout_rs_token_k2_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_rs_seq_mean_k1_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(3 / 5)


# ---------------------------------------------------------------- diagnostics
def test_offpolicy_diagnostics_by_hand():
    _, m = run()
    train_means = [-3.5 / 3, -1.7 / 2]
    rollout_means = [(-3.5 - math.log(1.2)) / 3, (-1.7 - math.log(0.375)) / 2]
    assert m["training_log_ppl"] == pytest.approx(-sum(train_means) / 2)
    assert m["training_ppl"] == pytest.approx(sum(math.exp(-x) for x in train_means) / 2)
    assert m["rollout_ppl"] == pytest.approx(sum(math.exp(-x) for x in rollout_means) / 2)
    assert m["kl"] == pytest.approx(-math.log(3 * 0.4 * 0.25 * 1.5) / 5)
    assert m["k3_kl"] == pytest.approx(sum(r - math.log(r) - 1 for r in (3.0, 1.0, 0.4, 0.25, 1.5)) / 5)
    diffs = [r - t for r, t in zip(rollout_means, train_means, strict=True)]
    assert m["log_ppl_diff"] == pytest.approx(sum(diffs) / 2)
    assert m["log_ppl_abs_diff"] == pytest.approx(sum(map(abs, diffs)) / 2)
    assert (m["log_ppl_diff_max"], m["log_ppl_diff_min"]) == pytest.approx((max(diffs), min(diffs)))
    assert m["ppl_ratio"] == pytest.approx(sum(map(math.exp, diffs)) / 2)
    assert m["chi2_token"] == pytest.approx((9 + 1 + 0.16 + 0.0625 + 2.25) / 5 - 1)
    assert m["chi2_seq"] == pytest.approx((1.2 ** 2 + 0.375 ** 2) / 2 - 1)
    assert not any(k.startswith(("rollout_is", "rollout_rs")) for k in m), "diagnostics only"


def test_metrics_of_micro_batches_add_up_to_the_whole_batch():
    config = settings(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_max_k2",
                      rollout_rs_threshold="0.2_2.0,0.7")
    whole = values(correct(TRAIN, ROLLOUT, MASK, config).metrics)
    sums = MetricSums()
    for rows in (slice(0, 1), slice(1, 2)):
        sums.add(correct(TRAIN[rows], ROLLOUT[rows], MASK[rows], config).metrics)
    parts = {name.removeprefix("rollout_corr/"): value for name, value in sums.result().items()}
    assert parts.keys() == whole.keys()
    for name, value in whole.items():
        assert parts[name] == pytest.approx(value, abs=1e-12), name


# ---------------------------------------------------------------- settings
@pytest.mark.parametrize("config, message", [
    ({"rollout_is": "geometric"}, "unknown rollout IS level 'geometric'"),
    ({"rollout_is": "token", "rollout_is_threshold": None}, "needs algorithm.rollout_correction.rollout_is_threshold"),
    ({"rollout_is_threshold": "2.0_0.5"}, "the lower bound is above the upper bound"),
    ({"rollout_is_threshold": -1.0}, "must be a positive number"),
    ({"rollout_rs": "token_k1"}, "needs algorithm.rollout_correction.rollout_rs_threshold"),
    ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0}, "unknown rollout rejection option 'seq_max_k1'"),
    ({"rollout_rs": "seq_max_k2", "rollout_rs_threshold": "0.5_2.0"}, "seq_max_k2 takes an upper bound only"),
    ({"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "1,2,3"}, "has 3 entries for 2 options"),
    ({"loss_type": "reinforce"}, "applies in the bypass mode only"),
    ({"loss_type": "pg", "bypass_mode": True}, "unknown algorithm.rollout_correction.loss_type 'pg'"),
])
def test_bad_settings_are_one_clear_error(config, message):
    with pytest.raises(ArcherError, match=message):
        settings(**config)


def test_a_rejection_option_is_checked_when_registered():
    with pytest.raises(ArcherError, match="a maximum takes an upper bound only"):
        register_rejection_option("seq_max", "k1")
    with pytest.raises(ArcherError, match="unknown part"):
        register_rejection_option("seq_median", "k2")
    with pytest.raises(ArcherError, match="registered twice"):
        register_rejection_option("token", "k1")
    assert len(REJECTION_OPTIONS) == 11


def test_a_loss_that_takes_the_is_weights_itself_is_refused():
    """compute_policy_loss applies the weights once for every loss: a loss that takes them would apply them twice."""
    def weighting(*, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights):
        return advantages * rollout_is_weights, {}

    with pytest.raises(ArcherError, match="does not match its declaration"):
        register_policy_loss("test_weighting", registry=BYPASS_LOSS_TYPES)(weighting)
    assert "test_weighting" not in BYPASS_LOSS_TYPES


def test_reinforce_replaces_only_the_vanilla_loss():
    bypass = settings(bypass_mode=True, loss_type="reinforce")
    assert bypass.policy_loss("vanilla").name == "reinforce"
    with pytest.raises(ArcherError, match="loss_mode=archer asks for another"):
        bypass.policy_loss("archer")
    assert settings(bypass_mode=True).policy_loss("archer").name == "archer", "ppo_clip keeps the configured loss"


# ---------------------------------------------------------------- the losses
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}


def test_decoupled_ppo_is_the_clipped_proximal_ratio_times_the_truncated_behaviour_weight():
    """AReaL's decoupled PPO: L_t = min(pi_prox / pi_behav, C) * max(-A r_t, -A clip(r_t)), r_t = pi_theta / pi_prox."""
    prox = torch.full((1, 3), -1.0, dtype=F64)
    behaviour = prox - torch.tensor([[3.0, 1.0, 0.4]], dtype=F64).log()  # pi_prox / pi_behav = 3, 1, 0.4
    current = (prox + torch.tensor([[1.5, 1.1, 0.5]], dtype=F64).log()).requires_grad_(True)  # r = 1.5, 1.1, 0.5
    mask, adv = torch.ones(1, 3, dtype=F64), torch.ones(1, 3, dtype=F64)
    weights = correct(prox, behaviour, mask, settings(rollout_is="token", rollout_is_threshold=2.0)).weights
    loss, metrics = compute_policy_loss("vanilla", old_log_prob=prox, log_prob=current, advantages=adv,
                                        response_mask=mask, rollout_is_weights=weights, **CLIP)
    # PPO per token -1.2 (clipped), -1.1, -0.5; weights 2, 1, 0.4
    assert loss.item() == pytest.approx((2 * -1.2 + 1 * -1.1 + 0.4 * -0.5) / 3)
    loss.backward()
    # d/dlogp: clipped token 0; else -A * r * w / 3
    torch.testing.assert_close(current.grad, torch.tensor([[0.0, -1.1 / 3, -0.2 / 3]], dtype=F64))
    assert metrics["pg_clipfrac"].value == pytest.approx(1 / 3), "the clip statistics ignore the weights"


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "archer", "aspo", "kl_cov", "clip_cov"])
def test_every_loss_scales_its_token_losses_by_the_weights(loss_mode):
    old = torch.full((2, 3), -1.0, dtype=F64)
    new = old + torch.tensor([[0.1, -0.2, 0.05], [0.3, 0.0, -0.1]], dtype=F64)
    adv, mask = torch.tensor([[1.0], [-1.0]], dtype=F64).expand(2, 3), torch.ones(2, 3, dtype=F64)
    needs = {"vanilla": CLIP, "gspo": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}, "kl_cov": {},
             "clip_cov": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2},
             "archer": {"clip_ratio_c": 3.0, "high_entropy_mask": torch.zeros(2, 3, dtype=torch.bool)},
             "aspo": {"clip_ratio_c": 3.0, "high_entropy_mask": torch.zeros(2, 3, dtype=torch.bool)}}[loss_mode]
    common = {"old_log_prob": old, "log_prob": new, "advantages": adv, "response_mask": mask,
              "loss_agg_mode": "token-sum", **needs}
    torch.manual_seed(0)  # clip_cov draws its tokens
    plain, _ = compute_policy_loss(loss_mode, **common)
    torch.manual_seed(0)
    doubled, _ = compute_policy_loss(loss_mode, **common, rollout_is_weights=torch.full((2, 3), 2.0, dtype=F64))
    torch.manual_seed(0)
    ones, _ = compute_policy_loss(loss_mode, **common, rollout_is_weights=torch.ones(2, 3, dtype=F64))
    assert doubled.item() == pytest.approx(2 * plain.item()) and plain.item() != 0
    assert ones.item() == plain.item()


def test_bypass_reinforce_is_the_weighted_log_likelihood_gradient():
    rollout = torch.full((1, 3), -1.0, dtype=F64)
    current = (rollout + torch.tensor([[3.0, 1.0, 0.4]], dtype=F64).log()).requires_grad_(True)
    mask, adv = torch.ones(1, 3, dtype=F64), torch.tensor([[2.0, 2.0, 2.0]], dtype=F64)
    config = settings(rollout_is="token", rollout_is_threshold=2.0, bypass_mode=True, loss_type="reinforce")
    weights = correct(current, rollout, mask, config).weights  # pi_theta / pi_rollout, truncated at 2
    loss, metrics = compute_policy_loss(config.policy_loss("vanilla"), old_log_prob=rollout, log_prob=current,
                                        advantages=adv, response_mask=mask, rollout_is_weights=weights)
    logp = current.detach()[0].tolist()
    assert loss.item() == pytest.approx(-2 * (2 * logp[0] + 1 * logp[1] + 0.4 * logp[2]) / 3)
    loss.backward()
    torch.testing.assert_close(current.grad, torch.tensor([[-4.0 / 3, -2.0 / 3, -0.8 / 3]], dtype=F64))
    assert metrics["ppo_kl"].value == pytest.approx(-math.log(3 * 1 * 0.4) / 3)
    assert not weights.requires_grad
