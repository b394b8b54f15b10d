"""A sharded policy's weights gathered straight into the weight sync's flat buckets: one gather a bucket.

Gathering the policy a tensor at a time (``policy_weights``: a DTensor cast and all-gather each, some 340 for a
1.5B model) costs far more in collective launches and DTensor's Python dispatch than in bytes. Here every trainer
rank packs its own FSDP2 shards of one bucket's tensors, cast to the sync's dtype, into one flat buffer, and a
single gather brings those buffers to trainer rank 0, which lays the tensors out as the manifest says
(``WeightManifest``: the layout the rollout ranks receive, whatever made it).

FSDP2 shards a tensor of ``n`` rows as ``torch.chunk`` does: rank r holds rows ``[r c, min(n, (r + 1) c))`` with
``c = ceil(n / world)`` (the last ranks may hold fewer rows, or none). In a rank's buffer each tensor has ``c``
rows' room, so after the gather the tensor's rows lie in order along the ranks' buffers, with the unused rows of
short shards between them. Only plain weights of a one-dimensional mesh sharded on dim 0 go this way; a LoRA
merge needs the whole base weight and keeps the per-tensor stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from archer.distributed.weight_sync import WeightManifest, WeightSlot
from archer.errors import ArcherError


def gatherable(params: list[tuple[str, torch.Tensor]]) -> bool:
    """True when every parameter is an FSDP2 shard this module gathers: a DTensor on a one-dimensional mesh,
    sharded on dim 0."""
    return bool(params) and all(isinstance(p, DTensor) and p.device_mesh.ndim == 1 and p.dim() > 0
                                and tuple(p.placements) == (Shard(0),) for _, p in params)


@dataclass(frozen=True)
class _Piece:
    """One tensor of a bucket in the ranks' buffers: ``rows`` whole rows of ``row_numel`` elements, ``per_rank``
    rows' room from ``offset`` of each rank's buffer."""

    slot: WeightSlot
    offset: int
    rows: int
    per_rank: int
    row_numel: int


def _pieces(slots: tuple[WeightSlot, ...], world: int) -> tuple[list[_Piece], int]:
    """Where each of a bucket's tensors lies in a rank's buffer, and the buffer's elements."""
    pieces, used = [], 0
    for slot in slots:
        rows = slot.shape[0]
        per_rank = -(-rows // world)
        row_numel = math.prod(slot.shape[1:])
        pieces.append(_Piece(slot, used, rows, per_rank, row_numel))
        used += per_rank * row_numel
    return pieces, used


class ShardGather:
    """Every trainer rank's side of a sharded policy's weight sync: ``buckets()`` gathers each bucket of
    ``manifest`` onto the group's rank 0 (which gets it laid out as the manifest says; the others get None)."""

    def __init__(self, params: list[tuple[str, torch.Tensor]], manifest: WeightManifest, device: torch.device
                 ) -> None:
        """``params``: the policy's stream parameters (name, DTensor), in the manifest's order."""
        names = [name for name, _ in params]
        planned = [slot.name for bucket in manifest.buckets for slot in bucket]
        if names != planned:
            raise ArcherError(f"the policy's sharded weights ({len(names)}, first {names[:1]}) are not the ones the "
                              f"rollout ranks expect ({len(planned)}, first {planned[:1]})",
                              "restart the run: the policy's parameters changed after the weight sync was set up")
        self.params = [param for _, param in params]
        self.manifest, self.device = manifest, device
        mesh = self.params[0].device_mesh
        self.group, self.world, self.rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        self.layout = [_pieces(slots, self.world) for slots in manifest.buckets]

    def buckets(self) -> Iterator[torch.Tensor | None]:
        """Bucket by bucket: every rank packs and sends its shards; rank 0 yields the whole bucket (flat, valid
        until the bucket after next is asked for), the other ranks None."""
        dtype, main = self.manifest.dtype, self.rank == 0
        widest = max(used for _, used in self.layout)
        send = torch.empty(widest, dtype=dtype, device=self.device)
        received = torch.empty(self.world * widest if main else 0, dtype=dtype, device=self.device)
        out = [torch.empty(self.manifest.largest_bucket() if main else 0, dtype=dtype, device=self.device)
               for _ in range(min(2, len(self.layout)))]
        params = iter(self.params)
        for index, (pieces, used) in enumerate(self.layout):
            for piece in pieces:
                local = next(params).to_local()
                rows = min(piece.per_rank, max(0, piece.rows - self.rank * piece.per_rank))
                if local.numel() != rows * piece.row_numel:
                    raise ArcherError(f"{piece.slot.name}: trainer rank {self.rank} holds {tuple(local.shape)} of "
                                      f"{piece.slot.shape}, not torch.chunk's {rows} rows",
                                      "report this with the model's type: its FSDP2 shards are not split as the "
                                      "weight sync expects")
                send[piece.offset: piece.offset + local.numel()].copy_(local.reshape(-1))
            gathered = [received[r * used: (r + 1) * used] for r in range(self.world)] if main else None
            dist.gather(send[:used], gathered, group=self.group, group_dst=0)
            if not main:
                yield None
                continue
            bucket = out[index % 2][: self.manifest.bucket_numel(index)]
            shards = received[: self.world * used].view(self.world, used)
            for piece in pieces:
                self._place(piece, shards, bucket)
            yield bucket

    def _place(self, piece: _Piece, shards: torch.Tensor, bucket: torch.Tensor) -> None:
        """Copy one tensor's rows from the gathered shards [world, used] into its slot of ``bucket``."""
        if piece.rows == 0:
            return
        width = piece.per_rank * piece.row_numel
        rows = shards[:, piece.offset: piece.offset + width].view(self.world, piece.per_rank, piece.row_numel)
        target = bucket[piece.slot.offset: piece.slot.offset + piece.slot.numel].view(piece.rows, piece.row_numel)
        full, remainder = divmod(piece.rows, piece.per_rank)  # ranks holding per_rank rows; the next holds the rest
        target[: full * piece.per_rank].view(full, piece.per_rank, piece.row_numel).copy_(rows[:full])
        if remainder:
            target[full * piece.per_rank:].copy_(rows[full, :remainder])
