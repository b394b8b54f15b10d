"""The reward stage of the RL step: decode responses, score each row, place scores on tokens.

Rows are scored by a reward manager (archer.rewards.row_scorers: naive, batch, dapo, prime) that calls
``compute_score`` (a custom function, used for every row as in verl) or the built-in routing of
archer.rewards.routing on the text of the whole response (tool output included). The row's score lands on its last learned token (``response_mask``) of ``token_level_scores``; a row with no such
token keeps an all-zero row (its score is still in ``scores``). Rows are scored in order, so the output is deterministic. Shaping (rewards/shaping.py) comes
after scoring: a built-in rule reward's wrong answers get ``wrong_answer_score``, and the overlong buffer
adds its penalty (``overlong_penalty``); accuracy is that of the unshaped answer.

With the reward model on (reward_model.enable, archer.workers.reward_model), a batch that carries its
``rm_scores`` is scored as ``rule_weight * rule score + rm_weight * rm score`` (``ModelRewardMix``; verl's default
rm_weight 1, rule_weight 0 is the reward model's score alone, as verl's managers return ``rm_scores`` as they are).
The rules still score the rows they can (all rows with a custom function; with the built-in rewards the rows whose
data_source has one and a ground truth), for the accuracy of the metrics; a row without a rule has accuracy
``score > 0``. Each row's extras gain ``rm_score`` and ``rule_score`` (``reward/rm_score/mean`` ... in the metrics).
A batch without ``rm_scores`` (validation, ``archer eval``) is scored by the rules alone, as in verl.

A scorer's other dict keys are the row's extras (archer.rewards.extras). A score or accuracy that is not a
finite number (a custom function returning NaN) stops the run with an error naming the row, its data_source
and its response: a non-finite reward would turn every later update into a silent no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from archer.batch import Batch, response_attention
from archer.errors import ArcherError
from archer.rewards.custom import load_custom_reward_fn
from archer.rewards.extras import REWARD_EXTRAS, as_number
from archer.rewards.routing import has_builtin_reward
from archer.rewards.row_scorers import ManagerContext, RowScorer, ScoreRows, build_row_scorer
from archer.rewards.shaping import OverlongBuffer, apply_wrong_answer_score

_REQUIRED_ROWS = ("ground_truth",)
_REQUIRED_TENSORS = ("responses", "response_mask", "attention_mask")
_SHOWN_RESPONSE_CHARS = 200  # of the response quoted in an error


@dataclass
class RewardOutput:
    """Scores of one batch: per token ([B, R] float32), per row, accuracy, the decoded responses, each row's
    extras (a dict, empty when the scorer returned a number) and the overlong penalty (with the buffer on)."""

    token_level_scores: torch.Tensor
    scores: np.ndarray
    acc: np.ndarray
    response_text: list[str]
    extras: np.ndarray
    overlong_penalty: np.ndarray | None = None

    def add_to(self, batch: Batch) -> Batch:
        """Store the outputs in ``batch`` as the fields later stages read (token_level_scores, score, acc,
        response_text, reward_extras and, with the overlong buffer, overlong_penalty); returns ``batch``."""
        batch["token_level_scores"] = self.token_level_scores
        batch["score"] = self.scores
        batch["acc"] = self.acc
        batch["response_text"] = self.response_text
        batch[REWARD_EXTRAS] = self.extras
        if self.overlong_penalty is not None:
            batch["overlong_penalty"] = self.overlong_penalty
        return batch


@dataclass(frozen=True)
class ModelRewardMix:
    """How a batch's reward-model scores (``rm_scores``) and the rule reward combine into a row's score:
    ``rule_weight * rule score + rm_weight * rm score`` (reward_model.rule_weight / rm_weight; verl's default 0
    and 1 is the reward model's score alone)."""

    rm_weight: float = 1.0
    rule_weight: float = 0.0

    def combine(self, rule: np.ndarray, acc: np.ndarray, ruled: np.ndarray, rm: np.ndarray,
                extras: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(score, accuracy) of each row from its rule score (rows ``ruled``) and reward-model score ``rm``; a
        row without a rule has accuracy ``score > 0``. Each row's extras gain ``rm_score`` (and ``rule_score``
        where a rule scored it)."""
        scores = self.rm_weight * rm
        if self.rule_weight:
            scores = scores + self.rule_weight * np.where(ruled, rule, 0.0)
        acc = np.where(ruled, acc, (scores > 0).astype(np.float64))
        for i, row_extras in enumerate(extras):
            row_extras["rm_score"] = float(rm[i])
            if ruled[i]:
                row_extras["rule_score"] = float(rule[i])
        return scores, acc


class RewardManager:
    """Turns a batch of responses into token-level scores with the reward manager named ``manager`` (its
    ``manager_kwargs`` are verl's reward_model.reward_kwargs; ``max_response_length`` is dapo's default).
    ``mix``: with the reward model on, how its ``rm_scores`` (when the batch has them) combine with the rules."""

    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., float | Mapping[str, Any]] | None = None,
        reward_fn_key: str = "data_source",
        overlong: OverlongBuffer | None = None,
        wrong_answer_score: float = 0.0,
        manager: str = "naive",
        manager_kwargs: Mapping[str, Any] | None = None,
        max_response_length: int = 0,
        score_workers: int = 1,
        mix: ModelRewardMix | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.mix = mix
        self.compute_score = compute_score
        self.reward_fn_key = reward_fn_key
        self.scorer: RowScorer = build_row_scorer(manager, compute_score, manager_kwargs or {},
                                                  ManagerContext(tokenizer, max_response_length, score_workers))
        if overlong is not None and self.scorer.overlong is not None:
            raise ArcherError(
                "two overlong buffers are set: reward_model.overlong_buffer and "
                "reward_model.reward_kwargs.overlong_buffer_cfg (reward_manager=dapo)",
                "keep one of them (reward_model.overlong_buffer.enable=false, or drop the reward_kwargs one)")
        self.overlong = overlong or self.scorer.overlong
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

    def _rows(self, batch: Batch, texts: list[str]) -> ScoreRows:
        n = len(texts)
        return ScoreRows(data_sources=list(batch[self.reward_fn_key]), texts=texts,
                         ground_truths=list(batch["ground_truth"]),
                         extra_infos=list(batch["extra_info"]) if "extra_info" in batch else [None] * n,
                         abilities=list(batch["ability"]) if "ability" in batch else [None] * n)

    def __call__(self, batch: Batch) -> RewardOutput:
        self._check_fields(batch)
        responses, mask = batch["responses"], batch["response_mask"]
        present = response_attention(batch)  # the reward reads the whole response, tool output included
        texts = self._decode(responses, present)
        rows = self._rows(batch, texts)
        model_scored = self.mix is not None and "rm_scores" in batch
        ruled = self._ruled(rows) if model_scored else np.ones(len(texts), dtype=bool)
        scores, acc, extras = self._rule_scores(rows, np.flatnonzero(ruled))
        if self.compute_score is None and self.wrong_answer_score != 0:
            scores[ruled] = apply_wrong_answer_score(scores[ruled], acc[ruled], self.wrong_answer_score)
        if model_scored:
            assert self.mix is not None
            rm = batch["rm_scores"].detach().sum(dim=1).cpu().double().numpy()
            scores, acc = self.mix.combine(scores, acc, ruled, rm, extras)
        penalty = None
        if self.overlong is not None:
            penalty = self.overlong.penalties(present.sum(dim=1).cpu().numpy())
            scores = scores + penalty
        return RewardOutput(on_last_token(scores, mask).to(responses.device), scores, acc, texts, extras, penalty)

    def _ruled(self, rows: ScoreRows) -> np.ndarray:
        """With the reward model's scores and rule_weight 0: the rows a rule scores (for their accuracy and the
        rule_score extra): every row with a custom function, else those with a built-in reward and a ground
        truth. With rule_weight != 0, every row (one without a rule is then an error)."""
        n = len(rows.texts)
        if self.compute_score is not None or (self.mix is not None and self.mix.rule_weight != 0):
            return np.ones(n, dtype=bool)
        return np.array([rows.ground_truths[i] is not None and has_builtin_reward(rows.data_sources[i], rows.abilities[i])
                         for i in range(n)], dtype=bool)

    def _rule_scores(self, rows: ScoreRows, which: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(score, accuracy, extras) of every row, the rows ``which`` scored by the manager; the others keep
        score 0, accuracy NaN and no extras."""
        n = len(rows.texts)
        scores, acc = np.zeros(n, dtype=np.float64), np.full(n, np.nan, dtype=np.float64)
        extras = np.empty(n, dtype=object)
        extras[:] = [{} for _ in range(n)]
        picked = [int(i) for i in which]
        subset = rows if len(picked) == n else ScoreRows(
            **{f.name: [getattr(rows, f.name)[i] for i in picked] for f in fields(ScoreRows)})
        results = self.scorer.score(subset) if picked else []
        for i, result in zip(picked, results, strict=True):
            where = f"row {i} (data_source {rows.data_sources[i]!r}, response {_excerpt(rows.texts[i])})"
            scores[i], acc[i], extras[i] = _row_score(result, where)
        return scores, acc, extras


def on_last_token(scores: np.ndarray, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] float32 zeros with each row's score at its last valid token (rows without one stay zero)."""
    valid = mask.cpu().long()
    out = torch.zeros(valid.shape, dtype=torch.float32)
    last = (valid * torch.arange(1, valid.shape[1] + 1)).argmax(dim=1)
    has_tokens = valid.sum(dim=1) > 0
    rows = torch.arange(valid.shape[0])[has_tokens]
    out[rows, last[has_tokens]] = torch.as_tensor(scores, dtype=torch.float32)[has_tokens]
    return out


def _excerpt(text: str) -> str:
    shown = text[:_SHOWN_RESPONSE_CHARS]
    return repr(shown) + ("..." if len(text) > len(shown) else "")


def _finite(value: Any, name: str, result: Any, where: str) -> float:
    """``result[name]`` as a finite float, else the error that names the row."""
    number = as_number(value)
    if number is None:
        raise ArcherError(
            f"the reward function returned {result!r} for {where}; its {name} must be a number",
            "return a float, or a dict {'score': float, ...} (an 'acc' key, when given, a number too)",
        )
    if not np.isfinite(number):
        raise ArcherError(
            f"the reward function returned {name} {number} for {where}: a non-finite reward makes every "
            "update a no-op",
            "make the reward function return a finite number for every response (e.g. 0.0 for one it "
            "cannot score); call it on that response to see why it does not",
        )
    return number


def _row_score(result: Any, where: str) -> tuple[float, float, dict[str, Any]]:
    """(score, accuracy, extras) of one scorer result; accuracy is ``score > 0`` when the scorer gives none."""
    if isinstance(result, Mapping) and "score" in result:
        score = _finite(result["score"], "score", result, where)
        given_acc = result.get("acc")
        acc = float(score > 0) if given_acc is None else _finite(given_acc, "acc", result, where)
        return score, acc, {k: v for k, v in result.items() if k not in ("score", "acc")}
    if as_number(result) is None:
        raise ArcherError(
            f"the reward function returned {result!r} for {where}; "
            "it must return a number or a dict with a 'score' key",
            "return a float, or {'score': float, ...} from the reward function",
        )
    score = _finite(result, "score", result, where)
    return score, float(score > 0), {}


def build_reward_manager(cfg: DictConfig, tokenizer: Any) -> RewardManager:
    """The reward stage an RL config describes (custom_reward_function, reward_model.*, eval.score_workers): the
    same for training, its validation and ``archer eval``."""
    custom = cfg.custom_reward_function
    fn = None
    if custom.path:
        fn = load_custom_reward_fn(custom.path, custom.name, **dict(custom.reward_kwargs))
    buffer = cfg.reward_model.overlong_buffer
    overlong = (OverlongBuffer(int(cfg.data.max_response_length), int(buffer.len), float(buffer.penalty_factor))
                if buffer.enable else None)
    return RewardManager(tokenizer, compute_score=fn, reward_fn_key=cfg.data.reward_fn_key, overlong=overlong,
                         wrong_answer_score=float(cfg.reward_model.wrong_answer_score),
                         manager=str(cfg.reward_model.reward_manager),
                         manager_kwargs=OmegaConf.to_container(cfg.reward_model.reward_kwargs, resolve=True),
                         max_response_length=int(cfg.data.max_response_length),
                         score_workers=int(cfg.eval.score_workers), mix=model_reward_mix(cfg))


def model_reward_mix(cfg: DictConfig) -> ModelRewardMix | None:
    """The mix of reward_model.rm_weight / rule_weight when reward_model.enable is on, else None."""
    rm = cfg.reward_model
    if not rm.enable:
        return None
    return ModelRewardMix(rm_weight=float(rm.rm_weight), rule_weight=float(rm.rule_weight))
