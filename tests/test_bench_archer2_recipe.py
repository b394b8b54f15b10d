"""bench/archer2_recipe.py: the stage MFU against hand computation, the parameter count of a model folder, and a
tiny run of the recipe on the CPU whose record's MFU is recomputed from the run's own metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_support import BENCH, bench_module
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def recipe():
    with bench_module("archer2_recipe") as module:
        yield module


def test_stage_mfu_is_the_stages_flops_over_their_seconds_on_all_gpus(recipe) -> None:
    lines = [{"timing_s/update_actor": 2.0, "timing_s/old_log_prob": 0.5, "perf/total_num_tokens": 1000},
             {"timing_s/update_actor": 2.0, "timing_s/old_log_prob": 0.5, "perf/total_num_tokens": 3000}]
    got = recipe.stage_mfu(lines, params=10**9, ppo_epochs=2, gpus=2)
    assert set(got) == {"update_actor", "old_log_prob"}  # no reference pass timed
    assert got["update_actor"] == pytest.approx(6 * 2 * 1e9 * 4000 / (4.0 * 2 * 989e12))
    assert got["old_log_prob"] == pytest.approx(2 * 1e9 * 4000 / (1.0 * 2 * 989e12))


def test_parameter_count_counts_tied_weights_once(recipe, tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert recipe.parameter_count(tiny_model_dir) == sum(p.numel() for p in model.parameters())
    assert model.config.tie_word_embeddings


def test_a_tiny_run_records_the_stage_mfu_of_its_own_metrics(recipe, tmp_path: Path) -> None:
    out = tmp_path / "record.json"
    subprocess.run([sys.executable, str(BENCH / "archer2_recipe.py"), "--tiny", "--steps", "2", "--workdir",
                    str(tmp_path / "work"), "--json", str(out)], check=True, timeout=300, capture_output=True)
    record = json.loads(out.read_text())
    lines = [json.loads(line) for line in (tmp_path / "work" / "run" / "metrics.jsonl").read_text().splitlines()]
    steady = [line for line in lines if "timing_s/step" in line][1:]
    assert record["ok"] and len(record["step_s"]) == 2 and record["tokens"][1] == steady[0]["perf/total_num_tokens"]
    assert record["stage_mfu"] == recipe.stage_mfu(steady, record["params"], 1, 1)
    assert set(record["stage_mfu"]) == {"update_actor", "old_log_prob", "ref"}
    assert record["params"] == recipe.parameter_count(tmp_path / "work" / "tiny")
    assert torch.tensor(list(record["stage_mfu"].values())).gt(0).all()
