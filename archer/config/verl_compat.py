"""verl's config keys that archer's schema lacks: each renamed, accepted without effect, or refused.

A user's own YAML in verl's layout (``archer train --config-path=DIR --config-name=NAME.yaml``, e.g. ARPO's
published ``ppo_trainer.yaml``) and command-line overrides both pass through ``translate``: a key archer knows
stays; a key of ``VERL_KEYS`` (or under a prefix of it) is renamed, dropped (with a warning when its value is one
under which verl would compute something archer does not), or refused (an error when its value would change
the result); any other key is an error naming the nearest known key. README "Porting from verl, Archer2.0 or
ARPO" shows this table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from archer.errors import ArcherError

log = logging.getLogger(__name__)

ANY = object()  # a rule whose every value is neutral (the key changes speed or memory, never a result)


@dataclass(frozen=True)
class Renamed:
    to: str


@dataclass(frozen=True)
class NoEffect:
    """Accepted and dropped; a value outside ``neutral`` logs a warning saying what archer does instead."""
    why: str
    neutral: Any = ANY


@dataclass(frozen=True)
class Refused:
    """Accepted only at a value that changes nothing (``neutral``); any other value is an error."""
    why: str
    fix: str
    neutral: tuple = (None, False, "")


@dataclass(frozen=True)
class ValueMapped:
    """A switch that selects an archer value: ``values[v]`` is set at ``to`` (None: leave ``to`` as it is)."""
    to: str
    values: dict


Rule = Renamed | NoEffect | Refused | ValueMapped

RM = "reward_model"
ROLL = "actor_rollout_ref.rollout"

# verl keys (dotted; "x.*" covers everything under x) and what archer does with them.
VERL_KEYS: dict[str, Rule] = {
    "data.use_shm": NoEffect("loading speed only"),
    "data.image_key": NoEffect("archer trains on text; image columns are not read"),
    "data.video_key": NoEffect("archer trains on text; video columns are not read"),
    "data.custom_cls.*": Refused("archer reads RL data with its own loader (parquet, json, jsonl)",
                                 "drop data.custom_cls and convert the data to verl's schema"),
    "actor_rollout_ref.actor.checkpoint.contents": Renamed("actor_rollout_ref.actor.checkpoint.save_contents"),
    "critic.checkpoint.contents": Renamed("critic.checkpoint.save_contents"),
    "actor_rollout_ref.ref.use_torch_compile": NoEffect("archer does not compile the reference model"),
    f"{ROLL}.chat_scheduler": Refused("verl's async chat scheduler is not in archer",
                                      f"drop {ROLL}.chat_scheduler (archer generates synchronously)"),
    f"{ROLL}.use_fire_sampling": Refused("FIRE sampling is not in archer", f"set {ROLL}.use_fire_sampling=False"),
    f"{ROLL}.layered_summon": NoEffect("memory only: archer streams the weights to its engine"),
    f"{ROLL}.multi_turn.enable": Refused(
        "verl's chat-template multi-turn rollout (sglang, tool_config_path) is not read by archer; archer's tool "
        f"loop runs whenever {ROLL}.tools.tool_instances names a tool",
        f"configure the tools under {ROLL}.tools.tool_instances (with {ROLL}.multi_turn.format=hermes for "
        f"<tool_call> turns) and drop {ROLL}.multi_turn.enable"),
    f"{ROLL}.multi_turn.max_turns": Refused("verl's turn limit is not archer's", f"use {ROLL}.tools.call_limit"),
    f"{ROLL}.multi_turn.tool_config_path": Refused(
        "verl's tool config file is not read by archer", f"configure the tools under {ROLL}.tools.tool_instances"),
    f"{ROLL}.multi_turn.completion_callback": Refused("verl's completion callback is not in archer",
                                                      "drop it"),
    f"{ROLL}.tools.verbose_logging": NoEffect("logging only"),
    f"{ROLL}.tools.fail_on_error": Refused(
        "archer always stops at start-up when a tool cannot be built (fail_on_error=false would train without it)",
        f"set {ROLL}.tools.fail_on_error=true or drop it", neutral=(None, False, True, "")),
    f"{ROLL}.agent.tools.*": Renamed(f"{ROLL}.tools"),  # ARPO's deep-search config (ppo_trainer_dr.yaml)
    f"{ROLL}.agent.activate_agent": NoEffect(f"archer's tool loop runs whenever {ROLL}.tools.tool_instances "
                                             "names a tool", neutral=(None, False, True, "")),
    f"{ROLL}.agent.name": NoEffect("archer has one tool loop (ARPO's tool_agent)", neutral=(None, "tool_agent")),
    "critic.model.use_shm": NoEffect("loading speed only"),
    "critic.model.enable_activation_offload": NoEffect("memory only"),
    "critic.model.lora_rank": Refused("a LoRA critic is not in archer", "set critic.model.lora_rank=0",
                                      neutral=(None, 0)),
    "critic.model.lora_alpha": NoEffect("used only with critic.model.lora_rank > 0"),
    "critic.model.target_modules": NoEffect("used only with critic.model.lora_rank > 0"),
    f"{RM}.strategy": NoEffect("the reward model runs on the trainer's device without FSDP"),
    f"{RM}.model.*": NoEffect("loading and sharding options of verl's FSDP worker: archer loads the reward model "
                              "with transformers (bf16 on a GPU, float32 on the CPU)"),
    f"{RM}.ulysses_sequence_parallel_size": NoEffect("the reward model runs on one device"),
    f"{RM}.enable_resource_pool": NoEffect("the reward model shares the trainer's device"),
    f"{RM}.n_gpus_per_node": NoEffect(f"used only with {RM}.enable_resource_pool"),
    f"{RM}.nnodes": NoEffect(f"used only with {RM}.enable_resource_pool"),
    f"{RM}.use_reward_loop": NoEffect("archer's reward-model worker scores each generated batch"),
    f"{RM}.num_workers": NoEffect("archer's reward-model worker scores each generated batch"),
    f"{RM}.rollout.*": NoEffect("archer runs the reward model with transformers, not on a vLLM/SGLang server"),
    f"{RM}.reward_loop_source": NoEffect("archer has no reward-loop classes", neutral=(None, "register")),
    f"{RM}.reward_loop_module_path": Refused("verl's custom reward-loop class is not in archer",
                                             "drop it and score with custom_reward_function.path=FILE"),
    f"{RM}.reward_loop_class_name": NoEffect(f"used only with {RM}.reward_loop_module_path"),
    f"{RM}.profiler.*": NoEffect("profiling only"),
    f"{RM}.sandbox_fusion.url": Refused("verl's remote code sandbox (sandbox_fusion) is not in archer",
                                        f"drop {RM}.sandbox_fusion.url; rewards run in archer's process"),
    f"{RM}.sandbox_fusion.max_concurrent": NoEffect(f"used only with {RM}.sandbox_fusion.url"),
    f"{RM}.sandbox_fusion.memory_limit_mb": NoEffect(f"used only with {RM}.sandbox_fusion.url"),
    "algorithm.use_pf_ppo": Refused("PF-PPO's reweighting is not in archer", "set algorithm.use_pf_ppo=False"),
    "algorithm.pf_ppo.*": NoEffect("used only with algorithm.use_pf_ppo=true, which archer refuses"),
    # Archer2.0's keys (its math scripts): the ASPO loss switch, and switches archer has no counterpart for
    "actor_rollout_ref.actor.use_archer_policy_loss": ValueMapped("actor_rollout_ref.actor.policy_loss.loss_mode",
                                                                  {True: "aspo", False: None}),
    "actor_rollout_ref.actor.use_dynamic_clip": Refused("Archer2.0's dynamic clip is not in archer",
                                                        "set actor_rollout_ref.actor.use_dynamic_clip=False"),
    "trainer.enable_overlong_filter": Refused(
        "Archer2.0's overlong filter (truncated responses left out of the loss) is not in archer",
        "set trainer.enable_overlong_filter=False, or shape overlong responses with reward_model.overlong_buffer"),
    f"{ROLL}.val_kwargs.response_length": NoEffect("archer validates with data.max_response_length",
                                                   neutral=(None,)),
    "trainer.ray_wait_register_center_timeout": NoEffect("Ray start-up only"),
    "ray_init.*": NoEffect("Ray start-up only"),
}

# Values of an archer key that only verl uses, and what they are in archer (None: keep archer's default).
VERL_VALUES: dict[str, dict[Any, Any]] = {
    # verl's multi-turn format applies only with multi_turn.enable=true (refused above); ARPO's configs carry it
    # while ARPO's own loop (archer's default "arpo") does the tool calls
    f"{ROLL}.multi_turn.format": {"chatml": None},
}


def rule_for(key: str) -> tuple[str, Rule] | None:
    """The rule of a dotted key: its own entry, or the entry of the nearest ``prefix.*`` above it."""
    if key in VERL_KEYS:
        return key, VERL_KEYS[key]
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        pattern = ".".join(parts[:i]) + ".*"
        if pattern in VERL_KEYS:
            return pattern, VERL_KEYS[pattern]
    return None


def is_verl_key(key: str) -> bool:
    """A key archer lacks that VERL_KEYS covers (or a parent mapping of such keys, e.g. ``ray_init``)."""
    return rule_for(key) is not None or any(p.startswith(key + ".") for p in VERL_KEYS)


def _neutral(rule: NoEffect | Refused, value: Any) -> bool:
    """A value under which verl computes what archer computes (0 is not False: types must match)."""
    return rule.neutral is ANY or any(type(v) is type(value) and v == value for v in rule.neutral)


def _leaves(value: Any, prefix: str) -> Iterable[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        for k, child in value.items():
            yield from _leaves(child, f"{prefix}.{k}")
    else:
        yield prefix, value


def apply_rule(key: str, value: Any, out: DictConfig, source: str) -> None:
    """Put a verl key's value into archer's config ``out`` as its rule says (rename, drop, warn or refuse)."""
    pattern, rule = rule_for(key)
    if isinstance(rule, ValueMapped):
        if value not in rule.values:
            raise ArcherError(f"{source}: {key}={value!r} is not one of {sorted(rule.values, key=str)}",
                              f"set {key} to one of those, or set {rule.to} directly")
        if rule.values[value] is not None:
            OmegaConf.update(out, rule.to, rule.values[value], force_add=True, merge=False)
        return
    if isinstance(rule, Renamed):
        target = rule.to + key[len(pattern) - 2:] if pattern.endswith(".*") else rule.to
        OmegaConf.update(out, target, value, force_add=True, merge=False)
        return
    if _neutral(rule, value) or isinstance(value, str) and value.startswith("${"):  # verl's own cross-references
        return
    if isinstance(rule, NoEffect):
        log.warning("%s: %s=%r is accepted without effect (%s)", source, key, value, rule.why)
        return
    raise ArcherError(f"{source}: {key}={value!r} is not supported: {rule.why}", rule.fix)


def translate(user: DictConfig, known: set[str], open_maps: set[str], closest: Callable[[str], str | None],
              source: str) -> DictConfig:
    """The archer-shaped config of a user's verl-layout config: archer's keys kept, VERL_KEYS applied, any other
    key an error naming the nearest known one (``closest(key)``)."""
    out = OmegaConf.create({})
    _translate(user, "", out, known, open_maps, closest, source)
    return out


def _translate(node: DictConfig, prefix: str, out: DictConfig, known: set[str], open_maps: set[str],
               closest: Callable[[str], str | None], source: str) -> None:
    for k in node.keys():
        key = f"{prefix}.{k}" if prefix else str(k)
        child = node._get_node(k)
        value = child if OmegaConf.is_config(child) else child._value()
        if key in known:
            if key in VERL_VALUES and not OmegaConf.is_config(value) and value in VERL_VALUES[key]:
                value = VERL_VALUES[key][value]
                if value is None:
                    continue
            if isinstance(value, DictConfig) and key not in open_maps and len(value):
                OmegaConf.update(out, key, {}, force_add=True, merge=True)
                _translate(value, key, out, known, open_maps, closest, source)
            else:
                OmegaConf.update(out, key, value, force_add=True, merge=False)
        elif any(key.startswith(m + ".") for m in open_maps):
            OmegaConf.update(out, key, value, force_add=True, merge=False)
        elif rule_for(key) is not None:
            raw = OmegaConf.to_container(value, resolve=False) if OmegaConf.is_config(value) else value
            for leaf, leaf_value in _leaves(raw, key):
                apply_rule(leaf, leaf_value, out, source)
        elif isinstance(value, DictConfig) and is_verl_key(key):
            _translate(value, key, out, known, open_maps, closest, source)
        else:
            near = closest(key)
            hint = f"did you mean {near!r}?" if near else "archer/config/ppo_trainer.yaml lists the keys"
            raise ArcherError(f"{source}: unknown config key {key!r}: {hint}",
                              "fix or drop the key; archer refuses keys it does not know so that no setting is "
                              "silently ignored (README \"Porting from verl, Archer2.0 or ARPO\" lists verl's keys)")
