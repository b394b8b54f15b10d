"""Reward shaping applied after scoring: DAPO's soft overlong punishment and the score of a wrong answer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from archer.errors import ArcherError


@dataclass(frozen=True)
class OverlongBuffer:
    """DAPO's overlong shaping: r += min(-(|y| - (L_max - L_buf)) / L_buf * factor, 0)."""

    max_length: int
    buffer_len: int
    penalty_factor: float

    def __post_init__(self) -> None:
        if not 0 < self.buffer_len < self.max_length:
            raise ArcherError(
                f"reward_model.overlong_buffer.len={self.buffer_len} must be positive and smaller than "
                f"data.max_response_length={self.max_length}",
                "set reward_model.overlong_buffer.len to the last tokens before the limit that earn a "
                f"growing penalty, e.g. {max(1, self.max_length // 4)}",
            )

    def penalties(self, lengths: np.ndarray) -> np.ndarray:
        """The (non-positive) penalty of each response length: 0 up to L_max - L_buf, -factor at L_max."""
        start = self.max_length - self.buffer_len
        excess = np.asarray(lengths, dtype=np.float64) - start
        return np.minimum(-excess / self.buffer_len * self.penalty_factor, 0.0)


def apply_wrong_answer_score(scores: np.ndarray, acc: np.ndarray, wrong_answer_score: float) -> np.ndarray:
    """Scores with every wrong answer scored 0 (acc 0, score 0) replaced by `wrong_answer_score`."""
    wrong = (acc == 0) & (scores == 0)
    return np.where(wrong, wrong_answer_score, scores)
