"""A user's own verl-layout YAML (``--config-path/--config-name``), verl's keys archer lacks (renamed, accepted
with a warning, refused), Hydra's ``hydra.run.dir`` and empty overrides, ``rollout.mode`` and verl's tool class
paths checked before any data loads: all through ``archer.cli.main`` as a user runs them."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from archer.cli import _enter_hydra_run_dir, main
from archer.config import no_ops
from archer.config.loader import hydra_settings, load_config
from archer.config.no_ops import SCHEMA_LESS_KEYS
from archer.config.verl_compat import VERL_KEYS
from archer.errors import ArcherError
from archer.tools.registry import VERL_TOOLS

ARPO_YAML = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "arpo" / "published" / "ppo_trainer.yaml"
needs_arpo = pytest.mark.skipif(not ARPO_YAML.is_file(), reason="ARPO's published config is not in ../shared/data")
ROLL = "actor_rollout_ref.rollout"
REQUIRED = ["data.train_files=/nonexistent/train.parquet", "actor_rollout_ref.model.path=/nonexistent/model"]

ONE_DEVICE = (f"{ROLL}.tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1")


def cfg_job(capsys, *args: str) -> tuple[int, dict | None, str]:
    """``archer train --cfg job ARGS``: exit status, the printed config, stderr."""
    code = main(["train", "--cfg", "job", *args])
    out, err = capsys.readouterr()
    return code, (yaml.safe_load(out) if code == 0 else None), err


def user_yaml(tmp_path: Path, tree: dict, name: str = "mine.yaml") -> Path:
    (tmp_path / name).write_text(yaml.safe_dump(tree), encoding="utf-8")
    return tmp_path


@needs_arpo
def test_arpo_published_config_loads_with_its_values(capsys, caplog) -> None:
    # as published the file asks for 8 GPUs and a tensor-parallel engine of 2: refused until archer runs on many
    code, _, err = cfg_job(capsys, f"--config-path={ARPO_YAML.parent}", "--config-name=ppo_trainer.yaml",
                           *REQUIRED, f"{ROLL}.multi_turn.enable=")
    assert code == 2 and "cannot be honoured" in err and "fix: set" in err
    # with one device, as ARPO's launch script sets the engine (tensor_model_parallel_size=1) and N_GPUS_PER_NODE=1
    code, cfg, err = cfg_job(capsys, f"--config-path={ARPO_YAML.parent}", "--config-name=ppo_trainer.yaml",
                             *REQUIRED, *ONE_DEVICE, f"{ROLL}.multi_turn.enable=")
    assert code == 0, err
    rollout = cfg["actor_rollout_ref"]["rollout"]
    assert rollout["beam_size"] == 1 and isinstance(rollout["beam_size"], int)  # ARPO writes 1.
    assert (rollout["name"], rollout["tensor_model_parallel_size"], rollout["enforce_eager"]) == ("vllm", 1, True)
    assert rollout["multi_turn"]["format"] == "arpo"  # verl's chatml (multi_turn off) leaves ARPO's format
    tools = rollout["tools"]
    assert (tools["call_limit"], tools["timeout"]) == (3, 120)
    assert tools["tool_instances"]["python"] == {"class_path": "verl.workers.rollout.tools.python_tool.PythonTool",
                                                 "params": {"conda_path": "<your_conda_path>", "conda_env": "verl"}}
    assert tools["tool_instances"]["search"]["params"]["max_results"] == 10
    assert cfg["actor_rollout_ref"]["actor"]["checkpoint"]["save_contents"] == ["model", "optimizer", "extra"]
    assert (cfg["trainer"]["device"], cfg["trainer"]["logger"]) == ("cuda", ["console", "wandb"])
    assert cfg["critic"]["optim"]["lr"] == 1e-5 and cfg["data"]["train_files"] == "/nonexistent/train.parquet"
    assert "ray_init" not in cfg and "use_pf_ppo" not in cfg["algorithm"]


@needs_arpo
def test_the_spaced_and_short_forms_and_a_name_without_yaml(capsys) -> None:
    spaced = cfg_job(capsys, "--config-path", str(ARPO_YAML.parent), "--config-name", "ppo_trainer.yaml", *REQUIRED,
                     *ONE_DEVICE)
    short = cfg_job(capsys, "-cp", str(ARPO_YAML.parent), "-cn", "ppo_trainer", *REQUIRED, *ONE_DEVICE)
    assert spaced[0] == short[0] == 0 and spaced[1] == short[1]
    assert spaced[1]["trainer"]["project_name"] == "verl_examples"


def test_overrides_apply_after_the_users_file(tmp_path, capsys) -> None:
    folder = user_yaml(tmp_path, {"data": {"train_batch_size": 8, "max_prompt_length": 64},
                                  "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}}})
    code, cfg, err = cfg_job(capsys, f"--config-path={folder}", "--config-name=mine.yaml", *REQUIRED,
                             "data.train_batch_size=16")
    assert code == 0, err
    assert (cfg["data"]["train_batch_size"], cfg["data"]["max_prompt_length"]) == (16, 64)
    assert cfg["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] == 4
    assert cfg["data"]["max_response_length"] == 512  # archer's default where the file is silent


def test_an_unknown_key_in_the_file_names_the_nearest_key(tmp_path, capsys) -> None:
    folder = user_yaml(tmp_path, {"data": {"train_batch_sise": 8}})
    code, _, err = cfg_job(capsys, f"--config-path={folder}", "--config-name=mine.yaml", *REQUIRED)
    assert code == 2
    assert f"{folder / 'mine.yaml'}: unknown config key 'data.train_batch_sise': did you mean 'data.train_batch_size'?" in err


def test_a_missing_file_and_a_path_without_name_are_clear_errors(tmp_path, capsys) -> None:
    code, _, err = cfg_job(capsys, f"--config-path={tmp_path}", "--config-name=absent.yaml", *REQUIRED)
    assert code == 2 and f"config file {tmp_path / 'absent.yaml'} does not exist" in err
    code, _, err = cfg_job(capsys, f"--config-path={tmp_path}", *REQUIRED)
    assert code == 2 and "--config-path is given without --config-name" in err


def test_a_malformed_or_non_mapping_file_is_one_clear_error(tmp_path, capsys) -> None:
    (tmp_path / "bad.yaml").write_text("data:\n  train_batch_size: [1,\n", encoding="utf-8")
    (tmp_path / "list.yaml").write_text("- a\n- b\n", encoding="utf-8")
    code, _, err = cfg_job(capsys, f"--config-path={tmp_path}", "--config-name=bad.yaml", *REQUIRED)
    assert code == 2 and err.startswith(f"archer: error: config file {tmp_path / 'bad.yaml'} cannot be read: ")
    assert "fix: fix the YAML" in err
    code, _, err = cfg_job(capsys, f"--config-path={tmp_path}", "--config-name=list.yaml", *REQUIRED)
    assert code == 2 and "is not a mapping of config sections" in err


def test_a_defaults_list_is_refused(tmp_path, capsys) -> None:
    folder = user_yaml(tmp_path, {"defaults": ["_self_"], "data": {"train_batch_size": 8}})
    code, _, err = cfg_job(capsys, f"--config-path={folder}", "--config-name=mine.yaml", *REQUIRED)
    assert code == 2 and "has a 'defaults' section" in err


def test_a_result_changing_verl_key_is_refused_and_a_neutral_one_passes(tmp_path, capsys) -> None:
    on = user_yaml(tmp_path, {"actor_rollout_ref": {"rollout": {"use_fire_sampling": True}}}, "on.yaml")
    code, _, err = cfg_job(capsys, f"--config-path={on}", "--config-name=on.yaml", *REQUIRED)
    assert code == 2
    assert "actor_rollout_ref.rollout.use_fire_sampling=True cannot be honoured: FIRE sampling is not in archer" in err
    assert f"fix: set {ROLL}.use_fire_sampling=False" in err
    off = user_yaml(tmp_path, {"actor_rollout_ref": {"rollout": {"use_fire_sampling": False}}}, "off.yaml")
    assert cfg_job(capsys, f"--config-path={off}", "--config-name=off.yaml", *REQUIRED)[0] == 0


def test_a_key_without_effect_warns_only_off_its_neutral_value(tmp_path, caplog, monkeypatch) -> None:
    monkeypatch.setattr(no_ops, "_warned", set())  # warnings are given once a process
    tree = {"data": {"image_key": "pixels", "custom_cls": {"path": None, "name": None}},
            "critic": {"model": {"lora_rank": 0}}, "algorithm": {"use_pf_ppo": False, "pf_ppo": {"weight_pow": 3.0}},
            "actor_rollout_ref": {"rollout": {"agent": {"name": "tool_agent"}}}}
    with caplog.at_level(logging.WARNING, logger="archer.config"):
        load_config("ppo_trainer", REQUIRED, user_config=user_yaml(tmp_path, tree) / "mine.yaml")
    assert caplog.messages == []  # every value is neutral (or the key changes no result at any value)
    tree["actor_rollout_ref"]["rollout"]["agent"]["name"] = "my_agent"
    with caplog.at_level(logging.WARNING, logger="archer.config"):
        load_config("ppo_trainer", REQUIRED, user_config=user_yaml(tmp_path, tree) / "mine.yaml")
        load_config("ppo_trainer", REQUIRED, user_config=user_yaml(tmp_path, tree) / "mine.yaml")
    assert caplog.messages == [f"{tmp_path / 'mine.yaml'}: {ROLL}.agent.name='my_agent' has no effect in archer: "
                               "archer has one tool loop (ARPO's tool_agent)"]  # once, however often it loads


def test_renamed_keys_land_on_archers_keys(tmp_path) -> None:
    tree = {"critic": {"checkpoint": {"contents": ["model"]}},
            "actor_rollout_ref": {"rollout": {"agent": {"activate_agent": True, "name": "tool_agent",
                                                        "tools": {"call_limit": 6, "tool_instances": {
                                                            "python": {"class_path": "python"}}}}}}}
    cfg = load_config("ppo_trainer", REQUIRED, user_config=user_yaml(tmp_path, tree) / "mine.yaml")
    assert cfg.critic.checkpoint.save_contents == ["model"]
    assert cfg.actor_rollout_ref.rollout.tools.call_limit == 6  # ARPO's deep-search layout (rollout.agent.tools)
    assert OmegaConf.to_container(cfg.actor_rollout_ref.rollout.tools.tool_instances) == {
        "python": {"class_path": "python"}}


def test_multi_turn_enable_empty_or_false_passes_true_is_refused(capsys) -> None:
    for value in ("", "false", "False", "null"):
        assert cfg_job(capsys, *REQUIRED, f"{ROLL}.multi_turn.enable={value}")[0] == 0, value
    code, _, err = cfg_job(capsys, *REQUIRED, f"{ROLL}.multi_turn.enable=true")
    assert code == 2 and "override: actor_rollout_ref.rollout.multi_turn.enable=True cannot be honoured" in err


def test_an_empty_value_of_a_boolean_key_is_false_as_verl_reads_it(capsys, caplog) -> None:
    code, cfg, err = cfg_job(capsys, *REQUIRED, "trainer.val_before_train=")
    assert code == 0, err
    assert cfg["trainer"]["val_before_train"] is False
    assert "'trainer.val_before_train=' has an empty value (an unset shell variable?): read as false" in caplog.text


def test_hydra_settings_are_split_off_and_others_refused() -> None:
    rest, hydra = hydra_settings(["a.b=1", "hydra.run.dir=/x/outputs", "hydra.job.chdir=false"])
    assert rest == ["a.b=1"] and hydra == {"hydra.run.dir": "/x/outputs", "hydra.job.chdir": "false"}
    with pytest.raises(ArcherError, match="Hydra setting 'hydra.verbose=true' is not supported"):
        hydra_settings(["hydra.verbose=true"])


def test_hydra_run_dir_records_the_job_and_becomes_the_working_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config("ppo_trainer", REQUIRED)
    overrides = [*REQUIRED, "hydra.run.dir=out/outputs"]
    _enter_hydra_run_dir({"hydra.run.dir": "out/outputs"}, cfg, overrides)
    run_dir = tmp_path / "out" / "outputs"
    assert Path(os.getcwd()) == run_dir
    assert OmegaConf.load(run_dir / ".hydra" / "config.yaml") == cfg
    assert OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")) == overrides
    monkeypatch.chdir(tmp_path)
    _enter_hydra_run_dir({"hydra.run.dir": "kept", "hydra.job.chdir": "false"}, cfg, overrides)
    assert Path(os.getcwd()) == tmp_path and (tmp_path / "kept" / ".hydra" / "config.yaml").is_file()


def test_rollout_mode_takes_verls_values_and_sync_with_tool_needs_a_tool(capsys) -> None:
    for mode in ("sync", "async"):
        assert cfg_job(capsys, *REQUIRED, f"{ROLL}.mode={mode}")[0] == 0
    code, _, err = cfg_job(capsys, *REQUIRED, f"{ROLL}.mode=sync_with_tool")
    assert code == 2 and "mode=sync_with_tool (ARPO: rollouts with tools) but no tool is configured" in err
    tool = f"+{ROLL}.tools.tool_instances.python.class_path=verl.workers.rollout.tools.python_tool.PythonTool"
    assert cfg_job(capsys, *REQUIRED, f"{ROLL}.mode=sync_with_tool", tool)[0] == 0
    code, _, err = cfg_job(capsys, *REQUIRED, f"{ROLL}.mode=sync_tools")
    assert code == 2 and "unknown actor_rollout_ref.rollout.mode 'sync_tools'" in err


def test_a_wrong_tool_class_path_or_param_fails_at_config_check_before_data(capsys) -> None:
    """The train file does not exist: the tool's error comes first, from the config check."""
    tools = f"+{ROLL}.tools.tool_instances"
    code, _, err = cfg_job(capsys, *REQUIRED, f"{tools}.search.class_path=verl.workers.rollout.tools.search_tool.GoogleTool")
    assert code == 2
    assert "tool 'search': verl's 'verl.workers.rollout.tools.search_tool.GoogleTool' has no archer counterpart" in err
    code, _, err = cfg_job(capsys, *REQUIRED, f"{tools}.search.class_path=verl.workers.agent.tools.search_tool.BingSearchTool",
                           f"+{tools}.search.params.api_keys=k")
    assert code == 2 and "tool 'search': bad params for BingSearchTool" in err and "api_key" in err
    code = main(["train", *REQUIRED, f"{tools}.py.class_path=archer.tools.nowhere.Tool"])
    assert code == 2 and "tool 'py': cannot import 'archer.tools.nowhere.Tool'" in capsys.readouterr().err


def test_the_porting_page_names_every_verl_key_of_the_table() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "porting.md").read_text(encoding="utf-8")
    section = page.split("# Porting from verl, Archer2.0 or ARPO", 1)[1].split("\n## ", 1)[0]
    for key in [*VERL_KEYS, *SCHEMA_LESS_KEYS]:
        leaf = key.removesuffix(".*").rsplit(".", 1)[-1]
        assert leaf in section, key
    for class_path in VERL_TOOLS:
        assert f"`{class_path}`" in section, class_path


def test_sft_reads_a_users_file_too(tmp_path, capsys) -> None:
    folder = user_yaml(tmp_path, {"data": {"max_length": 2048, "train_batch_size": 8}, "optim": {"lr": 2e-6}})
    code = main(["sft", "--cfg", "job", f"--config-path={folder}", "--config-name=mine",
                 "data.train_files=/nonexistent/sft.jsonl", "model.partial_pretrain=/nonexistent/model",
                 "data.train_batch_size=16"])
    out, err = capsys.readouterr()
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert (cfg["data"]["max_length"], cfg["data"]["train_batch_size"], cfg["optim"]["lr"]) == (2048, 16, 2e-6)


def test_archer2_switches_map_or_are_refused(capsys) -> None:
    code, cfg, err = cfg_job(capsys, *REQUIRED, "+actor_rollout_ref.actor.use_archer_policy_loss=True",
                             "+trainer.enable_overlong_filter=False", "+actor_rollout_ref.actor.use_dynamic_clip=False")
    assert code == 0, err
    assert cfg["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"] == "aspo"
    code, cfg, err = cfg_job(capsys, *REQUIRED, "actor_rollout_ref.actor.use_archer_policy_loss=False",
                             "actor_rollout_ref.actor.policy_loss.loss_mode=gspo")
    assert code == 0 and cfg["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"] == "gspo"
    code, _, err = cfg_job(capsys, *REQUIRED, "+trainer.enable_overlong_filter=True")
    assert code == 2 and "trainer.enable_overlong_filter=True cannot be honoured: Archer2.0's overlong filter" in err
