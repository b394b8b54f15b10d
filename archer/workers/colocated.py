"""The workers of one rank, colocated on its device: the actor with its rollout engine, the reference, the
critic and the reward model (verl's one process per GPU holding every role). The trainer reaches them only
through a worker group (archer/controller/worker_group.py): in this process at world 1, one Ray actor per rank
otherwise; each method declares how the ranks' results come back (archer/workers/dispatch.py).

Every method gets the whole batch; each role's method declares what of it the rank works on and how the ranks'
results come back (archer/workers/dispatch.py): its rows, or, for an update, its share of every mini-batch and the
metrics all ranks agree on. The methods that only hand the call to a role are generated from those declarations.
At world > 1 the rank joins the process group the worker group describes in its environment and the models are
sharded with FSDP2 (archer/distributed/fsdp.py); at world 1 nothing changes from a plain single-device run.

Knowing every model on the card, the rank makes its memory plan (workers/memory.py) on a GPU: after the models
are loaded and before the actor's engine takes its share of the card, so that a setting that cannot fit stops
there with its figures.

In trainer.v1.trainer_mode=separate_async the same roles train without an engine (``generates=False``): standalone
rollout ranks generate (workers/rollout_rank.py), and rank 0 sends them the policy's weights over the weight-sync
group (archer/distributed/weight_sync.py, ``open_weight_sync`` .. ``send_weights``).
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from archer.config.world import world_size
from archer.distributed.context import DistContext
from archer.distributed.shared_folder import rank_name, unseen_markers, write_marker
from archer.distributed.weight_sync import WeightManifest, WeightSender, join_group, open_store
from archer.models.loading import load_tokenizer, pick_device
from archer.units import GIB
from archer.workers.actor import ActorWorker
from archer.workers.critic import CriticWorker
from archer.workers.dispatch import collect, delegate, rank_zero
from archer.workers.memory import MemoryPlan, card_figures, plan_actor_memory
from archer.workers.reference import ReferenceWorker
from archer.workers.reward_model import RewardModelWorker
from archer.workers.rollout_correction_config import read_rollout_correction

log = logging.getLogger("archer.workers")


def models_beside_actor(ref: ReferenceWorker | None, critic: CriticWorker | None,
                        reward_model: RewardModelWorker | None) -> dict[str, int]:
    """The bytes each model beside the actor keeps on this rank's card: the reference's own copy (none with
    LoRA, whose reference is the policy's module) and the critic with its training state, as sharded; the
    reward model whole (each rank holds a copy)."""
    beside: dict[str, int] = {}
    if ref is not None and ref.owner is not None:
        beside["reference policy"] = ref.owner.card_bytes()
    if critic is not None:
        beside["critic"] = critic.owner.card_bytes()
    if reward_model is not None:
        beside["reward model"] = reward_model.bytes
    return beside


def max_over_ranks(results: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's maximum over the ranks (peak memory per device)."""
    return {name: max(r[name] for r in results) for name in results[0]}


class RankWorkers:
    """The roles of one rank. ``use_ref`` / ``use_critic``: whether the run needs a reference policy / critic;
    ``tokenizer``: the policy's, when the driver already holds it (world 1; ranks of a Ray group load it)."""

    def __init__(self, cfg: DictConfig, *, total_steps: int, use_ref: bool, use_critic: bool,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None, generates: bool = True) -> None:
        """``generates=False``: the ranks only train (separate_async: rollout ranks of their own generate, and
        rank 0 sends them the weights, ``send_weights``); no engine is built and the memory plan counts none."""
        self.generates = generates
        device = pick_device(cfg.trainer.device)
        # The value model returns its logits as a view; nothing writes into it in place (models/loading.py).
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        if world_size(cfg.trainer) == 1:
            self.ctx = DistContext.single(device)
        else:
            self.ctx = DistContext.init_from_env(device.type, float(cfg.actor_rollout_ref.nccl_timeout))
        torch.manual_seed(int(cfg.trainer.seed))  # new weights (a value head) as the single-process run draws them
        ref_cfg = cfg.actor_rollout_ref
        if tokenizer is None:
            tokenizer = load_tokenizer(ref_cfg.model.path, role="model")
        self.reward_model: RewardModelWorker | None = None
        if cfg.reward_model.enable:
            self.reward_model = RewardModelWorker(cfg.reward_model, device=self.ctx.device, policy_tokenizer=tokenizer,
                                                  policy_path=str(ref_cfg.model.path), ctx=self.ctx)
        self.actor = ActorWorker(ref_cfg, device=self.ctx.device, ctx=self.ctx, total_steps=total_steps,
                                 tokenizer=tokenizer, chat_template_kwargs=chat_template_kwargs, start_rollout=False,
                                 rollout_correction=read_rollout_correction(cfg.algorithm.rollout_correction),
                                 balance_ranks=bool(cfg.trainer.balance_batch))
        self.ref = self.actor.make_reference() if use_ref else None
        self.critic = (CriticWorker(cfg.critic, rollout_n=int(ref_cfg.rollout.n), device=self.ctx.device, ctx=self.ctx,
                                    total_steps=total_steps, balance_ranks=bool(cfg.trainer.balance_batch))
                       if use_critic else None)
        self.memory_plan = self.plan_memory() if self.ctx.device.type == "cuda" else None
        self.actor.plan_checkpointing(self.memory_plan, announce=self.ctx.rank == 0)
        for worker in (self.actor, self.ref, self.critic, self.reward_model):
            if worker is not None:  # the no-grad passes' token budgets come from the plan (None on a CPU)
                worker.plan_micro_batches(self.memory_plan, announce=self.ctx.rank == 0)
        if generates:
            self.actor.start_rollout()
        self.weight_sender: WeightSender | None = None  # separate_async: rank 0's side of the weight sync
        self._weight_store: Any = None
        self._weight_manifest: WeightManifest | None = None  # separate_async: the buckets on the wire

    def plan_memory(self) -> MemoryPlan:
        """The card's memory plan (workers/memory.py): the actor's policy, training state and engine, and the
        models beside it as they sit on the card; checked (one ArcherError with the figures when a stage cannot
        fit)."""
        total, elsewhere = card_figures(self.ctx.device)
        plan = plan_actor_memory(self.actor.cfg, self.actor.model, total=total,
                                 fast_engine=self.actor.fast_engine and self.generates,
                                 others=models_beside_actor(self.ref, self.critic, self.reward_model),
                                 elsewhere=elsewhere, shards=self.ctx.world_size)
        plan.check()
        return plan

    # -- the step's stages: each role's method splits the whole batch it is handed (workers/dispatch.py) --------
    generate_sequences = delegate("actor", ActorWorker.generate_sequences)
    produce_groups = delegate("actor", ActorWorker.produce_groups)  # colocate_async (workers/async_rollout.py)
    compute_rm_score = delegate("reward_model", RewardModelWorker.compute_rm_score)
    compute_log_prob = delegate("actor", ActorWorker.compute_log_prob)
    compute_ref_log_prob = delegate("ref", ReferenceWorker.compute_ref_log_prob)
    compute_values = delegate("critic", CriticWorker.compute_values)
    update_critic = delegate("critic", CriticWorker.update_critic)
    update_actor = delegate("actor", ActorWorker.update_actor)  # (batch, influence_tokens)
    setup_influence = delegate("actor", ActorWorker.setup_influence)

    # -- weights to standalone rollout ranks (separate_async) ----------------------------------------------
    @collect(rank_zero)
    def open_weight_sync(self) -> tuple[str, int]:
        """Rank 0 hosts the weight-sync group's store on its node; returns its address and port."""
        if self.ctx.rank != 0:
            return "", 0
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self._weight_store = open_store(host, float(self.actor.cfg.nccl_timeout))
        return host, int(self._weight_store.port)

    @collect(rank_zero)
    def weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The policy's weight stream as (name, shape), in its order (nothing gathered)."""
        return self.actor.owner.weight_shapes()

    @collect(rank_zero)
    def join_weight_sync(self, host: str, port: int, size: int, manifest: WeightManifest) -> None:
        """Rank 0 joins the weight-sync group as its rank 0 (the sender); the other ranks have no part in it."""
        self._weight_manifest = manifest
        if self.ctx.rank == 0:
            group = join_group(host, port, 0, size, self.ctx.device, float(self.actor.cfg.nccl_timeout),
                               store=self._weight_store)
            self.weight_sender = WeightSender(group, manifest, self.ctx.device)

    @collect(rank_zero)
    def send_weights(self) -> None:
        """The policy's current weights to every rollout rank (sharded: every rank gathers, rank 0 sends)."""
        buckets = self.actor.owner.weight_buckets(self._weight_manifest, pack=self.weight_sender is not None)
        if self.weight_sender is not None:
            self.weight_sender.send_buckets(buckets)
        else:
            for _ in buckets:  # the gathers rank 0's buckets need
                pass

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

    @collect(max_over_ranks)
    def kv_cache_size(self) -> dict[str, float]:
        """``perf/kv_cache_gb``: the KV cache the fast engine last sized (less than its share where the card had
        less free); empty without a fast engine on this rank."""
        rollout = getattr(self.actor, "rollout", None)
        cache_bytes = getattr(rollout.engine, "cache_bytes", 0) if rollout is not None else 0
        return {"perf/kv_cache_gb": cache_bytes / GIB} if cache_bytes else {}

    # -- checkpoints ------------------------------------------------------------------------------------------
    @collect(rank_zero)
    def save_checkpoint(self, folder: Path, tokenizer: PreTrainedTokenizerBase | None) -> None:
        """The trained models into ``folder`` (the checkpoint's temporary directory): ``actor/`` and
        ``critic/``; every rank writes its shards, rank 0 the HF folders."""
        self.actor.save(folder / "actor", tokenizer)
        if self.critic is not None:
            self.critic.save(folder / "critic")

    @collect(list)
    def check_shared_folder(self, folder: Path, token: str) -> dict[str, Any]:
        """This rank's side of archer/distributed/shared_folder.check_shared_folder: write its marker, wait for
        every rank's, then name the markers it does not see (and its host)."""
        write_marker(folder, token, rank_name(self.ctx.rank))
        self.ctx.barrier()
        return {"host": socket.gethostname(), "unseen": unseen_markers(folder, token, self.ctx.world_size)}

    @collect(rank_zero)
    def load_checkpoint(self, folder: Path) -> None:
        self.actor.load(folder / "actor")
        if self.critic is not None:
            self.critic.load(folder / "critic")
