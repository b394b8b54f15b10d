import pytest
import torch

from archer.algorithms.value_loss import compute_value_loss

# clip range 0.5 around V_old; the last two entries of row 1 are padding with huge values
VPREDS = torch.tensor([[1.0, 0.3, 2.0], [-1.0, 1e6, -1e6]], dtype=torch.float64)
V_OLD = torch.tensor([[0.2, 0.2, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
RETURNS = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float64)
# token 1: V=1 clipped to 0.7 -> max(0, 0.09) = 0.09 (clip active)
# token 2: V=0.3 inside the range -> 0.49 ; token 3: V=2 -> 0.5 -> max(4, 0.25) = 4
# token 4: V=-1 -> -0.5 -> max(4, 2.25) = 4
TOKEN_LOSSES = [0.09, 0.49, 4.0, 4.0]


def test_clipped_value_loss_token_mean_by_hand():
    loss, clipfrac = compute_value_loss(VPREDS, V_OLD, RETURNS, MASK, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * sum(TOKEN_LOSSES) / 4)
    assert clipfrac.value == pytest.approx(1 / 4)


def test_value_loss_follows_the_aggregation_mode_and_normalisers():
    loss, _ = compute_value_loss(VPREDS, V_OLD, RETURNS, MASK, loss_agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(0.5 * ((0.09 + 0.49 + 4.0) + 4.0) / 2)
    loss, _ = compute_value_loss(VPREDS, V_OLD, RETURNS, MASK, agg_kwargs={"num_tokens": 8})
    assert loss.item() == pytest.approx(0.5 * sum(TOKEN_LOSSES) / 8)


def test_value_gradient_is_zero_where_the_clipped_term_wins():
    vpreds = VPREDS.clone().requires_grad_(True)
    loss, _ = compute_value_loss(vpreds, V_OLD, RETURNS, MASK)
    loss.backward()
    # unclipped tokens: d/dV 0.5 * (V - R)^2 / 4 = (V - R) / 4
    expected = torch.tensor([[0.0, (0.3 - 1.0) / 4, 2.0 / 4], [-2.0 / 4, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(vpreds.grad, expected)
