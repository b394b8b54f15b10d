"""The trainer with verl/ARPO/Archer2.0 data as users have it: JSON lines rows that carry only a top-level answer,
a batch reward function (reward_manager=batch), and the checks that stop a run when the data loads (a
data_source without a reward route, a row naming a tool that is not configured)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from archer.config.loader import load_config
from archer.errors import ArcherError
from archer.trainer import ppo
from archer.trainer.ppo import PPOTrainer

BATCH_REWARD = '''
import json, os

def compute_score(data_sources, solution_strs, ground_truths, extra_infos, log_file):
    with open(log_file, "a") as f:
        f.write(json.dumps({"n": len(solution_strs), "sources": list(data_sources), "gts": list(ground_truths)}) + "\\n")
    return [{"score": float(len(s) % 3), "acc": 0.0} for s in solution_strs]
'''


class ModelLoaded(Exception):
    """Raised instead of loading the model: the data checks ran before it."""


def _jsonl_rows(task_files: dict[str, Path], n: int) -> list[dict]:
    """The arithmetic task's train rows with the ground truth as a top-level answer (ARPO's layout)."""
    rows = pq.read_table(task_files["train"]).slice(0, n).to_pylist()
    for row in rows:
        row["answer"] = row.pop("reward_model")["ground_truth"]
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _overrides(model: Path, train: Path, run: Path) -> list[str]:
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", "data.max_prompt_length=48",
            "data.max_response_length=8", "trainer.device=cpu", f"trainer.default_local_dir={run}",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.total_training_steps=1",
            "trainer.logger=[jsonl]", "trainer.plots=False", f"trainer.rollout_data_dir={run / 'rollouts'}"]


def test_training_on_json_lines_with_answers_through_a_batch_reward(tiny_model_dir: Path,
                                                                     task_files: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    rows = _jsonl_rows(task_files, 4)
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    reward, log_file = tmp_path / "batch_reward.py", tmp_path / "calls.jsonl"
    reward.write_text(BATCH_REWARD)
    run = tmp_path / "run"
    cfg = load_config("ppo_trainer", [*_overrides(tiny_model_dir, train, run), "reward_model.reward_manager=batch",
                                      f"custom_reward_function.path={reward}",
                                      f"+reward_model.reward_kwargs.log_file={log_file}"])
    PPOTrainer(cfg).fit()
    (call,) = [json.loads(line) for line in log_file.read_text().splitlines()]  # one call for the whole batch
    answers = {r["answer"] for r in rows}
    assert call["n"] == 4 and set(call["gts"]) <= answers and call["sources"] == ["archer/arithmetic"] * 4
    dumped = [json.loads(line) for line in (run / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert [d["gts"] for d in dumped] == call["gts"]
    assert [d["score"] for d in dumped] == [float(len(d["output"]) % 3) for d in dumped]
    (metrics,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics["critic/score/mean"] == pytest.approx(sum(d["score"] for d in dumped) / 4)


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise ModelLoaded

    monkeypatch.setattr(ppo, "build_worker_group", refuse)


def test_a_data_source_without_a_reward_stops_the_run_when_the_data_loads(
        tiny_model_dir: Path, task_files: dict[str, Path], tmp_path: Path, no_model: None) -> None:
    rows = _jsonl_rows(task_files, 3)
    rows[1]["data_source"], rows[1]["ability"] = "my_benchmark", None  # (with an ability it routes by that)
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(ArcherError) as info:
        PPOTrainer(load_config("ppo_trainer", _overrides(tiny_model_dir, train, tmp_path / "run")))
    assert info.value.problem.startswith("data.train_files: no built-in reward for data_source 'my_benchmark'; "
                                         "known data sources: [")
    assert "'hotpotqa'" in info.value.problem and "custom_reward_function.path" in info.value.fix

    reward = tmp_path / "any_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    with pytest.raises(ModelLoaded):  # a custom reward scores every source: the run goes on to the model
        PPOTrainer(load_config("ppo_trainer", [*_overrides(tiny_model_dir, train, tmp_path / "run2"),
                                               f"custom_reward_function.path={reward}"]))


def test_a_row_naming_an_unconfigured_tool_stops_the_run_when_the_data_loads(
        tiny_model_dir: Path, task_files: dict[str, Path], tmp_path: Path, no_model: None) -> None:
    rows = _jsonl_rows(task_files, 2)
    rows[0]["tools"] = ["python"]
    rows[1]["tools"] = ["search"]
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    tools = "actor_rollout_ref.rollout.tools.tool_instances.python"
    cfg = load_config("ppo_trainer", [*_overrides(tiny_model_dir, train, tmp_path / "run"),
                                      f"+{tools}.class_path=python"])
    with pytest.raises(ArcherError, match=r"data.train_files: rows name tool\(s\) \['search'\] in their tools"):
        PPOTrainer(cfg)
