"""archer.trainer.config_check: counts below 1, the resume and val_only modes, checked before any data or model
loads (the CLI case points at a model and data files that do not exist, so only the config can be at fault)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from archer.config.loader import load_config
from archer.errors import ArcherError
from archer.trainer.config_check import COUNT_KEYS, NULLABLE_COUNT_KEYS, check_config

REQUIRED = ["actor_rollout_ref.model.path=/no/model", "data.train_files=/no/train.parquet",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]


def config(*overrides: str):
    return load_config("ppo_trainer", [*REQUIRED, *overrides])


@pytest.mark.parametrize(("key", "value"), [
    ("data.train_batch_size", 0),  # was a ZeroDivisionError traceback
    ("data.train_batch_size", -8),  # was "must divide"
    ("actor_rollout_ref.actor.ppo_mini_batch_size", 0),
    ("actor_rollout_ref.rollout.n", 0),  # was "n=0" from the engine, after the model loaded
    ("data.max_response_length", 0),  # was "max_new_tokens=0", after the model loaded
    ("data.max_prompt_length", -1),
    ("data.val_batch_size", 0),
    ("data.gen_batch_size", 0),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 0),
    ("actor_rollout_ref.actor.ppo_epochs", 0),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", -2),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 0),
    ("actor_rollout_ref.rollout.val_kwargs.n", 0),
    ("critic.ppo_micro_batch_size_per_gpu", 0),
    ("critic.forward_micro_batch_size_per_gpu", 0),
    ("trainer.total_training_steps", 0),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 0),  # the token budgets of use_dynamic_bsz
    ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", -1),
    ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", 0),
    ("critic.forward_max_token_len_per_gpu", 0),
    ("actor_rollout_ref.actor.logprob_chunk_size", 0),  # null: the automatic chunk
    ("actor_rollout_ref.rollout.response_length", 0),  # was "max_new_tokens=0", after the model loaded
    ("actor_rollout_ref.rollout.prompt_length", 0),
    ("actor_rollout_ref.rollout.max_num_seqs", 0),  # the fast engine refused these only after the model loaded
    ("actor_rollout_ref.rollout.max_num_batched_tokens", -1),
    ("actor_rollout_ref.rollout.max_model_len", 0),  # was read as null (prompt_length + response_length)
    ("actor_rollout_ref.rollout.max_model_len", -4),  # null: prompt_length + response_length
])
def test_a_count_below_one_is_refused_naming_its_key(key: str, value: int) -> None:
    with pytest.raises(ArcherError) as err:
        check_config(config(f"{key}={value}"))
    assert err.value.problem == f"{key}={value} must be an integer of at least 1"
    assert err.value.fix.startswith(f"set {key} to a positive integer")


def test_a_nullable_count_must_still_be_an_integer() -> None:
    with pytest.raises(ArcherError) as err:
        check_config(config("data.val_batch_size=all"))
    assert err.value.problem == "data.val_batch_size='all' must be an integer of at least 1"
    assert err.value.fix == "set data.val_batch_size to a positive integer (or null)"


def test_defaults_and_set_counts_pass() -> None:
    check_config(config())
    check_config(config("data.val_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                        "actor_rollout_ref.rollout.n=1", "trainer.total_training_steps=1",
                        "actor_rollout_ref.rollout.max_model_len=1024"))
    cfg = config()
    assert all(OmegaConf.select(cfg, key) is None for key in NULLABLE_COUNT_KEYS)
    assert all(OmegaConf.select(cfg, key) >= 1 for key in COUNT_KEYS)


def test_a_loss_mode_and_a_switch_it_does_not_take_are_refused_before_the_model_loads() -> None:
    with pytest.raises(ArcherError, match="unknown policy loss 'ppo'"):
        check_config(config("actor_rollout_ref.actor.policy_loss.loss_mode=ppo"))
    with pytest.raises(ArcherError, match="enable_entropy_balanced_clipping=true does not apply to "
                                          "policy_loss.loss_mode=gspo"):
        check_config(config("actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                            "actor_rollout_ref.actor.enable_entropy_balanced_clipping=true"))
    check_config(config("actor_rollout_ref.actor.policy_loss.loss_mode=archer",
                        "actor_rollout_ref.actor.enable_entropy_balanced_clipping=true"))


def test_resume_path_without_a_path_names_the_unset_key() -> None:
    with pytest.raises(ArcherError) as err:
        check_config(config("trainer.resume_mode=resume_path"))
    assert err.value.problem == "trainer.resume_mode=resume_path but trainer.resume_from_path is not set"
    assert "trainer.resume_from_path=<run>/checkpoints/global_step_N" in err.value.fix
    check_config(config("trainer.resume_mode=resume_path", "trainer.resume_from_path=/runs/a/checkpoints/global_step_2"))


def test_val_only_without_validation_files_is_an_error() -> None:
    with pytest.raises(ArcherError) as err:
        check_config(config("trainer.val_only=true"))
    assert err.value.problem == "trainer.val_only=true but data.val_files is not set: there is nothing to validate"
    assert "data.val_files" in err.value.fix
    check_config(config("trainer.val_only=true", "data.val_files=/no/val.parquet"))


def test_the_cli_reports_a_bad_count_before_reading_data_or_model() -> None:
    proc = subprocess.run([sys.executable, "-m", "archer.cli", "train", *REQUIRED, "data.train_batch_size=0"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2
    assert proc.stderr == ("archer: error: data.train_batch_size=0 must be an integer of at least 1\n"
                           "  fix: set data.train_batch_size to a positive integer\n")
