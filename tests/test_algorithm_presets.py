"""Tests of the algorithm presets (archer/config/algorithm/*.yaml, selected with ``algorithm=NAME``): each one
composes to exactly the keys its YAML lists, every key exists in the base schema, command-line keys win, an
unknown name is a clear error, the values match docs/algorithms.md, each preset trains two tiny steps in-process and
logs the metric of its mechanism, and ``archer quickstart`` leaves its own algorithm keys out under a preset.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

from archer.config import loader
from archer.config.loader import CONFIG_DIR, known_keys, load_config
from archer.errors import ArcherError
from archer.trainer.ppo import PPOTrainer, build_reward_manager, check_config
from archer.trainer.quickstart import (
    DEFAULT_ALGORITHM_OVERRIDES,
    RL_OVERRIDES,
    algorithm_overrides,
    run_quickstart,
)

PRESETS = ["aepo", "archer", "arpo", "aspo", "clip_cov", "dapo", "dr_grpo", "grpo", "gspo", "kl_cov", "ppo",
           "reinforce_plus_plus", "rloo", "top_entropy"]
AGENTIC = ("aepo", "arpo")  # their branches start after tool calls: they need tools
REQUIRED = ["actor_rollout_ref.model.path=/no/model", "data.train_files=/no/train.parquet"]
ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"

# Score = share of digits in the response (varies inside a group); acc alternates 1, 0, 1, 0 over the calls,
# so every group of 4 responses has mixed accuracy and Archer's rejection sampling keeps all of them.
MIXED_REWARD = '''
calls = 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    digits = sum(c.isdigit() for c in solution_str)
    return {"score": digits / max(len(solution_str), 1), "acc": float(calls % 2)}
'''


# -- composing ----------------------------------------------------------------------------------------------
def leaves(node: DictConfig, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf of a config (lists and empty mappings are leaves; `${..}` kept as text)."""
    out: dict[str, Any] = {}
    for key in node.keys():
        path = f"{prefix}.{key}" if prefix else str(key)
        value = node._get_node(key)
        if isinstance(value, DictConfig) and len(value):
            out.update(leaves(value, path))
        elif isinstance(value, DictConfig | ListConfig):
            out[path] = OmegaConf.to_container(value, resolve=False)
        else:
            out[path] = value._value()
    return out


def preset_yaml(name: str) -> dict[str, Any]:
    return leaves(OmegaConf.load(CONFIG_DIR / "algorithm" / f"{name}.yaml"))


def interpolations_of(keys: set[str]) -> set[str]:
    """Base-schema keys whose default is `${K}` for some K in `keys` (they follow K when a preset sets it)."""
    raw = leaves(OmegaConf.load(CONFIG_DIR / "ppo_trainer.yaml"))
    out = set()
    for path, value in raw.items():
        match = re.fullmatch(r"\$\{([^}]+)\}", value) if isinstance(value, str) else None
        if match and match.group(1) in keys:
            out.add(path)
    return out


def test_the_fourteen_presets_are_the_group_options() -> None:
    assert sorted(p.stem for p in (CONFIG_DIR / "algorithm").glob("*.yaml")) == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_to_exactly_the_keys_its_yaml_lists(name: str) -> None:
    yaml_keys = preset_yaml(name)
    assert yaml_keys, "a preset sets something"
    base = leaves(load_config("ppo_trainer", REQUIRED))
    composed = leaves(load_config("ppo_trainer", [*REQUIRED, f"algorithm={name}"]))
    assert set(composed) == set(base), "a preset adds no key"
    for key, value in yaml_keys.items():
        assert composed[key] == value, (key, composed[key], value)
    changed = {k for k in base if composed[k] != base[k]}
    assert changed <= set(yaml_keys) | interpolations_of(set(yaml_keys)), changed - set(yaml_keys)


@pytest.mark.parametrize("name", PRESETS)
def test_every_key_a_preset_sets_is_a_leaf_of_the_base_schema(name: str) -> None:
    schema, _ = known_keys("ppo_trainer")
    base = leaves(OmegaConf.load(CONFIG_DIR / "ppo_trainer.yaml"))
    for key in preset_yaml(name):
        assert key in schema and key in base, key


def test_interpolated_keys_follow_the_preset() -> None:
    cfg = load_config("ppo_trainer", [*REQUIRED, "algorithm=aspo"])
    assert cfg.critic.ppo_epochs == 3 and cfg.critic.loss_agg_mode == "token-mean"
    cfg = load_config("ppo_trainer", [*REQUIRED, "algorithm=dr_grpo"])
    assert cfg.critic.loss_agg_mode == "seq-mean-token-sum-norm"


@pytest.mark.parametrize("order", ["preset_first", "key_first"])
def test_a_command_line_key_wins_over_the_preset(order: str) -> None:
    keys = [f"{ACTOR}.clip_ratio_high=0.3", "reward_model.overlong_buffer.len=8", "+algorithm.filter_groups.metric=score"]
    overrides = ["algorithm=dapo", *keys] if order == "preset_first" else [*keys, "algorithm=dapo"]
    cfg = load_config("ppo_trainer", [*REQUIRED, *overrides])
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.3
    assert cfg.reward_model.overlong_buffer.len == 8
    assert cfg.algorithm.filter_groups.metric == "score"
    # the rest of the preset still applies
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == 0.2 and cfg.algorithm.filter_groups.enable is True
    assert cfg.reward_model.wrong_answer_score == -1.0


def test_plus_algorithm_selects_the_preset_too() -> None:
    cfg = load_config("ppo_trainer", [*REQUIRED, "+algorithm=kl_cov"])
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "kl_cov"
    assert cfg.actor_rollout_ref.actor.policy_loss.kl_cov_ratio == 0.002


@pytest.mark.parametrize("override", ["algorithm=nope", "+algorithm=nope"])
def test_an_unknown_preset_names_the_known_ones(override: str) -> None:
    with pytest.raises(ArcherError) as err:
        load_config("ppo_trainer", [*REQUIRED, override])
    message = str(err.value)
    assert "'nope'" in message
    assert all(name in message for name in PRESETS), message


# Values from docs/algorithms.md (and the paper settings the presets' comments cite).
REFERENCE_VALUES = {
    "ppo": {"algorithm.adv_estimator": "gae", f"{ACTOR}.use_kl_loss": False},
    "grpo": {"algorithm.adv_estimator": "grpo", f"{ACTOR}.loss_agg_mode": "seq-mean-token-mean",
             f"{ACTOR}.use_kl_loss": True, f"{ACTOR}.kl_loss_type": "low_var_kl", f"{ACTOR}.kl_loss_coef": 0.001},
    "dr_grpo": {"algorithm.norm_adv_by_std_in_grpo": False, f"{ACTOR}.loss_agg_mode": "seq-mean-token-sum-norm"},
    "rloo": {"algorithm.adv_estimator": "rloo", "algorithm.use_kl_in_reward": True},
    "reinforce_plus_plus": {"algorithm.adv_estimator": "reinforce_plus_plus", "algorithm.use_kl_in_reward": True},
    "dapo": {f"{ACTOR}.clip_ratio_low": 0.2, f"{ACTOR}.clip_ratio_high": 0.28, f"{ACTOR}.loss_agg_mode": "token-mean",
             f"{ACTOR}.use_kl_loss": False, "algorithm.filter_groups.enable": True, f"{ACTOR}.clip_ratio_c": 10.0,
             "reward_model.overlong_buffer.enable": True, "reward_model.overlong_buffer.len": 4096,
             "reward_model.overlong_buffer.penalty_factor": 1.0, "reward_model.wrong_answer_score": -1.0},
    "archer": {f"{ACTOR}.policy_loss.loss_mode": "archer", f"{ACTOR}.token_entropy_quantile": 0.8,
               f"{ACTOR}.low_entropy_clip_ratio_low": 0.2, f"{ACTOR}.low_entropy_clip_ratio_high": 0.2,
               f"{ACTOR}.high_entropy_clip_ratio_low": 0.5, f"{ACTOR}.high_entropy_clip_ratio_high": 0.5,
               f"{ACTOR}.clip_ratio_c": 10.0, f"{ACTOR}.kl_loss_coef": 0.001,
               f"{ACTOR}.high_entropy_kl_loss_scale_coef": 0.0, "trainer.rejection_sample": True},
    "aspo": {f"{ACTOR}.policy_loss.loss_mode": "aspo", f"{ACTOR}.high_entropy_clip_ratio_low": 0.4,
             f"{ACTOR}.high_entropy_clip_ratio_high": 0.4, f"{ACTOR}.low_entropy_clip_ratio_high": 0.2,
             f"{ACTOR}.ppo_epochs": 3, f"{ACTOR}.clip_ratio_c": 3.0, f"{ACTOR}.loss_agg_mode": "token-mean",
             "reward_model.overlong_buffer.len": 16, "trainer.rejection_sample": True},
    "top_entropy": {f"{ACTOR}.entropy_top_ratio": 0.2, "algorithm.filter_groups.enable": True,
                    f"{ACTOR}.clip_ratio_high": 0.28},
    "clip_cov": {f"{ACTOR}.policy_loss.loss_mode": "clip_cov", f"{ACTOR}.policy_loss.clip_cov_ratio": 0.0002,
                 f"{ACTOR}.policy_loss.clip_cov_lb": 1.0, f"{ACTOR}.policy_loss.clip_cov_ub": 5.0},
    "kl_cov": {f"{ACTOR}.policy_loss.loss_mode": "kl_cov", f"{ACTOR}.policy_loss.kl_cov_ratio": 0.002,
               f"{ACTOR}.policy_loss.ppo_kl_coef": 1.0},
    "gspo": {f"{ACTOR}.policy_loss.loss_mode": "gspo", f"{ACTOR}.clip_ratio_low": 0.0003,
             f"{ACTOR}.clip_ratio_high": 0.0004},
    "arpo": {"algorithm.adv_estimator": "grpo", f"{ACTOR}.loss_agg_mode": "token-mean", f"{ACTOR}.use_kl_loss": False,
             f"{ROLLOUT}.n": 16, f"{ROLLOUT}.initial_rollouts": 8, f"{ROLLOUT}.beam_size": 2,
             f"{ROLLOUT}.branch_probability": 0.5, f"{ROLLOUT}.entropy_weight": 0.2, f"{ROLLOUT}.tools.call_limit": 3,
             f"{ROLLOUT}.enable_dynamic_rollouts": False, f"{ROLLOUT}.consecutive_branch_penalty": 0.0},
    "aepo": {"algorithm.adv_estimator": "grpo", f"{ROLLOUT}.n": 16, f"{ROLLOUT}.beam_size": 2,
             f"{ROLLOUT}.enable_dynamic_rollouts": True, f"{ROLLOUT}.dynamic_rollout_beta": 0.5,
             f"{ROLLOUT}.consecutive_branch_penalty": 0.05, f"{ACTOR}.enable_entropy_balanced_clipping": True,
             f"{ACTOR}.enable_entropy_balanced_advantage": True},
}


@pytest.mark.parametrize("name", PRESETS)
def test_preset_values_match_the_reference(name: str) -> None:
    composed = leaves(load_config("ppo_trainer", [*REQUIRED, f"algorithm={name}"]))
    for key, value in REFERENCE_VALUES[name].items():
        assert composed[key] == value, (key, composed[key], value)


def test_dapos_paper_buffer_is_refused_for_short_responses() -> None:
    cfg = load_config("ppo_trainer", [*REQUIRED, "algorithm=dapo", "data.max_response_length=16"])
    with pytest.raises(ArcherError, match=r"overlong_buffer.len=4096 must be positive and smaller than "
                                          r"data.max_response_length=16"):
        build_reward_manager(cfg, tokenizer=None)


# -- quickstart ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [[], ["trainer.seed=3"], ["algorithm.adv_estimator=rloo"], ["algorithm_x=1"]])
def test_quickstart_keeps_its_algorithm_keys_without_a_preset(extra: list[str]) -> None:
    out = algorithm_overrides(extra)
    assert out == ["algorithm.adv_estimator=grpo", f"{ACTOR}.use_kl_loss=false", f"{ACTOR}.entropy_coeff=0"]
    out.append("x=1")
    assert "x=1" not in DEFAULT_ALGORITHM_OVERRIDES  # a copy: the module's list is untouched


@pytest.mark.parametrize("extra", [["algorithm=archer"], ["+algorithm=archer"], ["trainer.seed=3", "++algorithm=archer"]])
def test_quickstart_drops_its_algorithm_keys_under_a_preset(extra: list[str]) -> None:
    assert algorithm_overrides(extra) == []
    # composed as run_quickstart does: the preset's KL loss survives (the quickstart's own keys turn it off)
    preset = [e.lstrip("+") for e in extra]
    cfg = load_config("ppo_trainer", [*REQUIRED, *algorithm_overrides(extra), *RL_OVERRIDES, *preset])
    assert cfg.actor_rollout_ref.actor.use_kl_loss is True
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "archer"
    plain = load_config("ppo_trainer", [*REQUIRED, *algorithm_overrides([]), *RL_OVERRIDES])
    assert plain.algorithm.adv_estimator == "grpo" and plain.actor_rollout_ref.actor.use_kl_loss is False


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_gives_a_quickstart_rl_config_archer_accepts(name: str) -> None:
    extra = [f"algorithm={name}"]
    cfg = load_config("ppo_trainer", [*REQUIRED, *algorithm_overrides(extra), *RL_OVERRIDES, *extra])
    if name in AGENTIC:  # the quickstart's task has no tools: refused before any work, naming the fix
        with pytest.raises(ArcherError, match="no tool is configured"):
            check_config(cfg)
        cfg = load_config("ppo_trainer", [*REQUIRED, *algorithm_overrides(extra), *RL_OVERRIDES, *extra, *TOOLS])
    check_config(cfg)
    build_reward_manager(cfg, tokenizer=None)


# -- two training steps per preset ----------------------------------------------------------------------------


ROWS = 4 * 4  # train_batch_size x rollout.n
TOOLS = [f"+{ROLLOUT}.tools.tool_instances.python.class_path=python"]
# rollout.n=4 of the test: two global samples, two from branches or refills
AGENTIC_OVERRIDES = [*TOOLS, f"{ROLLOUT}.initial_rollouts=2"]
MAX_RESPONSE = 16
BUFFER = 4


def train_preset(name: str, model: Path, files: dict[str, Path], root: Path) -> tuple[dict[int, dict], list, Any]:
    """Two steps of `algorithm=name`; (metrics by step, the rollout dump's trained rows by step, resolved
    config)."""
    reward = root / "mixed_reward.py"
    reward.write_text(MIXED_REWARD)
    run = root / name
    cfg = load_config("ppo_trainer", [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={files['train']}", f"algorithm={name}",
        "data.max_prompt_length=32", f"data.max_response_length={MAX_RESPONSE}", "trainer.device=cpu",
        f"trainer.default_local_dir={run}", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=4",
        f"{ACTOR}.ppo_mini_batch_size=4", f"{ACTOR}.optim.lr=1e-3", f"custom_reward_function.path={reward}",
        "trainer.total_training_steps=2", "trainer.logger=[jsonl]", "trainer.plots=False",
        f"trainer.rollout_data_dir={run / 'rollouts'}",
        # the paper's 4096-token buffer does not fit 16-token responses; digit shares vary inside groups
        f"reward_model.overlong_buffer.len={BUFFER}", "algorithm.filter_groups.metric=score",
        *(AGENTIC_OVERRIDES if name in AGENTIC else [])])
    PPOTrainer(cfg).fit()
    metrics = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        metrics[record.pop("step")] = record
    dumps = {s: [r for r in map(json.loads, (run / "rollouts" / f"step_{s}.jsonl").read_text().splitlines())
                 if r["trained"]] for s in (1, 2)}  # the dump holds the dropped groups too
    return metrics, dumps, OmegaConf.load(run / "config.yaml")


def digit_share(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def check_overlong(line: dict[str, float], dump: list[dict[str, Any]]) -> None:
    """The penalty of each trained row (score minus its digit share) is on DAPO's ramp, and the metrics agree."""
    penalties = np.array([r["score"] - digit_share(r["output"]) for r in dump])
    ramp = [-(length - (MAX_RESPONSE - BUFFER)) / BUFFER for length in range(MAX_RESPONSE - BUFFER + 1, MAX_RESPONSE + 1)]
    assert all(p == pytest.approx(0.0, abs=1e-9) or any(p == pytest.approx(v) for v in ramp) for p in penalties), penalties
    assert line["reward/overlong_penalty_mean"] == pytest.approx(penalties.mean(), abs=1e-6)
    assert line["reward/overlong_penalised_frac"] == pytest.approx(np.mean(penalties < -1e-9))
    # a response cut at max_response_length gets the whole factor, and only such a response
    assert np.mean(np.isclose(penalties, -1.0)) == pytest.approx(line["response_length/clip_ratio"])


def check_kl_in_reward(metrics: dict[int, dict]) -> None:
    assert metrics[1]["actor/reward_kl_penalty"] == 0.0  # the actor is the reference at step 1
    assert metrics[1]["critic/rewards/mean"] == pytest.approx(metrics[1]["critic/score/mean"])
    assert metrics[2]["actor/reward_kl_penalty"] != 0.0
    assert metrics[2]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001)
    assert all("actor/kl_loss" not in line for line in metrics.values())


def check_entropy_classes(line: dict[str, float]) -> None:
    low, high = line["actor/entropy_low_frac"], line["actor/entropy_high_frac"]
    assert low + high == pytest.approx(1.0, abs=1e-6)
    # per response, n - 1 - floor(0.8 (n - 1)) of n tokens lie above the 0.8 quantile: 3 of 16, 1 of 2..5
    assert 0.7 <= low <= 0.9
    assert line["train/num_rejected_groups"] == 0.0  # every group has mixed accuracy
    assert line["train/num_kept_groups"] == 4.0


def check_mechanism(name: str, metrics: dict[int, dict], dumps: dict[int, list], cfg: Any) -> None:
    steps = (1, 2)
    if name == "ppo":
        for s in steps:
            assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/values/mean"} <= set(metrics[s])
            assert metrics[s]["critic/vf_loss"] > 0
    elif name in ("grpo", "archer"):
        assert metrics[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)  # k3 of the actor against itself
        assert metrics[2]["actor/kl_loss"] > 0
        assert metrics[2]["actor/kl_coef"] == pytest.approx(0.001)
    elif name == "aspo":
        # 3 PPO epochs: epochs 2 and 3 of step 1 already run off-policy and away from the reference
        assert metrics[1]["actor/kl_loss"] > 0 and abs(metrics[1]["actor/ppo_kl"]) > 1e-6
        assert metrics[2]["actor/kl_coef"] == pytest.approx(0.001)
    elif name in ("rloo", "reinforce_plus_plus"):
        check_kl_in_reward(metrics)
    if name in ("archer", "aspo"):
        for s in steps:
            check_entropy_classes(metrics[s])
    if name == "dr_grpo":
        # no division by the group std: |A| never exceeds the spread of the scores
        for s in steps:
            spread = metrics[s]["critic/score/max"] - metrics[s]["critic/score/min"]
            assert max(abs(metrics[s]["critic/advantages/max"]), abs(metrics[s]["critic/advantages/min"])) <= spread + 1e-6
    if name == "reinforce_plus_plus":
        for s in steps:  # whitened over the batch's valid tokens
            assert metrics[s]["critic/advantages/mean"] == pytest.approx(0.0, abs=1e-5)
    if name in ("dapo", "top_entropy"):
        for s in steps:
            assert metrics[s]["train/num_gen_batches"] >= 1
            assert metrics[s]["train/num_candidate_groups"] == 4 * metrics[s]["train/num_gen_batches"]
            assert metrics[s]["train/num_kept_groups"] == 4.0
    if name in ("dapo", "top_entropy", "aspo"):
        for s in steps:
            check_overlong(metrics[s], dumps[s])
    else:
        assert all("reward/overlong_penalty_mean" not in line for line in metrics.values())
    if name == "top_entropy":
        for s in steps:  # one micro-batch: ceil(0.2 N) of its N valid tokens
            tokens = round(metrics[s]["response_length/mean"] * ROWS)
            assert metrics[s]["actor/top_entropy_selected_tokens"] == math.ceil(0.2 * tokens)
            assert metrics[s]["actor/top_entropy_selected_frac"] == pytest.approx(math.ceil(0.2 * tokens) / tokens)
    if name == "clip_cov":
        for s in steps:  # at most max(1, int(2e-4 N)) = 1 token, among those with 1 < cov < 5
            assert metrics[s]["actor/cov_selected_tokens"] in (0.0, 1.0)
    if name == "kl_cov":
        for s in steps:  # max(1, int(2e-3 N)) = 1 for N < 1000
            assert metrics[s]["actor/cov_selected_tokens"] == 1.0
    if name in AGENTIC:  # the tool loop ran: 4 prompts x 2 global samples, the rest from branches or refills
        for s in steps:
            if name == "arpo":
                assert metrics[s]["rollout/initial_rollouts"] == 2.0
            assert metrics[s]["rollout/branches"] + metrics[s]["rollout/refills"] == 16 - 4 * metrics[s]["rollout/initial_rollouts"]
            assert "tools/python/calls" in metrics[s] and "tools/calls_per_response" in metrics[s]
    if name == "gspo":
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"
        assert metrics[1]["actor/pg_clipfrac"] == 0.0  # one on-policy update: sequence ratio exactly 1


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_preset_trains_two_steps_and_logs_its_mechanism(name: str, micro_model: Path, task_files: dict[str, Path],
                                                        tmp_path: Path) -> None:
    metrics, dumps, cfg = train_preset(name, micro_model, task_files, tmp_path)
    assert sorted(metrics) == [1, 2]
    for key, value in preset_yaml(name).items():  # the run saw the preset (the test's overrides aside)
        if key not in ("reward_model.overlong_buffer.len", "algorithm.filter_groups.metric", f"{ROLLOUT}.n",
                       f"{ROLLOUT}.initial_rollouts"):
            assert OmegaConf.select(cfg, key) == value, key
    for s in (1, 2):
        line = metrics[s]
        assert all(isinstance(v, float | int) and math.isfinite(v) for v in line.values()), line
        assert line["actor/grad_norm"] > 0 and "actor/pg_loss" in line
        assert len(dumps[s]) == ROWS
    if cfg.actor_rollout_ref.actor.ppo_epochs == 1:  # one on-policy update: new and old log-probs agree
        assert abs(metrics[1]["actor/ppo_kl"]) < 1e-6
    check_mechanism(name, metrics, dumps, cfg)


# -- a preset with a stray key, and bad RL overrides in the quickstart ------------------------------------------
def test_a_preset_that_sets_an_unknown_key_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_dir = tmp_path / "config"
    shutil.copytree(loader.CONFIG_DIR, config_dir)
    (config_dir / "algorithm" / "typo.yaml").write_text(
        "# @package _global_\nactor_rollout_ref:\n  actor:\n    clip_ratio_hihg: 0.3\n")
    monkeypatch.setattr(loader, "CONFIG_DIR", config_dir)
    with pytest.raises(ArcherError) as err:
        load_config("ppo_trainer", [*REQUIRED, "algorithm=typo"])
    assert "actor_rollout_ref.actor.clip_ratio_hihg" in err.value.problem
    assert load_config("ppo_trainer", [*REQUIRED, "algorithm=dapo"]).algorithm.filter_groups.enable is True


def test_quickstart_refuses_bad_rl_overrides_before_the_warm_start(tmp_path: Path) -> None:
    with pytest.raises(ArcherError) as err:
        run_quickstart(["algorithm=dapo", "reward_model.overlong_buffer.len=100"], out_dir=str(tmp_path / "qs"))
    assert "overlong_buffer.len=100" in err.value.problem and "max_response_length=48" in err.value.problem
    assert not (tmp_path / "qs" / "sft").exists() and not (tmp_path / "qs" / "data").exists()
