"""bench/async_rl.py's arithmetic and records, without running a model: the length distribution it asks the fast
engine for (median and the share at the limit), each mode's and variant's overrides, the table's ratios against
the sync run of the same variant, and a failed run's record."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from statistics import NormalDist

import pytest
from bench_support import bench_module


@pytest.fixture(scope="module")
def ar():
    with bench_module("async_rl") as module:
        yield module


def args(**more) -> argparse.Namespace:
    return argparse.Namespace(**{"response_length": 2048, "prompt_length": 1024, "median_fraction": 0.25,
                                 "at_limit": 0.05, "gpus": 1, "tiny": False, "warmup": 2, "threshold": 3,
                                 "prompts": 16, "n": 8, "recipe": "plain", "tool_rate": 0.5,
                                 "tool_latency_scale": 1.0, **more})


def test_the_drawn_lengths_have_the_asked_median_and_share_at_the_limit(ar) -> None:
    variable, value = ar.length_env(args())
    fields = dict(part.split("=") for part in value.split(","))
    assert variable == "ARCHER_SIMULATED_LENGTHS" and fields["prompt"] == "1024" and float(fields["median"]) == 512
    sigma = float(fields["sigma"])  # P(median * exp(sigma Z) >= 2048) = P(Z >= ln 4 / sigma) = 5%
    assert 1 - NormalDist().cdf(math.log(4) / sigma) == pytest.approx(0.05, abs=1e-4)
    # arpo: the same lengths as scripted turns, a share of whose first turns call the tool
    variable, value = ar.length_env(args(recipe="arpo", tool_rate=0.4))
    turns = dict(part.split("=") for part in value.split(","))
    assert variable == "ARCHER_SIMULATED_TURNS"
    assert turns == {"median": "512", "sigma": fields["sigma"], "limit": "2048", "tool_rate": "0.4"}


def test_the_arpo_recipe_branches_and_calls_the_tools_stand_in(ar) -> None:
    assert ar.recipe_overrides(args()) == []
    assert ar.recipe_overrides(args(recipe="arpo", tool_latency_scale=0.5)) == [
        "+actor_rollout_ref.rollout.tools.tool_instances.python.class_path=agentic_rollout.SandboxLatency",
        "+actor_rollout_ref.rollout.tools.tool_instances.python.params.scale=0.5",
        "actor_rollout_ref.rollout.tools.call_limit=3", "actor_rollout_ref.rollout.initial_rollouts=4",
        "actor_rollout_ref.rollout.beam_size=2", "actor_rollout_ref.rollout.branch_probability=0.5",
        "actor_rollout_ref.rollout.entropy_weight=0.2"]


def test_modes_and_variants_set_the_keys_they_name(ar) -> None:
    sync = ar.mode_overrides("sync", args())
    assert sync == ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=fast"]
    colocated = ar.mode_overrides("colocate_async", args(tiny=True))
    assert colocated[2:] == ["trainer.device=cpu", "trainer.v1.trainer_mode=colocate_async",
                             "trainer.v1.colocate_async.num_warmup_batches=2",
                             "trainer.v1.sampler.max_off_policy_threshold=3"]
    separate = ar.mode_overrides("separate_async", args(gpus=4, rollout_gpus=1, separate_warmup=1, threshold=1))
    assert separate == ["trainer.n_gpus_per_node=3", "actor_rollout_ref.rollout.name=fast",
                        "trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.nnodes=1",
                        "actor_rollout_ref.rollout.n_gpus_per_node=1", "trainer.v1.separate_async.num_warmup_batches=1",
                        "trainer.v1.separate_async.parameter_sync_step=1",
                        "trainer.v1.sampler.max_off_policy_threshold=2"]  # at least the warm-up's lag + 1
    assert ar.VARIANTS["packed"] == ["actor_rollout_ref.model.use_remove_padding=true",
                                     "actor_rollout_ref.actor.use_dynamic_bsz=true"]


def record(mode: str, variant: str, tokens_per_s: float) -> dict:
    return {"mode": mode, "variant": variant, "gpus": 1, "ran": True, "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_gpu": tokens_per_s, "timed_step_s": 20.0, "mfu": 0.12,
            "stages_s": {"gen": 5.0, "old_log_prob": 2.0, "update_actor": 12.0},
            "training/off_policy/trajectory_staleness/mean": 1.5 if mode != "sync" else 0.0,
            "response_length/mean": 700.0}


def test_the_table_compares_each_run_with_sync_of_its_variant(ar, tmp_path: Path) -> None:
    separate = {**record("separate_async", "plain", 16000.0), "stages_s": {"gen": 0.4, "update_weights": 0.125}}
    rows = ar.table([record("sync", "plain", 8000.0), record("colocate_async", "plain", 8800.0),
                     record("sync", "packed", 10000.0), record("colocate_async", "packed", 10300.0),
                     {"mode": "colocate_async", "variant": "plain", "gpus": 4, "ran": False, "error": "oom"}, separate])
    lines = rows.splitlines()
    assert "| colocate_async | plain | 1 | 20.00 s | 8,800 | 1.10x | 12.0% |" in lines[3]
    assert "| colocate_async | packed | 1 | 20.00 s | 10,300 | 1.03x |" in lines[5]
    assert lines[6].startswith("| colocate_async | plain | 4 | not run: oom |")
    assert lines[7].startswith("| separate_async | plain | 1 | 20.00 s | 16,000 | 2.00x | 12.0% | 0.40 s | 0.00 s | "
                               "0.00 s | 0.125 s | 1.50 |")
    assert "| - | 0.00 |" in lines[2]  # sync has no weight sync
    log = tmp_path / "train.log"
    log.write_text("archer: error: the fast engine's KV cache does not fit\n  fix: lower it\n")
    failed = ar.collect(tmp_path, "sync", "plain", ["python", "-m", "archer.cli"], 1, args())
    assert not failed["ran"] and failed["error"].startswith("the fast engine's KV cache does not fit")


@pytest.mark.slow
def test_a_tiny_arpo_run_calls_the_tool_and_branches(ar, tmp_path: Path) -> None:
    """The whole path on the CPU: ``archer train`` with the scripted turns and the tool's stand-in from bench/."""
    [run] = ar.main(["--tiny", "--steps", "2", "--recipe", "arpo", "--modes", "sync", "--tool-latency-scale", "0.01",
                     "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "records.json")])
    assert run["ran"] and run["recipe"] == "arpo"
    lines = [json.loads(line) for line in (tmp_path / "work" / "sync_plain" / "run" / "metrics.jsonl").open()]
    assert all(line["tools/python/calls"] > 0 and line["tools/invalid_calls"] == 0 for line in lines)
    assert sum(line["rollout/branches"] for line in lines) > 0
