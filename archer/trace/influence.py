"""The influence trace of a run: which responses are traced, the capture during the update, the step file.

One traced step goes:
    select   prompt groups with mixed rewards (accepted = reward equal to the group maximum); groups whose
             responses all score the same are skipped and counted; caps on groups, responses and tokens
    capture  the actor's policy update runs with hooks (influence_capture.py); with output_function
             training_loss they ride on the real backward of the first PPO epoch, the other output functions
             (log_prob, advantage_log_prob) need one extra forward+backward of the traced rows
    score    per module, then summed (influence_score.py)
    write    trace format v1 plus influence, selected_row_id, accepted, group_id (REFERENCE.md s.11)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from archer.algorithms.grouping import group_rows
from archer.batch import Batch
from archer.errors import ArcherError
from archer.trace.entropy import response_arrays, step_stats, trace_dir, trace_metadata
from archer.trace.format import TraceWriter, value_stats
from archer.trace.influence_capture import (
    InfluenceCapture,
    MicroBatchPositions,
    ProjectionSpec,
    select_modules,
)
from archer.trace.influence_score import Scopes, ScoreOptions, module_scores

OUTPUT_FUNCTIONS = ("training_loss", "log_prob", "advantage_log_prob")


@dataclass
class Selection:
    """The traced responses of one step and their traced tokens."""

    rows: np.ndarray            # [S] batch rows
    group_id: np.ndarray        # [S] index of the prompt group within the step
    accepted: np.ndarray        # [S] reward equals the group maximum
    token_response: np.ndarray  # [T] selected response (0..S-1) of each traced token
    token_position: np.ndarray  # [T] response position of each traced token
    skipped_groups: int
    num_groups: int


def select_responses(uids: list[str], rewards: np.ndarray, mask: np.ndarray, *, max_groups: int,
                     max_responses: int, max_tokens_per_response: int) -> Selection:
    """Groups with mixed rewards in order of first appearance, within the caps (0 or less: no cap)."""
    groups = group_rows(uids)
    rows, group_ids, accepted = [], [], []
    skipped, kept, full = 0, 0, False
    for members in groups:
        scores = rewards[members]
        if np.all(scores == scores[0]):
            skipped += 1  # counted over the whole step, also once the caps are reached
            continue
        full = full or (max_groups > 0 and kept >= max_groups) or (
            max_responses > 0 and len(rows) + len(members) > max_responses)
        if full:
            continue
        rows += members.tolist()
        group_ids += [kept] * len(members)
        kept += 1
        accepted += list(scores == scores.max())
    token_response, token_position = [], []
    for s, row in enumerate(rows):
        positions = np.flatnonzero(mask[row])
        if max_tokens_per_response > 0:
            positions = positions[:max_tokens_per_response]
        token_response.append(np.full(len(positions), s, dtype=np.int64))
        token_position.append(positions.astype(np.int64))
    return Selection(np.asarray(rows, dtype=np.int64), np.asarray(group_ids, dtype=np.int32),
                     np.asarray(accepted, dtype=bool),
                     np.concatenate(token_response) if token_response else np.zeros(0, np.int64),
                     np.concatenate(token_position) if token_position else np.zeros(0, np.int64),
                     skipped, len(groups))


class InfluenceStep:
    """One step's capture: the actor calls ``hooks()`` around its update and ``micro_batch`` per micro-batch."""

    def __init__(self, capture: InfluenceCapture, selection: Selection, skip_optimizer_step: bool) -> None:
        self.capture = capture
        self.selection = selection
        self.skip_optimizer_step = skip_optimizer_step
        # batch row -> (id of its first traced token, its traced response positions)
        self._by_row: dict[int, tuple[int, np.ndarray]] = {}
        starts = np.searchsorted(selection.token_response, np.arange(len(selection.rows)))
        ends = np.searchsorted(selection.token_response, np.arange(len(selection.rows)), side="right")
        for s, row in enumerate(selection.rows):
            self._by_row[int(row)] = (int(starts[s]), selection.token_position[starts[s]:ends[s]])

    def hooks(self):
        return self.capture.capturing()

    @contextmanager
    def micro_batch(self, rows: torch.Tensor, input_length: int, response_length: int) -> Iterator[None]:
        """Trace the selected rows among ``rows`` (batch row ids of the micro-batch) inside the block."""
        mb_rows, positions, token_ids = [], [], []
        for i, row in enumerate(rows.tolist()):
            found = self._by_row.get(int(row))
            if found is None:
                continue
            first, pos = found
            mb_rows.append(np.full(len(pos), i))
            # The hidden state at input position L - R - 1 + t scores response token t.
            positions.append(input_length - response_length - 1 + pos)
            token_ids.append(first + np.arange(len(pos)))
        where = None
        if mb_rows:
            where = MicroBatchPositions(torch.as_tensor(np.concatenate(mb_rows)),
                                        torch.as_tensor(np.concatenate(positions)),
                                        torch.as_tensor(np.concatenate(token_ids)))
        with self.capture.micro_batch(where):
            yield


def influence_stats(arrays: dict[str, np.ndarray]) -> dict[str, float]:
    """Manifest statistics of an influence step: the entropy step's, plus influence over scored tokens."""
    influence = arrays["influence"].astype(np.float32)
    valid = influence[~np.isnan(influence)]
    return {**step_stats(arrays), **value_stats(valid, "influence"), "num_valid_influence": int(valid.size),
            "influence_sum": float(valid.sum()), "influence_mean": float(valid.mean()) if valid.size else 0.0}


class InfluenceTrace:
    """Writes the influence trace of a run (enabled by trainer.influence_trace.enable)."""

    def __init__(self, cfg: DictConfig, run_dir: Path, tokenizer: Any, model: torch.nn.Module,
                 device: torch.device) -> None:
        t = cfg.trainer.influence_trace
        self.cfg = t
        if t.output_function not in OUTPUT_FUNCTIONS:
            raise ArcherError(f"trainer.influence_trace.output_function={t.output_function!r} is not one of "
                              f"{OUTPUT_FUNCTIONS}", "use training_loss (no extra pass), log_prob or advantage_log_prob")
        if t.hessian_source != "response":
            raise ArcherError(f"trainer.influence_trace.hessian_source={t.hessian_source!r}: archer builds G from "
                              "response gradients only", "set trainer.influence_trace.hessian_source=response")
        self.options = ScoreOptions(mode=str(t.hessian_mode), reg_lambda=float(t.reg_lambda),
                                    scope=str(t.accepted_rejected_scope), contrastive_agg=str(t.contrastive_agg),
                                    response_grad_agg=str(t.response_grad_agg),
                                    exclude_self_response=bool(t.exclude_self_response))
        layers = None if t.layers is None else [int(i) for i in t.layers]
        self.modules = select_modules(model, list(t.module_name_filter), layers, int(t.max_modules))
        self.spec = ProjectionSpec(factor=int(t.projection_dim_factor), max_vector_sum=int(t.max_proj_vector_sum),
                                   max_dim=int(t.max_hessian_dim), seed=int(t.projection_seed))
        self.store_device = torch.device("cpu") if t.grad_offload_to_cpu else device
        self.score_device = device if t.force_gpu_compute else torch.device("cpu")
        self.extra_pass = t.output_function != "training_loss"
        self.writer = TraceWriter(trace_dir(t, run_dir, "influence_trace"), kind="influence",
                                  write_every=int(t.write_every), fsync=bool(t.fsync),
                                  metadata={**trace_metadata(cfg), "modules": list(self.modules),
                                            "options": {**vars(self.options), "output_function": t.output_function,
                                                        "projection": vars(self.spec)}},
                                  tokenizer=tokenizer)

    def begin(self, step: int, batch: Batch) -> InfluenceStep | None:
        """The capture of ``step``, or None when this step is not written."""
        if not self.writer.should_write(step):
            return None
        mask = batch["response_mask"].bool()
        if "loss_mask" in batch.tensors:
            mask = mask & batch["loss_mask"].bool()
        selection = select_responses(list(batch["uid"]), batch["token_level_scores"].sum(dim=1).numpy(),
                                     mask.numpy(), max_groups=int(self.cfg.max_prompts_per_step),
                                     max_responses=int(self.cfg.max_responses_per_step),
                                     max_tokens_per_response=int(self.cfg.max_tokens_per_response))
        capture = InfluenceCapture(self.modules, self.spec, store_device=self.store_device)
        return InfluenceStep(capture, selection, bool(self.cfg.skip_optimizer_step))

    def finish(self, step: int, batch: Batch, traced: InfluenceStep) -> dict[str, float]:
        """Score the captured tokens and write the step; returns influence metrics and phase timings."""
        sel = traced.selection
        start = time.perf_counter()
        scores = self.score(traced)
        scored = time.perf_counter()
        arrays = response_arrays(batch, sel.rows)
        influence = np.full(arrays["response_mask"].shape, np.nan, dtype=np.float32)
        influence[sel.token_response, sel.token_position] = scores
        arrays.update({"influence": influence.astype(np.float16), "selected_row_id": sel.rows.astype(np.int32),
                       "accepted": sel.accepted, "group_id": sel.group_id})
        groups = {"num_groups": sel.num_groups, "skipped_groups": sel.skipped_groups}
        self.writer.write_step_later(step, arrays, lambda a: {**influence_stats(a), **groups})
        return {"influence/selected_responses": float(len(sel.rows)),
                "influence/selected_groups": float(len(set(sel.group_id.tolist()))),
                "influence/skipped_groups": float(sel.skipped_groups),
                "influence/traced_tokens": float(len(sel.token_response)),
                "influence/num_modules": float(len(self.modules)),
                "timing_s/influence_score": scored - start,
                "timing_s/influence_write": time.perf_counter() - scored}

    def score(self, traced: InfluenceStep) -> np.ndarray:
        """Per traced token, the influence summed over modules (float32, aligned with the selection)."""
        sel = traced.selection
        total = torch.zeros(len(sel.token_response), dtype=torch.float32, device=self.score_device)
        if not len(sel.rows):
            return total.cpu().numpy()
        accepted = torch.as_tensor(sel.accepted, device=self.score_device)
        scope_of = (torch.as_tensor(sel.group_id, device=self.score_device) if self.options.scope == "per_prompt"
                    else torch.zeros(len(sel.rows), dtype=torch.int32, device=self.score_device))
        token_response = torch.as_tensor(sel.token_response, device=self.score_device)
        scopes = Scopes.build(accepted, scope_of, self.options.contrastive_agg)
        for name, (token_ids, u, v) in traced.capture.collect().items():
            if not torch.equal(token_ids.cpu(), torch.arange(len(sel.token_response))):
                raise RuntimeError(f"influence capture of {name} saw {len(token_ids)} of "
                                   f"{len(sel.token_response)} traced tokens")
            total += module_scores(token_response, u.to(self.score_device), v.to(self.score_device), scopes,
                                   self.options)
        return total.cpu().numpy()
