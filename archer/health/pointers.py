"""Pointers: the responses (and tokens in them) that carry a flagged behaviour, picked from the step's rows.

A pointer names a response by its row in the step's batch (the rollout dump's line, the trace's
``response_index``), its prompt group, the token positions to look at (empty: the whole response) and the
value that ranked it, with a few words saying what that value is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from archer.health.rows import ScoredResponses, StepRows


@dataclass(frozen=True)
class Pointer:
    row: int
    uid: str
    value: float
    why: str
    positions: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def top_responses(rows: StepRows | ScoredResponses, scores: np.ndarray, k: int, why: str, *, eligible: np.ndarray | None = None,
                  positions: np.ndarray | None = None, token_scores: np.ndarray | None = None,
                  max_positions: int = 8, per_response: int = 3) -> list[Pointer]:
    """The ``k`` responses with the highest ``scores`` ([N]) among the ``eligible`` ones, highest first, each
    marking the first ``max_positions`` tokens where ``positions`` ([N, L] bool) holds, or its ``per_response``
    learned tokens of highest ``token_scores`` ([N, L])."""
    keep = np.isfinite(scores) & (np.ones(len(rows), dtype=bool) if eligible is None else eligible)
    out = []
    for i in [int(i) for i in np.argsort(-scores, kind="stable") if keep[i]][:k]:
        marked: list[int] = []
        if positions is not None:
            marked = np.flatnonzero(positions[i])[:max_positions].tolist()
        elif token_scores is not None:
            marked = _best_positions(np.where(rows.mask[i], token_scores[i], -np.inf), per_response)
        out.append(Pointer(int(rows.row[i]), str(rows.uid[i]), float(scores[i]), why, marked))
    return out


def _best_positions(scores: np.ndarray, count: int) -> list[int]:
    """The positions of the ``count`` highest finite ``scores``, in position order."""
    return sorted(int(p) for p in np.argsort(-scores, kind="stable")[:count] if np.isfinite(scores[p]))


def top_tokens(rows: StepRows, scores: np.ndarray, k: int, why: str, *, per_response: int = 3) -> list[Pointer]:
    """The ``k`` responses whose best learned token scores highest in ``scores`` ([N, L]), in that order; each
    marks its ``per_response`` best tokens and carries its best token's score."""
    masked = np.where(rows.mask, scores, -np.inf)
    best = masked.max(axis=1) if masked.size else np.full(len(rows), -np.inf)
    return [Pointer(int(rows.row[i]), str(rows.uid[i]), float(best[i]), why, _best_positions(masked[i], per_response))
            for i in [int(i) for i in np.argsort(-best, kind="stable") if np.isfinite(best[i])][:k]]


def mean_over_tokens(rows: StepRows, values: np.ndarray) -> np.ndarray:
    """[N] the mean of ``values`` ([N, L]) over each response's learned tokens (NaN without any)."""
    counts = rows.lengths
    sums = np.where(rows.mask, values, 0.0).sum(axis=1)
    return np.divide(sums, counts, out=np.full(len(rows), np.nan), where=counts > 0)
