"""ActorObjective: config reading (each loss's own defaults, the GSPO aggregation warning), when entropies are
needed, top-entropy normalisers, the Archer split KL, the entropy bonus, the rollout correction (decoupled IS
weights, the bypass mode's per-micro-batch correction and REINFORCE), and micro-batch losses, gradients and
metrics that add up to the mini-batch's (docs/algorithms.md)."""

import logging
import math

import pytest
import torch

from archer.algorithms.metric_sums import MetricSums
from archer.algorithms.policy_loss import LOSS_INPUTS, POLICY_LOSSES
from archer.config.loader import load_config
from archer.errors import ArcherError
from archer.workers.actor_objective import INPUT_BUILDERS, ActorObjective
from archer.workers.rollout_correction_config import read_rollout_correction

F64 = torch.float64
ACTOR = "actor_rollout_ref.actor."


RC = "algorithm.rollout_correction."


def objective(*overrides: str) -> ActorObjective:
    cfg = load_config("ppo_trainer", ["data.train_files=x", "actor_rollout_ref.model.path=y", *overrides])
    return ActorObjective.from_config(cfg.actor_rollout_ref.actor,
                                      read_rollout_correction(cfg.algorithm.rollout_correction))


def lengths_mask(lengths: list[int], width: int = 5) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(F64)


# -- config ----------------------------------------------------------------------------------------------------
def test_from_config_reads_the_aspo_recipe():
    obj = objective("algorithm=aspo", ACTOR + "clip_ratio=0.3", ACTOR + "clip_ratio_high=0.28")
    assert (obj.loss_mode, obj.loss_agg_mode) == ("aspo", "token-mean")
    assert (obj.use_kl_loss, obj.kl_loss_coef, obj.kl_loss_type) == (True, 0.001, "low_var_kl")
    assert (obj.token_entropy_quantile, obj.high_entropy_kl_loss_scale_coef, obj.entropy_top_ratio) == (0.8, 0.0, None)
    # exactly what ASPO declares: the dual-clip bound and its entropy-class clip ranges (no PPO clip range)
    assert obj.loss_kwargs == {"clip_ratio_c": 3.0, "low_entropy_clip_ratio_low": 0.2,
                               "low_entropy_clip_ratio_high": 0.2, "high_entropy_clip_ratio_low": 0.4,
                               "high_entropy_clip_ratio_high": 0.4}


def test_clip_ratio_low_and_high_fall_back_to_clip_ratio():
    obj = objective(ACTOR + "clip_ratio=0.3", ACTOR + "clip_ratio_high=0.28")
    assert obj.loss_kwargs == {"clip_ratio_low": 0.3, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                               "enable_entropy_balanced_clipping": False}


# Each loss mode set on its own (no preset) gets its paper's values, or verl's for the keys verl shares between
# its losses (the PPO clip range 0.2 / 0.2 and dual-clip 3.0; KL-Cov's ratio 2e-4 and coefficient 0.1), and the
# losses that clip the token ratio get AEPO's entropy-balanced clipping switch (off).
OFF = {"enable_entropy_balanced_clipping": False}
LOSS_DEFAULTS = {
    "vanilla": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, **OFF},
    "gspo": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2},
    "archer": {"clip_ratio_c": 3.0, "low_entropy_clip_ratio_low": 0.2, "low_entropy_clip_ratio_high": 0.2,
               "high_entropy_clip_ratio_low": 0.5, "high_entropy_clip_ratio_high": 0.5, **OFF},
    "aspo": {"clip_ratio_c": 3.0, "low_entropy_clip_ratio_low": 0.2, "low_entropy_clip_ratio_high": 0.2,
             "high_entropy_clip_ratio_low": 0.4, "high_entropy_clip_ratio_high": 0.4},
    "clip_cov": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0,
                 "clip_cov_ub": 5.0, **OFF},
    "kl_cov": {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1},
}


@pytest.mark.parametrize("loss_mode", sorted(LOSS_DEFAULTS))
def test_each_loss_mode_alone_gets_its_own_defaults(loss_mode):
    obj = objective(ACTOR + f"policy_loss.loss_mode={loss_mode}")
    assert obj.loss_kwargs == LOSS_DEFAULTS[loss_mode]
    assert (obj.token_entropy_quantile, obj.high_entropy_kl_loss_scale_coef) == (0.8, 0.0)  # shared by archer/aspo


def test_every_registered_loss_has_its_defaults_checked_and_every_input_a_builder():
    assert set(LOSS_DEFAULTS) == set(POLICY_LOSSES)
    assert INPUT_BUILDERS.keys() == LOSS_INPUTS.keys()


def test_a_set_option_wins_over_the_loss_default_and_must_be_a_number():
    obj = objective(ACTOR + "policy_loss.loss_mode=aspo", ACTOR + "high_entropy_clip_ratio_high=0.6",
                    ACTOR + "policy_loss.ppo_kl_coef=2.0")  # another loss's option is read by nobody
    assert obj.loss_kwargs["high_entropy_clip_ratio_high"] == 0.6
    assert obj.loss_kwargs["high_entropy_clip_ratio_low"] == 0.4
    assert objective("algorithm=kl_cov").loss_kwargs == {"kl_cov_ratio": 0.002, "ppo_kl_coef": 1.0}  # the preset
    with pytest.raises(ArcherError, match=r"actor_rollout_ref.actor.high_entropy_clip_ratio_low='wide' is not a "
                                          r"number") as err:
        objective(ACTOR + "policy_loss.loss_mode=archer", ACTOR + "high_entropy_clip_ratio_low=wide")
    assert "archer loss's default (0.5)" in err.value.fix


def test_an_unknown_loss_mode_fails_when_the_objective_is_built():
    with pytest.raises(ArcherError, match="loss_mode"):
        objective(ACTOR + "policy_loss.loss_mode=nope")


@pytest.mark.parametrize(("override", "key"), [("loss_agg_mode=seq-mean", "loss_agg_mode"),
                                               ("kl_loss_type=full", "kl_loss_type")])
def test_an_unknown_aggregation_or_kl_kind_fails_when_the_objective_is_built(override, key):
    with pytest.raises(ArcherError, match=key):
        objective(ACTOR + "use_kl_loss=true", ACTOR + override)


@pytest.mark.parametrize(("overrides", "warned"), [
    (("algorithm=gspo",), False),  # the preset says seq-mean-token-mean
    ((ACTOR + "policy_loss.loss_mode=gspo",), True),  # the default token-mean
    (("algorithm=gspo", ACTOR + "loss_agg_mode=token-sum"), True),
    ((ACTOR + "loss_agg_mode=token-sum",), False),  # vanilla follows loss_agg_mode
])
def test_gspo_warns_once_when_loss_agg_mode_is_not_its_own(caplog, overrides, warned):
    with caplog.at_level(logging.WARNING, logger="archer.workers.actor_objective"):
        objective(*overrides)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == int(warned), messages
    if warned:
        assert "gspo always aggregates seq-mean-token-mean" in messages[0]


@pytest.mark.parametrize(
    ("overrides", "needed"),
    [
        ((), False),
        ((ACTOR + "policy_loss.loss_mode=clip_cov",), False),
        ((ACTOR + "entropy_coeff=0.01",), True),
        (("algorithm=archer",), True),  # entropy_coeff 0, but the entropy split needs H
        (("algorithm=aspo",), True),
        ((ACTOR + "policy_loss.loss_mode=archer", ACTOR + "entropy_coeff=0.0"), True),
        ((ACTOR + "entropy_top_ratio=0.2",), True),
        ((ACTOR + "enable_entropy_balanced_advantage=true",), True),  # AEPO's advantage, entropy_coeff 0
        ((ACTOR + "enable_entropy_balanced_clipping=true",), False),  # AEPO's clip reads no entropy
    ],
)
def test_needs_entropy(overrides, needed):
    assert objective(*overrides).needs_entropy is needed


# -- normalisers -----------------------------------------------------------------------------------------------
def parts(*groups: list[int]) -> list[torch.Tensor]:
    """The rows of each micro-batch."""
    return [torch.tensor(group) for group in groups]


def test_top_entropy_policy_normaliser_sums_the_ceil_of_each_micro_batch():
    mask = lengths_mask([5, 2, 1, 2])  # micro-batches of 2 rows: 7 and 3 valid tokens
    obj = objective(ACTOR + "entropy_top_ratio=0.2")
    common, pg = obj.mini_batch_normalisers(mask, parts([0, 1], [2, 3]))
    assert common == {"num_tokens": 10.0, "num_seqs": 4.0, "max_len": 5}
    assert pg == {"num_tokens": 3.0, "num_seqs": 4.0, "max_len": 5}  # ceil(1.4) + ceil(0.6), not ceil(2.0)
    assert obj.mini_batch_normalisers(mask, parts([0, 1, 2, 3]))[1]["num_tokens"] == 2.0  # ceil(0.2 * 10)
    # rows in any order (a token-budget split): rows 0 | 3, 1, 2 hold 5 and 5 tokens -> ceil(1.0) + ceil(1.0)
    assert obj.mini_batch_normalisers(mask, parts([0], [3, 1, 2]))[1]["num_tokens"] == 2.0


def test_without_top_ratio_the_policy_loss_uses_the_common_normalisers():
    common, pg = objective().mini_batch_normalisers(lengths_mask([5, 2, 1, 2]), parts([0, 1], [2, 3]))
    assert common == pg == {"num_tokens": 10.0, "num_seqs": 4.0, "max_len": 5}


# -- terms by hand ---------------------------------------------------------------------------------------------
def test_top_entropy_policy_loss_and_entropy_bonus_by_hand():
    obj = objective(ACTOR + "entropy_top_ratio=0.2", ACTOR + "entropy_coeff=0.1")
    mask = lengths_mask([5], width=6)
    old = torch.full((1, 6), -2.0, dtype=F64)
    log_prob = old.clone().requires_grad_(True)  # r = 1 everywhere
    entropy = torch.tensor([[0.1, 0.5, 0.2, 0.9, 0.4, 7.0]], dtype=F64)  # the padded token has the largest H
    adv = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 9.0]], dtype=F64)
    agg, pg_agg = obj.mini_batch_normalisers(mask, list(torch.arange(len(mask)).split(1)))
    loss, metrics = obj.micro_batch_loss(log_prob=log_prob, entropy=entropy, old_log_prob=old, advantages=adv,
                                         mask=mask, ref_log_prob=None, agg_kwargs=agg, pg_agg_kwargs=pg_agg)
    # ceil(0.2 * 5) = 1 token gets policy gradient: H = 0.9 with A = 4, normalised by 1 selected token
    assert metrics["pg_loss"].value == pytest.approx(-4.0)
    # entropy bonus: token-mean of H over all 5 valid tokens = 2.1 / 5
    assert metrics["entropy_loss"].value == pytest.approx(0.42)
    assert loss.item() == pytest.approx(-4.0 - 0.1 * 0.42)
    assert metrics["top_entropy_selected_tokens"].value == 1
    assert metrics["top_entropy_selected_frac"].value == pytest.approx(0.2)
    # the clip metrics are means over the one selected token
    assert float(metrics["pg_clipfrac"].count) == 1
    (grad,) = torch.autograd.grad(loss, log_prob)  # the entropies are inputs: only the policy term has a gradient
    assert grad[0].tolist() == pytest.approx([0.0, 0.0, 0.0, -4.0, 0.0, 0.0])


@pytest.mark.parametrize("scale", [0.0, 0.3])
def test_archer_split_kl_by_hand(scale):
    obj = objective("algorithm=archer", ACTOR + "kl_loss_coef=0.5", ACTOR + "kl_loss_type=kl",
                    ACTOR + f"high_entropy_kl_loss_scale_coef={scale}")
    mask = lengths_mask([5, 3])  # mini-batch of 8 valid tokens, micro-batches of one row
    entropy = torch.tensor([[0.1, 0.5, 0.2, 0.9, 0.4], [0.3, 0.1, 0.2, 8.0, 8.0]], dtype=F64)
    # per-row 0.8 quantile: row 0 q = 0.58 -> token 3 high; row 1 q = 0.2 + 0.6*0.1 = 0.26 -> token 0 high
    kl = torch.tensor([[0.1, -0.2, 0.3, 0.8, 0.0], [0.4, -0.1, 0.3, 5.0, 5.0]], dtype=F64)  # k1: logp - ref
    old = torch.full((2, 5), -2.0, dtype=F64)
    log_prob = old.clone().requires_grad_(True)
    agg, pg_agg = obj.mini_batch_normalisers(mask, list(torch.arange(len(mask)).split(1)))
    terms, losses = [], []
    for row in range(2):
        loss, metrics = obj.micro_batch_loss(
            log_prob=log_prob[row:row + 1], entropy=entropy[row:row + 1], old_log_prob=old[row:row + 1],
            advantages=torch.zeros(1, 5, dtype=F64), mask=mask[row:row + 1],
            ref_log_prob=(old - kl)[row:row + 1], agg_kwargs=agg, pg_agg_kwargs=pg_agg)
        assert metrics["pg_loss"].value == 0.0  # A = 0
        terms.append(metrics["kl_loss"].value)
        losses.append(loss)
    # share * (mean_low + scale * mean_high): row 0 share 5/8, low mean (0.1-0.2+0.3+0)/4 = 0.05, high 0.8;
    # row 1 share 3/8, low mean (-0.1+0.3)/2 = 0.1, high 0.4
    expected = [5 / 8 * (0.05 + scale * 0.8), 3 / 8 * (0.1 + scale * 0.4)]
    assert terms == pytest.approx(expected)
    assert [x.item() for x in losses] == pytest.approx([0.5 * t for t in expected])
    (grad,) = torch.autograd.grad(sum(losses), log_prob)
    low0, low1 = 0.5 * 5 / 8 / 4, 0.5 * 3 / 8 / 2  # coef * share / low count
    high0, high1 = 0.5 * 5 / 8 * scale, 0.5 * 3 / 8 * scale  # coef * share * scale / 1 high token
    assert grad.flatten().tolist() == pytest.approx([low0, low0, low0, high0, low0, high1, low1, low1, 0.0, 0.0])


# -- micro-batches add up to the mini-batch --------------------------------------------------------------------
def random_mini_batch(seed: int, spread: float = 0.3) -> dict[str, torch.Tensor]:
    """Four rows of lengths 5, 3, 5, 3; log pi / pi_old uniform in (-spread / 2, spread / 2)."""
    g = torch.Generator().manual_seed(seed)
    old = -1.0 - torch.rand(4, 5, generator=g, dtype=F64)
    return {
        "mask": lengths_mask([5, 3, 5, 3]),
        "old_log_prob": old,
        "log_prob": old + spread * (torch.rand(4, 5, generator=g, dtype=F64) - 0.5),
        "advantages": torch.randn(4, 5, generator=g, dtype=F64),
        "ref_log_prob": old + 0.3 * torch.randn(4, 5, generator=g, dtype=F64),
        "entropy": torch.rand(4, 5, generator=g, dtype=F64),
    }


def accumulate(obj: ActorObjective, data: dict[str, torch.Tensor], micro: int
               ) -> tuple[float, torch.Tensor, dict[str, float]]:
    """(sum of the micro-batch losses, their gradient w.r.t. log_prob, the mini-batch metrics), as the actor
    accumulates them over micro-batches of `micro` rows (the last one smaller when `micro` does not divide 4)."""
    log_prob = data["log_prob"].clone().requires_grad_(True)
    agg, pg_agg = obj.mini_batch_normalisers(data["mask"], list(torch.arange(4).split(micro)))
    total = torch.zeros((), dtype=F64)
    sums = MetricSums()
    for start in range(0, 4, micro):
        rows = slice(start, start + micro)
        loss, metrics = obj.micro_batch_loss(
            log_prob=log_prob[rows], entropy=data["entropy"][rows], old_log_prob=data["old_log_prob"][rows],
            advantages=data["advantages"][rows], mask=data["mask"][rows], ref_log_prob=data["ref_log_prob"][rows],
            agg_kwargs=agg, pg_agg_kwargs=pg_agg)
        total = total + loss
        sums.add(metrics)
    (grad,) = torch.autograd.grad(total, log_prob)
    return total.item(), grad, sums.result()


def mini_batch_loss(obj: ActorObjective, data: dict[str, torch.Tensor], micro: int) -> tuple[float, torch.Tensor]:
    return accumulate(obj, data, micro)[:2]


@pytest.mark.parametrize("overrides", [
    (ACTOR + "use_kl_loss=true", ACTOR + "kl_loss_type=k3+", ACTOR + "entropy_coeff=0.01"),
    (ACTOR + "loss_agg_mode=token-sum", ACTOR + "use_kl_loss=true", ACTOR + "entropy_coeff=0.01"),
    (ACTOR + "loss_agg_mode=seq-mean-token-mean", ACTOR + "use_kl_loss=true", ACTOR + "entropy_coeff=0.01"),
    ("algorithm=archer", ACTOR + "use_kl_loss=false"),  # the split KL is exact only for equal class shares
    ("algorithm=aspo", ACTOR + "use_kl_loss=false", ACTOR + "entropy_coeff=0.01"),
    ("algorithm=gspo", ACTOR + "clip_ratio_low=0.2", ACTOR + "clip_ratio_high=0.2"),
    (ACTOR + "enable_entropy_balanced_clipping=true", ACTOR + "use_kl_loss=true", ACTOR + "entropy_coeff=0.01"),
    ("algorithm=archer", ACTOR + "use_kl_loss=false", ACTOR + "enable_entropy_balanced_clipping=true"),
])
def test_unequal_micro_batches_give_the_losses_gradients_and_metrics_of_the_whole_mini_batch(overrides):
    obj = objective(*overrides)
    data = random_mini_batch(5, spread=1.6)  # |log r| up to 0.8: both clip ranges are crossed
    whole, whole_grad, whole_metrics = accumulate(obj, data, 4)
    for micro in (3, 1):  # micro-batches of 13 + 3 and of 5, 3, 5, 3 tokens
        split, split_grad, split_metrics = accumulate(obj, data, micro)
        # (the entropy bonus runs in float32, as in the actor)
        assert split == pytest.approx(whole, rel=1e-6)
        assert torch.allclose(split_grad, whole_grad, rtol=1e-6, atol=1e-9)
        assert split_metrics == pytest.approx(whole_metrics, rel=1e-6, abs=1e-9)
    assert whole_metrics["pg_clipfrac"] > 0
    if obj.loss_kwargs.get("enable_entropy_balanced_clipping"):
        assert 0 < whole_metrics["entropy_balanced_clip_kept_frac"] < whole_metrics["pg_clipfrac"]
    if obj.splits_by_entropy:
        assert 0 < whole_metrics["entropy_low_clipfrac"] < 1 and 0 < whole_metrics["entropy_high_clipfrac"] < 1


def test_token_sum_is_the_sum_of_the_token_losses():
    obj = objective(ACTOR + "loss_agg_mode=token-sum", ACTOR + "clip_ratio_c=10.0")
    data = random_mini_batch(3)  # |log r| < 0.15: nothing is clipped, every token loss is -A * r
    loss, grad, metrics = accumulate(obj, data, 3)
    ratio = (data["log_prob"] - data["old_log_prob"]).exp()
    valid = data["mask"].bool()
    assert loss == pytest.approx(float((-data["advantages"] * ratio)[valid].sum()), rel=1e-12)
    assert metrics["pg_loss"] == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(grad, -data["advantages"] * ratio * data["mask"])


@pytest.mark.parametrize("loss_mode", ["archer", "aspo"])
def test_equal_micro_batches_add_up_to_the_mini_batch_with_split_kl(loss_mode):
    obj = objective(f"algorithm={loss_mode}", ACTOR + "kl_loss_coef=0.2",
                    ACTOR + "high_entropy_kl_loss_scale_coef=0.5", ACTOR + "entropy_coeff=0.01")
    data = random_mini_batch(0)  # every row has exactly one high-entropy token: 2 high, 6 low per micro-batch
    whole, whole_grad = mini_batch_loss(obj, data, 4)
    split, split_grad = mini_batch_loss(obj, data, 2)
    assert split == pytest.approx(whole, rel=1e-6)
    assert torch.allclose(split_grad, whole_grad, rtol=1e-6, atol=1e-9)
    assert whole_grad.abs().sum() > 0


def test_equal_micro_batches_add_up_to_the_mini_batch_with_top_entropy_tokens():
    obj = objective(ACTOR + "entropy_top_ratio=0.2", ACTOR + "use_kl_loss=true", ACTOR + "kl_loss_coef=0.2",
                    ACTOR + "entropy_coeff=0.01", ACTOR + "clip_ratio_c=10.0")
    data = random_mini_batch(1)
    # 8 valid tokens per micro-batch -> ceil(1.6) = 2 each; 16 in all -> ceil(3.2) = 4: the same four tokens
    data["entropy"] = data["entropy"] * 0.5
    for row, col, h in [(0, 1, 5.0), (1, 2, 4.0), (2, 0, 4.5), (3, 1, 3.5)]:
        data["entropy"][row, col] = h
    whole, whole_grad = mini_batch_loss(obj, data, 4)
    split, split_grad = mini_batch_loss(obj, data, 2)
    assert split == pytest.approx(whole, rel=1e-6)
    assert torch.allclose(split_grad, whole_grad, rtol=1e-6, atol=1e-9)
    # only the four selected tokens receive policy gradient; KL and (absent) entropy terms reach the rest
    obj_no_kl = objective(ACTOR + "entropy_top_ratio=0.2", ACTOR + "clip_ratio_c=10.0")
    _, pg_grad = mini_batch_loss(obj_no_kl, data, 2)
    assert sorted(map(tuple, pg_grad.nonzero().tolist())) == [(0, 1), (1, 2), (2, 0), (3, 1)]
    ratio = (data["log_prob"] - data["old_log_prob"]).exp()
    for row, col in [(0, 1), (1, 2), (2, 0), (3, 1)]:
        a, r = data["advantages"][row, col].item(), ratio[row, col].item()
        assert pg_grad[row, col].item() == pytest.approx(-a * r / 4)  # |ln r| < 0.15: unclipped, over 4 tokens


# -- AEPO's entropy-balanced clipping and entropy-aware advantage --------------------------------------------
def test_the_aepo_switches_are_read_with_their_defaults():
    obj = objective()
    assert (obj.entropy_balanced_advantage, obj.entropy_balanced_advantage_coef) == (False, 0.2)
    obj = objective(ACTOR + "enable_entropy_balanced_advantage=true", ACTOR + "entropy_balanced_advantage_coef=0.5",
                    ACTOR + "enable_entropy_balanced_clipping=true", ACTOR + "policy_loss.loss_mode=archer")
    assert (obj.entropy_balanced_advantage, obj.entropy_balanced_advantage_coef) == (True, 0.5)
    assert obj.loss_kwargs["enable_entropy_balanced_clipping"] is True


@pytest.mark.parametrize("loss_mode", ["gspo", "aspo", "kl_cov"])
def test_balanced_clipping_is_refused_for_a_loss_without_a_token_ratio_clip(loss_mode):
    with pytest.raises(ArcherError, match=rf"actor_rollout_ref.actor.enable_entropy_balanced_clipping=true does not "
                                          rf"apply to policy_loss.loss_mode={loss_mode}") as err:
        objective(ACTOR + f"policy_loss.loss_mode={loss_mode}", ACTOR + "enable_entropy_balanced_clipping=true")
    assert err.value.fix.startswith("use it with loss_mode archer | clip_cov | vanilla, or set it to false")


def test_entropy_aware_advantage_by_hand_with_a_stop_gradient_on_the_entropy():
    obj = objective(ACTOR + "enable_entropy_balanced_advantage=true", ACTOR + "clip_ratio_c=10.0")
    mask = lengths_mask([3, 2], width=4)
    # valid entropies 2.5, 2.5, 1.5 | 0.5, 0.5: mean 1.5, unbiased std 1 -> H_hat 1, 1, 0 | -1, -1
    entropy = torch.tensor([[2.5, 2.5, 1.5, 9.0], [0.5, 0.5, 9.0, 9.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, 2.0, 2.0], [-1.0, -1.0, -1.0, -1.0]], dtype=F64)
    old = torch.full((2, 4), -2.0, dtype=F64)
    log_prob = old.clone().requires_grad_(True)  # r = 1: the token loss is -A_tilde
    agg, pg_agg = obj.mini_batch_normalisers(mask, parts([0, 1]))
    loss, metrics = obj.micro_batch_loss(log_prob=log_prob, entropy=entropy, old_log_prob=old, advantages=adv,
                                         mask=mask, ref_log_prob=None, agg_kwargs=agg, pg_agg_kwargs=pg_agg)
    a_tilde = [[2 * 1.2, 2 * 1.2, 2 * 1.0, 0.0], [-0.8, -0.8, 0.0, 0.0]]  # A * (1 + 0.2 * H_hat)
    assert metrics["pg_loss"].value == pytest.approx(-sum(map(sum, a_tilde)) / 5, abs=1e-8)
    grad_logp, grad_entropy = torch.autograd.grad(loss, [log_prob, entropy], allow_unused=True)
    torch.testing.assert_close(grad_logp, -torch.tensor(a_tilde, dtype=F64) / 5, rtol=0, atol=1e-9)
    assert grad_entropy is None  # sg(H_hat): no gradient reaches the entropies
    assert metrics["entropy_adv_scale_pos"].value == pytest.approx(3.4 / 3)
    assert metrics["entropy_adv_scale_neg"].value == pytest.approx(0.8)


def test_entropy_aware_advantage_standardises_over_each_micro_batch():
    obj = objective(ACTOR + "enable_entropy_balanced_advantage=true", ACTOR + "entropy_balanced_advantage_coef=0.3")
    data = random_mini_batch(2)  # |log r| < 0.15: nothing clipped, the gradient is -A_tilde * r / 16
    ratio = (data["log_prob"] - data["old_log_prob"]).exp()

    def by_hand(micro: int) -> torch.Tensor:
        expected = torch.zeros(4, 5, dtype=F64)
        for start in range(0, 4, micro):
            rows = slice(start, start + micro)
            h, m = data["entropy"][rows], data["mask"][rows]
            valid = h[m.bool()]
            h_hat = (h - valid.mean()) / valid.std()  # unbiased std over the micro-batch's valid tokens
            expected[rows] = -data["advantages"][rows] * (1 + 0.3 * h_hat) * ratio[rows] * m / 16
        return expected

    for micro in (4, 2):
        _, grad, metrics = accumulate(obj, data, micro)
        torch.testing.assert_close(grad, by_hand(micro), rtol=1e-6, atol=1e-9)
        assert metrics["pg_clipfrac"] == 0
    assert not torch.allclose(by_hand(4), by_hand(2))  # the paper's micro-batch statistics, not the mini-batch's


@pytest.mark.parametrize("loss_mode", sorted(LOSS_DEFAULTS))
def test_entropy_aware_advantage_is_the_same_loss_on_scaled_advantages_for_every_loss_mode(loss_mode):
    data = random_mini_batch(6, spread=1.6)
    scaled = objective(ACTOR + f"policy_loss.loss_mode={loss_mode}", ACTOR + "enable_entropy_balanced_advantage=true")
    plain = objective(ACTOR + f"policy_loss.loss_mode={loss_mode}")
    valid = data["entropy"][data["mask"].bool()]
    by_hand = dict(data, advantages=data["advantages"] * (1 + 0.2 * (data["entropy"] - valid.mean()) / valid.std()))
    torch.manual_seed(0)  # clip_cov draws its tokens at random
    loss, grad, metrics = accumulate(scaled, data, 4)
    torch.manual_seed(0)
    expected, expected_grad, expected_metrics = accumulate(plain, by_hand, 4)
    assert loss == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-9)
    extra = {k: v for k, v in metrics.items() if k not in expected_metrics}
    assert sorted(extra) == ["entropy_adv_flipped_frac", "entropy_adv_scale_mean", "entropy_adv_scale_neg",
                             "entropy_adv_scale_pos"]


# -- rollout correction ------------------------------------------------------------------------------------------
# One response of 4 tokens, A = 1, 1, -1, -1; pi_theta / pi_rollout = 3, 1.1, 0.9, 0.25 (old_log_prob: the rollout's)
BYPASS_RATIOS = [3.0, 1.1, 0.9, 0.25]
BYPASS_ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=F64)


def bypass_loss(obj: ActorObjective) -> tuple[torch.Tensor, dict, torch.Tensor]:
    old = torch.full((1, 4), -1.0, dtype=F64)
    log_prob = (old + torch.tensor([BYPASS_RATIOS], dtype=F64).log()).requires_grad_(True)
    mask = torch.ones(1, 4, dtype=F64)
    agg, pg_agg = obj.mini_batch_normalisers(mask, [torch.arange(1)])
    loss, metrics = obj.micro_batch_loss(log_prob=log_prob, entropy=None, old_log_prob=old, advantages=BYPASS_ADV,
                                         mask=mask, ref_log_prob=None, agg_kwargs=agg, pg_agg_kwargs=pg_agg)
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss, {k: m.value for k, m in metrics.items()}, grad


def test_bypass_ppo_clip_rejects_tokens_of_the_current_policy_and_reports_its_diagnostics():
    obj = objective(RC + "bypass_mode=true", RC + "rollout_is=token", RC + "rollout_rs=token_k1",
                    RC + "rollout_rs_threshold=0.5_2.0")
    assert obj.loss_mode == "vanilla" and obj.bypass is not None
    loss, metrics, grad = bypass_loss(obj)
    # token_k1 keeps 1 / r within [0.5, 2]: 1.1 and 0.9; PPO clip on them (-1.1, then A < 0: max(0.9, 0.8) = 0.9),
    # normalised by the mini-batch's 4 tokens; the IS weights are diagnostics only
    assert loss.item() == pytest.approx((-1.1 + 0.9) / 4)
    assert grad[0].tolist() == pytest.approx([0.0, -1.1 / 4, 0.9 / 4, 0.0])
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 4)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx((2.0 + 1.1 + 0.9 + 0.25) / 4)
    assert metrics["rollout_corr/kl"] == pytest.approx(-math.log(3.0 * 1.1 * 0.9 * 0.25) / 4)
    assert float(metrics["pg_clipfrac"]) == 0.0, "over the kept tokens: neither is clipped"


def test_bypass_reinforce_weights_the_log_likelihood_gradient():
    obj = objective(RC + "bypass_mode=true", RC + "loss_type=reinforce", RC + "rollout_is=token")
    assert obj.loss_mode == "reinforce"
    loss, metrics, grad = bypass_loss(obj)
    weights = [2.0, 1.1, 0.9, 0.25]  # min(pi_theta / pi_rollout, 2)
    logp = [-1.0 + math.log(r) for r in BYPASS_RATIOS]
    adv = BYPASS_ADV[0].tolist()
    assert loss.item() == pytest.approx(-sum(a * w * lp for a, w, lp in zip(adv, weights, logp)) / 4)
    assert grad[0].tolist() == pytest.approx([-a * w / 4 for a, w in zip(adv, weights)])
    assert metrics["ppo_kl"] == pytest.approx(-sum(map(math.log, BYPASS_RATIOS)) / 4)


def test_decoupled_weights_multiply_the_policy_loss_only():
    obj = objective(ACTOR + "entropy_coeff=0.1", ACTOR + "use_kl_loss=true", ACTOR + "kl_loss_type=kl")
    assert obj.bypass is None, "the decoupled mode corrects in the trainer"
    data = random_mini_batch(2)
    agg, pg_agg = obj.mini_batch_normalisers(data["mask"], [torch.arange(4)])
    common = {"log_prob": data["log_prob"], "entropy": data["entropy"], "old_log_prob": data["old_log_prob"],
              "advantages": data["advantages"], "mask": data["mask"], "ref_log_prob": data["ref_log_prob"],
              "agg_kwargs": agg, "pg_agg_kwargs": pg_agg}
    _, plain = obj.micro_batch_loss(**common)
    _, weighted = obj.micro_batch_loss(**common, rollout_is_weights=torch.full((4, 5), 0.5, dtype=F64))
    assert weighted["pg_loss"].value == pytest.approx(0.5 * plain["pg_loss"].value)
    assert weighted["entropy_loss"].value == plain["entropy_loss"].value
    assert weighted["kl_loss"].value == plain["kl_loss"].value


@pytest.mark.parametrize("overrides", [
    (RC + "bypass_mode=true", RC + "rollout_is=token", RC + "rollout_rs='token_k1,seq_mean_k3'",
     RC + "rollout_rs_threshold='0.6_1.6,0.15'"),
    (RC + "bypass_mode=true", RC + "loss_type=reinforce", RC + "rollout_is=sequence", RC + "rollout_is_threshold=1.5",
     RC + "rollout_rs=seq_max_k2", RC + "rollout_rs_threshold=0.26"),
])
def test_the_bypass_mode_adds_up_over_micro_batches(overrides):
    obj = objective(*overrides)
    data = random_mini_batch(5, spread=1.6)
    whole, whole_grad, whole_metrics = accumulate(obj, data, 4)
    assert 0 < whole_metrics["rollout_corr/rollout_rs_masked_fraction"] < 1
    for micro in (3, 1):
        split, split_grad, split_metrics = accumulate(obj, data, micro)
        assert split == pytest.approx(whole, rel=1e-9)
        assert torch.allclose(split_grad, whole_grad, rtol=1e-9, atol=1e-12)
        assert split_metrics == pytest.approx(whole_metrics, rel=1e-9, abs=1e-12)
