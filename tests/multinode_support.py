"""A rank worker for tests/test_multinode.py: it joins the process group from the environment the Ray worker group
sets (MASTER_ADDR/MASTER_PORT: TCP to rank 0's node) and reports where it runs."""

from __future__ import annotations

import os

import torch

from archer.distributed.context import DistContext
from archer.workers.dispatch import collect


class WhereWorker:
    """Joins the gloo process group at construction."""

    def __init__(self) -> None:
        self.ctx = DistContext.init_from_env("cpu", timeout_s=60.0)

    @collect(list)
    def where(self) -> dict:
        """This rank's Ray node, its master address and the all-reduced sum of rank + 1 over the ranks."""
        import ray

        total = self.ctx.all_reduce_sum(torch.tensor([float(self.ctx.rank + 1)]))
        return {"node": ray.get_runtime_context().get_node_id(), "master": os.environ["MASTER_ADDR"],
                "rank": self.ctx.rank, "sum": float(total.item())}
