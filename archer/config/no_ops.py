"""The config keys archer accepts (so verl, Archer2.0 and ARPO configs port unchanged) but does not act on: one
table, ``NO_OPS``, for the keys of archer's schema (marked "(accepted" in ppo_trainer.yaml, checked with the
config by ``check_no_ops``) and for verl's keys that archer's schema lacks (dropped when the config loads,
config/verl_compat.py, through ``check_value``).

Each entry says what archer does instead (``note``) and which values are silent: the key's default, and its
``neutral`` values: those that ask for what archer does (``rollout.use_fire_sampling=false``: plain sampling), or
``ANY`` for a key that only tunes speed, kernels, logging or loading. A value whose no-op would change the result
is refused (``refuse``: an ArcherError naming ``fix``); any other value asks for something archer does not do
(an offload, sequence parallelism, a partial resume, ...) and is named in one warning, once a process however
often the config is loaded or checked. A schema key's default is a value, or ``${other.key}`` for a key that must equal another's
(as in the YAML).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from archer.config.world import world_size
from archer.errors import ArcherError

log = logging.getLogger("archer.config")
T = TypeVar("T")

ANY = object()  # a key whose every value is neutral
NOT_IN_SCHEMA = object()  # the default of a verl key archer's schema lacks
OFF = (None, False, "")  # the values of a switch that is off (an unset shell variable leaves "")

VERL = "accepted for verl compatibility; archer"
STRATEGY = "archer shards with FSDP2 whenever several ranks run, and runs one plain process otherwise"
NO_SP = "archer has no sequence parallelism: each rank runs whole sequences"
RESHARD = "decoder layers reshard after their forward; the root keeps its parameters gathered until its backward"
FSDP_SIZE = "each model is sharded over all ranks"
WRAP = "FSDP2 wraps each decoder layer (the model's _no_split_modules) and the root"
MIXED = "acts with several ranks on GPUs only; one device computes under bf16 autocast over its own weights"
SHARDED_OFFLOAD = "acts with several ranks only (FSDP2's CPU offload of the shards); on one device the model stays on it"
SAVED = "a checkpoint always holds the model, the optimiser and the trainer state"
LOADED = "resuming always loads the model, the optimiser and the trainer state"


@dataclass(frozen=True)
class NoOp:
    """``key`` has no effect in archer (``note``: why, or what governs instead). ``key`` is dotted; ``x.*`` covers
    every key under x (keys archer's schema lacks). ``default`` is a schema key's YAML default (NOT_IN_SCHEMA for
    a verl key archer lacks); ``neutral`` holds the other values that change nothing (ANY: every value), compared
    with their type (0 is not False); ``refuse`` picks the values whose no-op would change the result, an error
    with ``fix``. ``sharded_only``: the key acts when several ranks run (trainer.nnodes x n_gpus_per_node > 1)."""

    key: str
    note: str
    default: Any = NOT_IN_SCHEMA
    neutral: Any = ()
    refuse: Callable[[Any], bool] | None = None
    fix: str = ""
    sharded_only: bool = False

    @property
    def in_schema(self) -> bool:
        return self.default is not NOT_IN_SCHEMA

    def is_neutral(self, value: Any) -> bool:
        return self.neutral is ANY or any(type(v) is type(value) and v == value for v in self.neutral)


def _above(limit: int) -> Callable[[Any], bool]:
    return lambda value: value is not None and value > limit


def _truthy(value: Any) -> bool:
    return bool(value)


def _unless(*values: Any) -> Callable[[Any], bool]:
    """Refuse every value but these (compared with their type)."""
    return lambda value: not any(type(v) is type(value) and v == value for v in values)


AR = "actor_rollout_ref"
ROLL = f"{AR}.rollout"
RM = "reward_model"
NO_OPS: tuple[NoOp, ...] = (
    # -- keys of archer's schema (ppo_trainer.yaml marks them "(accepted") ------------------------------------------
    NoOp("data.return_raw_input_ids", f"{VERL} re-tokenises for a reward model of its own", False, ANY),
    NoOp("data.return_raw_chat", f"{VERL} keeps the raw prompt in every batch", False, ANY),
    NoOp("data.return_full_prompt", f"{VERL} keeps the raw prompt in every batch", False, ANY),
    NoOp("data.validation_shuffle", "validation always covers the whole validation set in file order", False, ANY),
    NoOp("data.filter_overlong_prompts_workers", "overlong prompts are filtered in one process", 1, ANY),
    NoOp("data.dataloader_num_workers", "prompts are collated in the trainer's process", 8, ANY),
    NoOp("data.trust_remote_code", f"the tokenizer follows {AR}.model.trust_remote_code", False),
    NoOp(f"{AR}.hybrid_engine", "the engine always shares the actor's device (hybrid engine)", True, ANY),
    NoOp(f"{AR}.model.external_lib", "nothing is imported; the model must load with transformers", None),
    NoOp(f"{AR}.model.override_config", "the model's config.json is used as it is", {}, refuse=_truthy,
         fix="edit the model folder's config.json (or drop actor_rollout_ref.model.override_config)"),
    NoOp(f"{AR}.model.enable_activation_offload",
         "activations stay on the device (enable_gradient_checkpointing bounds them)", False),
    NoOp(f"{AR}.model.use_fused_kernels", "log-probs always come from archer's chunked kernel", False, ANY),
    NoOp(f"{AR}.model.fused_kernel_options.impl_backend", "log-probs come from archer's chunked kernel", "torch", ANY),
    NoOp(f"{AR}.model.use_shm", "the model is read from its folder", False, ANY),
    NoOp(f"{AR}.actor.strategy", STRATEGY, "fsdp", ANY),
    NoOp(f"{AR}.actor.ulysses_sequence_parallel_size", NO_SP, 1),
    NoOp(f"{AR}.actor.entropy_from_logits_with_chunking", "archer always computes entropy in chunks", False, ANY),
    NoOp(f"{AR}.actor.entropy_checkpointing", "archer always makes each chunk's logits again in the backward", False,
         ANY),
    NoOp(f"{AR}.actor.checkpoint.save_contents", SAVED, ["model", "optimizer", "extra"], ANY),
    NoOp(f"{AR}.actor.checkpoint.load_contents", LOADED, ["model", "optimizer", "extra"]),
    NoOp(f"{AR}.actor.optim.total_training_steps", "the trainer sets the schedule's length", -1, ANY),
    NoOp(f"{AR}.actor.fsdp_config.offload_policy", "param_offload / optimizer_offload turn on FSDP2's CPU offload",
         False),
    NoOp(f"{AR}.actor.fsdp_config.reshard_after_forward", RESHARD, True, ANY),
    NoOp(f"{AR}.actor.fsdp_config.fsdp_size", FSDP_SIZE, -1, ANY),
    NoOp(f"{AR}.actor.fsdp_config.wrap_policy.min_num_params", WRAP, 0, ANY),
    NoOp(f"{AR}.ref.strategy", STRATEGY, "fsdp", ANY),
    NoOp(f"{AR}.ref.ulysses_sequence_parallel_size", NO_SP, 1),
    NoOp(f"{AR}.ref.fsdp_config.param_offload", SHARDED_OFFLOAD, False, sharded_only=True),
    *(NoOp(f"{section}.fsdp_config.mixed_precision.{name}", MIXED, default, sharded_only=True)
      for section in (f"{AR}.actor", f"{AR}.ref", "critic.model")
      for name, default in (("param_dtype", "bf16"), ("reduce_dtype", "fp32"))),
    *(NoOp(f"{section}.fsdp_config.mixed_precision.buffer_dtype", "FSDP2 keeps buffers in their own dtype", "fp32")
      for section in (f"{AR}.actor", f"{AR}.ref", "critic.model")),
    NoOp(f"{AR}.ref.fsdp_config.reshard_after_forward", RESHARD, True, ANY),
    NoOp(f"{AR}.ref.fsdp_config.wrap_policy.min_num_params", WRAP, 0, ANY),
    NoOp(f"{ROLL}.mode", "generation runs synchronously between the trainer's stages", "sync", ANY),
    NoOp(f"{ROLL}.ignore_eos", "generation stops at the end-of-sequence token", False, refuse=_truthy,
         fix="drop actor_rollout_ref.rollout.ignore_eos (responses end at eos, as the reward expects)"),
    NoOp(f"{ROLL}.load_format", "the engine copies the actor's weights in place", "dummy_dtensor", ANY),
    NoOp(f"{ROLL}.tensor_model_parallel_size", "the engine runs on one GPU", 1, refuse=_above(1),
         fix="set actor_rollout_ref.rollout.tensor_model_parallel_size=1 (archer's engines run on one device)"),
    NoOp(f"{ROLL}.disable_log_stats", "the engine logs no statistics", True, ANY),
    NoOp(f"{ROLL}.enable_chunked_prefill", "prefill is cut into max_num_batched_tokens batches", True, ANY),
    NoOp(f"{ROLL}.calculate_log_probs", "archer always returns the rollout log-probs", False, ANY),
    NoOp(f"{ROLL}.engine_kwargs", "the engines take no extra arguments", {}, ANY),
    NoOp(f"{ROLL}.checkpoint_engine.backend",
         "colocated engines take the policy's weights in process; separate_async's rollout GPUs take them by "
         "broadcast from trainer rank 0 (NCCL on GPUs, gloo on CPUs) whatever the backend", "naive", ("nccl",)),
    NoOp("critic.rollout_n", f"{ROLL}.n governs", f"${{{ROLL}.n}}"),
    NoOp("critic.strategy", STRATEGY, "fsdp", ANY),
    NoOp("critic.optim.total_training_steps", "the trainer sets the schedule's length", -1, ANY),
    NoOp("critic.model.tokenizer_path", "the critic reads the actor's tokenized batch", f"${{{AR}.model.path}}"),
    NoOp("critic.model.override_config", "the model's config.json is used as it is", {}, refuse=_truthy,
         fix="edit the critic model folder's config.json (or drop critic.model.override_config)"),
    NoOp("critic.model.external_lib", "nothing is imported; the model must load with transformers", None),
    NoOp("critic.model.fsdp_config.param_offload", SHARDED_OFFLOAD, False, sharded_only=True),
    NoOp("critic.model.fsdp_config.optimizer_offload", SHARDED_OFFLOAD, False, sharded_only=True),
    NoOp("critic.model.fsdp_config.offload_policy", "param_offload / optimizer_offload turn on FSDP2's CPU offload",
         False),
    NoOp("critic.model.fsdp_config.reshard_after_forward", RESHARD, True, ANY),
    NoOp("critic.model.fsdp_config.fsdp_size", FSDP_SIZE, -1, ANY),
    NoOp("critic.model.fsdp_config.wrap_policy.min_num_params", WRAP, 0, ANY),
    NoOp("critic.ulysses_sequence_parallel_size", NO_SP, 1),
    NoOp("critic.checkpoint.save_contents", SAVED, ["model", "optimizer", "extra"], ANY),
    NoOp("critic.checkpoint.load_contents", LOADED, ["model", "optimizer", "extra"]),
    NoOp(f"{RM}.overlong_buffer.log", "the overlong penalty's metrics are always logged", False, ANY),
    NoOp(f"{RM}.launch_reward_fn_async", "rewards are computed after each generation batch", False, ANY),
    NoOp("trainer.default_hdfs_dir", "checkpoints stay in trainer.default_local_dir", None),
    NoOp("trainer.del_local_ckpt_after_load", "checkpoints are kept (max_actor_ckpt_to_keep prunes them)", False),
    NoOp("trainer.max_critic_ckpt_to_keep", "a checkpoint holds actor and critic; max_actor_ckpt_to_keep governs",
         None),
    NoOp("trainer.use_legacy_worker_impl", "archer has one worker implementation", "auto", ANY),
    NoOp("trainer.use_v1", "archer's one RL loop runs verl's V1 trainer modes (trainer.v1.trainer_mode) whatever "
         "its value", True, ANY),
    NoOp("trainer.entropy_trace.update_summary_every", "summary.json is rewritten with every written step", 1, ANY),
    NoOp("trainer.entropy_trace.atomic_write", "archer's trace writes are always atomic", True, ANY),
    NoOp("trainer.influence_trace.atomic_write", "archer's trace writes are always atomic", True, ANY),
    NoOp("trainer.influence_trace.profile_timing", "phase timings are always in metrics.jsonl", False, ANY),
    # -- verl's keys that archer's schema lacks (dropped as the config loads) --------------------------------------
    NoOp("data.use_shm", "loading speed only", neutral=ANY),
    NoOp("data.image_key", "archer trains on text; image columns are not read", neutral=ANY),
    NoOp("data.video_key", "archer trains on text; video columns are not read", neutral=ANY),
    NoOp("data.custom_cls.*", "archer reads RL data with its own loader (parquet, json, jsonl)", neutral=OFF,
         refuse=_unless(*OFF), fix="drop data.custom_cls and convert the data to verl's schema"),
    NoOp(f"{ROLL}.chat_scheduler", "verl's async chat scheduler is not in archer", neutral=OFF, refuse=_unless(*OFF),
         fix=f"drop {ROLL}.chat_scheduler (archer generates synchronously)"),
    NoOp(f"{ROLL}.use_fire_sampling", "FIRE sampling is not in archer", neutral=OFF, refuse=_unless(*OFF),
         fix=f"set {ROLL}.use_fire_sampling=False"),
    *(NoOp(f"{AR}.actor.router_replay.{name}", "routing records travel in the batch (routed_experts); no file is "
           "written or read", neutral=OFF, refuse=_unless(*OFF),
           fix=f"drop {AR}.actor.router_replay.{name} (R3 replays the engine's records of the same step)")
      for name in ("record_file", "replay_file")),
    NoOp(f"{ROLL}.layered_summon", "memory only: archer streams the weights to its engine", neutral=ANY),
    NoOp(f"{ROLL}.multi_turn.enable",
         "verl's chat-template multi-turn rollout (sglang, tool_config_path) is not read by archer; archer's tool loop "
         f"runs whenever {ROLL}.tools.tool_instances names a tool", neutral=OFF, refuse=_unless(*OFF),
         fix=f"configure the tools under {ROLL}.tools.tool_instances (with {ROLL}.multi_turn.format=hermes for "
             f"<tool_call> turns) and drop {ROLL}.multi_turn.enable"),
    NoOp(f"{ROLL}.multi_turn.max_turns", "verl's turn limit is not archer's", neutral=OFF, refuse=_unless(*OFF),
         fix=f"use {ROLL}.tools.call_limit"),
    NoOp(f"{ROLL}.multi_turn.tool_config_path", "verl's tool config file is not read by archer", neutral=OFF,
         refuse=_unless(*OFF), fix=f"configure the tools under {ROLL}.tools.tool_instances"),
    NoOp(f"{ROLL}.multi_turn.completion_callback", "verl's completion callback is not in archer", neutral=OFF,
         refuse=_unless(*OFF), fix="drop it"),
    NoOp(f"{ROLL}.tools.verbose_logging", "logging only", neutral=ANY),
    NoOp(f"{ROLL}.tools.fail_on_error",
         "archer always stops at start-up when a tool cannot be built (fail_on_error=false would train without it)",
         neutral=(*OFF, True), refuse=_unless(*OFF, True), fix=f"set {ROLL}.tools.fail_on_error=true or drop it"),
    NoOp(f"{ROLL}.agent.activate_agent", f"archer's tool loop runs whenever {ROLL}.tools.tool_instances names a tool",
         neutral=(*OFF, True)),
    NoOp(f"{ROLL}.agent.name", "archer has one tool loop (ARPO's tool_agent)", neutral=(None, "tool_agent")),
    NoOp("critic.model.use_shm", "loading speed only", neutral=ANY),
    NoOp("critic.model.enable_activation_offload", "memory only", neutral=ANY),
    NoOp("critic.model.lora_rank", "a LoRA critic is not in archer", neutral=(None, 0), refuse=_unless(None, 0),
         fix="set critic.model.lora_rank=0"),
    NoOp("critic.model.lora_alpha", "used only with critic.model.lora_rank > 0", neutral=ANY),
    NoOp("critic.model.target_modules", "used only with critic.model.lora_rank > 0", neutral=ANY),
    NoOp(f"{RM}.strategy", "the reward model runs on the trainer's device without FSDP", neutral=ANY),
    NoOp(f"{RM}.model.*", "loading and sharding options of verl's FSDP worker: archer loads the reward model with "
                          "transformers (bf16 on a GPU, float32 on the CPU)", neutral=ANY),
    NoOp(f"{RM}.ulysses_sequence_parallel_size", "the reward model runs on one device", neutral=ANY),
    NoOp(f"{RM}.enable_resource_pool", "the reward model shares the trainer's device", neutral=ANY),
    NoOp(f"{RM}.n_gpus_per_node", f"used only with {RM}.enable_resource_pool", neutral=ANY),
    NoOp(f"{RM}.nnodes", f"used only with {RM}.enable_resource_pool", neutral=ANY),
    NoOp(f"{RM}.use_reward_loop", "archer's reward-model worker scores each generated batch", neutral=ANY),
    NoOp(f"{RM}.num_workers", "archer's reward-model worker scores each generated batch", neutral=ANY),
    NoOp(f"{RM}.rollout.*", "archer runs the reward model with transformers, not on a vLLM/SGLang server",
         neutral=ANY),
    NoOp(f"{RM}.reward_loop_source", "archer has no reward-loop classes", neutral=(None, "register")),
    NoOp(f"{RM}.reward_loop_module_path", "verl's custom reward-loop class is not in archer", neutral=OFF,
         refuse=_unless(*OFF), fix="drop it and score with custom_reward_function.path=FILE"),
    NoOp(f"{RM}.reward_loop_class_name", f"used only with {RM}.reward_loop_module_path", neutral=ANY),
    NoOp(f"{RM}.profiler.*", "profiling only", neutral=ANY),
    NoOp(f"{RM}.sandbox_fusion.url", "verl's remote code sandbox (sandbox_fusion) is not in archer", neutral=OFF,
         refuse=_unless(*OFF), fix=f"drop {RM}.sandbox_fusion.url; rewards run in archer's process"),
    NoOp(f"{RM}.sandbox_fusion.max_concurrent", f"used only with {RM}.sandbox_fusion.url", neutral=ANY),
    NoOp(f"{RM}.sandbox_fusion.memory_limit_mb", f"used only with {RM}.sandbox_fusion.url", neutral=ANY),
    NoOp("algorithm.use_pf_ppo", "PF-PPO's reweighting is not in archer", neutral=OFF, refuse=_unless(*OFF),
         fix="set algorithm.use_pf_ppo=False"),
    NoOp("algorithm.pf_ppo.*", "used only with algorithm.use_pf_ppo=true, which archer refuses", neutral=ANY),
    # Archer2.0's switches that archer has no counterpart for
    NoOp(f"{AR}.actor.use_dynamic_clip", "Archer2.0's dynamic clip is not in archer", neutral=OFF,
         refuse=_unless(*OFF), fix=f"set {AR}.actor.use_dynamic_clip=False"),
    NoOp("trainer.enable_overlong_filter",
         "Archer2.0's overlong filter (truncated responses left out of the loss) is not in archer", neutral=OFF,
         refuse=_unless(*OFF),
         fix="set trainer.enable_overlong_filter=False, or shape overlong responses with reward_model.overlong_buffer"),
    NoOp(f"{ROLL}.val_kwargs.response_length", "archer validates with data.max_response_length", neutral=(None,)),
    NoOp("trainer.ray_wait_register_center_timeout", "Ray start-up only", neutral=ANY),
    NoOp("ray_init.*", "Ray start-up only (verl's older layout; its num_cpus is ray_kwargs.ray_init.num_cpus)",
         neutral=ANY),
    NoOp("ray_kwargs.timeline_json_file", "Ray's timeline of the run is not written", neutral=(None,)),
)
_SCHEMA_LESS = {entry.key: entry for entry in NO_OPS if not entry.in_schema}
SCHEMA_LESS_KEYS = tuple(_SCHEMA_LESS)
_warned: set[tuple[str, str]] = set()


def by_pattern(table: Mapping[str, T], key: str) -> tuple[str, T] | None:
    """``table``'s entry for a dotted key: its own, or that of the nearest ``prefix.*`` above it, with the
    table key that matched."""
    if key in table:
        return key, table[key]
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        pattern = ".".join(parts[:i]) + ".*"
        if pattern in table:
            return pattern, table[pattern]
    return None


def no_op_for(key: str) -> NoOp | None:
    """The entry of a verl key archer's schema lacks (its own or that of the nearest ``prefix.*`` above it)."""
    found = by_pattern(_SCHEMA_LESS, key)
    return None if found is None else found[1]


def check_value(entry: NoOp, key: str, value: Any, source: str = "") -> None:
    """Refuse ``value`` of ``key`` (``entry``'s) when its no-op would change the result; warn once (a process)
    when it is neither the default nor neutral."""
    _refuse(entry, key, value, source)
    _warn(entry, key, value, source)


def _silent(entry: NoOp, value: Any) -> bool:
    return entry.is_neutral(value) or isinstance(value, str) and value.startswith("${")  # verl's own references


def _refuse(entry: NoOp, key: str, value: Any, source: str) -> None:
    if not _silent(entry, value) and entry.refuse is not None and entry.refuse(value):
        prefix = f"{source}: " if source else ""
        raise ArcherError(f"{prefix}{key}={value!r} cannot be honoured: {entry.note}", entry.fix)


def _warn(entry: NoOp, key: str, value: Any, source: str) -> None:
    if not _silent(entry, value) and (key, repr(value)) not in _warned:
        _warned.add((key, repr(value)))
        log.warning("%s%s=%r has no effect in archer: %s", f"{source}: " if source else "", key, value, entry.note)


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _default(cfg: DictConfig, entry: NoOp) -> Any:
    if isinstance(entry.default, str) and entry.default.startswith("${"):
        return _plain(OmegaConf.select(cfg, entry.default[2:-1]))
    return entry.default


def set_no_ops(cfg: DictConfig) -> list[tuple[NoOp, Any]]:
    """The schema entries that ``cfg`` sets to a value other than their default, with the value."""
    out = []
    for entry in NO_OPS:
        if entry.in_schema:
            value = _plain(OmegaConf.select(cfg, entry.key))
            if value != _default(cfg, entry):
                out.append((entry, value))
    return out


def check_no_ops(cfg: DictConfig) -> None:
    """``check_value`` of each schema key ``cfg`` sets to a value other than its default (the keys that act with
    several ranks are left alone when several run)."""
    sharded = world_size(cfg.trainer) > 1
    found = [(entry, value) for entry, value in set_no_ops(cfg) if not (sharded and entry.sharded_only)]
    for entry, value in found:  # a refusal first: a run that stops warns about nothing
        _refuse(entry, entry.key, value, "")
    for entry, value in found:
        _warn(entry, entry.key, value, "")
