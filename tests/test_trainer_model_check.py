"""The RL run's sequence lengths against the model's positions (archer.trainer.model_check), checked after the
prompts are read and before any weights load, and the positions a model config gives (models.loading)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import GPT2Config, Qwen2Config

from archer.cli import main
from archer.config.loader import load_config
from archer.errors import ArcherError
from archer.models.loading import max_positions
from archer.trainer.model_check import check_sequence_lengths


def test_max_positions_reads_the_config_and_its_rope_stretch() -> None:
    assert max_positions(Qwen2Config(max_position_embeddings=512)) == 512
    assert max_positions(GPT2Config(n_positions=300)) == 300
    yarn = Qwen2Config(max_position_embeddings=32768, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                    "original_max_position_embeddings": 32768})
    assert max_positions(yarn) == 131072
    llama3 = Qwen2Config(max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    assert max_positions(llama3) == 131072  # llama3's configs state the stretched length themselves


def test_the_longest_prompt_plus_a_full_response_must_fit(tiny_model_dir: Path) -> None:
    cfg = load_config("ppo_trainer", [f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_files=x",
                                      "data.max_prompt_length=300", "data.max_response_length=56"])
    check_sequence_lengths(cfg, 200)  # 200 + 56 = the model's 256 positions
    with pytest.raises(ArcherError, match="prompts of up to 201 tokens") as err:
        check_sequence_lengths(cfg, 201)
    assert err.value.problem == (
        "prompts of up to 201 tokens (data.max_prompt_length=300) plus data.max_response_length=56 make sequences "
        f"of 257 tokens, beyond the 256 positions of the model {tiny_model_dir} (its max_position_embeddings)")
    assert "add up to at most 256" in err.value.fix


def test_archer_train_refuses_overlong_sequences_before_loading_weights(tiny_model_dir: Path, task_files,
                                                                         tmp_path: Path, capsys) -> None:
    """The issue's case (README's ARPO command on a 512-position model exited 0); here the weights are absent,
    so the error shows the check comes before they would load."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").unlink()
    run = tmp_path / "run"
    code = main(["train", f"actor_rollout_ref.model.path={model}", f"data.train_files={task_files['train']}",
                 "data.max_prompt_length=64", "data.max_response_length=250", "data.train_batch_size=4",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.device=cpu",
                 f"trainer.default_local_dir={run}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("archer: error: prompts of up to ")
    assert "data.max_response_length=250 make sequences of" in err and "beyond the 256 positions" in err
    assert not run.exists()
