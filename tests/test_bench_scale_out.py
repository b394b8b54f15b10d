"""bench/scale_out.py on a CPU: world size 1 with both memory settings on the tiny model (each record checked
against the run's own metrics.jsonl), a configuration that fails recorded with its error, and the table and goal
check from hand-made records."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from bench_support import bench_module
from multi_gpu_support import multi_gpu_refused
from omegaconf import OmegaConf


@pytest.fixture(scope="module")
def so():
    with bench_module("scale_out") as module:
        yield module


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_world_one_records_match_the_runs_metrics(so, tmp_path: Path, capsys) -> None:
    out, work = tmp_path / "scale_out.json", tmp_path / "work"
    argv = ["--tiny", "--gpus", "1", "--steps", "2", "--out", str(out), "--workdir", str(work)]
    returned = so.main(argv)
    records = json.loads(out.read_text())
    assert records == returned and [(r["world_size"], r["setting"]) for r in records] == [(1, "plain"),
                                                                                          (1, "fsdp_offload")]
    for record in records:
        lines = metrics(work / f"world1_{record['setting']}" / "run")
        assert record["ran"] and record["steps"] == 2 and record["timed_steps"] == 1
        assert record["step_s"] == [line["timing_s/step"] for line in lines]
        assert record["tokens"] == [line["perf/total_num_tokens"] for line in lines]
        # the step's tokens: 4 prompts x 4 samples of 32 prompt tokens, plus every response token
        for line in lines:
            assert line["perf/total_num_tokens"] == pytest.approx(16 * 32 + 16 * line["response_length/mean"])
        assert record["tokens_per_s"] == pytest.approx(lines[1]["perf/total_num_tokens"] / lines[1]["timing_s/step"])
        assert record["timed_step_s"] == lines[1]["timing_s/step"] and record["speedup_vs_world1"] == 1.0
        assert record["stages_s"]["gen"] == lines[1]["timing_s/gen"] and "step" not in record["stages_s"]
        assert record["stages_s"]["update_actor"] == lines[1]["timing_s/update_actor"]
        assert record["peak_memory_per_gpu_gb"] is None and record["peak_reserved_per_gpu_gb"] is None  # a CPU
        assert record["cpu_memory_used_gb"] == max(line["perf/cpu_memory_used_gb"] for line in lines)
        assert (record["device"], record["torch"], record["shape"], record["vocab"]) == ("cpu", torch.__version__,
                                                                                         "tiny", None)
        assert (record["prompts"], record["n"], record["prompt_length"], record["response_length"]) == (4, 4, 32, 16)
        assert record["command"] == "python bench/scale_out.py " + " ".join(argv)
        assert datetime.datetime.fromisoformat(record["date"]).tzinfo is not None
        assert record["overrides"][:1] == ["trainer.n_gpus_per_node=1"] and "trainer.device=cpu" in record["overrides"]
        assert ("actor_rollout_ref.actor.fsdp_config.param_offload=true" in record["overrides"]) == \
            (record["setting"] == "fsdp_offload")
        assert "trainer.n_gpus_per_node=1" in record["archer_command"]
    # the run took the setting: the config it recorded has it
    offload = OmegaConf.load(work / "world1_fsdp_offload" / "run" / "config.yaml")
    assert offload.actor_rollout_ref.actor.fsdp_config.param_offload is True
    assert offload.actor_rollout_ref.actor.fsdp_config.optimizer_offload is True
    assert (offload.trainer.n_gpus_per_node, offload.trainer.device) == (1, "cpu")
    printed = capsys.readouterr().out
    plain = records[0]
    assert f"| 1 | plain | {plain['timed_step_s']:.2f} | {plain['tokens'][1]:.0f} | {plain['tokens_per_s']:.1f} | " \
           "1.00x | - (-) |" in printed
    assert "goal" not in printed  # world 2 was not asked for
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_a_failing_configuration_is_recorded_with_its_error(so, tmp_path: Path, capsys) -> None:
    missing = tmp_path / "missing.parquet"
    out = tmp_path / "scale_out.json"
    records = so.main(["--tiny", "--gpus", "1", "--settings", "plain", "--steps", "1", "--out", str(out),
                       "--workdir", str(tmp_path / "work"), "--archer-override", f"data.train_files={missing}"])
    assert json.loads(out.read_text()) == records and len(records) == 1
    record = records[0]
    assert record["ran"] is False and str(missing) in record["error"] and record["speedup_vs_world1"] is None
    assert Path(record["log"]).is_file()
    printed = capsys.readouterr()
    assert f"| 1 | plain | not run: {so.short(record['error'])} | - | - | - | - |" in printed.out
    assert "Traceback" not in printed.out + printed.err
    assert not out.with_suffix(".png").exists()  # nothing ran: no plot


def test_world_two_on_cpu(so, tmp_path: Path, capsys) -> None:
    """Two CPU worker processes (gloo) through archer train: refused with archer's own error until world > 1
    lands, then a run whose record reads like world 1's."""
    out, work = tmp_path / "scale_out.json", tmp_path / "work"
    (two,) = so.main(["--tiny", "--gpus", "2", "--settings", "plain", "--steps", "2", "--out", str(out),
                      "--workdir", str(work)])
    assert (two["world_size"], two["setting"], two["overrides"][0]) == (2, "plain", "trainer.n_gpus_per_node=2")
    if multi_gpu_refused():  # the switch (tests/multi_gpu_support.py)
        assert two["ran"] is False and "archer_command" not in two  # refused by the config check: nothing ran
        assert two["error"].startswith("trainer.n_gpus_per_node=2 cannot be honoured")
        assert "| 2 | plain | not run: trainer.n_gpus_per_node=2 cannot be honoured" in capsys.readouterr().out
        return
    lines = metrics(work / "world2_plain" / "run")
    assert two["ran"] and two["step_s"] == [line["timing_s/step"] for line in lines]
    assert two["tokens_per_s"] == pytest.approx(lines[1]["perf/total_num_tokens"] / lines[1]["timing_s/step"])
    assert two["speedup_vs_world1"] is None  # world 1 was not asked for


def record(world: int, setting: str, tokens_per_s: float | None, error: str = "") -> dict:
    if tokens_per_s is None:
        return {"world_size": world, "setting": setting, "ran": False, "error": error}
    return {"world_size": world, "setting": setting, "ran": True, "tokens_per_s": tokens_per_s, "timed_steps": 2,
            "tokens": [900, 1000, 1000], "timed_step_s": 1000 / tokens_per_s, "peak_memory_per_gpu_gb": 30.25,
            "peak_reserved_per_gpu_gb": 33.0}


def test_speedups_table_and_the_goal_check(so) -> None:
    records = [record(1, "plain", 1000.0), record(1, "fsdp_offload", 800.0), record(2, "plain", 1800.0),
               record(2, "fsdp_offload", None, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")]
    so.add_speedups(records)
    assert [r["speedup_vs_world1"] for r in records] == [1.0, 1.0, 1.8, None]
    assert so.goal_line(records) == "goal (2 GPUs >= 1.7x 1 GPU, plain): 1.80x (met)"
    lines = so.table(records).splitlines()
    assert lines[2] == "| 1 | plain | 1.00 | 1000 | 1000.0 | 1.00x | 30.2 (33.0) |"
    assert lines[4] == "| 2 | plain | 0.56 | 1000 | 1800.0 | 1.80x | 30.2 (33.0) |"
    assert lines[5] == "| 2 | fsdp_offload | not run: torch.OutOfMemoryError: CUDA out of memory | - | - | - | - |"
    records[2]["tokens_per_s"] = 1600.0
    so.add_speedups(records)
    assert so.goal_line(records) == "goal (2 GPUs >= 1.7x 1 GPU, plain): 1.60x (missed)"
    records[0] = record(1, "plain", None, "refused")
    so.add_speedups(records)
    assert so.goal_line(records) == "goal (2 GPUs >= 1.7x 1 GPU, plain): not checked, world 1 did not run"
    assert so.goal_line(records[:2]) is None  # world 2 not asked for


def test_the_workload_is_built_once_and_reused(so, tmp_path: Path) -> None:
    work, console = so.workload_args("tiny"), so.Console(quiet=True)
    model_dir, train_file, reward = so.workload_files(tmp_path, work, 8, console)
    assert pq.read_table(train_file).num_rows == 8 and (model_dir / "config.json").is_file() and reward.is_file()
    stamp = (model_dir / "config.json").stat().st_mtime_ns
    assert so.workload_files(tmp_path, work, 4, console) == (model_dir, train_file, reward)  # fewer prompts: reused
    assert (model_dir / "config.json").stat().st_mtime_ns == stamp
    so.workload_files(tmp_path, work, 12, console)  # more prompts than were built: built again
    assert pq.read_table(train_file).num_rows == 12 and (model_dir / "config.json").stat().st_mtime_ns > stamp


def test_world_sizes_settings_and_device_names(so) -> None:
    work = so.workload_args(so.SHAPE)
    assert so.default_gpus(8, work) == [1, 2, 4, 8] and so.default_gpus(2, work) == [1, 2]
    assert so.default_gpus(0, work) == [1]
    assert so.parse_gpus("2,1, 2") == [1, 2]
    for bad in ("0,1", "one", ""):
        with pytest.raises(Exception, match="--gpus"):
            so.parse_gpus(bad)
    assert so.parse_settings("fsdp_offload,plain") == ["fsdp_offload", "plain"]
    with pytest.raises(Exception, match="pick from plain,fsdp_offload"):
        so.parse_settings("zero3")
    assert so.device_slug("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3" and so.device_slug("cpu") == "cpu"
    assert so.config_overrides(2, "fsdp_offload", tiny=False) == [
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true"]
