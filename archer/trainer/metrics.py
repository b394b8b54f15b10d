"""Step metrics under verl's names: scores, rewards, advantages, lengths, entropy, timing, throughput,
and validation accuracy per data source."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from archer.algorithms.grouping import group_rows
from archer.batch import Batch, response_attention


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Adds the wall time of the block to ``timings[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


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
    return metrics


def compute_timing_metrics(timings: dict[str, float], num_tokens: int) -> dict[str, float]:
    metrics = {f"timing_s/{k}": v for k, v in timings.items()}
    step_time = timings.get("step", sum(timings.values()))
    metrics["perf/total_num_tokens"] = float(num_tokens)
    metrics["perf/time_per_step"] = step_time
    metrics["perf/throughput"] = num_tokens / step_time if step_time > 0 else 0.0
    return metrics


def validation_metrics(data_sources: np.ndarray, uids: np.ndarray, acc: np.ndarray, scores: np.ndarray,
                       n: int) -> dict[str, float]:
    """mean@n accuracy and score per data source, plus best@n (pass@n) when n > 1, and over all sources."""
    acc = np.asarray(acc, dtype=np.float64)
    by_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for ds, a, s in zip(data_sources, acc, scores):
        by_source[str(ds)]["acc"].append(float(a))
        by_source[str(ds)]["score"].append(float(s))
        by_source["all"]["acc"].append(float(a))
        by_source["all"]["score"].append(float(s))
    metrics: dict[str, float] = {}
    for ds, vals in by_source.items():
        metrics[f"val-core/{ds}/acc/mean@{n}"] = float(np.mean(vals["acc"]))
        metrics[f"val-aux/{ds}/score/mean@{n}"] = float(np.mean(vals["score"]))
    if n > 1:
        best: dict[str, list[float]] = defaultdict(list)
        for rows in group_rows(list(zip(data_sources, uids))):  # the n responses to one prompt of one source
            best[str(data_sources[rows[0]])].append(float(np.max(acc[rows])))
            best["all"].append(float(np.max(acc[rows])))
        for ds, vals in best.items():
            metrics[f"val-core/{ds}/acc/best@{n}/mean"] = float(np.mean(vals))
    return metrics
