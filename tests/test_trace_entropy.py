"""The entropy trace: the per-response arrays taken from a Batch, the step statistics and EntropyTrace's files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig
from workers_support import PROMPT_IDS, RESPONSE_IDS, hand_batch

from archer.batch import Batch
from archer.config.loader import load_config
from archer.models.loading import load_tokenizer
from archer.rewards.extras import REWARD_EXTRAS
from archer.trace.entropy import EntropyTrace, response_arrays, step_stats
from archer.trace.format import TraceReader, check_step_arrays
from archer.viz import queries

# Entropies of the three rows (response width 3). Valid tokens (RESPONSE_MASK [[1,1,0],[1,1,1],[1,0,0]]):
# 1.0, 2.0 | 0.5, 0.25, 4.0 | 3.0, all exact in float16; 0.1 and 1/3 sit on padding and get rounded.
ENTROPIES = [[1.0, 2.0, 0.1], [0.5, 0.25, 4.0], [3.0, 1 / 3, 8.0]]
ENTROPIES_F16 = [[1.0, 2.0, 0.0999755859375], [0.5, 0.25, 4.0], [3.0, 0.333251953125, 8.0]]
OLD_LOG_PROBS = [[-0.1, -1 / 3, 0.0], [-0.7, -2.2, -0.5], [-1.0, 0.0, 0.0]]
OLD_LOG_PROBS_F16 = [[-0.0999755859375, -0.333251953125, 0.0], [-0.7001953125, -2.19921875, -0.5],
                     [-1.0, 0.0, 0.0]]
SCORES = [[0.0, 1.0, 0.0], [0.0, 0.25, 0.25], [-1.0, 0.0, 0.0]]   # row sums 1.0, 0.5, -1.0
ADVANTAGES = [[1.0, 3.0, 99.0], [2.0, 4.0, 6.0], [5.0, 99.0, 99.0]]  # 99 on padding must not count
TOOL_TOKENS = [[0, 1, 0], [1, 0, 0], [0, 0, 0]]  # present in the sequence (attention 1), not learned from


def traced_batch(tool_tokens: bool = False) -> Batch:
    batch = hand_batch()
    batch["prompts"] = torch.tensor(PROMPT_IDS)
    batch["entropies"] = torch.tensor(ENTROPIES)
    batch["old_log_probs"] = torch.tensor(OLD_LOG_PROBS)
    batch["token_level_scores"] = torch.tensor(SCORES)
    batch["advantages"] = torch.tensor(ADVANTAGES)
    batch["uid"] = ["u1", "u2", "u1"]
    batch["data_source"] = ["gsm8k", "math", "gsm8k"]
    batch["acc"] = np.array([1.0, 0.0, True], dtype=object)  # the reward manager's: numbers or booleans
    if tool_tokens:
        batch["response_mask"] = batch["response_mask"] * (1 - torch.tensor(TOOL_TOKENS))
    return batch


def test_response_arrays_field_by_field() -> None:
    arrays = response_arrays(traced_batch())
    assert sorted(arrays) == sorted(["entropies", "response_mask", "responses", "response_index", "prompt_length",
                                     "prompts", "uid", "sample_index", "old_log_probs", "reward", "acc",
                                     "advantage", "data_source"])
    expected = {
        "entropies": (np.float16, ENTROPIES_F16),
        "response_mask": (np.bool_, [[True, True, False], [True, True, True], [True, False, False]]),
        "responses": (np.int32, RESPONSE_IDS),
        "response_index": (np.int32, [0, 1, 2]),
        "prompt_length": (np.int32, [2, 4, 3]),
        "prompts": (np.int32, PROMPT_IDS),
        "sample_index": (np.int32, [0, 0, 1]),
        "old_log_probs": (np.float16, OLD_LOG_PROBS_F16),
        "reward": (np.float32, [1.0, 0.5, -1.0]),
        "acc": (np.float32, [1.0, 0.0, 1.0]),
        "advantage": (np.float32, [(1.0 + 3.0) / 2, (2.0 + 4.0 + 6.0) / 3, 5.0]),
    }
    for name, (dtype, values) in expected.items():
        assert arrays[name].dtype == dtype, name
        assert arrays[name].tolist() == values, name
    assert arrays["uid"].dtype.kind == "U" and arrays["uid"].tolist() == ["u1", "u2", "u1"]
    assert arrays["data_source"].dtype.kind == "U" and arrays["data_source"].tolist() == ["gsm8k", "math", "gsm8k"]
    check_step_arrays(arrays, "entropy")


def test_tokens_outside_the_response_mask_are_not_traced_as_learned() -> None:
    arrays = response_arrays(traced_batch(tool_tokens=True))
    # the response mask with the tool tokens cleared; the attention mask still holds them
    assert arrays["response_mask"].tolist() == [[True, False, False], [False, True, True], [True, False, False]]
    assert arrays["advantage"].tolist() == [1.0, (4.0 + 6.0) / 2, 5.0]
    assert arrays["reward"].tolist() == [1.0, 0.5, -1.0]  # the reward is the whole row's score


def tool_batch() -> Batch:
    """traced_batch() of a tool run: row 2 (u1's second response) branched from row 0 at position 2."""
    batch = traced_batch(tool_tokens=True)
    batch["tool_mask"] = torch.tensor(TOOL_TOKENS)
    batch["num_tool_calls"] = [1, 1, 0]
    batch["num_turns"] = [2, 2, 1]
    batch["branch_parent"] = [-1, -1, 0]
    batch["branch_position"] = [-1, -1, 2]
    batch["finish_reason"] = ["eos", "length", "call_limit"]
    return batch


def test_response_arrays_record_the_tool_fields_of_a_tool_run() -> None:
    arrays = response_arrays(tool_batch())
    assert arrays["tool_mask"].dtype == np.bool_
    assert arrays["tool_mask"].tolist() == [[False, True, False], [True, False, False], [False, False, False]]
    assert arrays["response_mask"].tolist() == [[True, False, False], [False, True, True], [True, False, False]]
    for name, values in (("num_tool_calls", [1, 1, 0]), ("num_turns", [2, 2, 1]), ("branch_parent", [-1, -1, 0]),
                         ("branch_position", [-1, -1, 2])):
        assert arrays[name].dtype == np.int32 and arrays[name].tolist() == values, name
    assert arrays["finish_reason"].dtype.kind == "U"
    assert arrays["finish_reason"].tolist() == ["eos", "length", "call_limit"]
    assert arrays["sample_index"].tolist() == [0, 0, 1]  # branch_parent 0 of row 2 is row 0 (u1, sample 0)
    check_step_arrays(arrays, "entropy")
    chosen = response_arrays(tool_batch(), rows=np.array([2, 0]))
    assert chosen["tool_mask"].tolist() == [[False, False, False], [False, True, False]]
    assert chosen["branch_parent"].tolist() == [0, -1] and chosen["branch_position"].tolist() == [2, -1]
    assert chosen["finish_reason"].tolist() == ["call_limit", "eos"]
    check_step_arrays(chosen, "entropy")


def test_response_arrays_record_policy_versions_staleness_and_rejected_tokens() -> None:
    batch = traced_batch()
    batch["policy_version"] = np.array([6, 6, 5])
    batch["first_policy_version"] = np.array([6, 5, 5])  # row 1: a partial rollout resumed under version 6
    batch["staleness"] = np.array([0, 0, 1])
    # the rollout correction took token 1 of row 1 out of the loss (RESPONSE_MASK [[1,1,0],[1,1,1],[1,0,0]])
    batch["rollout_rs_rejected"] = torch.tensor([[False] * 3, [False, True, False], [False] * 3])
    batch["response_mask"] = batch["response_mask"] * ~batch["rollout_rs_rejected"]
    arrays = response_arrays(batch)
    assert arrays["policy_version"].dtype == np.int32 and arrays["policy_version"].tolist() == [6, 6, 5]
    assert arrays["staleness"].dtype == np.int32 and arrays["staleness"].tolist() == [0, 0, 1]
    assert arrays["first_policy_version"].dtype == np.int32 and arrays["first_policy_version"].tolist() == [6, 5, 5]
    # the policy wrote the rejected token: it stays in response_mask, marked in rollout_rs_rejected
    assert arrays["response_mask"].tolist() == [[True, True, False], [True, True, True], [True, False, False]]
    assert arrays["rollout_rs_rejected"].tolist() == [[False] * 3, [False, True, False], [False] * 3]
    assert arrays["advantage"].tolist() == [2.0, 4.0, 5.0], "over the learned tokens: (2 + 6) / 2"
    check_step_arrays(arrays, "entropy")
    assert queries.overview_table(arrays)[["learned_tokens", "rejected_tokens"]].values.tolist() == [
        [2, 0], [2, 1], [1, 0]]


def test_a_run_without_tools_records_no_tool_fields() -> None:
    arrays = response_arrays(traced_batch())
    assert not {"tool_mask", "num_tool_calls", "num_turns", "branch_parent", "branch_position"} & set(arrays)


def test_response_arrays_of_chosen_rows() -> None:
    arrays = response_arrays(traced_batch(), rows=np.array([2, 0]))
    assert arrays["response_index"].tolist() == [2, 0]
    assert arrays["uid"].tolist() == ["u1", "u1"]
    assert arrays["sample_index"].tolist() == [1, 0]  # the index within the whole batch's group
    assert arrays["prompt_length"].tolist() == [3, 2]
    assert arrays["prompts"].tolist() == [PROMPT_IDS[2], PROMPT_IDS[0]]
    assert arrays["responses"].tolist() == [RESPONSE_IDS[2], RESPONSE_IDS[0]]
    assert arrays["entropies"].tolist() == [ENTROPIES_F16[2], ENTROPIES_F16[0]]
    assert arrays["response_mask"].tolist() == [[True, False, False], [True, True, False]]
    assert arrays["reward"].tolist() == [-1.0, 1.0]
    assert arrays["advantage"].tolist() == [5.0, 2.0]
    assert arrays["data_source"].tolist() == ["gsm8k", "gsm8k"]
    check_step_arrays(arrays, "entropy")


def test_response_arrays_without_data_source_or_advantages() -> None:
    batch = traced_batch()
    del batch.rows["data_source"]
    del batch.tensors["advantages"]
    arrays = response_arrays(batch)
    assert arrays["data_source"].tolist() == ["", "", ""]
    assert "advantage" not in arrays


def test_numeric_reward_extras_become_float32_fields() -> None:
    batch = traced_batch()
    batch[REWARD_EXTRAS] = [{"f1": 0.5, "format_ok": True, "note": "a"}, {"format_ok": False, "note": "b"},
                            {"f1": 1 / 3, "format_ok": np.bool_(True)}]
    arrays = response_arrays(batch)
    assert sorted(k for k in arrays if k.startswith("reward_extra/")) == ["reward_extra/f1", "reward_extra/format_ok"]
    assert arrays["reward_extra/f1"].dtype == np.float32
    np.testing.assert_array_equal(arrays["reward_extra/f1"], np.array([0.5, np.nan, 1 / 3], np.float32))
    assert arrays["reward_extra/format_ok"].tolist() == [1.0, 0.0, 1.0]
    check_step_arrays(arrays, "entropy")
    chosen = response_arrays(batch, rows=np.array([1]))  # a row without f1: only the keys the rows hold
    assert [k for k in chosen if k.startswith("reward_extra/")] == ["reward_extra/format_ok"]
    assert chosen["reward_extra/format_ok"].tolist() == [0.0]


def test_step_stats_by_hand() -> None:
    stats = step_stats(response_arrays(traced_batch()))
    valid = [1.0, 2.0, 0.5, 0.25, 4.0, 3.0]  # sorted: 0.25, 0.5, 1, 2, 3, 4
    mean = sum(valid) / 6
    expected = {
        "entropy_mean": 10.75 / 6,
        "entropy_std": math.sqrt(sum((v - mean) ** 2 for v in valid) / 6),
        "entropy_min": 0.25,
        "entropy_max": 4.0,
        "entropy_p50": (1.0 + 2.0) / 2,
        "entropy_p90": 3.0 + 0.5 * (4.0 - 3.0),   # position 0.9 * 5 = 4.5
        "entropy_p99": 3.0 + 0.95 * (4.0 - 3.0),  # position 0.99 * 5 = 4.95
        "reward_mean": (1.0 + 0.5 - 1.0) / 3,
        "response_length_mean": (2 + 3 + 1) / 3,
    }
    assert set(stats) == set(expected)
    for name, value in expected.items():
        assert stats[name] == pytest.approx(value, abs=1e-7), name


def test_step_stats_of_no_responses() -> None:
    stats = step_stats(response_arrays(traced_batch(), rows=np.zeros(0, dtype=np.int64)))
    assert all(math.isnan(stats[f"entropy_{k}"]) for k in ("mean", "std", "min", "max", "p50", "p90", "p99"))
    assert stats["reward_mean"] == 0.0 and stats["response_length_mean"] == 0.0


# -- EntropyTrace ------------------------------------------------------------------------------------------

def trace_config(model_dir: Path, run_dir: Path, *overrides: str) -> DictConfig:
    return load_config("ppo_trainer", [f"actor_rollout_ref.model.path={model_dir}", "data.train_files=x",
                                       f"trainer.default_local_dir={run_dir}", "trainer.entropy_trace.enable=true",
                                       "trainer.project_name=proj", "trainer.experiment_name=exp", *overrides])


def test_entropy_trace_writes_under_the_run_with_the_tokenizer(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    tokenizer = load_tokenizer(tiny_model_dir)
    trace = EntropyTrace(trace_config(tiny_model_dir, run_dir), run_dir, tokenizer)
    trace_dir = run_dir / "entropy_trace"
    assert trace.writer.dir == trace_dir

    summary = json.loads((trace_dir / "summary.json").read_text())
    assert summary["kind"] == "entropy" and summary["format_version"] == 1
    assert summary["project_name"] == "proj" and summary["experiment_name"] == "exp"
    assert summary["model_path"] == str(tiny_model_dir) and summary["run_dir"] == str(run_dir)
    assert summary["algorithm"] == "gae" and summary["loss_mode"] == "vanilla" and summary["rollout_n"] == 1
    assert summary["write_every"] == 1 and summary["tokenizer"] == "tokenizer"
    assert "call_tags" not in summary  # a run without tools
    saved = load_tokenizer(trace_dir / "tokenizer")
    text = "Question: what is 3 + 5? Answer: 8."
    assert saved(text)["input_ids"] == tokenizer(text)["input_ids"]

    batch = tool_batch()
    batch[REWARD_EXTRAS] = [{"f1": 0.5}, {}, {"f1": 0.25}]
    assert trace.record(1, batch) is True
    trace.writer.flush()
    expected = response_arrays(batch)
    assert "reward_extra/f1" in expected  # a field name with a slash survives the npz round trip
    assert {"tool_mask", "branch_parent", "branch_position", "finish_reason"} <= set(expected)
    reader = TraceReader(trace_dir)
    assert reader.steps() == [1] and reader.tokenizer_dir() == (trace_dir / "tokenizer").resolve()
    step = reader.load_step(1)
    assert sorted(step) == sorted(expected)
    for name, array in expected.items():
        assert step[name].dtype == array.dtype, name
        np.testing.assert_array_equal(step[name], array, err_msg=name)  # NaN equals NaN here
    entry = reader.entry(1)
    assert entry["num_responses"] == 3 and entry["response_len"] == 3
    assert entry["num_valid_tokens"] == 4  # the two tool tokens are not the policy's
    for name, value in step_stats(expected).items():
        assert entry[name] == pytest.approx(value, abs=1e-12), name
    assert (trace_dir / "latest_step.txt").read_text() == "1\n"


def test_entropy_trace_records_the_tags_of_the_runs_tool_calls(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    EntropyTrace(trace_config(tiny_model_dir, run_dir), run_dir, None, (("<calc>", "</calc>"), ("<py>", "</py>")))
    summary = TraceReader(run_dir / "entropy_trace").summary
    assert summary["call_tags"] == [["<calc>", "</calc>"], ["<py>", "</py>"]]
    assert queries.call_tags(summary) == (("<calc>", "</calc>"), ("<py>", "</py>"))  # what the explorer marks


def test_entropy_trace_honours_output_dir_and_write_every(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    out = tmp_path / "elsewhere" / "trace"
    cfg = trace_config(tiny_model_dir, run_dir, f"trainer.entropy_trace.output_dir={out}",
                       "trainer.entropy_trace.write_every=2", "trainer.entropy_trace.fsync=true")
    trace = EntropyTrace(cfg, run_dir, load_tokenizer(tiny_model_dir))
    assert trace.writer.dir == out and trace.writer.fsync is True
    assert not (run_dir / "entropy_trace").exists()
    assert [trace.record(step, traced_batch()) for step in (1, 2, 3, 4)] == [False, True, False, True]
    trace.writer.flush()
    reader = TraceReader(out)
    assert reader.steps() == [2, 4] and reader.summary["write_every"] == 2
    assert sorted(p.name for p in (out / "steps").iterdir()) == ["step_000002.npz", "step_000004.npz"]
    assert (out / "tokenizer").is_dir()


def test_response_arrays_of_no_rows_keep_their_types() -> None:
    # an influence step where no prompt group has mixed rewards traces no response
    arrays = response_arrays(traced_batch(), rows=np.zeros(0, dtype=np.int64))
    assert arrays["data_source"].dtype.kind == arrays["uid"].dtype.kind == "U"
    assert arrays["entropies"].shape == (0, 3) and arrays["reward"].shape == (0,)
    check_step_arrays(arrays, "entropy")
