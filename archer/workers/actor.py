"""The actor worker: the policy model on one device, the rollout engine that generates with its weights, its
log-probs/entropies, its PPO update and the influence hooks on its layers.

The trainer talks to it in Batches and plain data only (so that it can move into another process): prompts in,
sequences out (``generate_sequences``, sampling settings in ``info``; with tools configured, through the
multi-turn tool loop); a batch in, old log-probs and entropies out; a batch in, metrics (and, when the influence
trace asks for tokens in ``info``, their captured gradient factors) out. The worker keeps the engine's weights
in step with the model and frees the engine's memory (KV cache and weight copy) around the update
(``rollout.free_cache_engine``); on a GPU it checks the memory plan (workers/memory.py) before anything runs, and
moves the policy's weights / Adam's states to host memory where verl's offload keys ask (workers/offload.py).

Log-probs and entropies come from the chunked kernel in models/logprobs.py (no full float32 tokens x vocab
tensor). The update splits the batch into mini-batches (one optimiser step each) and micro-batches
(gradient accumulation: a number of rows, or a token budget, padded or packed: models/micro_batches.py); every
loss is normalised over its whole mini-batch, so accumulation is exact whatever the micro-batches. The old
log-probs are packed to a token budget by default.

With ``model.lora_rank > 0`` the policy is the base model with peft's LoRA layers (models/lora.py): only the
adapters are trained and checkpointed (beside the merged HF folder), the engine takes the merged weights, and
the reference worker uses the same module with the adapters off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from archer.algorithms.metrics import MetricSums
from archer.batch import Batch
from archer.distributed.context import DistContext, shard_bounds
from archer.distributed.data_parallel import rank_passes, reduce_metric_sums
from archer.models.forward import MODEL_INPUTS, compute_log_probs
from archer.models.loading import autocast_for, load_tokenizer, parse_dtype
from archer.models.logprobs import layout_logprobs
from archer.models.lora import LoraSettings, trainable_parameters
from archer.models.micro_batches import ACTOR_UPDATE, LOG_PROB, MicroBatching, no_grad_micro_batching
from archer.models.optim import LRSchedule, clip_and_step
from archer.models.owner import ModelOwner, OwnsModel
from archer.models.packed_attention import supports_packing
from archer.rollout.factory import build_engine, uses_fast_engine
from archer.trace.influence_capture import (
    CaptureSettings,
    FactorGroup,
    InfluenceCapture,
    ModuleProjection,
    TokenCapture,
    TracedTokens,
    module_projections,
    select_modules,
)
from archer.workers.actor_objective import ActorObjective
from archer.workers.memory import (
    MemoryPlan,
    card_figures,
    plan_actor_memory,
    planned_no_grad_tokens,
    release_cached_blocks,
)
from archer.workers.mini_batches import StepAverages, mini_batches
from archer.workers.offload import Offload
from archer.workers.reference import ReferenceWorker
from archer.workers.rollout import FIRST_PROMPT, ROLLOUT_STATS, RolloutWorker, pad_sequences

log = logging.getLogger("archer.actor")

INFLUENCE_TOKENS = "influence_tokens"  # info key of update_actor's input: the TracedTokens to capture
INFLUENCE_CAPTURED = "influence_captured"  # info key of a data-parallel rank's update: tokens captured per module


class ActorWorker(OwnsModel):
    """Owns the policy model, its optimiser and schedule, and the rollout engine, on one device."""

    def __init__(self, cfg: DictConfig, *, device: torch.device, total_steps: int,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None,
                 other_models: Mapping[str, int] | None = None, ctx: DistContext | None = None) -> None:
        """``other_models``: the models beside the actor on the device (reference, critic), as bytes per policy
        parameter each holds, for the memory plan (workers/memory.py) checked here on a GPU. ``ctx``: the rank
        of a data-parallel run (archer/distributed/context.py; default: one process on ``device``); the policy
        is then sharded with FSDP2 and the offload keys become FSDP2's CPU offload."""
        self.cfg = cfg
        self.actor_cfg = cfg.actor
        self.device = device
        self.ctx = ctx if ctx is not None else DistContext.single(device)
        offload = self.actor_cfg.fsdp_config
        self.owner = ModelOwner.policy(cfg.model.path, device=device, lora=LoraSettings.from_config(cfg.model),
                                       gradient_checkpointing=bool(cfg.model.enable_gradient_checkpointing),
                                       trust_remote_code=bool(cfg.model.trust_remote_code),
                                       master_dtype=parse_dtype(offload.model_dtype,
                                                                "actor_rollout_ref.actor.fsdp_config.model_dtype"),
                                       ctx=self.ctx)
        offload_keys = bool(offload.param_offload), bool(offload.optimizer_offload)
        sharded = self.ctx.distributed
        if sharded:
            self.owner.shard(self.ctx, offload, cpu_offload=any(offload_keys))
        self.owner.attach_optimizer(self.actor_cfg.optim, LRSchedule.from_rl_optim(self.actor_cfg.optim, total_steps))
        self.offload = Offload(self.model.parameters(), self.optimizer, device,
                               param_offload=offload_keys[0] and not sharded,
                               optimizer_offload=offload_keys[1] and not sharded)
        self.temperature = float(cfg.rollout.temperature)
        self.chunk_size = self.actor_cfg.logprob_chunk_size
        remove_padding, can_pack = bool(cfg.model.use_remove_padding), supports_packing(self.model)
        self.update_micro = MicroBatching.from_config(self.actor_cfg, ACTOR_UPDATE, packed=remove_padding and can_pack)
        self.objective = ActorObjective.from_config(self.actor_cfg)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model.path, role="model")
        self.pad_token_id = int(tokenizer.pad_token_id)
        fast = uses_fast_engine(cfg.rollout, self.model, device)
        self.memory_plan: MemoryPlan | None = None
        if device.type == "cuda":
            params = sum(p.numel() for p in self.model.parameters())
            others = {name: int(per_param * params) for name, per_param in (other_models or {}).items()}
            total, elsewhere = card_figures(device)
            self.memory_plan = plan_actor_memory(cfg, self.model, total=total, fast_engine=fast, others=others,
                                                 elsewhere=elsewhere, shards=self.ctx.world_size)
            self.memory_plan.check()
        self.log_prob_micro = no_grad_micro_batching(
            cfg.rollout, "actor_rollout_ref.rollout", LOG_PROB, remove_padding=remove_padding, can_pack=can_pack,
            planned_tokens=planned_no_grad_tokens(self.memory_plan, self.model), announce=self.ctx.rank == 0)
        if self.offload.param_offload and not fast:
            log.warning("actor.fsdp_config.param_offload=true has no effect with the hf engine, which generates "
                        "with the policy's own weights")
            self.offload.param_offload = False
        engine = build_engine(cfg.rollout, self.model, tokenizer, device, standalone=sharded,
                              weights=self.owner.weights() if sharded and fast else None)
        self.rollout = RolloutWorker(engine, cfg.rollout, device=device, tokenizer=tokenizer,
                                     chat_template=cfg.model.custom_chat_template,
                                     template_kwargs=chat_template_kwargs)
        # the weights changed since the engine last took them (a sharded policy's hf engine never took them)
        self._engine_is_stale = sharded and not fast
        # the influence trace's settings, hooked modules and their projections (setup_influence)
        self.influence: tuple[CaptureSettings, dict[str, torch.nn.Linear], dict[str, ModuleProjection]] | None = None

    def make_reference(self) -> ReferenceWorker:
        """The reference worker beside this actor: with LoRA the policy's base (adapters off, no second copy),
        else its own frozen copy of actor_rollout_ref.model.path."""
        return ReferenceWorker(self.cfg, device=self.device, ctx=self.ctx, memory_plan=self.memory_plan,
                               lora_policy=self.owner if self.owner.peft is not None else None)

    # -- generation --------------------------------------------------------------------------------------
    def generate_sequences(self, prompts: Batch) -> Batch:
        """Responses to ``prompts`` (``info``: ``validate`` picks rollout.val_kwargs and turns branching off,
        ``seed`` the sampling seed); with tools configured, through the multi-turn tool loop."""
        release_cached_blocks(self.device)  # what the update left in the caching allocator
        if self._engine_is_stale:
            self.rollout.engine.sync_weights(self.owner.weights())
            self._engine_is_stale = False
        self.offload.params_to_host()
        try:
            return self._generate_rank_share(prompts)
        finally:
            if self.cfg.rollout.free_cache_engine:  # the weight copy went too: the next generation syncs again
                self._engine_is_stale = True
            self.offload.params_to_device()

    def _generate_rank_share(self, prompts: Batch) -> Batch:
        """The responses to this rank's prompts (all of them at world 1), each sampled with the seed of its index
        in the whole batch, padded to the widest response of every rank (so the ranks' batches concatenate). A
        rank without prompts generates for one and returns no rows (its engine's weights still synced)."""
        if not self.ctx.distributed:
            return self.rollout.generate_for(prompts, release_weights=True)
        start, stop = shard_bounds(len(prompts), self.ctx.rank, self.ctx.world_size)
        share = prompts.index(slice(start, stop) if stop > start else slice(0, 1))
        share.info[FIRST_PROMPT] = start
        out = self.rollout.generate_for(share, release_weights=True)
        if stop == start:
            out.info.pop(ROLLOUT_STATS, None)
            out = out.index(slice(0, 0))
        width = int(self.ctx.all_reduce_max(torch.tensor([out["responses"].shape[1]]))[0])
        return pad_sequences(out, out["prompts"].shape[1], width, self.pad_token_id)

    # -- inference -------------------------------------------------------------------------------------
    def compute_log_prob(self, batch: Batch) -> Batch:
        """old_log_probs and entropies of the current policy (before the update)."""
        passes = rank_passes(batch["attention_mask"], self.log_prob_micro, self.ctx)
        logp, ent = compute_log_probs(self.model, batch, temperature=self.temperature, micro=self.log_prob_micro,
                                      chunk_size=self.chunk_size, device=self.device, compute_entropy=True,
                                      parts=passes.parts)
        return Batch({"old_log_probs": logp[passes.rows], "entropies": ent[passes.rows]})

    # -- influence ---------------------------------------------------------------------------------------
    def setup_influence(self, settings: CaptureSettings) -> list[str]:
        """Hook the linear layers ``settings`` names during traced updates; returns their names."""
        modules = select_modules(self.model, list(settings.module_name_filter),
                                 None if settings.layers is None else list(settings.layers), settings.max_modules)
        self.influence = (settings, modules, module_projections(modules, settings.projection))
        return list(modules)

    def _token_capture(self, tokens: TracedTokens) -> TokenCapture:
        if self.influence is None:
            raise RuntimeError("update_actor was asked for influence tokens before setup_influence")
        settings, modules, projections = self.influence
        store = torch.device("cpu") if settings.offload_to_cpu else self.device
        return TokenCapture(InfluenceCapture(modules, projections, num_tokens=len(tokens.token_response),
                                             store_device=store), tokens)

    # -- update ------------------------------------------------------------------------------------------
    def update_actor(self, batch: Batch) -> Batch:
        """PPO epochs over mini-batches. Returns ``info["metrics"]``: verl-named metrics averaged over optimiser
        steps; and, when ``batch.info["influence_tokens"]`` names tokens, ``info["influence"]``: their captured
        gradient factors per group of modules, on this device (on the CPU with grad_offload_to_cpu; see
        trace/influence_capture.py)."""
        tokens: TracedTokens | None = batch.info.get(INFLUENCE_TOKENS)
        capture = self._token_capture(tokens) if tokens is not None else None
        metrics: dict[str, float] = {}
        if capture is not None and self.influence[0].extra_pass:
            start = perf_counter()
            self._influence_backward(batch, capture, self.influence[0].output_function)
            metrics["timing_s/influence_backward"] = perf_counter() - start
        skip_step = capture is not None and self.influence[0].skip_optimizer_step
        in_update = capture if capture is not None and not self.influence[0].extra_pass else None
        metrics.update(self._update_policy(batch, in_update, step_optimizer=not skip_step))
        self._engine_is_stale = True
        out = Batch(info={"metrics": metrics})
        if capture is not None:
            if self.ctx.distributed:  # this rank's rows only, on the CPU for the driver to merge
                factors = capture.collect(complete=False)
                out.info["influence"] = [FactorGroup(g.modules, g.u.cpu(), g.v.cpu()) for g in factors]
                out.info[INFLUENCE_CAPTURED] = capture.capture.captured
            else:
                out.info["influence"] = capture.collect()
        return out

    def _update_policy(self, batch: Batch, influence: TokenCapture | None, *, step_optimizer: bool
                       ) -> dict[str, float]:
        """The PPO epochs. With ``influence``, hooks capture the per-token gradients of the traced rows during
        the backward of the first epoch (each row passes through it exactly once)."""
        a = self.actor_cfg
        n = int(self.cfg.rollout.n)
        mini = int(a.ppo_mini_batch_size) * n
        keys = [*MODEL_INPUTS, "responses", "response_mask", "old_log_probs", "advantages"]
        keys += [k for k in ("ref_log_prob",) if k in batch.tensors]
        data = batch.select(keys)
        data["row_id"] = torch.arange(len(data))
        averages = StepAverages()
        self.model.train()
        with influence.hooks() if influence is not None else nullcontext():
            for epoch, mini_batch in mini_batches(data, mini, epochs=int(a.ppo_epochs), shuffle=bool(a.shuffle),
                                                  seed=int(a.get("data_loader_seed") or 0)):
                tracing = influence if epoch == 0 else None
                averages.add(self._update_mini_batch(mini_batch, tracing, step_optimizer))
        metrics = averages.result()
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]  # the lr of this update, as verl reports it
        self.scheduler.step()
        return metrics

    def _update_mini_batch(self, mini_batch: Batch, influence: TokenCapture | None, step_optimizer: bool
                           ) -> dict[str, float]:
        objective = self.objective
        passes = rank_passes(mini_batch["attention_mask"], self.update_micro, self.ctx)
        agg_kwargs, pg_agg_kwargs = objective.mini_batch_normalisers(mini_batch["response_mask"].float(),
                                                                     passes.every_rank)
        sums = MetricSums()
        for index, rows in enumerate(passes.parts):
            weight = 0.0 if passes.padding(index) else 1.0  # a padding pass only keeps FSDP's collectives in step
            mb = mini_batch.index(rows).to(self.device)
            layout = self.update_micro.layout(mb)
            mask = mb["response_mask"].float()
            tracing = (influence.micro_batch(mb["row_id"].tolist(), layout.first_predictor.tolist(),
                                             tuple(layout.input_ids.shape))
                       if influence is not None and weight else nullcontext())  # padding passes trace nothing
            with tracing:
                with autocast_for(self.device):
                    logp, ent = layout_logprobs(self.model, layout, temperature=self.temperature,
                                                chunk_size=self.chunk_size, compute_entropy=objective.needs_entropy)
                loss, metrics = objective.micro_batch_loss(
                    log_prob=logp.float(), entropy=None if ent is None else ent.float(),
                    old_log_prob=mb["old_log_probs"], advantages=mb["advantages"], mask=mask,
                    ref_log_prob=mb.tensors.get("ref_log_prob"), agg_kwargs=agg_kwargs, pg_agg_kwargs=pg_agg_kwargs)
                (loss * weight).backward()
            sums.add(metrics, weight)
        reduce_metric_sums(sums, self.ctx)
        out = {f"actor/{name}": value for name, value in sums.result().items()}
        if objective.use_kl_loss:
            out["actor/kl_coef"] = objective.kl_loss_coef
        with self.offload.optimizer_step():
            grad_norm, stepped = clip_and_step(self.model, self.optimizer, float(self.actor_cfg.grad_clip),
                                               step=step_optimizer)
        out["actor/grad_norm"] = grad_norm
        out["actor/skipped_steps"] = 0.0 if stepped else 1.0
        return out

    def _influence_backward(self, batch: Batch, influence: TokenCapture, output_function: str) -> None:
        """The extra forward+backward of the traced rows that log_prob / advantage_log_prob need.

        The objective is the sum of the traced tokens' log-probs (times their advantages); gradients go to
        the hooks only, the parameters' ``.grad`` stay untouched.
        """
        rows = torch.as_tensor(influence.tokens.rows, dtype=torch.long)
        if not len(rows):
            return
        data = batch.select([*MODEL_INPUTS, "responses", "response_mask", "advantages"]).index(rows)
        data["row_id"] = rows
        # the hooked modules' trainable parameters (LoRA: the adapters), so that the backward reaches every hook
        weights = [p for module in influence.capture.modules.values() for p in trainable_parameters(module)]
        self.model.train()
        with influence.hooks():
            for part in self.update_micro.split(data["attention_mask"]):
                mb = data.index(part).to(self.device)
                layout = self.update_micro.layout(mb)
                with influence.micro_batch(mb["row_id"].tolist(), layout.first_predictor.tolist(),
                                           tuple(layout.input_ids.shape)):
                    with autocast_for(self.device):
                        logp, _ = layout_logprobs(self.model, layout, temperature=self.temperature,
                                                  chunk_size=self.chunk_size, compute_entropy=False)
                    objective = logp.float() * mb["response_mask"].float()
                    if output_function == "advantage_log_prob":
                        objective = objective * mb["advantages"]
                    torch.autograd.grad(objective.sum(), weights)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save(self, out_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        """HF folder (loadable with from_pretrained) plus optimiser and scheduler state. With LoRA the folder
        holds the merged model, and ``lora_adapter/`` the adapters (what resuming loads)."""
        self.owner.save(out_dir, tokenizer)

    def load(self, in_dir: Path) -> None:
        self.owner.load(in_dir, "actor_rollout_ref.model")
        self.offload.optimizer_to_host()
        self._engine_is_stale = True
