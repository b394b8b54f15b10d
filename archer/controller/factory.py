"""``build_worker_group``: the worker group for a run's ranks, in this process at world 1
(``LocalWorkerGroup``, archer/controller/worker_group.py) or one Ray actor per rank (``RayWorkerGroup``,
archer/controller/ray_group.py, imported only then, so a single-device run never imports Ray)."""

from __future__ import annotations

from typing import Any, Literal

from archer.controller.ray_cluster import LocalRay
from archer.controller.worker_group import LocalWorkerGroup, WorkerGroup
from archer.distributed.context import DeviceKind
from archer.errors import ArcherError


def build_worker_group(
    worker_cls: type,
    init_kwargs: dict[str, Any],
    *,
    nnodes: int = 1,
    n_gpus_per_node: int = 1,
    device_kind: DeviceKind | Literal["auto"] = "auto",
    placement_timeout_s: float = 120.0,
    call_timeout_s: float | None = None,
    local_ray: LocalRay | None = None,
) -> WorkerGroup:
    """The worker group for ``trainer.nnodes * trainer.n_gpus_per_node`` ranks of ``worker_cls(**init_kwargs)``.

    World 1 builds the worker in this process (``LocalWorkerGroup``; Ray is never imported). World > 1 starts
    one Ray actor per rank (``RayWorkerGroup``): on the cluster at ``RAY_ADDRESS`` when set, else on a local
    Ray instance; with ``device_kind="cpu"`` each rank is a CPU process (gloo), ``n_gpus_per_node`` counting
    processes per node. ``placement_timeout_s`` bounds the wait for the resources, ``call_timeout_s`` (None:
    no limit) each ``call``; ``local_ray``: the settings of the local Ray started without ``RAY_ADDRESS``.
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
                          call_timeout_s=call_timeout_s, local_ray=local_ray)
