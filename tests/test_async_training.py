"""trainer.v1.trainer_mode=colocate_async on the CPU (GRPO, a micro model): generation runs one batch ahead of
training and the trained responses are exactly one policy version old at max_off_policy_threshold=1, two Ray ranks
train what one process trains, paused requests resume under newer weights with their earlier tokens and
behaviour log-probs kept (the IS weights against them checked by hand), and a resumed run trains the prompts an
unbroken run trains, in the same order.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_health_checks import METRIC_NAME
from test_scale_out_on_cpu import DIGIT_REWARD, assert_close_metrics, environment, metrics
from train_support import task_model

from archer.config.loader import load_config
from archer.data.tasks import write_task_files
from archer.errors import ArcherError
from archer.health import checks
from archer.health.history import ACC
from archer.trace.format import TraceReader
from archer.trainer.checkpoint_dirs import load_torch_state
from archer.trainer.off_policy import RolloutCorrectionStage
from archer.trainer.ppo import PPOTrainer

pytestmark = pytest.mark.slow

ASYNC = ["trainer.v1.trainer_mode=colocate_async", "trainer.v1.sampler.max_off_policy_threshold=1"]
STALENESS = [f"training/off_policy/trajectory_staleness/{stat}" for stat in ("mean", "max", "min")]


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("async")
    files = write_task_files("arithmetic", root / "data", n_train=48, n_val=4, n_sft=64, seed=0, max_operand=9)
    reward = root / "digit_reward.py"  # a score that varies within a group: every step moves the policy
    reward.write_text(DIGIT_REWARD)
    return {**files, "reward": reward, "model": task_model(root / "model", files["sft"], max_positions=256)}


def overrides(task: dict[str, Path], run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [f"actor_rollout_ref.model.path={task['model']}", f"data.train_files={task['train']}",
            "data.max_prompt_length=32", "data.max_response_length=16", "data.train_batch_size=4",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.optim.lr=1e-3",
            f"trainer.total_training_steps={steps}", "trainer.plots=false", "trainer.logger=[jsonl]",
            "trainer.device=cpu", "trainer.val_before_train=false", "+trainer.entropy_trace.enable=true",
            f"trainer.rollout_data_dir={run_dir / 'rollouts'}", f"trainer.default_local_dir={run_dir}", *extra]


def train_here(task: dict[str, Path], run_dir: Path, steps: int, *extra: str) -> dict[int, dict]:
    PPOTrainer(load_config("ppo_trainer", overrides(task, run_dir, steps, *extra))).fit()
    return metrics(run_dir)


def trained_prompts(run_dir: Path, step: int) -> list[str]:
    """The prompts step ``step`` trained on, in batch order, once per group."""
    lines = [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
    return list(dict.fromkeys(json.dumps(line["input"]) for line in lines if line["trained"]))


@pytest.fixture(scope="module")
def one_process(task: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("one") / "run"
    train_here(task, run_dir, 3, *ASYNC)
    return run_dir


def test_responses_are_exactly_one_version_old_and_two_ranks_train_what_one_process_trains(
        task: dict[str, Path], one_process: Path, tmp_path: Path) -> None:
    want = metrics(one_process)
    assert [want[1][k] for k in STALENESS] == [0.0] * 3  # the first batch: sampled by the initial policy
    for step in (2, 3):  # the batch of step s was sampled by version s - 2 while step s - 1 trained
        assert [want[step][k] for k in STALENESS] == [1.0] * 3
        assert want[step]["training/off_policy/stale_fraction"] == 1.0
        trace = TraceReader(one_process / "entropy_trace").load_step(step)
        assert trace["policy_version"].tolist() == [step - 2] * 12 and trace["staleness"].tolist() == [1] * 12
    # the hf engine decodes whole rounds: each step's turn completes the next batch, nothing is paused
    assert [want[s]["async/in_flight_groups"] for s in (1, 2, 3)] == [4.0] * 3
    assert all(want[s]["async/paused_requests"] == 0 for s in want)
    # the loader's batches in order, one step late after the first: step s trains batch s
    sync_dir = tmp_path / "sync"
    train_here(task, sync_dir, 2)
    for step in (1, 2):
        assert trained_prompts(one_process, step) == trained_prompts(sync_dir, step)

    run_dir = tmp_path / "two"
    command = [sys.executable, "-m", "archer.cli", "train", *overrides(task, run_dir, 3, *ASYNC),
               "trainer.n_gpus_per_node=2"]
    proc = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = metrics(run_dir)
    for step in want:
        assert_close_metrics(got[step], want[step], step)


def test_a_resumed_run_trains_the_prompts_an_unbroken_run_trains(task: dict[str, Path], one_process: Path,
                                                                 tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train_here(task, run_dir, 1, *ASYNC, "trainer.save_freq=1")
    state = load_torch_state(run_dir / "checkpoints" / "global_step_1" / "trainer_state.pt")
    assert state["async_pending"] == {"next_number": 3,
                                      "batches": [{"number": 2, "epoch": 0, "position": 1, "rows": [0, 1, 2, 3]}]}
    assert state["loader"] == {"epoch": 0, "position": 2}  # the loader is one batch ahead of training
    resumed = train_here(task, run_dir, 3, *ASYNC, "trainer.save_freq=1")
    assert sorted(resumed) == [1, 2, 3]
    for step in (2, 3):
        assert trained_prompts(run_dir, step) == trained_prompts(one_process, step)
    # batch 2 is sampled anew by the resumed policy, the one step 2 updates (0 versions old), batch 3 beside it
    assert [resumed[s]["training/off_policy/trajectory_staleness/max"] for s in (2, 3)] == [0.0, 1.0]


def test_paused_requests_resume_with_their_tokens_and_log_probs_and_are_weighted_by_hand(
        task: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast engine pauses the requests still decoding when a step's groups are complete; they resume under the
    next policy. One response per prompt (REINFORCE++), long responses that the micro model ends at many lengths
    and a bound of 2 versions give responses that span two versions."""
    seen: dict[int, dict[str, torch.Tensor | np.ndarray]] = {}
    correct_batch = RolloutCorrectionStage.correct_batch

    def spy(self, batch):
        result = correct_batch(self, batch)
        seen[len(seen) + 1] = {k: batch[k] for k in ("old_log_probs", "rollout_log_probs", "response_mask",
                                                      "rollout_is_weights", "staleness", "policy_version",
                                                      "first_policy_version")}
        return result

    monkeypatch.setattr(RolloutCorrectionStage, "correct_batch", spy)
    run_dir = tmp_path / "run"
    got = train_here(task, run_dir, 4, "trainer.v1.trainer_mode=colocate_async",
                     "trainer.v1.sampler.max_off_policy_threshold=2", "trainer.v1.colocate_async.num_warmup_batches=2",
                     "actor_rollout_ref.rollout.name=fast", "data.max_response_length=128",
                     "actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus",
                     f"custom_reward_function.path={task['reward']}",
                     "algorithm.rollout_correction.rollout_is=token",
                     "algorithm.rollout_correction.rollout_is_threshold=1000")
    assert sum(got[s]["async/resumed_requests"] for s in got) > 0
    spanning = [s for s in got if got[s]["training/off_policy/trajectory_spans/max"] == 2.0]
    assert spanning, "no trained response spans two policy versions"
    for step in got:
        assert got[step]["training/off_policy/trajectory_staleness_worst/max"] <= 2.0
    step = spanning[0]
    assert np.any(seen[step]["first_policy_version"] < seen[step]["policy_version"])
    arrays = TraceReader(run_dir / "entropy_trace").load_step(step)  # the trace records both versions
    assert np.any(arrays["first_policy_version"] < arrays["policy_version"])
    assert arrays["first_policy_version"].tolist() == seen[step]["first_policy_version"].tolist()
    assert arrays["policy_version"].tolist() == seen[step]["policy_version"].tolist()
    assert arrays["staleness"].tolist() == seen[step]["staleness"].tolist()
    for step, batch in seen.items():
        mask = batch["response_mask"].bool()
        gap = (batch["old_log_probs"] - batch["rollout_log_probs"]).abs().masked_fill(~mask, 0).amax(dim=1)
        # token-level truncated IS: w = exp(old - rollout) on the policy's tokens, capped at the threshold
        weights = torch.exp(batch["old_log_probs"] - batch["rollout_log_probs"]).clamp(max=1000) * mask
        torch.testing.assert_close(batch["rollout_is_weights"] * mask, weights, rtol=1e-6, atol=1e-7)
        fresh = torch.from_numpy((batch["staleness"] == 0) & (batch["first_policy_version"] == step - 1))
        # a response sampled wholly by the policy the step updates: the behaviour log-probs are the old ones
        assert torch.all(gap[fresh] < 1e-4), step
        if step > 1 and bool((~fresh).any()):  # sampled by earlier versions: their log-probs, kept, differ
            assert float(gap[~fresh].max()) > 1e-3, step


def test_dynamic_sampling_asks_the_pools_again_for_the_groups_it_filtered_out(task: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    """filter_groups with colocate_async: each call after the first admits one more loader batch and asks for the
    groups still missing; the step trains exactly train_batch_size informative groups."""
    run_dir = tmp_path / "run"
    got = train_here(task, run_dir, 3, *ASYNC, "algorithm.filter_groups.enable=true",
                     "algorithm.filter_groups.metric=score", f"custom_reward_function.path={task['reward']}")
    for step in got:
        assert got[step]["train/num_kept_groups"] == 4.0
        assert got[step]["train/num_candidate_groups"] >= 4.0
    assert max(got[s]["train/num_gen_batches"] for s in got) > 1  # some group scored alike: the pools were asked again
    trained = [p for step in got for p in trained_prompts(run_dir, step)]
    assert len(trained) == len(set(trained)) == 12
    with pytest.raises(ArcherError, match="max_num_gen_batches"):  # the micro model never answers right: no
        train_here(task, tmp_path / "never", 1, *ASYNC, "algorithm.filter_groups.enable=true",  # group varies
                   "algorithm.filter_groups.max_num_gen_batches=2")


def test_a_warm_up_past_the_staleness_bound_is_refused(task: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ArcherError, match="older than the bound"):
        PPOTrainer(load_config("ppo_trainer", overrides(task, tmp_path / "run", 1, *ASYNC,
                                                        "trainer.v1.colocate_async.num_warmup_batches=2")))
    assert not (tmp_path / "run").exists()


TOOLS = ["+actor_rollout_ref.rollout.tools.tool_instances.python.class_path=agentic_support.Echo",
         "+actor_rollout_ref.rollout.tools.tool_instances.python.params.answer='7'"]
TOOL_LOOP_FIGURES = ("tools/", "rollout/")  # the tool loop's statistics: a turn also generates the next batch


def test_with_tools_each_turn_generates_whole_batches_and_the_step_trains_the_oldest(task: dict[str, Path],
                                                                                     tmp_path: Path) -> None:
    """partial_rollout=false: tool trajectories are never paused: the first turn generates loader batches 1 and 2
    whole (the warm-up),
    step 1 trains batch 1 as the synchronous loop does (the same seeds and weights), and every later step trains
    the batch generated one turn earlier, one version old."""
    reward = f"custom_reward_function.path={task['reward']}"
    want = train_here(task, tmp_path / "sync", 1, *TOOLS, reward)
    run_dir = tmp_path / "colocated"
    got = train_here(task, run_dir, 3, *ASYNC, *TOOLS, reward, "trainer.v1.partial_rollout=false")
    assert "tools/invalid_calls" in got[1] and "rollout/turns_mean" in got[1]
    skipped = (*TOOL_LOOP_FIGURES, "async/", "training/off_policy/evicted_samples")
    assert_close_metrics({k: v for k, v in got[1].items() if not k.startswith(skipped)},
                         {k: v for k, v in want[1].items() if not k.startswith(skipped)}, 1)
    assert trained_prompts(run_dir, 1) == trained_prompts(tmp_path / "sync", 1)
    assert [got[s]["training/off_policy/trajectory_staleness/mean"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [got[s]["async/in_flight_groups"] for s in (1, 2, 3)] == [4.0] * 3  # the next batch, complete
    assert all(got[s]["async/paused_requests"] == 0 for s in got)


def test_with_tools_paused_trajectories_resume_under_the_next_policy(task: dict[str, Path], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """partial_rollout=true (the default) with tools and ARPO's branching on the fast engine, turns scripted to
    long-tailed lengths with calls (rollout/simulated_turns.py): each turn stops once a batch's worth of groups is
    complete, the trajectories still decoding or waiting for the tool resume in the next turn, and trained
    responses span two policy versions, within the bound."""
    monkeypatch.setenv("ARCHER_SIMULATED_TURNS", "median=24,sigma=0.8,limit=96,tool_rate=0.7")
    run_dir = tmp_path / "run"
    got = train_here(task, run_dir, 4, "trainer.v1.trainer_mode=colocate_async",
                     "trainer.v1.sampler.max_off_policy_threshold=2", *TOOLS,
                     "actor_rollout_ref.rollout.name=fast", "data.max_response_length=96",
                     "actor_rollout_ref.rollout.initial_rollouts=1", "actor_rollout_ref.rollout.beam_size=2",
                     "actor_rollout_ref.rollout.branch_probability=1.0", f"custom_reward_function.path={task['reward']}")
    assert sum(got[s]["async/paused_requests"] for s in got) > 0
    assert sum(got[s]["async/resumed_requests"] for s in got) > 0
    assert sum(got[s]["tools/python/calls"] for s in got) > 0 and sum(got[s]["rollout/branches"] for s in got) > 0
    spanning = [s for s in got if got[s]["training/off_policy/trajectory_spans/max"] == 2.0]
    assert spanning, "no trained response spans two policy versions"
    assert all(got[s]["training/off_policy/trajectory_staleness_worst/max"] <= 2.0 for s in got)
    arrays = TraceReader(run_dir / "entropy_trace").load_step(spanning[0])  # the trace records both versions
    assert np.any(arrays["first_policy_version"] < arrays["policy_version"])


def test_every_trainer_metric_a_health_check_reads_is_logged_by_a_run_with_its_feature(task: dict[str, Path],
                                                                                       tmp_path: Path) -> None:
    """The checks read the trainer's metrics by name (archer/health/checks.py's constants): a run with every
    feature a check watches (a critic, the KL loss, rollout correction with rejection, colocate_async's staleness,
    tools) logs each of those names, so a renamed producer cannot leave a check silently reading nothing."""
    read = {value for value in vars(checks).values() if isinstance(value, str)
            and METRIC_NAME.match(value) and not value.startswith("health/")} | {*checks.SPIKY, ACC}
    rc = "algorithm.rollout_correction."
    got = train_here(task, tmp_path / "run", 2, *ASYNC, *TOOLS, f"custom_reward_function.path={task['reward']}",
                     "algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "actor_rollout_ref.actor.use_kl_loss=true",
                     f"{rc}rollout_is=token", f"{rc}rollout_is_threshold=2.0", f"{rc}rollout_rs=token_k1",
                     f"{rc}rollout_rs_threshold=2.0")
    assert len(read) >= 18, sorted(read)  # the constants the checks read, as named in checks.py today
    assert sorted(read - set(got[2])) == []

