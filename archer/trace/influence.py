"""The influence trace of a run: which responses are traced, the capture during the update, the step file.

One traced step goes:
    select   prompt groups with mixed rewards (accepted = reward equal to the group maximum); groups whose
             responses all score the same are skipped and counted; caps on groups, responses and tokens
    capture  the actor worker runs its policy update with hooks on its own model (influence_capture.py) and
             returns the captured factors as plain tensors; with output_function training_loss they ride on
             the real backward of the first PPO epoch, the other output functions (log_prob,
             advantage_log_prob) need one extra forward+backward of the traced rows
    score    per group of modules of equal projection sizes, then summed (influence_score.py)
    write    trace format v1 plus influence, selected_row_id, accepted, group_id (docs/traces.md)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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
from archer.trace.influence_capture import CapturedFactors, CaptureSettings, TracedTokens
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

    @property
    def tokens(self) -> TracedTokens:
        """What the actor worker captures for this selection."""
        return TracedTokens(self.rows, self.token_response, self.token_position)


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


def influence_stats(arrays: dict[str, np.ndarray]) -> dict[str, float]:
    """Manifest statistics of an influence step: the entropy step's, plus influence over scored tokens."""
    influence = arrays["influence"].astype(np.float32)
    valid = influence[~np.isnan(influence)]
    return {**step_stats(arrays), **value_stats(valid, "influence"), "num_valid_influence": int(valid.size),
            "influence_sum": float(valid.sum()), "influence_mean": float(valid.mean()) if valid.size else 0.0}


class InfluenceTrace:
    """Writes the influence trace of a run (enabled by trainer.influence_trace.enable).

    ``modules`` are the names of the linear layers the actor worker hooks (what its ``setup_influence``
    returned for ``capture_settings``); scores are computed on ``device`` (force_gpu_compute) or the CPU.
    ``call_tags``: the rollout's (rollout/agentic_config.tool_call_tags), recorded as the entropy trace records them.
    """

    def __init__(self, cfg: DictConfig, run_dir: Path, tokenizer: Any, modules: list[str], device: torch.device,
                 call_tags: Sequence[tuple[str, str]] = ()) -> None:
        t = cfg.trainer.influence_trace
        self.cfg = t
        check_settings(t)
        self.options = ScoreOptions.from_config(t)
        self.capture_settings = CaptureSettings.from_config(t)
        self.modules = list(modules)
        self.score_device = device if t.force_gpu_compute else torch.device("cpu")
        self.writer = TraceWriter(trace_dir(t, run_dir, "influence_trace"), kind="influence",
                                  write_every=int(t.write_every), fsync=bool(t.fsync),
                                  metadata={**trace_metadata(cfg, call_tags), "modules": self.modules,
                                            "options": {**vars(self.options), "output_function": t.output_function,
                                                        "projection": vars(self.capture_settings.projection)}},
                                  tokenizer=tokenizer)

    def select(self, step: int, batch: Batch) -> Selection | None:
        """The responses and tokens traced at ``step``, or None when this step is not written."""
        if not self.writer.should_write(step):
            return None
        return select_responses(list(batch["uid"]), batch["token_level_scores"].sum(dim=1).numpy(),
                                batch["response_mask"].bool().numpy(), max_groups=int(self.cfg.max_prompts_per_step),
                                max_responses=int(self.cfg.max_responses_per_step),
                                max_tokens_per_response=int(self.cfg.max_tokens_per_response))

    def finish(self, step: int, batch: Batch, sel: Selection, captured: CapturedFactors) -> dict[str, float]:
        """Score the captured tokens and write the step; returns influence metrics and phase timings."""
        start = time.perf_counter()
        scores = self.score(sel, captured)
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

    def score(self, sel: Selection, captured: CapturedFactors) -> np.ndarray:
        """Per traced token, the influence summed over modules (float32, aligned with the selection)."""
        total = torch.zeros(len(sel.token_response), dtype=torch.float32, device=self.score_device)
        if not len(sel.rows):
            return total.cpu().numpy()
        accepted = torch.as_tensor(sel.accepted, device=self.score_device)
        scope_of = (torch.as_tensor(sel.group_id, device=self.score_device) if self.options.scope == "per_prompt"
                    else torch.zeros(len(sel.rows), dtype=torch.int32, device=self.score_device))
        token_response = torch.as_tensor(sel.token_response, device=self.score_device)
        scopes = Scopes.build(accepted, scope_of, self.options.contrastive_agg)
        for group in captured:
            if group.u.shape[1] != len(sel.token_response):
                raise RuntimeError(f"influence capture of {group.modules} holds {group.u.shape[1]} tokens; the "
                                   f"selection has {len(sel.token_response)}")
            total += module_scores(token_response, group.u.to(self.score_device), group.v.to(self.score_device),
                                   scopes, self.options).sum(0)
        return total.cpu().numpy()


def check_settings(t: DictConfig) -> None:
    """trainer.influence_trace values archer cannot run, refused before any model work."""
    if t.output_function not in OUTPUT_FUNCTIONS:
        raise ArcherError(f"trainer.influence_trace.output_function={t.output_function!r} is not one of "
                          f"{OUTPUT_FUNCTIONS}", "use training_loss (no extra pass), log_prob or advantage_log_prob")
    ScoreOptions.from_config(t)  # hessian_mode, accepted_rejected_scope, contrastive_agg, response_grad_agg
    if t.hessian_source != "response":
        raise ArcherError(f"trainer.influence_trace.hessian_source={t.hessian_source!r}: archer builds G from "
                          "response gradients only", "set trainer.influence_trace.hessian_source=response")
