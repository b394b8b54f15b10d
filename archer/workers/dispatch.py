"""How a worker method's per-rank results come back to the driver, and which rows each rank owns.

Every rank receives the same full arguments (one object-store copy); a worker takes its own rows with
``shard_bounds``/``shard_rows``. A method declares how the per-rank results are collected with ``@collect``:

    class RankWorkers:                    # workers/colocated.py
        @collect(concat_batches)          # each rank returns the Batch of its rows, concatenated in rank order
        def compute_log_prob(self, batch: Batch) -> Batch: ...

        @collect(rank_zero)               # ranks agree by construction (metrics already all-reduced)
        def update_critic(self, batch: Batch) -> UpdateResult: ...

        @collect(merge_updates)           # rank 0's metrics, every rank's influence factors merged
        def update_actor(self, batch: Batch, influence_tokens=None) -> UpdateResult: ...

A worker group refuses to call a method that declares no collector, so no result is dropped silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from archer.batch import Batch
from archer.distributed.context import shard_bounds

Collector = Callable[[list[Any]], Any]
"""Turns the list of per-rank results (index = rank) into what the driver receives."""

F = TypeVar("F", bound=Callable[..., Any])

_COLLECT_ATTR = "__archer_collect__"


def collect(collector: Collector) -> Callable[[F], F]:
    """Declare on a worker method how its per-rank results are collected (``rank_zero``, ``concat_batches``
    or any function of the list of results in rank order)."""
    if not callable(collector):
        raise TypeError(f"collect() takes a function of the per-rank results, got {collector!r}")

    def mark(method: F) -> F:
        setattr(method, _COLLECT_ATTR, collector)
        return method

    return mark


def rank_zero(results: list[Any]) -> Any:
    """Rank 0's result: for values every rank computes identically (all-reduced metrics, a saved path)."""
    return results[0]


def concat_batches(results: list[Batch]) -> Batch:
    """Each rank's Batch of its own rows, concatenated in rank order (``Batch.concat``; one rank: as is)."""
    if len(results) == 1:
        return results[0]
    return Batch.concat(results)


def collector_of(worker_cls: type, method_name: str) -> Collector:
    """The collector a worker class declares on ``method_name``; a clear error when there is none."""
    method = getattr(worker_cls, method_name, None)
    if method is None or not callable(method):
        raise AttributeError(f"{worker_cls.__name__} has no method {method_name!r}")
    collector = getattr(method, _COLLECT_ATTR, None)
    if collector is None:
        raise TypeError(
            f"{worker_cls.__name__}.{method_name} declares no collector: decorate it with "
            "@collect(rank_zero), @collect(concat_batches) or @collect(<function of the per-rank results>) "
            "(archer/workers/dispatch.py)"
        )
    return collector


def shard_rows(batch: Batch, rank: int, world: int) -> Batch:
    """The rows of ``batch`` that ``rank`` owns (see ``shard_bounds``); info is kept."""
    start, stop = shard_bounds(len(batch), rank, world)
    return batch.index(slice(start, stop))

