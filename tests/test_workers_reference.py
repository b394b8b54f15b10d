"""ReferenceWorker on the micro model: the frozen initial policy scores responses exactly as the actor did."""

from __future__ import annotations

import torch
from workers_support import float64_logprobs, hand_batch, ppo_config, unequal_batch, update

from archer.models.micro_batches import MicroBatching
from archer.workers.actor import ActorWorker
from archer.workers.reference import ReferenceWorker

CPU = torch.device("cpu")


def test_ref_log_prob_equals_the_initial_actor_and_stays_frozen(tiny_model_dir):
    cfg = ppo_config(tiny_model_dir, "actor_rollout_ref.rollout.temperature=0.7",
                     "actor_rollout_ref.actor.optim.lr=0.01", "actor_rollout_ref.actor.ppo_mini_batch_size=3")
    actor = ActorWorker(cfg.actor_rollout_ref, device=CPU, total_steps=10)
    ref = ReferenceWorker(cfg.actor_rollout_ref, device=CPU)
    assert next(ref.model.parameters()).dtype == torch.float32
    assert not any(p.requires_grad for p in ref.model.parameters())
    assert not ref.model.training

    batch = hand_batch()
    old = actor.compute_log_prob(batch)["old_log_probs"]
    out = ref.compute_ref_log_prob(batch)
    assert list(out.tensors) == ["ref_log_prob"]
    torch.testing.assert_close(out["ref_log_prob"], old, atol=1e-7, rtol=0)

    # the actor learns; the reference does not
    batch["old_log_probs"] = old
    batch["advantages"] = torch.randn(3, 3, generator=torch.Generator().manual_seed(0)) * batch["response_mask"]
    update(actor, batch)
    assert not torch.allclose(actor.compute_log_prob(batch)["old_log_probs"], old, atol=1e-4)
    torch.testing.assert_close(ref.compute_ref_log_prob(batch)["ref_log_prob"], old, atol=1e-7, rtol=0)


def test_ref_log_prob_matches_a_float64_forward_and_micro_batches_agree(tiny_model_dir):
    whole = ReferenceWorker(ppo_config(tiny_model_dir).actor_rollout_ref, device=CPU)
    micro_cfg = ppo_config(tiny_model_dir, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1")
    micro = ReferenceWorker(micro_cfg.actor_rollout_ref, device=CPU)
    batch = hand_batch()
    expected = whole.compute_ref_log_prob(batch)["ref_log_prob"]
    reference, _ = float64_logprobs(whole.model, batch, temperature=1.0)
    torch.testing.assert_close(expected.double(), reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(micro.compute_ref_log_prob(batch)["ref_log_prob"], expected, atol=1e-6, rtol=0)
    assert torch.all(expected[~batch["response_mask"].bool()] == 0)


def test_packed_token_budget_ref_log_prob_equals_the_padded_one(tiny_model_dir):
    padded_cfg = ppo_config(tiny_model_dir, "actor_rollout_ref.ref.log_prob_by_tokens=false")
    padded = ReferenceWorker(padded_cfg.actor_rollout_ref, device=CPU)
    assert padded.micro == MicroBatching(None, None, packed=False)
    default = ReferenceWorker(ppo_config(tiny_model_dir).actor_rollout_ref, device=CPU)
    assert default.micro == MicroBatching(None, 16384, packed=True)  # by tokens unless told otherwise
    packed_cfg = ppo_config(tiny_model_dir, "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
                            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=12")
    packed = ReferenceWorker(packed_cfg.actor_rollout_ref, device=CPU)
    batch = unequal_batch(padded.model.config.vocab_size)
    # sequences of 6, 7, 6, 6, 6 and 10 tokens, packed first-fit within 12: 10 | 7 | 6 6 | 6 6
    assert [len(part) for part in packed.micro.split(batch["attention_mask"])] == [1, 1, 2, 2]
    want = padded.compute_ref_log_prob(batch)["ref_log_prob"]
    torch.testing.assert_close(packed.compute_ref_log_prob(batch)["ref_log_prob"], want, atol=1e-5, rtol=0)
    torch.testing.assert_close(default.compute_ref_log_prob(batch)["ref_log_prob"], want, atol=1e-5, rtol=0)
    reference, _ = float64_logprobs(padded.model, batch, 1.0)  # 0 outside response_mask (row 5's tool token)
    torch.testing.assert_close((want * batch["response_mask"]).double(), reference, atol=1e-5, rtol=0)
