"""The layer operations of the fast engine's forward, each in plain torch (CPU, and the reference the kernel
tests check against) and, on a CUDA tensor when Triton is installed, as the fused kernel of ``kernels.py``.

The torch versions follow Hugging Face's Qwen2 modeling operation by operation (RMSNorm in float32 then
cast, residual added in the activation dtype, RoPE in float32 for float32 models), so a float32 model gives
the training forward's numbers to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from archer.rollout.fast import kernels
except ImportError:  # no Triton: CPU builds of torch
    kernels = None


def use_kernels(t: torch.Tensor) -> bool:
    """True where the Triton kernels run: CUDA tensors with Triton installed."""
    return kernels is not None and t.is_cuda


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x) * weight, residual + x); without a residual, x itself is normed and returned."""
    if use_kernels(x):
        return kernels.add_rmsnorm(x, residual, weight, eps)
    if residual is not None:
        x = residual + x
    return rmsnorm(x, weight, eps), x


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (float32, cast back, then scaled: Hugging Face's order)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for the fused [.., 2 * intermediate] projection."""
    if use_kernels(gate_up):
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate, tanh approximation) * up for the fused [.., 2 * intermediate] projection (Gemma's MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
               k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int) -> torch.Tensor:
    """Split the fused q/k/v rows [N, (H + 2 Hkv) D], norm q and k per head (Qwen3), rotate them by their
    positions, write k and v into the paged cache at token ``slots`` (page * page_size + offset) and return
    q [N, H, D]. ``cos`` / ``sin`` are float32 tables [positions, D / 2]."""
    if use_kernels(qkv):
        return kernels.rope_store(qkv, positions, slots, cos, sin, q_norm, k_norm, eps, k_cache, v_cache,
                                  heads)
    tokens = qkv.shape[0]
    _, kv_heads, page, dim = k_cache.shape
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim), v.reshape(tokens, kv_heads, dim)
    if q_norm is not None:
        q, k = rmsnorm(q, q_norm, eps), rmsnorm(k, k_norm, eps)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q, k = _rotate(q, c, s), _rotate(k, c, s)
    heads_index = torch.arange(kv_heads, device=qkv.device)
    rows = (((slots // page).unsqueeze(1) * kv_heads + heads_index) * page + (slots % page).unsqueeze(1)).flatten()
    k_cache.view(-1, dim).index_copy_(0, rows, k.reshape(-1, dim).to(k_cache.dtype))
    v_cache.view(-1, dim).index_copy_(0, rows, v.reshape(-1, dim).to(v_cache.dtype))
    return q


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    q_positions: torch.Tensor, kv_len: torch.Tensor, scale: float, *, max_kv: int,
                    fresh: bool = False, window: int = 0) -> torch.Tensor:
    """Attention of queries q [R, H, T, D] at ``q_positions`` [R, T] over each row's cached keys
    (positions < ``kv_len`` [R] <= ``max_kv``, pages listed in ``tables`` [R, *]), causal; returns
    [R, T, H * D]. ``window`` > 0: a query at position p sees the keys at p - window < position <= p (a sliding
    window layer, transformers' ``sliding_window``). ``fresh``: every row's queries are positions 0, 1, ... (a
    prompt with nothing cached before it), so the causal mask alone applies (when no window cuts it) and SDPA
    runs without an explicit mask."""
    rows, heads, length, dim = q.shape
    _, kv_heads, page, _ = k_cache.shape
    blocks = -(-max_kv // page)
    pages = tables[:, :blocks].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        kv = cache[pages].permute(0, 2, 1, 3, 4).reshape(rows, kv_heads, blocks * page, dim)
        return kv.repeat_interleave(heads // kv_heads, dim=1)

    if fresh and not 0 < window < max_kv:
        out = F.scaled_dot_product_attention(q, gather(k_cache), gather(v_cache), is_causal=True, scale=scale)
    else:
        key_pos = torch.arange(blocks * page, device=q.device)
        query_pos = q_positions.unsqueeze(-1)
        mask = (key_pos <= query_pos) & (key_pos < kv_len.view(rows, 1, 1))
        if window > 0:
            mask &= key_pos > query_pos - window
        out = F.scaled_dot_product_attention(q, gather(k_cache), gather(v_cache), attn_mask=mask.unsqueeze(1),
                                             scale=scale)
    return out.transpose(1, 2).reshape(rows, length, heads * dim)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     ctx: torch.Tensor, scale: float, splits: int, window: int = 0) -> torch.Tensor:
    """One query per row (q [B, H, D] at position ctx - 1) over its ``ctx`` cached keys, the last ``window`` of
    them where ``window`` > 0; returns [B, H * D]. ``splits`` divides each row's context among that many programs
    (the kernel's parallelism)."""
    if use_kernels(q):
        return kernels.decode_attention(q, k_cache, v_cache, tables, ctx, scale, splits, window=window)
    out = paged_attention(q.unsqueeze(2), k_cache, v_cache, tables, (ctx - 1).unsqueeze(1), ctx, scale,
                          max_kv=int(ctx.max()), window=window)
    return out.squeeze(1)
