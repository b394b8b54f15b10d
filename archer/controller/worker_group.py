"""The worker group interface: the driver's one handle on a role's workers, for one rank or many.

``group.call("compute_log_prob", batch)`` runs the method on every rank with the same full arguments and
returns the per-rank results collected as the method declares (``archer/workers/dispatch.py``). World 1 is
the ``LocalWorkerGroup`` here: the worker lives in this process and is called directly, with no Ray and no
copy. World > 1 is the ``RayWorkerGroup`` (``archer/controller/ray_group.py``): one Ray actor per rank.
``build_worker_group`` (``archer/controller/factory.py``) picks one; the trainer reads the same for both.
``group.submit(...)`` starts the same call and returns at once (``PendingCall``): two groups' calls then run
side by side (separate_async: the rollout ranks generate while the trainer ranks train).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any

from archer.workers.dispatch import collector_of


class PendingCall(ABC):
    """A call started on every rank of a group; ``result`` waits for it and collects as ``call`` does."""

    @abstractmethod
    def result(self) -> Any: ...


class DoneCall(PendingCall):
    """A call whose result is already here."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


class WorkerGroup(ABC):
    """The ranks of one worker class; ``call`` returns the collected result of a method run on every rank."""

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @abstractmethod
    def call(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method_name(*args, **kwargs)`` on every rank and apply the method's declared collector to
        the list of per-rank results (rank order)."""

    def submit(self, method_name: str, *args: Any, **kwargs: Any) -> PendingCall:
        """Start ``call(method_name, ...)`` and return without waiting (in process: it has run when this returns)."""
        return DoneCall(self.call(method_name, *args, **kwargs))

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
