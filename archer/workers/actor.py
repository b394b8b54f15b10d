"""The actor worker: the policy model on one device, its log-probs/entropies and its PPO update.

Log-probs and entropies come from the chunked kernel in models/logprobs.py (no full float32 tokens x vocab
tensor). The update splits the batch into mini-batches (one optimiser step each) and micro-batches
(gradient accumulation); every loss is normalised over its whole mini-batch, so accumulation is exact.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig

from archer.algorithms.metrics import MetricSums
from archer.batch import Batch
from archer.models.loading import autocast_for, load_causal_lm, save_hf
from archer.models.logprobs import response_logprobs
from archer.workers.actor_objective import ActorObjective
from archer.workers.optim import (
    build_optimizer,
    build_scheduler,
    clip_and_step,
    load_optim_state,
    save_optim_state,
)

if TYPE_CHECKING:
    from archer.trace.influence import InfluenceStep

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def micro_batch_size(*sizes: int | None, default: int) -> int:
    """The first size that is set (verl's per-GPU key, then its deprecated global key), else the default."""
    for size in sizes:
        if size:
            return int(size)
    return default


def compute_log_probs(model: torch.nn.Module, batch: Batch, *, temperature: float, micro: int, chunk_size: int,
                      device: torch.device, compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the batch's responses under ``model``, micro-batch by micro-batch."""
    response_length = batch["responses"].shape[1]
    logps, ents = [], []
    was_training = model.training
    model.eval()
    with torch.no_grad(), autocast_for(device):
        for mb in batch.select(MODEL_INPUTS).split(micro):
            logp, ent = response_logprobs(model, *(mb[k].to(device) for k in MODEL_INPUTS), response_length,
                                          temperature=temperature, chunk_size=chunk_size,
                                          compute_entropy=compute_entropy)
            logps.append(logp.float().cpu())
            if ent is not None:
                ents.append(ent.float().cpu())
    model.train(was_training)
    return torch.cat(logps), (torch.cat(ents) if ents else None)


def loss_mask_of(batch: Batch) -> torch.Tensor:
    """Tokens that count for the loss: the response mask, times loss_mask (tool results) when present."""
    mask = batch["response_mask"].float()
    if "loss_mask" in batch.tensors:
        mask = mask * batch["loss_mask"].float()
    return mask


class ActorWorker:
    """Owns the policy model, its optimiser and schedule on one device."""

    def __init__(self, cfg: DictConfig, *, device: torch.device, total_steps: int) -> None:
        self.cfg = cfg
        self.actor_cfg = cfg.actor
        self.device = device
        self.model = load_causal_lm(cfg.model.path, device=device, dtype=torch.float32,
                                    gradient_checkpointing=bool(cfg.model.enable_gradient_checkpointing),
                                    trust_remote_code=bool(cfg.model.trust_remote_code))
        self.model.train()
        self.optimizer = build_optimizer(self.model.parameters(), self.actor_cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, self.actor_cfg.optim, total_steps)
        self.temperature = float(cfg.rollout.temperature)
        self.chunk_size = int(self.actor_cfg.logprob_chunk_size)
        self.objective = ActorObjective.from_config(self.actor_cfg)

    # -- inference -------------------------------------------------------------------------------------
    def compute_log_prob(self, batch: Batch) -> Batch:
        """old_log_probs and entropies of the current policy (before the update)."""
        micro = micro_batch_size(self.cfg.rollout.log_prob_micro_batch_size_per_gpu,
                                 self.cfg.rollout.log_prob_micro_batch_size, default=len(batch))
        logp, ent = compute_log_probs(self.model, batch, temperature=self.temperature, micro=micro,
                                      chunk_size=self.chunk_size, device=self.device, compute_entropy=True)
        return Batch({"old_log_probs": logp, "entropies": ent})

    # -- update ------------------------------------------------------------------------------------------
    def update_policy(self, batch: Batch, influence: InfluenceStep | None = None) -> dict[str, float]:
        """PPO epochs over mini-batches; returns verl-named metrics averaged over optimiser steps.

        With ``influence``, hooks capture the per-token gradients of the traced rows during the backward of
        the first epoch (each row passes through it exactly once).
        """
        a = self.actor_cfg
        n = int(self.cfg.rollout.n)
        mini = int(a.ppo_mini_batch_size) * n
        micro = micro_batch_size(a.ppo_micro_batch_size_per_gpu, a.ppo_micro_batch_size, default=mini)
        keys = [*MODEL_INPUTS, "responses", "response_mask", "old_log_probs", "advantages"]
        keys += [k for k in ("loss_mask", "ref_log_prob") if k in batch.tensors]
        data = batch.select(keys)
        data["row_id"] = torch.arange(len(data))
        generator = torch.Generator().manual_seed(int(a.get("data_loader_seed") or 0))
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        step_optimizer = influence is None or not influence.skip_optimizer_step
        self.model.train()
        with influence.hooks() if influence is not None else nullcontext():
            for epoch in range(int(a.ppo_epochs)):
                order = torch.randperm(len(data), generator=generator) if a.shuffle else torch.arange(len(data))
                for mini_batch in data.index(order).split(mini):
                    tracing = influence if epoch == 0 else None
                    for k, v in self._update_mini_batch(mini_batch, micro, tracing, step_optimizer).items():
                        sums[k] += v
                        counts[k] += 1
        metrics = {k: sums[k] / counts[k] for k in sums}
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]  # the lr of this update, as verl reports it
        self.scheduler.step()
        return metrics

    def _update_mini_batch(self, mini_batch: Batch, micro: int, influence: InfluenceStep | None,
                           step_optimizer: bool) -> dict[str, float]:
        objective = self.objective
        agg_kwargs, pg_agg_kwargs = objective.mini_batch_normalisers(loss_mask_of(mini_batch), micro)
        sums = MetricSums()
        response_length = mini_batch["responses"].shape[1]
        for mb in mini_batch.split(micro):
            mb = mb.to(self.device)
            mask = loss_mask_of(mb)
            tracing = (influence.micro_batch(mb["row_id"], mb["input_ids"].shape[1], response_length)
                       if influence is not None else nullcontext())
            with tracing:
                with autocast_for(self.device):
                    logp, ent = response_logprobs(self.model, *(mb[k] for k in MODEL_INPUTS), response_length,
                                                  temperature=self.temperature, chunk_size=self.chunk_size,
                                                  compute_entropy=objective.needs_entropy)
                loss, metrics = objective.micro_batch_loss(
                    log_prob=logp.float(), entropy=None if ent is None else ent.float(),
                    old_log_prob=mb["old_log_probs"], advantages=mb["advantages"], mask=mask,
                    ref_log_prob=mb.tensors.get("ref_log_prob"), agg_kwargs=agg_kwargs, pg_agg_kwargs=pg_agg_kwargs)
                loss.backward()
            sums.add(metrics)
        out = {f"actor/{name}": value for name, value in sums.result().items()}
        if objective.use_kl_loss:
            out["actor/kl_coef"] = objective.kl_loss_coef
        grad_norm, stepped = clip_and_step(self.model, self.optimizer, float(self.actor_cfg.grad_clip),
                                           step=step_optimizer)
        out["actor/grad_norm"] = grad_norm
        out["actor/skipped_steps"] = 0.0 if stepped else 1.0
        return dict(out)

    def influence_backward(self, batch: Batch, influence: InfluenceStep, output_function: str) -> None:
        """The extra forward+backward of the traced rows that log_prob / advantage_log_prob need.

        The objective is the sum of the traced tokens' log-probs (times their advantages); gradients go to
        the hooks only, the parameters' ``.grad`` stay untouched.
        """
        rows = torch.as_tensor(influence.selection.rows, dtype=torch.long)
        if not len(rows):
            return
        keys = [*MODEL_INPUTS, "responses", "response_mask", "advantages"]
        data = batch.select(keys + [k for k in ("loss_mask",) if k in batch.tensors]).index(rows)
        data["row_id"] = rows
        a = self.actor_cfg
        micro = micro_batch_size(a.ppo_micro_batch_size_per_gpu, a.ppo_micro_batch_size, default=len(data))
        response_length = data["responses"].shape[1]
        weights = [module.weight for module in influence.capture.modules.values()]
        self.model.train()
        with influence.hooks():
            for mb in data.split(micro):
                mb = mb.to(self.device)
                with influence.micro_batch(mb["row_id"], mb["input_ids"].shape[1], response_length):
                    with autocast_for(self.device):
                        logp, _ = response_logprobs(self.model, *(mb[k] for k in MODEL_INPUTS), response_length,
                                                    temperature=self.temperature, chunk_size=self.chunk_size,
                                                    compute_entropy=False)
                    objective = logp.float() * loss_mask_of(mb)
                    if output_function == "advantage_log_prob":
                        objective = objective * mb["advantages"]
                    torch.autograd.grad(objective.sum(), weights)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save(self, out_dir: Path, tokenizer) -> None:
        """HF folder (loadable with from_pretrained) plus optimiser and scheduler state."""
        save_hf(self.model, tokenizer, out_dir)
        save_optim_state(out_dir, self.optimizer, self.scheduler)

    def load(self, in_dir: Path) -> None:
        load_weights(self.model, in_dir)
        load_optim_state(in_dir, self.optimizer, self.scheduler, self.device)


def load_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load the safetensors weights that save_hf wrote into an existing model (exact, in place)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k and getattr(model.config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"checkpoint {folder} does not match the model: missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")
