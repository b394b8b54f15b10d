"""A standalone rollout rank (trainer.v1.trainer_mode=separate_async, docs/async.md): a GPU that only generates.

It holds the policy in the engine's dtype with its rollout engine (no optimiser, reference or critic), keeps a pool
of prompt groups in flight across calls as a colocate_async rank does (workers/async_rollout.py; with tools, whole
batches through the tool loop: workers/async_tool_rollout.py), and takes new weights from trainer rank 0 over the
weight-sync group (archer/distributed/weight_sync.py) between calls. Its
engine never gives its memory back (nothing else runs on its card): rollout.free_cache_engine is off here. The
rollout ranks share no process group among themselves; the driver pads their results to one width.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import PreTrainedTokenizerBase

from archer.batch import Batch
from archer.distributed.weight_sync import WeightManifest, WeightReceiver, join_group
from archer.models.loading import load_causal_lm, load_tokenizer, pick_device
from archer.rollout.factory import build_engine, uses_fast_engine
from archer.workers.async_rollout import (
    ASYNC_STATS,
    GENERATION_S,
    StalenessBound,
    admitted_share,
    merge_async_stats,
    rank_quota,
)
from archer.workers.async_tool_rollout import RankRollout, async_rollout_for
from archer.workers.dispatch import Seat, collect, own_rows
from archer.workers.results import concat_generations
from archer.workers.rollout import RolloutWorker, concat_sequences

PAD_TOKEN = "pad_token_id"  # info key of a rollout rank's result: the pad token its rows are padded with


def engine_dtype(rollout: DictConfig, device: torch.device) -> torch.dtype:
    """The dtype the rollout ranks hold and receive the weights in: rollout.dtype on a GPU, float32 on a CPU."""
    return getattr(torch, str(rollout.dtype)) if device.type == "cuda" else torch.float32


def _padded(results: list[Batch]) -> Batch:
    """The ranks' rows in rank order, padded to one prompt and response width (the pad token each rank named
    in its ``info`` is taken out)."""
    pad = int(results[0].info[PAD_TOKEN])
    for batch in results:
        batch.info.pop(PAD_TOKEN, None)
    parts = [b for b in results if len(b)]
    if not parts:
        return results[0]
    return concat_sequences(parts, pad) if len(parts) > 1 else parts[0]


def concat_rank_groups(results: list[Batch]) -> Batch:
    """produce_groups' results: the ranks' complete groups, with what their pools did (``merge_async_stats``)
    and the tool loop's statistics merged."""
    stats = [b.info.pop(ASYNC_STATS) for b in results]
    batch = concat_rank_generations(results)
    batch.info[ASYNC_STATS] = merge_async_stats(stats)
    return batch


def concat_rank_generations(results: list[Batch]) -> Batch:
    """generate_sequences' results: the ranks' rows in order, the agentic loop's statistics merged."""
    return concat_generations(results, _padded)


def _none(results: list[Any]) -> None:
    return None


class RolloutRank:
    """One rollout rank of ``cfg`` (the whole run config); ``RANK`` / ``WORLD_SIZE`` in its environment place it
    among the rollout ranks."""

    def __init__(self, cfg: DictConfig, *, tokenizer: PreTrainedTokenizerBase | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        ref_cfg = cfg.actor_rollout_ref
        self.ctx = Seat(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
        self.device = pick_device(cfg.trainer.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = float(ref_cfg.nccl_timeout)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(ref_cfg.model.path, role="model")
        rollout_cfg = OmegaConf.merge(ref_cfg.rollout, {"free_cache_engine": False})
        self.dtype = engine_dtype(rollout_cfg, self.device)
        # read on the host: the engine takes its own copy on the card (the fast engine's weights, the hf engine's
        # module filled by every sync: the first comes before any generation), so no second copy sits beside it
        model = load_causal_lm(ref_cfg.model.path, device="cpu", dtype=self.dtype,
                               trust_remote_code=bool(ref_cfg.model.trust_remote_code))
        model.eval()
        fast = uses_fast_engine(rollout_cfg, model, self.device)
        engine = build_engine(rollout_cfg, model, self.tokenizer, self.device, standalone=not fast)
        self.rollout = RolloutWorker(engine, rollout_cfg, device=self.device, tokenizer=self.tokenizer,
                                     chat_template=ref_cfg.model.custom_chat_template,
                                     template_kwargs=chat_template_kwargs)
        self.pool: RankRollout | None = None  # made at the first call, which brings trainer.v1.partial_rollout
        self.receiver: WeightReceiver | None = None

    def _tagged(self, batch: Batch) -> Batch:
        batch.info[PAD_TOKEN] = int(self.tokenizer.pad_token_id)
        return batch

    @collect(concat_rank_groups, split=admitted_share)
    def produce_groups(self, admitted: list[Batch], quota: int, version: int, bound: StalenessBound,
                       rotation: int = 0, lag: int = 0) -> Batch:
        """This rank's rows of the admitted prompt batches, and its share of ``quota`` complete groups
        (``AsyncRollout.take``), sampled up to policy ``version`` for the step that updates ``version + lag``."""
        start = time.perf_counter()
        if self.pool is None:
            self.pool = async_rollout_for(self.rollout, int(self.tokenizer.pad_token_id), partial=bound.partial_rollout)
        out = self.pool.take(admitted, rank_quota(quota, self.ctx.rank, self.ctx.world_size, rotation), version,
                             bound, lag=lag)
        out.info[ASYNC_STATS][GENERATION_S] = time.perf_counter() - start
        return self._tagged(out)

    @collect(concat_rank_generations, split=own_rows)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """The responses to this rank's rows of ``prompts`` (validation), each sampled with the seed of its
        index in the whole batch; a rank without rows returns none."""
        if not len(prompts):
            return self._tagged(Batch({}))
        return self._tagged(self.rollout.generate_for(prompts))

    # -- weights ------------------------------------------------------------------------------------------
    @collect(_none)
    def join_weight_sync(self, host: str, port: int, size: int, manifest: WeightManifest) -> None:
        """Join the weight-sync group hosted by trainer rank 0 (this rank is 1 + its rollout rank)."""
        group = join_group(host, port, 1 + self.ctx.rank, size, self.device, self.timeout_s)
        self.receiver = WeightReceiver(group, manifest, self.device)

    @collect(_none)
    def receive_weights(self) -> None:
        """Take the policy's weights from trainer rank 0 into the engine, in place."""
        self.rollout.engine.sync_weights(self.receiver.receive())
