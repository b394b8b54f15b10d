"""The keys archer accepts without acting on them (config/no_ops.py, one table for archer's schema keys and
verl's keys archer lacks): the table matches the YAML's markers, the defaults and the values under which archer
does what verl does are silent, another value warns once naming the key (once, however often the config is
checked), and a value whose no-op would change the result is refused."""

from __future__ import annotations

import logging
import re

import pytest
from omegaconf import OmegaConf

from archer.config import no_ops
from archer.config.loader import CONFIG_DIR, group_options, load_config
from archer.config.no_ops import NO_OPS, check_no_ops, set_no_ops
from archer.errors import ArcherError
from archer.trainer.config_check import check_config

REQUIRED = ["actor_rollout_ref.model.path=m", "data.train_files=x"]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no warning given yet (they are given once a process)."""
    monkeypatch.setattr(no_ops, "_warned", set())


def marked_keys() -> set[str]:
    """Leaf keys of ppo_trainer.yaml marked "(accepted", or inside a mapping so marked."""
    stack: list[str] = []
    blocks: list[str] = []
    marked: set[str] = set()
    for line in (CONFIG_DIR / "ppo_trainer.yaml").read_text().splitlines():
        match = re.match(r"^(\s*)([A-Za-z_0-9]+):\s*(.*)$", line)
        if not match or match.group(2) == "defaults":
            continue
        stack = stack[: len(match.group(1)) // 2] + [match.group(2)]
        path, rest = ".".join(stack), match.group(3)
        value = rest.split("#")[0].strip()
        if "(accepted" in rest and not value:
            blocks.append(path)
        elif value and ("(accepted" in rest or any(path.startswith(b + ".") for b in blocks)):
            marked.add(path)
    return marked


def test_the_table_lists_every_marked_key_once():
    """Keys without effect are marked "(accepted" in the YAML; keys that act with several ranks only are not
    (their comments say what they do) but must exist there."""
    keys = [entry.key for entry in NO_OPS]
    assert len(keys) == len(set(keys))
    schema = [entry for entry in NO_OPS if entry.in_schema]
    assert {entry.key for entry in schema if not entry.sharded_only} == marked_keys()
    cfg = load_config("ppo_trainer", REQUIRED)
    assert all(OmegaConf.select(cfg, entry.key) == entry.default for entry in NO_OPS if entry.sharded_only)
    assert len(schema) == 74 and sum(entry.sharded_only for entry in NO_OPS) == 9
    assert all(OmegaConf.select(cfg, entry.key, default="absent") == "absent"
               for entry in NO_OPS if not entry.in_schema and not entry.key.endswith(".*"))  # verl's keys archer lacks


def test_defaults_and_every_algorithm_preset_are_silent(caplog):
    assert set_no_ops(load_config("ppo_trainer", REQUIRED)) == []
    for preset in group_options("algorithm"):
        assert set_no_ops(load_config("ppo_trainer", [*REQUIRED, f"algorithm={preset}"])) == [], preset


def test_a_value_that_would_change_behaviour_warns_once_naming_the_key(caplog):
    # speed-only keys and the values archer acts as (use_fire_sampling=false: plain sampling) are silent
    cfg = load_config("ppo_trainer", [*REQUIRED, "data.dataloader_num_workers=4",
                                      "actor_rollout_ref.rollout.use_fire_sampling=false",
                                      "actor_rollout_ref.model.use_fused_kernels=true",
                                      "actor_rollout_ref.actor.checkpoint.load_contents=[model]",
                                      "critic.rollout_n=3"])
    with caplog.at_level(logging.WARNING, logger="archer.config"):
        check_config(cfg)
        check_config(cfg)  # as archer train does (the command, then the trainer): still one warning each
        load_config("ppo_trainer", [*REQUIRED, "critic.rollout_n=3"])
    messages = [r.getMessage() for r in caplog.records if r.name == "archer.config"]
    assert messages == [
        "actor_rollout_ref.actor.checkpoint.load_contents=['model'] has no effect in archer: resuming always loads "
        "the model, the optimiser and the trainer state",
        "critic.rollout_n=3 has no effect in archer: actor_rollout_ref.rollout.n governs",
    ]


def test_an_interpolated_default_follows_its_source():
    cfg = load_config("ppo_trainer", [*REQUIRED, "actor_rollout_ref.rollout.n=3"])
    assert cfg.critic.rollout_n == 3 and set_no_ops(cfg) == []


@pytest.mark.parametrize(("override", "fix"), [
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "tensor_model_parallel_size=1"),
    ("actor_rollout_ref.rollout.ignore_eos=true", "drop actor_rollout_ref.rollout.ignore_eos"),
    ("+actor_rollout_ref.model.override_config.attention_dropout=0.1", "config.json"),
])
def test_a_no_op_that_would_change_the_result_is_refused(override, fix):
    cfg = load_config("ppo_trainer", [*REQUIRED, override])
    key = override.lstrip("+").split("=")[0]
    with pytest.raises(ArcherError) as err:
        check_config(cfg)
    assert err.value.problem.startswith(key.rsplit(".", 1)[0] if "override_config" in key or "reward_kwargs" in key
                                        else key)
    assert fix in err.value.fix


def test_allowed_values_of_refusable_keys_only_warn(caplog):
    cfg = load_config("ppo_trainer", [*REQUIRED, "actor_rollout_ref.rollout.tensor_model_parallel_size=1"])
    check_no_ops(cfg)
    assert not [r for r in caplog.records if r.name == "archer.config"]


@pytest.mark.parametrize(("ranks", "warned"), [(1, True), (2, False)])
def test_offload_keys_of_the_reference_and_critic_act_with_several_ranks_only(caplog, ranks, warned):
    cfg = load_config("ppo_trainer", [*REQUIRED, f"trainer.n_gpus_per_node={ranks}",
                                      "actor_rollout_ref.ref.fsdp_config.param_offload=true",
                                      "critic.model.fsdp_config.optimizer_offload=true"])
    check_no_ops(cfg)
    messages = [r.getMessage() for r in caplog.records if r.name == "archer.config"]
    assert len(messages) == (2 if warned else 0), messages
    assert all("acts with several ranks only" in m for m in messages)
