"""Triton kernels of the fast engine: the fused pieces of one decode step (add + RMSNorm, RoPE + paged KV
store, SiLU-and-multiply, paged decode attention, sampling with log-prob and entropy).

Imported only where Triton is available (a CUDA build of torch); ``ops.py`` holds the plain torch version
of every kernel, which is what runs on a CPU and what the kernel tests compare against. All arithmetic
inside is float32; results are rounded to the activation dtype where the torch version rounds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# -- counter-based noise (same bits as sampling.uniform_noise) -----------------------------------------


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _row_stream(key, position):
    return _fmix32(key ^ _fmix32(position * 0x9E3779B9 + 0x632BE5AB))


@triton.jit
def _uniform(stream, index):
    h = _fmix32(stream ^ (index * 0x27D4EB2F))
    return ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


# -- add + RMSNorm -------------------------------------------------------------------------------------


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, n_cols, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(new_res_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    out, new_res = torch.empty_like(x), torch.empty_like(x)
    _add_rmsnorm_kernel[(rows,)](x, x if residual is None else residual, weight, out, new_res, cols, eps,
                                 HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(cols))
    return out, new_res


# -- SiLU(gate) * up -----------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    inter = width // 2
    out = gate_up.new_empty(rows, inter)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out


# -- q/k norm, RoPE and the paged KV store -------------------------------------------------------------


@triton.jit
def _rope_store_kernel(qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps,
                       q_out_ptr, k_cache_ptr, v_cache_ptr,
                       H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                       QK_NORM: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = tl.arange(0, D // 2)
    width = (H + 2 * HKV) * D
    base = qkv_ptr + n * width + head * D
    x1 = tl.load(base + half)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(base + D // 2 + half).to(tl.float32)
    if QK_NORM:
        is_q = head < H
        w1 = tl.where(is_q, tl.load(qn_ptr + half), tl.load(kn_ptr + half)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qn_ptr + D // 2 + half), tl.load(kn_ptr + D // 2 + half)).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    pos = tl.load(pos_ptr + n)
    c = tl.load(cos_ptr + pos * (D // 2) + half)
    s = tl.load(sin_ptr + pos * (D // 2) + half)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    if head < H:
        dst = q_out_ptr + (n * H + head) * D
        tl.store(dst + half, o1.to(q_out_ptr.dtype.element_ty))
        tl.store(dst + D // 2 + half, o2.to(q_out_ptr.dtype.element_ty))
    else:
        kh = head - H
        slot = tl.load(slot_ptr + n)
        offset = ((slot // PAGE * HKV + kh) * PAGE + slot % PAGE) * D
        tl.store(k_cache_ptr + offset + half, o1.to(k_cache_ptr.dtype.element_ty))
        tl.store(k_cache_ptr + offset + D // 2 + half, o2.to(k_cache_ptr.dtype.element_ty))
        cols = tl.arange(0, D)
        v = tl.load(qkv_ptr + n * width + (H + HKV + kh) * D + cols)
        tl.store(v_cache_ptr + offset + cols, v.to(v_cache_ptr.dtype.element_ty))


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
               k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int) -> torch.Tensor:
    tokens = qkv.shape[0]
    _, kv_heads, page, dim = k_cache.shape
    q = qkv.new_empty(tokens, heads, dim)
    if tokens:
        _rope_store_kernel[(tokens, heads + kv_heads)](
            qkv, positions, slots, cos, sin, q_norm if q_norm is not None else cos,
            k_norm if k_norm is not None else cos, eps, q, k_cache, v_cache,
            H=heads, HKV=kv_heads, D=dim, PAGE=page, QK_NORM=q_norm is not None)
    return q


# -- paged decode attention (split over the context, then merged) --------------------------------------

# Cached tokens a program reads per step of its loop (a power of two of whole pages, at least one): 128 was the
# fastest of 32 / 64 / 128 at 64-512 rows of both benchmark shapes (BENCHMARKS.md, "The decode attention's tiles").
DECODE_TILE_TOKENS = 128


@triton.jit
def _decode_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, ctx_ptr, out_ptr, part_ptr,
                             lse_ptr, scale, table_width, window,
                             H: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                             D: tl.constexpr, PAGE: tl.constexpr, PAGES: tl.constexpr, SPLITS: tl.constexpr,
                             PRECISION: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    cols = tl.arange(0, D)
    heads = kh * GROUP + g
    q = tl.load(q_ptr + (row * H + heads)[:, None] * D + cols[None, :], mask=gmask[:, None], other=0.0)
    ctx = tl.load(ctx_ptr + row)
    # the keys at positions ctx - window and after (a sliding-window layer's; ``decode_attention`` gives every
    # other layer a window longer than any context): the pages before are skipped
    start = tl.maximum(ctx - window, 0)
    pages = tl.cdiv(ctx, PAGE)
    skipped = start // PAGE
    per_split = tl.cdiv(pages - skipped, SPLITS)
    first = skipped + split * per_split
    last = tl.minimum(first + per_split, pages)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    offs = tl.arange(0, PAGES * PAGE)  # PAGES pages a tile: more bytes in flight per step of the loop
    in_page = offs % PAGE
    for p in range(first, last, PAGES):
        index = p + offs // PAGE
        key_pos = index * PAGE + in_page
        valid = (index < last) & (key_pos < ctx) & (key_pos >= start)
        page = tl.load(table_ptr + row * table_width + index, mask=index < last, other=0).to(tl.int64)
        tile = ((page * HKV + kh) * PAGE + in_page)[:, None] * D + cols[None, :]
        k = tl.load(k_cache_ptr + tile, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + tile, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        probs = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(probs, axis=1)
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if SPLITS == 1:
        out = acc / total[:, None]
        tl.store(out_ptr + (row * H + heads)[:, None] * D + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        # an empty split leaves m = -inf and total = 0, which the merge weighs as 0
        slot = (row * H + heads) * SPLITS + split
        tl.store(part_ptr + slot[:, None] * D + cols[None, :], acc, mask=gmask[:, None])
        tl.store(lse_ptr + slot * 2, m, mask=gmask)
        tl.store(lse_ptr + slot * 2 + 1, total, mask=gmask)


@triton.jit
def _merge_splits_kernel(part_ptr, lse_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr):
    head_row = tl.program_id(0).to(tl.int64)  # row * H + head
    s = tl.arange(0, SPLITS)
    cols = tl.arange(0, D)
    m = tl.load(lse_ptr + (head_row * SPLITS + s) * 2)
    total = tl.load(lse_ptr + (head_row * SPLITS + s) * 2 + 1)
    top = tl.max(m, axis=0)
    weight = tl.where(total > 0, tl.exp(m - top), 0.0)
    acc = tl.load(part_ptr + (head_row * SPLITS + s)[:, None] * D + cols[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
    tl.store(out_ptr + head_row * D + cols, out.to(out_ptr.dtype.element_ty))


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     ctx: torch.Tensor, scale: float, splits: int, tile_tokens: int = DECODE_TILE_TOKENS, *,
                     window: int = 0) -> torch.Tensor:
    rows, heads, dim = q.shape
    _, kv_heads, page, _ = k_cache.shape
    group = heads // kv_heads
    out = q.new_empty(rows, heads * dim)
    if splits > 1:
        part = torch.empty(rows * heads * splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(rows * heads * splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = lse = out
    _decode_attention_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, tables, ctx, out, part, lse, scale, tables.shape[1], window if window > 0 else 2 ** 30,
        H=heads, HKV=kv_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=dim, PAGE=page,
        PAGES=_pow2_floor(max(1, tile_tokens // page)), SPLITS=splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    if splits > 1:
        _merge_splits_kernel[(rows * heads,)](part, lse, out, D=dim, SPLITS=splits)
    return out


# -- sampling: log-softmax statistics and the Gumbel-max draw in one pass over the vocabulary -------------

SAMPLE_BLOCK = 1024
SAMPLE_CHUNK = 8192


@triton.jit
def _sample_chunk_kernel(logits_ptr, temp_ptr, greedy_ptr, key_ptr, pos_ptr, thr_ptr, part_ptr, best_ptr,
                         vocab, chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # Each lane keeps its own sums (scaled to the block-wise running maximum m) and its own best draw, so a block
    # costs one reduction (its maximum); the lanes are reduced once, at the end of the chunk.
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    stream = _row_stream(tl.load(key_ptr + row).to(tl.uint32), tl.load(pos_ptr + row).to(tl.uint32))
    thr = tl.load(thr_ptr + row)
    m = float("-inf")
    total = tl.zeros([BLOCK], tl.float32)
    moment = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    best_x = tl.zeros([BLOCK], tl.float32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        valid = idx < vocab
        x = tl.load(logits_ptr + row * vocab + idx, mask=valid, other=float("-inf")).to(tl.float32) / temp
        m_new = tl.maximum(m, tl.max(x, axis=0))
        e = tl.exp(x - m_new)
        alpha = tl.exp(m - m_new)
        total = total * alpha + e
        moment = moment * alpha + tl.where(valid, e * x, 0.0)
        m = m_new
        gumbel = -tl.log(-tl.log(_uniform(stream, idx.to(tl.uint32))))
        score = tl.where(greedy, x, x + gumbel)
        score = tl.where(valid & (x >= thr), score, float("-inf"))
        take = score > best  # a lane keeps its earliest best: the lowest index on ties
        best_x = tl.where(take, x, best_x)
        best_i = tl.where(take, idx, best_i)
        best = tl.where(take, score, best)
    top = tl.max(best, axis=0)
    top_i = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)
    top_x = tl.sum(tl.where((best == top) & (best_i == top_i), best_x, 0.0), axis=0)
    out = (row * chunks + chunk) * 4
    tl.store(part_ptr + out, m)
    tl.store(part_ptr + out + 1, tl.sum(total, axis=0))
    tl.store(part_ptr + out + 2, tl.sum(moment, axis=0))
    tl.store(part_ptr + out + 3, top_x)
    tl.store(best_ptr + (row * chunks + chunk) * 2, top)
    tl.store(best_ptr + (row * chunks + chunk) * 2 + 1, top_i.to(tl.float32))


@triton.jit
def _sample_merge_kernel(part_ptr, best_ptr, tok_ptr, logp_ptr, ent_ptr, chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    live = c < chunks
    base = (row * chunks + c) * 4
    m = tl.load(part_ptr + base, mask=live, other=float("-inf"))
    total = tl.load(part_ptr + base + 1, mask=live, other=0.0)
    moment = tl.load(part_ptr + base + 2, mask=live, other=0.0)
    best_x = tl.load(part_ptr + base + 3, mask=live, other=0.0)
    best = tl.load(best_ptr + (row * chunks + c) * 2, mask=live, other=float("-inf"))
    best_i = tl.load(best_ptr + (row * chunks + c) * 2 + 1, mask=live, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(live, tl.exp(m - top), 0.0)
    z = tl.sum(total * w, axis=0)
    log_norm = top + tl.log(z)
    winner = tl.max(best, axis=0)
    first = tl.min(tl.where(best == winner, c, CHUNKS), axis=0)
    token = tl.sum(tl.where(c == first, best_i, 0.0), axis=0)
    x_tok = tl.sum(tl.where(c == first, best_x, 0.0), axis=0)
    tl.store(tok_ptr + row, token.to(tl.int64))
    tl.store(logp_ptr + row, x_tok - log_norm)
    tl.store(ent_ptr + row, log_norm - tl.sum(moment * w, axis=0) / z)


def sample(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, keys: torch.Tensor,
           positions: torch.Tensor, threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    chunk = min(SAMPLE_CHUNK, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, chunk)
    part = torch.empty(rows, chunks, 4, dtype=torch.float32, device=logits.device)
    best = torch.empty(rows, chunks, 2, dtype=torch.float32, device=logits.device)
    token = torch.empty(rows, dtype=torch.long, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_chunk_kernel[(rows, chunks)](logits, temperature, greedy, keys, positions, threshold, part, best,
                                         vocab, chunks, CHUNK=chunk, BLOCK=min(SAMPLE_BLOCK, chunk))
    _sample_merge_kernel[(rows,)](part, best, token, logp, entropy, chunks,
                                  CHUNKS=max(2, triton.next_power_of_2(chunks)))
    return token, logp, entropy
