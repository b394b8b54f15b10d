"""The RL trainer: one controller that runs the step of docs/architecture.md in order, validation, checkpoints, resume.

    prompts -rollout-> responses -reward-> token_level_scores -actor-> old_log_probs, entropies
            -ref-> ref_log_prob -critic-> values -algorithm-> advantages, returns
            -critic-> value update -actor-> policy update -> metrics, rollout dump, checkpoint
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from archer.algorithms.advantages import compute_advantage
from archer.algorithms.grouping import count_groups
from archer.algorithms.kl import apply_kl_penalty, make_kl_controller
from archer.atomic_files import recorded_path, write_json_atomically, write_text_atomically
from archer.batch import Batch
from archer.config.loader import as_list, save_config
from archer.config.world import world_size
from archer.controller.factory import build_worker_group
from archer.controller.worker_group import WorkerGroup
from archer.data.rl_data import build_rl_data
from archer.data.rl_dataset import RLDataset
from archer.distributed.shared_folder import check_shared_folder
from archer.eval.evaluator import Evaluator, records_metrics
from archer.folder_lock import FolderLock, hold_folder, refuse_if_held
from archer.health.monitor import HealthMonitor
from archer.models.loading import pick_device
from archer.models.router_replay import ROUTE_COUNTS, mismatch_metrics
from archer.rewards.extras import REWARD_EXTRAS
from archer.rewards.reward_stage import build_reward_manager
from archer.rewards.routing import check_routes
from archer.rollout.agentic_config import check_row_tools, tool_call_tags
from archer.rollout.policy_versions import engine_version
from archer.rollout.rollout_stats import RolloutStats
from archer.trace.entropy import EntropyTrace
from archer.trace.influence import InfluenceTrace
from archer.trace.influence_capture import CaptureSettings
from archer.trainer.async_batches import ASYNC_STATE, AsyncBatches
from archer.trainer.batch_sources import BatchSource, ColocateSource, SeparateSource, SyncSource
from archer.trainer.checkpoint_dirs import CheckpointManager, load_torch_state
from archer.trainer.config_check import check_config, ray_settings
from archer.trainer.group_filter import (
    informative_rows,
    too_many_batches_error,
    uniform_accuracy_rows,
)
from archer.trainer.model_check import check_sequence_lengths
from archer.trainer.no_update import TRAINED, UpdateGuard, every_response
from archer.trainer.off_policy import RolloutCorrectionStage, record_staleness
from archer.trainer.plots import plot_metrics
from archer.trainer.run_folder import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    SUMMARY_FILE,
    TRAINER_STATE,
    RunClock,
    RunFolder,
    checkpoint_to_resume,
    restore_trainer_state,
    save_trainer_state,
)
from archer.trainer.separate_rollout import SeparateRollout, build_separate_groups, stop_groups
from archer.trainer.step_metrics import MemoryPeaks, compute_data_metrics, compute_timing_metrics, timer
from archer.trainer.tracking import Tracking
from archer.workers.colocated import RankWorkers
from archer.workers.generator import CHECKPOINT_ACTOR, GenerationWorker
from archer.workers.results import ROLLOUT_STATS
from archer.workers.rollout import concat_sequences

log = logging.getLogger("archer.trainer")

VAL_ONLY_FILE = "val_only.jsonl"  # trainer.val_only: one line per validation, appended


EVAL_ONLY_KEYS = ("benchmark", "data_dir", "output_dir", "limit")  # eval.* keys only `archer eval` reads


def warn_eval_only_keys(eval_cfg: DictConfig) -> None:
    """Training's validation reads eval.k and eval.score_workers; the other eval.* keys would change nothing here."""
    set_keys = [f"eval.{k}" for k in EVAL_ONLY_KEYS if eval_cfg[k] not in (None, [])]
    if eval_cfg.judge.url:
        set_keys.append("eval.judge.url")
    if set_keys:
        log.warning("%s: read by `archer eval` only; training's validation scores data.val_files with the rule "
                    "rewards and ignores them", ", ".join(set_keys))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_data_against_config(cfg: DictConfig, dataset: RLDataset | None, where: str) -> None:
    """When the data loads, before training: without custom_reward_function every data_source has a built-in
    reward (naming the ones without and the routes there are), and the rows' tools name configured tools. The
    training rows need no rule when the reward model alone scores them (reward_model.rule_weight=0); validation
    is scored by the rules (as verl's)."""
    if dataset is None:
        return
    items = [dataset[i] for i in range(len(dataset))]
    rm = cfg.reward_model
    model_alone = bool(rm.enable) and float(rm.rule_weight) == 0 and where == "data.train_files"
    if not cfg.custom_reward_function.path and not model_alone:
        key = cfg.data.reward_fn_key
        if rm.enable and where == "data.val_files":
            where += " (validation is scored by the rule rewards; the reward model scores training, as in verl)"
        check_routes(((item[key], item["ability"]) for item in items), where)
    check_row_tools((item["tools"] for item in items), cfg.actor_rollout_ref.rollout, where)


def write_generations(path: Path, batch: Batch, texts: list[str], scores: np.ndarray, step: int) -> None:
    """One JSON line per response (verl's rollout dump): input, output, gts, score, step, then data_source, acc
    and the reward's extras (an extra named like one of these fields is written as ``reward_extra/<name>``)."""
    lines = []
    for i, (text, score) in enumerate(zip(texts, scores, strict=True)):
        record = {"input": batch["raw_prompt"][i], "output": text, "gts": batch["ground_truth"][i],
                  "score": float(score), "step": step, "data_source": batch["data_source"][i],
                  "acc": float(batch["acc"][i])}
        record.update({k: _json_value(batch[k][i]) for k in ("uid", TRAINED) if k in batch.rows})
        record.update({f"reward_extra/{k}" if k in record else k: v for k, v in batch[REWARD_EXTRAS][i].items()})
        lines.append(json.dumps(record, default=_json_value) + "\n")
    write_text_atomically(path, "".join(lines), fsync=False)


def _json_value(value: Any) -> Any:
    """numpy and torch values as plain JSON values; anything else as its str."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


class PPOTrainer:
    """Builds the workers from the config and runs training (``fit``) or validation alone."""

    def __init__(self, cfg: DictConfig) -> None:
        check_config(cfg)
        self.cfg = cfg
        self.run_dir = Path(cfg.trainer.default_local_dir)
        self.checkpoints = CheckpointManager(self.run_dir / CHECKPOINTS_DIR, cfg.trainer.max_actor_ckpt_to_keep)
        self.folder = RunFolder(cfg, "ppo_trainer")
        # one process writes a run folder (val_only only appends a line): held from before the first write until
        # fit ends or the process dies; a folder another process holds is refused first
        self.lock: FolderLock | None = None
        if not cfg.trainer.val_only:  # another experiment's folder is refused before any data or model loads
            refuse_if_held(self.run_dir, "archer train")
            self.folder.check_experiment()
        self.clock = RunClock()
        self.seed = int(cfg.trainer.seed)
        seed_everything(self.seed)
        self.device = pick_device(cfg.trainer.device)
        ref_cfg = cfg.actor_rollout_ref
        data = build_rl_data(cfg.data, model_path=ref_cfg.model.path, chat_template=ref_cfg.model.custom_chat_template)
        self.tokenizer, self.train_set, self.val_set, self.loader = data.tokenizer, data.train, data.val, data.loader
        for where, dataset in (("data.train_files", self.train_set), ("data.val_files", self.val_set)):
            check_data_against_config(cfg, dataset, where)
        check_sequence_lengths(cfg, max(d.longest_prompt for d in (data.train, data.val) if d is not None))
        warn_eval_only_keys(cfg.eval)
        self.reward_fn = build_reward_manager(cfg, self.tokenizer)
        self.global_step = 0
        # the summary's figures: the model the run started from and its validation before and after (a resumed
        # run restores them from its checkpoint)
        self.model_path = str(ref_cfg.model.path)
        self.updates = UpdateGuard(int(cfg.trainer.max_steps_without_update))  # steps that trained, stop on none
        self.val_before: dict[str, float] = {}
        self.val_last: dict[str, float] = {}
        self.finished: dict[str, Any] | None = None  # the saved summary of a run that has nothing left to do
        self.entropy_trace: EntropyTrace | None = None
        self.influence_trace: InfluenceTrace | None = None
        self.health: HealthMonitor | None = None  # trainer.health: the checks of each step (docs/health.md)
        self.peaks = MemoryPeaks(self.device)  # the current step's peak GPU memory per stage
        self.template_kwargs = OmegaConf.to_container(cfg.data.apply_chat_template_kwargs)
        self.workers: WorkerGroup | None = None
        self.source: BatchSource | None = None  # the step's generated groups, in every mode (batch_sources.py)
        if cfg.trainer.val_only:  # a policy that only generates: no optimiser, reference, critic or train data
            return
        steps = cfg.trainer.total_training_steps
        self.total_steps = int(steps) if steps else self.loader.steps_per_epoch * int(cfg.trainer.total_epochs)
        self.world = world_size(cfg.trainer)
        self.finished = self.folder.finished_summary(self.total_steps)
        if self.finished is not None:  # nothing to train: no model is loaded
            return
        self.lock = hold_folder(self.run_dir, "archer train")
        algo = cfg.algorithm
        self.rollout_correction = RolloutCorrectionStage(algo.rollout_correction)
        self.use_ref = bool(ref_cfg.actor.use_kl_loss or algo.use_kl_in_reward)
        self.use_critic = algo.adv_estimator == "gae"
        mode = str(cfg.trainer.v1.trainer_mode)
        # the driver's tokenizer goes to an in-process worker; ranks load their own
        local = self.world == 1 and mode != "separate_async"
        worker_kwargs = {"cfg": cfg, "total_steps": self.total_steps, "use_ref": self.use_ref,
                         "use_critic": self.use_critic, "tokenizer": self.tokenizer if local else None,
                         "chat_template_kwargs": self.template_kwargs}
        if not local:
            self.device = torch.device("cpu")  # the driver holds no model: the ranks own the devices
        pad = self.tokenizer.pad_token_id
        if mode == "separate_async":  # rollout GPUs of their own: two Ray worker groups
            self.workers, rollout, owns_ray = build_separate_groups(
                cfg, worker_kwargs, {"cfg": cfg, "chat_template_kwargs": self.template_kwargs})
            try:
                self.source = SeparateSource(SeparateRollout(cfg, self.workers, AsyncBatches(cfg, self.loader,
                                                                                             rollout, pad), owns_ray))
            except BaseException:
                stop_groups([rollout, self.workers], owns_ray)
                raise
        else:
            self.workers = build_worker_group(RankWorkers, worker_kwargs, nnodes=int(cfg.trainer.nnodes),
                                              n_gpus_per_node=int(cfg.trainer.n_gpus_per_node),
                                              device_kind=str(cfg.trainer.device), local_ray=ray_settings(cfg))
            remote = self.world > 1
            self.source = (ColocateSource(AsyncBatches(cfg, self.loader, self.workers, pad), pad, self.seed,
                                          remote=remote) if mode == "colocate_async"
                           else SyncSource(self.loader, self.workers, pad, self.seed, remote=remote))
        self.driver_holds_model = local  # else the trainer's ranks report their devices' peaks
        self.kl_ctrl = make_kl_controller(algo.kl_ctrl.type, float(algo.kl_ctrl.kl_coef),
                                          float(algo.kl_ctrl.target_kl), int(algo.kl_ctrl.horizon))

    # -- the step -----------------------------------------------------------------------------------------
    def generate_batch(self, step: int, gen_index: int, timings: dict[str, float],
                       rollout_stats: list[RolloutStats], metrics: dict[str, float] | None = None,
                       quota: int | None = None) -> Batch:
        """The step's ``gen_index``-th batch of prompt groups from the mode's batch source, scored:
        prompts -> responses -> token_level_scores, acc, score (``quota``: the groups a dynamic-sampling call
        still needs). The agentic loop's stats of the batch go to ``rollout_stats``."""
        batch = self.source.groups(step, gen_index, quota, timings, {} if metrics is None else metrics,
                                   lambda: timer("gen", timings, self.peaks))
        if gen_index == 0 and not self.cfg.algorithm.filter_groups.enable:
            self.source.sampled(step, self.total_steps)  # the step's only call: the next step's may start now
        return self.score_batch(batch, timings, rollout_stats) if len(batch) else batch

    def score_batch(self, batch: Batch, timings: dict[str, float], rollout_stats: list[RolloutStats]) -> Batch:
        """The reward of every response of a generated batch (the reward model's scores first, when enabled)."""
        if ROLLOUT_STATS in batch.info:
            rollout_stats.append(batch.info.pop(ROLLOUT_STATS))
        with timer("reward", timings, self.peaks):
            if self.cfg.reward_model.enable:
                batch = batch.union(self.workers.call("compute_rm_score", batch))
            self.reward_fn(batch).add_to(batch)
        return batch

    def sample_batch(self, step: int, timings: dict[str, float], metrics: dict[str, float],
                     dropped: list[Batch]) -> Batch:
        """The step's training batch: one generation batch, or with dynamic sampling (filter_groups) as many
        as it takes to keep train_batch_size informative prompt groups, trimmed to exactly that many;
        then Archer's rejection sampling, which drops groups whose accuracies are all 0 or all 1. The
        generated responses left out go to ``dropped``."""
        algo, n = self.cfg.algorithm, int(self.cfg.actor_rollout_ref.rollout.n)
        fg = algo.filter_groups
        rollout_stats: list[RolloutStats] = []
        if not fg.enable:
            batch = self.generate_batch(step, 0, timings, rollout_stats, metrics)
            metrics["train/num_candidate_groups"] = float(count_groups(batch["uid"])) if len(batch) else 0.0
        else:
            needed, limit = int(self.cfg.data.train_batch_size), int(fg.max_num_gen_batches)
            kept: list[Batch] = []
            num_kept = candidates = num_batches = 0
            while num_kept < needed:
                if limit > 0 and num_batches >= limit:  # verl: <= 0 means no limit
                    raise too_many_batches_error(num_batches, num_kept, needed)
                generated = self.generate_batch(step, num_batches, timings, rollout_stats, metrics,
                                                quota=needed - num_kept)
                num_batches += 1
                if not len(generated):
                    continue
                candidates += count_groups(generated["uid"])
                values = generated["acc"] if fg.metric == "acc" else generated["score"]
                keep = informative_rows(generated["uid"], values)
                informative = generated.index(np.flatnonzero(keep))
                dropped.append(generated.index(np.flatnonzero(~keep)))
                kept.append(informative)
                num_kept += count_groups(informative["uid"])
                log.info("step %d: dynamic sampling kept %d of %d prompt groups after %d generation batch(es)",
                         step, num_kept, needed, num_batches)
            self.source.sampled(step, self.total_steps)  # no further call this step
            batch = concat_sequences([b for b in kept if len(b)], self.tokenizer.pad_token_id)
            dropped.append(batch.index(slice(needed * n, None)))
            batch = batch.index(slice(0, needed * n))
            metrics["train/num_gen_batches"] = float(num_batches)
            metrics["train/num_candidate_groups"] = float(candidates)
        if rollout_stats:  # every response generated in the step, kept or not
            metrics.update(RolloutStats.merge(rollout_stats).metrics())
        if self.cfg.trainer.rejection_sample:
            rejected = uniform_accuracy_rows(batch["uid"], batch["acc"])
            metrics["train/num_rejected_groups"] = float(count_groups(batch["uid"][rejected]))
            dropped.append(batch.index(np.flatnonzero(rejected)))
            batch = batch.index(np.flatnonzero(~rejected))
        metrics["train/num_kept_groups"] = float(count_groups(batch["uid"]))
        if "overlong_penalty" in batch.rows and len(batch):
            penalty = batch["overlong_penalty"].astype(np.float64)
            metrics["reward/overlong_penalised_frac"] = float(np.mean(penalty < 0))
            metrics["reward/overlong_penalty_mean"] = float(np.mean(penalty))
        return batch

    def train_step(self, step: int) -> dict[str, float]:
        cfg, algo = self.cfg, self.cfg.algorithm
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {}
        self.peaks = MemoryPeaks(self.device)
        with timer("step", timings, self.peaks):
            dropped: list[Batch] = []
            batch = self.sample_batch(step, timings, metrics, dropped)
            responses = every_response(batch, dropped)  # trained or not, in the dump's order
            if cfg.trainer.rollout_data_dir:
                with timer("dump_rollout", timings, self.peaks):
                    write_generations(Path(cfg.trainer.rollout_data_dir) / f"step_{step}.jsonl", responses,
                                      responses["response_text"], responses["score"], step)
            if self.health is not None:
                self.health.collect_scored(responses)
            self.updates.record(step, updated=len(batch) > 0, responses=responses)
            if not len(batch):
                log.warning("step %d: rejection sampling dropped every prompt group (all accuracies 0 or 1); "
                            "no update this step", step)
                return {**metrics, "training/global_step": float(step), "training/epoch": float(self.loader.epoch)}
            metrics.update(record_staleness(batch, trainer_version=engine_version(step)))
            if self.rollout_correction.bypass:  # the engine's log-probs are the old ones: no old-log-prob pass
                batch = batch.union(self.rollout_correction.rollout_log_probs_as_old(batch))
            else:
                with timer("old_log_prob", timings, self.peaks):
                    batch = batch.union(self.workers.call("compute_log_prob", batch))
                if ROUTE_COUNTS in batch:  # routing replay: how often the policy's top-k differs from the engine's
                    metrics.update(mismatch_metrics(batch.pop([ROUTE_COUNTS])[ROUTE_COUNTS]))
            if self.use_ref:
                with timer("ref", timings, self.peaks):
                    batch = batch.union(self.workers.call("compute_ref_log_prob", batch))
            if self.use_critic:
                with timer("values", timings, self.peaks):
                    batch = batch.union(self.workers.call("compute_values", batch))
            with timer("adv", timings, self.peaks):
                if algo.use_kl_in_reward:
                    rewards, kl_metrics = apply_kl_penalty(batch["token_level_scores"], batch["old_log_probs"],
                                                           batch["ref_log_prob"], batch["response_mask"],
                                                           self.kl_ctrl, algo.kl_penalty)
                    metrics.update(kl_metrics)
                else:
                    rewards = batch["token_level_scores"]
                batch["token_level_rewards"] = rewards
                metrics.update(self.rollout_correction.correct_batch(batch))  # decoupled mode: weights, rejection
                adv, returns = compute_advantage(
                    algo.adv_estimator, token_level_rewards=rewards, response_mask=batch["response_mask"],
                    index=batch["uid"], values=batch.tensors.get("values"), gamma=float(algo.gamma),
                    lam=float(algo.lam), norm_adv_by_std_in_grpo=bool(algo.norm_adv_by_std_in_grpo))
                batch["advantages"], batch["returns"] = adv, returns
            if self.entropy_trace is not None:
                with timer("entropy_trace", timings, self.peaks):  # entropies of the old-log-prob pass, with advantages
                    self.entropy_trace.record(step, batch)
            if self.health is not None:
                self.health.collect(batch)
            if self.use_critic:
                with timer("update_critic", timings, self.peaks):
                    metrics.update(self.workers.call("update_critic", batch).metrics)
            if int(cfg.trainer.critic_warmup) <= step:  # verl: steps count from 1, so k skips k-1 updates
                selection = None
                if self.influence_trace is not None:
                    with timer("influence_select", timings, self.peaks):
                        selection = self.influence_trace.select(step, batch)
                with timer("update_actor", timings, self.peaks):
                    update = self.workers.call("update_actor", batch,
                                               influence_tokens=None if selection is None else selection.tokens)
                metrics.update(update.metrics)
                if selection is not None:
                    metrics.update(self.influence_trace.finish(step, batch, selection, update.influence))
        metrics.update(compute_data_metrics(batch, max_response_length=int(cfg.data.max_response_length)))
        metrics.update(compute_timing_metrics(timings, int(batch["attention_mask"].sum())))
        metrics.update(self.peaks.metrics())
        if not self.driver_holds_model:  # the busiest trainer device's peak
            metrics.update(self.workers.call("memory_peaks"))
        metrics.update(self.workers.call("kv_cache_size"))
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.loader.epoch)
        return metrics

    def generate_sequences(self, prompts: Batch) -> Batch:
        """The policy's responses to ``prompts``, generated by the ranks (separate_async: the rollout ranks,
        with the trainer's newest weights)."""
        return self.source.generate(prompts, self.global_step)

    # -- validation -----------------------------------------------------------------------------------------
    def validate(self, dump_prefix: str = "", generator: Any = None) -> dict[str, float]:
        """Generate for every validation prompt with rollout.val_kwargs and score it, through the Evaluator that
        ``archer eval`` uses (``generator``: the policy that generates, default the actor); the generations go to
        <validation_data_dir>/<dump_prefix>step_N.jsonl when that key is set."""
        if self.val_set is None:
            return {}
        n = int(self.cfg.actor_rollout_ref.rollout.val_kwargs.n)
        generate = generator.generate_sequences if generator is not None else self.generate_sequences
        evaluator = Evaluator(generate, self.reward_fn, self.tokenizer.pad_token_id,
                              n=n, seed=self.seed)
        size = int(self.cfg.data.val_batch_size or len(self.val_set))
        items = [self.val_set[i] for i in range(len(self.val_set))]
        parts, records = [], []
        start = time.perf_counter()
        for b, offset in enumerate(range(0, len(items), size)):
            batch, batch_records = evaluator.run_batch(items[offset: offset + size], b)
            batch.info.pop(ROLLOUT_STATS, None)
            records += batch_records
            parts.append(batch.select(["data_source", "uid", "raw_prompt", "ground_truth", "response_text", "score",
                                       "acc", REWARD_EXTRAS]))
        merged = Batch.concat(parts)
        ks = self.cfg.eval.k
        metrics = records_metrics(records, n, None if ks is None else list(ks))
        metrics["timing_s/testing"] = time.perf_counter() - start
        if self.source is not None:  # trainer.val_only generates with its own worker
            metrics.update(self.source.validation_timings())
        if self.cfg.trainer.validation_data_dir:
            write_generations(Path(self.cfg.trainer.validation_data_dir) / f"{dump_prefix}step_{self.global_step}.jsonl",
                              merged, merged["response_text"], merged["score"], self.global_step)
        n_show = int(self.cfg.trainer.log_val_generations)
        for text, gt, s in list(zip(merged["response_text"], merged["ground_truth"], merged["score"]))[:n_show]:
            log.info("val sample: score=%.2f gt=%s output=%r", s, gt, text)
        return metrics

    # -- checkpoints -------------------------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> Path:
        def write(tmp: Path) -> None:
            self.workers.call("save_checkpoint", tmp, self.tokenizer)
            state = self.source.state()
            pending = {} if state is None else {ASYNC_STATE: state}
            save_trainer_state(tmp, step, self.loader, self.clock,
                               {"model_path": self.model_path, "val_before": self.val_before,
                                "val_after": self.val_last, "updated_steps": self.updates.updated_steps},
                               kl_coef=float(self.kl_ctrl.value), **pending)

        return self.checkpoints.save(step, write)

    def resume(self) -> int:
        """Restore the checkpoint of trainer.resume_mode, if any, with the summary's figures and wall time so far;
        returns the step to continue from."""
        path = checkpoint_to_resume(self.cfg.trainer, self.checkpoints, CHECKPOINT_ACTOR)
        if path is None:
            return 0
        self.workers.call("load_checkpoint", path)
        state = restore_trainer_state(path, self.loader, self.clock)
        self.kl_ctrl.value = state["kl_coef"]
        self.source.restore(state.get(ASYNC_STATE), path)
        record = state["run"]
        self.model_path = record.get("model_path", self.model_path)
        self.val_before, self.val_last = record.get("val_before", {}), record.get("val_after", {})
        # a checkpoint written before the count was kept: every step taken as one that updated
        self.updates.updated_steps = int(record.get("updated_steps", state["global_step"]))
        return int(state["global_step"])

    # -- the loop -------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Validation before training, the steps, periodic validation and checkpoints, plots and summary."""
        cfg = self.cfg.trainer
        if cfg.val_only:
            return self.validate_only()
        if self.finished is not None:
            return self.finished
        try:
            return self.train()
        finally:
            self.source.shutdown()
            self.lock.release()

    def train(self) -> dict[str, Any]:
        cfg = self.cfg.trainer
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.run_dir / CONFIG_FILE)
        if not self.driver_holds_model:  # ranks in other processes, maybe on other nodes, write the checkpoints
            check_shared_folder(self.workers.call, self.checkpoints.root, self.workers.world_size,
                                "trainer.default_local_dir")
        start = self.resume()
        self.global_step = start
        self.open_traces(start)
        if cfg.health.enable:
            self.health = HealthMonitor(self.cfg, self.run_dir, start, tool_call_tags(self.cfg.actor_rollout_ref.rollout))
        with Tracking(self.run_dir, backends=as_list(cfg.logger), project=cfg.project_name, experiment=cfg.experiment_name,
                      config=OmegaConf.to_container(self.cfg, resolve=True), total_steps=self.total_steps, start_step=start) as tracker:
            if start == 0 and cfg.val_before_train and self.val_set is not None:
                self.val_before = self.validate()
                self.log_step(tracker, 0, self.val_before)
            for step in range(start + 1, self.total_steps + 1):
                self.global_step = step
                metrics = self.train_step(step)
                last = step == self.total_steps
                if self.val_set is not None and cfg.test_freq > 0 and (step % cfg.test_freq == 0 or last):
                    self.val_last = self.validate()
                    metrics.update(self.val_last)
                # Log before the checkpoint commits: a run killed in between resumes from the previous
                # checkpoint and redoes this step, whereas a committed step without its line stays missing.
                self.log_step(tracker, step, metrics)
                self.updates.check(step)  # k steps in a row without an update: an error that says why
                stop = self.health.stop if self.health is not None else None
                if stop is not None or (cfg.save_freq > 0 and (step % cfg.save_freq == 0 or last)):
                    self.flush_traces()  # every step the checkpoint covers is on disk first
                    saved = time.perf_counter()
                    path = self.save_checkpoint(step)
                    log.info("saved %s in %.2fs", path, time.perf_counter() - saved)
                if stop is not None:
                    log.error("stopping at step %d (trainer.health.stop_on=%s): %s; the checkpoint %s holds the "
                              "policy of this step", step, cfg.health.stop_on, stop.line(), path)
                    break
        self.flush_traces()
        if cfg.plots:
            plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "plots")
        return self.write_summary()

    def log_step(self, tracker: Tracking, step: int, metrics: dict[str, float]) -> None:
        """The step's metrics, with the health checks' (trainer.health), to every logger."""
        if self.health is not None:
            metrics = {**metrics, **self.health.check(step, metrics)}
        tracker.log(metrics, step=step)

    def open_traces(self, start: int) -> None:
        """Trace writers of the enabled traces; steps after the resumed checkpoint are dropped (redone)."""
        cfg = self.cfg.trainer
        call_tags = tool_call_tags(self.cfg.actor_rollout_ref.rollout)  # what the explorer highlights as tool calls
        if cfg.entropy_trace.enable:
            self.entropy_trace = EntropyTrace(self.cfg, self.run_dir, self.tokenizer, call_tags)
            self.entropy_trace.writer.truncate_after(start)
        if cfg.influence_trace.enable:
            modules = self.workers.call("setup_influence", CaptureSettings.from_config(cfg.influence_trace))
            self.influence_trace = InfluenceTrace(self.cfg, self.run_dir, self.tokenizer, modules, self.device,
                                                  call_tags)
            self.influence_trace.writer.truncate_after(start)

    def flush_traces(self) -> None:
        for trace in (self.entropy_trace, self.influence_trace):
            if trace is not None:
                trace.writer.flush()

    def validate_only(self) -> dict[str, Any]:
        """trainer.val_only: validate the checkpoint trainer.resume_mode names (with auto the newest one), or the
        model when there is none, and stop. The run's own files (config.yaml, metrics.jsonl, summary.json,
        traces, checkpoints) are left as they are: the figures go to one appended line of <run>/val_only.jsonl."""
        start_time = time.perf_counter()
        path = checkpoint_to_resume(self.cfg.trainer, self.checkpoints, CHECKPOINT_ACTOR, read_only=True)
        validated = str(self.cfg.actor_rollout_ref.model.path)
        if path is not None:
            self.global_step = int(load_torch_state(path / TRAINER_STATE)["global_step"])
            validated = str(path / CHECKPOINT_ACTOR)
        generator = GenerationWorker(self.cfg.actor_rollout_ref, validated, device=self.device, tokenizer=self.tokenizer,
                                     chat_template_kwargs=self.template_kwargs)
        metrics = self.validate(dump_prefix="val_only_", generator=generator)  # never replaces a training dump
        record = {"step": self.global_step, "model": validated,
                  **{k: v if math.isfinite(v) else None for k, v in metrics.items()}}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with (self.run_dir / VAL_ONLY_FILE).open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        return {"steps": self.global_step, "wall_time_s": time.perf_counter() - start_time, "validated_model": validated,
                "val_before": metrics, "val_after": metrics, "run_dir": str(self.run_dir),
                "val_only_file": str(self.run_dir / VAL_ONLY_FILE)}

    def write_summary(self) -> dict:
        summary = {
            "steps": self.global_step,
            "updated_steps": self.updates.updated_steps,  # steps that trained on at least one prompt group
            "wall_time_s": self.clock.seconds(),
            "model_path": recorded_path(self.model_path),
            "train_files": [recorded_path(f) for f in as_list(self.cfg.data.train_files)],
            "val_files": [recorded_path(f) for f in as_list(self.cfg.data.val_files)],
            "val_before": self.val_before,
            "val_after": self.val_last,
            "run_dir": recorded_path(self.run_dir),
        }
        latest = self.checkpoints.latest_step()
        if latest is not None:
            summary["latest_checkpoint"] = recorded_path(self.checkpoints.load_dir(latest) / CHECKPOINT_ACTOR)
        if self.health is not None and self.health.stop is not None:
            summary["stopped_by_health"] = self.health.stop.to_json()
        write_json_atomically(self.run_dir / SUMMARY_FILE, summary)
        return summary
