"""The reward stage of the RL step: decode responses, score each row, place scores on tokens.

Each row is scored by ``compute_score`` (a custom function, used for every row as in verl) or by the
built-in routing of archer.rewards.registry on the text of the whole response (tool output included). The
row's score lands on its last learned token (``response_mask``) of ``token_level_scores``; a row with no such
token keeps an all-zero row (its score is still in ``scores``). Rows are scored in order, so the output is deterministic. Shaping (rewards/shaping.py) comes
after scoring: a built-in rule reward's wrong answers get ``wrong_answer_score``, and the overlong buffer
adds its penalty (``extra["overlong_penalty"]``); accuracy is that of the unshaped answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from archer.batch import Batch, response_attention
from archer.errors import ArcherError
from archer.rewards.registry import default_compute_score
from archer.rewards.shaping import OverlongBuffer, apply_wrong_answer_score

_REQUIRED_ROWS = ("ground_truth",)
_REQUIRED_TENSORS = ("responses", "response_mask", "attention_mask")


@dataclass
class RewardOutput:
    """Scores of one batch: per token ([B, R] float32), per row, accuracy, and any extra scorer keys."""

    token_level_scores: torch.Tensor
    scores: np.ndarray
    acc: np.ndarray
    extra: dict[str, Any] = field(default_factory=dict)


class RewardManager:
    """Turns a batch of responses into token-level scores (verl's naive reward manager)."""

    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., float | Mapping[str, Any]] | None = None,
        reward_fn_key: str = "data_source",
        overlong: OverlongBuffer | None = None,
        wrong_answer_score: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.reward_fn_key = reward_fn_key
        self.overlong = overlong
        self.wrong_answer_score = wrong_answer_score

    def _check_fields(self, batch: Batch) -> None:
        missing = [k for k in (*_REQUIRED_TENSORS, self.reward_fn_key, *_REQUIRED_ROWS) if k not in batch]
        if missing:
            raise ArcherError(
                f"the reward stage needs batch field(s) {missing}; the batch has {sorted(batch)}",
                "keep data_source / reward_model.ground_truth in the prompt files, or set "
                "reward_model.reward_fn_key to the column that names the reward",
            )

    def _decode(self, responses: torch.Tensor, mask: torch.Tensor) -> list[str]:
        ids = [
            row[row_mask].tolist() for row, row_mask in zip(responses.cpu(), mask.cpu().bool(), strict=True)
        ]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def _score_row(self, batch: Batch, i: int, text: str) -> Mapping[str, Any]:
        data_source = batch[self.reward_fn_key][i]
        extra_info = batch["extra_info"][i] if "extra_info" in batch else None
        kwargs = {"data_source": data_source, "solution_str": text, "ground_truth": batch["ground_truth"][i]}
        try:
            if self.compute_score is not None:
                result = self.compute_score(**kwargs, extra_info=extra_info)
            else:
                ability = batch["ability"][i] if "ability" in batch else None
                result = default_compute_score(**kwargs, extra_info=extra_info, ability=ability)
        except ArcherError:
            raise
        except Exception as exc:
            raise ArcherError(
                f"the reward function failed on row {i} (data_source {data_source!r}): {type(exc).__name__}: {exc}",
                "fix the reward function or that row's ground truth; a custom reward is set with "
                "custom_reward_function.path=FILE custom_reward_function.name=FN",
            ) from exc
        return _as_score_dict(result, data_source, i)

    def __call__(self, batch: Batch) -> RewardOutput:
        self._check_fields(batch)
        responses, mask = batch["responses"], batch["response_mask"]
        present = response_attention(batch)  # the reward reads the whole response, tool output included
        texts = self._decode(responses, present)
        results = [self._score_row(batch, i, text) for i, text in enumerate(texts)]
        scores = np.array([float(r["score"]) for r in results], dtype=np.float64)
        acc = np.array([_accuracy(r) for r in results], dtype=np.float64)
        extra = _extra_columns(results)
        extra["response_text"] = texts
        if self.compute_score is None and self.wrong_answer_score != 0:
            scores = apply_wrong_answer_score(scores, acc, self.wrong_answer_score)
        if self.overlong is not None:
            extra["overlong_penalty"] = self.overlong.penalties(present.sum(dim=1).cpu().numpy())
            scores = scores + extra["overlong_penalty"]
        return RewardOutput(_on_last_token(scores, mask).to(responses.device), scores, acc, extra)


def _on_last_token(scores: np.ndarray, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] float32 zeros with each row's score at its last valid token (rows without one stay zero)."""
    valid = mask.cpu().long()
    out = torch.zeros(valid.shape, dtype=torch.float32)
    last = (valid * torch.arange(1, valid.shape[1] + 1)).argmax(dim=1)
    has_tokens = valid.sum(dim=1) > 0
    rows = torch.arange(valid.shape[0])[has_tokens]
    out[rows, last[has_tokens]] = torch.as_tensor(scores, dtype=torch.float32)[has_tokens]
    return out


def _as_score_dict(result: Any, data_source: str, i: int) -> Mapping[str, Any]:
    if isinstance(result, Mapping) and "score" in result:
        return result
    if isinstance(result, int | float | np.number):
        return {"score": float(result)}
    raise ArcherError(
        f"the reward function returned {result!r} for row {i} (data_source {data_source!r}); "
        "it must return a number or a dict with a 'score' key",
        "return a float, or {'score': float, ...} from the reward function",
    )


def _accuracy(result: Mapping[str, Any]) -> float:
    if "acc" in result:
        return float(result["acc"])
    return 1.0 if float(result["score"]) > 0 else 0.0


def _extra_columns(results: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-row arrays of the dict keys other than score/acc; numeric keys get NaN where a row lacks them."""
    keys = sorted({k for r in results for k in r} - {"score", "acc"})
    columns: dict[str, Any] = {}
    for key in keys:
        values = [r.get(key) for r in results]
        if all(v is None or isinstance(v, int | float | np.number) for v in values):
            columns[key] = np.array([math.nan if v is None else float(v) for v in values], dtype=np.float64)
        else:
            column = np.empty(len(values), dtype=object)
            for j, value in enumerate(values):
                column[j] = value
            columns[key] = column
    return columns
