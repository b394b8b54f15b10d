"""The fast engine's Triton kernels against their plain torch versions (ops.py, sampling.py) on random inputs.

Runs on a CUDA GPU, or on a CPU under Triton's interpreter (TRITON_INTERPRET=1); skipped where Triton is
not installed (CPU builds of torch), where the engine runs the torch versions themselves.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

kernels = pytest.importorskip("archer.rollout.fast.kernels", reason="Triton is not installed")

from archer.rollout.fast import ops, sampling  # noqa: E402

if torch.cuda.is_available():
    DEVICE, DTYPES = "cuda", (torch.float32, torch.bfloat16)
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE, DTYPES = "cpu", (torch.float32,)
else:
    pytest.skip("the Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)


@contextlib.contextmanager
def _torch_ops():
    """Switch the kernels off, so ops and sampling run their torch versions."""
    saved, ops.kernels = ops.kernels, None
    try:
        yield
    finally:
        ops.kernels = saved


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm(dtype, with_residual):
    torch.manual_seed(0)
    x, res, w = _rand(5, 96, dtype=dtype), _rand(5, 96, dtype=dtype), _rand(96, dtype=dtype)
    residual = res if with_residual else None
    got = kernels.add_rmsnorm(x, residual, w, 1e-6)
    with _torch_ops():
        want = ops.add_rmsnorm(x, residual, w, 1e-6)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    torch.manual_seed(1)
    gate_up = _rand(3, 2 * 1100, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, **_tol(dtype))
    assert gate_up.shape[1] // 2 > 1024  # more than one block per row


def _cache(pages: int, kv_heads: int, page: int, dim: int, dtype: torch.dtype):
    return torch.zeros(pages, kv_heads, page, dim, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store(dtype, qk_norm):
    torch.manual_seed(2)
    heads, kv_heads, dim, page, tokens = 6, 2, 32, 16, 7
    qkv = _rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    positions = torch.tensor([0, 5, 17, 3, 40, 41, 2], device=DEVICE)
    slots = torch.tensor([16, 21, 50, 35, 80, 81, 3], device=DEVICE)
    angles = torch.arange(64, device=DEVICE).unsqueeze(1) * torch.rand(dim // 2, device=DEVICE)
    cos, sin = angles.cos(), angles.sin()
    norms = (_rand(dim, dtype=dtype), _rand(dim, dtype=dtype)) if qk_norm else (None, None)
    caches = [(_cache(6, kv_heads, page, dim, dtype), _cache(6, kv_heads, page, dim, dtype)) for _ in range(2)]
    q_kernel = kernels.rope_store(qkv, positions, slots, cos, sin, *norms, 1e-6, *caches[0], heads)
    with _torch_ops():
        q_torch = ops.rope_store(qkv, positions, slots, cos, sin, *norms, 1e-6, *caches[1], heads)
    torch.testing.assert_close(q_kernel, q_torch, **_tol(dtype))
    torch.testing.assert_close(caches[0][0], caches[1][0], **_tol(dtype))
    torch.testing.assert_close(caches[0][1], caches[1][1], **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (4, 4, 32)])
@pytest.mark.parametrize("tile_tokens", [16, 32, 64])  # 1, 2 or 4 pages a loop step (a split may end inside one)
def test_decode_attention(dtype, splits, heads, kv_heads, dim, tile_tokens):
    torch.manual_seed(3)
    page, pages = 16, 12
    k_cache, v_cache = _rand(pages, kv_heads, page, dim, dtype=dtype), _rand(pages, kv_heads, page, dim, dtype=dtype)
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [2, 4, 6, 8]], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([40, 1, 64], device=DEVICE)
    q = _rand(3, heads, dim, dtype=dtype)
    got = kernels.decode_attention(q, k_cache, v_cache, tables, ctx, dim ** -0.5, splits, tile_tokens)
    want = ops.paged_attention(q.unsqueeze(2), k_cache, v_cache, tables, (ctx - 1).unsqueeze(1), ctx,
                               dim ** -0.5, max_kv=int(ctx.max())).squeeze(1)
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("vocab", [300, 20000])
def test_sampling_kernel_matches_torch(vocab):
    torch.manual_seed(4)
    rows = 6
    logits = _rand(rows, vocab, scale=3.0)
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 1.0, 0.5], device=DEVICE)
    greedy = torch.tensor([False, False, False, True, False, False], device=DEVICE)
    keys = torch.tensor([sampling.noise_key(7, r) for r in range(rows)], device=DEVICE)
    positions = torch.tensor([3, 9, 1000, 4, 70000, 12], device=DEVICE)
    top_k = torch.tensor([0, 0, 0, 0, 5, 0], device=DEVICE)
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.6], device=DEVICE)
    threshold = sampling.filter_thresholds(logits, temperature, top_k, top_p)
    threshold[:4] = float("-inf")
    got = kernels.sample(logits, temperature, greedy, keys, positions, threshold)
    with _torch_ops():
        want = sampling.sample(logits, temperature, greedy, keys, positions, threshold)
    assert got[0].tolist() == want[0].tolist()
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2], want[2], atol=1e-4, rtol=1e-4)  # sums in another order


def test_sampling_kernel_takes_the_lowest_index_on_ties():
    """Greedy rows whose maximum repeats in other lanes, blocks and chunks (of 8,192 tokens) take the lowest
    index, as torch's argmax does; a row of equal logits takes token 0."""
    vocab = 20000
    logits = torch.zeros(3, vocab, device=DEVICE)
    logits[0, [17000, 5000, 2053, 1029, 9000]] = 2.0  # lanes 616, 904, 5, 5, 808 (of 1,024); chunks 2, 0, 0, 0, 1
    logits[1, [8192 + 3, 8192 * 2 + 1]] = 1.5  # only in later chunks
    ones = torch.ones(3, device=DEVICE)
    token, logp, _ = kernels.sample(logits, ones, torch.ones(3, dtype=torch.bool, device=DEVICE),
                                    torch.zeros(3, dtype=torch.long, device=DEVICE),
                                    torch.zeros(3, dtype=torch.long, device=DEVICE),
                                    torch.full((3,), float("-inf"), device=DEVICE))
    assert token.tolist() == [1029, 8195, 0]
    assert torch.allclose(logp[2], torch.tensor(-torch.log(torch.tensor(float(vocab))).item(), device=DEVICE))
