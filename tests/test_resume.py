"""Crash and resume of the RL trainer (trainer.resume_mode=auto).

A GRPO run killed with SIGKILL after its step-3 checkpoint and relaunched must log exactly the metrics of
an uninterrupted run with the same seed and end with the same weights: model, optimiser, LR schedule,
adaptive KL coefficient, RNG and data position (shuffled, wrapping into a second epoch) all resume.
The in-process tests check what `resume()` restores field by field, and that a run dying right after a
checkpoint commits keeps that step's metrics line. trainer.val_only validates the checkpoint resume_mode names
and leaves every file of the run as it was; an auto-resumed run never replaces metrics it cannot resume.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from archer import cli
from archer.config.loader import load_config
from archer.data.tasks import write_task_files
from archer.errors import ArcherError
from archer.models.tiny import build_tiny_model
from archer.trace.format import TraceReader
from archer.trainer.checkpoint_dirs import CheckpointManager
from archer.trainer.ppo import PPOTrainer

TOTAL_STEPS = 6
CRASH_AFTER = 3
WAIT_S = 180.0
TIME_BASED = ("timing_s/", "perf/")
DELAY_ENV = "RESUME_TEST_REWARD_DELAY_S"

# Dense and deterministic, so GRPO groups have non-zero advantages from the first step: the share of
# digit characters in the response. The optional sleep only slows the run that is going to be killed.
REWARD_SOURCE = f'''
import os
import time

DELAY_S = float(os.environ.get("{DELAY_ENV}", "0"))


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(DELAY_S)
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """16 arithmetic train prompts (4 batches of 4: step 5 is in the second epoch), 8 val, a micro model."""
    root = tmp_path_factory.mktemp("resume_task")
    files = write_task_files("arithmetic", root / "data", n_train=16, n_val=8, n_sft=8, seed=0, max_operand=9)
    corpus: list[str] = []
    for name in ("train", "val"):
        for row in pq.read_table(files[name]).to_pylist():
            corpus += [row["prompt"][0]["content"], row["extra_info"]["solution"]]
    for row in pq.read_table(files["sft"]).to_pylist():
        corpus += [row["prompt"][0]["content"], row["response"]]
    model = build_tiny_model(root / "model", corpus, hidden_size=64, num_layers=2, intermediate_size=128, seed=0)
    reward = root / "reward.py"
    reward.write_text(REWARD_SOURCE)
    return {"train": files["train"], "val": files["val"], "model": model, "reward": reward}


def overrides(task: dict[str, Path], run_dir: Path) -> list[str]:
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.05",
        "algorithm.kl_ctrl.horizon=100",
        f"actor_rollout_ref.model.path={task['model']}",
        f"data.train_files={task['train']}",
        f"data.val_files={task['val']}",
        f"custom_reward_function.path={task['reward']}",
        "data.train_batch_size=4",
        "data.max_prompt_length=32",
        "data.max_response_length=16",
        "data.shuffle=true",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.optim.warmup_style=cosine",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
        f"trainer.total_training_steps={TOTAL_STEPS}",
        "trainer.save_freq=1",
        "trainer.test_freq=3",
        "trainer.val_before_train=true",
        "trainer.logger=[jsonl]",
        "trainer.plots=false",
        "trainer.device=cpu",
        f"trainer.default_local_dir={run_dir}",
        "+trainer.entropy_trace.enable=True",
        "+trainer.influence_trace.enable=True",
        "+trainer.influence_trace.projection_dim_factor=16",
    ]


def train_command(task: dict[str, Path], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "archer.cli", "train", *overrides(task, run_dir)]


def train_env(reward_delay_s: float = 0.0) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            DELAY_ENV: str(reward_delay_s)}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def latest_step_named(run_dir: Path) -> int:
    """The step the `latest` pointer names, 0 while there is none (read only: no clean-up of debris)."""
    try:
        text = (run_dir / "checkpoints" / "latest").read_text().strip()
    except FileNotFoundError:
        return 0
    match = re.fullmatch(r"global_step_(\d+)", text)
    return int(match.group(1)) if match else 0


def kill_after_checkpoint(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    """SIGKILL `proc` as soon as `latest` names `step` or a later one."""
    deadline = time.monotonic() + WAIT_S
    while latest_step_named(run_dir) < step:
        assert proc.poll() is None, f"the run exited (status {proc.returncode}) before checkpoint {step}"
        assert time.monotonic() < deadline, f"no checkpoint {step} within {WAIT_S}s"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL, "the run finished before the kill landed"


def assert_same_metrics(got: dict, want: dict, step: int) -> None:
    keys = {k for k in want if not k.startswith(TIME_BASED)}
    assert {k for k in got if not k.startswith(TIME_BASED)} == keys, f"step {step}: different metric names"
    for key in keys:
        a, b = got[key], want[key]
        same = a == b or (a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12))
        assert same, f"step {step}: {key} = {a} after resume, {b} uninterrupted"


def test_killed_and_resumed_run_matches_uninterrupted_run(task: dict[str, Path], tmp_path: Path) -> None:
    ref_dir, crash_dir = tmp_path / "reference", tmp_path / "crashed"
    ref_log = (tmp_path / "reference.log").open("w")
    reference = subprocess.Popen(train_command(task, ref_dir), env=train_env(), stdout=ref_log, stderr=ref_log)
    try:
        # 20 ms per scored response: the killed run still has about a second of work after step 3.
        doomed = subprocess.Popen(train_command(task, crash_dir), env=train_env(0.02),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            kill_after_checkpoint(doomed, crash_dir, CRASH_AFTER)
        finally:
            if doomed.poll() is None:
                doomed.kill()
                doomed.wait(timeout=WAIT_S)
        committed = CheckpointManager(crash_dir / "checkpoints").complete_steps()
        resumed = subprocess.run(train_command(task, crash_dir), env=train_env(), capture_output=True, text=True,
                                 timeout=WAIT_S)
        assert resumed.returncode == 0, resumed.stderr
        assert reference.wait(timeout=WAIT_S) == 0, (tmp_path / "reference.log").read_text()
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait(timeout=WAIT_S)
        ref_log.close()

    match = re.search(r"resumed from \S+ \(step (\d+)\)", resumed.stderr)
    assert match, f"the relaunched run did not resume:\n{resumed.stderr}"
    resume_step = int(match.group(1))
    assert resume_step == committed[-1], "resume must start from the newest committed checkpoint"
    assert CRASH_AFTER <= resume_step < TOTAL_STEPS

    want = read_metrics(ref_dir)
    got = read_metrics(crash_dir)
    steps = list(range(TOTAL_STEPS + 1))
    assert [r["step"] for r in want] == steps
    assert [r["step"] for r in got] == steps, "each step exactly once, in order, step 0 being validation"
    # The fixture must make every resumed piece of state matter, or the comparison proves nothing.
    assert len({r["actor/lr"] for r in want[1:]}) >= 4, "warm-up then cosine decay"
    assert len({r["actor/reward_kl_penalty_coeff"] for r in want[1:]}) == TOTAL_STEPS, "the KL coefficient adapts"
    assert all(r["actor/grad_norm"] > 0 for r in want[1:])
    assert [r["training/epoch"] for r in want[1:]] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert {"val-core/all/acc/mean@1", "val-aux/all/score/mean@1"} <= want[3].keys() & want[6].keys()
    for a, b in zip(got, want):
        assert_same_metrics(a, b, a["step"])

    final_ref = load_file(ref_dir / "checkpoints" / f"global_step_{TOTAL_STEPS}" / "actor" / "model.safetensors")
    final = load_file(crash_dir / "checkpoints" / f"global_step_{TOTAL_STEPS}" / "actor" / "model.safetensors")
    initial = load_file(task["model"] / "model.safetensors")
    assert final.keys() == final_ref.keys()
    assert all(torch.equal(final[k], final_ref[k]) for k in final)
    assert not all(torch.equal(final[k], initial[k]) for k in final), "training must change the weights"
    expected_entries = sorted([f"global_step_{s}" for s in range(1, TOTAL_STEPS + 1)] + ["latest"])
    assert sorted(p.name for p in (crash_dir / "checkpoints").iterdir()) == expected_entries, "no .tmp- debris"
    for kind in ("entropy_trace", "influence_trace"):
        assert_same_trace(crash_dir / kind, ref_dir / kind)


def assert_same_trace(got_dir: Path, want_dir: Path) -> None:
    """Each step once, no temporary debris, and every array equal to the uninterrupted run's."""
    got, want = TraceReader(got_dir), TraceReader(want_dir)
    steps = list(range(1, TOTAL_STEPS + 1))
    assert [e["step"] for e in read_jsonl_lines(got_dir / "manifest.jsonl")] == steps, "each step exactly once"
    assert got.steps() == want.steps() == steps
    assert sorted(p.name for p in (got_dir / "steps").iterdir()) == [f"step_{s:06d}.npz" for s in steps]
    assert not list(got_dir.glob(".tmp-*")) and (got_dir / "latest_step.txt").read_text().strip() == str(TOTAL_STEPS)
    assert got.summary["num_steps_written"] == TOTAL_STEPS and got.summary["latest_step"] == TOTAL_STEPS
    for step in steps:
        a, b = got.load_step(step), want.load_step(step)
        assert a.keys() == b.keys()
        for name in a:
            assert np.array_equal(a[name], b[name], equal_nan=a[name].dtype.kind == "f"), f"step {step}: {name}"
        stats = {k: v for k, v in got.entry(step).items() if k != "created_at"}
        assert stats == {k: v for k, v in want.entry(step).items() if k != "created_at"}


def read_jsonl_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def state_tensors(state: object) -> list:
    """A nested state dict flattened to comparable leaves (tensors as lists of their exact values)."""
    if isinstance(state, dict):
        return [(k, state_tensors(v)) for k, v in sorted(state.items(), key=lambda kv: str(kv[0]))]
    if isinstance(state, list | tuple):
        return [state_tensors(v) for v in state]
    if isinstance(state, torch.Tensor):
        return [str(state.dtype), list(state.shape), state.flatten().tolist()]
    return state


def test_resume_restores_every_piece_of_state(task: dict[str, Path], tmp_path: Path) -> None:
    cfg = load_config("ppo_trainer", overrides(task, tmp_path / "run"))
    trained = PPOTrainer(cfg)
    trained.train_step(1)
    trained.train_step(2)
    assert trained.kl_ctrl.value != 0.05 and trained.workers.worker.actor.scheduler.last_epoch == 2
    random.random()  # a run moves every generator away from its seed
    np.random.rand(5)
    torch.rand(7)
    trained.save_checkpoint(2)
    loader_state = trained.loader.state_dict()
    optimizer_state = state_tensors(trained.workers.worker.actor.optimizer.state_dict())
    scheduler_state = trained.workers.worker.actor.scheduler.state_dict()
    weights = {k: v.clone() for k, v in trained.workers.worker.actor.model.state_dict().items()}
    draws = (random.random(), np.random.rand(), torch.rand(3))
    next_prompts = [item["raw_prompt"] for item in trained.loader.next_batch()]

    fresh = PPOTrainer(cfg)
    assert not torch.equal(fresh.workers.worker.actor.model.state_dict()["lm_head.weight"], weights["lm_head.weight"])
    assert fresh.resume() == 2

    assert fresh.loader.state_dict() == loader_state == {"epoch": 0, "position": 2}
    assert fresh.kl_ctrl.value == trained.kl_ctrl.value
    assert state_tensors(fresh.workers.worker.actor.optimizer.state_dict()) == optimizer_state
    assert len(fresh.workers.worker.actor.optimizer.state) == len(list(fresh.workers.worker.actor.model.parameters()))  # Adam state for each
    assert fresh.workers.worker.actor.scheduler.state_dict() == scheduler_state
    assert fresh.workers.worker.actor.scheduler.get_last_lr() == [1e-3]  # two warm-up steps done: the full lr
    assert all(torch.equal(fresh.workers.worker.actor.model.state_dict()[k], v) for k, v in weights.items())
    assert (random.random(), np.random.rand()) == draws[:2]
    assert torch.equal(torch.rand(3), draws[2])
    assert [item["raw_prompt"] for item in fresh.loader.next_batch()] == next_prompts


class Killed(Exception):
    """Stands for SIGKILL inside the process: nothing after the raise runs."""


def test_run_dying_right_after_a_checkpoint_keeps_that_steps_metrics(task: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config("ppo_trainer", [*overrides(task, run_dir), "trainer.total_training_steps=3",
                                      "trainer.test_freq=-1", "trainer.val_before_train=false"])
    dying = PPOTrainer(cfg)
    commit = dying.checkpoints.save

    def commit_then_die(step: int, write: Callable[[Path], None]) -> Path:
        path = commit(step, write)
        if step == 2:
            raise Killed
        return path

    dying.checkpoints.save = commit_then_die
    with pytest.raises(Killed):
        dying.fit()
    assert latest_step_named(run_dir) == 2
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]

    PPOTrainer(cfg).fit()
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


# -- trainer.val_only and an earlier run's files ---------------------------------------------------------------
def run_files(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory (checkpoints and traces included) with its content."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_val_only_validates_the_newest_checkpoint_and_leaves_the_run_as_it_was(
        task: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir, dumps = tmp_path / "run", tmp_path / "val_generations"
    train = [*overrides(task, run_dir), "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=2",
             f"trainer.validation_data_dir={dumps}", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
             "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"]  # seeded samples: they show which weights ran
    PPOTrainer(load_config("ppo_trainer", train)).fit()
    saving = run_dir / "checkpoints" / ".tmp-global_step_3-x"  # a checkpoint another process is still writing
    saving.mkdir()
    (saving / "part.bin").write_bytes(b"half")
    trained = run_files(run_dir)
    assert {"metrics.jsonl", "summary.json", "config.yaml", "checkpoints/latest"} <= trained.keys()
    before, after = (read_jsonl_lines(dumps / f"step_{s}.jsonl") for s in (0, 2))
    assert [g["output"] for g in before] != [g["output"] for g in after], "training must change the sampled outputs"

    checks = tmp_path / "val_only_generations"
    capsys.readouterr()
    for mode in ("auto", "disable"):  # the newest checkpoint, then the model itself
        code = cli.main(["train", *train, "trainer.val_only=true", f"trainer.resume_mode={mode}",
                         f"trainer.validation_data_dir={checks / mode}"])
        assert code == 0
    # into the training run's own dump folder: its step_2.jsonl stays, the check has its own file
    code = cli.main(["train", *train, "trainer.val_only=true"])
    assert code == 0
    assert read_jsonl_lines(dumps / "step_2.jsonl") == after
    assert read_jsonl_lines(dumps / "val_only_step_2.jsonl") == after

    lines = read_jsonl_lines(run_dir / "val_only.jsonl")
    model_dir = run_dir / "checkpoints" / "global_step_2" / "actor"
    assert [(r["step"], r["model"]) for r in lines] == [(2, str(model_dir)), (0, str(task["model"])),
                                                        (2, str(model_dir))]
    metrics = read_metrics(run_dir)
    assert {k: v for k, v in lines[0].items() if k not in ("step", "model", "timing_s/testing")} == {
        k: v for k, v in metrics[2].items() if k.startswith("val-")}  # the step-2 checkpoint's figures again
    assert {k: v for k, v in lines[1].items() if k not in ("step", "model", "timing_s/testing")} == {
        k: v for k, v in metrics[0].items() if k.startswith("val-")}
    assert read_jsonl_lines(checks / "auto" / "val_only_step_2.jsonl") == after
    assert read_jsonl_lines(checks / "disable" / "val_only_step_0.jsonl") == before
    assert run_files(run_dir) == {**trained, "val_only.jsonl": (run_dir / "val_only.jsonl").read_bytes()}
    out = capsys.readouterr().out
    assert f"validated {model_dir} (step 2):" in out and f"appended to {run_dir / 'val_only.jsonl'}" in out
    assert f"  val-core/all/acc/mean@1 = {lines[0]['val-core/all/acc/mean@1']:.4f}" in out


def test_val_only_on_a_new_folder_validates_the_model(task: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "fresh"
    cfg = load_config("ppo_trainer", [*overrides(task, run_dir), "trainer.val_only=true"])
    summary = PPOTrainer(cfg).fit()
    assert summary["steps"] == 0 and summary["validated_model"] == str(task["model"])
    assert sorted(p.name for p in run_dir.iterdir()) == ["val_only.jsonl"]  # no metrics, traces or config
    (line,) = read_jsonl_lines(run_dir / "val_only.jsonl")
    assert line["val-core/all/acc/mean@1"] == summary["val_after"]["val-core/all/acc/mean@1"]


def test_auto_resume_refuses_a_folder_with_metrics_but_no_checkpoint(task: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    old = '{"step": 1, "critic/score/mean": 0.5}\n'
    (run_dir / "metrics.jsonl").write_text(old)
    with pytest.raises(ArcherError) as err:
        PPOTrainer(load_config("ppo_trainer", overrides(task, run_dir)))
    assert err.value.problem == (f"{run_dir} holds a run (metrics.jsonl) but has no complete checkpoint to continue "
                                 "from (trainer.resume_mode=auto); archer keeps its files rather than overwrite them")
    assert "trainer.default_local_dir" in err.value.fix
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]
    assert (run_dir / "metrics.jsonl").read_text() == old
