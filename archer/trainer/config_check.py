"""Checks of an RL config that need no data and no model: counts in range, enumerated values and ranges
(config_values.py), combinations archer can run, and the
keys archer accepts without acting on them (config/no_ops.py: a warning, or an error where ignoring the value
would change the result).

``check_config`` runs before any file is read or model loaded (``archer train`` calls it right after
composing the config), so a bad value is reported naming its key, not as an internal error after the model
has loaded.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf

from archer.config.loader import as_list
from archer.config.no_ops import check_no_ops
from archer.config.world import world_size
from archer.controller.ray_cluster import RAY_INIT, LocalRay
from archer.errors import ArcherError
from archer.health.settings import HealthSettings
from archer.models.lora import LoraSettings
from archer.models.router_replay import MODE_KEY as ROUTER_MODE_KEY
from archer.models.router_replay import RECORD_KEY as ROUTER_RECORD_KEY
from archer.models.router_replay import ReplaySettings
from archer.rewards.row_scorers import check_manager
from archer.rewards.shaping import OverlongBuffer
from archer.rollout.agentic_config import check_agentic_config, uses_tools
from archer.rollout.factory import check_engine_name
from archer.rollout.policy_versions import oldest_trained_age
from archer.trace.influence import check_settings as check_influence_settings
from archer.trainer.config_values import check_choices, check_micro_batches, check_ranges
from archer.trainer.group_filter import check_filter_metric
from archer.trainer.run_folder import check_resume_mode
from archer.workers.actor_objective import loss_switches
from archer.workers.reward_model import check_reward_model_config
from archer.workers.rollout_correction_config import read_rollout_correction

log = logging.getLogger("archer.config")

# Keys that count something and must be at least 1.
COUNT_KEYS = (
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.rollout.max_batch_size",
    "actor_rollout_ref.rollout.prompt_length",  # the engine-facing lengths and sizes
    "actor_rollout_ref.rollout.response_length",
    "actor_rollout_ref.rollout.max_num_seqs",
    "actor_rollout_ref.rollout.max_num_batched_tokens",
    "critic.ppo_mini_batch_size",
    "critic.ppo_epochs",
    "critic.ppo_max_token_len_per_gpu",
    "critic.forward_max_token_len_per_gpu",
    "trainer.total_epochs",
)
# The same for keys whose null means "use another size" (the whole batch, train_batch_size, the epochs, the
# automatic chunk size, prompt_length + response_length).
NULLABLE_COUNT_KEYS = (
    "data.gen_batch_size",
    "data.val_batch_size",
    "actor_rollout_ref.actor.logprob_chunk_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.max_model_len",
    "critic.ppo_micro_batch_size",
    "critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size",
    "critic.forward_micro_batch_size_per_gpu",
    "trainer.total_training_steps",
)


# Keys that count something and may be 0 (which switches what they bound off).
ZERO_COUNT_KEYS = ("trainer.max_steps_without_update",)


def check_counts(cfg: DictConfig) -> None:
    """Every count key is an integer >= 1 (the nullable ones may also be null; the zero ones 0)."""
    for key in ZERO_COUNT_KEYS:
        value = OmegaConf.select(cfg, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ArcherError(f"{key}={value!r} must be an integer of at least 0", f"set {key} to 0 or more")
    for key in (*COUNT_KEYS, *NULLABLE_COUNT_KEYS):
        value = OmegaConf.select(cfg, key)
        if value is None and key in NULLABLE_COUNT_KEYS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            unset = " (or null)" if key in NULLABLE_COUNT_KEYS else ""
            raise ArcherError(f"{key}={value!r} must be an integer of at least 1",
                              f"set {key} to a positive integer{unset}")


def check_world(cfg: DictConfig) -> None:
    """What a run on several ranks (trainer.nnodes x trainer.n_gpus_per_node > 1) cannot do yet."""
    trainer = cfg.trainer
    world = world_size(trainer)
    if world == 1 or trainer.val_only:
        return
    trace = trainer.influence_trace
    if trace.enable and trace.output_function != "training_loss":
        raise ArcherError(f"trainer.influence_trace.output_function={trace.output_function} needs an extra "
                          f"backward of the traced rows alone, which a sharded policy cannot run; this run has "
                          f"{world} ranks (trainer.nnodes x trainer.n_gpus_per_node)",
                          "trace the training loss (trainer.influence_trace.output_function=training_loss, captured "
                          "during the update on every rank), or trace on one device (trainer.n_gpus_per_node=1)")


def check_config(cfg: DictConfig) -> None:
    """Values and combinations archer cannot run, reported before any data or model is loaded."""
    check_counts(cfg)
    check_choices(cfg)  # enumerated values, ranges and batch nesting (trainer/config_values.py)
    check_ranges(cfg)
    check_micro_batches(cfg)
    check_no_ops(cfg)
    if cfg.reward_model.enable:
        check_reward_model_config(cfg)
    elif cfg.reward_model.model.path:
        log.warning("reward_model.model.path is set but reward_model.enable=false: the rule rewards score every "
                    "response (set reward_model.enable=true to use the reward model)")
    check_engine_name(cfg.actor_rollout_ref.rollout.name)
    LoraSettings.from_config(cfg.actor_rollout_ref.model)  # lora_rank, lora_alpha, target_modules
    actor = cfg.actor_rollout_ref.actor
    correction = read_rollout_correction(cfg.algorithm.rollout_correction)
    loss_switches(correction.policy_loss(actor.policy_loss.loss_mode), actor)  # a loss (mode) and switches it takes
    if correction.is_level is not None and not correction.applies_weights:
        log.warning("algorithm.rollout_correction.rollout_is=%s with bypass_mode and loss_type=ppo_clip: the IS "
                    "weights are diagnostics only (rollout_corr/*); the PPO ratio pi_theta / pi_rollout corrects "
                    "(loss_type=reinforce applies them)", correction.is_level.name)
    check_trainer_mode(cfg)
    check_agentic_config(cfg.actor_rollout_ref.rollout)
    check_router_replay(cfg)
    check_trainer_modes(cfg.trainer, has_val_files=bool(as_list(cfg.data.val_files)))
    if not cfg.trainer.val_only and not as_list(cfg.data.train_files):
        raise ArcherError("data.train_files is not set: training needs prompts",
                          "set data.train_files to the training parquet file(s) (trainer.val_only=true needs none)")
    if int(cfg.eval.score_workers) < 1:
        raise ArcherError(f"eval.score_workers={cfg.eval.score_workers} must be at least 1", "set eval.score_workers=1 or more")
    train_bs, mini = int(cfg.data.train_batch_size), int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    if mini > train_bs or train_bs % mini:
        raise ArcherError(f"actor.ppo_mini_batch_size={mini} must divide data.train_batch_size={train_bs}",
                          "pick a mini-batch size that divides the train batch size (both count prompts)")
    if cfg.trainer.influence_trace.enable:
        check_influence_settings(cfg.trainer.influence_trace)
    check_world(cfg)
    check_ray_settings(cfg)
    HealthSettings.from_config(cfg.trainer.health)  # trainer.health.*: thresholds, windows, stop_on
    check_manager(str(cfg.reward_model.reward_manager),
                  OmegaConf.to_container(cfg.reward_model.reward_kwargs, resolve=True),
                  has_custom_function=bool(cfg.custom_reward_function.path))
    buffer = cfg.reward_model.overlong_buffer
    if buffer.enable:
        OverlongBuffer(int(cfg.data.max_response_length), int(buffer.len), float(buffer.penalty_factor))
    filter_groups = cfg.algorithm.filter_groups
    if filter_groups.enable:
        check_filter_metric(filter_groups.metric)
    elif cfg.data.gen_batch_size is not None and int(cfg.data.gen_batch_size) != train_bs:
        raise ArcherError(f"data.gen_batch_size={cfg.data.gen_batch_size} differs from data.train_batch_size={train_bs} "
                          "but dynamic sampling is off", "set algorithm.filter_groups.enable=true, or drop data.gen_batch_size")


def ray_settings(cfg: DictConfig) -> LocalRay:
    """ray_kwargs.ray_init: the settings of the local Ray a run starts without RAY_ADDRESS."""
    return LocalRay.from_config(OmegaConf.to_container(cfg.ray_kwargs.ray_init))


def check_ray_settings(cfg: DictConfig) -> None:
    """ray_kwargs.ray_init's values (controller/ray_cluster.py); a warning when they are set for a run that starts
    no Ray (one rank, not separate_async)."""
    local = ray_settings(cfg)
    if local != LocalRay() and world_size(cfg.trainer) == 1 and cfg.trainer.v1.trainer_mode != "separate_async":
        log.warning("%s is set, but this run has one rank and starts no Ray: the settings have no effect", RAY_INIT)


TRAINER_MODES = ("sync", "colocate_async", "separate_async")
NODE_PLACEMENTS = ("auto", "apart", "shared")
OFF_POLICY_STRATEGIES = ("drop", "wait")


def check_trainer_mode(cfg: DictConfig) -> None:
    """verl's V1 trainer keys (trainer.v1, actor_rollout_ref.rollout.nnodes): values in range, and what each
    mode does not combine with (docs/async.md); standalone rollout GPUs only in separate_async."""
    v1 = cfg.trainer.v1
    mode = v1.trainer_mode
    if mode not in TRAINER_MODES:
        raise ArcherError(f"unknown trainer.v1.trainer_mode {mode!r}", f"use one of: {', '.join(TRAINER_MODES)}")
    for key in ("colocate_async.num_warmup_batches", "separate_async.num_warmup_batches",
                "sampler.max_off_policy_threshold"):
        value = OmegaConf.select(v1, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ArcherError(f"trainer.v1.{key}={value!r} must be an integer of at least 0",
                              f"set trainer.v1.{key} to 0 or more")
    sync_step = v1.separate_async.parameter_sync_step
    if not isinstance(sync_step, int) or isinstance(sync_step, bool) or sync_step < 1:
        raise ArcherError(f"trainer.v1.separate_async.parameter_sync_step={sync_step!r} must be an integer of at "
                          "least 1", "set it to 1 or more")
    if v1.separate_async.node_placement not in NODE_PLACEMENTS:
        raise ArcherError(f"unknown trainer.v1.separate_async.node_placement {v1.separate_async.node_placement!r}",
                          f"use one of: {', '.join(NODE_PLACEMENTS)}")
    if v1.sampler.max_off_policy_strategy not in OFF_POLICY_STRATEGIES:
        raise ArcherError(f"unknown trainer.v1.sampler.max_off_policy_strategy "
                          f"{v1.sampler.max_off_policy_strategy!r}", f"use one of: {', '.join(OFF_POLICY_STRATEGIES)}")
    if mode == "separate_async":
        check_separate_async(cfg)
        return
    if mode == "colocate_async":
        check_colocate_async(cfg)
    nodes = cfg.actor_rollout_ref.rollout.nnodes
    if nodes != 0:
        raise ArcherError(f"actor_rollout_ref.rollout.nnodes={nodes!r}: standalone rollout GPUs serve "
                          f"trainer.v1.trainer_mode=separate_async, not {mode}",
                          "set actor_rollout_ref.rollout.nnodes=0 (the trainer's GPUs generate), or "
                          "trainer.v1.trainer_mode=separate_async")


def check_separate_async(cfg: DictConfig) -> None:
    """separate_async: standalone rollout GPUs configured, verl's parameter_sync_step consistent
    with archer's one sync a step, and a staleness bound that the pipeline's one version of lag (plus the
    warm-up's) passes."""
    v1, rollout, actor = cfg.trainer.v1, cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    for key in ("nnodes", "n_gpus_per_node"):
        value = rollout[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ArcherError(f"trainer.v1.trainer_mode=separate_async needs standalone rollout GPUs, but "
                              f"actor_rollout_ref.rollout.{key}={value!r}",
                              "set actor_rollout_ref.rollout.nnodes=1 and actor_rollout_ref.rollout.n_gpus_per_node "
                              "to the GPUs that generate (trainer.n_gpus_per_node GPUs train beside them)")
    bucket = rollout.checkpoint_engine.update_weights_bucket_megabytes
    if not isinstance(bucket, (int, float)) or isinstance(bucket, bool) or bucket <= 0:
        raise ArcherError(f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes={bucket!r}: "
                          "the weight sync's buckets need a positive size in MiB",
                          "set it to e.g. 512 (verl's default is 2048)")
    sync_step, mini, train = (int(v1.separate_async.parameter_sync_step), int(actor.ppo_mini_batch_size),
                              int(cfg.data.train_batch_size))
    if sync_step * mini != train:
        raise ArcherError(f"trainer.v1.separate_async.parameter_sync_step={sync_step} x "
                          f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} is not data.train_batch_size={train}: "
                          "archer syncs the weights once a step, after its last mini-batch",
                          f"set trainer.v1.separate_async.parameter_sync_step={max(1, train // max(1, mini))} "
                          "(and ppo_mini_batch_size dividing data.train_batch_size)")
    warmup, bound = int(v1.separate_async.num_warmup_batches), int(v1.sampler.max_off_policy_threshold)
    if bound < oldest_trained_age(warmup, engine_lag=1):
        raise ArcherError(f"trainer.v1.sampler.max_off_policy_threshold={bound} is below what separate_async's "
                          f"groups reach: one version (the trainer is one update ahead of the rollout ranks) plus "
                          f"num_warmup_batches={warmup}", f"set trainer.v1.sampler.max_off_policy_threshold to "
                          f"{warmup + 1} or more, or lower trainer.v1.separate_async.num_warmup_batches")


def check_colocate_async(cfg: DictConfig) -> None:
    """A warm-up that the staleness bound would evict or force at once."""
    v1 = cfg.trainer.v1
    warmup, bound = v1.colocate_async.num_warmup_batches, v1.sampler.max_off_policy_threshold
    if bound < oldest_trained_age(warmup, engine_lag=0):
        raise ArcherError(f"trainer.v1.colocate_async.num_warmup_batches={warmup} is more than "
                          f"trainer.v1.sampler.max_off_policy_threshold={bound}: the warm-up's groups would be older "
                          "than the bound when they are trained", "lower num_warmup_batches or raise the threshold")


def check_router_replay(cfg: DictConfig) -> None:
    """Routing replay's keys (models/router_replay.py): a known mode; R2 needs the old-log-prob pass it records
    in; the engine records only in the sync trainer mode's generation with the fast engine, without tools (the
    model's MoE blocks are checked by the actor)."""
    settings = ReplaySettings.from_config(cfg.actor_rollout_ref)
    keys = f"{ROUTER_MODE_KEY}=disabled and {ROUTER_RECORD_KEY}=false"
    if settings.own and cfg.algorithm.rollout_correction.bypass_mode:
        raise ArcherError(f"{ROUTER_MODE_KEY}=R2 replays the routing of the old-log-prob pass, which "
                          "algorithm.rollout_correction.bypass_mode=true skips",
                          f"use {ROUTER_MODE_KEY}=R3 (the engine's routing), or turn bypass_mode off")
    if not settings.record:
        return
    mode, engine = cfg.trainer.v1.trainer_mode, cfg.actor_rollout_ref.rollout.name
    if mode != "sync":
        raise ArcherError(f"routing replay records the experts of the sync mode's generation only, not "
                          f"trainer.v1.trainer_mode={mode} (its request pools keep no records)",
                          f"use trainer.v1.trainer_mode=sync, or set {keys}")
    if uses_tools(cfg.actor_rollout_ref.rollout):
        raise ArcherError("routing replay does not record the routing of tool rollouts (the multi-turn tool loop's "
                          "sessions keep no records)",
                          f"drop actor_rollout_ref.rollout.tools.tool_instances, or set {keys}")
    if engine == "hf":
        raise ArcherError("routing replay needs the fast engine, which records each token's experts; "
                          "actor_rollout_ref.rollout.name=hf does not",
                          f"set actor_rollout_ref.rollout.name=fast, or {keys}")


def check_trainer_modes(trainer: DictConfig, *, has_val_files: bool) -> None:
    """trainer.resume_mode and its path, and trainer.val_only's need for validation files."""
    check_resume_mode(trainer)
    if trainer.val_only and not has_val_files:
        raise ArcherError("trainer.val_only=true but data.val_files is not set: there is nothing to validate",
                          "set data.val_files to the validation parquet file(s), or drop trainer.val_only")
