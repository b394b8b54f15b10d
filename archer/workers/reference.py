"""The reference worker: the initial policy, frozen, that scores responses for KL. Without LoRA it holds its own
copy of the model; with LoRA it is the actor's module with the adapters off (the base), so no second copy: the
actor builds it then (``ActorWorker.make_reference``), the two being colocated."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from archer.batch import Batch
from archer.distributed.context import DistContext
from archer.models import liger
from archer.models.compiled_layers import REF_KEY, maybe_compile_layers
from archer.models.forward import compute_log_probs
from archer.models.lora import base_policy
from archer.models.micro_batches import LOG_PROB, no_grad_micro_batching
from archer.models.owner import ModelOwner
from archer.models.packed_attention import supports_packing
from archer.workers.data_parallel import PassShare, own_passes
from archer.workers.dispatch import collect, concat_batches
from archer.workers.memory import MemoryPlan, planned_no_grad_tokens


class ReferenceWorker:
    """Holds the frozen reference model (bf16 on GPU) and computes ``ref_log_prob``. ``lora_policy``: the
    actor's LoRA policy, whose base (adapters off) is the reference."""

    def __init__(self, cfg: DictConfig, *, device: torch.device, lora_policy: ModelOwner | None = None,
                 ctx: DistContext | None = None) -> None:
        """``ctx``: the rank of a data-parallel run (default: one process on ``device``); the reference's own
        copy is then sharded with FSDP2 too (with its shards in host memory, as verl's, under
        ref.fsdp_config.param_offload)."""
        self.cfg = cfg
        self.device = device
        self.ctx = ctx if ctx is not None else DistContext.single(device)
        self.lora_policy = lora_policy
        self.owner: ModelOwner | None = None  # its own copy (None with LoRA: the actor's module)
        if lora_policy is not None:
            self.model = lora_policy.peft.get_base_model()
        else:
            self.owner = ModelOwner.frozen_policy(cfg.model.path, device=device,
                                                  trust_remote_code=bool(cfg.model.trust_remote_code), ctx=self.ctx,
                                                  liger_key=liger.RL_KEY if cfg.model.use_liger else None)
            if self.ctx.distributed:
                self.owner.shard(self.ctx, cfg.ref.fsdp_config, cpu_offload=bool(cfg.ref.fsdp_config.param_offload))
            self.model = self.owner.model
            maybe_compile_layers(self.model, device, enabled=bool(cfg.ref.use_torch_compile),
                                 liger=bool(cfg.model.use_liger), key=REF_KEY, announce=False)
        self.temperature = float(cfg.rollout.temperature)
        self.plan_micro_batches(None, announce=False)

    def plan_micro_batches(self, memory_plan: MemoryPlan | None, *, announce: bool) -> None:
        """The pass's micro-batches: the ref section's keys and, on a GPU, the memory plan's token budget
        (models/micro_batches.py); ``announce``: this process speaks for the run."""
        self.micro = no_grad_micro_batching(
            self.cfg.ref, "actor_rollout_ref.ref", LOG_PROB, remove_padding=bool(self.cfg.model.use_remove_padding),
            can_pack=supports_packing(self.model), planned_tokens=planned_no_grad_tokens(memory_plan, self.model),
            announce=announce)

    @collect(concat_batches, split=own_passes("micro"))
    def compute_ref_log_prob(self, share: PassShare) -> Batch:
        """The reference's log-probs of this rank's rows (called with the whole batch)."""
        with base_policy(None if self.lora_policy is None else self.lora_policy.peft):
            logp, _ = compute_log_probs(self.model, share.batch, temperature=self.temperature, micro=self.micro,
                                        chunk_size=self.cfg.actor.logprob_chunk_size, device=self.device,
                                        compute_entropy=False, parts=share.passes.parts)
        return Batch({"ref_log_prob": share.own(logp)})
