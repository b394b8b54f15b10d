"""ModelOwner: one model a worker trains or holds frozen on one device. It owns the loading (dtype, device,
gradient checkpointing, LoRA through models/lora.py), the optimiser and learning-rate schedule, the checkpoint
(model folder plus optimiser state) and the stream of named weights a rollout engine takes.

The actor, the critic, the reference and the SFT trainer each hold one; the dtype rule lives here only: full
fine-tuning trains float32 master weights, LoRA trains float32 adapters on a base in the device's dtype (bf16
on a GPU), and a frozen policy is held in the device's dtype. Sharding (FSDP2, docs/architecture.md) wraps
``model`` after loading and before ``attach_optimizer``; its sharded save and load take the place of
``save_model`` / ``load_model`` (the optimiser state then goes into the same distributed checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from omegaconf import DictConfig
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from archer.models.checkpoint import load_policy, save_policy
from archer.models.loading import default_dtype, load_causal_lm, load_value_model
from archer.models.lora import LoraSettings, add_lora, policy_weights, trainable_parameters
from archer.models.optim import (
    LRSchedule,
    build_optimizer,
    build_scheduler,
    load_optim_state,
    save_optim_state,
)


class ModelOwner:
    """``model`` (with LoRA: the base model with peft's layers injected, and ``peft`` peft's wrapper of it) on
    ``device``; ``optimizer`` / ``scheduler`` once ``attach_optimizer`` ran (None for a frozen model)."""

    def __init__(self, model: PreTrainedModel, *, device: torch.device, peft: PeftModel | None = None) -> None:
        self.model = model
        self.peft = peft
        self.device = device
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None

    @classmethod
    def policy(cls, path: str | Path, *, device: torch.device, lora: LoraSettings | None,
               gradient_checkpointing: bool, trust_remote_code: bool) -> ModelOwner:
        """A causal LM to train, in train mode: float32 for full fine-tuning; with ``lora`` a base in the
        device's dtype with float32 adapters (fresh, or loaded from the settings' adapter path)."""
        model = load_causal_lm(path, device=device, dtype=torch.float32 if lora is None else default_dtype(device),
                               gradient_checkpointing=gradient_checkpointing, trust_remote_code=trust_remote_code)
        peft = add_lora(model, lora) if lora is not None else None  # injects the LoRA layers into model
        model.train()
        return cls(model, device=device, peft=peft)

    @classmethod
    def frozen_policy(cls, path: str | Path, *, device: torch.device, trust_remote_code: bool) -> ModelOwner:
        """A causal LM that only scores (the reference): the device's dtype, eval mode, no gradients."""
        model = load_causal_lm(path, device=device, dtype=default_dtype(device), trust_remote_code=trust_remote_code)
        model.eval().requires_grad_(False)
        return cls(model, device=device)

    @classmethod
    def value_model(cls, path: str | Path, *, device: torch.device, gradient_checkpointing: bool,
                    trust_remote_code: bool) -> ModelOwner:
        """The critic: the backbone with a scalar value head (models/loading.py), float32, to train."""
        model = load_value_model(path, device=device, dtype=torch.float32,
                                 gradient_checkpointing=gradient_checkpointing, trust_remote_code=trust_remote_code)
        return cls(model, device=device)

    def attach_optimizer(self, optim: DictConfig, schedule: LRSchedule) -> None:
        """AdamW over the trainable parameters (LoRA: the adapters) from ``optim``, stepped along ``schedule``."""
        self.optimizer = build_optimizer(trainable_parameters(self.model), optim)
        self.scheduler = build_scheduler(self.optimizer, schedule)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's weights as (state-dict name, tensor) pairs, LoRA layers merged: what an engine syncs."""
        return policy_weights(self.model)

    # -- checkpoints (full: one HF folder; the FSDP branch's sharded save takes these methods' place) --------
    def save_model(self, out_dir: Path, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """The model's HF folder (from_pretrained loads it); with LoRA the merged model and ``lora_adapter/``."""
        save_policy(self.model, self.peft, tokenizer, out_dir)

    def load_model(self, in_dir: Path, model_key: str) -> None:
        """Restore what ``save_model`` wrote, exactly, in place (``model_key`` names the config in errors)."""
        load_policy(self.model, self.peft, in_dir, model_key)

    def save(self, out_dir: Path, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """A checkpoint: ``save_model`` plus the optimiser and scheduler state beside it."""
        self.save_model(out_dir, tokenizer)
        save_optim_state(out_dir, self.optimizer, self.scheduler)

    def load(self, in_dir: Path, model_key: str) -> None:
        """Resume from what ``save`` wrote: the weights and the optimiser and scheduler state."""
        self.load_model(in_dir, model_key)
        load_optim_state(in_dir, self.optimizer, self.scheduler, self.device)
