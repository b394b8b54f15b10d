"""The responses of one step as the health checks read them: from the step's Batch while training, or from a
step of the run's entropy trace afterwards (``archer health``), so that both go through the same checks.

Token arrays are [responses, response length]; ``row`` is each response's row in the step's batch (the trace's
``response_index``), which is how a flag's pointers name a response in the rollout dump and the explorer. The
trace keeps each response's mean advantage, not its tokens': from a trace, every token gets its response's
(exact for GRPO, RLOO and REINFORCE++ without a per-token KL penalty; a token average for GAE). Entropies and
log-probs are rounded to float16 in both, as the trace stores them, so a replay ranks the pointers the same.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from archer.rewards.extras import REWARD_EXTRAS, numeric_columns
from archer.tagged_text import tag_spans
from archer.trace.format import REWARD_EXTRA_PREFIX

if TYPE_CHECKING:  # torch is needed only while training, not by `archer health`
    import torch

    from archer.batch import Batch

CallTags = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class StepRows:
    entropies: np.ndarray  # [N, L] float32, under the policy that generated the step
    log_probs: np.ndarray  # [N, L] float32 (old policy)
    mask: np.ndarray  # [N, L] bool: the learned tokens
    advantages: np.ndarray  # [N, L] float32
    responses: np.ndarray  # [N, L] token ids
    uid: np.ndarray  # [N] prompt group
    reward: np.ndarray  # [N] float64 sequence score
    row: np.ndarray  # [N] row in the step's batch
    acc: np.ndarray | None = None  # [N] float64 (absent from traces written before it was recorded)
    finish_reason: np.ndarray | None = None  # [N] str
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # numeric reward extras, NaN where absent
    calls: list[list[str]] | None = None  # each response's tool calls, as text (runs with tools)

    def __len__(self) -> int:
        return int(self.mask.shape[0])

    def take(self, index: np.ndarray) -> StepRows:
        """The responses at ``index``."""
        return StepRows(self.entropies[index], self.log_probs[index], self.mask[index], self.advantages[index],
                        self.responses[index], self.uid[index], self.reward[index], self.row[index],
                        None if self.acc is None else self.acc[index],
                        None if self.finish_reason is None else self.finish_reason[index],
                        {k: v[index] for k, v in self.extras.items()},
                        None if self.calls is None else [self.calls[int(i)] for i in index])

    @property
    def lengths(self) -> np.ndarray:
        """Learned tokens per response."""
        return self.mask.sum(axis=1)

    @classmethod
    def from_batch(cls, batch: Batch, call_tags: CallTags = ()) -> StepRows:
        """The rows of a training step after its advantages are computed (ppo.PPOTrainer.train_step)."""
        rows = batch.rows
        extras = numeric_columns(rows[REWARD_EXTRAS]) if REWARD_EXTRAS in rows else {}
        calls = None
        if call_tags and "num_tool_calls" in rows and "response_text" in rows:
            calls = [tool_calls(str(text), call_tags) for text in rows["response_text"]]
        return cls(entropies=_as_traced(batch["entropies"]), log_probs=_as_traced(batch["old_log_probs"]),
                   mask=batch["response_mask"].bool().numpy(), advantages=batch["advantages"].float().numpy(),
                   responses=batch["responses"].numpy(), uid=np.asarray([str(u) for u in rows["uid"]]),
                   reward=batch["token_level_scores"].sum(dim=1).double().numpy(),
                   row=np.arange(len(batch)),
                   acc=rows["acc"].astype(np.float64) if "acc" in rows else None,
                   finish_reason=np.asarray([str(r) for r in rows["finish_reason"]]) if "finish_reason" in rows
                   else None, extras=extras, calls=calls)

    @classmethod
    def from_trace(cls, arrays: dict[str, np.ndarray], call_tags: CallTags = (),
                   decode: Callable[[np.ndarray], str] | None = None) -> StepRows:
        """The rows of an entropy-trace step (archer/trace/format.py); ``decode`` (token ids -> text) reads the
        tool calls of a run with tools."""
        mask = arrays["response_mask"]
        n = mask.shape[0]
        advantage = arrays["advantage"] if "advantage" in arrays else np.zeros(n, dtype=np.float32)
        calls = None
        if call_tags and decode is not None and "tool_mask" in arrays:
            shown = mask | arrays["tool_mask"]
            calls = [tool_calls(decode(ids[keep]), call_tags) for ids, keep in zip(arrays["responses"], shown)]
        extras = {name[len(REWARD_EXTRA_PREFIX):]: values.astype(np.float64) for name, values in arrays.items()
                  if name.startswith(REWARD_EXTRA_PREFIX)}
        return cls(entropies=arrays["entropies"].astype(np.float32), log_probs=arrays["old_log_probs"].astype(np.float32),
                   mask=mask, advantages=np.broadcast_to(advantage.astype(np.float32)[:, None], mask.shape),
                   responses=arrays["responses"], uid=arrays["uid"].astype(str),
                   reward=arrays["reward"].astype(np.float64), row=arrays["response_index"].astype(np.int64),
                   acc=arrays["acc"].astype(np.float64) if "acc" in arrays else None,
                   finish_reason=arrays.get("finish_reason"), extras=extras, calls=calls)


@dataclass(frozen=True)
class ScoredResponses:
    """Every response a step generated, trained on or dropped, with its score: the step's rollout dump, whose
    line numbers are ``row`` (the trained responses come first, so their rows are the batch's)."""

    uid: np.ndarray  # [N] prompt group
    reward: np.ndarray  # [N] float64 sequence score
    row: np.ndarray  # [N] line of the rollout dump

    def __len__(self) -> int:
        return len(self.uid)

    @classmethod
    def from_rows(cls, uid: Sequence[object], score: Sequence[float]) -> ScoredResponses:
        return cls(np.asarray([str(u) for u in uid]), np.asarray(score, dtype=np.float64), np.arange(len(uid)))

    @classmethod
    def from_dump(cls, path: Path) -> ScoredResponses | None:
        """The responses of a rollout dump (``step_N.jsonl``), or None for a dump without prompt groups."""
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not records or any("uid" not in r for r in records):
            return None
        return cls.from_rows([r["uid"] for r in records], [r["score"] for r in records])


def _as_traced(values: torch.Tensor) -> np.ndarray:
    """Token values rounded to float16 as the trace stores them (then float32), so a replay reads the same."""
    return values.half().float().numpy()


def tool_calls(text: str, call_tags: CallTags) -> list[str]:
    """The tool calls a response's text holds (each ``opening ... closing`` block), in order."""
    return [text[start:end] for start, end, _ in tag_spans(text, list(call_tags))]
