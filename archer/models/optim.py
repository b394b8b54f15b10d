"""Optimiser and learning-rate schedule from verl's ``optim`` config block (AdamW, warmup, constant/cosine)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import torch
from omegaconf import DictConfig

from archer.errors import ArcherError

WARMUP_STYLES = ("constant", "cosine")


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: DictConfig) -> torch.optim.AdamW:
    betas = tuple(optim.get("betas", (0.9, 0.999)))
    return torch.optim.AdamW(params, lr=float(optim.lr), betas=betas, weight_decay=float(optim.weight_decay))


def warmup_steps(optim: DictConfig, total_steps: int) -> int:
    """verl's rule: lr_warmup_steps unless negative (or null), else lr_warmup_steps_ratio * total_steps."""
    steps = optim.get("lr_warmup_steps", -1)
    if steps is not None and int(steps) >= 0:
        return int(steps)
    return int(float(optim.get("lr_warmup_steps_ratio", 0.0)) * total_steps)


def lr_multiplier(step: int, *, warmup: int, total: int, style: str, min_lr_ratio: float, num_cycles: float) -> float:
    """The factor applied to the base learning rate after ``step`` scheduler steps."""
    if warmup > 0 and step < warmup:
        return min_lr_ratio + (1.0 - min_lr_ratio) * step / warmup if style == "cosine" else step / warmup
    if style == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * 2.0 * num_cycles * min(progress, 1.0)))
    return min_lr_ratio + (1.0 - min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, optim: DictConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    style = str(optim.get("warmup_style", "constant"))
    if style not in WARMUP_STYLES:
        raise ArcherError(f"unknown optim.warmup_style {style!r}", f"use one of {', '.join(WARMUP_STYLES)}")
    warmup = warmup_steps(optim, total_steps)
    min_lr_ratio = float(optim.get("min_lr_ratio", 0.0) or 0.0)
    num_cycles = float(optim.get("num_cycles", 0.5))

    def factor(step: int) -> float:
        return lr_multiplier(step, warmup=warmup, total=total_steps, style=style, min_lr_ratio=min_lr_ratio,
                             num_cycles=num_cycles)

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
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = float(grad_clip) if grad_clip and grad_clip > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
    stepped = step and math.isfinite(grad_norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped
