"""`archer train ... trainer.n_gpus_per_node=2` on this CPU machine: two Ray ranks (gloo), the models sharded with
FSDP2, against the single-process run of the same config.

- Two ranks compute what one process computes: every metric of three GRPO steps within 1e-5 relative (1e-7
  absolute), the trained weights within 1e-5 (float32; only the order of float sums differs), and the entropy
  and influence traces (each rank's rows reach the driver's one writer) within 1e-4 relative (float16 factors:
  4 units in the last place).
- So do LoRA with FSDP2's CPU offload, a critic (GAE), a reward model mixed with the rule reward and the rollout
  correction's bypass mode (its extremes and moments reduced over the ranks).
- The checkpoint is sharded (one DCP file per rank) beside an HF export that from_pretrained loads.
- The driver killed with SIGKILL after a checkpoint takes its ranks with it, and relaunched it resumes there; a rank
  killed mid-run stops the run with one error naming the rank and how to resume; resumed, the run has logged the
  uninterrupted run's metrics.
- A checkpoint of 2 ranks resumes in one process, and one of a single process resumes on 2 ranks.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from test_reward_model import build_reward_model
from train_support import task_model
from transformers import AutoModelForCausalLM

from archer.data.tasks import write_task_files
from archer.trace.format import TraceReader

pytestmark = pytest.mark.slow

TIME_BASED = ("timing_s/", "perf/", "timing_per_token_ms/")
RANK_SPLIT = "global_seqlen/"  # how the rows split over the ranks: only a run on several ranks logs it
STEPS = 3
WAIT_S = 240
REL, ABS = 1e-5, 1e-7  # two ranks against one process: float sums in another order
# The rollout_corr/* statistics are of ratios within float rounding of 1 (the engine's log-probs against the
# old-log-prob pass; a chi-squared is E[w^2] - 1, a sequence's ratio a product over its tokens): their values are
# that rounding, which another split of the rows over ranks and token-budget micro-batches moves by ~1e-6.
CORR_ABS = 1e-5
DIGIT_REWARD = """
import os
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(float(os.environ.get("ARCHER_TEST_REWARD_DELAY_S", "0")))
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scale_out")
    files = write_task_files("arithmetic", root / "data", n_train=64, n_val=16, n_sft=64, seed=0, max_operand=9)
    reward = root / "digit_reward.py"
    reward.write_text(DIGIT_REWARD)
    return {**files, "reward": reward, "model": task_model(root / "model", files["sft"], max_positions=512)}


def command(task: dict[str, Path], run_dir: Path, ranks: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "archer.cli", "train",
            f"actor_rollout_ref.model.path={task['model']}", f"data.train_files={task['train']}",
            "data.max_prompt_length=32", "data.max_response_length=16", "data.train_batch_size=6",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.rollout.name=fast",
            "actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.use_kl_loss=true", f"custom_reward_function.path={task['reward']}",
            f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.plots=false",
            "trainer.logger=[jsonl]", "trainer.device=cpu", f"trainer.n_gpus_per_node={ranks}",
            # 9 rows a mini-batch: rank 0 takes 5 (micro-batches of 2, 2, 1), rank 1 takes 4 (2, 2, and a padding
            # pass weighted 0), so the ranks' pass counts really differ
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "+trainer.entropy_trace.enable=true", "+trainer.influence_trace.enable=true",
            f"trainer.default_local_dir={run_dir}", *extra]


def environment(reward_delay_s: float = 0.0) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "ARCHER_TEST_REWARD_DELAY_S": str(reward_delay_s)}


def train(task: dict[str, Path], run_dir: Path, ranks: int, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(command(task, run_dir, ranks, *extra), env=environment(), capture_output=True, text=True,
                          timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def assert_close_metrics(got: dict, want: dict, step: int, rel: float = REL, abs_: float = ABS,
                         corr_abs: float = CORR_ABS) -> None:
    skipped = (*TIME_BASED, RANK_SPLIT)
    keys = {k for k in want if not k.startswith(skipped)}
    assert {k for k in got if not k.startswith(skipped)} == keys, f"step {step}: different metric names"
    for key in sorted(keys):
        a, b = got[key], want[key]
        tol = corr_abs if key.startswith("rollout_corr/") else abs_
        assert a == b or math.isclose(a, b, rel_tol=rel, abs_tol=tol), f"step {step}: {key} = {a}, expected {b}"


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"global_step_{step}" / "actor" / "model.safetensors"))


@pytest.fixture(scope="module")
def one_process(task: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("one") / "run"
    train(task, run_dir, 1)
    return run_dir


@pytest.fixture(scope="module")
def two_ranks(task: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("two") / "run"
    train(task, run_dir, 2)
    return run_dir


def test_two_ranks_compute_what_one_process_computes(one_process: Path, two_ranks: Path) -> None:
    want, got = metrics(one_process), metrics(two_ranks)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert want[1]["actor/grad_norm"] > 0.1 and want[1]["actor/kl_loss"] > 0  # the policy moves from the reference
    for step in want:
        assert_close_metrics(got[step], want[step], step)
        split = {k.removeprefix(RANK_SPLIT): v for k, v in got[step].items() if k.startswith(RANK_SPLIT)}
        assert not any(k.startswith(RANK_SPLIT) for k in want[step])
        # two ranks share the same tokens either way: each split's min and max add up to twice the mean
        assert split["minmax_diff"] == split["max"] - split["min"] and split["min"] <= split["max"]
        assert split["min"] + split["max"] == split["balanced_min"] + split["balanced_max"] == 2 * split["mean"]
    single, sharded = weights(one_process, STEPS), weights(two_ranks, STEPS)
    assert single.keys() == sharded.keys()
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], rtol=0, atol=1e-5, msg=name)


def test_the_checkpoint_is_sharded_beside_an_hf_export(two_ranks: Path) -> None:
    actor = two_ranks / "checkpoints" / f"global_step_{STEPS}" / "actor"
    assert {p.name for p in (actor / "dcp").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert (actor / "schedule.pt").is_file() and not (actor / "optim_state.pt").exists()
    model = AutoModelForCausalLM.from_pretrained(str(actor), dtype=torch.float32)
    exported = weights(two_ranks, STEPS)
    for name, tensor in model.state_dict().items():
        if name in exported:
            assert torch.equal(tensor, exported[name]), name


def test_the_traces_of_two_ranks_are_those_of_one_process(one_process: Path, two_ranks: Path) -> None:
    for kind in ("entropy_trace", "influence_trace"):
        want, got = TraceReader(one_process / kind), TraceReader(two_ranks / kind)
        assert got.steps() == want.steps() == list(range(1, STEPS + 1))
        for step in want.steps():
            a, b = got.load_step(step), want.load_step(step)
            assert a.keys() == b.keys()
            for name in b:
                if b[name].dtype.kind == "f":  # float16 factors: a few units in the last place
                    eps = float(np.finfo(b[name].dtype).eps)
                    np.testing.assert_allclose(a[name], b[name], rtol=max(1e-4, 4 * eps), atol=max(1e-6, 4 * eps),
                                               err_msg=f"{kind} step {step}: {name}")
                else:
                    assert np.array_equal(a[name], b[name]), f"{kind} step {step}: {name}"


def test_lora_offload_critic_reward_model_and_bypass_correction_on_two_ranks(task: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    corpus = [json.dumps(row) for row in pq.read_table(task["train"]).to_pylist()[:32]]
    reward_model = build_reward_model(tmp_path / "reward_model", corpus)
    variant = ("trainer.total_training_steps=2", "actor_rollout_ref.model.lora_rank=8",
               "actor_rollout_ref.model.lora_alpha=16", "actor_rollout_ref.actor.fsdp_config.param_offload=true",
               "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true", "algorithm.adv_estimator=gae",
               "reward_model.enable=true", f"reward_model.model.path={reward_model}", "reward_model.rule_weight=0.5",
               "trainer.influence_trace.enable=false",
               # corrected in the actor's loss: its rollout_corr/* extremes and moments reduced over the ranks
               "algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token",
               "algorithm.rollout_correction.rollout_rs=token_k3", "algorithm.rollout_correction.rollout_rs_threshold=1e-4")
    runs = {ranks: tmp_path / f"ranks_{ranks}" for ranks in (1, 2)}
    for ranks, run_dir in runs.items():
        train(task, run_dir, ranks, *variant)
    want, got = metrics(runs[1]), metrics(runs[2])
    assert want[1]["critic/vf_loss"] > 0 and "reward/rm_score/mean" in want[1]
    assert "timing_s/old_log_prob" not in want[1] and want[2]["rollout_corr/rollout_is_max"] > 1
    for step in want:
        assert_close_metrics(got[step], want[step], step)
    actor = runs[2] / "checkpoints" / "global_step_2"
    assert (actor / "actor" / "dcp" / ".metadata").is_file() and (actor / "critic" / "dcp" / ".metadata").is_file()


def wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + WAIT_S
    while not (latest.is_file() and latest.read_text().strip() == f"global_step_{step}"):
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before checkpoint {step}"
        assert time.monotonic() < deadline, f"no checkpoint {step} within {WAIT_S}s"
        time.sleep(0.01)


def rank_processes(driver: int) -> list[int]:
    """The pids of the Ray rank actors under ``driver`` (the local Ray it started; their process title names
    archer's rank actor), in pid order: another test's ranks on this machine are not counted."""
    import psutil

    ranks = [p for p in psutil.Process(driver).children(recursive=True) if "ray::_RankActor" in " ".join(p.cmdline())]
    return sorted(p.pid for p in ranks)


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie, or a process gone between two looks, is not)."""
    import psutil

    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def test_a_killed_driver_or_rank_is_resumed_exactly(task: dict[str, Path], two_ranks: Path, tmp_path: Path) -> None:
    """The driver killed (SIGKILL) after checkpoint 1 takes its ranks with it, and relaunched it resumes there; a rank
    killed after checkpoint 2 stops that run with one error that names the rank's death and how to resume; resumed
    once more, the run has logged the uninterrupted run's metrics."""
    run_dir = tmp_path / "run"
    with (tmp_path / "log").open("w") as log:
        proc = subprocess.Popen(command(task, run_dir, 2), env=environment(reward_delay_s=0.05), stdout=log,
                                stderr=log)
        wait_for_checkpoint(proc, run_dir, 1)
        first_ranks = rank_processes(proc.pid)
        assert len(first_ranks) == 2, first_ranks
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    assert max(metrics(run_dir)) < STEPS, "the run finished before the kill landed"
    deadline = time.monotonic() + 60
    while alive(first_ranks):
        assert time.monotonic() < deadline, "the killed driver's ranks outlived it by a minute"
        time.sleep(0.1)

    proc = subprocess.Popen(command(task, run_dir, 2), env=environment(reward_delay_s=0.05), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_checkpoint(proc, run_dir, 2)
    ranks = rank_processes(proc.pid)
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=WAIT_S)
    assert proc.returncode != 0, "the run finished before the kill landed"
    assert "died during" in stderr and "trainer.resume_mode=auto" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]

    train(task, run_dir, 2)
    want, got = metrics(two_ranks), metrics(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(2, STEPS + 1):
        assert_close_metrics(got[step], want[step], step, rel=1e-6, abs_=1e-9, corr_abs=1e-9)


@pytest.mark.parametrize(("written_by", "resumed_on"), [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_on_another_number_of_ranks(task: dict[str, Path], one_process: Path, two_ranks: Path,
                                                          tmp_path: Path, written_by: int, resumed_on: int) -> None:
    source = two_ranks if written_by == 2 else one_process
    checkpoint = tmp_path / "global_step_1"
    shutil.copytree(source / "checkpoints" / "global_step_1", checkpoint)
    run_dir = tmp_path / "run"
    train(task, run_dir, resumed_on, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={checkpoint}")
    want, got = metrics(source), metrics(run_dir)
    assert sorted(got) == [2, 3]
    for step in got:
        assert_close_metrics(got[step], want[step], step)
