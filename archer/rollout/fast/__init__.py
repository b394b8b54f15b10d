"""archer's fast generation engine for the Qwen2 family: own forward, paged KV cache, continuous batching,
CUDA graphs and per-row seeded sampling (``FastEngine``); plain torch on a CPU, Triton kernels on a GPU."""

from archer.rollout.fast.engine import FastEngine, FastSession

__all__ = ["FastEngine", "FastSession"]
