"""separate_async's rollout ranks on a node of their own (trainer.v1.separate_async.node_placement), on a Ray
cluster of two raylets on this machine (ray.cluster_utils.Cluster, every node on the loopback interface):

- ``rollout_avoid_nodes`` by hand: apart keeps the rollout ranks off the trainer ranks' nodes (refused when the
  cluster lacks other nodes), auto does so when it can, shared never;
- a group placed with ``avoid_nodes`` runs on the other raylet (the actors report their node ids), and the
  weight sync between a rank of each group (the store on trainer rank 0's node address, gloo) delivers every
  tensor exactly across the two nodes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_weight_sync import SHAPES, weights

from archer.controller.ray_cluster import loopback_node
from archer.controller.ray_group import RayWorkerGroup, wait_all
from archer.distributed.weight_sync import (
    WeightManifest,
    WeightReceiver,
    WeightSender,
    join_group,
    open_store,
)
from archer.errors import ArcherError
from archer.trainer.separate_rollout import rollout_avoid_nodes
from archer.workers.dispatch import collect

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


def test_which_nodes_the_rollout_ranks_keep_off() -> None:
    alive = ["a", "b", "c"]
    assert rollout_avoid_nodes("apart", {"a"}, alive, 2) == ("a",)
    assert rollout_avoid_nodes("auto", {"a", "b"}, alive, 1) == ("a", "b")
    assert rollout_avoid_nodes("auto", {"a", "b"}, alive, 2) == ()  # one other node for two: shared
    assert rollout_avoid_nodes("auto", {"a"}, alive, 1, by_label=False) == ()
    assert rollout_avoid_nodes("shared", {"a"}, alive, 1) == ()
    with pytest.raises(ArcherError, match="has 1 live node.s. without trainer ranks"):
        rollout_avoid_nodes("apart", {"a", "b"}, alive, 2)
    with pytest.raises(ArcherError, match="bundle_label_selector"):
        rollout_avoid_nodes("apart", {"a"}, alive, 1, by_label=False)


class SyncEnd:
    """One end of the weight sync in a rank actor: trainer rank 0 hosts and sends, a rollout rank receives."""

    def __init__(self) -> None:
        self.store = None
        self.manifest = WeightManifest.plan(SHAPES, torch.float32, bucket_bytes=48 * 4)

    @collect(list)
    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    @collect(list)
    def host(self) -> tuple[str, int]:
        self.store = open_store(os.environ["MASTER_ADDR"], 60)
        return os.environ["MASTER_ADDR"], int(self.store.port)

    @collect(list)
    def send(self, host: str, port: int) -> None:
        WeightSender(join_group(host, port, 0, 2, CPU, 60, store=self.store), self.manifest, CPU).send(weights(3.0))

    @collect(list)
    def receive(self, host: str, port: int) -> list:
        receiver = WeightReceiver(join_group(host, port, 1, 2, CPU, 60), self.manifest, CPU)
        return [(name, tensor.clone()) for name, tensor in receiver.receive()]


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[None]:
    """Two raylets of 2 CPUs on the loopback interface, the driver connected; stopped at the end."""
    import ray
    from ray.cluster_utils import Cluster

    tests_dir = str(Path(__file__).resolve().parent)
    with pytest.MonkeyPatch.context() as mp, loopback_node():
        mp.delenv("RAY_ADDRESS", raising=False)
        mp.setenv("PYTHONPATH", os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=2)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=True)
            yield
        finally:
            ray.shutdown()
            cluster.shutdown()


def test_the_rollout_group_runs_on_the_other_node_and_receives_the_weights_there(two_nodes: None) -> None:
    import ray

    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    trainer = RayWorkerGroup(SyncEnd, {}, nnodes=1, n_gpus_per_node=1, device_kind="cpu")
    try:
        trainer_node = trainer.call("node")[0]
        rollout = RayWorkerGroup(SyncEnd, {}, nnodes=1, n_gpus_per_node=1, device_kind="cpu",
                                 avoid_nodes=(trainer_node,))
        try:
            assert rollout.call("node")[0] != trainer_node
            assert {p.node_id for p in rollout.layout} == {rollout.call("node")[0]}
            host, port = trainer.call("host")[0]
            assert host.startswith("127.")
            _, received = wait_all([trainer.submit("send", host, port), rollout.submit("receive", host, port)])
        finally:
            rollout.shutdown()
    finally:
        trainer.shutdown()
    got = received[0]
    assert [name for name, _ in got] == [name for name, _ in SHAPES]
    assert all(torch.equal(tensor, want) for (_, tensor), (_, want) in zip(got, weights(3.0)))
