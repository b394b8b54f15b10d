"""The workers of one rank, colocated on its device: the actor with its rollout engine, the reference, the
critic and the reward model (verl's one process per GPU holding every role). The trainer reaches them only
through a worker group (archer/distributed/worker_group.py): in this process at world 1, one Ray actor per rank
otherwise; each method declares how the ranks' results come back (archer/distributed/dispatch.py).

Every method gets the whole batch; each role takes its rank's rows (archer/distributed/data_parallel.py) and
returns them, or, for an update, runs its share of every mini-batch and returns the metrics all ranks agree on.
At world > 1 the rank joins the process group the worker group describes in its environment and the models are
sharded with FSDP2 (archer/distributed/fsdp.py); at world 1 nothing changes from a plain single-device run.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from archer.batch import Batch
from archer.distributed.context import DistContext
from archer.distributed.dispatch import collect, concat_batches, rank_zero, shard_rows
from archer.models.loading import load_tokenizer, pick_device
from archer.rollout.rollout_stats import RolloutStats
from archer.trace.influence_capture import CaptureSettings, merge_rank_factors
from archer.workers.actor import INFLUENCE_CAPTURED, ActorWorker
from archer.workers.critic import CriticWorker
from archer.workers.memory import GIB
from archer.workers.reward_model import RewardModelWorker
from archer.workers.rollout import ROLLOUT_STATS

log = logging.getLogger("archer.workers")

# The memory plan's figures for the models beside the actor, per policy parameter: the reference policy in bf16,
# the critic (a value model of the policy's size) in float32 with its gradients and Adam's two states.
REFERENCE_BYTES_PER_PARAM = 2
CRITIC_BYTES_PER_PARAM = 16


def world_size(cfg: DictConfig) -> int:
    """trainer.nnodes x trainer.n_gpus_per_node: the number of ranks of a run."""
    return int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)


def concat_generated(results: list[Batch]) -> Batch:
    """Every rank's generated rows in rank order (padded to one width by the ranks), the agentic loop's
    statistics merged over the ranks."""
    stats = [b.info.pop(ROLLOUT_STATS) for b in results if ROLLOUT_STATS in b.info]
    batch = concat_batches(results)
    if stats:
        batch.info[ROLLOUT_STATS] = RolloutStats.merge(stats)
    return batch


def merge_updates(results: list[Batch]) -> Batch:
    """The actor update's metrics (every rank's are the same, all-reduced) and, when influence was traced, the
    factors every rank captured for its rows, merged into those of the whole batch."""
    out = results[0]
    if INFLUENCE_CAPTURED in out.info:
        captured = [(r.info["influence"], r.info.pop(INFLUENCE_CAPTURED)) for r in results]
        out.info["influence"] = merge_rank_factors(captured, out.info["influence"][0].u.shape[1])
    return out


def max_over_ranks(results: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's maximum over the ranks (peak memory per device)."""
    return {name: max(r[name] for r in results) for name in results[0]}


class RankWorkers:
    """The roles of one rank. ``use_ref`` / ``use_critic``: whether the run needs a reference policy / critic;
    ``tokenizer``: the policy's, when the driver already holds it (world 1; ranks of a Ray group load it)."""

    def __init__(self, cfg: DictConfig, *, total_steps: int, use_ref: bool, use_critic: bool,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        device = pick_device(cfg.trainer.device)
        # The value model returns its logits as a view; nothing writes into it in place (models/loading.py).
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        if world_size(cfg) == 1:
            self.ctx = DistContext.single(device)
        else:
            self.ctx = DistContext.init_from_env(device.type, float(cfg.actor_rollout_ref.nccl_timeout))
        torch.manual_seed(int(cfg.trainer.seed))  # new weights (a value head) as the single-process run draws them
        ref_cfg = cfg.actor_rollout_ref
        if tokenizer is None:
            tokenizer = load_tokenizer(ref_cfg.model.path, role="model")
        lora = int(ref_cfg.model.lora_rank) > 0  # the reference is then the LoRA policy's base: no second copy
        others = {"reference policy": REFERENCE_BYTES_PER_PARAM} if use_ref and not lora else {}
        if use_critic:
            others["critic"] = CRITIC_BYTES_PER_PARAM
        self.reward_model: RewardModelWorker | None = None
        if cfg.reward_model.enable:
            self.reward_model = RewardModelWorker(cfg.reward_model, device=self.ctx.device, policy_tokenizer=tokenizer,
                                                  policy_path=str(ref_cfg.model.path))
            if self.ctx.device.type == "cuda":
                # the plan divides the models beside the actor by the ranks; the reward model is a whole copy each
                others["reward model"] = self.reward_model.bytes_per_policy_param(ref_cfg.model) * self.ctx.world_size
        self.actor = ActorWorker(ref_cfg, device=self.ctx.device, ctx=self.ctx, total_steps=total_steps, tokenizer=tokenizer,
                                 chat_template_kwargs=chat_template_kwargs, other_models=others)
        if self.reward_model is not None:  # its token budget needs the plan, which counts its bytes
            self.reward_model.plan_micro_batches(self.actor.memory_plan, announce=self.ctx.rank == 0)
        self.ref = self.actor.make_reference() if use_ref else None
        self.critic = (CriticWorker(cfg.critic, rollout_n=int(ref_cfg.rollout.n), device=self.ctx.device, ctx=self.ctx,
                                    total_steps=total_steps, memory_plan=self.actor.memory_plan)
                       if use_critic else None)

    # -- the step's stages ------------------------------------------------------------------------------------
    @collect(concat_generated)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """The responses to this rank's prompts (sampled with the seeds of a single-process run)."""
        return self.actor.generate_sequences(prompts)

    @collect(concat_batches)
    def compute_rm_score(self, batch: Batch) -> Batch:
        """``rm_scores`` of this rank's rows (the reward model is not sharded: each rank holds a copy)."""
        return self.reward_model.compute_rm_score(shard_rows(batch, self.ctx.rank, self.ctx.world_size))

    @collect(concat_batches)
    def compute_log_prob(self, batch: Batch) -> Batch:
        return self.actor.compute_log_prob(batch)

    @collect(concat_batches)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return self.ref.compute_ref_log_prob(batch)

    @collect(concat_batches)
    def compute_values(self, batch: Batch) -> Batch:
        return self.critic.compute_values(batch)

    @collect(rank_zero)
    def update_critic(self, batch: Batch) -> Batch:
        return self.critic.update_critic(batch)

    @collect(merge_updates)
    def update_actor(self, batch: Batch) -> Batch:
        return self.actor.update_actor(batch)

    @collect(rank_zero)
    def setup_influence(self, settings: CaptureSettings) -> list[str]:
        return self.actor.setup_influence(settings)

    # -- memory -------------------------------------------------------------------------------------------
    @collect(max_over_ranks)
    def memory_peaks(self) -> dict[str, float]:
        """The device's peak memory since the last call (GiB; empty on a CPU), then the count restarts."""
        if self.ctx.device.type != "cuda":
            return {}
        peaks = {"perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated(self.ctx.device) / GIB,
                 "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved(self.ctx.device) / GIB}
        torch.cuda.reset_peak_memory_stats(self.ctx.device)
        return peaks

    # -- checkpoints ------------------------------------------------------------------------------------------
    @collect(rank_zero)
    def save_checkpoint(self, folder: Path, tokenizer: PreTrainedTokenizerBase | None) -> None:
        """The trained models into ``folder`` (the checkpoint's temporary directory): ``actor/`` and
        ``critic/``; every rank writes its shards, rank 0 the HF folders."""
        self.actor.save(folder / "actor", tokenizer)
        if self.critic is not None:
            self.critic.save(folder / "critic")

    @collect(rank_zero)
    def load_checkpoint(self, folder: Path) -> None:
        self.actor.load(folder / "actor")
        if self.critic is not None:
            self.critic.load(folder / "critic")
