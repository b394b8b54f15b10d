"""Batched no-grad passes of a policy over a Batch of sequences: the tensors a forward pass reads
(``MODEL_INPUTS``) and the response tokens' log-probs / entropies, micro-batch by micro-batch (the actor's
old log-probs and the reference's log-probs use the same pass)."""

from __future__ import annotations

import torch

from archer.batch import Batch
from archer.models.loading import autocast_for
from archer.models.logprobs import layout_logprobs
from archer.models.micro_batches import MicroBatching

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def compute_log_probs(model: torch.nn.Module, batch: Batch, *, temperature: float, micro: MicroBatching,
                      chunk_size: int | None, device: torch.device, compute_entropy: bool,
                      parts: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the batch's responses under ``model``, micro-batch by micro-batch, on the
    CPU in float32; the model's train/eval mode is restored afterwards. ``parts``: the rows of each pass
    (default ``micro.split``; a data-parallel rank passes its own, archer/workers/data_parallel.py), rows
    outside them left 0."""
    data = batch.select([*MODEL_INPUTS, "responses"])
    shape = data["responses"].shape
    done: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    was_training = model.training
    model.eval()
    with torch.no_grad(), autocast_for(device):
        for rows in micro.split(data["attention_mask"]) if parts is None else parts:
            layout = micro.layout(data.index(rows)).to(device)  # made on the host: the GPU is never waited for
            mb_logp, mb_ent = layout_logprobs(model, layout, temperature=temperature, chunk_size=chunk_size,
                                              compute_entropy=compute_entropy)
            done.append((rows, mb_logp.float(), None if mb_ent is None else mb_ent.float()))
    model.train(was_training)
    logp = torch.zeros(shape)
    ent = torch.zeros(shape) if compute_entropy else None
    for rows, mb_logp, mb_ent in done:  # read back once the passes are queued
        logp[rows] = mb_logp.cpu()
        if ent is not None:
            ent[rows] = mb_ent.cpu()
    return logp, ent
