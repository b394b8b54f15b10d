"""One run folder, one experiment: the guard and the resume recipe that ``archer train`` and ``archer sft`` share.

Before anything is written, ``RunFolder.check_experiment`` compares the new config with the folder's saved
``config.yaml`` (when the folder holds a run: a ``metrics.jsonl`` or a complete checkpoint). Every key defines
the experiment but those of ``CONTINUABLE`` (the run's length, what is logged and saved and where, and where
and in how much memory it runs; for ``archer train`` also the keys archer accepts without acting on them,
config/no_ops.py). A defining key that differs is one error naming each key with both values and the fix:
another ``trainer.default_local_dir``, the saved values, or ``trainer.allow_config_change=true`` to continue
anyway. A continuable difference is allowed and logged. ``RunFolder.finished_summary`` then tells a finished
run (its ``summary.json`` reached the config's total steps: a rerun changes nothing) and refuses a folder with
metrics it cannot resume. A refused run leaves every file of the folder as it was.

A checkpoint's ``trainer_state.pt`` (``save_trainer_state`` / ``restore_trainer_state``) holds the step, the
data position, the RNG states and the run record: the wall time so far and the figures the summary reports
(validation before and after for RL, the last metrics for SFT), so that a resumed run's summary keeps them.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from archer.config.loader import CONFIG_DIR, known_keys
from archer.config.no_ops import NO_OPS
from archer.data.loader import PromptLoader
from archer.errors import ArcherError
from archer.trainer.checkpoint_dirs import (
    CheckpointManager,
    capture_rng_state,
    load_torch_state,
    restore_rng_state,
    save_torch_state,
)
from archer.trainer.tracking import METRICS_FILE

log = logging.getLogger("archer.trainer")

CONFIG_FILE = "config.yaml"
CHECKPOINTS_DIR = "checkpoints"
SUMMARY_FILE = "summary.json"
TRAINER_STATE = "trainer_state.pt"
OVERRIDE_KEY = "trainer.allow_config_change"
ABSENT = "(absent)"  # a key one of the two configs does not have
SHOWN_KEYS = 8  # differing keys named one by one in the error; the rest are counted
SHOWN_CHARS = 160  # a longer value loses its middle in the messages

# Keys that may change when a run continues (``x.*``: every key under x); every other key defines the experiment.
_RUN_KEYS = (  # the run's length, what it logs and saves, and where
    "trainer.total_epochs", "trainer.total_training_steps", "trainer.project_name", "trainer.experiment_name",
    "trainer.logger", "trainer.save_freq", "trainer.test_freq", "trainer.resume_mode", "trainer.resume_from_path",
    "trainer.default_local_dir", "trainer.plots", OVERRIDE_KEY,
)
CONTINUABLE: dict[str, tuple[str, ...]] = {
    "ppo_trainer": (
        *_RUN_KEYS, "trainer.log_val_generations", "trainer.rollout_data_dir", "trainer.validation_data_dir",
        "trainer.val_before_train", "trainer.val_only", "trainer.max_actor_ckpt_to_keep",
        "trainer.entropy_trace.output_dir", "trainer.entropy_trace.fsync", "trainer.influence_trace.output_dir",
        "trainer.influence_trace.fsync", "eval.*",
        # what the health checks flag and whether a critical flag stops the run: they read the run, never steer it
        "trainer.health.*", "trainer.max_steps_without_update",
        # where and in how much memory it runs: the same losses and updates (the losses are normalised over the
        # whole mini-batch; only choices made per micro-batch move, docs/training.md, "Micro-batches")
        "trainer.device", "trainer.nnodes", "trainer.n_gpus_per_node", "actor_rollout_ref.nccl_timeout",
        "trainer.balance_batch", "actor_rollout_ref.model.use_liger",  # which rank takes a row; fused kernels
        "actor_rollout_ref.model.enable_gradient_checkpointing", "actor_rollout_ref.model.gradient_checkpointing_layers",
        "actor_rollout_ref.model.use_remove_padding",
        "actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.actor.logprob_chunk_size", "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload", "actor_rollout_ref.ref.log_prob_micro_batch_size",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.free_cache_engine",
        "actor_rollout_ref.rollout.enforce_eager", "actor_rollout_ref.rollout.max_num_batched_tokens",
        "actor_rollout_ref.rollout.max_num_seqs", "actor_rollout_ref.rollout.max_batch_size",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.rollout.tools.max_workers", "critic.model.enable_gradient_checkpointing",
        "critic.model.use_remove_padding", "critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu",
        "critic.forward_micro_batch_size", "critic.forward_micro_batch_size_per_gpu", "critic.use_dynamic_bsz",
        "critic.ppo_max_token_len_per_gpu", "critic.forward_max_token_len_per_gpu", "reward_model.micro_batch_size",
        "reward_model.micro_batch_size_per_gpu", "reward_model.use_dynamic_bsz",
        "reward_model.forward_max_token_len_per_gpu", "actor_rollout_ref.rollout.log_prob_by_tokens",
        "actor_rollout_ref.ref.log_prob_by_tokens", "critic.forward_by_tokens", "reward_model.forward_by_tokens",
        *(entry.key for entry in NO_OPS if entry.in_schema),  # accepted without effect
    ),
    "sft_trainer": (
        *_RUN_KEYS, "trainer.max_ckpt_to_keep", "trainer.device",
        "data.micro_batch_size_per_gpu",  # gradient accumulation is exact (the loss is normalised over the batch)
        "model.enable_gradient_checkpointing", "model.use_liger",
    ),
}


def _leaves(cfg: DictConfig, resolve: bool = True) -> dict[str, Any]:
    """Every leaf of a config as dotted key -> plain value (a mapping's entries are leaves of their own)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = node

    walk(OmegaConf.to_container(cfg, resolve=resolve), "")
    return out


def config_changes(saved: DictConfig, new: DictConfig, config_name: str) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (saved value, new value) of every leaf that differs (``ABSENT`` where a config lacks it). A
    schema key that one config lacks (a config of another archer version) differs only when the other sets it
    to something else than its default; an entry of a free-form mapping (a tool, a reward argument) that one
    lacks always differs."""
    before, after = _leaves(saved), _leaves(new)
    _, open_maps = known_keys(config_name)
    defaults = _leaves(OmegaConf.load(CONFIG_DIR / f"{config_name}.yaml"), resolve=False)
    changes = {}
    for key in sorted(before.keys() | after.keys()):
        old, value = before.get(key, ABSENT), after.get(key, ABSENT)
        if old == value:
            continue
        in_open_map = any(key.startswith(m + ".") for m in open_maps)
        if not in_open_map and ABSENT in (old, value) and defaults.get(key, ABSENT) in (old, value):
            continue  # a key of another version's schema, at its default
        changes[key] = (old, value)
    return changes


def is_continuable(key: str, config_name: str) -> bool:
    """Whether ``key`` may change when a run of ``config_name`` continues (CONTINUABLE)."""
    for pattern in CONTINUABLE[config_name]:
        if key == pattern or (pattern.endswith(".*") and key.startswith(pattern[:-1])):
            return True
    return False


def _shown(value: Any) -> str:
    text = value if value == ABSENT else json.dumps(value)
    half = SHOWN_CHARS // 2
    return text if len(text) <= SHOWN_CHARS else f"{text[:half]}...{text[-half:]}"


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    """``key (saved A, now B)`` for the first SHOWN_KEYS changes, and how many more."""
    parts = [f"{key} (saved {_shown(a)}, now {_shown(b)})" for key, (a, b) in list(changes.items())[:SHOWN_KEYS]]
    if len(changes) > SHOWN_KEYS:
        parts.append(f"and {len(changes) - SHOWN_KEYS} more")
    return "; ".join(parts)


class RunFolder:
    """The run folder ``cfg.trainer.default_local_dir`` of an ``archer train`` (config_name ``ppo_trainer``) or
    ``archer sft`` (``sft_trainer``) config: what it holds, and whether this config may train into it."""

    def __init__(self, cfg: DictConfig, config_name: str) -> None:
        self.cfg = cfg
        self.config_name = config_name
        self.path = Path(cfg.trainer.default_local_dir)
        self.checkpoints = CheckpointManager(self.path / CHECKPOINTS_DIR)  # only read here: no clean-up of debris

    def holds_run(self) -> bool:
        """A run trained here: its metrics.jsonl is not empty, or a checkpoint is complete (read only)."""
        metrics = self.path / METRICS_FILE
        return (metrics.is_file() and metrics.stat().st_size > 0) or bool(self.checkpoints.complete_steps())

    def check_experiment(self) -> None:
        """Before anything is written: refuse to train into a folder holding a run when resume_mode=disable, or
        when the saved config differs in a key that defines the experiment (unless trainer.allow_config_change);
        log the continuable differences."""
        if not self.holds_run():
            return
        trainer = self.cfg.trainer
        if trainer.resume_mode == "disable":
            raise ArcherError(f"{self.path} already holds a run (metrics.jsonl or checkpoints) and "
                              "trainer.resume_mode=disable", "choose a new trainer.default_local_dir, or continue it "
                              "with trainer.resume_mode=auto")
        saved_path = self.path / CONFIG_FILE
        if not saved_path.is_file():
            return
        changes = config_changes(OmegaConf.load(saved_path), self.cfg, self.config_name)
        defining = {k: v for k, v in changes.items() if not is_continuable(k, self.config_name)}
        allowed = {k: v for k, v in changes.items() if k not in defining}
        if defining and not trainer.allow_config_change:
            raise ArcherError(
                f"{self.path} holds another experiment: its {CONFIG_FILE} differs in what defines the run: "
                f"{describe_changes(defining)}",
                "train into a new folder (trainer.default_local_dir=NEW_DIR), or give those keys their saved values "
                f"to continue that run; {OVERRIDE_KEY}=true continues it with the new values (from its own "
                "checkpoint, whatever the model path says)")
        if defining:
            log.warning("%s: continuing with changed settings (%s=true): %s", self.path, OVERRIDE_KEY,
                        describe_changes(defining))
        if allowed:
            log.info("%s: continuing with changed settings: %s", self.path, describe_changes(allowed))

    def saved_summary(self) -> dict[str, Any]:
        """The folder's summary.json (written last, atomically, by a run that finished), or {} when it has none
        that reads as a summary with its step count."""
        try:
            summary = json.loads((self.path / SUMMARY_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return summary if isinstance(summary, dict) and isinstance(summary.get("steps"), int) else {}

    def finished_summary(self, total_steps: int) -> dict[str, Any] | None:
        """The saved summary when the run here finished at ``total_steps`` or later (a rerun has nothing to do);
        None when there is a run to start or continue. A folder with metrics but nothing to resume is refused."""
        if not self.holds_run():
            return None
        summary = self.saved_summary()
        if summary.get("steps", -1) >= total_steps:
            log.info("%s: this run finished at step %d (%s); nothing to do (raise trainer.total_training_steps to "
                     "train further, or choose a new trainer.default_local_dir for another run)",
                     self.path, summary["steps"], SUMMARY_FILE)
            return summary
        if self.cfg.trainer.resume_mode == "auto" and not self.checkpoints.complete_steps():
            done = f"finished at step {summary['steps']}" if summary else "holds a run (metrics.jsonl)"
            raise ArcherError(f"{self.path} {done} but has no complete checkpoint to continue from "
                              "(trainer.resume_mode=auto); archer keeps its files rather than overwrite them",
                              "choose a new trainer.default_local_dir, or move the old metrics.jsonl away to start "
                              "this run over in that folder (trainer.save_freq=N makes runs that can continue)")
        return None


RESUME_MODES = ("auto", "disable", "resume_path")


def check_resume_mode(trainer: DictConfig) -> None:
    """trainer.resume_mode and its path, the one check of `archer train` (trainer/config_check.py) and `archer sft`."""
    mode = trainer.resume_mode
    if mode not in RESUME_MODES:
        raise ArcherError(f"unknown trainer.resume_mode {mode!r}", f"use one of {', '.join(RESUME_MODES)}")
    if mode == "resume_path" and not trainer.resume_from_path:
        raise ArcherError("trainer.resume_mode=resume_path but trainer.resume_from_path is not set",
                          "set trainer.resume_from_path=<run>/checkpoints/global_step_N, or use trainer.resume_mode=auto "
                          "to resume from the newest checkpoint of trainer.default_local_dir")


def checkpoint_to_resume(trainer: DictConfig, checkpoints: CheckpointManager, model_folder: str, *,
                         read_only: bool = False) -> Path | None:
    """The checkpoint trainer.resume_mode names: resume_from_path (which must hold ``model_folder``, the run kind's
    model: ``actor`` or ``model``), the newest complete one of the run folder (auto), or none (disable, or auto
    without a checkpoint). ``read_only`` leaves the folder's debris alone, for a reader (val_only) while another
    process may be training into it."""
    if trainer.resume_mode == "disable":
        return None
    if trainer.resume_mode == "resume_path":
        path = Path(str(trainer.resume_from_path))
        if not ((path / TRAINER_STATE).is_file() and (path / model_folder).is_dir()):
            raise ArcherError(f"trainer.resume_from_path={path} is not a checkpoint of this kind of run (it needs "
                              f"{TRAINER_STATE} and {model_folder}/)",
                              "point it at a <run>/checkpoints/global_step_N folder of a run of the same command")
        return path
    if read_only:
        steps = checkpoints.complete_steps()
        return checkpoints.step_dir(steps[-1]) if steps else None
    step = checkpoints.latest_step()
    return None if step is None else checkpoints.load_dir(step)


class RunClock:
    """A run's wall time over its sessions: the time recorded at the checkpoint it resumed from, plus this one's."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.earlier = 0.0

    def seconds(self) -> float:
        return self.earlier + time.perf_counter() - self.started


def save_trainer_state(directory: Path, step: int, loader: PromptLoader, clock: RunClock, record: dict[str, Any],
                       **extra: Any) -> None:
    """``<checkpoint>/trainer_state.pt``: the step, data position, RNG states, and the run record (``record``: the
    summary's figures so far, plain values; with the wall time so far) that a resumed run's summary keeps."""
    save_torch_state(directory / TRAINER_STATE, {"global_step": step, "loader": loader.state_dict(),
                                                 "rng": capture_rng_state(),
                                                 "run": {**record, "wall_time_s": clock.seconds()}, **extra})


def restore_trainer_state(checkpoint: Path, loader: PromptLoader, clock: RunClock) -> dict[str, Any]:
    """Restore the data position, RNG states and wall time of ``checkpoint``; returns its trainer state (its
    ``run`` record is empty for a checkpoint of an archer that did not keep one)."""
    state = load_torch_state(checkpoint / TRAINER_STATE)
    loader.load_state_dict(state["loader"])
    restore_rng_state(state["rng"])
    state.setdefault("run", {})
    clock.earlier = float(state["run"].get("wall_time_s", 0.0))
    log.info("resumed from %s (step %d)", checkpoint, state["global_step"])
    return state
