"""bench/sft_packing.py on the CPU: the packed batch it builds (long-tailed examples, rows of micro x max_length
tokens) and both variants' record, whose loss and gradient norm agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_support import bench_module


def test_both_attentions_of_a_packed_batch_are_timed_and_agree(tmp_path: Path) -> None:
    with bench_module("sft_packing") as sft_packing:
        items = sft_packing.examples(200, 512, 100, seed=1)
        lengths = sorted(len(item["input_ids"]) for item in items)
        assert lengths[0] >= 16 and lengths[-1] <= 512 and 90 <= lengths[100] <= 170  # median near 512 / 4
        assert all(int(item["loss_mask"].sum()) == len(item["input_ids"]) - len(item["input_ids"]) // 2
                   for item in items)
        argv = ["--shape", "tiny", "--max-length", "128", "--micro", "2", "--examples", "12", "--repeats", "2",
                "--workdir", str(tmp_path / "w"), "--json", str(tmp_path / "r.json")]
        record = sft_packing.main(argv)
    assert json.loads((tmp_path / "r.json").read_text()) == record
    assert record["command"] == "python bench/sft_packing.py " + " ".join(argv)
    assert record["examples"] == 12 and record["rows"] < 12 and record["tokens"] <= record["rows"] * 256
    archer, before = record["variants"].values()
    for got in (archer, before):
        assert got["runs"] == 2 and got["min_s"] <= got["seconds"] <= got["max_s"] and got["mfu"] is None
    assert archer["loss"] == pytest.approx(before["loss"], rel=1e-5)
    assert archer["grad_norm"] == pytest.approx(before["grad_norm"], rel=1e-4)
