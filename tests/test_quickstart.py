"""The quickstart as a user runs it: `archer quickstart` on the CPU, checked against the issue's bar and the health
checks' silence; bad overrides that leave no folder behind; a trainer.default_local_dir override that the summary
and the printed commands follow; `task=tool_arithmetic` picks the tool recipe, whose RL overrides configure the Python tool
and whose summary reports the tool-call rate (the warm start replaced by the test's micro model, so these run
in seconds)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoModelForCausalLM

from archer import cli
from archer.config.loader import load_config
from archer.data.tasks import write_task_files
from archer.errors import ArcherError
from archer.tools import ToolRegistry
from archer.trace.format import TraceReader
from archer.trainer import quickstart
from archer.trainer.config_check import check_config
from archer.trainer.quickstart import (
    RECIPES,
    TOOL_RL_OVERRIDES,
    Recipe,
    parse_quickstart_args,
    run_quickstart,
)

# The suite runs in two pytest-xdist workers on two cores: a quickstart at torch's default of one thread a core beside
# the other worker's tests took 554 s where one thread took 223 s (the same machine, one core kept busy).
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quickstart_learns(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    proc = subprocess.run([sys.executable, "-m", "archer.cli", "quickstart", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("val_acc_before_rl", "val_acc_after_rl", "steps", "wall_time_s", "model_path", "train_files",
                "val_files"):
        assert key in summary
    assert summary["steps"] == 40
    assert summary["val_acc_after_rl"] - summary["val_acc_before_rl"] >= 0.15
    assert summary["wall_time_s"] < 600
    # The files it names live in the run directory and are usable as they are: the RL-trained policy first.
    model_dir = Path(summary["model_path"])
    assert model_dir == out / "rl" / "checkpoints" / "global_step_40" / "actor"
    AutoModelForCausalLM.from_pretrained(model_dir)
    AutoModelForCausalLM.from_pretrained(summary["sft_model_path"])
    assert f"  archer eval model={model_dir} 'benchmark=[{out / 'data' / 'val_benchmark.yaml'}]' " in proc.stdout  # quoted for the shell
    assert pq.read_table(summary["train_files"][0]).num_rows == 1000
    assert pq.read_table(summary["val_files"][0]).num_rows == 200
    assert (out / "rl" / "metrics.jsonl").is_file() and list((out / "rl" / "plots").glob("*.png"))
    assert "validation accuracy before RL" in proc.stdout
    assert "archer train actor_rollout_ref.model.path=" in proc.stdout
    # Both traces cover every GRPO step, and the command to explore them is printed.
    for kind in ("entropy_trace", "influence_trace"):
        reader = TraceReader(summary[kind])
        assert reader.steps() == list(range(1, 41)) and reader.tokenizer_dir() is not None
    assert f"archer viz --trace-dir {summary['influence_trace']}" in proc.stdout
    assert_no_health_warning(out / "rl", proc.stderr)
    # The printed RL stage's first 20 steps, repeated with generation one batch ahead of training (colocate_async:
    # responses one policy version old), still learn: >= 15 points (0.000 -> 0.315 at step 20 on 2026-11-27; 0.265
    # after all 40, where sync reaches 0.710). Without the traces and half the steps: 36 s instead of 75.
    repeat = next(line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("archer train "))
    words = [w for w in shlex.split(repeat)[1:]
             if not w.startswith(("trainer.default_local_dir=", "trainer.entropy_trace.", "trainer.influence_trace.",
                                  "trainer.total_training_steps="))]
    again = tmp_path / "async"
    proc = subprocess.run([sys.executable, "-m", "archer.cli", *words, "trainer.total_training_steps=20",
                           "trainer.v1.trainer_mode=colocate_async", f"trainer.default_local_dir={again}"],
                          capture_output=True, text=True, timeout=600, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    async_summary = json.loads((again / "summary.json").read_text())
    key = "val-core/archer/arithmetic/acc/mean@1"
    assert async_summary["val_after"][key] - async_summary["val_before"][key] >= 0.15
    last = json.loads((again / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["training/off_policy/trajectory_staleness/mean"] >= 1.0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_tool_quickstart_learns_to_call_the_tool(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    proc = subprocess.run([sys.executable, "-m", "archer.cli", "quickstart", "task=tool_arithmetic", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "tool_arithmetic" and summary["steps"] == 20
    assert summary["val_acc_after_rl"] - summary["val_acc_before_rl"] >= 0.15
    assert summary["val_tool_call_rate_after_rl"] > summary["val_tool_call_rate_before_rl"]
    assert summary["wall_time_s"] < 480
    assert "tool-call rate before RL" in proc.stdout
    assert_no_health_warning(out / "rl", proc.stderr)


def assert_no_health_warning(rl: Path, stderr: str) -> None:
    """A healthy run: the health checks ran at every step and raised no warning (docs/health.md)."""
    flags = [json.loads(line) for line in (rl / "health.jsonl").read_text().splitlines()]
    assert [f for f in flags if f["severity"] != "info"] == []
    assert "WARNING archer.health" not in stderr and "ERROR archer.health" not in stderr
    metrics = [json.loads(line) for line in (rl / "metrics.jsonl").read_text().splitlines()]
    assert all("health/flags" in m for m in metrics if m["step"] >= 1)


def test_bad_overrides_leave_no_out_folder_behind(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    proc = subprocess.run([sys.executable, "-m", "archer.cli", "quickstart", "--out", str(out), "bad.key=1"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2 and "unknown config key 'bad.key'" in proc.stderr
    assert not out.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ArcherError, match="actor_rollout_ref.rollout.n=0 must be an integer of at least 1"):
        run_quickstart(["actor_rollout_ref.rollout.n=0"], out_dir=str(mine))
    assert [(p.name, p.read_text()) for p in mine.iterdir()] == [("notes.txt", "keep me")]


def test_a_default_local_dir_override_moves_the_rl_run_and_everything_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        task_files: dict[str, Path], micro_model: Path) -> None:
    def warm_start(run: Path, seed: int, console, sft_extra=(), recipe: Recipe = RECIPES["arithmetic"]
                   ) -> tuple[dict[str, Path], Path]:
        assert recipe.task == "arithmetic"
        (run / "data").mkdir(parents=True)
        files = {split: Path(shutil.copy(task_files[split], run / "data" / f"{split}.parquet")) for split in ("train", "val")}
        return files, micro_model  # the conftest's task and micro model stand for steps 1-3

    monkeypatch.setattr(quickstart, "warm_start", warm_start)
    reward = tmp_path / "digit_share.py"  # rewards that differ within a group, so the influence trace has rows
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n")
    out, rl_dir = tmp_path / "qs", tmp_path / "elsewhere" / "rl_run"
    summary = run_quickstart([f"trainer.default_local_dir={rl_dir}", f"custom_reward_function.path={reward}",
                              "data.train_batch_size=4",
                              "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "trainer.total_training_steps=1", "trainer.device=cpu",
                              "+trainer.influence_trace.projection_dim_factor=16"], out_dir=str(out))
    assert summary["rl_run_dir"] == str(rl_dir)
    assert summary["entropy_trace"] == str(rl_dir / "entropy_trace")
    assert summary["influence_trace"] == str(rl_dir / "influence_trace")
    assert json.loads((out / "summary.json").read_text()) == summary
    assert [r["step"] for r in map(json.loads, (rl_dir / "metrics.jsonl").read_text().splitlines())] == [0, 1]
    for kind in ("entropy_trace", "influence_trace"):
        assert TraceReader(summary[kind]).steps() == [1]
    assert not (out / "rl").exists()
    printed = capsys.readouterr().out
    assert f"  archer viz --trace-dir {rl_dir / 'influence_trace'}\n" in printed
    repeat = next(line for line in printed.splitlines() if line.startswith("  archer train "))
    assert repeat.count("trainer.default_local_dir=") == 1
    assert repeat.endswith(f" trainer.default_local_dir={tmp_path / 'elsewhere' / 'rl_run_again'}")


def test_task_picks_the_recipe_and_an_unknown_task_is_an_error() -> None:
    assert parse_quickstart_args(["a.b=1"]) == (1, RECIPES["arithmetic"], ["a.b=1"])
    assert parse_quickstart_args(["task=tool_arithmetic", "seed=2", "a.b=1"]) == (2, RECIPES["tool_arithmetic"],
                                                                                   ["a.b=1"])
    with pytest.raises(ArcherError) as err:
        parse_quickstart_args(["task=sudoku"])
    assert "no task 'sudoku'" in err.value.problem and "['arithmetic', 'tool_arithmetic']" in err.value.problem


def test_the_tool_recipe_configures_the_python_tool() -> None:
    cfg = load_config("ppo_trainer", ["actor_rollout_ref.model.path=/m", "data.train_files=/t.parquet",
                                      *TOOL_RL_OVERRIDES])
    check_config(cfg)
    tools = cfg.actor_rollout_ref.rollout.tools
    assert tools.call_limit == 1 and cfg.data.max_response_length == 64 and cfg.trainer.total_training_steps == 20
    registry = ToolRegistry.from_config(tools)
    try:
        assert list(registry.tools) == ["python"] and registry.stop_strings == ["</python>"]
    finally:
        registry.close()
    recipe = RECIPES["tool_arithmetic"]
    assert recipe.task == "tool_arithmetic" and 0 < recipe.knobs["tool_fraction"] < 0.5
    assert "data.tool_result_tag=result" in recipe.sft_overrides


def test_the_tool_quickstart_reports_the_tool_call_rate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture, micro_model: Path) -> None:
    def warm_start(run: Path, seed: int, console, sft_extra=(), recipe: Recipe = RECIPES["arithmetic"]
                   ) -> tuple[dict[str, Path], Path]:
        assert recipe.task == "tool_arithmetic"
        files = write_task_files(recipe.task, run / "data", n_train=4, n_val=4, n_sft=1, seed=seed, **recipe.knobs)
        return files, micro_model  # the conftest's micro model stands for the warm start

    monkeypatch.setattr(quickstart, "warm_start", warm_start)
    summary = run_quickstart(["task=tool_arithmetic", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=1",
                              "trainer.device=cpu", "trainer.entropy_trace.enable=false",
                              "trainer.influence_trace.enable=false"], out_dir=str(tmp_path / "qs"))
    assert summary["task"] == "tool_arithmetic"
    metrics = [json.loads(line) for line in (tmp_path / "qs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    rate = "val-aux/archer/tool_arithmetic/used_tool/mean@1"
    assert summary["val_tool_call_rate_before_rl"] == metrics[0][rate]
    assert summary["val_tool_call_rate_after_rl"] == metrics[-1][rate]
    assert summary["val_acc_before_rl"] == metrics[0]["val-core/archer/tool_arithmetic/acc/mean@1"]
    assert "tool-call rate before RL: " in capsys.readouterr().out


MICRO_RL = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.total_training_steps=1", "trainer.device=cpu", "trainer.entropy_trace.enable=false",
            "trainer.influence_trace.enable=false"]


@pytest.fixture()
def micro_quickstart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                     task_files: dict[str, Path], micro_model: Path) -> tuple[Path, dict, str]:
    """A one-step quickstart whose steps 1-3 are the conftest's task files and micro model, put where the real
    ones go: its folder, summary and printed output."""
    def warm_start(run: Path, seed: int, console, sft_extra=(), recipe: Recipe = RECIPES["arithmetic"]
                   ) -> tuple[dict[str, Path], Path]:
        (run / "data").mkdir(parents=True)
        files = {split: Path(shutil.copy(task_files[split], run / "data" / f"{split}.parquet")) for split in ("train", "val")}
        return files, Path(shutil.copytree(micro_model, run / "sft" / "hf_model"))

    monkeypatch.setattr(quickstart, "warm_start", warm_start)
    out = tmp_path / "qs"
    summary = run_quickstart(MICRO_RL, out_dir=str(out))
    return out, summary, capsys.readouterr().out


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"dir" for p in sorted(folder.rglob("*"))}


def test_the_quickstart_saves_its_rl_policy_and_the_printed_eval_command_evaluates_it(
        micro_quickstart: tuple[Path, dict, str]) -> None:
    out, summary, printed = micro_quickstart
    policy = out / "rl" / "checkpoints" / "global_step_1" / "actor"
    assert summary["model_path"] == str(policy) and summary["sft_model_path"] == str(out / "sft" / "hf_model")
    AutoModelForCausalLM.from_pretrained(policy)
    command = next(line.strip() for line in printed.splitlines() if line.startswith("  archer eval "))
    assert "evaluate the RL-trained policy on the validation set with:" in printed
    argv = shlex.split(command)
    assert argv[0] == "archer" and f"model={policy}" in argv and f"output_dir={out / 'eval'}" in argv
    assert cli.main(argv[1:]) == 0
    results = json.loads((out / "eval" / "results.json").read_text())
    assert results["model"] == str(policy) and results["benchmarks"]["val_benchmark"]["problems"] == 4
    # greedy on the validation prompts with the RL stage's lengths: the figure validation gave after RL
    assert results["metrics"]["val-core/val_benchmark/acc/mean@1"] == summary["val_acc_after_rl"]


def test_a_quickstart_rerun_into_its_folder_changes_nothing_and_other_settings_are_refused(
        micro_quickstart: tuple[Path, dict, str], capsys: pytest.CaptureFixture) -> None:
    out, summary, first = micro_quickstart
    before = folder_bytes(out)
    assert run_quickstart(MICRO_RL, out_dir=str(out)) == summary
    again = capsys.readouterr().out
    assert f"the quickstart in {out} has finished; nothing to do" in again
    assert first.split("quickstart done")[1].split("\n", 1)[1] in again  # the same figures and commands
    with pytest.raises(ArcherError) as err:
        run_quickstart(["seed=2", *MICRO_RL], out_dir=str(out))
    assert err.value.problem.startswith(f"{out / 'rl'} holds another experiment") and "trainer.seed" in err.value.problem
    assert err.value.fix.startswith("give this quickstart another --out DIR")
    assert folder_bytes(out) == before


def test_quickstart_help_names_the_folder_it_makes(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        cli.main(["quickstart", "--help"])
    assert "(default: the latest unfinished runs/quickstart/<date>-<time>, continued, else a new one)" in " ".join(capsys.readouterr().out.split())


def test_a_quickstart_started_with_relative_paths_records_absolute_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task_files: dict[str, Path], micro_model: Path) -> None:
    def warm_start(run: Path, seed: int, console, sft_extra=(), recipe: Recipe = RECIPES["arithmetic"]
                   ) -> tuple[dict[str, Path], Path]:
        (run / "data").mkdir(parents=True)
        files = {split: Path(shutil.copy(task_files[split], run / "data" / f"{split}.parquet")) for split in ("train", "val")}
        return files, Path(shutil.copytree(micro_model, run / "sft" / "hf_model"))

    monkeypatch.setattr(quickstart, "warm_start", warm_start)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")  # started here, with paths relative to it
    summary = run_quickstart([*MICRO_RL, "trainer.entropy_trace.enable=true",
                              "trainer.default_local_dir=../elsewhere/rl"], out_dir="../qs")
    out, rl = tmp_path / "qs", tmp_path / "elsewhere" / "rl"
    monkeypatch.chdir(tmp_path)  # read from another directory
    recorded = json.loads((out / "summary.json").read_text())
    assert recorded == summary
    assert recorded["run_dir"] == str(out) and recorded["rl_run_dir"] == str(rl)
    assert recorded["model_path"] == str(rl / "checkpoints" / "global_step_1" / "actor")
    assert recorded["sft_model_path"] == str(out / "sft" / "hf_model")
    assert recorded["train_files"] == [str(out / "data" / "train.parquet")]
    assert recorded["val_files"] == [str(out / "data" / "val.parquet")]
    assert recorded["val_benchmark"] == str(out / "data" / "val_benchmark.yaml")
    assert recorded["entropy_trace"] == str(rl / "entropy_trace") and recorded["influence_trace"] is None
    rl_summary = json.loads((rl / "summary.json").read_text())  # the RL run's own summary, written by archer train
    assert rl_summary["run_dir"] == str(rl) and rl_summary["model_path"] == str(out / "sft" / "hf_model")
    assert rl_summary["latest_checkpoint"] == recorded["model_path"]
    assert rl_summary["train_files"] == recorded["train_files"] and rl_summary["val_files"] == recorded["val_files"]


def test_without_out_a_quickstart_continues_the_newest_unfinished_folder(tmp_path: Path) -> None:
    root = tmp_path / "runs" / "quickstart"
    assert quickstart.default_run_folder(root).parent == root  # no folder yet: a new one
    for name in ("20261201-100000", "20261203-100000", "notes"):
        (root / name).mkdir(parents=True)
    assert quickstart.default_run_folder(root) == root / "20261203-100000"  # the newest, unfinished
    (root / "20261203-100000" / "summary.json").write_text("{}")
    new = quickstart.default_run_folder(root)  # the newest has finished: a new one, never an older one
    assert quickstart.RUN_NAME.fullmatch(new.name) and not new.exists() and new.parent == root
    assert quickstart.resume_command(Path("/r un"), ["seed=2"]) == "archer quickstart --out '/r un' seed=2"


# A quickstart whose steps 1-3 are the conftest's task files and micro model (argv: train, val, model, overrides).
INTERRUPTIBLE = """import shutil, sys
from pathlib import Path
from archer import cli
from archer.trainer import quickstart
train, val, model, *overrides = sys.argv[1:]
def warm_start(run, seed, console, sft_extra=(), recipe=None):
    (run / "data").mkdir(parents=True, exist_ok=True)
    files = {"train": Path(shutil.copy(train, run / "data" / "train.parquet")),
             "val": Path(shutil.copy(val, run / "data" / "val.parquet"))}
    hf = run / "sft" / "hf_model"
    return files, hf if hf.is_dir() else Path(shutil.copytree(model, hf))
quickstart.warm_start = warm_start
sys.exit(cli.main(["quickstart", *overrides]))
"""


@pytest.mark.timeout(600)
def test_an_interrupted_quickstart_prints_its_command_and_a_rerun_without_out_continues_it(
        tmp_path: Path, task_files: dict[str, Path], micro_model: Path) -> None:
    script = tmp_path / "qs.py"
    script.write_text(INTERRUPTIBLE)
    overrides = [*(o for o in MICRO_RL if not o.startswith("trainer.total_training_steps=")),
                 "trainer.total_training_steps=30", "trainer.save_freq=1", "trainer.test_freq=-1"]
    argv = [sys.executable, str(script), str(task_files["train"]), str(task_files["val"]), str(micro_model), *overrides]
    env = {**ONE_THREAD, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    root = tmp_path / "runs" / "quickstart"
    deadline = time.monotonic() + 300
    while not list(root.glob("*/rl/checkpoints/global_step_1")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    [run] = list(root.iterdir())
    command = f"archer quickstart --out {run} {' '.join(overrides)}"
    assert (f"the quickstart in {run} stopped; continue it with: {command} (or the same command without --out)"
            in err.splitlines()), err[-3000:]
    saved = max(int(p.name.rsplit("_", 1)[1]) for p in (run / "rl" / "checkpoints").glob("global_step_*"))
    assert saved < 30
    # the same command again, without --out: the same folder, from its last checkpoint
    again = subprocess.run(argv[:5] + [*overrides[:-3], "trainer.total_training_steps=" + str(saved + 2),
                                       *overrides[-2:]], cwd=tmp_path, env=env, text=True, capture_output=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"continuing the unfinished quickstart in {run} (--out DIR starts another)" in again.stdout
    assert list(root.iterdir()) == [run]
    steps = [json.loads(line)["step"] for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, *range(1, saved + 3)]  # validation at 0, every step once
    assert json.loads((run / "summary.json").read_text())["steps"] == saved + 2
