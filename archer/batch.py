"""Batch: the container every stage of the RL step takes and returns.

A Batch holds
- ``tensors``: torch tensors that share the first (row) dimension,
- ``rows``: per-row metadata as numpy object arrays of the same length (uid, data_source, ...),
- ``info``: batch-level values (sampling settings, timing, the global step ...).
Field names follow verl's (``responses``, ``response_mask``, ``old_log_probs`` ...).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def _as_object_array(values: Sequence[Any] | np.ndarray) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``. A CPU tensor bound for a GPU goes through pinned memory without the host waiting:
    a copy from ordinary memory makes the host wait for all the work queued on the GPU before it, which leaves the
    GPU idle between micro-batches while the host queues the next one (docs/architecture.md, "The host never
    waits inside a pass")."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _same_rows(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (len(a) == len(b) and all(x is y or np.array_equal(x, y) for x, y in zip(a, b)))


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rows = {k: _as_object_array(v) for k, v in self.rows.items()}
        self._check_lengths()

    # -- shape -----------------------------------------------------------------------------------
    def _check_lengths(self) -> None:
        lengths = {k: int(v.shape[0]) for k, v in self.tensors.items()}
        lengths.update({k: len(v) for k, v in self.rows.items()})
        if len(set(lengths.values())) > 1:
            raise ValueError(f"Batch fields disagree on the number of rows: {lengths}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for v in self.rows.values():
            return len(v)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.rows

    def __getitem__(self, key: str) -> torch.Tensor | np.ndarray:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.rows:
            return self.rows[key]
        raise KeyError(f"Batch has no field {key!r}; it has {sorted(self.tensors) + sorted(self.rows)}")

    def __setitem__(self, key: str, value: torch.Tensor | Sequence[Any] | np.ndarray) -> None:
        n = int(value.shape[0]) if isinstance(value, torch.Tensor) else len(value)
        others = {len(self[k]) for k in self if k != key}
        if others and others != {n}:
            raise ValueError(f"field {key!r} has {n} rows but the batch has {sorted(others)}")
        self.tensors.pop(key, None)
        self.rows.pop(key, None)
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.rows[key] = _as_object_array(value)

    # -- selection ---------------------------------------------------------------------------------
    def select(self, keys: Sequence[str], info_keys: Sequence[str] | None = None) -> Batch:
        """A batch with only the named fields (tensors or rows); info is kept unless info_keys is given."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no field(s) {missing}")
        info = dict(self.info) if info_keys is None else {k: self.info[k] for k in info_keys}
        return Batch(
            {k: v for k, v in self.tensors.items() if k in keys},
            {k: v for k, v in self.rows.items() if k in keys},
            info,
        )

    def index(self, idx: torch.Tensor | np.ndarray | Sequence[int] | slice) -> Batch:
        """Rows picked by an index list, a boolean mask or a slice."""
        if isinstance(idx, slice):
            return Batch(
                {k: v[idx] for k, v in self.tensors.items()},
                {k: v[idx] for k, v in self.rows.items()},
                dict(self.info),
            )
        np_idx = idx.cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
        if np_idx.dtype == bool:
            np_idx = np.nonzero(np_idx)[0]
        np_idx = np_idx.astype(np.int64)
        t_idx = torch.as_tensor(np_idx)
        return Batch(
            {k: v[t_idx.to(v.device)] for k, v in self.tensors.items()},
            {k: v[np_idx] for k, v in self.rows.items()},
            dict(self.info),
        )

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of at most ``size`` rows."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list[Batch]:
        """``n`` pieces of equal size (the row count must divide evenly)."""
        if len(self) % n:
            raise ValueError(f"cannot chunk {len(self)} rows into {n} equal pieces")
        return self.split(len(self) // n)

    def __iter__(self) -> Iterator[str]:
        yield from self.tensors
        yield from self.rows

    # -- combination -------------------------------------------------------------------------------
    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order; info of the first."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        rows = {k: np.concatenate([b.rows[k] for b in batches]) for k in first.rows}
        return Batch(tensors, rows, dict(first.info))

    def union(self, other: Batch) -> Batch:
        """Fields of both (same rows); a field present in both must be equal."""
        if len(self) != len(other) and len(self) and len(other):
            raise ValueError(f"union of batches of {len(self)} and {len(other)} rows")
        tensors = dict(self.tensors)
        for k, v in other.tensors.items():
            if k in tensors and not torch.equal(tensors[k].cpu(), v.cpu()):
                raise ValueError(f"union: field {k!r} differs between the batches")
            tensors[k] = v
        rows = dict(self.rows)
        for k, v in other.rows.items():
            if k in rows and not _same_rows(rows[k], v):
                raise ValueError(f"union: field {k!r} differs between the batches")
            rows[k] = v
        return Batch(tensors, rows, {**self.info, **other.info})

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row n times: interleaved (a a b b) or tiled (a b a b)."""
        if interleave:
            tensors = {k: v.repeat_interleave(n, dim=0) for k, v in self.tensors.items()}
            rows = {k: np.repeat(v, n) for k, v in self.rows.items()}
        else:
            tensors = {k: v.repeat(n, *([1] * (v.dim() - 1))) for k, v in self.tensors.items()}
            rows = {k: np.tile(v, n) for k, v in self.rows.items()}
        return Batch(tensors, rows, dict(self.info))

    def to(self, device: torch.device | str) -> Batch:
        """The batch with its tensors on ``device`` (``to_device``: no wait for the GPU)."""
        return Batch({k: to_device(v, device) for k, v in self.tensors.items()}, dict(self.rows), dict(self.info))

    def pop(self, keys: Sequence[str]) -> Batch:
        """Remove the named fields and return them as a batch."""
        out = self.select(keys)
        for k in keys:
            self.tensors.pop(k, None)
            self.rows.pop(k, None)
        return out


def response_attention(batch: Batch) -> torch.Tensor:
    """The response part of the attention mask: 1 on every token present in the response (the policy's and
    tool output), 0 on padding. What is learned from is ``response_mask``, a subset of it."""
    attention = batch["attention_mask"]
    return attention[:, attention.shape[1] - batch["responses"].shape[1]:]
