"""The config keys archer accepts (so verl scripts port unchanged) but does not act on: one declared table.

Set to its default, such a key is silent. Set to anything else, it is named in one warning at the start of the
run, saying what archer does instead; where ignoring the value would change the result (a model, a reward, a
parallel layout archer does not have yet), the value is refused with an ArcherError naming what to do instead.
A key's default is a value, or ``${other.key}`` for a key that must equal another's (as in the YAML).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from archer.config.loader import world_size
from archer.errors import ArcherError

log = logging.getLogger("archer.config")

VERL = "accepted for verl compatibility; archer"
STRATEGY = "archer shards with FSDP2 whenever several ranks run, and runs one plain process otherwise"
NO_SP = "archer has no sequence parallelism: each rank runs whole sequences"
RESHARD = "decoder layers reshard after their forward; the root keeps its parameters gathered until its backward"
FSDP_SIZE = "each model is sharded over all ranks"
WRAP = "FSDP2 wraps each decoder layer (the model's _no_split_modules) and the root"
MIXED = "acts with several ranks on GPUs only; one device computes under bf16 autocast over its own weights"
SHARDED_OFFLOAD = "acts with several ranks only (FSDP2's CPU offload of the shards); on one device the model stays on it"


@dataclass(frozen=True)
class NoOp:
    """``key`` has no effect in archer (``note`` says why or what governs instead). ``refuse`` picks the values
    whose no-op would change the result; those are an error with ``fix``."""

    key: str
    default: Any
    note: str
    refuse: Callable[[Any], bool] | None = None
    fix: str = ""
    sharded_only: bool = False  # the key acts when several ranks run (trainer.nnodes x n_gpus_per_node > 1)


def _above(limit: int) -> Callable[[Any], bool]:
    return lambda value: value is not None and value > limit


def _truthy(value: Any) -> bool:
    return bool(value)


AR = "actor_rollout_ref"
NO_OPS: tuple[NoOp, ...] = (
    NoOp("data.return_raw_input_ids", False, f"{VERL} has one tokenizer for policy and reward"),
    NoOp("data.return_raw_chat", False, f"{VERL} keeps the raw prompt in every batch"),
    NoOp("data.return_full_prompt", False, f"{VERL} keeps the raw prompt in every batch"),
    NoOp("data.validation_shuffle", False, "validation always covers the whole validation set in file order"),
    NoOp("data.filter_overlong_prompts_workers", 1, "overlong prompts are filtered in one process"),
    NoOp("data.dataloader_num_workers", 8, "prompts are collated in the trainer's process"),
    NoOp("data.trust_remote_code", False, f"the tokenizer follows {AR}.model.trust_remote_code"),
    NoOp(f"{AR}.hybrid_engine", True, "the engine always shares the actor's device (hybrid engine)"),
    NoOp(f"{AR}.model.external_lib", None, "nothing is imported; the model must load with transformers"),
    NoOp(f"{AR}.model.override_config", {}, "the model's config.json is used as it is", _truthy,
         "edit the model folder's config.json (or drop actor_rollout_ref.model.override_config)"),
    NoOp(f"{AR}.model.enable_activation_offload", False,
         "activations stay on the device (enable_gradient_checkpointing bounds them)"),
    NoOp(f"{AR}.model.use_fused_kernels", False, "log-probs always come from archer's chunked kernel"),
    NoOp(f"{AR}.model.use_liger", False, "log-probs always come from archer's chunked kernel"),
    NoOp(f"{AR}.model.fused_kernel_options.impl_backend", "torch", "log-probs come from archer's chunked kernel"),
    NoOp(f"{AR}.model.use_shm", False, "the model is read from its folder"),
    NoOp(f"{AR}.actor.strategy", "fsdp", STRATEGY),
    NoOp(f"{AR}.actor.use_torch_compile", True, "the update runs eagerly"),
    NoOp(f"{AR}.actor.ulysses_sequence_parallel_size", 1, NO_SP),
    NoOp(f"{AR}.actor.entropy_from_logits_with_chunking", False, "archer always computes entropy in chunks"),
    NoOp(f"{AR}.actor.entropy_checkpointing", False, "archer always makes each chunk's logits again in the backward"),
    NoOp(f"{AR}.actor.checkpoint.save_contents", ["model", "optimizer", "extra"],
         "a checkpoint always holds the model, the optimiser and the trainer state"),
    NoOp(f"{AR}.actor.checkpoint.load_contents", ["model", "optimizer", "extra"],
         "resuming always loads the model, the optimiser and the trainer state"),
    NoOp(f"{AR}.actor.optim.total_training_steps", -1, "the trainer sets the schedule's length"),
    NoOp(f"{AR}.actor.fsdp_config.offload_policy", False, "param_offload / optimizer_offload turn on FSDP2's CPU offload"),
    NoOp(f"{AR}.actor.fsdp_config.reshard_after_forward", True, RESHARD),
    NoOp(f"{AR}.actor.fsdp_config.fsdp_size", -1, FSDP_SIZE),
    NoOp(f"{AR}.actor.fsdp_config.wrap_policy.min_num_params", 0, WRAP),
    NoOp(f"{AR}.ref.strategy", "fsdp", STRATEGY),
    NoOp(f"{AR}.ref.ulysses_sequence_parallel_size", 1, NO_SP),
    NoOp(f"{AR}.ref.fsdp_config.param_offload", False, SHARDED_OFFLOAD, sharded_only=True),
    *(NoOp(f"{section}.fsdp_config.mixed_precision.{name}", default, MIXED, sharded_only=True)
      for section in (f"{AR}.actor", f"{AR}.ref", "critic.model")
      for name, default in (("param_dtype", "bf16"), ("reduce_dtype", "fp32"))),
    *(NoOp(f"{section}.fsdp_config.mixed_precision.buffer_dtype", "fp32", "FSDP2 keeps buffers in their own dtype")
      for section in (f"{AR}.actor", f"{AR}.ref", "critic.model")),
    NoOp(f"{AR}.ref.fsdp_config.reshard_after_forward", True, RESHARD),
    NoOp(f"{AR}.ref.fsdp_config.wrap_policy.min_num_params", 0, WRAP),
    NoOp(f"{AR}.rollout.mode", "sync", "generation runs synchronously between the trainer's stages"),
    NoOp(f"{AR}.rollout.ignore_eos", False, "generation stops at the end-of-sequence token", _truthy,
         "drop actor_rollout_ref.rollout.ignore_eos (responses end at eos, as the reward expects)"),
    NoOp(f"{AR}.rollout.load_format", "dummy_dtensor", "the engine copies the actor's weights in place"),
    NoOp(f"{AR}.rollout.tensor_model_parallel_size", 1, "the engine runs on one GPU", _above(1),
         "set actor_rollout_ref.rollout.tensor_model_parallel_size=1 (archer's engines run on one device)"),
    NoOp(f"{AR}.rollout.disable_log_stats", True, "the engine logs no statistics"),
    NoOp(f"{AR}.rollout.enable_chunked_prefill", True, "prefill is cut into max_num_batched_tokens batches"),
    NoOp(f"{AR}.rollout.calculate_log_probs", False, "archer always returns the rollout log-probs"),
    NoOp(f"{AR}.rollout.engine_kwargs", {}, "the engines take no extra arguments"),
    NoOp(f"{AR}.rollout.checkpoint_engine.backend", "naive",
         "the engine takes the policy's weights in process (standalone rollout GPUs are not built yet)"),
    NoOp(f"{AR}.rollout.checkpoint_engine.update_weights_bucket_megabytes", 2048,
         "the engine takes the policy's weights one tensor at a time, in process"),
    NoOp("critic.rollout_n", f"${{{AR}.rollout.n}}", f"{AR}.rollout.n governs"),
    NoOp("critic.strategy", "fsdp", STRATEGY),
    NoOp("critic.optim.total_training_steps", -1, "the trainer sets the schedule's length"),
    NoOp("critic.model.tokenizer_path", f"${{{AR}.model.path}}", "the critic reads the actor's tokenized batch"),
    NoOp("critic.model.override_config", {}, "the model's config.json is used as it is", _truthy,
         "edit the critic model folder's config.json (or drop critic.model.override_config)"),
    NoOp("critic.model.external_lib", None, "nothing is imported; the model must load with transformers"),
    NoOp("critic.model.fsdp_config.param_offload", False, SHARDED_OFFLOAD, sharded_only=True),
    NoOp("critic.model.fsdp_config.optimizer_offload", False, SHARDED_OFFLOAD, sharded_only=True),
    NoOp("critic.model.fsdp_config.offload_policy", False, "param_offload / optimizer_offload turn on FSDP2's CPU offload"),
    NoOp("critic.model.fsdp_config.reshard_after_forward", True, RESHARD),
    NoOp("critic.model.fsdp_config.fsdp_size", -1, FSDP_SIZE),
    NoOp("critic.model.fsdp_config.wrap_policy.min_num_params", 0, WRAP),
    NoOp("critic.ulysses_sequence_parallel_size", 1, NO_SP),
    NoOp("critic.checkpoint.save_contents", ["model", "optimizer", "extra"],
         "a checkpoint always holds the model, the optimiser and the trainer state"),
    NoOp("critic.checkpoint.load_contents", ["model", "optimizer", "extra"],
         "resuming always loads the model, the optimiser and the trainer state"),
    NoOp("reward_model.overlong_buffer.log", False, "the overlong penalty's metrics are always logged"),
    NoOp("reward_model.launch_reward_fn_async", False, "rewards are computed after each generation batch"),
    NoOp("trainer.balance_batch", True, "the ranks take contiguous rows of the batch in order (no reordering by length)"),
    NoOp("trainer.default_hdfs_dir", None, "checkpoints stay in trainer.default_local_dir"),
    NoOp("trainer.del_local_ckpt_after_load", False, "checkpoints are kept (max_actor_ckpt_to_keep prunes them)"),
    NoOp("trainer.max_critic_ckpt_to_keep", None, "a checkpoint holds actor and critic; max_actor_ckpt_to_keep governs"),
    NoOp("trainer.use_legacy_worker_impl", "auto", "archer has one worker implementation"),
    NoOp("trainer.use_v1", True, "archer has one RL loop: the synchronous one both of verl's trainers run "
         "(trainer.v1.trainer_mode=sync)"),
    NoOp("trainer.entropy_trace.update_summary_every", 1, "summary.json is rewritten with every written step"),
    NoOp("trainer.entropy_trace.atomic_write", True, "archer's trace writes are always atomic"),
    NoOp("trainer.influence_trace.atomic_write", True, "archer's trace writes are always atomic"),
    NoOp("trainer.influence_trace.profile_timing", False, "phase timings are always in metrics.jsonl"),
)


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _default(cfg: DictConfig, entry: NoOp) -> Any:
    if isinstance(entry.default, str) and entry.default.startswith("${"):
        return _plain(OmegaConf.select(cfg, entry.default[2:-1]))
    return entry.default


def set_no_ops(cfg: DictConfig, table: tuple[NoOp, ...] = NO_OPS) -> list[tuple[NoOp, Any]]:
    """The entries of ``table`` that ``cfg`` sets to something other than their default, with the value."""
    out = []
    for entry in table:
        value = _plain(OmegaConf.select(cfg, entry.key))
        if value != _default(cfg, entry):
            out.append((entry, value))
    return out


def check_no_ops(cfg: DictConfig, table: tuple[NoOp, ...] = NO_OPS) -> None:
    """Refuse a value whose no-op would change the result (the first, as an ArcherError); warn once about each
    other key set to a value archer does not act on."""
    found = set_no_ops(cfg, table)
    if world_size(cfg.trainer) > 1:
        found = [(entry, value) for entry, value in found if not entry.sharded_only]
    for entry, value in found:
        if entry.refuse is not None and entry.refuse(value):
            raise ArcherError(f"{entry.key}={value!r} cannot be honoured: {entry.note}", entry.fix)
    for entry, value in found:
        log.warning("%s=%r has no effect in archer: %s", entry.key, value, entry.note)
