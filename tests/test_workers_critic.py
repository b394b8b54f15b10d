"""CriticWorker on the micro model: values read at the token before each response token, the value update, and
packed token-budget micro-batches against the padded ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from workers_support import hand_batch, ppo_config, unequal_batch

from archer.batch import Batch
from archer.models.forward import MODEL_INPUTS
from archer.models.loading import value_forward
from archer.workers.critic import CriticWorker

CPU = torch.device("cpu")
CRITIC_METRICS = {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr"}
RETURNS = torch.tensor([[1.0, -0.5, 0.0], [0.3, 0.8, -1.0], [0.5, 0.0, 0.0]])  # 0 on padded tokens


def make_critic(model_dir: Path, *overrides: str) -> CriticWorker:
    cfg = ppo_config(model_dir, "critic.optim.weight_decay=0.0", "critic.ppo_mini_batch_size=3", *overrides)
    torch.manual_seed(0)  # the fresh value head is drawn from the global generator
    return CriticWorker(cfg.critic, rollout_n=1, device=CPU, total_steps=10)


def value_batch(critic: CriticWorker) -> Batch:
    batch = hand_batch()
    batch["values"] = critic.compute_values(batch)["values"]
    batch["returns"] = RETURNS
    return batch


def test_compute_values_reads_the_position_before_each_response_token(tiny_model_dir):
    critic = make_critic(tiny_model_dir)
    batch = hand_batch()
    values = critic.compute_values(batch)["values"]
    assert values.shape == (3, 3) and values.dtype == torch.float32
    with torch.no_grad():
        full = value_forward(critic.model, *(batch[k] for k in MODEL_INPUTS))
    # sequences are 7 long with 3 response tokens: positions -4, -3, -2 are 3, 4, 5
    expected = full[:, [3, 4, 5]] * batch["response_mask"]
    torch.testing.assert_close(values, expected, atol=1e-6, rtol=0)
    valid = batch["response_mask"].bool()
    assert torch.all(values[~valid] == 0) and torch.all(values[valid] != 0)

    micro = make_critic(tiny_model_dir, "critic.forward_micro_batch_size_per_gpu=1")
    torch.testing.assert_close(micro.compute_values(batch)["values"], values, atol=1e-6, rtol=0)


def test_update_critic_fits_fixed_returns(tiny_model_dir):
    critic = make_critic(tiny_model_dir, "critic.optim.lr=0.01")
    mask = hand_batch()["response_mask"].bool()
    losses = []
    for _ in range(6):
        batch = value_batch(critic)
        values = batch["values"]
        metrics = critic.update_critic(batch).metrics
        assert set(metrics) == CRITIC_METRICS
        # one mini-batch, one epoch: the update's forward sees V_old itself, so the clip is inactive
        expected_loss = 0.5 * float(((values - RETURNS)[mask] ** 2).mean())
        assert metrics["critic/vf_loss"] == pytest.approx(expected_loss, rel=1e-5)
        assert metrics["critic/vpred_mean"] == pytest.approx(float(values[mask].mean()), abs=1e-6)
        assert metrics["critic/vf_clipfrac"] == 0.0
        assert metrics["critic/grad_norm"] > 0
        assert metrics["critic/lr"] == pytest.approx(0.01)
        losses.append(metrics["critic/vf_loss"])
    final = value_batch(critic)["values"]
    final_loss = 0.5 * float(((final - RETURNS)[mask] ** 2).mean())
    assert final_loss < 0.5 * losses[0]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:]))


def test_critic_lr_follows_the_warmup_across_calls(tiny_model_dir):
    critic = make_critic(tiny_model_dir, "critic.optim.lr=0.01", "critic.optim.lr_warmup_steps=2")
    lrs = [critic.update_critic(value_batch(critic)).metrics["critic/lr"] for _ in range(3)]
    assert lrs == pytest.approx([0.0, 0.005, 0.01])


def test_unequal_micro_batches_give_the_metrics_of_the_whole_mini_batch(tiny_model_dir):
    shift = torch.tensor([[0.9, -0.2, 0.0], [0.1, -0.9, 0.7], [0.8, 0.0, 0.0]])  # V_old 0.7+ away: clipped
    metrics = []
    for micro in ("3", "2"):  # one micro-batch, or 2 + 1 rows holding 5 and 1 valid tokens
        critic = make_critic(tiny_model_dir, "critic.optim.lr=0.0", f"critic.ppo_micro_batch_size_per_gpu={micro}")
        batch = value_batch(critic)
        batch["values"] = batch["values"] + shift * batch["response_mask"]
        metrics.append(critic.update_critic(batch).metrics)
    whole, split = metrics
    assert 0 < whole["critic/vf_clipfrac"] < 1
    assert split == pytest.approx(whole, rel=1e-5, abs=1e-7)


def test_packed_token_budget_values_and_update_equal_the_padded_ones(tiny_model_dir):
    # sequences of 6, 7, 6, 6, 6 and 10 tokens, packed first-fit: a budget of 24 makes micro-batches of rows
    # 5, 1, 0 | 2, 3, 4 for the value pass, 20 makes 5, 1 | 0, 2, 3 | 4 for the update
    packed_keys = ("critic.model.use_remove_padding=true", "critic.use_dynamic_bsz=true",
                   "critic.forward_max_token_len_per_gpu=24", "critic.ppo_max_token_len_per_gpu=20")
    packed = make_critic(tiny_model_dir, *packed_keys)
    mask = unequal_batch(320)["attention_mask"]
    assert [part.tolist() for part in packed.forward_micro.split(mask)] == [[5, 1, 0], [2, 3, 4]]
    assert [part.tolist() for part in packed.update_micro.split(mask)] == [[5, 1], [0, 2, 3], [4]]
    padded_keys = ("critic.forward_by_tokens=false",)
    assert not make_critic(tiny_model_dir, *padded_keys).forward_micro.packed
    results = []
    for keys in (padded_keys, packed_keys):
        critic = make_critic(tiny_model_dir, "critic.optim.lr=0.01", "critic.ppo_mini_batch_size=6", *keys)
        batch = unequal_batch(critic.model.config.vocab_size)
        batch["values"] = critic.compute_values(batch)["values"]
        shift = torch.linspace(-0.9, 0.9, 30).view(6, 5)  # some V_old far enough off to be clipped
        batch["values"] = batch["values"] + shift * batch["response_mask"]
        batch["returns"] = torch.linspace(1.0, -1.0, 30).view(6, 5) * batch["response_mask"]
        metrics = critic.update_critic(batch).metrics
        results.append((batch["values"] - shift * batch["response_mask"], metrics, critic.compute_values(batch)))
    (values, metrics, after), (free_values, free_metrics, free_after) = results
    torch.testing.assert_close(free_values, values, atol=1e-5, rtol=0)
    assert torch.all(values[unequal_batch(320)["response_mask"] == 0] == 0)
    assert 0 < metrics["critic/vf_clipfrac"] < 1
    assert free_metrics == pytest.approx(metrics, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(free_after["values"], after["values"], atol=1e-5, rtol=0)
