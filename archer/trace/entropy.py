"""The entropy trace: per-token entropies of each step's responses under the old policy (docs/traces.md).

The arrays come from the old-log-prob pass (``old_log_probs``, ``entropies``), so writing the trace adds no
model work: it copies tensors to numpy, compresses them and replaces files atomically. The step file also
holds what the explorer needs without the run: prompt ids, reward, accuracy, advantage, data_source, log-probs, the
reward's numeric extras (``reward_extra/<key>``, float32, NaN where a response has none), each response's
finish_reason, policy_version, first_policy_version and staleness (trainer/off_policy.py), the tokens the rollout
correction rejected (``rollout_rs_rejected``, when it rejects) and, for a run with tools, the tool fields
(format.TOOL_FIELDS: tool_mask, num_tool_calls, num_turns, branch_parent, branch_position). Both trace kinds take
their per-response fields from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from archer.algorithms.grouping import index_within_group
from archer.algorithms.rollout_correction import RS_REJECTED
from archer.batch import Batch
from archer.rewards.extras import REWARD_EXTRAS, numeric_columns
from archer.trace.format import REWARD_EXTRA_PREFIX, TraceWriter, value_stats


def response_arrays(batch: Batch, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The per-response fields shared by both trace kinds, for ``rows`` of the batch (all rows by default)."""
    rows = np.arange(len(batch)) if rows is None else np.asarray(rows, dtype=np.int64)
    index = torch.as_tensor(rows, dtype=torch.long)
    learned = batch["response_mask"][index].bool()
    rejected = batch[RS_REJECTED][index].bool() if RS_REJECTED in batch.tensors else None
    # the policy wrote the tokens the rollout correction rejected: shown, though it learns nothing from them
    mask = learned if rejected is None else learned | rejected
    uids = np.asarray([str(u) for u in batch["uid"]])
    prompt_mask = batch["attention_mask"][index, : batch["prompts"].shape[1]]
    advantages = batch["advantages"][index].float() if "advantages" in batch.tensors else None
    arrays: dict[str, np.ndarray] = {
        "entropies": batch["entropies"][index].to(torch.float16).numpy(),
        "response_mask": mask.numpy(),
        "responses": batch["responses"][index].to(torch.int32).numpy(),
        "response_index": rows.astype(np.int32),
        "prompt_length": prompt_mask.sum(dim=1).to(torch.int32).numpy(),
        "prompts": batch["prompts"][index].to(torch.int32).numpy(),
        "uid": uids[rows],
        "sample_index": index_within_group(uids)[rows],
        "old_log_probs": batch["old_log_probs"][index].to(torch.float16).numpy(),
        "reward": batch["token_level_scores"][index].sum(dim=1).float().numpy(),
        "data_source": np.asarray([str(batch["data_source"][int(i)]) if "data_source" in batch.rows else ""
                                   for i in rows], dtype=str),  # str also when no row is chosen
    }
    if "acc" in batch.rows:
        arrays["acc"] = batch["acc"][rows].astype(np.float32)
    if advantages is not None:
        m = learned.float()
        arrays["advantage"] = ((advantages * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)).numpy()
    if REWARD_EXTRAS in batch.rows:
        for key, column in numeric_columns(batch[REWARD_EXTRAS][rows]).items():
            arrays[REWARD_EXTRA_PREFIX + key] = column.astype(np.float32)
    if "finish_reason" in batch.rows:
        arrays["finish_reason"] = np.asarray([str(r) for r in batch["finish_reason"][rows]], dtype=str)
    if "tool_mask" in batch.tensors:
        arrays["tool_mask"] = batch["tool_mask"][index].bool().numpy()
    if rejected is not None:
        arrays[RS_REJECTED] = rejected.numpy()
    for name in ("num_tool_calls", "num_turns", "branch_parent", "branch_position", "first_policy_version",
                 "policy_version", "staleness"):
        if name in batch.rows:
            arrays[name] = batch[name][rows].astype(np.int32)
    return arrays


def step_stats(arrays: dict[str, np.ndarray]) -> dict[str, float]:
    """Manifest statistics: entropy over valid tokens, reward and response length."""
    mask = arrays["response_mask"]
    stats = value_stats(arrays["entropies"][mask], "entropy")
    stats["reward_mean"] = float(np.mean(arrays["reward"])) if "reward" in arrays and len(arrays["reward"]) else 0.0
    stats["response_length_mean"] = float(mask.sum(axis=1).mean()) if mask.shape[0] else 0.0
    return stats


def trace_metadata(cfg: DictConfig, call_tags: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """Run metadata recorded in a trace's summary.json; with tools, the (opening, closing) tags of the calls the
    model writes (``call_tags``: what the explorer highlights)."""
    trainer = cfg.trainer
    metadata = {"project_name": trainer.project_name, "experiment_name": trainer.experiment_name,
                "model_path": str(cfg.actor_rollout_ref.model.path), "run_dir": str(trainer.default_local_dir),
                "algorithm": str(cfg.algorithm.adv_estimator),
                "loss_mode": str(cfg.actor_rollout_ref.actor.policy_loss.loss_mode),
                "rollout_n": int(cfg.actor_rollout_ref.rollout.n)}
    if call_tags:
        metadata["call_tags"] = [[opening, closing] for opening, closing in call_tags]
    return metadata


def trace_dir(trace_cfg: DictConfig, run_dir: Path, default_name: str) -> Path:
    return Path(trace_cfg.output_dir) if trace_cfg.get("output_dir") else Path(run_dir) / default_name


class EntropyTrace:
    """Writes the entropy trace of a run (enabled by trainer.entropy_trace.enable); ``call_tags``: the rollout's
    (rollout/agentic_config.tool_call_tags)."""

    def __init__(self, cfg: DictConfig, run_dir: Path, tokenizer: Any,
                 call_tags: Sequence[tuple[str, str]] = ()) -> None:
        trace_cfg = cfg.trainer.entropy_trace
        self.writer = TraceWriter(trace_dir(trace_cfg, run_dir, "entropy_trace"), kind="entropy",
                                  write_every=int(trace_cfg.write_every), fsync=bool(trace_cfg.fsync),
                                  metadata=trace_metadata(cfg, call_tags), tokenizer=tokenizer)

    def record(self, step: int, batch: Batch) -> bool:
        """Write ``step`` if it is due (on the writer's thread); True when it is."""
        if not self.writer.should_write(step):
            return False
        self.writer.write_step_later(step, response_arrays(batch), step_stats)
        return True
