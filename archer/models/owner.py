"""ModelOwner: one model a worker trains or holds frozen on one device. It owns the loading (dtype, device,
gradient checkpointing, LoRA through models/lora.py), the optimiser and learning-rate schedule with its clipped
step, the offload of weights and optimiser state to host memory (verl's ``param_offload`` /
``optimizer_offload``, models/offload.py), the checkpoint (model folder plus optimiser state), the stream of
named weights a rollout engine takes, and what the model keeps on its card (``card_bytes``, for the rank's
memory plan).

The actor, the critic, the reference and the SFT trainer each hold one; the dtype rule lives here only: full
fine-tuning trains float32 master weights, LoRA trains float32 adapters on a base in the device's dtype (bf16
on a GPU), and a frozen policy is held in the device's dtype.

At world > 1 ``shard`` wraps ``model`` with FSDP2 (archer/distributed/fsdp.py) after loading and before
``attach_optimizer``. A sharded owner's checkpoint is then a distributed checkpoint of the trainable weights and
the optimiser (``dcp/``, read back at any world size) beside the HF export of the whole model and the schedule's
state; an unsharded owner reads it too (a run resumed on fewer ranks), and a sharded owner reads the
single-process checkpoint (a run resumed on more ranks).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from omegaconf import DictConfig
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from archer.distributed.context import DistContext
from archer.distributed.fsdp import load_from_rank0, shard_model
from archer.distributed.shard_buckets import ShardGather, gatherable
from archer.distributed.sharded_checkpoint import load_full_state, load_sharded, save_sharded
from archer.distributed.weight_sync import WeightManifest, packed_buckets
from archer.errors import ArcherError
from archer.models.hf_checkpoint import load_policy, save_policy
from archer.models.liger import apply_liger
from archer.models.loading import default_dtype, load_causal_lm, load_value_model, parse_dtype
from archer.models.lora import (
    LoraSettings,
    add_lora,
    plain_policy_parameters,
    policy_weight_shapes,
    policy_weights,
    save_merged,
    trainable_parameters,
)
from archer.models.offload import Offload
from archer.models.optim import (
    OPTIM_STATE,
    LRSchedule,
    allocate_adam_states,
    build_optimizer,
    build_scheduler,
    clip_and_step,
    load_optim_state,
    save_optim_state,
)


class ModelOwner:
    """``model`` (with LoRA: the base model with peft's layers injected, and ``peft`` peft's wrapper of it) on
    ``device``; ``optimizer`` / ``scheduler`` / ``offload`` once ``attach_optimizer`` ran (None for a frozen
    model)."""

    def __init__(self, model: PreTrainedModel, *, device: torch.device, peft: PeftModel | None = None) -> None:
        self.model = model
        self.peft = peft
        self.device = device
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.offload: Offload | None = None
        self.ctx = DistContext.single(device)  # ``shard`` replaces it at world > 1
        # Sharded loading (``load_on``): rank 0 read the weights into host memory, the other ranks hold the
        # architecture on the meta device; ``shard`` then hands every rank its shards from rank 0.
        self.from_rank0 = False

    @property
    def sharded(self) -> bool:
        return self.ctx.distributed

    def shard(self, ctx: DistContext, fsdp_config: DictConfig, *, cpu_offload: bool = False) -> None:
        """Shard the model over ``ctx``'s ranks with FSDP2 (nothing at world 1); before ``attach_optimizer``.
        ``fsdp_config``: verl's block, whose ``mixed_precision`` gives the layers' compute and gradient-reduction
        dtypes on GPUs (float32 on the CPU); ``cpu_offload``: shards, gradients and optimiser state in host
        memory (verl's param_offload / optimizer_offload under FSDP)."""
        if self.optimizer is not None:
            raise RuntimeError("shard the model before attach_optimizer")
        param_dtype, reduce_dtype = compute_dtypes(fsdp_config, ctx.device)
        source = self.model.state_dict() if self.from_rank0 and ctx.is_main else {}
        buffers = dict(self.model.named_buffers()) if self.from_rank0 and ctx.is_main else {}
        shard_model(self.model, ctx, param_dtype=param_dtype, reduce_dtype=reduce_dtype, cpu_offload=cpu_offload)
        if self.from_rank0:
            load_from_rank0(self.model, source, buffers, ctx, cpu_offload=cpu_offload)
            self.from_rank0 = False
        self.ctx = ctx

    @classmethod
    def policy(cls, path: str | Path, *, device: torch.device, lora: LoraSettings | None,
               gradient_checkpointing: bool, trust_remote_code: bool,
               master_dtype: torch.dtype = torch.float32, ctx: DistContext | None = None,
               liger_key: str | None = None) -> ModelOwner:
        """A causal LM to train, in train mode: ``master_dtype`` (verl's fsdp_config.model_dtype, float32 by
        default) for full fine-tuning; with ``lora`` a base in the device's dtype with float32 adapters (fresh,
        or loaded from the settings' adapter path). ``ctx``: the rank of a sharded run (see ``load_on``; every
        rank reads a LoRA base, whose adapters peft makes on each). ``liger_key``: the model.use_liger key that
        is on (liger's kernels for ``device``, models/liger.py; applied before any LoRA layer)."""
        ctx = ctx if lora is None else None  # every rank reads a LoRA base (peft makes the adapters on each)
        on, empty = load_on(device, ctx)
        model = load_causal_lm(path, device=on, dtype=master_dtype if lora is None else default_dtype(device),
                               gradient_checkpointing=gradient_checkpointing, trust_remote_code=trust_remote_code,
                               empty=empty)
        if liger_key is not None:
            apply_liger(model, device, liger_key)
        peft = add_lora(model, lora) if lora is not None else None  # injects the LoRA layers into model
        model.train()
        return cls(model, device=device, peft=peft)._loaded_by(ctx)

    @classmethod
    def frozen_policy(cls, path: str | Path, *, device: torch.device, trust_remote_code: bool,
                      ctx: DistContext | None = None, liger_key: str | None = None) -> ModelOwner:
        """A causal LM that only scores (the reference): the device's dtype, eval mode, no gradients;
        ``liger_key`` as for ``policy``."""
        on, empty = load_on(device, ctx)
        model = load_causal_lm(path, device=on, dtype=default_dtype(device), trust_remote_code=trust_remote_code,
                               empty=empty)
        if liger_key is not None:
            apply_liger(model, device, liger_key)
        model.eval().requires_grad_(False)
        return cls(model, device=device)._loaded_by(ctx)

    @classmethod
    def value_model(cls, path: str | Path, *, device: torch.device, gradient_checkpointing: bool,
                    trust_remote_code: bool, master_dtype: torch.dtype = torch.float32,
                    ctx: DistContext | None = None) -> ModelOwner:
        """The critic: the backbone with a scalar value head (models/loading.py), in ``master_dtype`` (float32
        by default), to train; its new head is rank 0's on every rank."""
        on, empty = load_on(device, ctx)
        model = load_value_model(path, device=on, dtype=master_dtype, gradient_checkpointing=gradient_checkpointing,
                                 trust_remote_code=trust_remote_code, empty=empty)
        return cls(model, device=device)._loaded_by(ctx)

    def _loaded_by(self, ctx: DistContext | None) -> ModelOwner:
        self.from_rank0 = ctx is not None and ctx.distributed
        return self

    def attach_optimizer(self, optim: DictConfig, schedule: LRSchedule, *, param_offload: bool = False,
                         optimizer_offload: bool = False) -> None:
        """AdamW over the trainable parameters (LoRA: the adapters) from ``optim``, stepped along ``schedule``.
        ``param_offload`` / ``optimizer_offload`` (verl's keys): on one device the weights live in host memory
        while an engine generates (``offload.params_to_host``) and Adam's states except during ``step``; a
        sharded model has FSDP2's CPU offload instead (``shard``'s ``cpu_offload``), so they do nothing here."""
        self.optimizer = build_optimizer(trainable_parameters(self.model), optim)
        if self.device.type == "cuda" and not optimizer_offload:  # before any activation: see allocate_adam_states
            allocate_adam_states(self.optimizer)
        self.scheduler = build_scheduler(self.optimizer, schedule)
        self.offload = Offload(self.model.parameters(), self.optimizer, self.device,
                               param_offload=param_offload and not self.sharded,
                               optimizer_offload=optimizer_offload and not self.sharded)

    def step(self, grad_clip: float, *, step: bool = True) -> tuple[float, bool]:
        """The optimiser step on the accumulated gradients: clipped to ``grad_clip`` (by the global norm when
        sharded), taken when the norm is finite (and ``step``), gradients zeroed; Adam's states on the device
        for it when they are offloaded. Returns (grad_norm, stepped)."""
        with self.offload.optimizer_step():
            return clip_and_step(self.model, self.optimizer, grad_clip, step=step)

    def card_bytes(self) -> int:
        """Bytes the model keeps on its device, for the rank's memory plan: its weights and, once an optimiser
        is attached, the gradients and Adam's two states of its trainable parameters (float32: 12 bytes each);
        sharded over N ranks, 1/N of that."""
        weights, trainable = model_bytes(self.model)
        held = weights + (12 * trainable if self.optimizer is not None else 0)
        return -(-held // self.ctx.world_size)

    def weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's weights as (state-dict name, tensor) pairs, LoRA layers merged: what an engine syncs
        (``dtype``: cast to it before any gather). Sharded, each is gathered in turn: every rank must read the
        whole stream."""
        return policy_weights(self.model, dtype)

    def weight_buckets(self, manifest: WeightManifest, *, pack: bool) -> Iterator[torch.Tensor | None]:
        """The policy's weights in ``manifest``'s flat buckets and dtype, for the weight sync (every rank reads
        it to its end; ``pack``: this rank sends, the others get None for each bucket). Sharded without LoRA,
        each bucket is one gather of every rank's shards (distributed/shard_buckets.py: the sender is rank 0);
        otherwise ``weights``'s stream is packed."""
        params = plain_policy_parameters(self.model)
        if self.sharded and params is not None and gatherable(params):
            return ShardGather(params, manifest, self.ctx.device).buckets()
        return packed_buckets(self.weights(manifest.dtype), manifest, self.ctx.device, pack=pack)

    def weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``weights``'s names and whole shapes in its order, with nothing gathered."""
        return policy_weight_shapes(self.model)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def save_model(self, out_dir: Path, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """The model's HF folder (from_pretrained loads it); with LoRA the merged model (and, unsharded,
        ``lora_adapter/``). Sharded, every rank calls it and rank 0 writes."""
        if self.sharded:
            save_merged(self.model, tokenizer, out_dir, self.ctx)
        else:
            save_policy(self.model, self.peft, tokenizer, out_dir)

    def load_model(self, in_dir: Path, model_key: str) -> None:
        """Restore what ``save_model`` wrote (unsharded), exactly, in place (``model_key`` names the config in
        errors)."""
        load_policy(self.model, self.peft, in_dir, model_key)

    def save(self, out_dir: Path, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """A checkpoint: ``save_model`` plus the optimiser and scheduler state (sharded: ``dcp/`` holds the
        trainable weights and the optimiser, ``schedule.pt`` the scheduler)."""
        self.save_model(out_dir, tokenizer)
        if not self.sharded:
            save_optim_state(out_dir, self.optimizer, self.scheduler)
            return
        save_sharded(out_dir / SHARDED_DIR, self.model, self.optimizer, self.ctx)
        if self.ctx.is_main:
            torch.save(self.scheduler.state_dict(), out_dir / SCHEDULE_STATE)
        self.ctx.barrier()

    def load(self, in_dir: Path, model_key: str) -> None:
        """Resume from what ``save`` wrote, whichever number of ranks wrote it: the weights and the optimiser
        and scheduler state."""
        if (in_dir / SHARDED_DIR).is_dir():
            load_sharded(in_dir / SHARDED_DIR, self.model, self.optimizer, self.ctx)
            self.scheduler.load_state_dict(torch.load(in_dir / SCHEDULE_STATE, weights_only=True))
        elif not self.sharded:
            self.load_model(in_dir, model_key)
            load_optim_state(in_dir, self.optimizer, self.scheduler, self.device)
            self.offload.optimizer_to_host()
        elif self.peft is not None:
            raise ArcherError(f"{in_dir} is a single-device LoRA checkpoint; resuming it on several ranks is not "
                              "supported", f"resume it with trainer.n_gpus_per_node=1 trainer.nnodes=1, or start "
                              f"from its merged model: {model_key}.path={in_dir}")
        else:
            state = torch.load(in_dir / OPTIM_STATE, map_location="cpu", weights_only=True)
            load_full_state(in_dir, self.model, self.optimizer, state["optimizer"], self.ctx)
            self.scheduler.load_state_dict(state["scheduler"])


class OwnsModel:
    """A worker whose model, optimiser and schedule are its ``owner``'s (the actor's and the critic's)."""

    owner: ModelOwner

    @property
    def model(self) -> PreTrainedModel:
        """The trained module (with LoRA: the base model with peft's layers injected)."""
        return self.owner.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.owner.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self.owner.scheduler


def model_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of every parameter, number of trainable parameters) of the whole model (a sharded model's
    global sizes); tied weights count once."""
    params = list(model.parameters())
    return (sum(p.numel() * p.element_size() for p in params),
            sum(p.numel() for p in params if p.requires_grad))


def load_on(device: torch.device, ctx: DistContext | None) -> tuple[torch.device, bool]:
    """Where a model's weights are read and whether the rank builds an empty (meta) model instead: in one
    process onto ``device``; in a sharded run rank 0 reads them into host memory (one copy in the run, not per
    rank) and the others read nothing, ``ModelOwner.shard`` then sending each rank its shards."""
    if ctx is None or not ctx.distributed:
        return device, False
    return torch.device("cpu"), not ctx.is_main


def compute_dtypes(fsdp_config: DictConfig, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(compute, gradient-reduction) dtypes of a sharded model from verl's ``fsdp_config.mixed_precision``
    (bf16 / fp32 by default); float32 for both on the CPU."""
    if device.type != "cuda":
        return torch.float32, torch.float32
    mixed = fsdp_config.get("mixed_precision") or {}
    return (parse_dtype(mixed.get("param_dtype", "bf16"), "fsdp_config.mixed_precision.param_dtype"),
            parse_dtype(mixed.get("reduce_dtype", "fp32"), "fsdp_config.mixed_precision.reduce_dtype"))


SHARDED_DIR = "dcp"  # a sharded checkpoint's distributed checkpoint (trainable weights and optimiser state)
SCHEDULE_STATE = "schedule.pt"  # a sharded checkpoint's learning-rate schedule state
