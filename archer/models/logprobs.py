"""Per-token log-probabilities and entropies without a full float32 [tokens x vocab] tensor (docs/architecture.md).

``logprobs_from_hidden`` makes the logits ``chunk_size`` tokens at a time from the last hidden states and the
LM head, in one autograd function (``_ChunkedLogProbs``) that keeps nothing of a chunk for the backward but
two numbers per token (the log-normaliser and the entropy): the backward makes each chunk's logits again and
writes the gradient of the logits straight from the closed forms

    d logp_y / dz = (onehot_y - p) / T,    d H / dz = -p * (log p + H) / T      (z: logits, p = softmax(z / T))

so a chunk never holds more than two float32 [chunk x vocab] buffers at once, in the forward or the backward. On a
GPU (Triton installed) the softmax statistics and the logit gradients come from the fused kernels of
models/logprob_kernels.py instead, which read a chunk's logits once and hold nothing in float32 beside them; the
LM head's gradient is then summed over the chunks by float32-accumulating matrix products (``_add_product``).
By default a chunk's logits take at most ``LOGITS_BYTES_PER_CHUNK`` (``chunk_size=None``): counted in float32 on
the torch path, in the matrix products' dtype where the fused kernels read them as they are (twice the tokens in
bf16). Under autocast the matrix products run in the autocast dtype, as ``F.linear`` would, and the softmax in float32.
The same per-row formula (``token_logprob_and_entropy``) serves the rollout engine, so generation-time and
training-time numbers agree. A model whose config sets ``final_logit_softcapping`` (Gemma 2, some Gemma 3 configs)
has its logits soft-capped as transformers caps them, z' = cap * tanh(z / cap) in the logits' dtype, before the
softmax; the backward multiplies the logits' gradient by dz'/dz = 1 - tanh(z / cap)^2.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed.fsdp import FSDPModule

from archer.errors import ArcherError
from archer.models.loading import autocast_for
from archer.models.packed_attention import supports_packing
from archer.models.sequence_layout import ScoredRows, SequenceLayout

try:  # the fused head kernels run on CUDA tensors where Triton is installed (a CUDA build of torch)
    from archer.models import logprob_kernels
except ImportError:
    logprob_kernels = None

LOGITS_BYTES_PER_CHUNK = 256 * 2**20  # the logits of one chunk when chunk_size is None (auto_chunk_size)


def auto_chunk_size(vocab_size: int, logit_bytes: int = 4) -> int:
    """Tokens per chunk whose logits, ``logit_bytes`` each, take at most LOGITS_BYTES_PER_CHUNK (at least one)."""
    return max(1, LOGITS_BYTES_PER_CHUNK // (logit_bytes * vocab_size))


def _log_softmax_stats(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, compute_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log p(label), log-normaliser, entropy) of softmax(logits / temperature), all float32 [N].

    ``logits`` may be in a lower precision: the shifted, scaled logits are made in float32 in one pass, and
    at most two float32 [N, V] buffers are alive at a time.
    """
    scale = 1.0 / temperature
    shift = logits.amax(dim=-1, keepdim=True).float() * scale
    shifted = torch.add(-shift, logits, alpha=scale)  # z / T - max(z / T), float32
    del logits  # freed here when the caller passed a temporary
    picked = shifted.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if compute_entropy:
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        mean_shifted = exp.mul_(shifted).sum(dim=-1) / total  # sum_v p_v (z_v / T - shift), in place
        entropy = total.log() - mean_shifted
    else:
        total = shifted.exp_().sum(dim=-1)
        entropy = None
    log_total = total.log()
    return picked - log_total, shift.squeeze(-1) + log_total, entropy


def token_logprob_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, compute_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) and the full-vocabulary entropy of softmax(logits), for float32 logits [N, V]."""
    logp, _, entropy = _log_softmax_stats(logits, labels, 1.0, compute_entropy)
    return logp, entropy


def _head_params(
    lm_head: nn.Linear | tuple[torch.Tensor, torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(lm_head, nn.Linear):
        return lm_head.weight, lm_head.bias
    weight, bias = lm_head
    return weight, bias


def _matmul_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in here: the autocast dtype when autocast is on, else the input's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _fused(hidden: torch.Tensor) -> bool:
    """Whether the Triton kernels of models/logprob_kernels.py make the head's softmax statistics and logit
    gradients from these hidden states' logits (CUDA, Triton installed)."""
    return logprob_kernels is not None and hidden.is_cuda


def _logit_grads(logits: torch.Tensor, labels: torch.Tensor, log_norm: torch.Tensor, grad_logp: torch.Tensor,
                 entropy: torch.Tensor | None, grad_entropy: torch.Tensor | None, scale: float) -> torch.Tensor:
    """float32 dL/dz of a chunk from the closed forms (at most two float32 [N, V] buffers alive at once):
    dL/dz = -p * (g_logp + g_H (log p + H)) / T + g_logp onehot / T, with g_H = 0 without ``grad_entropy``."""
    g_logp = grad_logp.unsqueeze(-1) * scale
    log_p = torch.add(-log_norm.unsqueeze(-1), logits, alpha=scale)
    del logits
    grad = log_p.exp()
    if grad_entropy is not None:
        g_entropy = grad_entropy.unsqueeze(-1) * scale
        offset = -(g_logp + g_entropy * entropy.unsqueeze(-1))
        grad.mul_(torch.addcmul(offset, log_p, -g_entropy, out=log_p))
    else:
        grad.mul_(-g_logp)
    del log_p
    return grad.scatter_add_(-1, labels.unsqueeze(-1), g_logp)


def _add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` for a float32 ``total`` (the LM head's gradient, [V, H], summed over the chunks). Half
    precision on a GPU: one GEMM that accumulates in float32 and adds into ``total`` (cuBLAS's epilogue), where
    a product in half precision and a separate float32 add would write and read a [V, H] tensor more per chunk.
    Elsewhere: float32 in place, or the product in the inputs' dtype added in float32 (as autograd through
    F.linear under autocast)."""
    if a.dtype == torch.float32:
        total.addmm_(a, b)
    elif a.is_cuda and a.dtype in (torch.float16, torch.bfloat16) and _accumulates_in_float32(a.device):
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total += a @ b


@functools.cache
def _accumulates_in_float32(device: torch.device) -> bool:
    """Whether this torch adds a half-precision product into a float32 tensor in one GEMM on ``device``
    (``addmm``'s ``out_dtype``, torch >= 2.8); probed once on two-by-two matrices."""
    try:
        total = torch.zeros(2, 2, device=device)
        half = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
        torch.addmm(total, half, half, out_dtype=torch.float32, out=total)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return bool(total[0, 0] == 2)


def logit_softcap(model: nn.Module) -> float | None:
    """The model's final-logit soft cap (its config's ``final_logit_softcapping``), or None."""
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return float(cap) if cap else None


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) in the logits' dtype (transformers' order); the logits themselves without a cap.
    The caller passes a temporary and keeps no reference to the result beyond its use, so that at most two
    [chunk, vocab] buffers are alive at once."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


class _ChunkedLogProbs(torch.autograd.Function):
    """log p(labels) and entropies of softmax(cap((hidden @ W^T + b)) / T), chunk by chunk, both directions (cap:
    the soft cap where given, else nothing)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, temperature: float, chunk_size: int, compute_entropy: bool,
                softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _matmul_dtype(hidden)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        logp = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        log_norm = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if compute_entropy else logp.new_empty(0)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                if _fused(hidden):
                    chunk_logp, chunk_norm, chunk_entropy = logprob_kernels.row_stats(
                        _capped(F.linear(hidden[rows].to(dtype), w, b), softcap), labels[rows], temperature)
                else:  # the logits are a temporary, freed inside
                    chunk_logp, chunk_norm, chunk_entropy = _log_softmax_stats(
                        _capped(F.linear(hidden[rows].to(dtype), w, b), softcap), labels[rows], temperature,
                        compute_entropy)
                logp[rows], log_norm[rows] = chunk_logp, chunk_norm
                if compute_entropy:
                    entropy[rows] = chunk_entropy
        ctx.save_for_backward(hidden, weight, bias, labels, log_norm, entropy)
        ctx.settings = (temperature, chunk_size, dtype, softcap)
        ctx.set_materialize_grads(False)  # an output the loss does not use sends None, not zeros
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels, log_norm, entropy = ctx.saved_tensors
        temperature, chunk_size, dtype, softcap = ctx.settings
        scale = 1.0 / temperature
        grad_logp = torch.zeros_like(log_norm) if grad_logp is None else grad_logp.float()
        with_entropy = grad_entropy is not None and entropy.numel() > 0
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows].to(dtype)
            chunk_entropy = entropy[rows] if with_entropy else None
            chunk_grad_entropy = grad_entropy[rows].float() if with_entropy else None
            squashed = None if softcap is None else torch.tanh(F.linear(h, w, b) / softcap)
            if _fused(h):  # written over the logits
                grad = logprob_kernels.logit_grads_(
                    F.linear(h, w, b) if squashed is None else squashed * softcap, labels[rows], log_norm[rows],
                    grad_logp[rows], chunk_entropy, chunk_grad_entropy, temperature)
            else:  # the logits are a temporary, freed inside
                grad = _logit_grads(F.linear(h, w, b) if squashed is None else squashed * softcap, labels[rows],
                                    log_norm[rows], grad_logp[rows], chunk_entropy, chunk_grad_entropy, scale)
            if squashed is not None:  # through the cap: dz'/dz = 1 - tanh(z / cap)^2
                grad.mul_(squashed.square_().neg_().add_(1))
                del squashed
            grad = grad.to(dtype)
            if need_hidden:
                grad_hidden[rows] = grad @ w
            if need_weight:
                _add_product(grad_weight, grad.t(), h)
            if need_bias:
                grad_bias += grad.sum(0)
            del grad
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        if need_bias:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head: nn.Linear | tuple[torch.Tensor, torch.Tensor | None],
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    compute_entropy: bool = True,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(labels) [N] and entropies [N] (float32) of softmax(lm_head(hidden) / temperature).

    ``lm_head`` is an ``nn.Linear`` or a ``(weight, bias)`` pair. Gradients reach ``hidden`` and the head
    through both outputs. ``chunk_size``: tokens per chunk (None: ``auto_chunk_size`` of the vocabulary).
    ``softcap``: the logits soft-capped first (``logit_softcap`` of the model).
    """
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    weight, bias = _head_params(lm_head)
    # the torch path's softmax holds float32 [chunk x vocab] buffers; the fused kernels only the logits themselves
    logit_bytes = _matmul_dtype(hidden).itemsize if _fused(hidden) else 4
    chunk = chunk_size or auto_chunk_size(weight.shape[0], logit_bytes)
    logp, entropy = _ChunkedLogProbs.apply(hidden, weight, bias, labels, float(temperature), chunk,
                                           compute_entropy, softcap)
    return logp, (entropy if compute_entropy else None)


def backbone_of(model: nn.Module) -> nn.Module:
    """The transformer under a causal-LM head (returns last hidden states, never logits)."""
    candidates = []
    if hasattr(model, "get_decoder"):
        candidates.append(model.get_decoder())
    prefix = getattr(model, "base_model_prefix", None)
    if prefix:
        candidates.append(getattr(model, prefix, None))
    for module in candidates:
        if isinstance(module, nn.Module) and module is not model:
            return module
    raise ArcherError(
        f"cannot find the transformer backbone inside {type(model).__name__}",
        "use a Hugging Face causal LM (a ...ForCausalLM class) whose get_decoder() or base_model_prefix "
        "attribute gives the backbone",
    )


def backbone_hidden(model: nn.Module, **inputs: torch.Tensor | int | None) -> torch.Tensor:
    """The backbone's last hidden states for ``inputs``. A model sharded with FSDP2 runs its whole forward with
    one position of logits, the hidden states taken from the backbone on the way: the root's forward gathers the
    embedding, final norm and LM head it owns and keeps them gathered until its backward (archer/distributed/
    fsdp.py), so the chunked head below reads the whole LM head, and the root's backward reduces its gradient.
    Otherwise the backbone alone."""
    backbone = backbone_of(model)
    if not isinstance(model, FSDPModule):
        return backbone(**inputs, use_cache=False).last_hidden_state
    captured: list[torch.Tensor] = []
    handle = backbone.register_forward_hook(lambda _module, _args, output: captured.append(output.last_hidden_state))
    try:
        model(**inputs, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return captured[0]


def masked_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  position_ids: torch.Tensor, loss_mask: torch.Tensor, *, packed: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The backbone's hidden states [N, H] at the positions that predict the N tokens with ``loss_mask`` 1, and
    those tokens [N], on the model's device. The rows are laid out where they are (best on the host: rows on a GPU
    are read back once) by ``ScoredRows``: cut to the longest, ``packed`` rows (several examples a row, told apart
    by restarts of ``position_ids``) as one sequence of examples through archer's attention, each example
    attending to itself (torch's varlen flash kernel on a GPU, O(sum of squared lengths)), or, with a model that
    does not run it, without an attention mask."""
    rows = ScoredRows.build(input_ids, attention_mask, position_ids, loss_mask, packed=packed,
                            examples=supports_packing(model)).to(model_device(model))
    return rows.scored_states(backbone_hidden(model, **rows.model_inputs())), rows.targets


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s parameters."""
    return next(model.parameters()).device


def masked_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor, loss_mask: torch.Tensor, *, packed: bool = False,
                    chunk_size: int | None = None) -> torch.Tensor:
    """Log-probs (float32, [N]) of the N tokens with ``loss_mask`` 1, each given the tokens before it (the SFT
    loss's terms); the LM head sees only those N positions, in chunks (``masked_hidden`` for ``packed``)."""
    with autocast_for(model_device(model)):
        hidden, labels = masked_hidden(model, input_ids, attention_mask, position_ids, loss_mask, packed=packed)
        return logprobs_from_hidden(hidden, model.get_output_embeddings(), labels, chunk_size=chunk_size,
                                    compute_entropy=False, softcap=logit_softcap(model))[0]


def layout_logprobs(
    model: nn.Module,
    layout: SequenceLayout,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, R] and entropies [B, R] of the response tokens of ``layout`` (0 where it has none).

    Only the positions that score a response token go through the LM head.
    """
    hidden = backbone_hidden(model, **layout.model_inputs())
    logp, entropy = logprobs_from_hidden(
        layout.response_states(hidden),
        model.get_output_embeddings(),
        layout.response_tokens(),
        temperature=temperature,
        chunk_size=chunk_size,
        compute_entropy=compute_entropy,
        softcap=logit_softcap(model),
    )
    return layout.scatter(logp), (None if entropy is None else layout.scatter(entropy))


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    compute_entropy: bool = True,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``layout_logprobs`` of rows that are a left-padded prompt followed by a right-padded response (the
    last ``response_length`` columns), run padded or ``packed`` (models/sequence_layout.py)."""
    layout = SequenceLayout.build(input_ids, attention_mask, position_ids, response_length, packed=packed)
    return layout_logprobs(model, layout, temperature=temperature, chunk_size=chunk_size,
                           compute_entropy=compute_entropy)
