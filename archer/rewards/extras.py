"""Reward extras: what a scorer returns besides ``score`` and ``acc`` (verl's ``reward_extra_info``).

A scorer may return a dict such as ``{"score": .., "acc": .., "f1": .., "format_ok": ..}``; every key other than
score and acc is an extra. The reward manager keeps each row's extras as one dict in the batch field
``reward_extras`` (empty when the scorer returned a number), so they follow the rows through filtering and
concatenation without any stage naming them. The numeric ones (booleans count as 0/1) become columns here, for
metrics and traces; every extra, numeric or not, goes to the generation dumps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

REWARD_EXTRAS = "reward_extras"
CORRECT_AT = 0.5  # a response with acc >= this counts as correct: pass@k (eval) and the health checks' wrong ones


def as_number(value: Any) -> float | None:
    """``value`` as a float when it is a real number (bool, int, float, numpy or one-element torch scalar)."""
    if isinstance(value, str | bytes | complex) or not hasattr(type(value), "__float__"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def numeric_columns(extras: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """One float64 column per numeric extra, in key order, NaN in the rows that lack the key (or hold None).

    A key is numeric when each row's value is a number or absent and at least one row holds a number that is
    not NaN; a key with any other value (a string, a list) is left to the dumps.
    """
    keys = sorted({key for row in extras for key in row})
    columns: dict[str, np.ndarray] = {}
    for key in keys:
        values = [row.get(key) for row in extras]
        numbers = [None if v is None else as_number(v) for v in values]
        if any(n is None and v is not None for n, v in zip(numbers, values)):
            continue
        column = np.array([math.nan if n is None else n for n in numbers], dtype=np.float64)
        if not np.isnan(column).all():
            columns[key] = column
    return columns
