"""bench/update_epoch.py on the CPU: one tiny workload's epoch timed after a warm-up epoch, its record field by
field."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from bench_support import bench_module


def test_a_tiny_epoch_is_timed_after_its_warm_up_and_recorded(tmp_path: Path) -> None:
    with bench_module("update_epoch") as update_epoch:
        argv = ["--shape", "tiny", "--rows", "4", "--repeats", "2", "--workdir", str(tmp_path / "w"),
                "--json", str(tmp_path / "r.json")]
        record = update_epoch.main(argv)
    assert json.loads((tmp_path / "r.json").read_text()) == record
    assert (record["device"], record["torch"], record["shape"], record["workload"]) == ("cpu", torch.__version__,
                                                                                       "tiny", "archer2")
    assert (record["rows"], record["packed"], record["checkpointing"], record["kernels"]) == (4, True, True, "compiled")
    assert record["runs"] == 2 and record["min_s"] <= record["seconds"] <= record["max_s"]
    assert record["real_tokens"] > 16 and record["mfu"] is None and record["peak_gib"] is None
    assert record["command"] == "python bench/update_epoch.py " + " ".join(argv)
