"""How a worker method's rows are split over the ranks and its per-rank results come back to the driver.

Every rank receives the same full arguments (one object-store copy). A method declares with ``@collect`` how the
per-rank results are collected and, with ``split``, which rows of its first argument the rank's method works on:
``whole`` (the default: the worker's own passes cut the batch, e.g. ``data_parallel.rank_passes``, which may
balance the rows) or ``own_rows`` (the rank's contiguous rows, ``shard_rows``):

    class RankWorkers:                    # workers/colocated.py
        @collect(concat_batches)          # each rank returns the Batch of its rows, concatenated in rank order
        def compute_log_prob(self, batch: Batch) -> Batch: ...

        @collect(rank_zero)               # ranks agree by construction (metrics already all-reduced)
        def update_critic(self, batch: Batch) -> UpdateResult: ...

        @collect(merge_updates)           # rank 0's metrics, every rank's influence factors merged
        def update_actor(self, batch: Batch, influence_tokens=None) -> UpdateResult: ...

A worker group refuses to call a method that declares no collector, so no result is dropped silently.
``delegate`` makes the rank-side method that only hands its call to one of the rank's workers, the split and
the collector declared in one line:

    compute_values = delegate("critic", "compute_values", concat_batches)
    compute_rm_score = delegate("reward_model", "compute_rm_score", concat_batches, split=own_rows)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from archer.batch import Batch
from archer.distributed.context import shard_bounds

Collector = Callable[[list[Any]], Any]
"""Turns the list of per-rank results (index = rank) into what the driver receives."""

Splitter = Callable[[Any, int, int], Any]
"""(the method's first argument, rank, world size) -> what the rank's method works on."""

F = TypeVar("F", bound=Callable[..., Any])

_COLLECT_ATTR = "__archer_collect__"
_SPLIT_ATTR = "__archer_split__"


def whole(value: Any, rank: int, world: int) -> Any:
    """Every rank takes the whole argument (the worker cuts its own rows)."""
    return value


def collect(collector: Collector, *, split: Splitter = whole) -> Callable[[F], F]:
    """Declare on a worker method how its per-rank results are collected (``rank_zero``, ``concat_batches``
    or any function of the list of results in rank order) and how its first argument's rows are split
    (``whole`` or ``own_rows``)."""
    if not callable(collector):
        raise TypeError(f"collect() takes a function of the per-rank results, got {collector!r}")
    if not callable(split):
        raise TypeError(f"collect(split=...) takes a function of (argument, rank, world), got {split!r}")

    def mark(method: F) -> F:
        setattr(method, _COLLECT_ATTR, collector)
        setattr(method, _SPLIT_ATTR, split)
        return method

    return mark


def delegate(role: str, method: str, collector: Collector, *, split: Splitter = whole) -> Callable[..., Any]:
    """A rank's method that hands its call to ``method`` of the rank's ``role`` worker (an attribute of the
    rank), the first argument split by ``split`` for the rank (``self.ctx``: its rank and world size); declared
    with ``collector`` and ``split``."""
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            args = (split(args[0], self.ctx.rank, self.ctx.world_size), *args[1:])
        return getattr(getattr(self, role), method)(*args, **kwargs)

    call.__name__ = call.__qualname__ = method
    call.__doc__ = f"``{role}.{method}`` on this rank's {'rows' if split is own_rows else 'share'} of the call."
    return collect(collector, split=split)(call)


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


def own_rows(batch: Batch, rank: int, world: int) -> Batch:
    """``split``: the rank's contiguous rows of the batch (``shard_rows``)."""
    return shard_rows(batch, rank, world)


def split_of(worker_cls: type, method_name: str) -> Splitter:
    """How ``method_name`` of ``worker_cls`` splits its first argument (``whole`` when it declares none)."""
    return getattr(getattr(worker_cls, method_name), _SPLIT_ATTR, whole)

