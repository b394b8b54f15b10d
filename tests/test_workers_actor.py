"""ActorWorker on the micro model: log-probs against a float64 forward, the PPO update (signs, masks, clip
fallbacks, entropy bonus, epochs, warmup, skipped steps), packed and token-budget micro-batches against
the padded ones, and the checkpoint round trip."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from workers_support import RESPONSE_MASK, float64_logprobs, hand_batch, ppo_config, unequal_batch, update

import archer.models.forward as forward_module
from archer.algorithms.token_selection import top_entropy_tokens
from archer.batch import Batch
from archer.models.forward import MODEL_INPUTS
from archer.models.loading import load_tokenizer
from archer.models.logprobs import response_logprobs
from archer.workers import actor as actor_module
from archer.workers.actor import ActorWorker

CPU = torch.device("cpu")
VALID_TOKENS = sum(map(sum, RESPONSE_MASK))  # 6
PG_METRICS = {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/grad_norm",
              "actor/skipped_steps", "actor/lr"}


def make_actor(model_dir: Path, *overrides: str, total_steps: int = 10) -> ActorWorker:
    cfg = ppo_config(model_dir, "actor_rollout_ref.actor.optim.weight_decay=0.0",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=3", *overrides)
    return ActorWorker(cfg.actor_rollout_ref, device=CPU, total_steps=total_steps)


def policy_batch(actor: ActorWorker, advantages: torch.Tensor, old_shift: float = 0.0, **extra: torch.Tensor) -> Batch:
    """The hand batch with the actor's current log-probs (+ old_shift) as old_log_probs and the given advantages."""
    batch = hand_batch()
    batch["old_log_probs"] = actor.compute_log_prob(batch)["old_log_probs"] + old_shift
    batch["advantages"] = advantages * batch["response_mask"]
    for key, value in extra.items():
        batch[key] = value
    return batch


def params_of(actor: ActorWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in actor.model.named_parameters()}


def assert_params_equal(actor: ActorWorker, expected: dict[str, torch.Tensor]) -> None:
    for name, value in actor.model.named_parameters():
        assert torch.equal(value, expected[name]), name


def random_advantages(seed: int = 0) -> torch.Tensor:
    return torch.randn(3, 3, generator=torch.Generator().manual_seed(seed))


# -- compute_log_prob ------------------------------------------------------------------------------------------
def test_compute_log_prob_matches_a_float64_full_logits_forward(tiny_model_dir):
    actor = make_actor(tiny_model_dir, "actor_rollout_ref.rollout.temperature=0.7")
    batch = hand_batch()
    out = actor.compute_log_prob(batch)
    assert sorted(out.tensors) == ["entropies", "old_log_probs"]
    logp, ent = out["old_log_probs"], out["entropies"]
    assert logp.shape == ent.shape == (3, 3) and logp.dtype == ent.dtype == torch.float32
    ref_logp, ref_ent = float64_logprobs(actor.model, batch, temperature=0.7)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    valid = batch["response_mask"].bool()
    assert torch.all(logp[~valid] == 0) and torch.all(ent[~valid] == 0)
    assert torch.all(logp[valid] < 0) and torch.all(ent[valid] > 0)
    # temperature 1 gives other numbers: the worker really applies rollout.temperature
    assert not torch.allclose(float64_logprobs(actor.model, batch, temperature=1.0)[0], ref_logp, atol=1e-3)

    micro = make_actor(tiny_model_dir, "actor_rollout_ref.rollout.temperature=0.7",
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                       "actor_rollout_ref.actor.logprob_chunk_size=2")
    out_micro = micro.compute_log_prob(batch)
    torch.testing.assert_close(out_micro["old_log_probs"], logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(out_micro["entropies"], ent, atol=1e-6, rtol=0)


# -- update_actor ----------------------------------------------------------------------------------------------
def test_zero_advantages_leave_the_policy_unchanged(tiny_model_dir):
    actor = make_actor(tiny_model_dir, "actor_rollout_ref.actor.optim.lr=0.01")
    before = params_of(actor)
    metrics = update(actor, policy_batch(actor, torch.zeros(3, 3)))
    assert set(metrics) == PG_METRICS
    assert metrics["actor/pg_loss"] == 0.0
    assert metrics["actor/grad_norm"] == 0.0
    assert metrics["actor/skipped_steps"] == 0.0
    assert abs(metrics["actor/ppo_kl"]) < 1e-6 and metrics["actor/pg_clipfrac"] == 0.0
    assert_params_equal(actor, before)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_the_response_log_prob_by_the_first_order_amount(tiny_model_dir, sign):
    lr = 1e-5
    actor = make_actor(tiny_model_dir, f"actor_rollout_ref.actor.optim.lr={lr}")
    batch = hand_batch()
    # g = d/dtheta sum_t log p(row 1, token t); row 1 has three valid tokens
    logp, _ = response_logprobs(actor.model, *(batch[k] for k in MODEL_INPUTS), 3, compute_entropy=False)
    actor.model.zero_grad()
    logp[1].sum().backward()
    grad_l1 = sum(float(p.grad.abs().sum()) for p in actor.model.parameters() if p.grad is not None)
    actor.model.zero_grad(set_to_none=True)

    advantages = torch.zeros(3, 3)
    advantages[1] = sign
    trained = policy_batch(actor, advantages)
    before = trained["old_log_probs"][1].sum().item()
    metrics = update(actor, trained)
    after = actor.compute_log_prob(batch)["old_log_probs"][1].sum().item()
    # ratio 1 on every token: pg_loss = -(A * 3 tokens) / 6 tokens
    assert metrics["actor/pg_loss"] == pytest.approx(-sign * 3 / VALID_TOKENS, abs=1e-6)
    # Adam's first step moves every weight by lr * sign(-dL/dtheta) = lr * sign(A * g): change = sign * lr * |g|_1
    assert (after - before) * sign > 0
    assert after - before == pytest.approx(sign * lr * grad_l1, rel=0.02)


def test_micro_batches_accumulate_to_the_mini_batch_gradient(tiny_model_dir):
    whole = make_actor(tiny_model_dir)
    micro = make_actor(tiny_model_dir, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    m_whole = update(whole, policy_batch(whole, random_advantages(), old_shift=0.1))
    m_micro = update(micro, policy_batch(micro, random_advantages(), old_shift=0.1))
    assert m_whole["actor/grad_norm"] > 0
    for key in PG_METRICS:
        assert m_micro[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("loss_mode", ["vanilla", "archer"])
def test_unequal_micro_batches_give_the_metrics_of_the_whole_mini_batch(tiny_model_dir, loss_mode):
    # micro-batches of 2 + 1 rows hold 5 and 1 valid tokens; Archer's split puts one token of each of rows 0 and 1
    # in the high-entropy class and none of row 2 (a single token is never above its own quantile)
    # (Archer's split KL is exact only for micro-batches with equal class shares: no KL loss for it here)
    overrides = [f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}", "actor_rollout_ref.actor.entropy_coeff=0.01",
                 f"actor_rollout_ref.actor.use_kl_loss={loss_mode == 'vanilla'}", "actor_rollout_ref.actor.kl_loss_type=kl"]
    shift = torch.tensor([[0.8, -0.8, 0.0], [-0.8, 0.8, -0.8], [0.8, 0.0, 0.0]])  # ratios e^-0.8 and e^0.8
    metrics = []
    for micro in ("3", "2", "1"):
        actor = make_actor(tiny_model_dir, *overrides, f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}")
        batch = policy_batch(actor, random_advantages(4), old_shift=shift)
        batch["ref_log_prob"] = batch["old_log_probs"] + 0.1 * shift
        metrics.append(update(actor, batch))
    whole = metrics[0]
    assert whole["actor/pg_clipfrac"] > 0
    if loss_mode == "archer":
        assert whole["actor/entropy_high_frac"] == pytest.approx(2 / VALID_TOKENS, abs=1e-6)
        assert whole["actor/entropy_high_clipfrac"] > 0
    for split in metrics[1:]:
        assert split.keys() == whole.keys()
        for key in whole:
            assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize(("mini_batch_size", "steps"), [(3, 2), (1, 6)])
def test_ppo_epochs_give_one_optimiser_step_per_mini_batch_and_epoch(tiny_model_dir, mini_batch_size, steps):
    actor = make_actor(tiny_model_dir, "actor_rollout_ref.actor.ppo_epochs=2",
                       f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch_size}")
    update(actor, policy_batch(actor, random_advantages()))
    counters = {float(state["step"]) for state in actor.optimizer.state.values()}
    assert counters == {float(steps)}


def test_lr_follows_the_warmup_across_calls(tiny_model_dir):
    actor = make_actor(tiny_model_dir, "actor_rollout_ref.actor.optim.lr=0.001",
                       "actor_rollout_ref.actor.optim.lr_warmup_steps=2")
    used = []
    for call in range(4):
        before = params_of(actor)
        metrics = update(actor, policy_batch(actor, random_advantages(call)))
        used.append(metrics["actor/lr"])
        moved = any(not torch.equal(v, before[k]) for k, v in actor.model.named_parameters())
        assert moved == (call > 0)  # the first update runs at lr 0 (warmup step 0 of 2)
    assert used == pytest.approx([0.0, 0.0005, 0.001, 0.001])


def test_tokens_outside_the_response_mask_do_not_reach_the_update(tiny_model_dir):
    advantages = random_advantages(1)
    tool_tokens = torch.tensor([[0, 1, 0], [0, 1, 0], [0, 0, 0]])  # in the sequence (attention 1), not learned from

    def masked_batch(actor: ActorWorker, garbage: float) -> Batch:
        batch = policy_batch(actor, advantages, old_shift=0.1)
        batch["response_mask"] = batch["response_mask"] * (1 - tool_tokens)
        batch["old_log_probs"] = torch.where(tool_tokens.bool(), garbage, batch["old_log_probs"])
        batch["advantages"] = torch.where(tool_tokens.bool(), garbage, batch["advantages"])
        return batch

    first = make_actor(tiny_model_dir, "actor_rollout_ref.actor.optim.lr=0.001")
    m_first = update(first, masked_batch(first, garbage=0.0))
    second = make_actor(tiny_model_dir, "actor_rollout_ref.actor.optim.lr=0.001")
    m_second = update(second, masked_batch(second, garbage=-50.0))
    plain = make_actor(tiny_model_dir, "actor_rollout_ref.actor.optim.lr=0.001")
    m_plain = update(plain, policy_batch(plain, advantages, old_shift=0.1))

    assert m_first == pytest.approx(m_second, rel=1e-6)
    for (name, value), other in zip(first.model.named_parameters(), second.model.parameters()):
        torch.testing.assert_close(value, other, atol=1e-7, rtol=0, msg=name)
    assert m_plain["actor/grad_norm"] != pytest.approx(m_first["actor/grad_norm"], rel=1e-3)


@pytest.mark.parametrize(
    ("overrides", "high_loss", "low_loss"),
    [
        # both null -> clip_ratio 0.2: ratio e^0.25 clips at 1.2, ratio e^-0.25 clips at 0.8
        ([], -1.2, 0.8),
        # both null -> clip_ratio 0.3: neither ratio is clipped
        (["actor_rollout_ref.actor.clip_ratio=0.3"], -math.exp(0.25), math.exp(-0.25)),
        # only the high side widened; low falls back to 0.2
        (["actor_rollout_ref.actor.clip_ratio_high=0.3"], -math.exp(0.25), 0.8),
        # only the low side widened; high falls back to 0.2
        (["actor_rollout_ref.actor.clip_ratio_low=0.25"], -1.2, math.exp(-0.25)),
    ],
)
def test_clip_ratio_low_and_high_fall_back_to_clip_ratio(tiny_model_dir, overrides, high_loss, low_loss):
    actor = make_actor(tiny_model_dir, "actor_rollout_ref.actor.optim.lr=0.0", *overrides)
    # A = +1 with ratio e^0.25: token loss max(-r, -clip(r)) -> -min(r, 1 + eps_high)
    high = update(actor, policy_batch(actor, torch.ones(3, 3), old_shift=-0.25))
    assert high["actor/pg_loss"] == pytest.approx(high_loss, abs=1e-5)
    assert high["actor/pg_clipfrac"] == pytest.approx(float(high_loss == -1.2))
    # A = -1 with ratio e^-0.25: token loss max(r, clip(r)) -> max(r, 1 - eps_low); dual-clip bound 3 is inactive
    low = update(actor, policy_batch(actor, -torch.ones(3, 3), old_shift=0.25))
    assert low["actor/pg_loss"] == pytest.approx(low_loss, abs=1e-5)
    assert low["actor/pg_clipfrac"] == pytest.approx(float(low_loss == 0.8))
    assert low["actor/pg_clipfrac_lower"] == 0.0


def test_entropy_coeff_adds_the_entropy_loss(tiny_model_dir):
    actor = make_actor(tiny_model_dir, "actor_rollout_ref.actor.entropy_coeff=0.01",
                       "actor_rollout_ref.actor.optim.lr=0.001", "actor_rollout_ref.rollout.temperature=0.7")
    batch = hand_batch()
    _, entropies = float64_logprobs(actor.model, batch, temperature=0.7)
    before = params_of(actor)
    metrics = update(actor, policy_batch(actor, torch.zeros(3, 3)))
    assert set(metrics) == PG_METRICS | {"actor/entropy_loss"}
    # token-mean over the 6 valid tokens
    assert metrics["actor/entropy_loss"] == pytest.approx(float(entropies.sum()) / VALID_TOKENS, rel=1e-5)
    # with zero advantages only the entropy bonus makes a gradient
    assert metrics["actor/pg_loss"] == 0.0 and metrics["actor/grad_norm"] > 0
    assert any(not torch.equal(v, before[k]) for k, v in actor.model.named_parameters())


# -- packed micro-batches by token budget -------------------------------------------------------------------------
# unequal_batch's sequences are 6, 7, 6, 6, 6 and 10 tokens: a budget of 17 packs rows 5, 1 (17 tokens), rows 0, 2
# (12) and rows 3, 4 (12); the padded baseline keeps its no-grad passes padded too
PACKED = ("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=17")
PADDED = ("actor_rollout_ref.rollout.log_prob_by_tokens=false",)
PACKED_SHAPES = [(1, 17), (1, 12), (1, 12)]


def unequal_policy_batch(actor: ActorWorker) -> Batch:
    batch = unequal_batch(actor.model.config.vocab_size)
    shift = 0.4 * torch.randn(6, 5, generator=torch.Generator().manual_seed(7))  # some ratios clip
    batch["old_log_probs"] = (actor.compute_log_prob(batch)["old_log_probs"] + shift) * batch["response_mask"]
    batch["ref_log_prob"] = batch["old_log_probs"] - 0.2 * shift
    batch["advantages"] = torch.randn(6, 1, generator=torch.Generator().manual_seed(8)) * batch["response_mask"]
    return batch


def record_micro_batches(monkeypatch) -> list[tuple[int, int]]:
    """(rows, width) of every micro-batch the actor's forward sees from now on."""
    shapes: list[tuple[int, int]] = []
    forward = actor_module.layout_logprobs

    def recording(model, layout, **kwargs):
        shapes.append(tuple(layout.input_ids.shape))
        return forward(model, layout, **kwargs)

    monkeypatch.setattr(actor_module, "layout_logprobs", recording)  # the update's forwards
    monkeypatch.setattr(forward_module, "layout_logprobs", recording)  # the log-prob passes'
    return shapes


def test_packed_token_budget_log_probs_equal_the_padded_ones(tiny_model_dir, monkeypatch):
    padded = make_actor(tiny_model_dir, *PADDED)
    packed = make_actor(tiny_model_dir, *PACKED)  # rollout.log_prob_* follow the actor's keys, as in verl
    batch = unequal_batch(padded.model.config.vocab_size)
    shapes = record_micro_batches(monkeypatch)
    want = padded.compute_log_prob(batch)
    assert shapes == [(6, 10)]  # left-aligned: the longest sequence (10 tokens), not the 11 padded columns
    shapes.clear()
    got = packed.compute_log_prob(batch)
    assert shapes == PACKED_SHAPES
    for key in ("old_log_probs", "entropies"):
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)
    assert torch.all(want["old_log_probs"][batch["attention_mask"][:, 6:] == 0] == 0)


def test_no_grad_log_probs_do_not_depend_on_the_grouping(tiny_model_dir, monkeypatch):
    batch = unequal_batch(320)
    one_row = make_actor(tiny_model_dir, *PADDED, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1")
    want = one_row.compute_log_prob(batch)
    shapes = record_micro_batches(monkeypatch)
    for budget in (10, 13, 24, 1000):  # every row alone (packed), ..., all six rows in one pass
        actor = make_actor(tiny_model_dir, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                           "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                           f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}")
        shapes.clear()
        got = actor.compute_log_prob(batch)
        assert sum(width for _, width in shapes) == 41 and all(rows == 1 for rows, _ in shapes)  # real tokens only
        assert len(shapes) == {10: 6, 13: 4, 24: 2, 1000: 1}[budget]
        for key in ("old_log_probs", "entropies"):
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_packed_token_budget_update_equals_the_padded_update(tiny_model_dir, monkeypatch, loss_agg_mode):
    overrides = ("actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.entropy_coeff=0.01",
                 "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
                 f"actor_rollout_ref.actor.loss_agg_mode={loss_agg_mode}")
    padded = make_actor(tiny_model_dir, *overrides, *PADDED)
    packed = make_actor(tiny_model_dir, *overrides, *PACKED)
    batch = unequal_policy_batch(padded)
    want = update(padded, batch)
    shapes = record_micro_batches(monkeypatch)
    got = update(packed, batch)
    assert shapes == PACKED_SHAPES
    assert want["actor/pg_clipfrac"] > 0 and want["actor/grad_norm"] > 0
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    after = padded.compute_log_prob(batch)["old_log_probs"]
    torch.testing.assert_close(packed.compute_log_prob(batch)["old_log_probs"], after, atol=1e-5, rtol=0)


def test_top_entropy_tokens_are_counted_in_each_token_budget_micro_batch(tiny_model_dir):
    # rows 5, 1 hold 4 + 1 learned tokens (row 5's third is tool output), rows 0, 2 hold 5 + 3 and rows 3, 4 hold
    # 2 + 4: ceil(0.3 * 5) + ceil(0.3 * 8) + ceil(0.3 * 6) = 2 + 3 + 2 tokens get policy gradient (one micro-batch:
    # ceil(0.3 * 19) = 6)
    overrides = ("actor_rollout_ref.actor.entropy_top_ratio=0.3", "actor_rollout_ref.actor.ppo_mini_batch_size=6")
    actor = make_actor(tiny_model_dir, *overrides, *PACKED)
    batch = unequal_policy_batch(actor)
    current = actor.compute_log_prob(batch)
    batch["old_log_probs"] = current["old_log_probs"]  # ratio 1: every selected token's loss is -A
    mask = batch["response_mask"]
    selected = torch.zeros_like(mask, dtype=torch.bool)
    for rows in ([5, 1], [0, 2], [3, 4]):
        selected[rows] = top_entropy_tokens(current["entropies"][rows], mask[rows], 0.3)
    metrics = update(actor, batch)
    assert metrics["actor/top_entropy_selected_tokens"] == 7.0 == float(selected.sum())
    assert metrics["actor/top_entropy_selected_frac"] == pytest.approx(7 / 19)
    assert metrics["actor/pg_loss"] == pytest.approx(-float(batch["advantages"][selected].sum()) / 7, rel=1e-5)
    whole = make_actor(tiny_model_dir, *overrides)
    assert update(whole, unequal_policy_batch(whole))["actor/top_entropy_selected_tokens"] == 6.0


def test_entropy_aware_advantage_alone_makes_the_update_compute_entropies(tiny_model_dir):
    # entropy_coeff 0 and the vanilla loss: only AEPO's advantage needs the training forward's entropies
    actor = make_actor(tiny_model_dir, "actor_rollout_ref.actor.enable_entropy_balanced_advantage=true",
                       "actor_rollout_ref.actor.optim.lr=0.0", "actor_rollout_ref.rollout.temperature=0.1")
    batch = hand_batch()
    # at temperature 0.1 the micro model's entropies spread from 1.9 to 5.1 (at 0.7 they all lie within 0.004 of
    # ln 320, and standardising would blow float32 noise up)
    _, entropies = float64_logprobs(actor.model, batch, temperature=0.1)
    valid = batch["response_mask"].bool()
    h = entropies[valid]
    scale = (1 + 0.2 * (entropies - h.mean()) / h.std()).float()  # standardised over the 6 valid tokens
    advantages = random_advantages(2)
    metrics = update(actor, policy_batch(actor, advantages))
    assert "actor/entropy_loss" not in metrics
    # ratio 1: pg_loss = -sum(A * scale) / 6
    assert metrics["actor/pg_loss"] == pytest.approx(-float((advantages * scale)[valid].sum()) / VALID_TOKENS,
                                                     abs=1e-5)
    assert metrics["actor/entropy_adv_scale_pos"] == pytest.approx(float(scale[valid & (advantages > 0)].mean()),
                                                                   rel=1e-4)
    assert metrics["actor/entropy_adv_scale_neg"] == pytest.approx(float(scale[valid & (advantages < 0)].mean()),
                                                                   rel=1e-4)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_nan_advantage_skips_the_step(tiny_model_dir):
    actor = make_actor(tiny_model_dir, "actor_rollout_ref.actor.optim.lr=0.01")
    advantages = random_advantages()
    advantages[1, 1] = float("nan")
    before = params_of(actor)
    metrics = update(actor, policy_batch(actor, advantages))
    assert not math.isfinite(metrics["actor/grad_norm"])
    assert metrics["actor/skipped_steps"] == 1.0
    assert_params_equal(actor, before)
    assert not actor.optimizer.state
    # the NaN gradients were dropped: the next finite batch steps normally
    metrics = update(actor, policy_batch(actor, random_advantages()))
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/skipped_steps"] == 0.0
    assert any(not torch.equal(v, before[k]) for k, v in actor.model.named_parameters())


# -- checkpoints -----------------------------------------------------------------------------------------------
def test_save_load_round_trip_is_exact(tiny_model_dir, tmp_path):
    actor = make_actor(tiny_model_dir, "actor_rollout_ref.actor.optim.lr=0.001",
                       "actor_rollout_ref.actor.optim.lr_warmup_steps=3")
    update(actor, policy_batch(actor, random_advantages(0)))
    update(actor, policy_batch(actor, random_advantages(1)))
    folder = tmp_path / "actor"
    actor.save(folder, load_tokenizer(tiny_model_dir))
    saved_params = params_of(actor)
    saved_optim = copy.deepcopy(actor.optimizer.state_dict())
    saved_sched = actor.scheduler.state_dict()
    next_batch = policy_batch(actor, random_advantages(2))
    update(actor, next_batch)
    after_one_more = params_of(actor)
    update(actor, policy_batch(actor, random_advantages(3)))

    actor.load(folder)
    assert_params_equal(actor, saved_params)
    state = actor.optimizer.state_dict()
    assert state["param_groups"] == saved_optim["param_groups"]
    assert state["state"].keys() == saved_optim["state"].keys()
    for index, slots in saved_optim["state"].items():
        for slot, value in slots.items():
            assert torch.equal(state["state"][index][slot], value), (index, slot)
    assert actor.scheduler.state_dict() == saved_sched
    # resuming replays the same update exactly
    update(actor, next_batch)
    assert_params_equal(actor, after_one_more)

    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    for name, value in reloaded.named_parameters():
        assert torch.equal(value, saved_params[name]), name
