"""bench/weight_sync.py on gloo processes (2 trainer ranks, 1 rollout rank, the tiny shape, buckets of 10 KiB):
both ways of making the buckets are timed, the bytes are the model's parameters in bf16, and the rollout rank
ends holding exactly the policy's weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from bench_support import BENCH, bench_module

from archer.models.lora import policy_weights


def test_both_paths_deliver_the_policy_to_the_rollout_rank(tmp_path: Path) -> None:
    out = tmp_path / "ws.json"
    subprocess.run([sys.executable, str(BENCH / "weight_sync.py"), "--shape", "tiny", "--device", "cpu",
                    "--trainer-ranks", "2", "--rollout-ranks", "1", "--repeats", "2", "--bucket-mb", "0.01",
                    "--json", str(out)], check=True, timeout=240, cwd=tmp_path)
    record = json.loads(out.read_text())
    with bench_module("weight_sync") as ws:
        model = ws.build(ws.argparse.Namespace(shape="tiny"), torch.device("cpu"))
    weights = list(policy_weights(model, torch.bfloat16))
    assert [row["path"] for row in record["rows"]] == ["per_tensor", "bucket_gather"]
    for row in record["rows"]:
        assert row["gb"] == sum(t.numel() for _, t in weights) * 2 / 1e9
        assert 0 < row["min_s"] <= row["median_s"] <= row["max_s"]
    assert record["received_sum"] == float(sum(t.float().sum() for _, t in weights))
    assert (record["trainer_ranks"], record["rollout_ranks"], record["device"]) == (2, 1, "cpu")
