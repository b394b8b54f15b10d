"""The critic worker: a value model (backbone + scalar head) for PPO with GAE, its values and its update.

Both passes run in micro-batches of a number of rows or of a token budget, padded or packed
(models/micro_batches.py; the value pass packed to a token budget by default); the value loss is normalised over
its whole mini-batch, so accumulation is exact.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from omegaconf import DictConfig

from archer.algorithms.aggregation import mini_batch_totals
from archer.algorithms.metric_sums import masked_mean_metric, total_metric
from archer.algorithms.value_loss import compute_value_loss
from archer.batch import Batch, to_device
from archer.distributed.context import DistContext
from archer.models.forward import MODEL_INPUTS
from archer.models.loading import autocast_for, parse_dtype, value_forward
from archer.models.micro_batches import CRITIC_UPDATE, CRITIC_VALUES, MicroBatching, no_grad_micro_batching
from archer.models.optim import LRSchedule
from archer.models.owner import ModelOwner, OwnsModel
from archer.models.packed_attention import supports_packing
from archer.workers.data_parallel import PassShare, RankPasses, own_passes, rank_passes
from archer.workers.dispatch import collect, concat_batches, rank_zero
from archer.workers.memory import MemoryPlan, planned_no_grad_tokens
from archer.workers.mini_batches import ppo_epochs
from archer.workers.results import UpdateResult


class CriticWorker(OwnsModel):
    """Owns the value model and its optimiser on one device."""

    def __init__(self, cfg: DictConfig, *, rollout_n: int, device: torch.device, total_steps: int,
                 ctx: DistContext | None = None, balance_ranks: bool = False) -> None:
        """``ctx``: the rank of a data-parallel run (default: one process on ``device``); the value model is
        then sharded with FSDP2 (CPU offload with critic.model.fsdp_config's offload keys). ``balance_ranks``:
        the update's ranks take rows balanced by tokens (trainer.balance_batch, workers/data_parallel.py)."""
        self.cfg = cfg
        self.balance_ranks = balance_ranks
        self.rollout_n = rollout_n
        self.device = device
        self.ctx = ctx if ctx is not None else DistContext.single(device)
        offload = cfg.model.fsdp_config
        self.owner = ModelOwner.value_model(cfg.model.path, device=device,
                                            gradient_checkpointing=bool(cfg.model.enable_gradient_checkpointing),
                                            trust_remote_code=bool(cfg.model.trust_remote_code),
                                            master_dtype=parse_dtype(offload.model_dtype,
                                                                     "critic.model.fsdp_config.model_dtype"),
                                            ctx=self.ctx)
        if self.ctx.distributed:
            self.owner.shard(self.ctx, offload,
                             cpu_offload=bool(offload.param_offload or offload.optimizer_offload))
        self.owner.attach_optimizer(cfg.optim, LRSchedule.from_rl_optim(cfg.optim, total_steps))
        self.can_pack = supports_packing(self.model)
        self.update_micro = MicroBatching.from_config(
            cfg, CRITIC_UPDATE, packed=bool(cfg.model.use_remove_padding) and self.can_pack)
        self.plan_micro_batches(None, announce=False)

    def plan_micro_batches(self, memory_plan: MemoryPlan | None, *, announce: bool) -> None:
        """The value pass's micro-batches: the critic's keys and, on a GPU, the memory plan's token budget
        (models/micro_batches.py); ``announce``: this process speaks for the run."""
        self.forward_micro = no_grad_micro_batching(
            self.cfg, "critic", CRITIC_VALUES, remove_padding=bool(self.cfg.model.use_remove_padding),
            can_pack=self.can_pack, planned_tokens=planned_no_grad_tokens(memory_plan, self.model),
            announce=announce)

    def _values(self, mb: Batch, micro: MicroBatching) -> torch.Tensor:
        """Value of each response position: the head's output at the token that precedes it."""
        layout = micro.layout(mb).to(self.device)  # made on the host: no wait for the GPU
        mb = mb.to(self.device)
        with autocast_for(self.device):
            v = value_forward(self.model, **layout.model_inputs())
        return layout.scatter(layout.response_states(v).float()) * mb["response_mask"].float()

    @collect(concat_batches, split=own_passes("forward_micro"))
    def compute_values(self, share: PassShare) -> Batch:
        """The values of this rank's rows (called with the whole batch)."""
        data = share.batch.select([*MODEL_INPUTS, "responses", "response_mask"])
        values = torch.zeros(data["responses"].shape)
        self.model.eval()
        with torch.no_grad():
            done = [(rows, self._values(data.index(rows), self.forward_micro)) for rows in share.passes.parts]
            for rows, part in done:  # read back once the passes are queued
                values[rows] = part.cpu()
        self.model.train()
        return Batch({"values": share.own(values)})

    @collect(rank_zero)
    def update_critic(self, batch: Batch) -> UpdateResult:
        """PPO epochs of the value loss over mini-batches (workers/mini_batches.py): verl-named metrics averaged
        over optimiser steps (as the actor's update_actor)."""
        c = self.cfg
        data = batch.select([*MODEL_INPUTS, "responses", "response_mask", "values", "returns"])
        self.model.train()
        metrics = ppo_epochs(data, int(c.ppo_mini_batch_size) * self.rollout_n, self, self.ctx,
                             epochs=int(c.ppo_epochs), shuffle=bool(c.shuffle), seed=0)
        metrics["critic/lr"] = self.scheduler.get_last_lr()[0]  # the lr of this update, as verl reports it
        self.scheduler.step()
        return UpdateResult(metrics)

    # -- the UpdateObjective of ppo_epochs --------------------------------------------------------------
    def plan(self, epoch: int, mini_batch: Batch) -> tuple[RankPasses, dict]:
        """The rank's passes over ``mini_batch`` and the value loss's normalisers (the mini-batch's totals)."""
        passes = rank_passes(mini_batch["attention_mask"], self.update_micro, self.ctx, balance=self.balance_ranks)
        return passes, mini_batch_totals(mini_batch["response_mask"].float())

    def loss(self, rows: Batch, normalisers: dict, *, epoch: int, weight: float, scope: ExitStack
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped value loss over ``rows`` and its metric sums."""
        vpreds = self._values(rows, self.update_micro)
        mask = to_device(rows["response_mask"], self.device).float()
        loss, clipfrac = compute_value_loss(
            vpreds, to_device(rows["values"], self.device), to_device(rows["returns"], self.device), mask,
            cliprange_value=float(self.cfg.cliprange_value), loss_agg_mode=self.cfg.loss_agg_mode,
            agg_kwargs=normalisers)
        return loss, {"critic/vf_loss": total_metric(loss), "critic/vf_clipfrac": clipfrac,
                      "critic/vpred_mean": masked_mean_metric(vpreds, mask)}

    def step(self, sums: dict[str, float]) -> dict[str, float]:
        """The value model's optimiser step; its metrics with the grad norm."""
        grad_norm, _ = self.owner.step(float(self.cfg.grad_clip))
        return {**sums, "critic/grad_norm": grad_norm}

    def save(self, out_dir: Path) -> None:
        """The value model's HF folder (its ``score`` head included) plus optimiser and scheduler state."""
        self.owner.save(out_dir)

    def load(self, in_dir: Path) -> None:
        self.owner.load(in_dir, "critic.model")
