"""A run that trains on nothing (archer/trainer/no_update.py): the guard's count and error, and end to end
``algorithm=archer`` with a reward of 0 for every response: every group is dropped, the run stops after
trainer.max_steps_without_update steps with exit status 2 and an error that says why, the rollout dump holds
every response of every step, health's no_signal flag points at responses (while training and replayed by
``archer health``), and the summary of an opted-in run counts the steps that updated.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from archer import cli
from archer.batch import Batch
from archer.errors import ArcherError
from archer.health.offline import replay
from archer.rewards.extras import REWARD_EXTRAS
from archer.trainer.no_update import UpdateGuard, every_response, score_distribution

N, PROMPTS = 4, 2
ZERO_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
'''


def scored(uids: list[str], scores: list[float], texts: list[str] | None = None) -> Batch:
    n = len(uids)
    return Batch({}, {"uid": uids, "score": np.asarray(scores), "acc": np.asarray(scores),
                      "response_text": texts or [f"r{i}" for i in range(n)], "ground_truth": ["7"] * n,
                      "data_source": ["t"] * n, "raw_prompt": [[{"role": "user", "content": "q"}]] * n,
                      REWARD_EXTRAS: [{}] * n})


# -- the guard -------------------------------------------------------------------------------------------
def test_guard_stops_after_limit_idle_steps_in_a_row_and_says_why() -> None:
    guard = UpdateGuard(limit=3)
    guard.record(1, updated=False, responses=scored(["1-0", "1-0"], [0.0, 0.0]))
    guard.check(1)
    guard.record(2, updated=True)  # an update resets the count
    guard.check(2)
    for step in (3, 4):
        guard.record(step, updated=False, responses=scored([f"{step}-0", f"{step}-0", f"{step}-1"], [0.0, 0.0, 1.0],
                                                           ["a" * 200, "b", "c"]))
        guard.check(step)
    guard.record(5, updated=False, responses=scored(["5-0"], [0.0]))
    with pytest.raises(ArcherError) as err:
        guard.check(5)
    problem = err.value.problem
    assert problem.startswith("steps 3-5: 3 steps in a row made no update (trainer.max_steps_without_update=3): "
                              "every prompt group scored alike")
    # 7 responses of steps 3-5: five 0s and two 1s
    assert "Scores: 7 responses, mean 0.2857 (min 0, max 1); scores 0 x5, 1 x2." in problem
    examples = problem.split("Examples:\n")[1].split("\n")
    assert examples == [f"    score 0 (ground truth '7', prompt group 3-0): {'a' * 120 + '...'!r}",
                        "    score 1 (ground truth '7', prompt group 3-1): 'c'",
                        "    score 0 (ground truth '7', prompt group 4-0): " + repr("a" * 120 + "...")]
    assert "trainer.max_steps_without_update=0" in err.value.fix
    assert guard.updated_steps == 1


def test_guard_with_limit_0_never_stops_and_keeps_nothing() -> None:
    guard = UpdateGuard(limit=0)
    for step in range(1, 20):
        guard.record(step, updated=False, responses=scored(["g"], [0.0]))
        guard.check(step)
    assert guard.idle == [] and guard.updated_steps == 0


def test_every_response_puts_the_trained_rows_first() -> None:
    out = every_response(scored(["b", "b"], [1.0, 0.0]), [scored(["a", "a"], [0.0, 0.0]), scored([], [])])
    assert out["uid"].tolist() == ["b", "b", "a", "a"]
    assert out["trained"].tolist() == [True, True, False, False]
    assert len(every_response(scored([], []), [])) == 0


def test_score_distribution_names_the_most_frequent_values() -> None:
    assert score_distribution(np.arange(7.0)) == ("7 responses, mean 3 (min 0, max 6); scores 0 x1, 1 x1, 2 x1, "
                                                  "3 x1, 4 x1, 2 other values")


# -- end to end -------------------------------------------------------------------------------------------
def overrides(model: Path, files: dict[str, Path], run: Path, reward: Path, *extra: str) -> list[str]:
    return ["algorithm=archer", f"actor_rollout_ref.model.path={model}", f"data.train_files={files['train']}",
            "data.max_prompt_length=32", "data.max_response_length=4", "trainer.device=cpu",
            f"trainer.default_local_dir={run}", f"actor_rollout_ref.rollout.n={N}", f"data.train_batch_size={PROMPTS}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}", f"custom_reward_function.path={reward}",
            "trainer.logger=[jsonl]", "trainer.plots=False", f"trainer.rollout_data_dir={run / 'rollouts'}",
            "trainer.val_before_train=false", *extra]


@pytest.mark.slow
def test_a_run_whose_every_group_scores_alike_stops_with_an_error(micro_model, task_files, tmp_path, capsys) -> None:
    reward = tmp_path / "zero.py"
    reward.write_text(ZERO_REWARD)
    run = tmp_path / "run"
    code = cli.main(["train", *overrides(micro_model, task_files, run, reward, "trainer.total_training_steps=6")])
    err = capsys.readouterr().err
    assert code == 2
    assert ("steps 1-3: 3 steps in a row made no update (trainer.max_steps_without_update=3): every prompt group "
            "scored alike") in err
    assert f"Scores: {3 * PROMPTS * N} responses, mean 0 (min 0, max 0); scores 0 x{3 * PROMPTS * N}." in err
    assert err.count("    score 0 (ground truth ") == 3
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(line["train/num_kept_groups"] == 0 for line in lines)
    assert not (run / "summary.json").exists()
    for step in (1, 2, 3):  # every response of every step dumped, none trained on
        dump = [json.loads(x) for x in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(dump) == PROMPTS * N
        assert {(r["score"], r["trained"], r["step"]) for r in dump} == {(0.0, False, step)}
        assert [r["uid"] for r in dump] == [f"{step}-{i}" for i in range(PROMPTS) for _ in range(N)]
    flags = [json.loads(x) for x in (run / "health.jsonl").read_text().splitlines()]
    no_signal = [f for f in flags if f["check"] == "no_signal"]
    assert len(no_signal) == 1 and no_signal[0]["pointers"], flags
    step = no_signal[0]["step"]
    assert [(p["row"], p["uid"], p["value"]) for p in no_signal[0]["pointers"]] == [
        (i * N, f"{step}-{i}", 0.0) for i in range(PROMPTS)]  # one response per group scored alike
    replayed = [f.to_json() for f in replay(run).flags if f.check == "no_signal"]
    assert replayed == no_signal  # `archer health` points at the same responses, from the dumps

    opted = tmp_path / "opted"  # opted out: the run finishes, its summary counts no update
    assert cli.main(["train", *overrides(micro_model, task_files, opted, reward, "trainer.total_training_steps=2",
                                         "trainer.max_steps_without_update=0")]) == 0
    summary = json.loads((opted / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["updated_steps"] == 0
