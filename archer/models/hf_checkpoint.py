"""A model's full (single-file-set) checkpoint: the HF folder a policy or value model is saved to and restored
from, in place. With LoRA the folder holds the merged model and ``lora_adapter/`` the adapters (what resuming
loads). These are the unsharded formats; a sharded (FSDP) save writes beside them (see docs/architecture.md)."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerBase

from archer.errors import ArcherError
from archer.models.loading import save_hf
from archer.models.lora import has_adapter, load_adapter, save_adapter, save_merged


def save_policy(model: torch.nn.Module, peft: PeftModel | None, tokenizer: PreTrainedTokenizerBase | None,
                out_dir: Path) -> None:
    """A policy's HF folder (loadable with from_pretrained): the model, or with LoRA the merged model plus
    ``lora_adapter/`` (what resuming loads). Used by the RL actor and SFT checkpoints alike."""
    if peft is None:
        save_hf(model, tokenizer, out_dir)
    else:
        save_merged(model, tokenizer, out_dir)
        save_adapter(peft, out_dir)


def load_policy(model: torch.nn.Module, peft: PeftModel | None, in_dir: Path, model_key: str) -> None:
    """Restore what ``save_policy`` wrote into the same kind of policy (exact, in place); a LoRA checkpoint
    into a full fine-tuning policy is an error naming ``model_key``'s lora settings."""
    if peft is not None:
        load_adapter(peft, in_dir)
    elif has_adapter(in_dir):
        raise ArcherError(f"{in_dir} was written by a LoRA run, and {model_key}.lora_rank=0",
                          "resume with the lora_rank, lora_alpha and target_modules of that run (its "
                          f"config.yaml), or start from its merged model: {model_key}.path={in_dir}")
    else:
        load_weights(model, in_dir)


def load_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load the safetensors weights that save_hf wrote into an existing model (exact, in place)."""
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k and getattr(model.config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"checkpoint {folder} does not match the model: missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")
