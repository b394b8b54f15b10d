"""The one Evaluator of training's validation and ``archer eval``: generation through the policy's rollout (the
engine and, with tools configured, the multi-turn tool loop) and scoring through the reward manager (the reward
registry, or the custom reward function), then the sampling metrics of archer.eval.sampling_metrics.

Its unit is a batch of prompts (RLDataset items): each is answered n times (rollout.val_kwargs), every sample
scored, and each prompt comes back as one ``ProblemRecord`` (the line ``archer eval`` writes to samples.jsonl):
the prompt, its ground truth, and per sample the response, score, accuracy, extracted answer, its normal form
(the maj@k vote) and the reward's extras. The metrics are computed from records alone, so an evaluation that
resumed from samples.jsonl reports exactly what an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from archer.batch import Batch
from archer.data.loader import collate_prompts
from archer.eval.answers import extract_answer, normalise
from archer.eval.sampling_metrics import validation_metrics
from archer.rewards.extras import REWARD_EXTRAS, as_number
from archer.rewards.reward_stage import RewardManager

ProblemRecord = dict[str, Any]
BATCH_SEED_STRIDE = 1_000_003  # sampling seed of batch b: seed + b * stride (fixed per batch, so resumes agree)
_SAMPLE_COUNTS = ("num_tool_calls", "num_turns")  # generation counts kept per sample (with tools) and averaged
_SAMPLE_ROWS = ("finish_reason", *_SAMPLE_COUNTS)


def answer_type_of(item: dict[str, Any]) -> str:
    """How a prompt's answers are normalised for votes: "qa" for QA rows (ability qa, or a DR_* source), else "math"."""
    source = str(item.get("data_source", ""))
    return "qa" if item.get("ability") == "qa" or source.startswith("DR_") else "math"


class Evaluator:
    """Answers prompts ``n`` times with ``generate`` (a policy's ``generate_sequences``: prompts Batch -> sequences
    Batch, rollout.val_kwargs sampling) and scores them with ``reward_fn``."""

    def __init__(self, generate: Callable[[Batch], Batch], reward_fn: RewardManager, pad_token_id: int, *, n: int,
                 seed: int) -> None:
        self.generate = generate
        self.reward_fn = reward_fn
        self.pad_token_id = pad_token_id
        self.n = n
        self.seed = seed

    def run_batch(self, items: Sequence[dict[str, Any]], batch_index: int, uid_prefix: str = "val") -> tuple[
            Batch, list[ProblemRecord]]:
        """Generate and score one batch of prompts; returns the scored sequences and one record per prompt."""
        prompts = collate_prompts(list(items), self.pad_token_id)
        prompts["uid"] = [f"{uid_prefix}-{item['index']}" for item in items]
        prompts.info.update(validate=True, seed=self.seed + batch_index * BATCH_SEED_STRIDE)
        batch = self.generate(prompts)
        self.reward_fn(batch).add_to(batch)
        return batch, [self._record(batch, item, i) for i, item in enumerate(items)]

    def _record(self, batch: Batch, item: dict[str, Any], i: int) -> ProblemRecord:
        answer_type = answer_type_of(item)
        samples = []
        for row in range(i * self.n, (i + 1) * self.n):  # the rollout repeats each prompt n times, interleaved
            text = batch["response_text"][row]
            answer = extract_answer(text)
            sample = {"response": text, "score": float(batch["score"][row]), "acc": float(batch["acc"][row]),
                      "answer": answer, "vote": normalise(answer, answer_type),
                      "extras": {k: _plain(v) for k, v in batch[REWARD_EXTRAS][row].items()}}
            sample.update({k: _plain(batch[k][row]) for k in _SAMPLE_ROWS if k in batch})
            samples.append(sample)
        return {"index": int(item["index"]), "data_source": str(item["data_source"]), "prompt": item["raw_prompt"],
                "ground_truth": _plain(item["ground_truth"]), "samples": samples}


def _plain(value: Any) -> Any:
    """A JSON-friendly value: numpy scalars and arrays as Python ones."""
    return value.tolist() if hasattr(value, "tolist") else value


def records_metrics(records: Sequence[ProblemRecord], n: int, ks: Sequence[int] | None,
                    source_key: str = "data_source") -> dict[str, float]:
    """validation_metrics of the records: ``val-core/<source>/acc/...`` (mean@n, and with n > 1 best@k, maj@k,
    pass@k) and ``val-aux/<source>/<name>/mean@n`` of the score, each numeric reward extra and, with tools, the
    tool calls and turns per sample; the source is each record's ``source_key``."""
    rows = [(r, s) for r in records for s in r["samples"]]
    if not rows:
        return {}
    extra_keys = sorted({k for _, s in rows for k, v in s["extras"].items() if as_number(v) is not None})
    extras = {k: np.array([_number(s["extras"].get(k)) for _, s in rows]) for k in extra_keys}
    for key in _SAMPLE_COUNTS:  # with tools: calls and turns per sample
        if any(key in s for _, s in rows):
            extras[key] = np.array([_number(s.get(key)) for _, s in rows])
    return validation_metrics([r[source_key] for r, _ in rows], [r["index"] for r, _ in rows],
                              np.array([s["acc"] for _, s in rows]), np.array([s["score"] for _, s in rows]), n,
                              extras={k: v for k, v in extras.items() if not np.all(np.isnan(v))},
                              answers=[s["vote"] for _, s in rows], ks=ks)


def _number(value: Any) -> float:
    number = as_number(value)
    return np.nan if number is None else number
