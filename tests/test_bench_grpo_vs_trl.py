"""bench/grpo_vs_trl.py without TRL: prompts of an exact token length, the steady-step median, the report table,
and the archer half on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from bench_support import bench_module

from archer.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def gvt():
    with bench_module("grpo_vs_trl") as module:
        yield module


def test_exact_prompts_are_distinct_and_of_the_exact_length(gvt, tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    contents = gvt.exact_prompts(tokenizer, 3, 40)
    assert len(set(contents)) == 3
    for content in contents:
        assert len(gvt.chat_prompt_ids(tokenizer, content)) == 40


def test_steady_drops_the_first_step(gvt) -> None:
    assert gvt.steady([9.0, 2.0, 4.0, 3.0]) == 3.0
    assert gvt.steady([9.0, 2.0]) == 2.0
    assert gvt.steady([7.0]) == 7.0


def test_report_lists_each_peer_and_the_ratio(gvt) -> None:
    records = [
        {"peer": "archer", "steady_step_s": 2.0, "step_s": [9.0, 2.0, 2.0], "response_length_mean": 511.5,
         "stages_s": {"gen": 1.25, "update_actor": 0.5}},
        {"peer": "trl", "steady_step_s": 8.0, "step_s": [10.0, 8.0], "response_length_mean": 512.0,
         "stages_s": {"generate": 7.0, "score": 0.1, "update": 0.9}},
    ]
    lines = gvt.report(records).splitlines()
    assert lines[2] == "| archer | 2.00 | 9.00 | 3 | 511.5 | gen 1.25, update_actor 0.50 |"
    assert lines[3] == "| trl | 8.00 | 10.00 | 2 | 512.0 | generate 7.00, score 0.10, update 0.90 |"
    assert lines[-1] == "archer / trl steady step: 0.250 (goal <= 0.333: met)"
    records[0]["steady_step_s"] = 4.0
    assert gvt.report(records).splitlines()[-1] == "archer / trl steady step: 0.500 (goal <= 0.333: missed)"
    for record in records:  # issue 26's goals for the shapes it names
        record["shape"] = "qwen2.5-1.5b"
    records[0]["steady_step_s"] = 2.1
    assert gvt.report(records).splitlines()[-1] == "archer / trl steady step: 0.263 (goal <= 0.25: missed)"
    records[0]["shape"] = records[1]["shape"] = "qwen2.5-0.5b"
    records[0]["steady_step_s"] = 1.6
    assert gvt.report(records).splitlines()[-1] == "archer / trl steady step: 0.200 (goal <= 0.2: met)"


def test_archer_half_reads_the_run_timings(gvt, tmp_path: Path) -> None:
    args = gvt.workload_args("tiny", out=tmp_path, steps=2, archer_override=[])
    prompt_length = args.prompt_length
    model_dir, contents, train_file, reward = gvt.prepare_workload(tmp_path, args, args.prompts * 2)
    assert len(contents) == 8 and (model_dir / "config.json").is_file()
    assert pq.read_table(train_file).num_rows == 8
    record = gvt.run_archer(args, model_dir, train_file, reward)
    lines = [json.loads(line) for line in (tmp_path / "archer_run" / "metrics.jsonl").read_text().splitlines()]
    assert record["step_s"] == [line["timing_s/step"] for line in lines]
    assert len(record["step_s"]) == 2
    assert record["stages_s"]["gen"] == lines[1]["timing_s/gen"]  # steady: the second step's
    assert record["stages_s"]["update_actor"] == lines[1]["timing_s/update_actor"]
    assert "step" not in record["stages_s"] and "old_log_prob" in record["stages_s"]
    assert record["response_length_mean"] == (lines[0]["response_length/mean"] + lines[1]["response_length/mean"]) / 2
    assert lines[0]["prompt_length/mean"] == prompt_length
