"""Tests of archer.trainer.group_filter (which prompt groups a step trains on) and of the trainer's use of it:
DAPO's dynamic sampling end to end (generation batches, kept groups, trimming, the batch limit) and Archer's
rejection sampling (uniform groups dropped, a step with nothing left does no update), plus the config checks.

The end-to-end runs use rewards that depend only on the prompt's index and on the call count, so which
groups are informative, and so every count, is known in advance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from archer.config.loader import load_config
from archer.errors import ArcherError
from archer.trainer.group_filter import (
    check_filter_metric,
    informative_rows,
    too_many_batches_error,
    uniform_accuracy_rows,
)
from archer.trainer.ppo import PPOTrainer, check_config

REQUIRED = ["actor_rollout_ref.model.path=/no/model", "data.train_files=/no/train.parquet"]


# -- informative_rows ----------------------------------------------------------------------------------------
def test_informative_rows_keeps_mixed_and_single_response_groups() -> None:
    uids = ["a", "a", "b", "b", "c"]
    kept = informative_rows(uids, np.array([1.0, 0.0, 1.0, 1.0, 0.0]))
    assert kept.dtype == bool
    assert kept.tolist() == [True, True, False, False, True]  # a mixed, b all 1, c a single response


def test_informative_rows_of_all_equal_groups_is_empty() -> None:
    assert informative_rows(["a"] * 3 + ["b"] * 2, np.full(5, 0.5)).tolist() == [False] * 5
    assert informative_rows(["a"] * 3, np.array([-1.0, -1.0, -1.0])).tolist() == [False] * 3


def test_informative_rows_groups_non_contiguous_uids() -> None:
    uids = np.array(["x", "y", "x", "y", "z", "x"], dtype=object)
    values = np.array([1.0, 2.0, 1.0, 2.0, 5.0, 3.0])
    # x: 1, 1, 3 (mixed); y: 2, 2 (uniform); z: one response
    assert informative_rows(uids, values).tolist() == [True, False, True, False, True, True]


def test_informative_rows_sees_small_differences_and_takes_lists() -> None:
    assert informative_rows(["g", "g"], [0.25, 0.2500001]).tolist() == [True, True]
    assert informative_rows(["g", "g", "h", "h"], [0, 0, 0, 1]).tolist() == [False, False, True, True]


def test_informative_rows_of_no_rows() -> None:
    out = informative_rows([], np.zeros(0))
    assert out.dtype == bool and out.shape == (0,)


# -- uniform_accuracy_rows -----------------------------------------------------------------------------------
def test_uniform_accuracy_rows_marks_all_zero_and_all_one_groups() -> None:
    uids = ["a", "b", "a", "c", "b", "a", "c", "d", "e", "e"]
    acc = np.array([1, 0, 1, 0, 0, 1, 1, 1, 0.5, 0.5], dtype=float)
    # a: 1 1 1 (uniform), b: 0 0 (uniform), c: 0 1 (mixed), d: one response of 1 (uniform),
    # e: 0.5 0.5 (neither all 0 nor all 1)
    assert uniform_accuracy_rows(uids, acc).tolist() == [True, True, True, False, True, True, False, True,
                                                         False, False]


def test_uniform_accuracy_rows_of_no_rows() -> None:
    out = uniform_accuracy_rows([], np.zeros(0))
    assert out.dtype == bool and out.shape == (0,)


# -- metric check, error -----------------------------------------------------------------------


def test_check_filter_metric() -> None:
    check_filter_metric("acc")
    check_filter_metric("score")
    with pytest.raises(ArcherError, match=r"unknown algorithm.filter_groups.metric 'reward'") as err:
        check_filter_metric("reward")
    assert "acc, score" in str(err.value)


def test_too_many_batches_error_names_the_counts_and_the_fix() -> None:
    err = too_many_batches_error(3, 2, 8)
    assert isinstance(err, ArcherError)
    assert "generated 3 batches" in err.problem and "kept only 2 of the 8 prompt groups" in err.problem
    assert "algorithm.filter_groups.max_num_gen_batches" in err.fix and "data.gen_batch_size" in err.fix


# -- check_config ---------------------------------------------------------------------------------------------
def config(*overrides: str):
    return load_config("ppo_trainer", [*REQUIRED, "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                                       *overrides])


def test_check_config_refuses_an_unknown_filter_metric() -> None:
    with pytest.raises(ArcherError, match="unknown algorithm.filter_groups.metric 'reward'"):
        check_config(config("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=reward"))
    check_config(config("algorithm.filter_groups.metric=reward"))  # not read while the filter is off


def test_check_config_refuses_a_gen_batch_size_without_the_filter() -> None:
    with pytest.raises(ArcherError, match=r"data.gen_batch_size=8 differs from data.train_batch_size=4") as err:
        check_config(config("data.gen_batch_size=8"))
    assert "algorithm.filter_groups.enable=true" in str(err.value)
    check_config(config("data.gen_batch_size=4"))
    check_config(config("data.gen_batch_size=8", "algorithm.filter_groups.enable=true"))
    check_config(config("data.gen_batch_size=2", "algorithm.filter_groups.enable=true"))


# -- end to end -----------------------------------------------------------------------------------------------
# Dynamic sampling: even-index prompts score 1, 0, 1, 0 (mixed accuracy); odd-index prompts score 0.75, 0.5,
# 0.75, 0.5 (accuracy all 1: uniform by acc, mixed by score). The calls of a group of 4 start at an odd count.
PARITY_REWARD = '''
calls = 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    if extra_info["index"] % 2 == 0:
        return float(calls % 2)
    return 0.5 + 0.25 * (calls % 2)
'''

# Rejection sampling over 3 steps of 4 prompts: mixed accuracy for prompts 1, 3, 8, 10; all 1 for 0, 6, 11;
# all 0 for the rest. Step 2 (prompts 4-7) has no mixed group.
REJECTION_REWARD = '''
calls = 0
MIXED, ONES = {1, 3, 8, 10}, {0, 6, 11}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    index = extra_info["index"]
    acc = float(calls % 2) if index in MIXED else float(index in ONES)
    return {"score": acc, "acc": acc}
'''

N = 4
TRAIN_BATCH = 4




@pytest.fixture(scope="module")
def questions(task_files: dict[str, Path]) -> list[str]:
    """The train file's questions in file order (row i has extra_info.index i)."""
    rows = pq.read_table(task_files["train"]).to_pylist()
    assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
    return [r["prompt"][0]["content"] for r in rows]


def train(model: Path, files: dict[str, Path], run: Path, reward_code: str, *extra: str) -> PPOTrainer:
    reward = run.parent / f"{run.name}_reward.py"
    reward.write_text(reward_code)
    cfg = load_config("ppo_trainer", [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={files['train']}", "data.shuffle=false",
        "data.max_prompt_length=32", "data.max_response_length=8", "trainer.device=cpu",
        f"trainer.default_local_dir={run}", "algorithm.adv_estimator=grpo", f"actor_rollout_ref.rollout.n={N}",
        f"data.train_batch_size={TRAIN_BATCH}", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", f"custom_reward_function.path={reward}", "trainer.logger=[jsonl]",
        "trainer.plots=False", f"trainer.rollout_data_dir={run / 'rollouts'}", *extra])
    trainer = PPOTrainer(cfg)
    trainer.fit()
    return trainer


def read_metrics(run: Path) -> dict[int, dict[str, Any]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r.pop("step"): r for r in records}


def dumped_groups(run: Path, step: int) -> list[tuple[str, list[float]]]:
    """(question, scores) of each trained group of the step's rollout dump, in order; groups are n consecutive
    lines."""
    lines = [json.loads(x) for x in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
    lines = [r for r in lines if r["trained"]]
    groups = []
    for start in range(0, len(lines), N):
        group = lines[start:start + N]
        assert len({json.dumps(r["input"]) for r in group}) == 1, "a group's responses share one prompt"
        groups.append((group[0]["input"][0]["content"], [r["score"] for r in group]))
    return groups


DYNAMIC = ["algorithm.filter_groups.enable=true", "data.gen_batch_size=6", "trainer.total_training_steps=2"]


@pytest.mark.slow
def test_dynamic_sampling_by_acc_generates_until_enough_groups_and_trims(micro_model, task_files, questions,
                                                                         tmp_path) -> None:
    run = tmp_path / "by_acc"
    train(micro_model, task_files, run, PARITY_REWARD, *DYNAMIC, "algorithm.filter_groups.metric=acc")
    metrics = read_metrics(run)
    assert sorted(metrics) == [1, 2]
    for step, first in ((1, 0), (2, 12)):
        line = metrics[step]
        # 6 prompts a batch, 3 of them (the even ones) informative: 2 batches for 4 groups, then trimmed
        assert line["train/num_gen_batches"] == 2.0
        assert line["train/num_candidate_groups"] == 12.0
        assert line["train/num_kept_groups"] == 4.0
        assert "train/num_rejected_groups" not in line
        groups = dumped_groups(run, step)
        assert sum(len(scores) for _, scores in groups) == TRAIN_BATCH * N  # exactly train_batch_size * n trained
        assert [q for q, _ in groups] == [questions[first + i] for i in (0, 2, 4, 6)]
        assert all(scores == [1.0, 0.0, 1.0, 0.0] for _, scores in groups)  # every trained group informative
        assert line["critic/score/mean"] == 0.5 and line["critic/acc/mean"] == 0.5
        assert line["actor/grad_norm"] > 0


@pytest.mark.slow
def test_dynamic_sampling_by_score_keeps_groups_whose_score_varies(micro_model, task_files, questions,
                                                                   tmp_path) -> None:
    run = tmp_path / "by_score"
    train(micro_model, task_files, run, PARITY_REWARD, *DYNAMIC, "algorithm.filter_groups.metric=score")
    metrics = read_metrics(run)
    for step, first in ((1, 0), (2, 6)):
        line = metrics[step]
        # every group's score varies: one batch of 6 is enough, trimmed to its first 4 groups
        assert line["train/num_gen_batches"] == 1.0
        assert line["train/num_candidate_groups"] == 6.0
        assert line["train/num_kept_groups"] == 4.0
        groups = dumped_groups(run, step)
        assert [q for q, _ in groups] == [questions[first + i] for i in range(4)]
        assert [scores for _, scores in groups] == [[1.0, 0.0, 1.0, 0.0], [0.75, 0.5, 0.75, 0.5]] * 2


@pytest.mark.slow
def test_dynamic_sampling_stops_at_max_num_gen_batches(micro_model, task_files, tmp_path) -> None:
    run = tmp_path / "limited"
    with pytest.raises(ArcherError) as err:
        train(micro_model, task_files, run, PARITY_REWARD, *DYNAMIC, "algorithm.filter_groups.max_num_gen_batches=1")
    assert ("dynamic sampling generated 1 batches (algorithm.filter_groups.max_num_gen_batches) and kept only 3 "
            "of the 4 prompt groups") in err.value.problem
    assert "raise algorithm.filter_groups.max_num_gen_batches" in err.value.fix
    assert not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").read_text() == ""


@pytest.mark.slow
def test_a_negative_max_num_gen_batches_means_no_limit_as_in_verl(micro_model, task_files, tmp_path) -> None:
    run = tmp_path / "negative_limit"
    train(micro_model, task_files, run, PARITY_REWARD, *DYNAMIC, "algorithm.filter_groups.max_num_gen_batches=-1")
    assert [line["train/num_gen_batches"] for line in read_metrics(run).values()] == [2.0, 2.0]


@pytest.mark.slow
def test_rejection_sampling_drops_uniform_groups_and_skips_an_empty_step(micro_model, task_files, questions,
                                                                         tmp_path) -> None:
    run = tmp_path / "rejection"
    train(micro_model, task_files, run, REJECTION_REWARD, "trainer.rejection_sample=true",
          "trainer.total_training_steps=3", "trainer.save_freq=1")
    metrics = read_metrics(run)
    assert sorted(metrics) == [1, 2, 3]  # training went on after the empty step
    for step, mixed in ((1, [1, 3]), (3, [8, 10])):
        line = metrics[step]
        assert line["train/num_candidate_groups"] == 4.0
        assert line["train/num_rejected_groups"] == 2.0 and line["train/num_kept_groups"] == 2.0
        groups = dumped_groups(run, step)
        assert [q for q, _ in groups] == [questions[i] for i in mixed]  # only the mixed-accuracy groups
        assert all(scores == [1.0, 0.0, 1.0, 0.0] for _, scores in groups)
        assert line["actor/grad_norm"] > 0 and line["critic/acc/mean"] == 0.5

    empty = metrics[2]
    assert empty["train/num_rejected_groups"] == 4.0 and empty["train/num_kept_groups"] == 0.0
    assert not [k for k in empty if k.startswith(("actor/", "critic/"))], empty
    assert empty["training/global_step"] == 2.0
    # every response is dumped, trained or not: the empty step's 16, the others' 8 dropped after their 8 trained
    dumps = {s: [json.loads(x) for x in (run / "rollouts" / f"step_{s}.jsonl").read_text().splitlines()]
             for s in (1, 2, 3)}
    assert [r["trained"] for r in dumps[2]] == [False] * 16
    assert [r["trained"] for r in dumps[1]] == [True] * 8 + [False] * 8
    assert [r["uid"] for r in dumps[1][8:]] == [f"1-{i}" for i in (0, 2) for _ in range(N)]  # prompts 0 and 2
    assert json.loads((run / "summary.json").read_text())["updated_steps"] == 2

    weights = {s: load_file(run / "checkpoints" / f"global_step_{s}" / "actor" / "model.safetensors") for s in (1, 2, 3)}
    assert all(torch.equal(weights[1][k], weights[2][k]) for k in weights[1]), "no update on the empty step"
    assert any(not torch.equal(weights[2][k], weights[3][k]) for k in weights[2])


def test_a_group_of_nan_values_is_not_informative() -> None:
    # std over NaN is NaN, not > 0: a group whose metric is missing everywhere has no signal
    values = np.array([math.nan, math.nan, 1.0, 0.0])
    assert informative_rows(["a", "a", "b", "b"], values).tolist() == [False, False, True, True]


def test_equal_non_binary_scores_are_not_informative() -> None:
    # the mean of three 0.1s is 0.10000000000000002: a spread measured by std would be a rounding error above 0
    assert informative_rows(["a", "a", "a", "b", "b"], np.array([0.1, 0.1, 0.1, 0.3, 0.7])).tolist() == [
        False, False, False, True, True]
