"""Triton kernels of the chunked log-prob head (models/logprobs.py) on a GPU, each reading a chunk's logits once:

- ``row_stats``: every row's log p(label), log-normaliser and entropy of softmax(z / T), by an online pass over the
  vocabulary in float32 (running maximum, sum of exponentials and their moment about the maximum, rescaled as
  the maximum grows);
- ``logit_grads_``: the gradient of the logits from the closed forms in models/logprobs.py's docstring, written
  over the logits in their own dtype.

The torch code of models/logprobs.py computes the same through several float32 [rows x vocab] tensors (a shifted
copy, its exponentials, their product, ...), which made the head's elementwise work cost about as much as its
matrix products at Qwen's 151,936-row vocabulary. It is what runs on a CPU and what the GPU tests compare these
kernels with (tests/test_logprob_kernels_gpu.py). Imported only where Triton is (a CUDA build of torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries a program reads per iteration
NUM_WARPS = 8


@triton.jit
def _softmax_step(x, valid, m, total, moment):
    """One block of float32 values ``x`` (``valid`` where real, -inf elsewhere) folded into the running maximum
    ``m``, the sum ``total`` of exp(x - m) and the shifted moment ``moment`` (sum of exp(x - m) * (x - m)), both
    rescaled to the new maximum; returns the three. Then the log-normaliser is m + log(total) and the entropy
    log(total) - moment / total: shifted, the moment keeps the entropy of a near-certain row to float32's
    precision, where an unshifted one cancels two large numbers (errors of 1e-5 at a 151,936 vocabulary)."""
    m_new = tl.maximum(m, tl.max(x, axis=0))
    alpha = tl.exp(m - m_new)
    e = tl.exp(x - m_new)
    # the earlier terms' shift moves by m - m_new; before the first block there are none (0 * -inf)
    carried = tl.where(total > 0, alpha * (moment + total * (m - m_new)), 0.0)
    moment = carried + tl.sum(tl.where(valid, e * (x - m_new), 0.0), axis=0)
    total = total * alpha + tl.sum(e, axis=0)
    return m_new, total, moment


@triton.jit
def _row_stats_kernel(logits_ptr, labels_ptr, logp_ptr, norm_ptr, ent_ptr, vocab, stride, scale,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    m = float("-inf")
    total = 0.0
    moment = 0.0
    for start in range(0, vocab, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        valid = idx < vocab
        x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32) * scale
        m, total, moment = _softmax_step(x, valid, m, total, moment)
    log_total = tl.log(total)
    log_norm = m + log_total
    picked = tl.load(base + tl.load(labels_ptr + row)).to(tl.float32) * scale
    tl.store(logp_ptr + row, picked - log_norm)
    tl.store(norm_ptr + row, log_norm)
    tl.store(ent_ptr + row, log_total - moment / total)


@triton.jit
def _logit_grads_kernel(logits_ptr, labels_ptr, norm_ptr, ent_ptr, glogp_ptr, gent_ptr, vocab, stride, scale,
                        HAS_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    log_norm = tl.load(norm_ptr + row)
    g_logp = tl.load(glogp_ptr + row) * scale
    if HAS_ENTROPY:
        g_entropy = tl.load(gent_ptr + row) * scale
        offset = -(g_logp + g_entropy * tl.load(ent_ptr + row))
    else:
        g_entropy = 0.0
        offset = -g_logp
    label = tl.load(labels_ptr + row)
    for start in range(0, vocab, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        valid = idx < vocab
        log_p = tl.load(base + idx, mask=valid, other=0.0).to(tl.float32) * scale - log_norm
        grad = tl.exp(log_p) * (offset - g_entropy * log_p) + tl.where(idx == label, g_logp, 0.0)
        tl.store(base + idx, grad.to(logits_ptr.dtype.element_ty), mask=valid)


def _check_rows(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"the head kernels take [N, V] logits with contiguous rows, got shape "
                         f"{tuple(logits.shape)} and strides {logits.stride()}")


def row_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(label), log-normaliser, entropy) of softmax(logits / temperature), float32 [N], for CUDA logits
    [N, V] (rows contiguous) and labels [N]."""
    _check_rows(logits)
    rows, vocab = logits.shape
    logp, log_norm, entropy = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    if rows:
        _row_stats_kernel[(rows,)](logits, labels.contiguous(), logp, log_norm, entropy, vocab, logits.stride(0),
                                   1.0 / temperature, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return logp, log_norm, entropy


def logit_grads_(logits: torch.Tensor, labels: torch.Tensor, log_norm: torch.Tensor, grad_logp: torch.Tensor,
                 entropy: torch.Tensor | None, grad_entropy: torch.Tensor | None, temperature: float
                 ) -> torch.Tensor:
    """Overwrite CUDA ``logits`` [N, V] with the gradient of sum(grad_logp * log p(label) + grad_entropy *
    entropy) with respect to them (float32 [N] rows of ``log_norm``, ``grad_logp``; ``entropy`` and
    ``grad_entropy`` both or neither), and return them."""
    _check_rows(logits)
    rows, vocab = logits.shape
    has_entropy = grad_entropy is not None
    # the kernel reads every [N] vector with stride 1: an autograd gradient may be a broadcast (stride 0)
    labels, log_norm, grad_logp = labels.contiguous(), log_norm.contiguous(), grad_logp.contiguous()
    if has_entropy:
        entropy, grad_entropy = entropy.contiguous(), grad_entropy.contiguous()
    if rows:
        _logit_grads_kernel[(rows,)](logits, labels, log_norm, entropy if has_entropy else log_norm, grad_logp,
                                     grad_entropy if has_entropy else grad_logp, vocab, logits.stride(0),
                                     1.0 / temperature, HAS_ENTROPY=has_entropy, BLOCK=BLOCK,
                                     num_warps=NUM_WARPS)
    return logits
