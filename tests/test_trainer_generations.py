"""The rollout / validation dump (ppo.write_generations): every field of every line, extras included."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from archer.batch import Batch
from archer.rewards.extras import REWARD_EXTRAS
from archer.trainer.ppo import write_generations


def test_dump_lines_field_by_field(tmp_path: Path) -> None:
    prompts = [[{"role": "user", "content": "Compute 1+2."}], [{"role": "user", "content": "Compute 2+2."}]]
    batch = Batch({}, {
        "raw_prompt": prompts, "ground_truth": ["3", "4"], "data_source": ["archer/arithmetic", "qa"],
        "acc": np.array([1.0, 0.0]),
        # numpy and torch values become plain JSON; a text extra is kept; "step" clashes with a dump field
        REWARD_EXTRAS: [{"f1": np.float32(0.5), "ok": np.bool_(True), "n": torch.tensor(3), "note": "fine"},
                        {"step": 7, "tags": ["a", "b"]}],
    })
    path = tmp_path / "rollouts" / "step_5.jsonl"
    path.parent.mkdir()
    path.write_text("an older file of the same step\n")
    write_generations(path, batch, ["3", "5"], np.array([1.0, -1.0]), step=5)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {"input": prompts[0], "output": "3", "gts": "3", "score": 1.0, "step": 5, "data_source": "archer/arithmetic",
         "acc": 1.0, "f1": 0.5, "ok": True, "n": 3, "note": "fine"},
        {"input": prompts[1], "output": "5", "gts": "4", "score": -1.0, "step": 5, "data_source": "qa", "acc": 0.0,
         "reward_extra/step": 7, "tags": ["a", "b"]},
    ]
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_5.jsonl"]  # replaced, no temporary left
