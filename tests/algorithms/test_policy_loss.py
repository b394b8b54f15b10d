import math

import pytest
import torch

from archer.algorithms.metric_sums import Mean, Total
from archer.algorithms.policy_loss import POLICY_LOSSES, compute_policy_loss, register_policy_loss
from archer.errors import ArcherError

CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}  # verl's defaults

# ratios r = pi / pi_old chosen to hit every branch of PPO clip with eps = 0.2 and dual-clip c = 3
RATIOS = [[1.5, 1.1, 0.5], [0.5, 1.1, 5.0]]
ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
# A>0: r=1.5 -> clipped -1.2 ; r=1.1 -> -1.1 ; r=0.5 -> max(-0.5, -0.8) = -0.5 (unclipped)
# A<0: r=0.5 -> max(0.5, 0.8) = 0.8 (clipped) ; r=1.1 -> 1.1 ; r=5 -> max(5, 1.2) = 5 -> dual-clip min(5, 3) = 3
TOKEN_LOSSES = [[-1.2, -1.1, -0.5], [0.8, 1.1, 3.0]]


def log_probs(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full((len(ratios), len(ratios[0])), -1.0, dtype=torch.float64)
    new = old + torch.tensor(ratios, dtype=torch.float64).log()
    return old, new.requires_grad_(True)


def vanilla(ratios=RATIOS, adv=ADV, mask=None, **kwargs):
    old, new = log_probs(ratios)
    mask = torch.ones_like(adv) if mask is None else mask
    loss, metrics = compute_policy_loss(
        "vanilla", old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, **{**CLIP, **kwargs}
    )
    return loss, metrics, new


def test_ppo_clip_both_sides_and_dual_clip_by_hand():
    loss, metrics, _ = vanilla()
    assert loss.item() == pytest.approx(sum(map(sum, TOKEN_LOSSES)) / 6)
    assert metrics["pg_clipfrac"].value == pytest.approx(2 / 6)
    assert metrics["pg_clipfrac_lower"].value == pytest.approx(1 / 6)
    expected_kl = -sum(math.log(r) for row in RATIOS for r in row) / 6
    assert metrics["ppo_kl"].value == pytest.approx(expected_kl)
    # each metric is a mean over the 6 valid tokens, declared as such, and detached
    assert all(isinstance(m, Mean) and float(m.count) == 6 for m in metrics.values())
    assert not any(m.total.requires_grad for m in metrics.values())


def test_masked_tokens_count_neither_in_loss_nor_in_metrics():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    loss, metrics, _ = vanilla(mask=mask)
    assert loss.item() == pytest.approx((-1.2 - 1.1 - 0.5 + 0.8 + 1.1) / 5)
    assert metrics["pg_clipfrac"].value == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"].value == 0.0


def test_clip_higher_and_a_larger_dual_clip_bound():
    loss, metrics, _ = vanilla(clip_ratio_high=0.28, clip_ratio_c=10.0)
    assert loss.item() == pytest.approx((-1.28 - 1.1 - 0.5 + 0.8 + 1.1 + 5.0) / 6)
    assert metrics["pg_clipfrac_lower"].value == 0.0


def test_gradient_is_minus_a_r_over_num_tokens_where_unclipped_and_zero_where_clipped():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    loss, _, new = vanilla(mask=mask)
    loss.backward()
    expected = torch.tensor([[0.0, -1.1 / 5, -0.5 / 5], [0.0, 1.1 / 5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(new.grad, expected)


def test_log_ratio_is_clamped_to_20_before_exp():
    old = torch.zeros(1, 1, dtype=torch.float64)
    adv = -torch.ones(1, 1, dtype=torch.float64)
    loss, _ = compute_policy_loss(
        "vanilla",
        old_log_prob=old,
        log_prob=old + 30.0,
        advantages=adv,
        response_mask=torch.ones(1, 1),
        **{**CLIP, "clip_ratio_c": 1e12},
    )
    assert loss.item() == pytest.approx(math.exp(20.0))


def test_dual_clip_bound_must_exceed_one():
    with pytest.raises(ArcherError, match="clip_ratio_c must be greater than 1.0"):
        vanilla(clip_ratio_c=1.0)


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_gspo_uses_the_sequence_ratio_and_aggregates_per_sequence(loss_agg_mode):
    # row 0: s = sqrt(1.1 * 1.3) ~ 1.196 < 1.2, A = +1, unclipped ; row 1: s = (0.5*0.5*0.8)^(1/3) ~ 0.585, A = -1,
    # clipped to 0.8. GSPO is registered seq-mean-token-mean: loss_agg_mode does not change it.
    old, new = log_probs([[1.1, 1.3, 7.0], [0.5, 0.5, 0.8]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    loss, metrics = compute_policy_loss(
        "gspo", old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode=loss_agg_mode,
        clip_ratio_low=0.2, clip_ratio_high=0.2,
    )
    assert POLICY_LOSSES["gspo"].agg_mode == "seq-mean-token-mean"
    s0 = math.sqrt(1.1 * 1.3)
    assert loss.item() == pytest.approx((-s0 + 0.8) / 2)
    assert metrics["pg_clipfrac"].value == pytest.approx(3 / 5)
    assert metrics["pg_clipfrac_lower"].value == 0.0
    assert metrics["ppo_kl"].value == pytest.approx(-math.log(1.1 * 1.3 * 0.5 * 0.5 * 0.8) / 5)
    loss.backward()
    # d/dlogp_t of -A * sg(s) * pi_t / sg(pi_t) = -A * s, then / len_i / num_seqs
    expected = torch.tensor([[-s0 / 2 / 2, -s0 / 2 / 2, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(new.grad, expected)


def test_unknown_loss_mode_lists_the_known_ones():
    with pytest.raises(ArcherError, match="unknown policy loss 'ppo'") as err:
        compute_policy_loss("ppo", old_log_prob=ADV, log_prob=ADV, advantages=ADV, response_mask=ADV)
    assert "vanilla" in err.value.fix and "gspo" in err.value.fix


# -- registration: a loss declares what it needs -----------------------------------------------------------------
def test_every_loss_declares_its_settings_options_and_inputs():
    declared = {name: (e.settings, dict(e.options), e.inputs, e.agg_mode, e.switches)
                for name, e in POLICY_LOSSES.items()}
    entropy_split = {"low_entropy_clip_ratio_low": 0.2, "low_entropy_clip_ratio_high": 0.2}
    balanced = ("enable_entropy_balanced_clipping",)  # AEPO's switch: the losses that clip the token ratio
    assert declared == {
        "vanilla": (("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"), {}, (), None, balanced),
        "gspo": (("clip_ratio_low", "clip_ratio_high"), {}, (), "seq-mean-token-mean", ()),
        "archer": (("clip_ratio_c",), {**entropy_split, "high_entropy_clip_ratio_low": 0.5,
                                       "high_entropy_clip_ratio_high": 0.5}, ("high_entropy_mask",), None, balanced),
        "aspo": (("clip_ratio_c",), {**entropy_split, "high_entropy_clip_ratio_low": 0.4,
                                     "high_entropy_clip_ratio_high": 0.4}, ("high_entropy_mask",), None, ()),
        "clip_cov": (("clip_ratio_low", "clip_ratio_high"), {"policy_loss.clip_cov_ratio": 0.0002,
                     "policy_loss.clip_cov_lb": 1.0, "policy_loss.clip_cov_ub": 5.0}, (), None, balanced),
        "kl_cov": ((), {"policy_loss.kl_cov_ratio": 0.0002, "policy_loss.ppo_kl_coef": 0.1}, (), None, ()),
    }


def test_a_registered_loss_gets_its_options_with_their_defaults():
    @register_policy_loss("test_scaled", settings=("clip_ratio_c",), options={"policy_loss.scale": 2.0})
    def scaled(*, old_log_prob, log_prob, advantages, response_mask, clip_ratio_c, scale):
        return advantages * scale * clip_ratio_c, {"n": Total(response_mask.sum())}

    common = {"old_log_prob": ADV, "log_prob": ADV, "advantages": ADV.abs(), "response_mask": torch.ones_like(ADV),
              "loss_agg_mode": "token-sum"}
    try:
        assert compute_policy_loss("test_scaled", clip_ratio_c=1.0, **common)[0].item() == 12.0  # default 2
        assert compute_policy_loss("test_scaled", clip_ratio_c=0.5, scale=3.0, **common)[0].item() == 9.0
        with pytest.raises(ArcherError, match="called without clip_ratio_c"):
            compute_policy_loss("test_scaled", **common)
        with pytest.raises(ArcherError, match="takes no argument clip_ratio_low") as err:
            compute_policy_loss("test_scaled", clip_ratio_c=1.0, clip_ratio_low=0.2, **common)
        assert err.value.fix == "pass only what it declares: clip_ratio_c, scale"
    finally:
        del POLICY_LOSSES["test_scaled"]


def test_a_loss_whose_parameters_differ_from_its_declaration_is_refused():
    def swallowing(*, old_log_prob, log_prob, advantages, response_mask, **_):
        return advantages.sum(), {}

    def undeclared(*, old_log_prob, log_prob, advantages, response_mask, scale):
        return advantages.sum(), {}

    def unknown_input(*, old_log_prob, log_prob, advantages, response_mask, tokens):
        return advantages.sum(), {}

    def unknown_switch(*, old_log_prob, log_prob, advantages, response_mask, turbo):
        return advantages.sum(), {}

    def aggregating(*, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode):
        return advantages, {}  # the aggregation is compute_policy_loss's, done once for every loss

    for fn, declaration in [(swallowing, {}), (undeclared, {}), (unknown_input, {"inputs": ("tokens",)}),
                            (unknown_switch, {"switches": ("turbo",)}), (aggregating, {})]:
        with pytest.raises(ArcherError, match="does not match its declaration"):
            register_policy_loss("test_bad", **declaration)(fn)
        assert "test_bad" not in POLICY_LOSSES


def test_the_token_losses_are_weighted_and_aggregated_once_by_compute_policy_loss():
    """A loss is its token losses; compute_policy_loss multiplies them by the rollout-correction weights and
    aggregates them by loss_agg_mode (or the loss's fixed agg_mode) with the given normalisers."""
    @register_policy_loss("test_identity")
    def identity(*, old_log_prob, log_prob, advantages, response_mask):
        return advantages, {"n": Total(response_mask.sum())}

    @register_policy_loss("test_fixed", agg_mode="seq-mean-token-mean")
    def fixed(*, old_log_prob, log_prob, advantages, response_mask):
        return advantages, {}

    adv = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    weights = torch.tensor([[0.5, 1.0, 3.0], [2.0, 0.0, 1.0]], dtype=torch.float64)
    common = {"old_log_prob": adv, "log_prob": adv, "advantages": adv, "response_mask": mask}
    try:
        assert compute_policy_loss("test_identity", **common)[0].item() == (1 + 2 + 8 + 16 + 32) / 5
        weighted = 0.5 * 1 + 2 + 2 * 8 + 0 * 16 + 32
        assert compute_policy_loss("test_identity", **common, rollout_is_weights=weights)[0].item() == weighted / 5
        assert compute_policy_loss("test_identity", **common, rollout_is_weights=weights, loss_agg_mode="token-sum",
                                   agg_kwargs={"num_tokens": 10.0})[0].item() == weighted
        assert compute_policy_loss("test_identity", **common, rollout_is_weights=weights,
                                   agg_kwargs={"num_tokens": 10.0})[0].item() == weighted / 10
        # seq-mean-token-mean whatever loss_agg_mode says: the mean of (1 + 2) / 2 and (8 + 16 + 32) / 3
        assert compute_policy_loss("test_fixed", **common, loss_agg_mode="token-sum")[0].item() == (1.5 + 56 / 3) / 2
    finally:
        del POLICY_LOSSES["test_identity"], POLICY_LOSSES["test_fixed"]
