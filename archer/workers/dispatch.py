"""How a worker method's rows are split over the ranks and its per-rank results come back to the driver.

Every rank receives the same full arguments (one object-store copy). A method declares with ``@collect`` how the
per-rank results are collected and, with ``split``, what of its first positional argument the rank's method works
on; the declaration wraps the method so that the split is made there, once, from the rank's place (``self.ctx``:
its ``rank`` and ``world_size``), whoever calls it (a worker group, or a test at world 1):

    class ActorWorker:                                          # workers/actor.py
        @collect(concat_batches, split=own_passes("log_prob_micro"))
        def compute_log_prob(self, share: PassShare) -> Batch: ...   # called with the whole batch

        @collect(merge_updates)                                 # split=whole: every mini-batch is cut by its passes
        def update_actor(self, batch: Batch, influence_tokens=None) -> UpdateResult: ...

Every split mode takes a rank's rows from ``rank_share`` (contiguous rows, as ``numpy.array_split``):

- ``whole`` (the default): the argument as it came;
- ``own_rows``: the batch's rows of the rank (``info[FIRST_ROW]``: the first one's index in the whole batch; at
  world 1 the batch as it came);
- ``own_rows_or_stand_in``: the same, and a rank without rows gets row 0 marked ``info[STAND_IN]`` (a generation
  whose engine must still take part in the ranks' collectives);
- ``own_passes`` (workers/data_parallel.py): the whole batch with the rank's micro-batches over its rows, padded
  so that every rank of a sharded model runs as many;
- ``admitted_share`` (workers/async_rollout.py): the rows of each admitted prompt batch that the rank takes.

A worker group refuses to call a method that declares no collector, so no result is dropped silently.
``delegate`` makes the rank-side method that only hands its call to one of the rank's workers, from that worker
method's declaration (its collector, unless one is given; the worker's method makes its own split):

    class RankWorkers:                                          # workers/colocated.py
        compute_log_prob = delegate("actor", ActorWorker.compute_log_prob)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from archer.batch import Batch
from archer.distributed.context import shard_bounds

Collector = Callable[[list[Any]], Any]
"""Turns the list of per-rank results (index = rank) into what the driver receives."""

Splitter = Callable[[Any, Any], Any]
"""(the method's first argument, the worker whose method it is: ``worker.ctx`` places it) -> what the method
works on."""

F = TypeVar("F", bound=Callable[..., Any])

FIRST_ROW = "first_row"  # info key of a rank's rows: the index of the first one in the whole batch
STAND_IN = "stand_in"  # info key of a rank's rows: True where the rank has none and was handed row 0 to run

_COLLECT_ATTR = "__archer_collect__"
_SPLIT_ATTR = "__archer_split__"


def rank_share(n_rows: int, rank: int, world: int) -> slice:
    """The contiguous rows of ``n_rows`` that ``rank`` of ``world`` owns (``shard_bounds``: as
    ``numpy.array_split``, the first ``n_rows % world`` ranks get one row more). Every split mode's rows."""
    return slice(*shard_bounds(n_rows, rank, world))


@dataclass(frozen=True)
class Seat:
    """The ``ctx`` of a worker that has no process group among its ranks (a standalone rollout rank): its rank
    and the number of ranks of its group."""

    rank: int
    world_size: int


def place(worker: Any) -> tuple[int, int]:
    """The rank and world size of the worker (its ``ctx``)."""
    return int(worker.ctx.rank), int(worker.ctx.world_size)


def whole(value: Any, worker: Any) -> Any:
    """``split``: every rank takes the whole argument."""
    return value


def own_rows(batch: Batch, worker: Any) -> Batch:
    """``split``: the rank's rows of the batch (``rank_share``), ``info[FIRST_ROW]`` their first index; at world 1
    the batch as it came."""
    rank, world = place(worker)
    if world == 1:
        return batch
    rows = rank_share(len(batch), rank, world)
    share = batch.index(rows)
    share.info[FIRST_ROW] = rows.start
    return share


def own_rows_or_stand_in(batch: Batch, worker: Any) -> Batch:
    """``split``: as ``own_rows``, but a rank without rows gets row 0 of the batch with ``info[STAND_IN]`` set, to
    run and drop (its engine still syncs and takes part in the ranks' collectives)."""
    rank, world = place(worker)
    if world == 1:
        return batch
    rows = rank_share(len(batch), rank, world)
    if rows.stop > rows.start:
        return own_rows(batch, worker)
    share = batch.index(slice(0, 1))
    share.info[FIRST_ROW] = rows.start
    share.info[STAND_IN] = True
    return share


def collect(collector: Collector, *, split: Splitter = whole) -> Callable[[F], F]:
    """Declare on a worker method how its per-rank results are collected (``rank_zero``, ``concat_batches``
    or any function of the list of results in rank order) and what of its first argument it works on (``split``,
    made on every call from ``self.ctx``)."""
    if not callable(collector):
        raise TypeError(f"collect() takes a function of the per-rank results, got {collector!r}")
    if not callable(split):
        raise TypeError(f"collect(split=...) takes a function of (argument, worker), got {split!r}")

    def mark(method: F) -> F:
        if split is whole:
            declared: Callable[..., Any] = method
        else:
            @functools.wraps(method)
            def declared(self: Any, first: Any, *args: Any, **kwargs: Any) -> Any:
                return method(self, split(first, self), *args, **kwargs)

        setattr(declared, _COLLECT_ATTR, collector)
        setattr(declared, _SPLIT_ATTR, split)
        return declared  # type: ignore[return-value]

    return mark


def delegate(role: str, method: Callable[..., Any], collector: Collector | None = None, *,
             split: Splitter = whole) -> Callable[..., Any]:
    """A rank's method that hands its call to ``method`` (a worker class's method) of the rank's ``role`` worker
    (an attribute of the rank, None where the run has none), declared with the worker method's collector
    (``collector`` replaces it) and ``split`` (default ``whole``: the worker's method makes its own)."""
    name = method.__name__
    chosen = collector if collector is not None else getattr(method, _COLLECT_ATTR, None)
    if chosen is None:
        raise TypeError(f"delegate({role!r}, {method.__qualname__}): the method declares no collector and none "
                        "was given (archer/workers/dispatch.py)")

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, role), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``{role}.{name}`` of this rank ({method.__qualname__})."
    return collect(chosen, split=split)(call)


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


def split_of(worker_cls: type, method_name: str) -> Splitter:
    """How ``method_name`` of ``worker_cls`` splits its first argument (``whole`` when it declares none)."""
    return getattr(getattr(worker_cls, method_name), _SPLIT_ATTR, whole)
