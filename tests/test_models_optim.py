"""Optimiser, warmup rule, learning-rate schedules and the clipped optimiser step, checked by hand."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from archer.errors import ArcherError
from archer.models.optim import (
    LRSchedule,
    allocate_adam_states,
    build_optimizer,
    build_scheduler,
    clip_and_step,
    lr_multiplier,
    warmup_steps,
)


def optim_cfg(**kw: object):
    base = {"lr": 0.1, "weight_decay": 0.01, "betas": [0.9, 0.999], "lr_warmup_steps": -1,
            "lr_warmup_steps_ratio": 0.0, "min_lr_ratio": 0.0, "num_cycles": 0.5, "warmup_style": "constant"}
    return OmegaConf.create({**base, **kw})


def test_constant_schedule_with_warmup() -> None:
    got = [lr_multiplier(s, warmup=4, total=10, style="constant", min_lr_ratio=0.5, num_cycles=0.5)
           for s in range(7)]
    # linear from 0 over 4 steps (min_lr_ratio does not apply to the constant style), then 1
    assert got == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert lr_multiplier(0, warmup=0, total=10, style="constant", min_lr_ratio=0.0, num_cycles=0.5) == 1.0


def test_cosine_schedule_with_warmup_and_min_lr_ratio() -> None:
    def f(step: int) -> float:
        return lr_multiplier(step, warmup=2, total=10, style="cosine", min_lr_ratio=0.1, num_cycles=0.5)

    # warmup: 0.1 + 0.9 * step / 2
    assert f(0) == pytest.approx(0.1)
    assert f(1) == pytest.approx(0.55)
    # decay over 8 steps: 0.1 + 0.9 * 0.5 * (1 + cos(pi * progress))
    assert f(2) == pytest.approx(1.0)
    assert f(4) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.sqrt(0.5)))  # progress 1/4
    assert f(6) == pytest.approx(0.55)  # progress 1/2
    assert f(10) == pytest.approx(0.1)  # progress 1
    assert f(13) == pytest.approx(0.1)  # held at the floor past the end


def test_cosine_full_cycle_and_no_warmup() -> None:
    def f(step: int) -> float:
        return lr_multiplier(step, warmup=0, total=8, style="cosine", min_lr_ratio=0.0, num_cycles=1.0)

    assert f(0) == pytest.approx(1.0)
    assert f(2) == pytest.approx(0.5)  # cos(pi / 2) = 0
    assert f(4) == pytest.approx(0.0)  # cos(pi) = -1
    assert f(8) == pytest.approx(1.0)  # cos(2 pi) = 1


@pytest.mark.parametrize(
    ("steps", "ratio", "total", "expected"),
    [
        (5, 0.5, 100, 5),  # an explicit count wins over the ratio
        (-1, 0.1, 100, 10),
        (-1, 0.25, 10, 2),  # int(2.5)
        (-1, 0.0, 100, 0),
        (None, 0.2, 50, 10),
        (0, 0.5, 100, 0),  # verl: 0 is an explicit count, not "use the ratio"
    ],
)
def test_warmup_steps_rule(steps: int | None, ratio: float, total: int, expected: int) -> None:
    assert warmup_steps(optim_cfg(lr_warmup_steps=steps, lr_warmup_steps_ratio=ratio), total) == expected


def test_build_optimizer_reads_lr_betas_and_weight_decay() -> None:
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], optim_cfg(lr=3e-4, betas=[0.8, 0.95], weight_decay=0.1))
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW)
    assert group["lr"] == 3e-4 and group["betas"] == (0.8, 0.95) and group["weight_decay"] == 0.1
    assert not group["fused"]  # parameters on the CPU: torch's default implementation


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_fused_optimiser_steps_as_the_default_one() -> None:
    torch.manual_seed(0)
    start = [torch.randn(64, 32, device="cuda"), torch.randn(32, device="cuda")]
    grads = [[torch.randn_like(t) for t in start] for _ in range(3)]
    results = []
    for fused in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = build_optimizer(params, optim_cfg(lr=1e-2)) if fused else torch.optim.AdamW(
            params, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)
        assert opt.param_groups[0]["fused"] is (True if fused else None)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach() for p in params])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_adam_states_allocated_up_front_step_as_the_lazy_ones(device: str) -> None:
    """Issue 44: the states made before the first step are the ones the first step would make (zeros, the step
    count's dtype and device); three steps give the same weights and state dict, bit for bit."""
    torch.manual_seed(0)
    start = [torch.randn(64, 32, device=device), torch.randn(32, device=device)]
    grads = [[torch.randn_like(t) for t in start] for _ in range(3)]
    results = []
    for up_front in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = build_optimizer(params, optim_cfg(lr=1e-2))
        if up_front:
            allocate_adam_states(opt)
            state = opt.state[params[0]]
            assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and not state["exp_avg"].any()
            assert state["exp_avg"].device == params[0].device and float(state["step"]) == 0.0
        else:
            assert not opt.state
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        results.append(([p.detach() for p in params], opt.state_dict()))
    (eager, eager_state), (lazy, lazy_state) = results
    for got, want in zip(eager, lazy, strict=True):
        assert torch.equal(got, want)
    for index, state in lazy_state["state"].items():
        for name, value in state.items():
            other = eager_state["state"][index][name]
            assert other.dtype == value.dtype and other.device == value.device and torch.equal(other, value)


def test_build_scheduler_drives_the_learning_rate() -> None:
    cfg = optim_cfg(lr=0.1, warmup_style="cosine", lr_warmup_steps_ratio=0.2, min_lr_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = build_scheduler(opt, LRSchedule.from_rl_optim(cfg, total_steps=10))  # 2 warmup steps
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(6):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.01, 0.055, 0.1, 0.1 * (0.1 + 0.45 * (1 + math.cos(math.pi / 8))),
                                 0.1 * (0.1 + 0.45 * (1 + math.sqrt(0.5))), 0.1 * (0.1 + 0.45 * (1 + math.cos(3 * math.pi / 8))),
                                 0.055])


def _lrs(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("name", ["cosine", "constant", "wsd"])
def test_sft_schedules_equal_transformers_schedules_bit_for_bit(name: str) -> None:
    """SFT's schedules (verl's SFT keys) are transformers' with warmup: the shared builder gives the same floats."""
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_wsd_schedule,
    )

    def sgd() -> torch.optim.SGD:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)

    for total in (1, 2, 7, 20, 101):
        for ratio in (0.0, 0.05, 0.1, 1 / 3, 0.5, 1.0):
            warmup = int(ratio * total)
            if name == "cosine":
                want = get_cosine_schedule_with_warmup(sgd(), warmup, total)
            elif name == "constant":
                want = get_constant_schedule_with_warmup(sgd(), warmup)
            else:
                decay = total - warmup - int((total - warmup) * 0.9)
                want = get_wsd_schedule(sgd(), warmup, decay, num_training_steps=total)
            schedule = LRSchedule.from_sft_optim(OmegaConf.create({"lr_scheduler": name, "warmup_steps_ratio": ratio}),
                                                 total)
            assert _lrs(build_scheduler(sgd(), schedule), total) == _lrs(want, total), (total, ratio)


def test_sft_schedule_refuses_an_unknown_scheduler() -> None:
    with pytest.raises(ArcherError, match="optim.lr_scheduler='linear' is not known"):
        LRSchedule.from_sft_optim(OmegaConf.create({"lr_scheduler": "linear", "warmup_steps_ratio": 0.1}), 10)


def test_build_scheduler_refuses_an_unknown_style() -> None:
    with pytest.raises(ArcherError, match="unknown optim.warmup_style 'linear'") as err:
        LRSchedule.from_rl_optim(optim_cfg(warmup_style="linear"), total_steps=10)
    assert "constant" in err.value.fix and "cosine" in err.value.fix


class Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([1.0, 1.0]))
        self.b = torch.nn.Parameter(torch.tensor([1.0]))
        self.frozen = torch.nn.Parameter(torch.tensor([5.0]))


def with_grads(ga: list[float], gb: list[float]) -> tuple[Two, torch.optim.SGD]:
    model = Two()
    model.a.grad = torch.tensor(ga)
    model.b.grad = torch.tensor(gb)
    return model, torch.optim.SGD(model.parameters(), lr=1.0)


def test_clip_and_step_clips_to_the_norm_and_steps() -> None:
    model, opt = with_grads([3.0, 0.0], [4.0])  # total norm 5
    norm, stepped = clip_and_step(model, opt, grad_clip=1.0)
    assert norm == pytest.approx(5.0) and stepped
    # gradients scaled by 1/5, then one SGD step with lr 1
    assert model.a.tolist() == pytest.approx([1.0 - 0.6, 1.0])
    assert model.b.tolist() == pytest.approx([1.0 - 0.8])
    assert model.frozen.tolist() == [5.0]
    assert model.a.grad is None and model.b.grad is None


def test_clip_and_step_leaves_small_gradients_alone_and_zero_clip_disables_clipping() -> None:
    model, opt = with_grads([0.3, 0.0], [0.4])
    norm, stepped = clip_and_step(model, opt, grad_clip=1.0)
    assert norm == pytest.approx(0.5) and stepped
    assert model.a.tolist() == pytest.approx([0.7, 1.0]) and model.b.tolist() == pytest.approx([0.6])

    model, opt = with_grads([3.0, 0.0], [4.0])
    norm, stepped = clip_and_step(model, opt, grad_clip=0.0)
    assert norm == pytest.approx(5.0) and stepped
    assert model.a.tolist() == pytest.approx([-2.0, 1.0]) and model.b.tolist() == pytest.approx([-3.0])


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_clip_and_step_skips_a_non_finite_gradient(bad: float) -> None:
    model, opt = with_grads([bad, 1.0], [1.0])
    norm, stepped = clip_and_step(model, opt, grad_clip=1.0)
    assert not stepped and not math.isfinite(norm)
    assert model.a.tolist() == [1.0, 1.0] and model.b.tolist() == [1.0]
    assert model.a.grad is None and model.b.grad is None


def test_clip_and_step_without_gradients() -> None:
    model = Two()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    assert clip_and_step(model, opt, grad_clip=1.0) == (0.0, True)
    assert model.a.tolist() == [1.0, 1.0]
