"""The weight sync's gather of a bucket of FSDP2 shards at once (archer/distributed/shard_buckets.py) on 3 gloo
ranks, where torch.chunk's shards are uneven: tensors of 5 rows (2, 2, 1), 2 rows (1, 1 and an empty shard),
9 rows (3 each) and 1 row, in buckets that split and one larger than a bucket. Rank 0's buckets must equal the
unsharded weights packed by the manifest, cast, for shards on the device and offloaded to the host; the other
ranks get None. Also by hand: where each tensor lies in a rank's buffer."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue

import pytest
import torch
from spawn_support import spawned
from torch import nn

from archer.distributed.shard_buckets import ShardGather, _pieces, gatherable
from archer.distributed.weight_sync import WeightManifest, WeightSlot, packed_buckets

WORLD = 3


class Odd(nn.Module):
    """Parameters whose rows do not divide among 3 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(7, 5)  # weight [5, 7]: rows 2, 2, 1; bias [5]
        self.table = nn.Embedding(2, 3)  # rows 1, 1, 0
        self.grid = nn.Parameter(torch.randn(9, 4))  # rows 3, 3, 3
        self.scale = nn.Parameter(torch.randn(1, 6))  # rows 1, 0, 0


def test_each_tensor_has_ceil_rows_over_world_of_room_in_a_ranks_buffer() -> None:
    slots = (WeightSlot("a", (5, 7), 0), WeightSlot("b", (5,), 35), WeightSlot("c", (2, 3), 40))
    pieces, used = _pieces(slots, WORLD)
    assert [(p.offset, p.rows, p.per_rank, p.row_numel) for p in pieces] == [(0, 5, 2, 7), (14, 5, 2, 1),
                                                                             (16, 2, 1, 3)]
    assert used == 14 + 2 + 3


def _rank(rank: int, port: int, offload: bool, results: mp.Queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        torch.manual_seed(0)
        model = Odd()
        whole = [(name, param.detach().clone()) for name, param in model.named_parameters()]
        policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
        fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)), offload_policy=policy)
        params = list(model.named_parameters())
        assert gatherable(params)
        shapes = [(name, tuple(tensor.shape)) for name, tensor in whole]
        out = {}
        for dtype, bucket_bytes in ((torch.float32, 40 * 4), (torch.bfloat16, 30 * 2)):
            manifest = WeightManifest.plan(shapes, dtype, bucket_bytes)
            got = [None if b is None else b.clone()
                   for b in ShardGather(params, manifest, torch.device("cpu")).buckets()]
            want = [b.clone() for b in packed_buckets([(n, t.to(dtype)) for n, t in whole], manifest,
                                                      torch.device("cpu"))]
            out[str(dtype)] = (got, want, [len(b) for b in manifest.buckets])
        payload = io.BytesIO()  # bytes: tensors through a queue would outlive their process's shared memory
        torch.save(out, payload)
        results.put((rank, payload.getvalue()))
        dist.destroy_process_group()
    except Exception as error:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{error!r}"))


@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "offloaded"])
def test_rank0_gets_every_bucket_of_uneven_shards_exactly(offload: bool) -> None:
    from fsdp_support import free_port

    results = mp.get_context("spawn").Queue()
    port = free_port()
    got = {}
    with spawned(*[(_rank, (rank, port, offload, results)) for rank in range(WORLD)]):
        try:
            for _ in range(WORLD):
                rank, value = results.get(timeout=90)
                got[rank] = torch.load(io.BytesIO(value)) if isinstance(value, bytes) else value
        except queue.Empty:
            pytest.fail(f"no result within 90 s: {got}")
    assert all(isinstance(value, dict) for value in got.values()), got
    for dtype, (buckets, want, sizes) in got[0].items():
        assert len(sizes) >= 3 and 1 in sizes, sizes  # split buckets, one tensor alone
        assert len(buckets) == len(want)
        for bucket, expected in zip(buckets, want, strict=True):
            assert str(bucket.dtype) == dtype and torch.equal(bucket, expected)
    for rank in (1, 2):
        assert all(all(b is None for b in buckets) for buckets, _, _ in got[rank].values())
