"""The generation worker: a policy that only generates (``archer eval``, ``trainer.val_only``).

It loads the model of a folder (a Hugging Face folder, or an archer checkpoint: ``global_step_N`` or its
``actor/``) in evaluation mode, float32 master weights as the actor's (so its answers are the actor's), and
generates through the same rollout worker (engine and multi-turn tool loop) as the ActorWorker; no optimiser,
no reference, no critic. ``model.lora_adapter_path`` puts those adapters on ``model.path`` (as the actor does).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from archer.batch import Batch
from archer.errors import ArcherError
from archer.models.loading import load_causal_lm
from archer.models.lora import LoraSettings, add_lora
from archer.rollout.factory import build_engine
from archer.workers.rollout import RolloutWorker

CHECKPOINT_ACTOR = "actor"  # a checkpoint folder's HF model sub-folder


def resolve_model_folder(path: str | Path) -> Path:
    """The HF model folder of ``path``: itself when it holds config.json, or its ``actor/`` (an archer checkpoint
    folder); an error otherwise."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ArcherError(f"model folder {folder} does not exist" if not folder.exists() else
                          f"model path {folder} is a file, not a folder",
                          "pass a Hugging Face model folder or an archer checkpoint (<run>/checkpoints/global_step_N)")
    for candidate in (folder, folder / CHECKPOINT_ACTOR):
        if (candidate / "config.json").is_file():
            return candidate
    raise ArcherError(f"{folder} is not a model: it has no config.json (nor an archer checkpoint's actor/config.json)",
                      "pass a Hugging Face model folder (config.json, weights, tokenizer) or an archer checkpoint "
                      "folder <run>/checkpoints/global_step_N")


class GenerationWorker:
    """The model of ``model_path`` on ``device`` with its rollout (``cfg``: actor_rollout_ref)."""

    def __init__(self, cfg: DictConfig, model_path: str | Path, *, device: torch.device,
                 tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.model_path = resolve_model_folder(model_path)
        self.model = load_causal_lm(self.model_path, device=device, dtype=torch.float32,
                                    trust_remote_code=bool(cfg.model.trust_remote_code))
        lora = LoraSettings.from_config(cfg.model)
        # model.lora_adapter_path applies to model.path (a checkpoint's actor/ already holds its merged adapters)
        if lora is not None and lora.adapter_path is not None and self.model_path == resolve_model_folder(cfg.model.path):
            add_lora(self.model, lora)
        self.model.eval()
        self.rollout = RolloutWorker(build_engine(cfg.rollout, self.model, tokenizer, device), cfg.rollout,
                                     device=device, tokenizer=tokenizer, chat_template=cfg.model.custom_chat_template,
                                     template_kwargs=chat_template_kwargs)

    def generate_sequences(self, prompts: Batch) -> Batch:
        """As ActorWorker.generate_sequences (with tools configured, through the multi-turn tool loop)."""
        return self.rollout.generate_for(prompts)
