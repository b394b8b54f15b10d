"""Tests of the `archer` command line: help (with the main config keys), --cfg job, data generation, SFT,
RL training with verl's non-default data keys, and the required-keys error, each in a subprocess as a user
runs them."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from archer.config.loader import CONFIG_DIR, load_config

ARCHER = [sys.executable, "-m", "archer.cli"]
SUBPROCESS_TIMEOUT_S = 240
RL_COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def run_archer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ARCHER, *args], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


@pytest.fixture(scope="module")
def data_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("cli") / "data"
    proc = run_archer("data", "--task", "arithmetic", "--out", str(out), "--train-size", "20", "--val-size", "5")
    return out, proc


def test_help_lists_the_commands() -> None:
    exe = shutil.which("archer")
    assert exe is not None, "the `archer` console script is not installed (pip install -e .)"
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: archer")
    for command in ("train", "sft", "data", "quickstart"):
        assert f"    {command} " in proc.stdout, command


def test_train_without_arguments_names_the_required_keys() -> None:
    proc = run_archer("train")
    assert proc.returncode == 2
    assert proc.stderr == ("archer: error: required config key(s) not set: actor_rollout_ref.model.path\n"
                           "  fix: pass them on the command line, e.g. actor_rollout_ref.model.path=VALUE\n")


def test_data_writes_the_three_parquet_files(data_run) -> None:
    out, proc = data_run
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"{name}: {out / name}.parquet" for name in ("train", "val", "sft")]
    train, val, sft = (pq.read_table(out / f"{name}.parquet") for name in ("train", "val", "sft"))
    assert (train.num_rows, val.num_rows, sft.num_rows) == (20, 5, 20)  # SFT rows default to --train-size
    assert train.column_names == RL_COLUMNS and val.column_names == RL_COLUMNS
    assert sft.column_names == ["prompt", "response"]
    questions = {name: {r["prompt"][0]["content"] for r in table.to_pylist()}
                 for name, table in (("train", train), ("val", val), ("sft", sft))}
    assert [len(q) for q in questions.values()] == [20, 5, 20]  # distinct problems ...
    assert not (questions["val"] & (questions["train"] | questions["sft"]))  # ... none of val's seen in training
    row = val.to_pylist()[0]
    assert row["data_source"] == "archer/arithmetic" and row["ability"] == "math"
    assert row["reward_model"]["style"] == "rule"
    assert row["extra_info"]["split"] == "val"


def test_sft_on_generated_data_writes_a_loadable_model(data_run, tiny_model_dir: Path, tmp_path: Path) -> None:
    data, data_proc = data_run
    assert data_proc.returncode == 0, data_proc.stderr
    run = tmp_path / "sft"
    proc = run_archer("sft", f"model.partial_pretrain={tiny_model_dir}", f"data.train_files={data / 'sft.parquet'}",
                      f"trainer.default_local_dir={run}", "trainer.total_training_steps=2", "data.train_batch_size=4",
                      "data.micro_batch_size_per_gpu=2", "data.max_length=96", "optim.lr=1e-3",
                      "trainer.logger=[jsonl]", "trainer.plots=False", "trainer.device=cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"SFT model: {run / 'hf_model'}"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train_lines] == [1, 2]
    assert all(math.isfinite(r["train/loss"]) and r["train/loss"] > 0 for r in train_lines)
    start = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(str(run / "hf_model")).state_dict()
    assert start.keys() == trained.keys()
    assert max(float((start[k] - trained[k]).abs().max()) for k in start) > 1e-4
    assert all(torch.isfinite(v).all() for v in trained.values())


@pytest.mark.parametrize(("command", "config_name", "shown"), [
    ("train", "ppo_trainer", ["data.train_files = null", "data.train_batch_size = 1024",
                              "actor_rollout_ref.rollout.n = 1", "algorithm.adv_estimator = gae",
                              "trainer.logger = [console, jsonl, tensorboard]", "trainer.val_only = false",
                              "algorithm.rollout_correction.bypass_mode = false", "trainer.v1.trainer_mode = sync",
                              "config groups: algorithm=NAME, NAME one of aepo, archer, arpo, aspo, clip_cov,"]),
    ("sft", "sft_trainer", ["model.partial_pretrain = ??? (required)", "data.micro_batch_size_per_gpu = 4",
                            "optim.lr_scheduler = cosine", "trainer.logger = [console, jsonl]"]),
])
def test_training_help_lists_the_main_keys_with_defaults(command: str, config_name: str, shown: list[str]) -> None:
    proc = run_archer(command, "--help")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for text in shown:
        assert any(line.strip().startswith(text) for line in lines), text
    assert f"every key, with what it does: {CONFIG_DIR / config_name}.yaml" in lines
    assert "--cfg job prints the resolved config and exits" in proc.stdout
    assert any(line.startswith("config sections: data, ") for line in lines)


def test_cfg_job_prints_the_resolved_config_and_runs_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    overrides = ["data.train_files=a.parquet", "actor_rollout_ref.model.path=/no/model", "algorithm=grpo",
                 "trainer.logger=console", "actor_rollout_ref.rollout.n=4", f"trainer.default_local_dir={run}"]
    proc = run_archer("train", "--cfg", "job", *overrides)
    assert proc.returncode == 0, proc.stderr
    assert OmegaConf.to_container(OmegaConf.create(proc.stdout)) == OmegaConf.to_container(
        load_config("ppo_trainer", overrides))
    assert "  logger:\n  - console\n" in proc.stdout and "rollout_n: 4" in proc.stdout  # lists and resolved values
    assert not run.exists()
    bad = run_archer("train", *overrides, "data.max_response_length=0", "--cfg", "job")  # checked as well
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("archer: error: data.max_response_length=0 must be an integer of at least 1")
    sft = run_archer("sft", "--cfg", "job", "data.train_files=s.parquet", "model.partial_pretrain=/no/model")
    assert sft.returncode == 0 and OmegaConf.create(sft.stdout).model.partial_pretrain == "/no/model"


def test_sft_cfg_job_checks_the_config_before_printing_it() -> None:
    """As `archer train --cfg job`: a value sft cannot train with is refused, nothing printed (it printed it)."""
    bad = run_archer("sft", "--cfg", "job", "data.train_files=s.parquet", "model.partial_pretrain=/no/model",
                     "data.micro_batch_size_per_gpu=0")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("archer: error: data.micro_batch_size_per_gpu must be positive")


def test_train_reads_a_non_default_prompt_key_and_reward_fn_key(micro_model: Path, task_files: dict[str, Path],
                                                                tmp_path: Path) -> None:
    """A verl script's data.prompt_key=question (and data.reward_fn_key) end to end through `archer train`."""
    files = {}
    for split in ("train", "val"):
        rows = pq.read_table(task_files[split]).to_pylist()
        table = pa.table({"data_source": [r["data_source"] for r in rows],
                          "question": [r["prompt"] for r in rows],
                          "task": ["digits"] * len(rows),
                          "reward_model": [r["reward_model"] for r in rows]})
        files[split] = tmp_path / f"{split}.parquet"
        pq.write_table(table, files[split])
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0 if data_source == 'digits' else -1.0\n")
    run = tmp_path / "run"
    proc = run_archer("train", f"actor_rollout_ref.model.path={micro_model}", f"data.train_files={files['train']}",
                      f"data.val_files={files['val']}", "data.prompt_key=question", "data.reward_fn_key=task",
                      f"custom_reward_function.path={reward}", "algorithm.adv_estimator=grpo",
                      "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                      "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=48", "data.max_response_length=8",
                      "trainer.total_training_steps=1", "trainer.logger=console", "trainer.plots=false",
                      "trainer.device=cpu", f"trainer.default_local_dir={run}")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["val-aux/archer/arithmetic/score/mean@1"] == 1.0  # the reward saw the task column
    assert records[1]["critic/score/mean"] == 1.0
    assert not (run / "tensorboard").exists()  # trainer.logger=console is [console] (+ jsonl), not letters


@pytest.mark.parametrize("case", ["no_ground_truth", "no_rows"])
def test_train_refuses_unusable_prompt_files_at_load_time(case: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / f"{case}.parquet"
    truths = ["4", None, None] if case == "no_ground_truth" else []
    pq.write_table(pa.table({"data_source": ["archer/arithmetic"] * len(truths), "prompt": [f"{i}+{i}?" for i in range(len(truths))],
                             "reward_model": [{"ground_truth": t} for t in truths]},
                            schema=pa.schema([("data_source", pa.string()), ("prompt", pa.string()),
                                              ("reward_model", pa.struct([("ground_truth", pa.string())]))])), path)
    proc = run_archer("train", f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={path}",
                      "data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                      "data.max_response_length=4", "trainer.total_training_steps=1", "trainer.device=cpu",
                      f"trainer.default_local_dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    expected = {"no_ground_truth": f"{path}: 2 of 3 rows have no reward_model.ground_truth; the first is row 1 ('1+1?')",
                "no_rows": f"{path} has no rows"}[case]
    assert proc.stderr.startswith(f"archer: error: {expected}\n  fix: "), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


LOGGING_PROBE = """
import logging, sys, warnings
from archer.cli import QUIET_WARNINGS, quiet_libraries, setup_logging
verbose = sys.argv[1] == "-v"
setup_logging(verbose)
quiet_libraries(verbose)
logging.getLogger("archer.data").info("archer's own line")
logging.getLogger("bm25s").debug("Building index from IDs objects")
logging.getLogger("bm25s").info("a library notice")
logging.info("Closed file and mmap objects")
warnings.warn("`past_key_values` is deprecated and will be removed in version 5.40.0", FutureWarning)
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_only_archers_own_lines_show_unless_verbose(verbose: bool) -> None:
    """The issue's noise: bm25s's DEBUG/INFO, the root logger's INFO and the past_key_values FutureWarning."""
    proc = subprocess.run([sys.executable, "-c", LOGGING_PROBE, "-v" if verbose else "-"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert "INFO archer.data: archer's own line" in lines
    noise = ["DEBUG bm25s: Building index from IDs objects", "INFO bm25s: a library notice",
             "INFO root: Closed file and mmap objects"]
    assert all((line in lines) == verbose for line in noise), lines
    assert ("past_key_values" in proc.stderr) == verbose


def test_build_index_prints_no_library_lines(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "The Nile is a river in Africa."}\n')
    proc = run_archer("build-index", "--corpus", str(corpus), "--out", str(tmp_path / "index"))
    assert proc.returncode == 0 and proc.stdout == f"BM25 index of 1 passages: {tmp_path / 'index'}\n"
    assert "bm25s" not in proc.stderr and "DEBUG" not in proc.stderr
