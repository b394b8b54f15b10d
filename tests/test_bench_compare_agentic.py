"""bench/compare_agentic.py without training: the methods' configs (ARPO/AEPO scaled to the tool task), the
figures read from a run's metrics.jsonl and summary.json, the tables and the outputs."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import pytest
from bench_support import bench_module

from archer.config.loader import load_config
from archer.errors import ArcherError

ACC = "val-core/archer/tool_arithmetic/acc/mean@1"
RATE = "val-aux/archer/tool_arithmetic/used_tool/mean@1"


@pytest.fixture(scope="module")
def cag():
    with bench_module("compare_agentic") as module:
        yield module


def method_config(cag, name: str):
    args = argparse.Namespace(steps=3, test_freq=1, device="cpu", seed=5)
    shared_overrides = importlib.import_module("compare_algorithms").shared_overrides  # beside compare_agentic
    return load_config("ppo_trainer", [*cag.METHODS[name], "actor_rollout_ref.model.path=m", "data.train_files=t",
                                       *shared_overrides(args, cag.RECIPE.rl_overrides)])


def test_every_method_has_the_task_budget_and_only_arpo_aepo_branch(cag) -> None:
    configs = {name: method_config(cag, name) for name in ("grpo", "arpo", "aepo")}
    for cfg in configs.values():
        rollout = cfg.actor_rollout_ref.rollout
        assert (rollout.n, rollout.tools.call_limit, cfg.data.max_response_length) == (8, 1, 64)
        assert (cfg.data.train_batch_size, cfg.trainer.total_training_steps, cfg.trainer.seed) == (32, 3, 5)
        assert list(rollout.tools.tool_instances) == ["python"]
        assert not cfg.trainer.entropy_trace.enable and not cfg.trainer.influence_trace.enable
        assert not cfg.actor_rollout_ref.actor.use_kl_loss and cfg.actor_rollout_ref.actor.loss_agg_mode == "token-mean"
    grpo, arpo, aepo = (configs[n].actor_rollout_ref.rollout for n in ("grpo", "arpo", "aepo"))
    assert grpo.beam_size == 1 and grpo.initial_rollouts is None
    assert (arpo.initial_rollouts, arpo.beam_size, arpo.enable_dynamic_rollouts) == (4, 2, False)
    assert (arpo.branch_probability, arpo.entropy_weight) == (0.5, 0.2)
    assert (aepo.initial_rollouts, aepo.beam_size, aepo.enable_dynamic_rollouts) == (4, 2, True)
    assert aepo.consecutive_branch_penalty == 0.05
    assert configs["aepo"].actor_rollout_ref.actor.enable_entropy_balanced_advantage


def test_override_value_takes_the_last_and_names_a_missing_key(cag) -> None:
    assert cag.override_value(["a.b=1", "+a.b=2", "c=3"], "a.b") == "2"
    with pytest.raises(ArcherError, match="do not set x.y"):
        cag.override_value(["a.b=1"], "x.y")


def test_parse_methods(cag) -> None:
    assert cag.parse_methods("aepo, grpo,aepo") == ["aepo", "grpo"]
    with pytest.raises(ArcherError, match="unknown methods: ppo") as err:
        cag.parse_methods("grpo,ppo")
    assert err.value.fix == "pick from grpo,arpo,aepo"
    with pytest.raises(ArcherError, match="no method names"):
        cag.parse_methods(" , ")


def write_run(run_dir: Path) -> None:
    records = [
        {"step": 0, ACC: 0.0, RATE: 0.0},
        {"step": 1, "tools/calls_per_response": 0.5, "tools/python/failures": 0.0, "rollout/branches": 10.0,
         "rollout/initial_rollouts": 4.0, "rollout/branch_entropy_mean": 0.3, "reward/used_tool/mean": 0.5,
         "timing_s/step": 20.0, ACC: 0.5, RATE: 0.25},
        {"step": 2, "tools/calls_per_response": 1.0, "tools/python/failures": 2.0, "rollout/branches": 4.0,
         "rollout/initial_rollouts": 5.0, "reward/used_tool/mean": 1.0, "timing_s/step": 10.0},
        {"step": 3, "tools/calls_per_response": 0.75, "tools/python/failures": 1.0, "rollout/branches": 1.0,
         "rollout/initial_rollouts": 6.0, "rollout/branch_entropy_mean": 0.5, "reward/used_tool/mean": 0.75,
         "timing_s/step": 12.0, ACC: 0.95, RATE: 1.0},
    ]
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "summary.json").write_text(json.dumps({"steps": 3, "wall_time_s": 61.4}))


def test_read_run_figures_and_curves(cag, tmp_path: Path) -> None:
    write_run(tmp_path / "run")
    r = cag.read_run(tmp_path / "run")
    assert (r["val_acc_before"], r["val_acc_after"], r["first_step_at_threshold"]) == (0.0, 0.95, 3)
    assert (r["val_tool_call_rate_before"], r["val_tool_call_rate_after"]) == (0.0, 1.0)
    assert (r["wall_time_s"], r["steps"]) == (61.4, 3)
    assert r["step_means"] == {"tools/calls_per_response": 0.75, "tools/python/failures": 1.0,
                               "rollout/initial_rollouts": 5.0, "rollout/branches": 5.0,
                               "rollout/branch_entropy_mean": 0.4, "timing_s/step": 14.0}
    assert r["curves"]["val_acc"] == {"step": [0, 1, 3], "value": [0.0, 0.5, 0.95]}
    assert r["curves"]["val_tool_call_rate"] == {"step": [0, 1, 3], "value": [0.0, 0.25, 1.0]}
    assert r["curves"]["train_tool_call_rate"] == {"step": [1, 2, 3], "value": [0.5, 1.0, 0.75]}


def test_first_step_at(cag) -> None:
    assert cag.first_step_at({0: 0.0, 2: 0.9, 4: 0.8}, 0.9) == 2
    assert cag.first_step_at({0: 0.95}, 0.9) == 0
    assert cag.first_step_at({0: 0.0, 2: 0.5}, 0.9) is None


def test_tables_and_outputs(cag, tmp_path: Path) -> None:
    write_run(tmp_path / "run")
    ok = cag.read_run(tmp_path / "run") | {"load_mean": 3.26}
    results = {"arpo": ok, "aepo": {"status": "failed", "error": "ValueError: bad\nthing", "run_dir": "x"}}
    accuracy = cag.markdown_table(results, cag.ACCURACY_COLUMNS).splitlines()
    assert accuracy[0] == ("| method | val acc before | val acc after | first step val acc >= 0.9 | "
                           "val tool-call rate before | val tool-call rate after | tool calls per response (train) | "
                           "tool failures per step | tool latency s | wall time s | mean load |")
    assert accuracy[2] == "| arpo | 0.000 | 0.950 | 3 | 0.000 | 1.000 | 0.75 | 1 | - | 61 | 3.3 |"
    assert accuracy[3] == "| aepo | failed" + " | -" * 9 + " |"
    rollout = cag.markdown_table({"arpo": ok}, cag.ROLLOUT_COLUMNS).splitlines()
    assert rollout[0].startswith("| method | global samples per prompt | branches per step | refills per step |")
    assert rollout[2] == "| arpo | 5 | 5 | - | - | 0.4 | - | - | - | - | - | 14 |"

    meta = {"device": "CPU", "date": "2026-11-22", "command": "python bench/compare_agentic.py --out x"}
    text = cag.write_outputs(tmp_path, meta, results, cag.tables(results), cag.FIGURE, "t", cag.PANELS)
    assert text == (tmp_path / "results.md").read_text()
    assert text.startswith("device: CPU | date: 2026-11-22 | command: `python bench/compare_agentic.py --out x`\n")
    assert "\n".join(accuracy) in text and text.endswith("failed presets:\n- aepo: ValueError: bad / thing\n")
    assert json.loads((tmp_path / "results.json").read_text())["presets"]["arpo"]["val_acc_after"] == 0.95
    assert (tmp_path / cag.FIGURE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sampled_load_samples_at_start(cag) -> None:
    with cag.sampled_load(every_s=100) as load:
        pass
    assert len(load) == 1 and load[0] >= 0


def test_every_preset_has_its_own_look_in_the_figures(cag) -> None:
    """Styles follow the preset's place among all presets (compare_algorithms.draw_curves): grpo, arpo and aepo
    must not share one."""
    import compare_algorithms as ca

    order = ca.available_presets()
    looks = {(ca.COLOURS[i % len(ca.COLOURS)], ca.LINE_STYLES[i % len(ca.LINE_STYLES)],
              ca.MARKERS[i % len(ca.MARKERS)]) for i in range(len(order))}
    assert {"grpo", "arpo", "aepo"} <= set(order) and len(looks) == len(order)
