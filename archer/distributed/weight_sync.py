"""The policy's weights from the trainer's rank 0 to standalone rollout ranks, with no disk round trip
(trainer.v1.trainer_mode=separate_async, docs/async.md "Weight sync between GPU groups").

A small process group of its own joins trainer rank 0 (its rank 0) and every rollout rank (ranks 1..R), over a
TCP store that trainer rank 0 hosts on its node's address (``MASTER_ADDR``, from Ray's node table), listening on
that address only: NCCL between GPUs, gloo on CPUs, each gloo endpoint on its node's address towards trainer
rank 0 (so a rollout rank on another node is reached over the network). It lives beside the trainer ranks' own
process group (FSDP's), which it never touches. The weights travel in flat buckets of
``checkpoint_engine.update_weights_bucket_megabytes`` in the engine's dtype, laid out as the ``WeightManifest``
taken once at set-up says (the policy's stream order). Rank 0 makes them either by packing the policy's weight
stream (``packed_buckets``) or, for a sharded plain policy, with one gather of every trainer rank's shards a bucket
(distributed/shard_buckets.py); ``WeightSender.send_buckets`` broadcasts bucket k while bucket k + 1 is made in a
second buffer (buffers allocated for the sync and freed after it: between steps, where the update's activations
were). Each receiver hands the engine views of its one bucket buffer, which the engine copies in place by name
(``RolloutEngine.sync_weights``) before the next bucket is received into it (on a GPU, NCCL's stream waits for
those copies). A tensor larger than a bucket travels in a bucket of its own.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from archer.distributed.stores import hosted_store, joined_store
from archer.errors import ArcherError
from archer.units import MIB

STORE_PREFIX = "archer-weight-sync"


@dataclass(frozen=True)
class WeightSlot:
    """One tensor's place in a bucket: its name, shape, and first element."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class WeightManifest:
    """The buckets of the weight stream: which tensors each holds where, and their element dtype."""

    buckets: tuple[tuple[WeightSlot, ...], ...]
    dtype: torch.dtype

    @classmethod
    def plan(cls, shapes: Iterable[tuple[str, tuple[int, ...]]], dtype: torch.dtype, bucket_bytes: int
             ) -> WeightManifest:
        """Tensors in stream order, filled into buckets of at most ``bucket_bytes`` (a larger tensor alone)."""
        if bucket_bytes < 1:
            raise ArcherError(f"a weight bucket of {bucket_bytes} bytes holds nothing",
                              "set actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes >= 1")
        capacity = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
        buckets: list[list[WeightSlot]] = []
        used = 0
        for name, shape in shapes:
            numel = math.prod(shape)
            if not buckets or used + numel > capacity:
                buckets.append([])
                used = 0
            buckets[-1].append(WeightSlot(name, tuple(shape), used))
            used += numel
        return cls(tuple(tuple(b) for b in buckets), dtype)

    def bucket_numel(self, index: int) -> int:
        last = self.buckets[index][-1]
        return last.offset + last.numel

    @property
    def num_bytes(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(self.bucket_numel(i) for i in range(len(self.buckets))) * size

    def largest_bucket(self) -> int:
        return max(self.bucket_numel(i) for i in range(len(self.buckets)))


def bucket_bytes(megabytes: float) -> int:
    """checkpoint_engine.update_weights_bucket_megabytes in bytes (verl's MB are MiB)."""
    return int(float(megabytes) * MIB)


def open_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The sync group's store, hosted by trainer rank 0 on a free port (``store.port``) of its node's address
    ``host`` only."""
    return hosted_store(host, 0, timeout_s)


def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (a rollout rank's side of the sync: the address trainer
    rank 0 reaches it at); no packet is sent."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def gloo_device(address: str) -> dist.ProcessGroupGloo.Device:
    """gloo's endpoint on ``address`` (``GLOO_SOCKET_IFNAME``, when set, names the interface instead); gloo's
    default, the address the host name resolves to, is the loopback one on many machines."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface.split(",")[0])
    return dist.ProcessGroupGloo.create_device(hostname=address)


def join_group(host: str, port: int, rank: int, size: int, device: torch.device, timeout_s: float,
               store: dist.TCPStore | None = None) -> dist.ProcessGroup:
    """This process's member of the sync group (rank 0: trainer rank 0, passing the store it hosts at ``host``;
    on CPUs gloo's endpoint is ``host`` for rank 0, a rollout rank's address towards it for the others)."""
    if store is None:
        store = joined_store(host, port, timeout_s)
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    gloo = dist.ProcessGroupGloo._Options()
    gloo._devices = [gloo_device(host if rank == 0 else address_towards(host, port))]
    gloo._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(prefixed, rank, size, gloo)


SYNC_FIX = ("a rank of the other side died or stopped answering (its own log lines, prefixed (rank N pid=...), say "
            "why); restart the run with trainer.resume_mode=auto, raising actor_rollout_ref.nccl_timeout if the ranks "
            "were only slow")


def _sync_error(group: dist.ProcessGroup, bucket: int, error: RuntimeError) -> ArcherError:
    """A collective of the sync that failed (a peer gone, the timeout past), as one ArcherError."""
    return ArcherError(f"the weight sync between trainer rank 0 and the {group.size() - 1} rollout rank(s) failed at "
                       f"bucket {bucket}: {str(error).splitlines()[0]}", SYNC_FIX)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, bucket: int) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    try:
        return group.broadcast([tensor], options)
    except RuntimeError as error:
        raise _sync_error(group, bucket, error) from None


def _wait(work: dist.Work, group: dist.ProcessGroup, bucket: int) -> None:
    try:
        work.wait()
    except RuntimeError as error:
        raise _sync_error(group, bucket, error) from None


def _checked(stream: Iterator[tuple[str, torch.Tensor]], slot: WeightSlot) -> torch.Tensor:
    """The stream's next tensor, which must be ``slot``'s (name and whole shape)."""
    name, tensor = next(stream, (None, None))
    if name != slot.name or tuple(tensor.shape) != slot.shape:
        raise ArcherError(f"the policy's weight stream gave {name!r} where the rollout ranks expect "
                          f"{slot.name!r} {slot.shape}", "restart the run: the policy's parameters "
                          "changed after the weight sync was set up")
    return tensor


def packed_buckets(weights: Iterable[tuple[str, torch.Tensor]], manifest: WeightManifest, device: torch.device,
                   *, pack: bool = True) -> Iterator[torch.Tensor | None]:
    """``weights`` (the policy's stream, in the manifest's order and shapes) packed into its flat buckets, in
    two buffers taken in turn: a buffer is written again two buckets later, so its consumer must be done with
    it once it asks for the next bucket but one (``WeightSender.send_buckets`` is). ``pack=False``: the stream
    is read (a sharded stream's gathers run on every rank) and None stands for each bucket."""
    stream = iter(weights)
    buffers = [torch.empty(manifest.largest_bucket(), dtype=manifest.dtype, device=device)
               for _ in range(min(2, len(manifest.buckets)) if pack else 0)]
    for index, slots in enumerate(manifest.buckets):
        buffer = buffers[index % 2] if pack else None
        for slot in slots:
            tensor = _checked(stream, slot)
            if buffer is not None:
                buffer[slot.offset: slot.offset + slot.numel].copy_(tensor.reshape(-1), non_blocking=True)
        yield None if buffer is None else buffer[: manifest.bucket_numel(index)]
    for _ in stream:  # a sharded policy's ranks gather every tensor: the stream is read to its end
        pass


class WeightSender:
    """Trainer rank 0's side: broadcasts the weights bucket by bucket, the next bucket made while the last one
    is in flight."""

    def __init__(self, group: dist.ProcessGroup, manifest: WeightManifest, device: torch.device) -> None:
        self.group, self.manifest, self.device = group, manifest, device

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast ``weights`` (the policy's stream, in the manifest's order and shapes)."""
        self.send_buckets(packed_buckets(weights, self.manifest, self.device))

    def send_buckets(self, buckets: Iterable[torch.Tensor]) -> None:
        """Broadcast the manifest's flat buckets as ``buckets`` makes them; bucket k's broadcast is waited for
        before bucket k + 2 is asked for, so a maker may write into bucket k's memory again then."""
        in_flight: dist.Work | None = None
        index = -1
        for index, bucket in enumerate(buckets):
            if in_flight is not None:
                _wait(in_flight, self.group, index - 1)
            in_flight = _broadcast(self.group, bucket, index)
        if in_flight is not None:
            _wait(in_flight, self.group, index)
        if self.device.type == "cuda":  # the buffers are reused by the allocator only after the last broadcast
            torch.cuda.current_stream(self.device).synchronize()


class WeightReceiver:
    """A rollout rank's side: the buckets as they arrive, as views named for the engine."""

    def __init__(self, group: dist.ProcessGroup, manifest: WeightManifest, device: torch.device) -> None:
        self.group, self.manifest = group, manifest
        self.buffer = torch.empty(manifest.largest_bucket(), dtype=manifest.dtype, device=device)

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights, (name, tensor view) in stream order; each view is valid until the next bucket arrives
        (the engine copies it in place first)."""
        for index, slots in enumerate(self.manifest.buckets):
            _wait(_broadcast(self.group, self.buffer[: self.manifest.bucket_numel(index)], index), self.group, index)
            for slot in slots:
                yield slot.name, self.buffer[slot.offset: slot.offset + slot.numel].view(slot.shape)
        if self.buffer.device.type == "cuda":
            torch.cuda.current_stream(self.buffer.device).synchronize()
