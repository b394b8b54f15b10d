"""Attention over packed rows: several sequences concatenated into one row, each attending only to itself.

A packed micro-batch (models/sequence_layout.py) enters the model as one row of T tokens with each sequence's
own position ids and ``cu_seq_lens`` (int32 [S + 1], the offsets of its S sequences), which transformers hands
through the model to the attention function of every layer. archer registers its own attention implementation,
``PACKED_ATTENTION``, with transformers' attention interfaces, and loads its models with it
(models/loading.py):

- a packed forward (``cu_seq_lens_q`` given) runs variable-length attention: on a GPU in bf16/fp16, torch's
  flash kernel (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10); otherwise (the CPU, float32, an older
  torch) SDPA once per sequence, causal. Both cost O(sum L^2) and no [T x T] mask;
- every other forward (padded rows, the packed SFT rows that transformers masks from their position ids,
  generation with a KV cache) is transformers' own SDPA, unchanged.

Sliding-window layers (Mistral's, Qwen2 / Qwen3's ``use_sliding_window`` layers, Gemma 3's local layers: the
architectures of ``WINDOWED_MODEL_TYPES``) get their window from the ``sliding_window`` their attention module hands
the attention function: a query at position p sees the keys at p - window < k <= p of its own sequence (the flash
kernel's ``window_size=(window - 1, 0)``, else SDPA with a banded causal mask), so they train packed too. Other
windowed architectures keep transformers' SDPA and run padded, with a warning.

A packed row comes with an all-ones attention mask, so transformers makes no mask of its own: with no mask it
would read the sequences off the position ids and build a [T x T] block-diagonal mask. archer makes that mask (and
a left-aligned padded micro-batch's, whose rows need none) with ``all_ones_mask``, which its mask function
(``archer_mask``) recognises without reading it (for a sliding-window layer too: the attention function then
applies the window itself): SDPA's own mask function would read it back from the GPU to see
that it is all ones, making the host wait for the GPU at every forward. FlexAttention's document
masks were the other candidate; they need a compiled kernel per shape and a block mask per micro-batch, where
varlen attention needs neither.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

log = logging.getLogger("archer.models")

PACKED_ATTENTION = "archer_packed"
# architectures whose attention modules pass their layer's sliding_window (None on a full-attention layer)
WINDOWED_MODEL_TYPES = ("mistral", "qwen2", "qwen3", "gemma3_text")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
_ALL_ONES = "_archer_all_ones"  # the attribute all_ones_mask sets on its masks


def all_ones_mask(like: torch.Tensor) -> torch.Tensor:
    """A boolean mask of ones of ``like``'s shape that ``archer_mask`` knows to be all ones without reading it."""
    mask = torch.ones_like(like, dtype=torch.bool)
    setattr(mask, _ALL_ONES, True)
    return mask


def archer_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask function for ``PACKED_ATTENTION``: SDPA's, except that a causal forward without a cache
    whose attention mask came from ``all_ones_mask`` gets no mask (causal attention, as SDPA's would conclude after
    reading the mask back from the GPU); so does a sliding-window layer of a model whose windows packed attention
    applies (``local_size``: transformers' sliding-window causal mask, nothing added to it; ``packs_windows`` of
    the ``config`` transformers passes), whose window ``packed_attention`` applies."""
    mask = kwargs.get("attention_mask")
    if kwargs.get("local_size") is None:
        plain = kwargs.get("mask_function", causal_mask_function) is causal_mask_function
    else:  # a window whose size the layer's attention call carries (not, say, a chunked layer's)
        config = kwargs.get("config")
        plain = windowed_layers(config) and packs_windows(config)
    if (not args and getattr(mask, _ALL_ONES, False) and kwargs.get("allow_is_causal_skip", True) and plain
            and not kwargs.get("q_offset", 0) and not kwargs.get("kv_offset", 0)
            and kwargs.get("q_length") == kwargs.get("kv_length")):
        return None
    return sdpa_mask(*args, **kwargs)


def _torch_varlen() -> tuple[Callable[..., torch.Tensor], set[str]] | None:
    """torch's varlen attention and the names of its parameters (they changed between releases), if present."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


VARLEN = _torch_varlen()


def uses_flash_varlen(query: torch.Tensor, scaling: float | None) -> bool:
    """Whether a packed forward of ``query`` [1, H, T, D] runs torch's flash varlen kernel (else SDPA per
    sequence): a CUDA tensor in half precision, a head size flash takes, and the default scale unless the
    kernel takes another."""
    if VARLEN is None or not query.is_cuda or query.dtype not in FLASH_DTYPES or query.shape[-1] > 256:
        return False
    default_scale = scaling is None or abs(scaling - query.shape[-1] ** -0.5) < 1e-12
    return default_scale or "scale" in VARLEN[1]


def _flash_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                  max_length: int, scaling: float | None, window: int | None = None) -> torch.Tensor:
    """[T, H, D] causal attention of each sequence in [T, H, D] / [T, Hkv, D] queries, keys and values (each query
    over the last ``window`` keys where given)."""
    attend, params = VARLEN
    options: dict[str, Any] = {}
    if "window_size" in params:  # torch >= 2.10
        options["window_size"] = (window - 1 if window else -1, 0)
    else:
        options["is_causal"] = True
    if scaling is not None and "scale" in params:
        options["scale"] = scaling
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:  # a release without the switch: give every query head its own copy of its key/value head
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    return attend(query, key, value, cu_seq_lens, cu_seq_lens, max_length, max_length, **options)


def window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """[length, length] boolean: query q sees key k where q - window < k <= q (transformers' sliding window)."""
    offsets = torch.arange(length, device=device)
    behind = offsets.unsqueeze(1) - offsets
    return (behind >= 0) & (behind < window)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
          window: int | None) -> torch.Tensor:
    """Causal SDPA of [1, H(kv), L, D] tensors, over the last ``window`` keys where given."""
    grouped, length = key.shape[1] != query.shape[1], query.shape[2]
    if window and length > window:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=window_mask(length, window, query.device),
                                              scale=scaling, enable_gqa=grouped)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=grouped)


@torch.compiler.disable  # a compiled layer calls it as it is: tracing the loop would recompile per row count
def _per_sequence_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                       scaling: float | None, window: int | None = None) -> torch.Tensor:
    """[1, H, T, D] causal SDPA of each sequence of [1, H(kv), T, D] tensors on its own (``cu_seq_lens``: the
    sequences' offsets; ``window``: each query's last keys), concatenated."""
    bounds = cu_seq_lens.tolist()
    outputs = [_sdpa(query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop], scaling, window)
               for start, stop in zip(bounds[:-1], bounds[1:], strict=True) if stop > start]
    return torch.cat(outputs, dim=2)


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature: [B, H, T, D] queries (keys and values with their own head
    count) in, [B, T, H, D] out. Packed when ``kwargs`` hold ``cu_seq_lens_q`` (B must be 1), else SDPA. A
    ``sliding_window`` in ``kwargs`` (the layer's) limits each query to that many keys, its own the last; where
    ``archer_mask`` gave no mask, the window's banded mask is made here."""
    cu_seq_lens, window = kwargs.get("cu_seq_lens_q"), kwargs.get("sliding_window")
    if cu_seq_lens is None:
        length = query.shape[2]
        if window and attention_mask is None and length > window and length == key.shape[2]:
            attention_mask = window_mask(length, window, query.device).expand(query.shape[0], 1, -1, -1)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or attention_mask is not None or dropout:
        raise ValueError("packed attention takes one row of sequences without an attention mask or dropout")
    device = query.device.type
    if torch.is_autocast_enabled(device):  # as autocast runs SDPA: rope leaves float32 queries and keys
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if uses_flash_varlen(query, scaling) and (not window or "window_size" in VARLEN[1]):
        # max_length_q as given (an int): int() would fix a compiled layer's graph to one value (a recompile each)
        out = _flash_varlen(*(t[0].transpose(0, 1).contiguous() for t in (query, key, value)), cu_seq_lens,
                            kwargs["max_length_q"], scaling, window)
        return out.unsqueeze(0), None
    out = _per_sequence_sdpa(query, key, value, cu_seq_lens, scaling, window)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, archer_mask)


def windowed_layers(config: Any) -> bool:
    """Whether a model config has layers that attend to a window (sliding or chunked) rather than to every earlier
    token: their masks are not plain causal; packed attention applies the sliding windows of
    ``WINDOWED_MODEL_TYPES`` only (``packs_windows``)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return any(kind != "full_attention" for kind in layer_types)
    return bool(getattr(config, "sliding_window", None)) and bool(getattr(config, "use_sliding_window", True))


def packs_windows(config: Any) -> bool:
    """Whether ``packed_attention`` applies the windows of a windowed config: an architecture of
    ``WINDOWED_MODEL_TYPES`` whose layers are full or sliding-window ones, its attention scores not soft-capped."""
    kinds = set(getattr(config, "layer_types", None) or ())
    return (getattr(config, "model_type", None) in WINDOWED_MODEL_TYPES
            and kinds <= {"full_attention", "sliding_attention"}
            and getattr(config, "attn_logit_softcapping", None) is None)


def use_packed_attention(model: nn.Module) -> None:
    """Make ``model`` (a transformers model) run ``packed_attention``; one whose architecture takes no attention
    implementation, or that has windowed layers packed attention does not apply (``packs_windows``), keeps its own
    and runs padded rows only (``supports_packing``), with a warning."""
    if supports_packing(model):
        return
    config = getattr(model, "config", None)
    if windowed_layers(config) and not packs_windows(config):
        log.warning("%s has windowed attention layers, which archer's packed attention applies only for the %s "
                    "architectures: its passes run padded, never packed", type(model).__name__,
                    ", ".join(WINDOWED_MODEL_TYPES))
        return
    try:
        model.set_attn_implementation(PACKED_ATTENTION)
    except (AttributeError, ValueError, NotImplementedError) as err:
        log.warning("%s takes no attention implementation of archer's (%s): its passes run padded, never packed",
                    type(model).__name__, err)


def supports_packing(model: nn.Module) -> bool:
    """Whether ``model``'s attention keeps the sequences of a packed row apart (it runs ``packed_attention``)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == PACKED_ATTENTION
