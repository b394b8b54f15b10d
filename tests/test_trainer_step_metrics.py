"""Step metrics on a hand-built batch, timing metrics, validation mean@n / best@n, and the timer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archer.batch import Batch
from archer.eval.sampling_metrics import validation_metrics
from archer.rewards.extras import REWARD_EXTRAS
from archer.trainer import step_metrics as metrics_module
from archer.trainer.step_metrics import compute_data_metrics, compute_timing_metrics, timer

X = 99.0  # a value under the response mask's zeros: must never reach a metric


def hand_batch(with_values: bool = True, with_acc: bool = True) -> Batch:
    """3 rows, prompts of width 3 (left padded), responses of width 4.

    row 0: prompt length 2, response length 4 (hits max_response_length 4)
    row 1: prompt length 3, response length 2
    row 2: prompt length 1, response length 1
    """
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1],
                                   [1, 1, 1, 1, 1, 0, 0],
                                   [0, 0, 1, 1, 0, 0, 0]])
    tensors = {
        "prompts": torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 4]]),
        "attention_mask": attention_mask,
        "responses": torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0], [7, 0, 0, 0]]),
        "response_mask": attention_mask[:, 3:].clone(),
        "token_level_scores": torch.tensor([[0.0, 0, 0, 1], [0, 0.5, 0, 0], [-1, 0, 0, 0]]),
        "token_level_rewards": torch.tensor([[0.0, 0, -0.1, 0.9], [0, 0.5, 0, 0], [-1.2, 0, 0, 0]]),
        "advantages": torch.tensor([[1.0, 2, 3, 4], [-1, -2, X, X], [0.5, X, X, X]]),
        "returns": torch.tensor([[0.1, 0.2, 0.3, 0.4], [1, 1, X, X], [2, X, X, X]]),
        "entropies": torch.tensor([[0.1, 0.2, 0.3, 0.4], [1, 2, X, X], [3, X, X, X]]),
    }
    if with_values:
        tensors["values"] = torch.tensor([[0.0, 0, 0, 0], [1, 3, X, X], [5, X, X, X]])
    rows = {"acc": [True, False, True]} if with_acc else {}
    return Batch(tensors, rows)


def test_compute_data_metrics_by_hand() -> None:
    m = compute_data_metrics(hand_batch(), max_response_length=4)
    expected = {
        # per-response sums: 1, 0.5, -1
        "critic/score/mean": 0.5 / 3, "critic/score/max": 1.0, "critic/score/min": -1.0,
        # per-response sums: 0.8, 0.5, -1.2
        "critic/rewards/mean": 0.1 / 3, "critic/rewards/max": 0.8, "critic/rewards/min": -1.2,
        # the 7 response tokens: 1 2 3 4 -1 -2 0.5
        "critic/advantages/mean": 7.5 / 7, "critic/advantages/max": 4.0, "critic/advantages/min": -2.0,
        # 0.1 0.2 0.3 0.4 1 1 2
        "critic/returns/mean": 5.0 / 7, "critic/returns/max": 2.0, "critic/returns/min": 0.1,
        # 0 0 0 0 1 3 5
        "critic/values/mean": 9.0 / 7, "critic/values/max": 5.0, "critic/values/min": 0.0,
        "response_length/mean": 7 / 3, "response_length/max": 4.0, "response_length/min": 1.0,
        "response_length/clip_ratio": 1 / 3,
        "prompt_length/mean": 2.0, "prompt_length/max": 3.0, "prompt_length/min": 1.0,
        "critic/acc/mean": 2 / 3,
        # 0.1 0.2 0.3 0.4 1 2 3
        "actor/entropy": 7.0 / 7,
    }
    assert set(m) == set(expected)
    for key, value in expected.items():
        assert m[key] == pytest.approx(value), key


def test_compute_data_metrics_without_values_or_acc() -> None:
    m = compute_data_metrics(hand_batch(with_values=False, with_acc=False), max_response_length=8)
    assert not any(k.startswith("critic/values") for k in m)
    assert "critic/acc/mean" not in m
    assert m["response_length/clip_ratio"] == 0.0
    assert m["critic/advantages/mean"] == pytest.approx(7.5 / 7)


def test_compute_data_metrics_with_no_response_tokens() -> None:
    b = hand_batch(with_acc=False)
    b["response_mask"] = torch.zeros(3, 4, dtype=torch.long)
    b["attention_mask"][:, 3:] = 0
    m = compute_data_metrics(b, max_response_length=4)
    assert m["actor/entropy"] == 0.0
    assert "critic/advantages/mean" not in m and "critic/returns/mean" not in m
    assert (m["response_length/mean"], m["response_length/clip_ratio"]) == (0.0, 0.0)
    assert m["critic/score/mean"] == pytest.approx(0.5 / 3)


def test_every_numeric_reward_extra_gets_a_mean() -> None:
    b = hand_batch()
    b[REWARD_EXTRAS] = [{"f1": 0.5, "format_ok": True, "note": "x"}, {"f1": 0.25, "format_ok": False},
                        {"format_ok": True, "note": "y"}]
    m = compute_data_metrics(b, max_response_length=4)
    extras = {k: v for k, v in m.items() if k.startswith("reward/")}
    # f1 over the two rows that have it; format_ok: True, False, True; "note" is text (dumps only)
    assert extras == {"reward/f1/mean": pytest.approx(0.375), "reward/format_ok/mean": pytest.approx(2 / 3)}
    b[REWARD_EXTRAS] = [{}, {}, {}]
    assert not any(k.startswith("reward/") for k in compute_data_metrics(b, max_response_length=4))


def test_compute_timing_metrics() -> None:
    m = compute_timing_metrics({"gen": 1.5, "adv": 0.5, "step": 4.0}, num_tokens=200)
    assert m == {"timing_s/gen": 1.5, "timing_s/adv": 0.5, "timing_s/step": 4.0,
                 "perf/total_num_tokens": 200.0, "perf/time_per_step": 4.0, "perf/throughput": 50.0}
    # without a "step" entry the stages add up to the step time
    m = compute_timing_metrics({"gen": 1.5, "adv": 0.5}, num_tokens=10)
    assert m["perf/time_per_step"] == 2.0 and m["perf/throughput"] == 5.0
    assert compute_timing_metrics({}, num_tokens=10)["perf/throughput"] == 0.0


def validation_inputs() -> tuple[np.ndarray, ...]:
    # gsm8k: prompt g0 (acc 1, 0), g1 (0, 0); math: m0 (1, 1); uid "x" in both sources stays two groups
    ds = np.array(["gsm8k", "gsm8k", "gsm8k", "gsm8k", "math", "math", "gsm8k", "gsm8k", "math", "math"],
                  dtype=object)
    uid = np.array(["g0", "g0", "g1", "g1", "m0", "m0", "x", "x", "x", "x"], dtype=object)
    acc = np.array([1, 0, 0, 0, 1, 1, 0, 0, 0, 1], dtype=float)
    score = np.array([1.0, -1.0, -1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 2.0])
    return ds, uid, acc, score


def test_validation_metrics_mean_and_best_at_n() -> None:
    m = validation_metrics(*validation_inputs(), n=2)
    expected = {
        "val-core/gsm8k/acc/mean@2": 1 / 6,
        "val-aux/gsm8k/score/mean@2": -1 / 6,
        "val-core/math/acc/mean@2": 3 / 4,
        "val-aux/math/score/mean@2": 4 / 4,
        "val-core/all/acc/mean@2": 4 / 10,
        "val-aux/all/score/mean@2": 3 / 10,
        # best of each prompt's 2 answers: gsm8k g0 1, g1 0, x 0; math m0 1, x 1
        "val-core/gsm8k/acc/best@2/mean": 1 / 3,
        "val-core/math/acc/best@2/mean": 2 / 2,
        "val-core/all/acc/best@2/mean": 3 / 5,
        # the first answer of each prompt: gsm8k 1, 0, 0; math 1, 0
        **{f"val-core/{ds}/acc/best@1/mean": v for ds, v in (("gsm8k", 1 / 3), ("math", 1 / 2), ("all", 2 / 5))},
        # unbiased pass@k with n=2: pass@1 = c/2, pass@2 = (c > 0)
        **{f"val-core/{ds}/acc/pass@1": v for ds, v in (("gsm8k", 1 / 6), ("math", 3 / 4), ("all", 4 / 10))},
        **{f"val-core/{ds}/acc/pass@2": v for ds, v in (("gsm8k", 1 / 3), ("math", 1.0), ("all", 3 / 5))},
    }
    assert set(m) == set(expected)
    for key, value in expected.items():
        assert m[key] == pytest.approx(value), key


def test_validation_metrics_of_reward_extras() -> None:
    ds, uid, acc, score = validation_inputs()
    # f1 only on the gsm8k rows 0-3 and the math rows 4, 5; format_ok everywhere
    f1 = np.array([1.0, 0.5, 0.0, 0.5, 0.25, 0.75, np.nan, np.nan, np.nan, np.nan])
    format_ok = np.array([1, 1, 0, 0, 1, 1, 0, 1, 1, 1], dtype=float)
    m = validation_metrics(ds, uid, acc, score, n=2, extras={"f1": f1, "format_ok": format_ok})
    expected = {
        "val-aux/gsm8k/f1/mean@2": 2.0 / 4, "val-aux/math/f1/mean@2": 1.0 / 2, "val-aux/all/f1/mean@2": 3.0 / 6,
        "val-aux/gsm8k/format_ok/mean@2": 3 / 6, "val-aux/math/format_ok/mean@2": 4 / 4,
        "val-aux/all/format_ok/mean@2": 7 / 10,
    }
    assert set(m) == set(validation_metrics(ds, uid, acc, score, n=2)) | set(expected)
    for key, value in expected.items():
        assert m[key] == pytest.approx(value), key
    only_math = np.where(ds == "math", 1.0, np.nan)
    m = validation_metrics(ds, uid, acc, score, n=2, extras={"steps": only_math})
    assert {k for k in m if "/steps/" in k} == {"val-aux/math/steps/mean@2", "val-aux/all/steps/mean@2"}


def test_validation_metrics_with_one_sample_has_no_best_at_n() -> None:
    ds = np.array(["a", "b", "a"], dtype=object)
    m = validation_metrics(ds, np.array(["0", "1", "2"], dtype=object), np.array([1.0, 0.0, 0.0]),
                           np.array([0.5, 0.0, 1.0]), n=1)
    assert m == pytest.approx({"val-core/a/acc/mean@1": 0.5, "val-aux/a/score/mean@1": 0.75,
                               "val-core/b/acc/mean@1": 0.0, "val-aux/b/score/mean@1": 0.0,
                               "val-core/all/acc/mean@1": 1 / 3, "val-aux/all/score/mean@1": 0.5})


def test_timer_accumulates(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 12.5, 20.0, 21.0, 30.0, 30.25])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    timings: dict[str, float] = {"other": 1.0}
    with timer("gen", timings):
        pass
    with timer("gen", timings):
        pass
    with pytest.raises(RuntimeError), timer("reward", timings):
        raise RuntimeError("boom")
    assert timings == {"other": 1.0, "gen": 3.5, "reward": 0.25}

