"""Reward extras: which values count as numbers, and the numeric columns of per-row extras."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from archer.rewards.extras import as_number, numeric_columns


@pytest.mark.parametrize("value, number", [
    (True, 1.0), (False, 0.0), (np.bool_(True), 1.0), (3, 3.0), (np.int64(-2), -2.0), (0.25, 0.25),
    (np.float32(0.5), 0.5), (torch.tensor(1.5), 1.5), (torch.tensor([2.0]), 2.0),
])
def test_numbers(value: object, number: float) -> None:
    assert as_number(value) == number and type(as_number(value)) is float


@pytest.mark.parametrize("value", ["0.5", b"1", None, [1.0], {"a": 1}, 1j, torch.tensor([1.0, 2.0])])
def test_not_numbers(value: object) -> None:
    assert as_number(value) is None


def test_numeric_columns_by_hand() -> None:
    rows = [
        {"f1": 0.5, "ok": True, "note": "a", "mixed": 1.0, "empty": None},
        {"f1": np.float32(0.25), "ok": False, "mixed": "two", "nan": math.nan},
        {"ok": np.bool_(True), "note": None, "late": 7, "nan": math.nan},
    ]
    columns = numeric_columns(rows)
    # "note" and "mixed" hold text, "empty" no value, "nan" only NaN: none of them is a column
    assert list(columns) == ["f1", "late", "ok"]
    np.testing.assert_array_equal(columns["f1"], [0.5, 0.25, np.nan])
    np.testing.assert_array_equal(columns["late"], [np.nan, np.nan, 7.0])
    np.testing.assert_array_equal(columns["ok"], [1.0, 0.0, 1.0])
    assert all(c.dtype == np.float64 for c in columns.values())
    assert numeric_columns([{}, {}]) == {} and numeric_columns([]) == {}
