"""Batched no-grad passes of a policy over a Batch of sequences: the tensors a forward pass reads
(``MODEL_INPUTS``) and the response tokens' log-probs / entropies, micro-batch by micro-batch (the actor's
old log-probs and the reference's log-probs use the same pass; the actor's routes an MoE policy's tokens with the
engine's recorded experts where routing replay says so, models/router_replay.py)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from archer.batch import Batch
from archer.models.loading import autocast_for
from archer.models.logprobs import layout_logprobs
from archer.models.micro_batches import MicroBatching
from archer.models.router_replay import ROUTED_EXPERTS, ReplaySettings, micro_batch_replay, own_routes

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def compute_log_probs(model: torch.nn.Module, batch: Batch, *, temperature: float, micro: MicroBatching,
                      chunk_size: int | None, device: torch.device, compute_entropy: bool,
                      parts: list[torch.Tensor] | None = None, routing: ReplaySettings | None = None,
                      route_counts: torch.Tensor | None = None, routes_out: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the batch's responses under ``model``, micro-batch by micro-batch, on the
    CPU in float32; the model's train/eval mode is restored afterwards. ``parts``: the rows of each pass
    (default ``micro.split``; a data-parallel rank passes its own, archer/workers/data_parallel.py), rows
    outside them left 0. ``routing``: where the batch holds ``routed_experts``, the MoE routers take them
    (``routing.replay``) or only compare their own top-k with them; ``route_counts`` ([B, RouteCounts.COLUMNS], zeros) then takes
    each row's counts (models/router_replay.py, ``RouteCounts``). ``routes_out`` ([B, W, layers, k] int16): takes
    the routers' own top-k of each token (R2's record, ``own_routes``)."""
    routed = routing is not None and ROUTED_EXPERTS in batch.tensors
    data = batch.select([*MODEL_INPUTS, "responses", *([ROUTED_EXPERTS] if routed else [])])
    shape = data["responses"].shape
    done: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    counted: list[tuple[torch.Tensor, torch.Tensor]] = []
    recorded: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []
    was_training = model.training
    model.eval()
    with torch.no_grad(), autocast_for(device):
        for rows in micro.split(data["attention_mask"]) if parts is None else parts:
            mb = data.index(rows)
            layout = micro.layout(mb).to(device)  # made on the host: the GPU is never waited for
            replay, counts = micro_batch_replay(model, micro.layout, mb, device, replay=routing.replay,
                                                count=route_counts is not None) if routed else (nullcontext(), None)
            if routes_out is not None:
                replay, taken = own_routes(model, micro.layout, mb)
                recorded.append((rows, taken))
            with replay:
                mb_logp, mb_ent = layout_logprobs(model, layout, temperature=temperature, chunk_size=chunk_size,
                                                  compute_entropy=compute_entropy)
            done.append((rows, mb_logp.float(), None if mb_ent is None else mb_ent.float()))
            if counts is not None:
                counted.append((rows, counts.per_row))
    model.train(was_training)
    logp = torch.zeros(shape)
    ent = torch.zeros(shape) if compute_entropy else None
    for rows, mb_logp, mb_ent in done:  # read back once the passes are queued
        logp[rows] = mb_logp.cpu()
        if ent is not None:
            ent[rows] = mb_ent.cpu()
    for rows, counts in counted:
        route_counts[rows] = counts.cpu()
    for rows, taken in recorded:
        routes_out[rows] = taken()
    return logp, ent
