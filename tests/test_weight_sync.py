"""The weight sync of separate_async (archer/distributed/weight_sync.py): bucket plans by hand, a broadcast
between two gloo processes that delivers every tensor exactly, by name, across bucket boundaries, and each end
listening on its own node's address only (a trainer "node" at 127.0.0.2)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading

import psutil
import pytest
import torch
from spawn_support import spawned

from archer.distributed.weight_sync import (
    WeightManifest,
    WeightReceiver,
    WeightSender,
    address_towards,
    join_group,
    open_store,
)
from archer.errors import ArcherError

SHAPES = [("embed", (10, 4)), ("norm", (4,)), ("big", (3, 20)), ("head", (2, 4)), ("bias", (2,))]


def weights(scale: float) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * scale + i)
            for i, (name, shape) in enumerate(SHAPES)]


def test_buckets_fill_in_stream_order_and_a_large_tensor_gets_its_own() -> None:
    manifest = WeightManifest.plan(SHAPES, torch.float32, bucket_bytes=48 * 4)  # 48 elements a bucket
    layout = [[(s.name, s.offset, s.numel) for s in bucket] for bucket in manifest.buckets]
    # embed 40 + norm 4 = 44 <= 48; big 60 > 48 alone; head 8 + bias 2 together
    assert layout == [[("embed", 0, 40), ("norm", 40, 4)], [("big", 0, 60)], [("head", 0, 8), ("bias", 8, 2)]]
    assert [manifest.bucket_numel(i) for i in range(3)] == [44, 60, 10]
    assert manifest.largest_bucket() == 60 and manifest.num_bytes == (44 + 60 + 10) * 4
    bf16 = WeightManifest.plan(SHAPES, torch.bfloat16, bucket_bytes=48 * 4)  # 96 two-byte elements
    assert [[s.name for s in b] for b in bf16.buckets] == [["embed", "norm"], ["big", "head", "bias"]]
    with pytest.raises(ArcherError, match="update_weights_bucket_megabytes"):
        WeightManifest.plan(SHAPES, torch.float32, bucket_bytes=0)
    empty_first = WeightManifest.plan([("none", (0,)), ("norm", (4,))], torch.float32, bucket_bytes=48 * 4)
    assert [[(s.name, s.offset) for s in b] for b in empty_first.buckets] == [[("none", 0), ("norm", 0)]]


def _rank(rank: int, ports: mp.Queue, results: mp.Queue) -> None:
    """Rank 0 hosts the store and sends twice (then a stream that names the wrong tensor first); rank 1
    receives twice."""
    torch.set_num_threads(1)
    manifest = WeightManifest.plan(SHAPES, torch.float32, bucket_bytes=48 * 4)
    try:
        store = open_store("127.0.0.1", 30) if rank == 0 else None
        if store is not None:
            ports.put(store.port)
            port = store.port
        else:
            port = ports.get(timeout=30)
        group = join_group("127.0.0.1", port, rank, 2, torch.device("cpu"), 30, store=store)
        if rank == 0:
            sender = WeightSender(group, manifest, torch.device("cpu"))
            for scale in (1.0, -2.0):
                sender.send(weights(scale))
            try:
                sender.send([("wrong" if name == "embed" else name, t) for name, t in weights(3.0)])
            except ArcherError as error:
                results.put(("sender_error", error.problem))
            return
        receiver = WeightReceiver(group, manifest, torch.device("cpu"))
        for _ in range(2):  # numpy arrays travel by value: a tensor's shared memory dies with this process
            results.put(("received", [(name, tensor.numpy().copy()) for name, tensor in receiver.receive()]))
    except Exception as error:  # noqa: BLE001 - reported to the test
        results.put(("error", f"rank {rank}: {error!r}"))


def test_two_processes_get_the_exact_weights_by_name_across_bucket_boundaries() -> None:
    context = mp.get_context("spawn")
    ports, results = context.Queue(), context.Queue()
    got: dict[str, list] = {"received": [], "sender_error": [], "error": []}
    with spawned(*[(_rank, (rank, ports, results)) for rank in range(2)]):
        try:
            while len(got["received"]) < 2 or not got["sender_error"]:
                kind, value = results.get(timeout=60)
                got[kind].append(value)
                assert not got["error"], got["error"]
        except queue.Empty:
            pytest.fail(f"no result within 60 s: {got}")
    for received, scale in zip(got["received"], (1.0, -2.0)):
        assert [name for name, _ in received] == [name for name, _ in SHAPES]
        for (name, array), (_, want) in zip(received, weights(scale)):
            assert torch.equal(torch.from_numpy(array), want), name
    assert "'wrong'" in got["sender_error"][0] and "'embed'" in got["sender_error"][0]


def _vanishing_receiver(ports: mp.Queue, results: mp.Queue) -> None:
    """Rank 0 sends to a rank 1 that joins the group, then exits without receiving."""
    torch.set_num_threads(1)
    manifest = WeightManifest.plan(SHAPES, torch.float32, bucket_bytes=48 * 4)
    store = open_store("127.0.0.1", 30)
    ports.put(store.port)
    group = join_group("127.0.0.1", store.port, 0, 2, torch.device("cpu"), 5, store=store)
    try:
        WeightSender(group, manifest, torch.device("cpu")).send(weights(1.0))
        results.put(("sent", ""))
    except ArcherError as error:
        results.put(("error", f"{error.problem}\n{error.fix}"))


def _joins_and_leaves(ports: mp.Queue) -> None:
    port = ports.get(timeout=30)
    join_group("127.0.0.1", port, 1, 2, torch.device("cpu"), 5)


def test_a_rollout_rank_that_leaves_makes_the_sync_one_clear_error() -> None:
    context = mp.get_context("spawn")
    ports, results = context.Queue(), context.Queue()
    with spawned((_vanishing_receiver, (ports, results)), (_joins_and_leaves, (ports,))):
        kind, text = results.get(timeout=60)
    assert kind == "error", text
    problem, fix = text.split("\n")
    assert problem.startswith("the weight sync between trainer rank 0 and the 1 rollout rank(s) failed at bucket ")
    assert "trainer.resume_mode=auto" in fix and "actor_rollout_ref.nccl_timeout" in fix


def test_the_store_and_each_gloo_end_listen_on_their_own_node_address_only() -> None:
    """Trainer rank 0 on a node at 127.0.0.2 hosts the store there and nowhere else (torch's own store listens on
    every interface); the rollout rank's gloo endpoint is its address on the route to that node (127.0.0.1: the
    loopback route's source address), and the weights arrive."""
    def listening() -> set[tuple[str, int]]:
        return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                if c.status == psutil.CONN_LISTEN}

    before = listening()  # what this test process listens on already (a Ray driver of another test, say)
    store = open_store("127.0.0.2", 30)
    manifest = WeightManifest.plan(SHAPES, torch.float32, bucket_bytes=48 * 4)
    received: list = []

    def rollout_rank() -> None:
        group = join_group("127.0.0.2", store.port, 1, 2, torch.device("cpu"), 30)
        received.extend((name, tensor.clone()) for name, tensor in WeightReceiver(group, manifest,
                                                                                  torch.device("cpu")).receive())

    thread = threading.Thread(target=rollout_rank)
    thread.start()
    group = join_group("127.0.0.2", store.port, 0, 2, torch.device("cpu"), 30, store=store)
    opened = listening() - before
    WeightSender(group, manifest, torch.device("cpu")).send(weights(1.0))
    thread.join(timeout=30)
    assert address_towards("127.0.0.2", store.port) == "127.0.0.1"
    # the store, trainer rank 0's gloo endpoint and the rollout rank's: no wildcard address among them
    assert ("127.0.0.2", store.port) in opened
    assert sorted(ip for ip, _ in opened) == ["127.0.0.1", "127.0.0.2", "127.0.0.2"]
    assert [name for name, _ in received] == [name for name, _ in SHAPES]
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(received, weights(1.0)))
