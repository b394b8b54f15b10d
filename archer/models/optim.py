"""Optimiser and learning-rate schedule from verl's ``optim`` config blocks (AdamW; warmup, then constant, cosine
or warmup-stable-decay), their checkpointed state, and the clipped optimiser step."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from archer.distributed.fsdp import clip_grad_norm
from archer.errors import ArcherError

WARMUP_STYLES = ("constant", "cosine")  # verl's actor / critic optim.warmup_style
SFT_SCHEDULERS = ("cosine", "constant", "wsd")  # verl's SFT trainer optim.lr_scheduler
WSD_STABLE_RATIO = 0.9  # wsd: share of the post-warmup steps held at the peak lr before the cosine decay (verl's)


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: DictConfig) -> torch.optim.AdamW:
    """AdamW from an optim block's lr, betas (default (0.9, 0.999)) and weight_decay; torch's fused kernel when
    every parameter is on a GPU (one kernel for all of them: 17 ms a step against the default's 47 ms for the
    1.5B shape on an H100, BENCHMARKS.md), else its default (parameters on the CPU: CPU runs and offloaded
    optimisers)."""
    params = list(params)
    betas = tuple(optim.get("betas", (0.9, 0.999)))
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=float(optim.lr), betas=betas, weight_decay=float(optim.weight_decay),
                             fused=fused or None)


def allocate_adam_states(optimizer: torch.optim.AdamW) -> None:
    """Allocate AdamW's states now, as its first step would (the same zeros, the same step tensors: the step's
    numbers do not change). On a GPU (where ModelOwner calls it), made lazily in the first step, the states (8 bytes a
    parameter) are carved out of the caching allocator's blocks that the update's activations just freed, and pin
    those blocks' segments for the rest of the run: ``empty_cache`` cannot give a segment back while a state lives
    in it, so the next generation found tens of GiB less free than at step 1 (issue 44, docs/memory.md). Made
    before any activation exists, they sit beside the weights."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue
            if group["capturable"] or group["fused"]:
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            else:  # torch keeps this step count on the host, in the default dtype's precision
                dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                state["step"] = torch.tensor(0.0, dtype=dtype)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def warmup_steps(optim: DictConfig, total_steps: int) -> int:
    """verl's rule: lr_warmup_steps unless negative (or null), else lr_warmup_steps_ratio * total_steps."""
    steps = optim.get("lr_warmup_steps", -1)
    if steps is not None and int(steps) >= 0:
        return int(steps)
    return int(float(optim.get("lr_warmup_steps_ratio", 0.0)) * total_steps)


def lr_multiplier(step: int, *, warmup: int, total: int, style: str, min_lr_ratio: float, num_cycles: float,
                  stable_ratio: float = WSD_STABLE_RATIO) -> float:
    """The factor applied to the base learning rate after ``step`` scheduler steps: a linear warmup over
    ``warmup`` steps, then constant, a cosine decay to ``min_lr_ratio``, or (wsd) ``stable_ratio`` of the
    remaining steps at the peak and the cosine decay over the rest. With min_lr_ratio 0 and num_cycles 0.5
    these are transformers' constant / cosine / wsd schedules with warmup, number for number."""
    if warmup > 0 and step < warmup:
        return min_lr_ratio + (1.0 - min_lr_ratio) * step / warmup if style != "constant" else step / warmup
    if style == "constant":
        return 1.0
    start, length = warmup, total - warmup
    if style == "wsd":
        stable = int(length * stable_ratio)
        if step < warmup + stable:
            return 1.0
        start, length = warmup + stable, length - stable
    progress = (step - start) / max(1, length)
    cosine = 0.5 * (1.0 + math.cos(math.pi * 2.0 * num_cycles * min(progress, 1.0)))
    return min_lr_ratio + (1.0 - min_lr_ratio) * cosine


@dataclass(frozen=True)
class LRSchedule:
    """A learning-rate schedule (``lr_multiplier``'s arguments); ``from_rl_optim`` / ``from_sft_optim`` read it
    from the keys verl's RL and SFT trainers give it."""

    style: str
    warmup: int
    total: int
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5

    @classmethod
    def from_rl_optim(cls, optim: DictConfig, total_steps: int) -> LRSchedule:
        """An actor / critic ``optim`` block: warmup_style, lr_warmup_steps(_ratio), min_lr_ratio, num_cycles."""
        style = str(optim.get("warmup_style", "constant"))
        if style not in WARMUP_STYLES:
            raise ArcherError(f"unknown optim.warmup_style {style!r}", f"use one of {', '.join(WARMUP_STYLES)}")
        return cls(style, warmup_steps(optim, total_steps), total_steps,
                   min_lr_ratio=float(optim.get("min_lr_ratio", 0.0) or 0.0),
                   num_cycles=float(optim.get("num_cycles", 0.5)))

    @classmethod
    def from_sft_optim(cls, optim: DictConfig, total_steps: int) -> LRSchedule:
        """The SFT trainer's ``optim`` block: lr_scheduler and a linear warmup over warmup_steps_ratio of the
        steps, decaying to 0 (transformers' schedules, as verl's SFT trainer uses them)."""
        if optim.lr_scheduler not in SFT_SCHEDULERS:
            raise ArcherError(f"optim.lr_scheduler={optim.lr_scheduler!r} is not known",
                              f"use one of {list(SFT_SCHEDULERS)}")
        return cls(str(optim.lr_scheduler), int(float(optim.warmup_steps_ratio) * total_steps), total_steps)

    def multiplier(self, step: int) -> float:
        return lr_multiplier(step, warmup=self.warmup, total=self.total, style=self.style,
                             min_lr_ratio=self.min_lr_ratio, num_cycles=self.num_cycles)


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:  # a plain function: the scheduler's state_dict stays steps and lrs only
        return schedule.multiplier(step)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


OPTIM_STATE = "optim_state.pt"


def save_optim_state(folder: Path, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Optimiser and scheduler state beside a checkpointed model."""
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, folder / OPTIM_STATE)


def load_optim_state(folder: Path, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                     device: torch.device) -> None:
    state = torch.load(folder / OPTIM_STATE, map_location=device, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
                  step: bool = True) -> tuple[float, bool]:
    """Clip gradients, step if the norm is finite (and ``step``); returns (grad_norm, stepped). Grads are zeroed."""
    grad_norm = clip_grad_norm(model, float(grad_clip) if grad_clip else None)  # sharded: the global norm
    stepped = step and math.isfinite(grad_norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped
