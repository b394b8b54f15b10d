"""Every enumerated value and range of an RL config is checked by ``check_config`` (trainer/config_values.py and
the checks beside it), so ``archer train`` and ``archer train --cfg job`` refuse a typo before any data, model or
folder is touched: each enumerated key with a typo, every value its implementation registers accepted, the
ranges (learning rates, fractions, coefficients) and verl's micro <= mini-batch nesting.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from archer import cli
from archer.config.loader import load_config
from archer.errors import ArcherError
from archer.models.optim import LRSchedule
from archer.trainer.config_check import check_config
from archer.trainer.config_values import CHOICES, TORCH_DTYPES, check_choices

REQUIRED = ["actor_rollout_ref.model.path=/no/model", "data.train_files=/no/train.parquet",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
YAML = Path(__file__).resolve().parents[1] / "archer" / "config" / "ppo_trainer.yaml"
TYPO = "gpro"
TRACE_ON = ("trainer.influence_trace.enable=true",)
# Every enumerated key, with the overrides that switch on the feature reading it (a key nothing reads is not
# checked: algorithm.filter_groups.metric while dynamic sampling is off).
ENUMERATED: dict[str, tuple[str, ...]] = {
    **{key: () for key, _ in CHOICES},
    "actor_rollout_ref.actor.policy_loss.loss_mode": (),
    "actor_rollout_ref.actor.router_replay.mode": (),
    "actor_rollout_ref.rollout.name": (),
    "actor_rollout_ref.rollout.dtype": (),
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": (),
    "reward_model.reward_manager": (),
    "algorithm.rollout_correction.rollout_is": (),
    "algorithm.rollout_correction.rollout_rs": (),
    "algorithm.rollout_correction.loss_type": ("algorithm.rollout_correction.bypass_mode=true",),
    "algorithm.filter_groups.metric": ("algorithm.filter_groups.enable=true",),
    "trainer.v1.trainer_mode": (),
    "trainer.v1.sampler.max_off_policy_strategy": (),
    "trainer.resume_mode": (),
    "trainer.device": (),
    "trainer.logger": (),
    "trainer.health.stop_on": (),
    "trainer.influence_trace.hessian_mode": TRACE_ON,
    "trainer.influence_trace.accepted_rejected_scope": TRACE_ON,
    "trainer.influence_trace.contrastive_agg": TRACE_ON,
    "trainer.influence_trace.response_grad_agg": TRACE_ON,
    "trainer.influence_trace.output_function": TRACE_ON,
}


@functools.cache
def _base() -> DictConfig:
    return load_config("ppo_trainer", REQUIRED)


def config(*overrides: str) -> DictConfig:
    """The config with ``key=value`` overrides, set on one loaded config (loading takes a while; the loader's own
    checks of these values are not what is tested here)."""
    cfg = copy.deepcopy(_base())
    for override in overrides:
        key, value = override.split("=", 1)
        OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=False)
    return cfg


def refusal(*overrides: str) -> ArcherError:
    with pytest.raises(ArcherError) as err:
        check_config(config(*overrides))
    return err.value


def yaml_choice_keys() -> list[str]:
    """The keys of ppo_trainer.yaml whose comment lists their values as ``a | b``."""
    keys, stack = [], []
    for line in YAML.read_text().splitlines():
        m = re.match(r"^(\s*)([A-Za-z_]\w*):\s*([^#]*)#?(.*)$", line)
        if not m:
            continue
        indent, key, value, comment = len(m.group(1)), m.group(2), m.group(3).strip(), m.group(4)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [key])
        if not value:
            stack.append((indent, key))
        elif " | " in comment and "(accepted" not in comment and not value.startswith("{"):
            keys.append(path)
    return keys


def test_every_key_whose_yaml_lists_values_is_checked() -> None:
    listed = yaml_choice_keys()
    assert "algorithm.kl_penalty" in listed and "trainer.v1.trainer_mode" in listed  # the parse reads nesting
    assert sorted(set(listed) - set(ENUMERATED)) == []


@pytest.mark.parametrize("key", sorted(ENUMERATED))
def test_a_typo_of_an_enumerated_key_is_refused(key: str) -> None:
    value = f"[{TYPO}]" if key == "trainer.logger" else TYPO
    err = refusal(*ENUMERATED[key], f"{key}={value}")
    assert TYPO in str(err)
    assert key in str(err) or key.rsplit(".", 1)[1] in str(err), str(err)


def test_every_registered_value_is_accepted() -> None:
    cfg = config()
    values = [(key, value) for key, allowed in CHOICES for value in allowed]
    values += [("actor_rollout_ref.rollout.dtype", dtype) for dtype in TORCH_DTYPES]
    values += [("trainer.device", device) for device in ("auto", "cpu", "cuda", "cuda:1")]  # whether or not here
    assert all(len(allowed) >= 2 for _, allowed in CHOICES)
    for key, value in values:
        default = OmegaConf.select(cfg, key)
        OmegaConf.update(cfg, key, value)
        check_choices(cfg)
        OmegaConf.update(cfg, key, default)
    check_config(config("algorithm.kl_penalty=k3+", "actor_rollout_ref.actor.kl_loss_type=low_var_kl+",
                        "algorithm.adv_estimator=reinforce_plus_plus_baseline"))


@pytest.mark.parametrize(("override", "message"), [
    ("actor_rollout_ref.actor.optim.lr=-1", "actor_rollout_ref.actor.optim.lr=-1 must be positive"),
    ("actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.actor.optim.lr=0 must be positive"),
    ("critic.optim.lr=-1.0e-5", "critic.optim.lr=-1e-05 must be positive"),
    ("actor_rollout_ref.actor.optim.min_lr_ratio=1.5", "min_lr_ratio=1.5 is not a fraction in [0, 1]"),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=-0.1", "lr_warmup_steps_ratio=-0.1 is not a fraction"),
    ("actor_rollout_ref.rollout.top_p=1.2", "rollout.top_p=1.2 is not a fraction"),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=2", "gpu_memory_utilization=2 is not a fraction"),
    ("actor_rollout_ref.actor.token_entropy_quantile=80", "token_entropy_quantile=80 is not a fraction"),
    ("actor_rollout_ref.actor.entropy_top_ratio=1.1", "entropy_top_ratio=1.1 is not a fraction"),
    ("actor_rollout_ref.actor.clip_ratio=-0.2", "clip_ratio=-0.2 is negative"),
    ("actor_rollout_ref.actor.clip_ratio_high=-0.28", "clip_ratio_high=-0.28 is negative"),
    ("actor_rollout_ref.actor.kl_loss_coef=-0.001", "kl_loss_coef=-0.001 is negative"),
    ("actor_rollout_ref.rollout.temperature=-1", "rollout.temperature=-1 is negative"),
])
def test_a_value_out_of_range_is_refused(override: str, message: str) -> None:
    assert message in str(refusal(override))


def test_values_at_the_ends_of_their_ranges_pass() -> None:
    check_config(config("actor_rollout_ref.actor.optim.min_lr_ratio=1", "actor_rollout_ref.rollout.top_p=1",
                        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0", "actor_rollout_ref.actor.clip_ratio=0",
                        "actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.actor.entropy_top_ratio=null"))


def test_a_null_min_lr_ratio_is_verls_no_floor_and_decays_to_zero() -> None:
    # ARPO's published config sets critic.optim.min_lr_ratio: null; verl reads it as no floor.
    cfg = config("actor_rollout_ref.actor.optim.min_lr_ratio=null", "critic.optim.min_lr_ratio=null",
                 "actor_rollout_ref.actor.optim.warmup_style=cosine")
    check_config(cfg)
    schedule = LRSchedule.from_rl_optim(cfg.actor_rollout_ref.actor.optim, total_steps=10)
    assert schedule.min_lr_ratio == 0.0
    assert schedule.multiplier(10) == pytest.approx(0.0, abs=1e-12)  # the cosine's end: lr x 0


def test_a_micro_batch_larger_than_its_mini_batch_is_refused() -> None:
    # 2 prompts x n=1 = 2 responses per mini-batch on one rank
    err = refusal("data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64")
    assert ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 is larger than a mini-batch: "
            "actor_rollout_ref.actor.ppo_mini_batch_size=2 prompts x rollout.n=1 over 1 rank(s) is 2 responses "
            "per rank") in err.problem
    assert "at most 2" in err.fix
    # n=32: 64 responses, exactly the micro-batch; token budgets size micro-batches otherwise
    check_config(config("data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                        "actor_rollout_ref.rollout.n=32", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64"))
    check_config(config("data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                        "actor_rollout_ref.actor.use_dynamic_bsz=true",
                        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64"))
    # two ranks share 4 x 2 = 8 responses: 4 each; verl's deprecated global size is divided by the ranks
    two = ("trainer.device=cpu", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.n=2")
    assert "4 responses per rank" in refusal(*two, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5").problem
    check_config(config(*two, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"))
    check_config(config(*two, "actor_rollout_ref.actor.ppo_micro_batch_size=8"))
    assert "ppo_micro_batch_size=10" in refusal(*two, "actor_rollout_ref.actor.ppo_micro_batch_size=10").problem
    # the critic's, with GAE only
    gae = ("algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=8")
    assert "critic.ppo_micro_batch_size_per_gpu=8 is larger" in refusal(*gae).problem
    check_config(config("algorithm.adv_estimator=grpo", *gae[1:]))


def test_the_cli_refuses_each_typo_before_any_folder_exists(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    for key, enabling in sorted(ENUMERATED.items()):
        value = f"[{TYPO}]" if key == "trainer.logger" else TYPO
        for job in ([], ["--cfg", "job"]):
            args = ["train", *REQUIRED, *enabling, f"{key}={value}", f"trainer.default_local_dir={run}",
                    f"trainer.rollout_data_dir={run}/rollouts", *job]
            assert cli.main(args) == 2, (key, job)
            err = capsys.readouterr().err
            assert err.startswith("archer: error: ") and TYPO in err, (key, err)
            assert not run.exists()
