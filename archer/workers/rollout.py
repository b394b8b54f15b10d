"""The rollout worker: turns a batch of prompts into a batch of prompt+response sequences.

It wraps a generation engine (rollout/) and lays out the tensors the later stages read: ``prompts``,
``responses``, ``input_ids`` (prompt + response), ``attention_mask``, ``position_ids``, ``response_mask``
and the engine's per-token ``rollout_log_probs`` / ``rollout_entropies``. Rows are repeated n times.
The actor worker owns it (the engine generates with the actor's weights).

The layout is where the one learning mask is set: ``response_mask`` is 1 on the tokens the policy wrote and
0 elsewhere (padding, and tool output once tools exist); the attention mask covers every token of the
sequence, tool output included (``response_attention`` gives its response part).
"""

from __future__ import annotations

import logging

import torch
from omegaconf import DictConfig

from archer.batch import Batch, response_attention
from archer.models.loading import autocast_for
from archer.rollout.base import RolloutEngine, SamplingParams

log = logging.getLogger("archer.rollout")


def sampling_params(rollout: DictConfig, *, validate: bool, seed: int) -> SamplingParams:
    """verl's rollout keys (or rollout.val_kwargs for validation) as engine sampling parameters."""
    src = rollout.val_kwargs if validate else rollout
    temperature = float(src.temperature)
    return SamplingParams(
        n=int(src.n), temperature=temperature, top_p=float(src.top_p), top_k=int(src.top_k),
        max_new_tokens=int(rollout.response_length), stop=tuple(rollout.stop),
        do_sample=bool(src.do_sample) and temperature > 0, seed=seed)


def layout_sequences(prompts: Batch, responses: torch.Tensor, response_mask: torch.Tensor, n: int) -> Batch:
    """verl's tensor layout for prompt (left-padded) + response (right-padded) sequences."""
    out = prompts.repeat(n, interleave=True)
    prompt_ids = out.tensors.pop("input_ids")
    prompt_mask = out.tensors.pop("attention_mask")
    out.tensors.pop("position_ids", None)
    attention_mask = torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1)
    out.tensors.update({
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "response_mask": response_mask,
    })
    return out


class RolloutWorker:
    """Generates responses with an engine that shares the actor's weights (hybrid engine)."""

    def __init__(self, engine: RolloutEngine, cfg: DictConfig, *, device: torch.device) -> None:
        self.engine = engine
        self.cfg = cfg
        self.device = device

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> Batch:
        ids, mask = prompts["input_ids"], prompts["attention_mask"]
        prompt_lists = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        with autocast_for(self.device):
            out = self.engine.generate(prompt_lists, params)
        batch = layout_sequences(prompts, out.responses.cpu(), out.response_mask.cpu().long(), params.n)
        batch["rollout_log_probs"] = out.log_probs.float().cpu()
        batch["rollout_entropies"] = out.entropies.float().cpu()
        batch["finish_reason"] = list(out.finish_reasons)
        return batch


def concat_sequences(batches: list[Batch], pad_token_id: int) -> Batch:
    """Rows of several generated batches in one batch, re-padded to the widest prompt and response.

    Prompts are left-padded and every [B, R] tensor aligned with the responses is right-padded (responses
    with the pad token, the others with 0); input_ids, attention_mask and position_ids are rebuilt.
    """
    prompt_width = max(b["prompts"].shape[1] for b in batches)
    response_width = max(b["responses"].shape[1] for b in batches)
    parts = []
    for b in batches:
        p, r = b["prompts"].shape[1], b["responses"].shape[1]
        tensors: dict[str, torch.Tensor] = {}
        for key, value in b.tensors.items():
            if key in ("input_ids", "attention_mask", "position_ids"):
                continue
            if key == "prompts":
                tensors[key] = torch.nn.functional.pad(value, (prompt_width - p, 0), value=pad_token_id)
            elif value.dim() == 2 and value.shape[1] == r:
                fill = pad_token_id if key == "responses" else 0
                tensors[key] = torch.nn.functional.pad(value, (0, response_width - r), value=fill)
            else:
                tensors[key] = value
        prompt_mask = torch.nn.functional.pad(b["attention_mask"][:, :p], (prompt_width - p, 0), value=0)
        present = torch.nn.functional.pad(response_attention(b), (0, response_width - r), value=0)
        attention_mask = torch.cat([prompt_mask, present], dim=1)
        tensors["input_ids"] = torch.cat([tensors["prompts"], tensors["responses"]], dim=1)
        tensors["attention_mask"] = attention_mask
        tensors["position_ids"] = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        parts.append(Batch(tensors, dict(b.rows), dict(b.info)))
    return Batch.concat(parts)
