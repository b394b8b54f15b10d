"""Worker groups: the driver's one handle on a role's workers, for one rank or many.

``group.call("compute_log_prob", batch)`` runs the method on every rank with the same full arguments and
returns the per-rank results collected as the method declares (``archer/workers/dispatch.py``). World 1 is
the ``LocalWorkerGroup``: the worker lives in this process and is called directly, with no Ray and no copy.
World > 1 is the ``RayWorkerGroup`` (``archer/controller/ray_group.py``): one Ray actor per rank. The trainer
reads the same for both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any, Literal

from archer.errors import ArcherError
from archer.workers.dispatch import collector_of

DeviceKind = Literal["auto", "cpu", "cuda"]


class WorkerGroup(ABC):
    """The ranks of one worker class; ``call`` returns the collected result of a method run on every rank."""

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @abstractmethod
    def call(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method_name(*args, **kwargs)`` on every rank and apply the method's declared collector to
        the list of per-rank results (rank order)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers (idempotent)."""

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()


class LocalWorkerGroup(WorkerGroup):
    """World 1: one worker object in this process, its methods called directly."""

    def __init__(self, worker: object) -> None:
        self._worker: object | None = worker

    @property
    def world_size(self) -> int:
        return 1

    @property
    def worker(self) -> object:
        """The in-process worker (world 1 only; code meant for any world size goes through ``call``)."""
        if self._worker is None:
            raise RuntimeError("the worker group was shut down")
        return self._worker

    def call(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        worker = self.worker
        collector = collector_of(type(worker), method_name)
        return collector([getattr(worker, method_name)(*args, **kwargs)])

    def shutdown(self) -> None:
        self._worker = None


def build_worker_group(
    worker_cls: type,
    init_kwargs: dict[str, Any],
    *,
    nnodes: int = 1,
    n_gpus_per_node: int = 1,
    device_kind: DeviceKind = "auto",
    placement_timeout_s: float = 120.0,
    call_timeout_s: float | None = None,
) -> WorkerGroup:
    """The worker group for ``trainer.nnodes * trainer.n_gpus_per_node`` ranks of ``worker_cls(**init_kwargs)``.

    World 1 builds the worker in this process (``LocalWorkerGroup``; Ray is never imported). World > 1 starts
    one Ray actor per rank (``RayWorkerGroup``): on the cluster at ``RAY_ADDRESS`` when set, else on a local
    Ray instance; with ``device_kind="cpu"`` each rank is a CPU process (gloo), ``n_gpus_per_node`` counting
    processes per node. ``placement_timeout_s`` bounds the wait for the resources, ``call_timeout_s`` (None:
    no limit) each ``call``.
    """
    for key, value in (("trainer.nnodes", nnodes), ("trainer.n_gpus_per_node", n_gpus_per_node)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ArcherError(f"{key} must be a whole number >= 1, got {value!r}",
                              f"set {key}=1 for one device, or the number of nodes / devices per node")
    if nnodes * n_gpus_per_node == 1:
        return LocalWorkerGroup(worker_cls(**init_kwargs))
    from archer.controller.ray_group import RayWorkerGroup

    return RayWorkerGroup(worker_cls, init_kwargs, nnodes=nnodes, n_gpus_per_node=n_gpus_per_node,
                          device_kind=device_kind, placement_timeout_s=placement_timeout_s,
                          call_timeout_s=call_timeout_s)
