"""bench/model_sizes.py on a CPU: a row that runs (the tiny shape), a row archer refuses reported as "not run" with
the error, and the table."""

from __future__ import annotations

import argparse

import pytest
from bench_support import bench_module


@pytest.fixture(scope="module")
def ms():
    with bench_module("model_sizes") as module:
        yield module


def test_a_row_that_runs_and_one_that_archer_refuses(ms, tmp_path):
    args = argparse.Namespace(out=tmp_path, steps=2, row_timeout=600.0)
    ran = ms.archer_row(args, "tiny", "tiny", [])
    assert ran["ran"] and ran["settings"] == ["defaults"] and len(ran["step_s"]) == 2
    assert ran["steady_step_s"] == ran["step_s"][1]
    assert set(ran["peak_allocated_gb"]) == set(ms.STAGES) and ran["cpu_memory_used_gb"] > 0
    refused = ms.archer_row(args, "tiny-tp2", "tiny", ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    assert refused["ran"] is False and "command" not in refused  # refused by the config check: nothing built
    assert refused["error"].startswith("actor_rollout_ref.rollout.tensor_model_parallel_size=2 cannot be honoured")
    assert "fix:" in refused["error"] and "tensor_model_parallel_size=1" in refused["error"]


def test_failure_picks_archers_error_or_the_last_line(ms):
    assert ms.failure("INFO x\narcher: error: bad key\n  fix: use another\n") == "bad key fix: use another"
    assert ms.failure("Traceback\n  ...\ntorch.OutOfMemoryError: CUDA out of memory\n") == \
        "torch.OutOfMemoryError: CUDA out of memory"


def test_table(ms):
    records = [
        {"model": "qwen2.5-0.5b", "peer": "archer", "settings": ["defaults"], "ran": True, "steady_step_s": 2.0,
         "peak_allocated_gb": {"gen": 40.0, "old_log_prob": 8.0, "adv": 7.0, "update_actor": 20.0},
         "max_memory_allocated_gb": 41.0},
        {"model": "qwen2.5-0.5b", "peer": "trl", "ran": True, "steady_step_s": 10.0, "max_memory_allocated_gb": 18.7},
        {"model": "qwen2.5-7b", "peer": "archer", "settings": ms.LORA, "ran": False, "error": "no LoRA"},
    ]
    lines = ms.table(records).splitlines()
    assert lines[2] == "| qwen2.5-0.5b | defaults | ran | 2.00 | 40.0 / 8.0 / 20.0 (41.0) | 10.00 (18.7) | 0.20 |"
    assert lines[3] == "| qwen2.5-7b | lora_rank=64, lora_alpha=32 | not run: no LoRA | - | - | - | - |"
