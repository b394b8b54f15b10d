"""Tests of archer.rewards.shaping: DAPO's overlong penalty at hand-computed lengths, the buffer checks, and
the wrong-answer score."""

from __future__ import annotations

import numpy as np
import pytest

from archer.errors import ArcherError
from archer.rewards.shaping import OverlongBuffer, apply_wrong_answer_score

# L_max 20, L_buf 5: no penalty up to 15 tokens, then -(|y| - 15) / 5 * factor.
LENGTHS = np.array([0, 10, 14, 15, 16, 17, 18, 19, 20])


def test_penalty_is_zero_before_the_buffer_and_ramps_to_minus_factor() -> None:
    out = OverlongBuffer(max_length=20, buffer_len=5, penalty_factor=1.0).penalties(LENGTHS)
    assert out.dtype == np.float64 and out.shape == LENGTHS.shape
    np.testing.assert_allclose(out, [0, 0, 0, 0, -0.2, -0.4, -0.6, -0.8, -1.0], atol=1e-12)
    assert not np.any(out > 0)


def test_penalty_scales_with_the_factor() -> None:
    out = OverlongBuffer(20, 5, 0.5).penalties(LENGTHS)
    np.testing.assert_allclose(out, [0, 0, 0, 0, -0.1, -0.2, -0.3, -0.4, -0.5], atol=1e-12)


def test_penalty_of_a_one_token_buffer_and_of_a_list() -> None:
    np.testing.assert_allclose(OverlongBuffer(16, 1, 2.0).penalties(np.array([14, 15, 16])), [0.0, 0.0, -2.0])
    assert OverlongBuffer(16, 4, 1.0).penalties([12, 13, 16]).tolist() == [0.0, -0.25, -1.0]


@pytest.mark.parametrize("buffer_len", [0, -3, 20, 25])
def test_a_buffer_outside_the_response_length_is_refused(buffer_len: int) -> None:
    with pytest.raises(ArcherError, match=rf"reward_model.overlong_buffer.len={buffer_len} must be positive and "
                                          r"smaller than data.max_response_length=20") as err:
        OverlongBuffer(20, buffer_len, 1.0)
    assert "e.g. 5" in err.value.fix  # a quarter of the response length


def test_the_buffer_is_immutable() -> None:
    buffer = OverlongBuffer(20, 5, 1.0)
    with pytest.raises(AttributeError):
        buffer.buffer_len = 6  # type: ignore[misc]


def test_wrong_answer_score_replaces_only_score_zero_and_acc_zero() -> None:
    scores = np.array([0.0, 0.0, 0.1, 1.0, 0.0, -0.5])
    acc = np.array([0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    out = apply_wrong_answer_score(scores, acc, -1.0)
    # row 1: acc 1 (score 0 kept); row 2: format credit 0.1 kept; row 5: already negative, kept
    np.testing.assert_array_equal(out, [-1.0, 0.0, 0.1, 1.0, -1.0, -0.5])
    np.testing.assert_array_equal(scores, [0.0, 0.0, 0.1, 1.0, 0.0, -0.5])  # the input is untouched


def test_wrong_answer_score_of_zero_changes_nothing() -> None:
    scores, acc = np.array([0.0, 1.0]), np.array([0.0, 1.0])
    np.testing.assert_array_equal(apply_wrong_answer_score(scores, acc, 0.0), [0.0, 1.0])
