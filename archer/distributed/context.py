"""The process group a rank runs in: its rank, world size, device and the 1-D device mesh FSDP2 shards over.

``DistContext.single(device)`` is today's single process (world 1, no process group, no mesh: nothing is
sharded). ``DistContext.init_from_env(device_kind, timeout_s)`` is one rank of a multi-process run: it reads
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK (set by the worker group, or by torchrun), starts
torch.distributed (gloo on the CPU; ``cpu:gloo,cuda:nccl`` on GPUs, so CPU-offloaded tensors and checkpoint
collectives have a CPU backend) and builds the mesh with its device type named explicitly (without one,
``fully_shard`` picks CUDA whenever it is present, which breaks gloo runs).

The reductions (``all_reduce_sum`` / ``all_reduce_max``) and ``barrier`` are no-ops at world 1, so a worker
calls them the same way in both cases. ``shard_bounds`` gives a rank its contiguous slice of a batch's rows.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from archer.distributed.stores import hosted_store, joined_store
from archer.errors import ArcherError

ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
DeviceKind = Literal["cpu", "cuda"]


def _rendezvous(rank: int, timeout_s: float) -> dist.Store | None:
    """The process group's store at MASTER_ADDR:MASTER_PORT, rank 0 listening on that address only (torch's env://
    store listens on every interface); None under torchrun, whose agent already hosts the store there."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return hosted_store(host, port, timeout_s) if rank == 0 else joined_store(host, port, timeout_s)


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the run. ``mesh`` is None exactly when there is no process group (world 1
    in one process): then nothing is sharded and every collective helper returns its input."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh | None = None

    @classmethod
    def single(cls, device: torch.device | str) -> DistContext:
        """The single-process run on ``device``: world 1, no process group."""
        return cls(rank=0, world_size=1, local_rank=0, device=torch.device(device))

    @classmethod
    def init_from_env(cls, device_kind: DeviceKind, timeout_s: float) -> DistContext:
        """Join the process group the environment describes (``ENV_KEYS``) and build the 1-D mesh over it.

        ``timeout_s`` bounds every collective (verl's ``trainer.dist_timeout_s``): a rank that waits longer
        for a peer fails with an error instead of hanging."""
        missing = [key for key in ENV_KEYS if not os.environ.get(key)]
        if missing:
            raise ArcherError(f"a distributed rank needs the environment variables {', '.join(ENV_KEYS)}; "
                              f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set",
                              "start ranks through archer's worker group (trainer.n_gpus_per_node > 1) or "
                              "torchrun, which set them")
        rank, world, local_rank = (int(os.environ[key]) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        if device_kind == "cuda":
            if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
                raise ArcherError(f"rank {rank} (LOCAL_RANK={local_rank}) needs a CUDA device, but this node has "
                                  f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} usable GPUs",
                                  "set trainer.n_gpus_per_node to the GPUs per node, or trainer.device=cpu")
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            backend = "cpu:gloo,cuda:nccl"
        elif device_kind == "cpu":
            device, backend = torch.device("cpu"), "gloo"
        else:
            raise ArcherError(f"unknown device kind {device_kind!r} for a distributed rank", "use 'cpu' or 'cuda'")
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, rank=rank, world_size=world, store=_rendezvous(rank, timeout_s),
                                    timeout=timedelta(seconds=timeout_s))
        mesh = init_device_mesh(device.type, (world,))
        return cls(rank=rank, world_size=world, local_rank=local_rank, device=device, mesh=mesh)

    @property
    def distributed(self) -> bool:
        """True when a process group is up (collectives communicate)."""
        return self.mesh is not None

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes shared files."""
        return self.rank == 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over ranks, in place (and returned)."""
        return self._all_reduce(tensor, dist.ReduceOp.SUM)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s element-wise maximum over ranks, in place (and returned)."""
        return self._all_reduce(tensor, dist.ReduceOp.MAX)

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=op)
        return tensor

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.distributed:
            dist.barrier()

    def destroy(self) -> None:
        """Leave the process group once every rank gets here; the context must not be used afterwards.

        Drop the models sharded over this context first: a process group that some object still holds
        outlives ``destroy_process_group`` and is torn down at interpreter exit, where gloo aborts the
        process ("terminate called without an active exception") in about one exit of five. For the same
        reason the groups the mesh cached (torch 2.13's ``DeviceMesh._pg_registry``) are released here."""
        if not (self.distributed and dist.is_initialized()):
            return
        dist.barrier()
        dist.destroy_process_group()
        registry = getattr(self.mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
        gc.collect()


def shard_bounds(n_rows: int, rank: int, world: int) -> tuple[int, int]:
    """The contiguous rows ``[start, stop)`` of ``n_rows`` that ``rank`` of ``world`` takes: as
    ``np.array_split``, the first ``n_rows % world`` ranks get one row more."""
    if world < 1 or not 0 <= rank < world or n_rows < 0:
        raise ValueError(f"shard_bounds needs 0 <= rank < world and n_rows >= 0 (got n_rows={n_rows}, "
                         f"rank={rank}, world={world})")
    base, extra = divmod(n_rows, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)

