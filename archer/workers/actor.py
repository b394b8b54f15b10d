"""The actor worker: the policy model on one device, the rollout engine that generates with its weights, its
log-probs/entropies, its PPO update and the influence hooks on its layers.

The trainer talks to it in Batches and plain data only (so that it can move into another process): prompts in,
sequences out (``generate_sequences``, sampling settings in ``info``; with tools configured, through the
multi-turn tool loop); a batch in, old log-probs and entropies out; a batch (and the influence trace's tokens)
in, an ``UpdateResult`` out (workers/results.py: metrics, and the tokens' captured gradient factors). The worker keeps the engine's weights
in step with the model and frees the engine's memory (KV cache and weight copy) around the update
(``rollout.free_cache_engine``); its model owner moves the policy's weights / Adam's states to host memory where
verl's offload keys ask (models/offload.py). The memory plan of the card is the rank's colocated workers'
(workers/colocated.py).

Log-probs and entropies come from the chunked kernel in models/logprobs.py (no full float32 tokens x vocab
tensor). The update splits the batch into mini-batches (one optimiser step each) and micro-batches
(gradient accumulation: a number of rows, or a token budget, padded or packed: models/micro_batches.py); every
loss is normalised over its whole mini-batch, so accumulation is exact whatever the micro-batches. The old
log-probs are packed to a token budget by default.

With ``model.lora_rank > 0`` the policy is the base model with peft's LoRA layers (models/lora.py): only the
adapters are trained and checkpointed (beside the merged HF folder), the engine takes the merged weights, and
the reference worker uses the same module with the adapters off.

With routing replay (``actor.router_replay.mode=R3``, models/router_replay.py) the fast engine records each
token's experts, and the old-log-prob pass and the update route an MoE policy's tokens with them; the old-log-prob
pass also counts how often the policy's own top-k differs (``actor/router_mismatch_*``), also when
``rollout.enable_rollout_routing_replay`` records without replaying. With R2 the old-log-prob pass records its own
routing and the update replays it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from archer.algorithms.rollout_correction import RolloutCorrection
from archer.batch import Batch
from archer.distributed.context import DistContext
from archer.distributed.fsdp import decoder_layers
from archer.errors import ArcherError
from archer.models import liger
from archer.models.checkpointed_layers import KEY as CHECKPOINT_KEY
from archer.models.checkpointed_layers import checkpoint_first_layers, requested_checkpointed_layers
from archer.models.compiled_layers import ACTOR_KEY, maybe_compile_layers
from archer.models.forward import MODEL_INPUTS, compute_log_probs
from archer.models.loading import autocast_for, load_tokenizer, parse_dtype, read_model_config
from archer.models.logprobs import layout_logprobs
from archer.models.lora import LoraSettings, trainable_parameters
from archer.models.micro_batches import ACTOR_UPDATE, LOG_PROB, MicroBatching, no_grad_micro_batching
from archer.models.moe import refuse_router_loss
from archer.models.optim import LRSchedule
from archer.models.owner import ModelOwner, OwnsModel
from archer.models.packed_attention import supports_packing
from archer.models.router_replay import (
    MODE_KEY,
    RECORD_KEY,
    ROUTE_COUNTS,
    ROUTED_EXPERTS,
    ReplaySettings,
    RouteCounts,
    micro_batch_replay,
    router_of,
    sparse_gates,
)
from archer.models.sequence_layout import SequenceLayout
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
from archer.workers.async_rollout import StalenessBound, admitted_share, concat_produced, rank_quota
from archer.workers.async_tool_rollout import RankRollout, async_rollout_for
from archer.workers.data_parallel import PassShare, RankPasses, RankTokens, own_passes, rank_passes
from archer.workers.dispatch import STAND_IN, collect, concat_batches, own_rows_or_stand_in, rank_zero
from archer.workers.memory import MemoryPlan, gib, planned_no_grad_tokens, release_cached_blocks
from archer.workers.mini_batches import ppo_epochs
from archer.workers.reference import ReferenceWorker
from archer.workers.results import ROLLOUT_STATS, UpdateResult, concat_generated, merge_updates
from archer.workers.rollout import RolloutWorker, pad_sequences

log = logging.getLogger("archer.actor")


def _width(batch: Batch, key: str) -> int:
    return int(batch[key].shape[1]) if key in batch.tensors else 0


class ActorWorker(OwnsModel):
    """Owns the policy model, its optimiser and schedule, and the rollout engine, on one device."""

    def __init__(self, cfg: DictConfig, *, device: torch.device, total_steps: int,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None, ctx: DistContext | None = None,
                 start_rollout: bool = True, rollout_correction: RolloutCorrection | None = None,
                 balance_ranks: bool = False) -> None:
        """``ctx``: the rank of a data-parallel run (archer/distributed/context.py; default: one process on
        ``device``); the policy is then sharded with FSDP2 and the offload keys become FSDP2's CPU offload.
        ``start_rollout``: build the rollout engine now; the rank's colocated workers pass False and call
        ``start_rollout`` once the card's memory plan is checked (workers/colocated.py), since the fast engine
        takes its share of the card when built. ``rollout_correction``: algorithm.rollout_correction (its bypass
        mode corrects in the loss; default: off). ``balance_ranks``: the update's ranks take rows balanced by tokens
        (trainer.balance_batch, workers/data_parallel.py), unless the loss makes choices per micro-batch."""
        self.cfg = cfg
        self.actor_cfg = cfg.actor
        self.device = device
        self.ctx = ctx if ctx is not None else DistContext.single(device)
        self.owner = self._load_policy(total_steps)
        self.compiled = maybe_compile_layers(self.model, device, enabled=bool(self.actor_cfg.use_torch_compile),
                                             liger=bool(cfg.model.use_liger), key=ACTOR_KEY,
                                             announce=self.ctx.rank == 0)
        self.temperature = float(cfg.rollout.temperature)
        self.chunk_size = self.actor_cfg.logprob_chunk_size
        remove_padding, self.can_pack = bool(cfg.model.use_remove_padding), supports_packing(self.model)
        self.update_micro = MicroBatching.from_config(self.actor_cfg, ACTOR_UPDATE, packed=remove_padding and self.can_pack)
        self.plan_micro_batches(None, announce=False)
        self.objective = ActorObjective.from_config(self.actor_cfg, rollout_correction)
        if balance_ranks and self.objective.chooses_per_micro_batch and self.ctx.world_size > 1:
            balance_ranks = False  # balanced shards would regroup the micro-batches this loss makes choices in
            if self.ctx.rank == 0:
                log.warning("trainer.balance_batch=true leaves the actor's rows contiguous over the ranks: its loss "
                            "(%s) makes choices per micro-batch (top-entropy tokens, the entropy split, AEPO's "
                            "standardisation or batch-normalised correction weights), which balanced shards would "
                            "regroup; the critic's update is balanced", self.objective.loss_mode)
        self.balance_ranks = balance_ranks
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model.path, role="model")
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.chat_template_kwargs = chat_template_kwargs
        self.fast_engine = uses_fast_engine(cfg.rollout, self.model, device)
        self.routing = ReplaySettings.from_config(cfg)
        if self.routing.record or self.routing.replay:
            self._check_routing()
        self.rollout: RolloutWorker | None = None
        self._engine_is_stale = False  # the weights changed since the engine last took them
        self.async_rollout: RankRollout | None = None  # colocate_async's pool (produce_groups)
        # the influence trace's settings, hooked modules and their projections (setup_influence)
        self.influence: tuple[CaptureSettings, dict[str, torch.nn.Linear], dict[str, ModuleProjection]] | None = None
        if start_rollout:
            self.start_rollout()

    def _load_policy(self, total_steps: int) -> ModelOwner:
        """The policy's owner: loaded (float32 master weights, or a LoRA base with float32 adapters), sharded at
        world > 1, with its optimiser, schedule and offload (actor.fsdp_config's keys)."""
        model_cfg, fsdp = self.cfg.model, self.actor_cfg.fsdp_config
        refuse_router_loss(read_model_config(model_cfg.path, trust_remote_code=bool(model_cfg.trust_remote_code)),
                           str(model_cfg.path))
        owner = ModelOwner.policy(model_cfg.path, device=self.device, lora=LoraSettings.from_config(model_cfg),
                                  gradient_checkpointing=bool(model_cfg.enable_gradient_checkpointing),
                                  trust_remote_code=bool(model_cfg.trust_remote_code),
                                  master_dtype=parse_dtype(fsdp.model_dtype,
                                                           "actor_rollout_ref.actor.fsdp_config.model_dtype"),
                                  ctx=self.ctx, liger_key=liger.RL_KEY if model_cfg.use_liger else None)
        param_offload, optimizer_offload = bool(fsdp.param_offload), bool(fsdp.optimizer_offload)
        if self.ctx.distributed:
            owner.shard(self.ctx, fsdp, cpu_offload=param_offload or optimizer_offload)
        owner.attach_optimizer(self.actor_cfg.optim, LRSchedule.from_rl_optim(self.actor_cfg.optim, total_steps),
                               param_offload=param_offload, optimizer_offload=optimizer_offload)
        return owner

    def _check_routing(self) -> None:
        """Refuse routing replay where the engine cannot record (the hf engine) or the policy has nothing to route
        (tools and the asynchronous modes are refused with the config: trainer/config_check.py)."""
        keys = f"{MODE_KEY}=disabled and {RECORD_KEY}=false"
        if not sparse_gates(self.model):
            raise ArcherError(f"routing replay ({MODE_KEY} / {RECORD_KEY}) needs a Mixture-of-Experts policy, and "
                              f"{self.cfg.model.path} has no sparse blocks", f"set {keys} for a dense model")
        if self.routing.record and not self.fast_engine:
            raise ArcherError("routing replay needs the fast engine, which records each token's experts; the hf "
                              "engine does not", "set actor_rollout_ref.rollout.name=fast, or " + keys)

    def plan_micro_batches(self, memory_plan: MemoryPlan | None, *, announce: bool) -> None:
        """The old-log-prob pass's micro-batches: the rollout section's keys and, on a GPU, the memory plan's token
        budget (models/micro_batches.py); the update's rows per micro-batch where the keys leave them unset and
        the plan chose them; ``announce``: this process speaks for the run."""
        rows = memory_plan.update_rows if memory_plan is not None else None
        if rows is not None:
            self.update_micro = MicroBatching(rows, None, packed=self.update_micro.packed)
            if announce:
                log.info("actor.ppo_micro_batch_size_per_gpu is unset: the memory plan runs the update in micro-batches "
                         "of %d rows (the most, up to %d tokens, whose update fits the card; %d of %d decoder layers "
                         "checkpointed)%s", rows, rows * memory_plan.longest, memory_plan.checkpointed_layers,
                         len(decoder_layers(self.model)),
                         "; this loss makes choices per micro-batch, so set it to fix the grouping"
                         if self.objective.chooses_per_micro_batch else "")
        self.log_prob_micro = no_grad_micro_batching(
            self.cfg.rollout, "actor_rollout_ref.rollout", LOG_PROB,
            remove_padding=bool(self.cfg.model.use_remove_padding), can_pack=self.can_pack,
            planned_tokens=planned_no_grad_tokens(memory_plan, self.model), announce=announce)

    def plan_checkpointing(self, memory_plan: MemoryPlan | None, *, announce: bool) -> None:
        """Checkpoint the decoder layers model.gradient_checkpointing_layers names: with ``auto`` the memory plan's
        count (every layer without a plan, on a CPU); ``announce``: this process speaks for the run."""
        layers = len(decoder_layers(self.model))
        requested = requested_checkpointed_layers(self.cfg.model, layers)  # a bad value is refused either way
        if not self.cfg.model.enable_gradient_checkpointing:
            return
        count = requested if requested is not None else (memory_plan.checkpointed_layers if memory_plan else layers)
        checkpoint_first_layers(self.model, count)
        if announce and requested is None and count < layers:
            log.info("gradient checkpointing on %d of %d decoder layers: the memory plan leaves room for the other "
                     "layers' activations (%s GiB at the update's largest micro-batch, estimated); %s=all recomputes "
                     "every layer", count, layers, gib(memory_plan.activations), CHECKPOINT_KEY)

    def start_rollout(self) -> None:
        """Build the rollout engine (with the policy's weights) and the rollout worker around it."""
        offload = self.owner.offload
        if offload.param_offload and not self.fast_engine:
            log.warning("actor.fsdp_config.param_offload=true has no effect with the hf engine, which generates "
                        "with the policy's own weights")
            offload.param_offload = False
        sharded = self.ctx.distributed
        engine = build_engine(self.cfg.rollout, self.model, self.tokenizer, self.device, standalone=sharded,
                              weights=self.owner.weights() if sharded and self.fast_engine else None,
                              record_routes=self.routing.record)
        self.rollout = RolloutWorker(engine, self.cfg.rollout, device=self.device, tokenizer=self.tokenizer,
                                     chat_template=self.cfg.model.custom_chat_template,
                                     template_kwargs=self.chat_template_kwargs)
        self._engine_is_stale = sharded and not self.fast_engine  # a sharded policy's hf engine has its own module

    def make_reference(self) -> ReferenceWorker:
        """The reference worker beside this actor: with LoRA the policy's base (adapters off, no second copy),
        else its own frozen copy of actor_rollout_ref.model.path."""
        return ReferenceWorker(self.cfg, device=self.device, ctx=self.ctx,
                               lora_policy=self.owner if self.owner.peft is not None else None)

    # -- generation --------------------------------------------------------------------------------------
    @contextmanager
    def _generating(self) -> Iterator[None]:
        """The engine's turn on the card: the policy's current weights synced into it first, the policy's
        parameters on the host meanwhile (param_offload)."""
        release_cached_blocks(self.device)  # what the update left in the caching allocator
        if self._engine_is_stale:
            self.rollout.engine.sync_weights(self.owner.weights())
            self._engine_is_stale = False
        self.owner.offload.params_to_host()
        try:
            yield
        finally:
            if self.cfg.rollout.free_cache_engine:  # the weight copy went too: the next generation syncs again
                self._engine_is_stale = True
            self.owner.offload.params_to_device()

    @collect(concat_generated, split=own_rows_or_stand_in)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """Responses to this rank's ``prompts`` (all of them at world 1; ``info``: ``validate`` picks
        rollout.val_kwargs and turns branching off, ``seed`` the sampling seed, each prompt sampled with the seed of
        its index in the whole batch); with tools configured, through the multi-turn tool loop. On several ranks
        padded to the widest response of every rank (so the ranks' batches concatenate); a rank without prompts
        generates for a stand-in and returns no rows (its engine's weights still synced)."""
        with self._generating():
            out = self.rollout.generate_for(prompts, release_weights=True)
            if not self.ctx.distributed:
                return out
            if prompts.info.get(STAND_IN):
                out.info.pop(ROLLOUT_STATS, None)
                out = out.index(slice(0, 0))
            width = int(self.ctx.all_reduce_max(torch.tensor([out["responses"].shape[1]]))[0])
            return pad_sequences(out, out["prompts"].shape[1], width, self.pad_token_id)

    @collect(concat_produced, split=admitted_share)
    def produce_groups(self, admitted: list[Batch], quota: int, version: int, bound: StalenessBound,
                       rotation: int = 0, lag: int = 0) -> Batch:
        """colocate_async (workers/async_rollout.py, ``AsyncRollout.take``): this rank's rows of the admitted prompt
        batches, and its share of ``quota`` complete groups (``rank_quota``) sampled up to policy ``version`` (for
        the step that trains version ``version + lag``), padded to the widest prompt and response of every rank."""
        if self.async_rollout is None:
            self.async_rollout = async_rollout_for(self.rollout, self.pad_token_id, partial=bound.partial_rollout)
        with self._generating():
            out = self.async_rollout.take(admitted, rank_quota(quota, self.ctx.rank, self.ctx.world_size, rotation),
                                          version, bound, lag=lag)
        if not self.ctx.distributed:
            return out
        widths = self.ctx.all_reduce_max(torch.tensor([_width(out, "prompts"), _width(out, "responses")]))
        if not len(out):
            return out
        return pad_sequences(out, int(widths[0]), int(widths[1]), self.pad_token_id)

    # -- inference -------------------------------------------------------------------------------------
    @collect(concat_batches, split=own_passes("log_prob_micro"))
    def compute_log_prob(self, share: PassShare) -> Batch:
        """old_log_probs and entropies of the current policy (before the update), of this rank's rows (called with
        the whole batch); where the batch holds the engine's ``routed_experts``, routed with them (R3) and each
        row's ``ROUTE_COUNTS``; with R2 the routers' own top-k as ``routed_experts``, which the update replays."""
        batch = share.batch
        counts = torch.zeros(len(batch), RouteCounts.COLUMNS) if ROUTED_EXPERTS in batch.tensors else None
        own = None
        if self.routing.own:  # R2: this pass's own routing, replayed in the update
            gates = sparse_gates(self.model)
            own = torch.full((*batch["input_ids"].shape, len(gates), int(router_of(gates[0]).top_k)), -1,
                             dtype=torch.int16)
        logp, ent = compute_log_probs(self.model, batch, temperature=self.temperature,
                                      micro=self.log_prob_micro, chunk_size=self.chunk_size, device=self.device,
                                      compute_entropy=True, parts=share.passes.parts, routing=self.routing,
                                      route_counts=counts, routes_out=own)
        out = Batch({"old_log_probs": share.own(logp), "entropies": share.own(ent)})
        if counts is not None:
            out[ROUTE_COUNTS] = share.own(counts)
        if own is not None:
            out[ROUTED_EXPERTS] = share.own(own)
        return out

    # -- influence ---------------------------------------------------------------------------------------
    @collect(rank_zero)
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
    @collect(merge_updates)
    def update_actor(self, batch: Batch, influence_tokens: TracedTokens | None = None) -> UpdateResult:
        """PPO epochs over mini-batches: verl-named metrics averaged over optimiser steps; with
        ``influence_tokens``, their captured gradient factors per group of modules, on this device (on the CPU
        with grad_offload_to_cpu, or on a rank of several, with the tokens it captured: see
        trace/influence_capture.py)."""
        capture = self._token_capture(influence_tokens) if influence_tokens is not None else None
        metrics: dict[str, float] = {}
        if capture is not None and self.influence[0].extra_pass:
            start = perf_counter()
            self._influence_backward(batch, capture, self.influence[0].output_function)
            metrics["timing_s/influence_backward"] = perf_counter() - start
        skip_step = capture is not None and self.influence[0].skip_optimizer_step
        in_update = capture if capture is not None and not self.influence[0].extra_pass else None
        metrics.update(self._update_policy(batch, in_update, step_optimizer=not skip_step))
        self._engine_is_stale = True
        if capture is None:
            return UpdateResult(metrics)
        if not self.ctx.distributed:
            return UpdateResult(metrics, influence=capture.collect())
        factors = capture.collect(complete=False)  # this rank's rows only, on the CPU for the driver to merge
        return UpdateResult(metrics, influence=[FactorGroup(g.modules, g.u.cpu(), g.v.cpu()) for g in factors],
                            captured=capture.capture.captured)

    def _update_policy(self, batch: Batch, influence: TokenCapture | None, *, step_optimizer: bool
                       ) -> dict[str, float]:
        """The PPO epochs (workers/mini_batches.py). With ``influence``, hooks capture the per-token gradients of
        the traced rows during the backward of the first epoch (each row passes through it exactly once)."""
        a = self.actor_cfg
        keys = [*MODEL_INPUTS, "responses", "response_mask", "old_log_probs", "advantages"]
        keys += [k for k in ("ref_log_prob", "rollout_is_weights") if k in batch.tensors]
        if self.routing.replay and ROUTED_EXPERTS in batch.tensors:
            keys.append(ROUTED_EXPERTS)
        data = batch.select(keys)
        data["row_id"] = torch.arange(len(data))
        update = PolicyUpdate(self, influence, step_optimizer)
        self.model.train()
        with influence.hooks() if influence is not None else nullcontext():
            metrics = ppo_epochs(data, int(a.ppo_mini_batch_size) * int(self.cfg.rollout.n), update, self.ctx,
                                 epochs=int(a.ppo_epochs), shuffle=bool(a.shuffle),
                                 seed=int(a.get("data_loader_seed") or 0))
        if update.rank_tokens is not None:  # how evenly the ranks' rows split (trainer.balance_batch), verl's names
            metrics.update(update.rank_tokens.metrics())
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]  # the lr of this update, as verl reports it
        self.scheduler.step()
        return metrics

    def _placed(self, rows: Batch) -> tuple[Batch, SequenceLayout, tuple[list[int], list[int], tuple[int, ...]]]:
        """A micro-batch's rows (with ``row_id``) and layout on the device, the layout made on the host and moved
        whole (no waits for the GPU), and what ``TokenCapture.micro_batch`` takes of them, read on the host."""
        layout = self.update_micro.layout(rows)
        traced = (rows["row_id"].tolist(), layout.first_predictor.tolist(), tuple(layout.input_ids.shape))
        return rows.to(self.device), layout.to(self.device), traced

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
                mb, layout, traced = self._placed(data.index(part))
                with influence.micro_batch(*traced):
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
        self._engine_is_stale = True


class PolicyUpdate:
    """The actor's ``UpdateObjective`` (workers/mini_batches.py): its loss over a micro-batch's log-probs, the
    influence capture of the first epoch's passes (``influence``), the ranks' token split of the first epoch,
    and its optimiser step (skipped without ``step_optimizer``)."""

    def __init__(self, actor: ActorWorker, influence: TokenCapture | None, step_optimizer: bool) -> None:
        self.actor, self.influence, self.step_optimizer = actor, influence, step_optimizer
        self.rank_tokens = RankTokens(actor.ctx.world_size) if actor.ctx.world_size > 1 else None

    def plan(self, epoch: int, mini_batch: Batch) -> tuple[RankPasses, tuple[dict, dict]]:
        actor = self.actor
        if self.rank_tokens is not None and epoch == 0:
            self.rank_tokens.add(mini_batch["attention_mask"])
        passes = rank_passes(mini_batch["attention_mask"], actor.update_micro, actor.ctx, balance=actor.balance_ranks)
        return passes, actor.objective.mini_batch_normalisers(mini_batch["response_mask"].float(), passes.every_rank)

    def loss(self, rows: Batch, normalisers: tuple[dict, dict], *, epoch: int, weight: float, scope: ExitStack
             ) -> tuple[torch.Tensor, dict[str, float]]:
        actor, objective = self.actor, self.actor.objective
        mb, layout, traced = actor._placed(rows)
        if self.influence is not None and epoch == 0 and weight:  # padding passes trace nothing
            scope.enter_context(self.influence.micro_batch(*traced))
        replay, _ = micro_batch_replay(actor.model, actor.update_micro.layout, rows, actor.device, replay=True,
                                       count=False)
        scope.enter_context(replay)  # open through the backward (a checkpointed layer's recompute routes again)
        with autocast_for(actor.device):
            logp, ent = layout_logprobs(actor.model, layout, temperature=actor.temperature,
                                        chunk_size=actor.chunk_size, compute_entropy=objective.needs_entropy)
        agg_kwargs, pg_agg_kwargs = normalisers
        return objective.micro_batch_loss(
            log_prob=logp.float(), entropy=None if ent is None else ent.float(), old_log_prob=mb["old_log_probs"],
            advantages=mb["advantages"], mask=mb["response_mask"].float(), ref_log_prob=mb.tensors.get("ref_log_prob"),
            agg_kwargs=agg_kwargs, pg_agg_kwargs=pg_agg_kwargs, rollout_is_weights=mb.tensors.get("rollout_is_weights"))

    def step(self, sums: dict[str, float]) -> dict[str, float]:
        actor, objective = self.actor, self.actor.objective
        # the objective's own metrics go under actor/; a named family (rollout_corr/...) keeps its name
        out = {name if "/" in name else f"actor/{name}": value for name, value in sums.items()}
        if objective.use_kl_loss:
            out["actor/kl_coef"] = objective.kl_loss_coef
        grad_norm, stepped = actor.owner.step(float(actor.actor_cfg.grad_clip), step=self.step_optimizer)
        out["actor/grad_norm"] = grad_norm
        out["actor/skipped_steps"] = 0.0 if stepped else 1.0
        return out
