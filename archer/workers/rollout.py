"""The rollout worker: turns a batch of prompts into a batch of prompt+response sequences.

It wraps a generation engine (rollout/) and lays out the tensors the later stages read: ``prompts``,
``responses``, ``input_ids`` (prompt + response), ``attention_mask``, ``position_ids``, ``response_mask``
and the engine's per-token ``rollout_log_probs`` / ``rollout_entropies`` (and, where the engine records its
routing, ``routed_experts``: routing replay, models/router_replay.py). Rows are repeated n times.
The actor worker owns it (the engine generates with the actor's weights).

With tools configured (``rollout.tools.tool_instances``) it generates with the multi-turn tool loop
(rollout/agentic.py), for training (with ARPO/AEPO branching) and validation alike, each prompt with the tools
its row's ``tools`` allow (every tool when the row has none), and adds ``tool_mask``
([B, R], 1 on tool output), the rows ``num_tool_calls``, ``num_turns``, ``branch_parent`` (the row of the
prompt's n it branched from, -1 for none), ``branch_position`` (the response position where it branched, -1
for none) and ``info["rollout_stats"]`` (a RolloutStats: the step's
``rollout/*`` and ``tools/*`` metrics).

The layout is where the one learning mask is set: ``response_mask`` is 1 on the tokens the policy wrote and
0 elsewhere (padding, and tool output); the attention mask covers every token of the sequence, tool output
included (``response_attention`` gives its response part).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from archer.batch import Batch, response_attention
from archer.models.loading import autocast_for
from archer.models.router_replay import ROUTED_EXPERTS, pad_routes, sequence_routes
from archer.rollout.agentic import AgenticOutput
from archer.rollout.agentic_config import branch_settings, build_agentic_rollout, uses_tools
from archer.rollout.base import RolloutEngine, SamplingParams
from archer.rollout.request_pool import PoolRun, RolloutPool
from archer.workers.dispatch import FIRST_ROW
from archer.workers.results import ROLLOUT_STATS

log = logging.getLogger("archer.rollout")


def sampling_params(rollout: DictConfig, *, validate: bool, seed: int, first_prompt: int = 0) -> SamplingParams:
    """verl's rollout keys (or rollout.val_kwargs for validation) as engine sampling parameters."""
    src = rollout.val_kwargs if validate else rollout
    temperature = float(src.temperature)
    return SamplingParams(
        n=int(src.n), temperature=temperature, top_p=float(src.top_p), top_k=int(src.top_k),
        max_new_tokens=int(rollout.response_length), stop=tuple(rollout.stop),
        do_sample=bool(src.do_sample) and temperature > 0, seed=seed, first_prompt=first_prompt)


def prompt_token_lists(prompts: Batch) -> list[list[int]]:
    """Each prompt row's token ids, without its padding."""
    return [row[m.bool()].tolist() for row, m in zip(prompts["input_ids"], prompts["attention_mask"], strict=True)]


def layout_sequences(prompts: Batch, responses: torch.Tensor, response_mask: torch.Tensor, n: int,
                     present: torch.Tensor | None = None) -> Batch:
    """verl's tensor layout for prompt (left-padded) + response (right-padded) sequences. ``present`` is the
    response part of the attention mask (tool output included); default: ``response_mask``."""
    out = prompts.repeat(n, interleave=True)
    prompt_ids = out.tensors.pop("input_ids")
    prompt_mask = out.tensors.pop("attention_mask")
    out.tensors.pop("position_ids", None)
    present = response_mask if present is None else present
    attention_mask = torch.cat([prompt_mask, present.to(prompt_mask.dtype)], dim=1)
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
    """Generates responses with an engine that shares the actor's weights (hybrid engine); with tools
    configured, through the agentic loop (``tokenizer`` is then required; ``chat_template`` and
    ``template_kwargs`` render the tool messages of multi_turn.format=hermes)."""

    def __init__(self, engine: RolloutEngine, cfg: DictConfig, *, device: torch.device,
                 tokenizer: PreTrainedTokenizerBase | None = None, chat_template: str | None = None,
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.engine = engine
        self.cfg = cfg
        self.device = device
        self.agentic = None
        if uses_tools(cfg):
            if tokenizer is None:
                raise ValueError("a rollout worker with tools needs the tokenizer")
            self.agentic = build_agentic_rollout(engine, tokenizer, cfg, chat_template=chat_template,
                                                 template_kwargs=template_kwargs)

    def generate_for(self, prompts: Batch, *, release_weights: bool = False) -> Batch:
        """Responses to ``prompts`` with the sampling of ``info`` (``validate`` picks rollout.val_kwargs and turns
        branching off, ``seed`` the sampling seed); the engine's memory is reclaimed before and, with
        rollout.free_cache_engine, released after (with ``release_weights``, the engine's weight copy too: the
        caller syncs the weights again before the next generation)."""
        validate = bool(prompts.info.get("validate", False))
        params = sampling_params(self.cfg, validate=validate, seed=int(prompts.info["seed"]),
                                 first_prompt=int(prompts.info.get(FIRST_ROW, 0)))
        with self.engine_turn(release_weights=release_weights):
            return self.generate_sequences(prompts, params, validate=validate)

    @contextmanager
    def engine_turn(self, *, release_weights: bool) -> Iterator[None]:
        """The engine's memory reclaimed before and, with rollout.free_cache_engine, released after (with
        ``release_weights``, its weight copy too: the caller syncs the weights before the next turn)."""
        self.engine.reclaim_memory()
        try:
            with autocast_for(self.device):
                yield
        finally:
            if self.cfg.free_cache_engine:
                self.engine.release_memory(weights=release_weights)

    def run_pool(self, pool: RolloutPool, params: SamplingParams, version: int, quota: int, *,
                 must_finish: frozenset, partial: bool) -> PoolRun:
        """``pool.run`` on this worker's engine (the asynchronous modes) in an engine turn that releases the
        weight copy (the caller syncs before the next call)."""
        with self.engine_turn(release_weights=True):
            return pool.run(self.engine, params, version, quota, must_finish=must_finish, partial=partial)

    def generate_sequences(self, prompts: Batch, params: SamplingParams, *, validate: bool = False) -> Batch:
        prompt_lists = prompt_token_lists(prompts)
        if self.agentic is not None:
            return self._generate_with_tools(prompts, prompt_lists, params, validate)
        with autocast_for(self.device):
            out = self.engine.generate(prompt_lists, params)
        batch = layout_sequences(prompts, out.responses.cpu(), out.response_mask.cpu().long(), params.n)
        batch["rollout_log_probs"] = out.log_probs.float().cpu()
        batch["rollout_entropies"] = out.entropies.float().cpu()
        batch["finish_reason"] = list(out.finish_reasons)
        if out.routed_experts is not None:
            lengths = [len(prompt_lists[i]) for i in out.prompt_index.tolist()]
            batch[ROUTED_EXPERTS] = sequence_routes(out.routed_experts, lengths, prompts["input_ids"].shape[1],
                                                    out.responses.shape[1])
        return batch

    def _generate_with_tools(self, prompts: Batch, prompt_lists: list[list[int]], params: SamplingParams,
                             validate: bool) -> Batch:
        allowed = list(prompts["tools"]) if "tools" in prompts else None  # the data's per-row tools
        with autocast_for(self.device):
            out = self.agentic.generate(prompt_lists, params, branch_settings(self.cfg, params, validate=validate),
                                        allowed_tools=allowed)
        batch = tool_rows(prompts, out, params.n)
        batch.info[ROLLOUT_STATS] = out.stats
        return batch


def tool_rows(prompts: Batch, out: AgenticOutput, n: int, rows: slice = slice(None)) -> Batch:
    """``prompts`` (one row each) with their ``n`` responses each from ``rows`` of the tool loop's output, in
    verl's layout, with the tool loop's fields."""
    mask, tool_mask = out.response_mask[rows], out.tool_mask[rows]
    batch = layout_sequences(prompts, out.responses[rows], mask, n, present=mask + tool_mask)
    batch["tool_mask"] = tool_mask
    batch["rollout_log_probs"] = out.log_probs[rows]
    batch["rollout_entropies"] = out.entropies[rows]
    batch["finish_reason"] = out.finish_reasons[rows]
    batch["num_tool_calls"] = out.num_tool_calls[rows]
    batch["num_turns"] = out.num_turns[rows]
    batch["branch_parent"] = out.branch_parent[rows]
    batch["branch_position"] = out.branch_position[rows]
    return batch


def concat_sequences(batches: list[Batch], pad_token_id: int) -> Batch:
    """Rows of several generated batches in one batch, re-padded to the widest prompt and response
    (``pad_sequences``)."""
    prompt_width = max(b["prompts"].shape[1] for b in batches)
    response_width = max(b["responses"].shape[1] for b in batches)
    return Batch.concat([pad_sequences(b, prompt_width, response_width, pad_token_id) for b in batches])


def pad_sequences(b: Batch, prompt_width: int, response_width: int, pad_token_id: int) -> Batch:
    """A generated batch padded to ``prompt_width`` / ``response_width`` (at least its own widths).

    Prompts are left-padded and every [B, R] tensor aligned with the responses is right-padded (responses
    with the pad token, the others with 0), ``routed_experts`` on both sides; input_ids, attention_mask and
    position_ids are rebuilt.
    """
    p, r = b["prompts"].shape[1], b["responses"].shape[1]
    tensors: dict[str, torch.Tensor] = {}
    for key, value in b.tensors.items():
        if key in ("input_ids", "attention_mask", "position_ids"):
            continue
        if key == "prompts":
            tensors[key] = torch.nn.functional.pad(value, (prompt_width - p, 0), value=pad_token_id)
        elif key == ROUTED_EXPERTS:
            tensors[key] = pad_routes(value, prompt_width - p, response_width - r)
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
    return Batch(tensors, dict(b.rows), dict(b.info))
