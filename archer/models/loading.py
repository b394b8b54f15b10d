"""Loading and saving Hugging Face models and tokenizers: device and dtype choice, the policy (causal LM),
the critic (backbone + scalar value head), the reward model (sequence classification), and clear errors for
every way a model folder can be broken. Every model loads with archer's attention implementation: transformers'
SDPA, plus packed rows (models/packed_attention.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from archer.errors import ArcherError
from archer.models.moe import use_grouped_experts
from archer.models.packed_attention import use_packed_attention

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
VALUE_HEAD_INIT_STD = 1e-3
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, SafetensorError)


DEVICE_TYPES = ("cpu", "cuda")


def check_device_name(preferred: str) -> torch.device | None:
    """The device 'cpu' / 'cuda' / 'cuda:N' names (None for 'auto'), whether or not this machine has it; an
    ArcherError for any other name."""
    if preferred == "auto":
        return None
    try:
        device = torch.device(preferred)
    except RuntimeError as err:
        raise ArcherError(
            f"unknown device {preferred!r} ({err})", "use 'auto', 'cpu', 'cuda' or 'cuda:N'"
        ) from err
    if device.type not in DEVICE_TYPES:
        raise ArcherError(f"unknown device {preferred!r}: archer trains on a CPU or CUDA GPUs",
                          "use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    return device


def pick_device(preferred: str = "auto") -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cpu' / 'cuda' / 'cuda:N' are taken as given."""
    device = check_device_name(preferred)
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ArcherError(
            f"device {preferred!r} was requested but this machine has no usable CUDA GPU",
            "run with device 'cpu' (or 'auto'), or install a CUDA build of torch on a GPU machine",
        )
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on GPU, float32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
               "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str, key: str) -> torch.dtype:
    """A dtype by verl's names (fp32, bf16, fp16, or torch's); an ArcherError naming ``key`` otherwise."""
    dtype = DTYPE_NAMES.get(str(name).lower())
    if dtype is None:
        raise ArcherError(f"{key}={name!r} is not a dtype archer knows", f"use one of {', '.join(DTYPE_NAMES)}")
    return dtype


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on GPU (float32 master weights), nothing on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _check_folder(path: str | Path, what: str) -> Path:
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ArcherError(
            f"{what} folder {folder} does not exist",
            "check the path: it must be a local Hugging Face model folder (config.json, weights, tokenizer); "
            "`archer quickstart` builds a tiny model to try archer with (<out>/base_model)",
        )
    if not folder.is_dir():
        raise ArcherError(
            f"{what} path {folder} is a file, not a folder",
            "pass the folder that holds config.json and the weights, not a file inside it",
        )
    return folder


def load_tokenizer(path: str | Path, *, role: str = "tokenizer") -> PreTrainedTokenizerBase:
    """AutoTokenizer from a local folder; the pad token falls back to the eos token.

    ``role`` names the folder in error messages (e.g. "model" when the tokenizer comes from the model folder).
    """
    folder = _check_folder(path, role)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ArcherError(
            f"tokenizer folder {folder} has no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})",
            "point to a Hugging Face model folder saved with tokenizer.save_pretrained",
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as err:  # the tokenizers library raises a bare Exception for broken files
        raise ArcherError(
            f"the tokenizer files in {folder} could not be read ({type(err).__name__}: {err})",
            "re-save the tokenizer with tokenizer.save_pretrained, or copy the files again from the source",
        ) from err
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ArcherError(
                f"the tokenizer in {folder} has neither a pad token nor an eos token",
                "set pad_token (or eos_token) in its tokenizer_config.json",
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_config(folder: Path, trust_remote_code: bool) -> PretrainedConfig:
    if not (folder / "config.json").is_file():
        raise ArcherError(
            f"model folder {folder} has no config.json",
            "point to a Hugging Face model folder saved with model.save_pretrained",
        )
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise ArcherError(
            f"config.json in {folder} could not be read ({type(err).__name__}: {err})",
            "fix or replace config.json (it must be valid JSON with a known model_type); "
            "models with custom code need trust_remote_code=True",
        ) from err


def read_model_config(path: str | Path, *, trust_remote_code: bool = False) -> PretrainedConfig:
    """The config.json of a model folder (no weights read), with the folder's errors as ArcherError."""
    return _load_config(_check_folder(path, "model"), trust_remote_code)


# RoPE scalings that stretch a model's positions by their ``factor`` (from original_max_position_embeddings when
# the config gives it); llama3 and longrope configs already state the stretched length in max_position_embeddings.
_STRETCHING_ROPE = ("linear", "dynamic", "yarn")


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest sequence (prompt + response) the model is built for, or None when its config does not say."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not isinstance(limit, int):
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    factor = rope.get("factor") if kind in _STRETCHING_ROPE else None
    if not isinstance(factor, int | float) or factor <= 1:
        return limit
    original = rope.get("original_max_position_embeddings")
    return max(limit, int((original if isinstance(original, int) else limit) * factor))


def _check_weights(folder: Path) -> None:
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ArcherError(
            f"model folder {folder} has no weights (looked for {', '.join(WEIGHT_FILES)})",
            "copy the weight files into the folder, or save the model again with model.save_pretrained",
        )


def _from_pretrained(
    auto_class: type, folder: Path, config: PretrainedConfig, dtype: torch.dtype, trust_remote_code: bool,
    empty: bool = False,
) -> PreTrainedModel:
    """from_pretrained with the weight errors turned into ArcherError; ``empty``: the architecture alone, on the
    meta device, no weights read (a rank that receives its shards from rank 0).

    Attention: ``_prepare`` switches it to archer's (SDPA, plus packed rows) where the architecture takes an
    attention implementation; otherwise it stays what transformers picked.
    """
    _check_weights(folder)
    if empty:
        with torch.device("meta"):
            return auto_class.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    try:
        return auto_class.from_pretrained(
            str(folder), config=config, dtype=dtype, trust_remote_code=trust_remote_code
        )
    except _LOAD_ERRORS as err:
        raise ArcherError(
            f"the model in {folder} could not be loaded as {auto_class.__name__} ({type(err).__name__}: {err})",
            "if the weight files are truncated or corrupt, copy them again from the source or save the model "
            "again with model.save_pretrained; if this transformers version lacks the architecture, upgrade it",
        ) from err


def set_gradient_checkpointing(model: PreTrainedModel, on: bool) -> None:
    """Recompute each decoder layer's activations in the backward (``on``), or keep them (non-reentrant)."""
    # transformers renamed the methods; older 5.x releases only have gradient_checkpointing_*.
    if not on:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
        return
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def _prepare(model: PreTrainedModel, device: torch.device, gradient_checkpointing: bool) -> PreTrainedModel:
    use_packed_attention(model)  # SDPA as before, and packed rows kept apart (models/packed_attention.py)
    use_grouped_experts(model)  # MoE experts as grouped matmuls, not transformers' per-expert loop (models/moe.py)
    if gradient_checkpointing:
        set_gradient_checkpointing(model, True)
    return model if next(model.parameters()).is_meta else model.to(device)


def load_causal_lm(
    path: str | Path,
    *,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    empty: bool = False,
) -> PreTrainedModel:
    """The policy: AutoModelForCausalLM from a local folder, on ``device`` in ``dtype`` (default by device);
    ``empty``: on the meta device, no weights read."""
    device = torch.device(device)
    folder = _check_folder(path, "model")
    config = _load_config(folder, trust_remote_code)
    model = _from_pretrained(
        AutoModelForCausalLM, folder, config, dtype or default_dtype(device), trust_remote_code, empty
    )
    return _prepare(model, device, gradient_checkpointing)


def load_value_model(
    path: str | Path,
    *,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    empty: bool = False,
) -> PreTrainedModel:
    """The critic: the causal LM's backbone plus a fresh scalar value head (token classification, 1 label).

    The head starts near zero so the first values are small; dropout before the head is off.
    A folder saved from a critic (with its ``score`` head) keeps its trained head.
    """
    device = torch.device(device)
    folder = _check_folder(path, "value model")
    config = _load_config(folder, trust_remote_code)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    model = _from_pretrained(
        AutoModelForTokenClassification, folder, config, dtype or default_dtype(device), trust_remote_code, empty
    )
    if not _is_critic_checkpoint(config) and not empty:
        head = model.score
        nn.init.normal_(head.weight, std=VALUE_HEAD_INIT_STD)
        if head.bias is not None:
            nn.init.zeros_(head.bias)
    return _prepare(model, device, gradient_checkpointing)


def _is_critic_checkpoint(config: PretrainedConfig) -> bool:
    """True when the folder was saved from a token-classification model (a trained critic)."""
    return any(arch.endswith("ForTokenClassification") for arch in (config.architectures or []))


def value_forward(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
    **packing: torch.Tensor | int,
) -> torch.Tensor:
    """Values [B, T] in float32 from a model made by ``load_value_model``; ``packing``: a packed row's
    ``cu_seq_lens_*`` / ``max_length_*`` (models/sequence_layout.py)."""
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **packing
    )
    return out.logits.squeeze(-1).float()


def save_hf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path) -> Path:
    """Save model (safetensors) and, when given, the tokenizer into one folder that from_pretrained loads."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder


def load_reward_model(
    path: str | Path,
    *,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A reward model: AutoModelForSequenceClassification (one label) from a local folder, frozen, in eval mode,
    on ``device`` in ``dtype`` (default by device). The folder's checks are archer.workers.reward_model's."""
    device = torch.device(device)
    folder = _check_folder(path, "reward model")
    config = _load_config(folder, trust_remote_code)
    model = _from_pretrained(
        AutoModelForSequenceClassification, folder, config, dtype or default_dtype(device), trust_remote_code
    )
    return _prepare(model, device, False).eval().requires_grad_(False)
