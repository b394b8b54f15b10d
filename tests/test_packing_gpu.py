"""Packed micro-batches on a CUDA GPU: torch's flash varlen kernel behind archer's attention implementation (the
branch the CPU tests cannot reach), its gradients, packed log-probs against padded ones under bf16 autocast, and
the workers' no-grad token budget from the memory plan. Skipped without a GPU; run on the device machine."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from workers_support import ppo_config, unequal_batch, update

from archer.models import packed_attention as packed_attention_module
from archer.models.forward import MODEL_INPUTS
from archer.models.loading import autocast_for, load_causal_lm
from archer.models.logprobs import response_logprobs
from archer.models.micro_batches import MicroBatching
from archer.models.packed_attention import PACKED_ATTENTION, VARLEN, packed_attention, uses_flash_varlen
from archer.workers.actor import ActorWorker
from archer.workers.colocated import RankWorkers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def test_torch_has_varlen_attention_and_bf16_takes_it():
    assert VARLEN is not None, f"torch {torch.__version__} has no torch.nn.attention.varlen"
    query = torch.zeros(1, 4, 8, 64, device=CUDA, dtype=torch.bfloat16)
    assert uses_flash_varlen(query, 64 ** -0.5)
    assert not uses_flash_varlen(query.float(), 64 ** -0.5)  # float32: SDPA per sequence


@pytest.mark.parametrize("heads", [(4, 4), (12, 2)])
def test_flash_varlen_equals_sdpa_per_sequence_with_gradients(heads):
    q_heads, kv_heads = heads
    lengths = [1, 300, 17, 64]
    total = sum(lengths)
    gen = torch.Generator(device=CUDA).manual_seed(0)

    def leaf(h):
        return torch.randn(1, h, total, 64, device=CUDA, dtype=torch.bfloat16, generator=gen).requires_grad_()

    query, key, value = leaf(q_heads), leaf(kv_heads), leaf(kv_heads)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    out, _ = packed_attention(None, query, key, value, None, scaling=64 ** -0.5, cu_seq_lens_q=cu,
                              max_length_q=max(lengths))
    weights = torch.randn(out.shape, device=CUDA, dtype=torch.bfloat16, generator=gen)
    grads = torch.autograd.grad((out.float() * weights).sum(), (query, key, value))
    want, start = [], 0
    for length in lengths:  # the reference: float32 SDPA on each sequence alone
        part = slice(start, start + length)
        repeat = q_heads // kv_heads
        want.append(F.scaled_dot_product_attention(
            query[:, :, part].float(), key[:, :, part].float().repeat_interleave(repeat, 1),
            value[:, :, part].float().repeat_interleave(repeat, 1), is_causal=True).transpose(1, 2))
        start += length
    want = torch.cat(want, dim=1)
    want_grads = torch.autograd.grad((want * weights.float()).sum(), (query, key, value))
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)
    for got, expected in zip(grads, want_grads, strict=True):  # bf16 rounding, measured over the whole tensor
        assert float((got.float() - expected.float()).norm() / expected.float().norm()) < 2e-2


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_log_probs_and_gradients_match_padded_ones_under_autocast(tiny_model_dir, checkpointing, monkeypatch):
    flash_calls = []
    flash = packed_attention_module._flash_varlen
    monkeypatch.setattr(packed_attention_module, "_flash_varlen", lambda *a: flash_calls.append(1) or flash(*a))
    model = load_causal_lm(tiny_model_dir, device=CUDA, gradient_checkpointing=checkpointing).train()
    assert model.config._attn_implementation == PACKED_ATTENTION  # transformers on this image takes it
    batch = unequal_batch(model.config.vocab_size).to(CUDA)
    rows = (*(batch[k] for k in MODEL_INPUTS), 5)
    results = []
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        with autocast_for(CUDA):
            logp, entropy = response_logprobs(model, *rows, packed=packed)
        (logp.sum() + entropy.sum()).backward()
        results.append((logp.detach(), entropy.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (logp, entropy, grad), (packed_logp, packed_entropy, packed_grad) = results
    layers = model.config.num_hidden_layers
    assert len(flash_calls) == (2 if checkpointing else 1) * layers  # every packed layer ran the flash kernel
    torch.testing.assert_close(packed_logp, logp, atol=3e-2, rtol=0)  # bf16 matrix products, other kernels
    torch.testing.assert_close(packed_entropy, entropy, atol=3e-2, rtol=0)
    assert float((packed_grad - grad).norm() / grad.norm()) < 2e-2


def test_the_actor_packs_its_no_grad_pass_to_the_memory_plans_budget(tiny_model_dir, caplog):
    cfg = ppo_config(tiny_model_dir, "actor_rollout_ref.rollout.name=hf", "trainer.device=cuda",
                     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1")
    rank = RankWorkers(cfg, total_steps=1, use_ref=False, use_critic=False)  # the plan is the rank's
    actor = rank.actor
    planned = rank.memory_plan.no_grad_tokens()
    assert actor.log_prob_micro == MicroBatching(None, planned, packed=True) and planned >= 2048
    assert "log_prob_micro_batch_size_per_gpu=1 is not used" in caplog.text
    kept = ActorWorker(ppo_config(tiny_model_dir, "actor_rollout_ref.rollout.name=hf",
                                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                                  "actor_rollout_ref.rollout.log_prob_by_tokens=false").actor_rollout_ref,
                       device=CUDA, total_steps=1)
    assert kept.log_prob_micro == MicroBatching(1, None, packed=False)
    batch = unequal_batch(actor.model.config.vocab_size)
    got, want = actor.compute_log_prob(batch), kept.compute_log_prob(batch)
    for key in ("old_log_probs", "entropies"):
        torch.testing.assert_close(got[key], want[key], atol=3e-2, rtol=0)


ACTOR = "actor_rollout_ref.actor"
# the losses whose per-micro-batch numbers or token selections could read back: ASPO with its split KL and the
# entropy term (class means and shares), the top-entropy tokens (a count), KL-Cov and Clip-Cov (a count, a draw)
WAIT_FREE_LOSSES = {
    "aspo": (f"{ACTOR}.policy_loss.loss_mode=aspo", f"{ACTOR}.use_kl_loss=true",
             f"{ACTOR}.high_entropy_kl_loss_scale_coef=0.5", f"{ACTOR}.entropy_coeff=0.001"),
    "top_entropy": (f"{ACTOR}.entropy_top_ratio=0.2",),
    "kl_cov": (f"{ACTOR}.policy_loss.loss_mode=kl_cov", f"{ACTOR}.policy_loss.kl_cov_ratio=0.05"),
    "clip_cov": (f"{ACTOR}.policy_loss.loss_mode=clip_cov", f"{ACTOR}.policy_loss.clip_cov_ratio=0.05",
                 f"{ACTOR}.policy_loss.clip_cov_lb=-10.0", f"{ACTOR}.policy_loss.clip_cov_ub=10.0"),
}


def host_waits(call):
    """What ``call`` returns and where it made the host wait for the GPU (file:line of each wait)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return result, [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("loss", list(WAIT_FREE_LOSSES))
def test_the_update_waits_for_the_gpu_once_a_mini_batch_not_once_a_micro_batch(tiny_model_dir, loss):
    """Reading a value back from the GPU (a boolean index, a copy from pageable memory, a tensor made a Python
    number) makes the host wait for all the work queued before it, and the GPU then idles while the host queues
    what follows: the update's packed micro-batches do none of it, so six micro-batches wait as often as two (the
    gradient norm and the metrics, once a mini-batch)."""
    overrides = ("actor_rollout_ref.rollout.name=hf", f"{ACTOR}.ppo_mini_batch_size=6",
                 "actor_rollout_ref.model.use_remove_padding=true", f"{ACTOR}.use_torch_compile=false",
                 *WAIT_FREE_LOSSES[loss])
    waits = {}
    for rows in (1, 3):
        actor = ActorWorker(ppo_config(tiny_model_dir, *overrides, f"{ACTOR}.ppo_micro_batch_size_per_gpu={rows}")
                            .actor_rollout_ref, device=CUDA, total_steps=10)
        batch = unequal_batch(actor.model.config.vocab_size)
        batch["old_log_probs"] = actor.compute_log_prob(batch)["old_log_probs"]
        batch["ref_log_prob"] = batch["old_log_probs"] - 0.1 * batch["response_mask"]
        batch["advantages"] = torch.randn(6, 1, generator=torch.Generator().manual_seed(2)) * batch["response_mask"]
        update(actor, batch)  # the libraries' first calls
        metrics, waits[rows] = host_waits(lambda actor=actor, batch=batch: update(actor, batch))
        assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    assert 0 < len(waits[1]) == len(waits[3]) <= 4, waits


@pytest.mark.parametrize("packed", [False, True])
def test_sft_micro_batches_wait_for_the_gpu_once_a_batch(tiny_model_dir, packed):
    """SFT's batch stays on the host and each micro-batch is laid out there (``ScoredRows``): three passes wait as
    often as one, once, for the losses."""
    from archer.data.sft_dataset import collate_sft, pack_sft
    from archer.trainer.sft import sft_backward

    model = load_causal_lm(tiny_model_dir, device=CUDA, gradient_checkpointing=True).train()
    gen = torch.Generator().manual_seed(0)
    items = [{"input_ids": torch.randint(3, model.config.vocab_size, (n,), generator=gen),
              "loss_mask": (torch.arange(n) >= n // 3).long()} for n in (40, 7, 23, 31, 12, 5)]
    batch = pack_sft(items, 0, capacity=48) if packed else collate_sft(items, 0)
    assert len(batch) >= 3
    waits = {}
    for micro in (1, len(batch)):
        sft_backward(model, batch, micro)  # the libraries' first calls
        (loss, _), waits[micro] = host_waits(lambda micro=micro: sft_backward(model, batch, micro))
        assert math.isfinite(loss)
    assert 0 < len(waits[1]) == len(waits[len(batch)]) <= 1, waits  # the losses, read back once
