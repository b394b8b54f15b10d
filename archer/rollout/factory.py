"""Which generation engine `actor_rollout_ref.rollout.name` builds, on the actor's model."""

from __future__ import annotations

import logging

import torch
from omegaconf import DictConfig
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from archer.errors import ArcherError
from archer.rollout.base import RolloutEngine
from archer.rollout.hf_engine import HFGenerateEngine

log = logging.getLogger("archer.rollout")

ENGINE_NAMES = ("hf",)
VERL_ENGINE_NAMES = ("vllm", "sglang")  # verl's engines: archer generates with its own and says so


def check_engine_name(name: str) -> None:
    """Refuse an engine archer does not have (before any model loads); warn about verl's names."""
    if name in VERL_ENGINE_NAMES:
        log.warning("rollout.name=%s: archer generates with its Hugging Face engine (hf); the %s-specific "
                    "rollout keys are accepted and ignored", name, name)
    elif name not in ENGINE_NAMES:
        raise ArcherError(f"unknown rollout engine {name!r}",
                          f"set actor_rollout_ref.rollout.name to one of: {', '.join(ENGINE_NAMES)}")


def build_engine(rollout: DictConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 device: torch.device) -> RolloutEngine:
    """The engine named by ``rollout.name`` (checked by ``check_engine_name``), generating with ``model``."""
    return HFGenerateEngine(model, tokenizer, device=device, max_batch_size=int(rollout.max_batch_size))
