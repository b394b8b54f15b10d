"""The critic worker: a value model (backbone + scalar head) for PPO with GAE, its values and its update.

Both passes run in micro-batches of a number of rows or of a token budget, padded or padding-free
(models/micro_batches.py); the value loss is normalised over its whole mini-batch, so accumulation is exact.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig
from transformers import PreTrainedModel

from archer.algorithms.aggregation import mini_batch_totals
from archer.algorithms.metrics import MetricSums, masked_mean_metric, total_metric
from archer.algorithms.value_loss import compute_value_loss
from archer.batch import Batch
from archer.models.forward import MODEL_INPUTS
from archer.models.loading import autocast_for, value_forward
from archer.models.micro_batches import MicroBatching
from archer.models.optim import LRSchedule, clip_and_step
from archer.models.owner import ModelOwner
from archer.workers.mini_batches import StepAverages, mini_batches


class CriticWorker:
    """Owns the value model and its optimiser on one device."""

    def __init__(self, cfg: DictConfig, *, rollout_n: int, device: torch.device, total_steps: int) -> None:
        self.cfg = cfg
        self.rollout_n = rollout_n
        self.device = device
        self.owner = ModelOwner.value_model(cfg.model.path, device=device,
                                            gradient_checkpointing=bool(cfg.model.enable_gradient_checkpointing),
                                            trust_remote_code=bool(cfg.model.trust_remote_code))
        self.owner.attach_optimizer(cfg.optim, LRSchedule.from_rl_optim(cfg.optim, total_steps))
        micro = {"dynamic_key": "use_dynamic_bsz", "remove_padding": bool(cfg.model.use_remove_padding)}
        self.forward_micro = MicroBatching.from_config(cfg, size_key="forward_micro_batch_size",
                                                       budget_key="forward_max_token_len_per_gpu", **micro)
        self.update_micro = MicroBatching.from_config(cfg, size_key="ppo_micro_batch_size",
                                                      budget_key="ppo_max_token_len_per_gpu", **micro)

    @property
    def model(self) -> PreTrainedModel:
        """The value model (backbone and scalar head)."""
        return self.owner.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.owner.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self.owner.scheduler

    def _values(self, mb: Batch, micro: MicroBatching) -> torch.Tensor:
        """Value of each response position: the head's output at the token that precedes it."""
        mb = mb.to(self.device)
        layout = micro.layout(mb)
        with autocast_for(self.device):
            v = value_forward(self.model, layout.input_ids, layout.attention_mask, layout.position_ids)
        return layout.scatter(layout.response_states(v).float()) * mb["response_mask"].float()

    def compute_values(self, batch: Batch) -> Batch:
        data = batch.select([*MODEL_INPUTS, "responses", "response_mask"])
        values = torch.zeros(data["responses"].shape)
        self.model.eval()
        with torch.no_grad():
            for rows in self.forward_micro.split(data["attention_mask"]):
                values[rows] = self._values(data.index(rows), self.forward_micro).cpu()
        self.model.train()
        return Batch({"values": values})

    def update_critic(self, batch: Batch) -> Batch:
        """PPO epochs of the value loss over mini-batches. Returns ``info["metrics"]``: verl-named metrics
        averaged over optimiser steps (as the actor's update_actor)."""
        c = self.cfg
        mini = int(c.ppo_mini_batch_size) * self.rollout_n
        data = batch.select([*MODEL_INPUTS, "responses", "response_mask", "values", "returns"])
        averages = StepAverages()
        self.model.train()
        for _, mini_batch in mini_batches(data, mini, epochs=int(c.ppo_epochs), shuffle=bool(c.shuffle), seed=0):
            agg_kwargs = mini_batch_totals(mini_batch["response_mask"].float())
            mini_sums = MetricSums()
            for rows in self.update_micro.split(mini_batch["attention_mask"]):
                mb = mini_batch.index(rows)
                vpreds = self._values(mb, self.update_micro)
                mask = mb["response_mask"].to(self.device).float()
                loss, clipfrac = compute_value_loss(
                    vpreds, mb["values"].to(self.device), mb["returns"].to(self.device), mask,
                    cliprange_value=float(c.cliprange_value), loss_agg_mode=c.loss_agg_mode, agg_kwargs=agg_kwargs)
                loss.backward()
                mini_sums.add({"critic/vf_loss": total_metric(loss), "critic/vf_clipfrac": clipfrac,
                               "critic/vpred_mean": masked_mean_metric(vpreds, mask)})
            grad_norm, _ = clip_and_step(self.model, self.optimizer, float(c.grad_clip))
            averages.add({**mini_sums.result(), "critic/grad_norm": grad_norm})
        metrics = averages.result()
        metrics["critic/lr"] = self.scheduler.get_last_lr()[0]  # the lr of this update, as verl reports it
        self.scheduler.step()
        return Batch(info={"metrics": metrics})

    def save(self, out_dir: Path) -> None:
        """The value model's HF folder (its ``score`` head included) plus optimiser and scheduler state."""
        self.owner.save(out_dir)

    def load(self, in_dir: Path) -> None:
        self.owner.load(in_dir, "critic.model")
