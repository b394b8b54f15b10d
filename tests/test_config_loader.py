"""Config loading: overrides, unknown-key errors with suggestions, interpolation, types, single values for list
keys, struct, save."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError

from archer.config import loader
from archer.config.loader import as_list, load_config, save_config
from archer.errors import ArcherError
from archer.trainer.config_check import check_config

REQUIRED = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=/models/tiny"]

# verl's examples/grpo_trainer/run_qwen2-7b.sh, as users run it
VERL_GRPO_SCRIPT = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=a",
    "data.val_files=b",
    "data.train_batch_size=1024",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation='error'",
    "actor_rollout_ref.model.path=X",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    "trainer.logger=['console','wandb']",
    "trainer.project_name=p",
    "trainer.experiment_name=e",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]


def load(*overrides: str):
    return load_config("ppo_trainer", [*REQUIRED, *overrides])


def test_defaults_load_with_the_required_keys() -> None:
    cfg = load()
    assert cfg.data.train_files == "train.parquet"
    assert cfg.actor_rollout_ref.model.path == "/models/tiny"
    assert cfg.data.train_batch_size == 1024
    assert cfg.actor_rollout_ref.actor.optim.lr == 1.0e-6
    assert cfg.algorithm.adv_estimator == "gae"
    assert cfg.trainer.logger == ["console", "jsonl", "tensorboard"]


@pytest.mark.parametrize("prefix", ["", "+", "++"])
def test_plain_and_plus_overrides_of_known_keys_set_the_value(prefix: str) -> None:
    cfg = load(f"{prefix}data.train_batch_size=8", f"{prefix}actor_rollout_ref.rollout.temperature=0.7",
               f"{prefix}trainer.total_training_steps=12", f"{prefix}algorithm.adv_estimator=grpo")
    assert cfg.data.train_batch_size == 8
    assert cfg.actor_rollout_ref.rollout.temperature == 0.7
    assert cfg.trainer.total_training_steps == 12
    assert cfg.algorithm.adv_estimator == "grpo"


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("actor_rollout_ref.actor.ppo_mini_batchsize=64", "actor_rollout_ref.actor.ppo_mini_batch_size"),
        ("trainer.total_training_step=10", "trainer.total_training_steps"),
        ("+trainer.total_training_step=10", "trainer.total_training_steps"),
        ("++trainer.total_training_step=10", "trainer.total_training_steps"),
        ("actor_rollout_ref.rollout.temprature=0.5", "actor_rollout_ref.rollout.temperature"),
        ("algorithm.adv_estimater=grpo", "algorithm.adv_estimator"),
        ("+data.train_batch_sise=2", "data.train_batch_size"),
        ("actor_rollout_ref.actor.kl_loss_coeff=0.01", "actor_rollout_ref.actor.kl_loss_coef"),
        ("model=/models/qwen", "actor_rollout_ref.model.path"),  # a section's value is its path, not the section
        ("actor_rollout_ref.modle=/models/qwen", "actor_rollout_ref.model.path"),
    ],
)
def test_unknown_keys_raise_and_name_the_closest_known_key(override: str, suggestion: str) -> None:
    with pytest.raises(ArcherError) as err:
        load(override)
    key = override.lstrip("+").split("=")[0]
    assert f"unknown config key {key!r}" in str(err.value)
    assert f"did you mean {suggestion!r}?" in str(err.value)
    assert err.value.fix


def test_sub_keys_of_free_form_mappings_are_accepted() -> None:
    cfg = load("actor_rollout_ref.model.override_config.x=1",
               "+actor_rollout_ref.model.override_config.attention_dropout=0.0",
               "+data.apply_chat_template_kwargs.enable_thinking=False",
               "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4")
    assert OmegaConf.to_container(cfg.actor_rollout_ref.model.override_config) == {"x": 1, "attention_dropout": 0.0}
    assert cfg.data.apply_chat_template_kwargs.enable_thinking is False
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space == 4


def test_sub_keys_of_fixed_mappings_are_still_checked() -> None:
    with pytest.raises(ArcherError, match="did you mean 'actor_rollout_ref.actor.optim.lr'"):
        load("actor_rollout_ref.actor.optim.lrr=0.1")


def test_list_values() -> None:
    cfg = load("data.train_files=[a.parquet,b.parquet]", "trainer.logger=['console','tensorboard']")
    assert isinstance(cfg.data.train_files, ListConfig)
    assert list(cfg.data.train_files) == ["a.parquet", "b.parquet"]
    assert list(cfg.trainer.logger) == ["console", "tensorboard"]
    assert as_list(cfg.data.train_files) == ["a.parquet", "b.parquet"]
    assert as_list("one.parquet") == ["one.parquet"]
    assert as_list(None) == []


def test_interpolations_resolve_against_the_overridden_values() -> None:
    cfg = load("data.max_response_length=300", "data.max_prompt_length=100", "actor_rollout_ref.rollout.n=4",
               "trainer.project_name=proj", "trainer.experiment_name=exp")
    assert cfg.critic.model.path == "/models/tiny"
    assert cfg.critic.model.tokenizer_path == "/models/tiny"
    assert cfg.actor_rollout_ref.rollout.response_length == 300
    assert cfg.actor_rollout_ref.rollout.prompt_length == 100
    assert cfg.critic.rollout_n == 4
    assert cfg.trainer.default_local_dir == "runs/proj/exp"
    # the result holds plain values, not references
    assert not OmegaConf.is_interpolation(cfg.critic.model, "path")


def test_an_explicit_value_replaces_an_interpolation() -> None:
    cfg = load("critic.model.path=/models/critic")
    assert cfg.critic.model.path == "/models/critic"
    assert cfg.actor_rollout_ref.model.path == "/models/tiny"


def test_missing_required_keys_are_named() -> None:
    with pytest.raises(ArcherError) as err:
        load_config("ppo_trainer", [])
    assert err.value.problem == "required config key(s) not set: actor_rollout_ref.model.path"
    # data.train_files is required by training only (trainer.val_only needs none): config_check says so
    with pytest.raises(ArcherError, match="data.train_files is not set: training needs prompts"):
        check_config(load_config("ppo_trainer", ["actor_rollout_ref.model.path=m"]))
    check_config(load_config("ppo_trainer", ["actor_rollout_ref.model.path=m", "trainer.val_only=true",
                                             "data.val_files=v.parquet"]))


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("data.train_batch_size=abc", "data.train_batch_size must be int"),
        ("data.max_prompt_length=1.5", "data.max_prompt_length must be int"),
        ("actor_rollout_ref.actor.use_kl_loss=maybe", "actor_rollout_ref.actor.use_kl_loss must be bool"),
        ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr must be float"),
        ("actor_rollout_ref.actor.optim=5", "actor_rollout_ref.actor.optim must be a mapping"),
        ("actor_rollout_ref.model.override_config=5", "actor_rollout_ref.model.override_config must be a mapping"),
    ],
)
def test_type_errors_raise(override: str, fragment: str) -> None:
    with pytest.raises(ArcherError, match=fragment):
        load(override)


def test_a_float_key_accepts_an_int_and_nullable_keys_accept_values() -> None:
    cfg = load("actor_rollout_ref.actor.optim.lr=1", "actor_rollout_ref.actor.entropy_coeff=0",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "data.val_files=null")
    assert cfg.actor_rollout_ref.actor.optim.lr == 1
    assert cfg.actor_rollout_ref.actor.entropy_coeff == 0
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    assert cfg.data.val_files is None


def test_deleting_a_key_and_unparsable_overrides_raise() -> None:
    with pytest.raises(ArcherError, match="deletes a key"):
        load("~data.seed")
    with pytest.raises(ArcherError, match="cannot parse override"):
        load("data.seed")


def test_the_result_is_struct() -> None:
    cfg = load()
    with pytest.raises(ConfigAttributeError):
        cfg.data.not_a_key = 1
    with pytest.raises(ConfigAttributeError):
        _ = cfg.trainer.not_a_key
    assert OmegaConf.is_struct(cfg)


def test_save_config_writes_yaml_that_reloads_equal(tmp_path: Path) -> None:
    cfg = load("data.train_files=[a,b]", "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.model.override_config.x=1")
    path = tmp_path / "run" / "config.yaml"
    save_config(cfg, path)
    assert path.is_file() and not path.with_suffix(".yaml.tmp").exists()
    reloaded = OmegaConf.load(path)
    assert OmegaConf.to_container(reloaded) == OmegaConf.to_container(cfg)
    assert reloaded.critic.model.path == "/models/tiny"
    assert reloaded.actor_rollout_ref.rollout.n == 3


def test_a_verl_grpo_script_loads_unchanged() -> None:
    cfg = load_config("ppo_trainer", VERL_GRPO_SCRIPT)
    arr = cfg.actor_rollout_ref
    assert cfg.algorithm.adv_estimator == "grpo"
    assert (cfg.data.train_files, cfg.data.val_files) == ("a", "b")
    assert cfg.data.max_response_length == 1024 and arr.rollout.response_length == 1024
    assert cfg.data.filter_overlong_prompts is True and cfg.data.truncation == "error"
    assert arr.actor.optim.lr == 1e-6
    assert arr.actor.ppo_mini_batch_size == 256 and arr.actor.ppo_micro_batch_size_per_gpu == 40
    assert arr.actor.use_kl_loss is True and arr.actor.kl_loss_type == "low_var_kl"
    assert arr.actor.kl_loss_coef == 0.001 and arr.actor.entropy_coeff == 0
    assert arr.rollout.n == 5 and arr.rollout.name == "vllm" and arr.rollout.gpu_memory_utilization == 0.6
    assert arr.ref.fsdp_config.param_offload is True
    assert list(cfg.trainer.logger) == ["console", "wandb"]
    assert (cfg.trainer.save_freq, cfg.trainer.test_freq, cfg.trainer.total_epochs) == (20, 5, 15)
    assert cfg.critic.model.path == "X"


def test_other_common_verl_script_keys_are_accepted() -> None:
    cfg = load("actor_rollout_ref.model.use_liger=True",
               "actor_rollout_ref.model.use_fused_kernels=True",
               "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton",
               "trainer.use_legacy_worker_impl=auto",
               "actor_rollout_ref.actor.use_dynamic_bsz=True",
               "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000",
               "data.return_raw_chat=True",
               "trainer.val_before_train=False",
               "critic.optim.lr=1e-5",
               "critic.ppo_micro_batch_size_per_gpu=32",
               "critic.model.fsdp_config.optimizer_offload=False",
               "algorithm.kl_ctrl.kl_coef=0.001")
    assert cfg.actor_rollout_ref.model.use_liger is True
    assert cfg.actor_rollout_ref.model.fused_kernel_options.impl_backend == "triton"
    assert cfg.trainer.use_legacy_worker_impl == "auto"
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 24000
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 32


# -- a single value for a list key -------------------------------------------------------------------------
def test_a_single_value_for_a_list_key_is_a_one_element_list() -> None:
    cfg = load("trainer.logger=console", "trainer.influence_trace.layers=-1",
               "actor_rollout_ref.rollout.stop='</answer>'", "trainer.influence_trace.module_name_filter=mlp.down_proj")
    assert isinstance(cfg.trainer.logger, ListConfig)
    assert list(cfg.trainer.logger) == ["console"]  # not split into letters
    assert list(cfg.trainer.influence_trace.layers) == [-1]
    assert list(cfg.actor_rollout_ref.rollout.stop) == ["</answer>"]
    assert list(cfg.trainer.influence_trace.module_name_filter) == ["mlp.down_proj"]
    sft = load_config("sft_trainer", ["data.train_files=a", "model.partial_pretrain=m", "trainer.logger=jsonl"])
    assert list(sft.trainer.logger) == ["jsonl"]


def test_lists_nulls_and_path_keys_are_left_as_given() -> None:
    cfg = load("trainer.logger=[console,wandb]", "trainer.influence_trace.layers=[0,-1]")
    assert list(cfg.trainer.logger) == ["console", "wandb"]
    assert list(cfg.trainer.influence_trace.layers) == [0, -1]
    assert load().trainer.influence_trace.layers is None  # null: every layer
    assert load("trainer.logger=null").trainer.logger is None
    assert cfg.data.train_files == "train.parquet"  # a path or a list of paths, read with as_list


def test_every_list_key_with_a_null_default_is_marked_in_the_yaml() -> None:
    yaml_text = (loader.CONFIG_DIR / "ppo_trainer.yaml").read_text()
    marked = {line.split(":")[0].strip() for line in yaml_text.splitlines() if "# (list)" in line}
    declared = loader.NULL_DEFAULT_LIST_KEYS["ppo_trainer"]
    assert marked == {key.rsplit(".", 1)[-1] for key in declared} == {"layers", "k"}
    defaults = OmegaConf.load(loader.CONFIG_DIR / "ppo_trainer.yaml")
    assert all(OmegaConf.select(defaults, key) is None for key in declared)
    assert declared <= loader.list_keys("ppo_trainer")
    assert {"trainer.logger", "actor_rollout_ref.rollout.stop", "critic.optim.betas"} <= loader.list_keys("ppo_trainer")
