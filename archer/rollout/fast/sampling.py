"""Per-row seeded sampling for the fast engine: counter-based noise, top-k / top-p thresholds and the draw.

A row's noise is a hash of (row key, token position, vocabulary index) made with 32-bit integer operations,
so it needs no random-number generator state: the same row gets the same noise whatever rows share its
batch, on a CPU, on a GPU and inside a CUDA graph. The draw is Gumbel-max over softmax(logits / T)
restricted to the tokens that top-k / top-p keep; the log-prob and the full-vocabulary entropy reported
with it are those of the unfiltered softmax(logits / T), in float32 (T = 1 for greedy rows).
"""

from __future__ import annotations

import torch

from archer.models.logprobs import token_logprob_and_entropy
from archer.rollout.fast.ops import kernels, use_kernels

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 tensors holding uint32 values, without overflowing int64."""
    return ((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_noise(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) float32 noise [B, vocab] of rows with 32-bit ``keys`` sampling at ``positions``."""
    stream = _fmix32(keys ^ _fmix32((_mul32(positions & _M32, 0x9E3779B9) + 0x632BE5AB) & _M32))
    index = torch.arange(vocab, device=keys.device)
    h = _fmix32(stream.unsqueeze(1) ^ _mul32(index, 0x27D4EB2F).unsqueeze(0))
    return ((h >> 8).float() + 0.5) * (1.0 / 16777216.0)


def noise_key(seed: int, stream: int = 0) -> int:
    """A row's 32-bit noise key from a seed and a stream number (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + (stream + 1) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return (z ^ (z >> 32)) & _M32


def filter_thresholds(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """The smallest scaled logit each row keeps under top-k (<= 0: off) then top-p (1: off), as Hugging
    Face's TopK then TopP warpers keep them; tokens whose logit / T is below it cannot be drawn."""
    x = logits.float() / temperature.unsqueeze(1)
    vocab = x.shape[-1]
    ordered = x.sort(dim=-1, descending=True).values
    ranks = torch.arange(vocab, device=x.device)
    in_k = ranks < torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).unsqueeze(1)
    probs = torch.softmax(ordered.masked_fill(~in_k, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = in_k & (mass_before < top_p.unsqueeze(1))
    return ordered.gather(-1, keep.sum(-1, keepdim=True) - 1).squeeze(-1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, keys: torch.Tensor,
           positions: torch.Tensor, threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token [B], its log-prob [B] and the entropy [B] of softmax(logits / temperature) for each row.

    Greedy rows take the argmax (lowest index on ties); the others the Gumbel-max draw with their noise at
    ``positions`` (the positions of the tokens being drawn) among logits / T >= ``threshold``.
    """
    if use_kernels(logits):
        return kernels.sample(logits, temperature, greedy, keys, positions, threshold)
    x = logits.float() / temperature.unsqueeze(1)
    gumbel = -torch.log(-torch.log(uniform_noise(keys, positions, x.shape[-1])))
    score = torch.where(greedy.unsqueeze(1), x, x + gumbel)
    token = score.masked_fill(x < threshold.unsqueeze(1), float("-inf")).argmax(-1)
    logp, entropy = token_logprob_and_entropy(x, token)
    return token, logp, entropy
