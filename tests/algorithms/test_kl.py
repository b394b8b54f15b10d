import math

import pytest
import torch

from archer.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)
from archer.errors import ArcherError

LOGP = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
REF = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
# x = logp - ref = 0.5, -1.0, 0.0
K3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0]


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (("kl", "k1"), [0.5, -1.0, 0.0]),
        (("abs",), [0.5, 1.0, 0.0]),
        (("mse", "k2"), [0.125, 0.5, 0.0]),
        (("low_var_kl", "k3"), K3),
    ],
)
def test_each_kl_kind_and_its_alias(kinds: tuple[str, ...], expected: list[float]):
    for kind in kinds:
        torch.testing.assert_close(kl_penalty(LOGP, REF, kind), torch.tensor([expected], dtype=torch.float64))


def test_k3_clamps_the_log_ratio_and_the_result():
    logp = torch.tensor([[-30.0, 30.0, 5.0]], dtype=torch.float64)
    # x=-30 -> x=-20: exp(20) - 21 -> 10 ; x=30 -> x=20: exp(-20) + 19 -> 10 ; x=5: exp(-5) + 4 (inside the clamp)
    expected = torch.tensor([[10.0, 10.0, math.exp(-5.0) + 4.0]], dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(logp, torch.zeros_like(logp), "k3"), expected)


# Straight-through estimators (verl's "+" kinds): the value of the named estimator, the gradient of
# k2 = 0.5 x^2, i.e. d/dlogp = x = 0.5, -1.0, 0.0 whatever the value is.
@pytest.mark.parametrize(
    ("kinds", "expected", "own_grad"),
    [
        (("kl+", "k1+"), [0.5, -1.0, 0.0], [1.0, 1.0, 1.0]),
        (("abs+",), [0.5, 1.0, 0.0], [1.0, -1.0, 0.0]),  # sign(x); torch's sign(0) = 0
        (("mse+", "k2+"), [0.125, 0.5, 0.0], [0.5, -1.0, 0.0]),
        (("low_var_kl+", "k3+"), K3, [1 - math.exp(-0.5), 1 - math.exp(1.0), 0.0]),  # k3' = 1 - e^-x
    ],
)
def test_plus_kinds_keep_the_value_and_take_the_gradient_of_k2(kinds, expected, own_grad):
    for kind in kinds:
        logp = LOGP.clone().requires_grad_(True)
        value = kl_penalty(logp, REF, kind)
        torch.testing.assert_close(value.detach(), torch.tensor([expected], dtype=torch.float64))
        (grad,) = torch.autograd.grad(value.sum(), logp)
        assert grad[0].tolist() == pytest.approx([0.5, -1.0, 0.0])
        # the plain estimator has its own gradient
        plain = LOGP.clone().requires_grad_(True)
        (plain_grad,) = torch.autograd.grad(kl_penalty(plain, REF, kind[:-1]).sum(), plain)
        assert plain_grad[0].tolist() == pytest.approx(own_grad)


def test_k3_plus_keeps_the_clamped_value_but_not_a_clamped_gradient():
    logp = torch.tensor([[30.0, -0.5]], dtype=torch.float64, requires_grad=True)
    value = kl_penalty(logp, torch.zeros_like(logp), "k3+")
    # x = 30 -> the k3 value is clamped to 10 (its own gradient there is 0); k2's gradient is x = 30
    assert value.detach()[0].tolist() == pytest.approx([10.0, math.exp(0.5) - 0.5 - 1])
    (grad,) = torch.autograd.grad(value.sum(), logp)
    assert grad[0].tolist() == pytest.approx([30.0, -0.5])


def test_kl_loss_with_a_plus_kind_by_hand():
    mask = torch.tensor([[1, 1, 0]], dtype=torch.float64)
    logp = LOGP.clone().requires_grad_(True)
    loss = kl_loss(logp, REF, mask, kind="k3+", agg_kwargs={"num_tokens": 4})
    assert loss.item() == pytest.approx((K3[0] + K3[1]) / 4)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].tolist() == pytest.approx([0.5 / 4, -1.0 / 4, 0.0])


def test_unknown_kind_lists_the_known_kinds():
    with pytest.raises(ArcherError, match="unknown KL estimator 'full'") as err:
        kl_penalty(LOGP, REF, "full")
    assert "low_var_kl" in err.value.fix


def test_fixed_controller_never_moves():
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=10.0, n_steps=100)
    assert ctrl.value == 0.05


def test_adaptive_controller_update_by_hand():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=100)
    ctrl.update(current_kl=0.6, n_steps=10)  # error 0.2 -> x (1 + 0.2 * 10 / 100)
    assert ctrl.value == pytest.approx(0.1 * 1.02)
    ctrl.update(current_kl=2.0, n_steps=10)  # error 3.0 clipped to 0.2
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 1.02)
    ctrl.update(current_kl=0.45, n_steps=50)  # error -0.1 -> x (1 - 0.1 * 50 / 100)
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 1.02 * 0.95)
    ctrl.update(current_kl=0.0, n_steps=100)  # error -1 clipped to -0.2
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 1.02 * 0.95 * 0.8)


def test_make_kl_controller():
    fixed = make_kl_controller("fixed", kl_coef=0.3)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.3
    adaptive = make_kl_controller("adaptive", kl_coef=0.2, target_kl=0.1, horizon=50)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target_kl, adaptive.horizon) == (0.2, 0.1, 50)
    with pytest.raises(ArcherError, match="unknown KL controller type 'pid'"):
        make_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ArcherError, match="horizon > 0"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=0)


SCORES = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
REF_LOGP = torch.zeros(2, 3, dtype=torch.float64)
OLD_LOGP = torch.tensor([[0.2, 0.4, 0.6], [0.1, 0.3, 9.0]], dtype=torch.float64)  # 9.0 is padding


def test_apply_kl_penalty_with_a_fixed_coefficient():
    rewards, metrics = apply_kl_penalty(SCORES, OLD_LOGP, REF_LOGP, MASK, FixedKLController(0.5), kind="kl")
    expected = torch.tensor([[-0.1, -0.2, 0.7], [-0.05, 1.85, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(rewards, expected)
    # per-sequence token-mean KL: 0.4 and 0.2 -> batch mean 0.3
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.3)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5


def test_apply_kl_penalty_updates_the_adaptive_controller_with_batch_size_steps():
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.2, horizon=10)
    _, metrics = apply_kl_penalty(SCORES, OLD_LOGP, REF_LOGP, MASK, ctrl, kind="kl")
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5  # the coefficient that was applied
    assert ctrl.value == pytest.approx(0.5 * (1 + 0.2 * 2 / 10))  # 0.3/0.2 - 1 = 0.5 clipped to 0.2


def test_kl_loss_is_the_aggregated_estimator():
    mask = torch.tensor([[1, 1, 0]], dtype=torch.float64)
    assert kl_loss(LOGP, REF, mask).item() == pytest.approx((K3[0] + K3[1]) / 2)
    assert kl_loss(LOGP, REF, mask, kind="abs", agg_kwargs={"num_tokens": 3}).item() == pytest.approx(0.5)
