"""LoRA on a causal LM (peft): the adapters from verl's keys, the base policy with them switched off, the
policy's weights as one stream of named tensors (adapters merged), and saving / loading the adapters.

A LoRA policy is the base model (frozen, in the device's dtype: bfloat16 on a GPU, float32 on the CPU) with
peft's LoRA layers injected in place (``lora_A`` / ``lora_B`` trainable, in float32). What runs the policy
(log-prob kernels, the hf engine) takes the injected transformers model itself
(``PeftModelForCausalLM.get_base_model()``) and needs no LoRA-specific code; the influence hooks sit on the LoRA
layers (trace/influence_capture.py's ``select_modules``); what needs peft goes through here:

- ``base_policy``: the reference policy, i.e. the same module with the adapters off (peft's
  ``disable_adapter``), so that no second copy of the model is held;
- ``policy_weights``: ``(name, tensor)`` pairs in the plain model's state-dict names, every LoRA layer merged
  (``W + scaling * B @ A`` by peft's ``get_delta_weight``, one layer at a time in float32, given back in the
  base's dtype), which the engines take and ``save_merged`` (the HF export) saves; the module itself is never
  modified (no merge / unmerge round trip, which would change the base's bits). The same stream serves a model
  sharded with FSDP2: each tensor is gathered whole in turn (archer/distributed/fsdp.py), so there is one
  merge whatever the number of ranks;
- ``save_adapter`` / ``load_adapter``: the adapters in peft's format (``adapter_config.json`` and
  ``adapter_model.safetensors``, float32) in a ``lora_adapter/`` folder beside the merged HF export; loading
  them into a freshly built policy resumes exactly, and ``model.lora_adapter_path`` starts a run from them
  (e.g. an SFT run's adapters).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from archer.distributed.context import DistContext
from archer.distributed.fsdp import full_tensor, reshard, unwrap, whole_parameters
from archer.errors import ArcherError

log = logging.getLogger("archer.models")

ADAPTER_DIR = "lora_adapter"  # the adapters' folder inside a saved model folder (from_pretrained ignores it)
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraSettings:
    """verl's ``model.lora_rank`` / ``lora_alpha`` / ``target_modules`` (rank 0: LoRA off), or the adapters of
    ``model.lora_adapter_path`` to start from (their rank, alpha and target modules, and their weights)."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...]
    adapter_path: Path | None = None
    exclude_modules: str | tuple[str, ...] | None = None  # verl's model.exclude_modules: a regex or name suffixes

    @classmethod
    def from_config(cls, model_cfg: DictConfig, prefix: str = "actor_rollout_ref.model") -> LoraSettings | None:
        """The settings of a ``model`` config block, None when ``lora_rank`` is 0 and no ``lora_adapter_path``
        is set; an ArcherError naming the key for a value LoRA cannot take."""
        rank = model_cfg.get("lora_rank", 0)
        alpha = model_cfg.get("lora_alpha", 16)
        targets = model_cfg.get("target_modules", "all-linear")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ArcherError(f"{prefix}.lora_rank={rank!r} must be an integer >= 0",
                              f"set {prefix}.lora_rank=0 (full fine-tuning) or a LoRA rank such as 8, 32 or 64")
        if model_cfg.get("lora_adapter_path"):
            return cls.from_adapter(model_cfg.lora_adapter_path, f"{prefix}.lora_adapter_path", rank, alpha)
        if rank == 0:
            return None
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
            raise ArcherError(f"{prefix}.lora_alpha={alpha!r} must be a positive number",
                              f"set {prefix}.lora_alpha, e.g. 16 or 2 x lora_rank (the update is scaled by "
                              "lora_alpha / lora_rank)")
        excluded = model_cfg.get("exclude_modules")
        if excluded is not None and not _names(excluded):
            raise ArcherError(f"{prefix}.exclude_modules={excluded!r} is neither a regex nor a list of names",
                              f"set {prefix}.exclude_modules to a regex ('.*mlp.*') or a list of module name "
                              "suffixes, or null")
        if not _names(targets):
            raise ArcherError(f"{prefix}.target_modules={targets!r} names no module",
                              f"set {prefix}.target_modules=all-linear (every linear layer but the LM head) or a "
                              "list of module name suffixes, e.g. [q_proj,k_proj,v_proj,o_proj]")
        return cls(rank, float(alpha), _names(targets), exclude_modules=_names(excluded) if excluded else None)

    @classmethod
    def from_adapter(cls, path: str | Path, key: str, rank: int, alpha: float) -> LoraSettings:
        """The settings saved with the adapters at ``path`` (a peft adapter folder, or a folder holding one in
        ``lora_adapter/``, as archer's checkpoints and SFT output do). A lora_rank / lora_alpha that disagrees
        with them is named in a warning: the saved ones are used, as verl does."""
        folder = adapter_folder(path, key)
        saved = LoraConfig.from_pretrained(str(folder))
        targets = saved.target_modules
        targets = targets if isinstance(targets, str) else tuple(sorted(targets))
        settings = cls(int(saved.r), float(saved.lora_alpha), targets, folder)
        prefix = key.rsplit(".", 1)[0]
        if rank and (rank, float(alpha)) != (settings.rank, settings.alpha):
            log.warning("%s: the adapters in %s have rank %d and alpha %g; they are used, not %s.lora_rank=%d "
                        "and %s.lora_alpha=%g", key, folder, settings.rank, settings.alpha, prefix, rank, prefix,
                        alpha)
        return settings

    def peft_config(self) -> LoraConfig:
        def listed(names: str | tuple[str, ...] | None) -> str | list[str] | None:
            return names if names is None or isinstance(names, str) else list(names)

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=listed(self.target_modules),
                          exclude_modules=listed(self.exclude_modules), lora_dropout=0.0, bias="none",
                          task_type="CAUSAL_LM")


def _names(value: object) -> str | tuple[str, ...] | None:
    """A module-name setting as peft takes it: a non-empty string (a regex, or all-linear) or a tuple of names;
    None for anything else."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, ListConfig | list | tuple) and value and all(isinstance(v, str) for v in value):
        return tuple(str(v) for v in value)
    return None


def add_lora(model: PreTrainedModel, settings: LoraSettings) -> PeftModel:
    """Inject LoRA layers into ``model`` in place: its other weights frozen, the adapters in float32 whatever
    the base's dtype (peft's autocast_adapter_dtype), fresh (B = 0: the policy starts as the base) or loaded
    from ``settings.adapter_path``. Returns peft's wrapper, whose ``get_base_model()`` is ``model``."""
    try:
        peft_model = get_peft_model(model, settings.peft_config(), autocast_adapter_dtype=True)
    except ValueError as err:  # peft: target modules not found in the base model
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ArcherError(f"LoRA target_modules={settings.target_modules!r} cannot be applied ({err})",
                          f"use all-linear or suffixes of the model's linear layers: {', '.join(linear)}") from err
    if settings.adapter_path is not None:
        load_adapter(peft_model, settings.adapter_path)
    return peft_model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimiser steps: all of a plain model, the adapters of a LoRA one."""
    return [p for p in model.parameters() if p.requires_grad]


def base_policy(peft_model: PeftModel | None) -> contextlib.AbstractContextManager:
    """A context in which the LoRA policy computes as its base model (adapters off); nothing without LoRA."""
    return peft_model.disable_adapter() if peft_model is not None else contextlib.nullcontext()


def _lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


@torch.no_grad()
def policy_weights(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights as (state-dict name, tensor) pairs named as in the plain model (tied weights once;
    peft's ``base_model.model.`` / ``.base_layer`` never appear), lazily, one parameter at a time. A LoRA layer
    gives its merged weight ``W + scaling * B @ A`` (peft's delta added in float32, returned in W's dtype) and
    its base bias; plain parameters are given as they are (no copy at world 1: copy a tensor before keeping it).

    On a model sharded with FSDP2 every tensor is all-gathered whole, with the same values as on the unsharded
    model: every rank must iterate the whole stream in step, between optimiser steps (not between a forward
    and its backward); a rank that needs nothing (not rank 0 in an export) still drains it. ``dtype``: each tensor
    cast to it (before the gather: fewer bytes to gather, the same values; a LoRA merge adds in float32 first)."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if dtype is None else tensor.to(dtype)

    root = unwrap(model)
    reshard(root)
    for name, param, layer in _stream_parameters(root):
        if layer is None:
            yield name, full_tensor(cast(param.detach()))
        else:
            yield name, cast(_merged(name.removesuffix(".weight"), layer, full_tensor(param.detach())))


def policy_weight_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``policy_weights``'s names and whole shapes, in its order, without gathering or merging anything (a
    sharded parameter knows its whole shape): what a weight sync plans its buckets from."""
    return [(name, tuple(param.shape)) for name, param, _ in _stream_parameters(unwrap(model))]


def plain_policy_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]] | None:
    """``policy_weights``'s tensors as the model holds them, (name, parameter) in its order, when each is given
    as it is (no LoRA layer to merge); None for a LoRA policy. FSDP units are resharded first, so a sharded
    model's parameters are its DTensor shards (what distributed/shard_buckets.py gathers a bucket at a time)."""
    root = unwrap(model)
    if _lora_layers(root):
        return None
    reshard(root)
    return [(name, param) for name, param, _ in _stream_parameters(root)]


def _stream_parameters(root: nn.Module) -> Iterator[tuple[str, nn.Parameter, LoraLayer | None]]:
    """The parameters behind ``policy_weights``'s stream, in its order: (name, parameter, the LoRA layer whose
    merged weight it gives, else None)."""
    layers = _lora_layers(root)
    inside = tuple(f"{name}." for name in layers)
    for name, param in root.named_parameters():
        if not name.startswith(inside):
            yield name, param, None
    for name, layer in layers.items():
        base = layer.get_base_layer()
        parameter = getattr(layer, "parameter_name", None)
        if parameter is not None:  # peft's ParamWrapper: LoRA on a bare parameter (an MoE's router, fused experts)
            yield f"{name.replace('.base_layer', '')}.{parameter}", getattr(base, parameter), layer
            continue
        yield f"{name}.weight", base.weight, layer
        if getattr(base, "bias", None) is not None:
            yield f"{name}.bias", base.bias, None


def _merged(name: str, layer: LoraLayer, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (the layer's whole base weight) plus every active adapter's delta, added in float32."""
    merged = weight.float()
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if layer.use_dora.get(adapter) or getattr(layer, "lora_variant", {}).get(adapter) is not None:
            raise ArcherError(f"{name}: adapter {adapter!r} is a LoRA variant (DoRA, ...), whose merge is not "
                              "W + scaling * B @ A", "use plain LoRA adapters")
        with whole_parameters(layer.lora_A[adapter], layer.lora_B[adapter]):
            merged = merged + layer.get_delta_weight(adapter).float()
    return merged.to(weight.dtype)


def save_merged(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path,
                ctx: DistContext | None = None) -> Path:
    """An ordinary HF folder (AutoModelForCausalLM.from_pretrained loads it) with the LoRA layers merged, in the
    weights' own dtype; the module is left as it is. Sharded over ``ctx``'s ranks, every rank calls it (the
    weights are gathered one at a time) and rank 0 collects them in host memory and writes."""
    ctx = ctx if ctx is not None else DistContext.single("cpu")
    folder = Path(out_dir)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in policy_weights(model):
        if ctx.is_main:
            state[name] = tensor.to("cpu", copy=True).contiguous()
    if ctx.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        unwrap(model).save_pretrained(str(folder), state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(folder))
    ctx.barrier()
    return folder


def save_adapter(peft_model: PeftModel, folder: str | Path) -> Path:
    """The adapters (peft format, float32) in ``folder/lora_adapter``."""
    target = Path(folder) / ADAPTER_DIR
    peft_model.save_pretrained(str(target))
    return target


def adapter_folder(path: str | Path, key: str = "the adapter folder") -> Path:
    """The peft adapter folder at ``path``: ``path`` itself when it holds adapter_config.json, else its
    ``lora_adapter/``; an ArcherError naming ``key`` when neither does."""
    path = Path(path).expanduser()
    for folder in (path, path / ADAPTER_DIR):
        if (folder / "adapter_config.json").is_file() and (folder / ADAPTER_WEIGHTS).is_file():
            return folder
    raise ArcherError(f"{key}: {path} holds no LoRA adapters (adapter_config.json and {ADAPTER_WEIGHTS}, "
                      f"in it or in its {ADAPTER_DIR}/)",
                      "point it at a peft adapter folder, or at a checkpoint's actor/ or an SFT run's hf_model "
                      "written with LoRA on")


def has_adapter(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file()


def load_adapter(peft_model: PeftModel, folder: str | Path) -> None:
    """Load the adapters at ``folder`` (see ``adapter_folder``) into ``peft_model``'s, exactly; an ArcherError
    when they do not fit (another rank or other target modules)."""
    try:
        found = adapter_folder(folder)
    except ArcherError as err:
        raise ArcherError(err.problem, "resume a checkpoint written with LoRA on, or set "
                          "actor_rollout_ref.model.lora_rank=0 to resume a full fine-tuning checkpoint") from err
    device = next(p for n, p in peft_model.named_parameters() if "lora_" in n).device
    state = load_file(str(found / ADAPTER_WEIGHTS), device=str(device))
    own = {k for k in peft_model.state_dict() if "lora_" in k}
    fix = ("use the lora_rank and target_modules the adapters were written with "
           f"(see {found}/adapter_config.json)")
    try:
        result = set_peft_model_state_dict(peft_model, state)
    except RuntimeError as err:  # a shape mismatch: another rank
        raise ArcherError(f"the LoRA adapters in {found} do not fit this model ({err})", fix) from err
    missing = sorted(k for k in result.missing_keys if k in own)
    if missing or result.unexpected_keys:
        raise ArcherError(f"the LoRA adapters in {found} do not match this model's (missing "
                          f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})", fix)
