"""One run folder, one experiment (trainer/run_folder.py), as a user meets it through `archer train` and `archer sft`:
a run with another model, data, seed or sizes is refused before anything is written (the folder checked byte
for byte), a change of the run's length or logging continues and is said, trainer.allow_config_change=true
continues anyway, a finished run's rerun changes nothing, and a resumed run keeps the summary's figures of
before and adds up its wall time. Micro model, a few steps each."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from archer import cli
from archer.trainer.run_folder import CONTINUABLE, config_changes, is_continuable


def folder_bytes(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``: a file's sha256, a folder's mark (so an added empty folder shows too)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def rl_args(run_dir: Path, model: Path, files: dict[str, Path], *changes: str) -> list[str]:
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files={files['train']}",
            f"data.val_files={files['val']}", "algorithm.adv_estimator=grpo", "data.train_batch_size=4",
            "data.max_prompt_length=32", "data.max_response_length=8", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=2", "trainer.save_freq=1",
            "trainer.test_freq=2", "trainer.logger=[jsonl]", "trainer.plots=false", "trainer.device=cpu",
            f"trainer.default_local_dir={run_dir}"]
    keys = {c.partition("=")[0] for c in changes}
    return [*(a for a in base if a.partition("=")[0] not in keys), *changes]


def train(args: list[str]) -> int:
    return cli.main(["train", *args])


@pytest.fixture()
def rl_run(tmp_path: Path, micro_model: Path, task_files: dict[str, Path]) -> tuple[Path, list[str]]:
    """A finished two-step GRPO run (a checkpoint each step) and the arguments that made it."""
    run_dir = tmp_path / "run"
    args = rl_args(run_dir, micro_model, task_files)
    assert train(args) == 0
    return run_dir, args


def test_keys_that_may_change_are_named_and_the_rest_define_the_experiment() -> None:
    rl = "ppo_trainer"
    for key in ("trainer.total_training_steps", "trainer.logger", "trainer.save_freq", "trainer.test_freq",
                "trainer.default_local_dir", "trainer.n_gpus_per_node", "eval.k", "trainer.balance_batch",
                "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"):
        assert is_continuable(key, rl), key
    for key in ("actor_rollout_ref.model.path", "data.train_files", "data.val_files", "trainer.seed", "data.seed",
                "algorithm.adv_estimator", "actor_rollout_ref.actor.policy_loss.loss_mode", "data.train_batch_size",
                "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.rollout.n",
                "data.max_response_length", "actor_rollout_ref.actor.optim.lr", "trainer.evaluation_ghost"):
        assert not is_continuable(key, rl), key
    assert is_continuable("trainer.total_epochs", "sft_trainer") and is_continuable("data.micro_batch_size_per_gpu", "sft_trainer")
    for key in ("model.partial_pretrain", "data.train_files", "data.max_length", "optim.lr", "trainer.seed"):
        assert not is_continuable(key, "sft_trainer"), key
    assert set(CONTINUABLE) == {"ppo_trainer", "sft_trainer"}


def test_config_changes_compare_every_leaf_and_another_versions_keys_at_their_default() -> None:
    saved = OmegaConf.create({"data": {"max_length": 1024, "prompt_key": "q"}, "trainer": {"seed": 1, "gone": 3},
                              "model": {"target_modules": ["q_proj"]}})
    new = OmegaConf.create({"data": {"max_length": 2048, "prompt_key": "q", "truncation": "error"},
                            "trainer": {"seed": 1, "allow_config_change": False}, "model": {"target_modules": ["q_proj", "v_proj"]},
                            "optim": {"lr": 1e-3}})
    # truncation and allow_config_change at their defaults (a config saved by an archer without them), and a key
    # the schema no longer has, are no change; the lr is
    assert config_changes(saved, new, "sft_trainer") == {
        "data.max_length": (1024, 2048), "model.target_modules": (["q_proj"], ["q_proj", "v_proj"]),
        "optim.lr": ("(absent)", 1e-3)}
    tools = "actor_rollout_ref.rollout.tools.tool_instances"
    with_tool = OmegaConf.create({"actor_rollout_ref": {"rollout": {"tools": {"tool_instances": {"python": {"class_path": "python"}}}}}})
    without = OmegaConf.create({"actor_rollout_ref": {"rollout": {"tools": {"tool_instances": {}}}}})
    assert config_changes(with_tool, without, "ppo_trainer") == {  # a free-form mapping's entry always counts
        f"{tools}.python.class_path": ("python", "(absent)")}


@pytest.mark.parametrize("changes", [
    ("actor_rollout_ref.model.path",),
    ("data.train_files", "trainer.seed"),
    ("actor_rollout_ref.rollout.n", "data.max_response_length", "algorithm.adv_estimator"),
])
def test_training_another_experiment_into_a_run_folder_is_refused_and_changes_nothing(
        rl_run: tuple[Path, list[str]], changes: tuple[str, ...], tmp_path: Path, micro_model: Path,
        task_files: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    run_dir, args = rl_run
    other_model = Path(shutil.copytree(micro_model, tmp_path / "other_model"))
    other_train = Path(shutil.copy(task_files["train"], tmp_path / "other_train.parquet"))
    new_values = {"actor_rollout_ref.model.path": str(other_model), "data.train_files": str(other_train),
                  "trainer.seed": "7", "actor_rollout_ref.rollout.n": "4", "data.max_response_length": "12",
                  "algorithm.adv_estimator": "rloo"}
    before = folder_bytes(run_dir)
    capsys.readouterr()
    assert train(rl_args(run_dir, micro_model, task_files, *(f"{k}={new_values[k]}" for k in changes),
                         "trainer.total_training_steps=4")) == 2
    err = capsys.readouterr().err
    assert f"{run_dir} holds another experiment: its config.yaml differs in what defines the run: " in err
    for key in changes:
        assert f"{key} (saved " in err and new_values[key] in err.split(f"{key} (saved ", 1)[1].split(")", 1)[0]
    assert "trainer.total_training_steps" not in err  # a change that may be made is not an objection
    assert "trainer.default_local_dir=NEW_DIR" in err and "trainer.allow_config_change=true" in err
    assert folder_bytes(run_dir) == before
    assert train(args) == 0 and folder_bytes(run_dir) == before  # its own command: finished, nothing changes


def test_a_finished_runs_rerun_says_so_and_changes_nothing(rl_run: tuple[Path, list[str]],
                                                           caplog: pytest.LogCaptureFixture,
                                                           capsys: pytest.CaptureFixture) -> None:
    run_dir, args = rl_run
    before = folder_bytes(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val_before"] and summary["val_after"] and summary["steps"] == 2
    with caplog.at_level(logging.INFO, logger="archer"):
        assert train([*args, "trainer.logger=[console,jsonl]"]) == 0  # logging may change: still finished
    assert f"{run_dir}: this run finished at step 2 (summary.json); nothing to do" in caplog.text
    assert f"run directory: {run_dir}" in capsys.readouterr().out
    assert folder_bytes(run_dir) == before


def test_a_continued_run_keeps_its_figures_and_adds_up_its_wall_time(
        rl_run: tuple[Path, list[str]], caplog: pytest.LogCaptureFixture) -> None:
    run_dir, args = rl_run
    first = json.loads((run_dir / "summary.json").read_text())
    at_step_2 = torch.load(run_dir / "checkpoints" / "global_step_2" / "trainer_state.pt", weights_only=True)["run"]
    assert at_step_2["val_before"] == first["val_before"] and at_step_2["val_after"] == first["val_after"]
    assert 0 < at_step_2["wall_time_s"] <= first["wall_time_s"]
    started = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="archer"):
        assert train([*args, "trainer.total_training_steps=3", "trainer.test_freq=-1"]) == 0
    session = time.perf_counter() - started
    assert (f"{run_dir}: continuing with changed settings: trainer.test_freq (saved 2, now -1); "
            "trainer.total_training_steps (saved 2, now 3)") in caplog.text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["val_before"] == first["val_before"]  # validated at step 0, in the first session
    assert summary["val_after"] == first["val_after"]  # step 2's: the continued run did not validate again
    assert at_step_2["wall_time_s"] < summary["wall_time_s"] < at_step_2["wall_time_s"] + session
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]


def test_allow_config_change_continues_another_experiment_and_says_what_changed(
        rl_run: tuple[Path, list[str]], caplog: pytest.LogCaptureFixture) -> None:
    run_dir, args = rl_run
    with caplog.at_level(logging.INFO, logger="archer"):
        assert train([*args, "trainer.seed=7", "trainer.total_training_steps=3", "trainer.allow_config_change=true"]) == 0
    assert (f"{run_dir}: continuing with changed settings (trainer.allow_config_change=true): trainer.seed "
            "(saved 1, now 7)") in caplog.text
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


# -- archer sft ----------------------------------------------------------------------------------------------------
def sft_args(run_dir: Path, model: Path, sft_file: Path, *extra: str) -> list[str]:
    return ["sft", f"model.partial_pretrain={model}", f"data.train_files={sft_file}", f"data.val_files={sft_file}",
            "data.train_batch_size=8", "data.micro_batch_size_per_gpu=8", "data.max_length=64",
            "trainer.total_training_steps=2", "trainer.logger=[jsonl]", "trainer.plots=false", "trainer.device=cpu",
            "model.enable_gradient_checkpointing=false", f"trainer.default_local_dir={run_dir}", *extra]


def test_sft_refuses_another_experiment_and_a_finished_rerun_changes_nothing(
        tmp_path: Path, micro_model: Path, task_files: dict[str, Path], capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    run_dir = tmp_path / "sft"
    args = sft_args(run_dir, micro_model, task_files["sft"])  # trainer.save_freq=-1: no checkpoint
    assert cli.main(args) == 0
    before = folder_bytes(run_dir)
    other = Path(shutil.copytree(micro_model, tmp_path / "other_model"))
    capsys.readouterr()
    assert cli.main([*args, f"model.partial_pretrain={other}", "optim.lr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert (f"{run_dir} holds another experiment: its config.yaml differs in what defines the run: "
            f'model.partial_pretrain (saved "{micro_model}", now "{other}"); optim.lr (saved 1e-05, now 0.001)') in err
    assert folder_bytes(run_dir) == before
    with caplog.at_level(logging.INFO, logger="archer"):
        assert cli.main(args) == 0
    assert f"{run_dir}: this run finished at step 2 (summary.json); nothing to do" in caplog.text
    assert f"SFT model: {run_dir / 'hf_model'}" in capsys.readouterr().out
    assert folder_bytes(run_dir) == before
    # more steps without a checkpoint to continue from: refused, and the folder stays as it is
    assert cli.main([*args, "trainer.total_training_steps=3"]) == 2
    assert f"{run_dir} finished at step 2 but has no complete checkpoint to continue from" in capsys.readouterr().err
    assert folder_bytes(run_dir) == before


def test_an_sft_run_resumed_at_its_last_checkpoint_keeps_its_final_figures(
        tmp_path: Path, micro_model: Path, task_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from archer.trainer import sft

    run_dir = tmp_path / "sft"
    args = sft_args(run_dir, micro_model, task_files["sft"], "trainer.save_freq=1")

    def killed(*_args: object) -> None:
        raise KeyboardInterrupt  # the run dies after its last checkpoint, before its summary

    with monkeypatch.context() as patch:
        patch.setattr(sft, "_write_summary", killed)
        assert cli.main(args) == 130
    assert not (run_dir / "summary.json").exists()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert cli.main(args) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    assert summary["final_train_loss"] == metrics[-1]["train/loss"]
    assert summary["final_val_loss"] == metrics[-1]["val/loss"]
    state = torch.load(run_dir / "checkpoints" / "global_step_2" / "trainer_state.pt", weights_only=True)["run"]
    assert state["last"]["train/loss"] == metrics[-1]["train/loss"]
    assert state["wall_time_s"] < summary["wall_time_s"]
