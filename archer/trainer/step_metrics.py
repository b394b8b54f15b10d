"""Step metrics under verl's names: scores, rewards, advantages, lengths, entropy, timing, throughput, memory
(``perf/max_memory_*_gb`` per step and stage, ``perf/cpu_memory_used_gb``), and the mean of every numeric reward
extra (``reward/<key>/mean``). Validation's metrics are archer.eval.sampling_metrics'."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import psutil
import torch

from archer.batch import Batch, response_attention
from archer.rewards.extras import REWARD_EXTRAS, numeric_columns
from archer.units import GIB


@contextmanager
def timer(name: str, timings: dict[str, float], peaks: MemoryPeaks | None = None) -> Iterator[None]:
    """Adds the wall time of the block to ``timings[name]`` (and its peak GPU memory to ``peaks``)."""
    start = time.perf_counter()
    if peaks is not None:
        peaks.start()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
        if peaks is not None:
            peaks.stop(name)


class MemoryPeaks:
    """Peak GPU memory per timed stage (allocated and reserved by torch's caching allocator), for verl's
    ``perf/max_memory_allocated_gb`` / ``perf/max_memory_reserved_gb`` (the step's peak, over its stages) and
    archer's ``perf/max_memory_allocated_gb/<stage>``; nothing on a CPU. Nested stages restart the count, so
    an enclosing stage's peak is the maximum of its own and its inner stages'."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.allocated: dict[str, float] = {}
        self.reserved: dict[str, float] = {}

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self, name: str) -> None:
        if self.cuda:
            self.allocated[name] = max(self.allocated.get(name, 0.0), torch.cuda.max_memory_allocated(self.device) / GIB)
            self.reserved[name] = max(self.reserved.get(name, 0.0), torch.cuda.max_memory_reserved(self.device) / GIB)

    def metrics(self) -> dict[str, float]:
        """The step's figures; ``perf/cpu_memory_used_gb`` is the host's memory in use (psutil), as verl."""
        out = {"perf/cpu_memory_used_gb": psutil.virtual_memory().used / GIB}
        if self.allocated:
            out["perf/max_memory_allocated_gb"] = max(self.allocated.values())
            out["perf/max_memory_reserved_gb"] = max(self.reserved.values())
            out.update({f"perf/max_memory_allocated_gb/{k}": v for k, v in self.allocated.items() if k != "step"})
        return out


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


def compute_data_metrics(batch: Batch, *, max_response_length: int) -> dict[str, float]:
    """verl's data metrics of one training batch."""
    mask = batch["response_mask"].bool()  # learned tokens: advantages, returns, values, entropy
    valid = mask.any(dim=1)
    response_length = response_attention(batch).sum(dim=1).float()  # every token of the response
    prompt_length = batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(dim=1).float()
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", batch["token_level_scores"].sum(dim=1)))
    metrics.update(_stats("critic/rewards", batch["token_level_rewards"].sum(dim=1)))
    metrics.update(_stats("critic/advantages", batch["advantages"][mask]))
    metrics.update(_stats("critic/returns", batch["returns"][mask]))
    if "values" in batch.tensors:
        metrics.update(_stats("critic/values", batch["values"][mask]))
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = float((response_length >= max_response_length).float().mean())
    metrics.update(_stats("prompt_length", prompt_length))
    if "acc" in batch.rows:
        metrics["critic/acc/mean"] = float(np.mean(batch["acc"].astype(float)))
    metrics["actor/entropy"] = float(batch["entropies"][mask].mean()) if valid.any() else 0.0
    if REWARD_EXTRAS in batch.rows:
        for key, column in numeric_columns(batch[REWARD_EXTRAS]).items():
            metrics[f"reward/{key}/mean"] = float(np.nanmean(column))
    return metrics


def compute_timing_metrics(timings: dict[str, float], num_tokens: int) -> dict[str, float]:
    metrics = {f"timing_s/{k}": v for k, v in timings.items()}
    step_time = timings.get("step", sum(timings.values()))
    metrics["perf/total_num_tokens"] = float(num_tokens)
    metrics["perf/time_per_step"] = step_time
    metrics["perf/throughput"] = num_tokens / step_time if step_time > 0 else 0.0
    return metrics
