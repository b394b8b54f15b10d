"""bench/stage_mfu.py and the decode HBM bound of bench/rollout_throughput.py without a GPU: the bound by hand (it
reproduces issue 26's 23% and 39%), the workloads' rows, the tokens each micro-batching computes, the goal lines."""

from __future__ import annotations

import pytest
import torch
from bench_support import bench_module

from archer.models.micro_batches import MicroBatching
from archer.rollout.fast.model import ModelSpec


@pytest.fixture(scope="module")
def stage_mfu():
    with bench_module("stage_mfu") as module:
        yield module


def qwen_spec(hidden: int, layers: int, heads: int, inter: int) -> ModelSpec:
    return ModelSpec(model_type="qwen2", layers=layers, hidden=hidden, heads=heads, kv_heads=2,
                     head_dim=hidden // heads, intermediate=inter, vocab=151936, eps=1e-6, qkv_bias=True,
                     o_bias=False, qk_norm=False, tied=True)


def test_decode_hbm_bound_by_hand():
    with bench_module("rollout_throughput") as rt:
        half = qwen_spec(896, 24, 14, 4864)
        weights = 2 * (151936 * 896 + 896 + 24 * (2 * 896 + 1152 * 896 + 896 * 896 + 3 * 4864 * 896 + 1152))
        kv_per_token = 24 * 2 * 2 * 64 * 2  # layers x (k, v) x kv heads x head size x bf16
        step = weights + 128 * (256 + 256) * kv_per_token  # every row at the mean context 256 + 512 / 2
        bound = rt.decode_hbm_bound(half, 128, 256, 512, 3.35e12)
        assert bound == pytest.approx(128 * 3.35e12 / step)
        # issue 26's figures: 55k tokens/s at 0.5B is 23% of the bound, 35k at 1.5B is 39-41%
        assert 55_000 / bound == pytest.approx(0.23, abs=0.005)
        assert 35_000 / rt.decode_hbm_bound(qwen_spec(1536, 28, 12, 8960), 128, 256, 512, 3.35e12) == pytest.approx(
            0.405, abs=0.005)
        assert rt.hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12 and rt.hbm_bandwidth("NVIDIA H200") == 4.8e12
        assert rt.hbm_bandwidth("NVIDIA A100-SXM4-80GB") is None


def test_workload_rows(stage_mfu):
    grpo = stage_mfu.make_batch(stage_mfu.WORKLOADS["grpo"], vocab=1000)
    assert grpo["attention_mask"].shape == (128, 768) and bool(grpo["attention_mask"].all())
    work = stage_mfu.WORKLOADS["archer2"]
    batch = stage_mfu.make_batch(work, vocab=1000)
    mask = batch["attention_mask"]
    prompt, response = mask[:, :1024].sum(1), mask[:, 1024:].sum(1)
    assert mask.shape == (128, 2048) and bool((prompt >= 32).all()) and bool((response >= 1).all())
    assert torch.equal(prompt.view(16, 8), prompt.view(16, 8)[:, :1].expand(16, 8))  # one prompt, 8 responses
    assert 40 < float(response.float().mean()) < 500 and int((response == 1024).sum()) >= 1  # long-tailed, some cut
    assert int(mask.sum()) < mask.numel() // 3  # mostly padding when padded
    assert torch.equal(batch["responses"], batch["input_ids"][:, 1024:])
    # a row's tokens are one run: left-padded prompt, right-padded response
    assert bool((mask.diff(dim=1).clamp(max=0).sum(1) >= -1).all())


def test_tokens_computed_and_goal_lines(stage_mfu):
    mask = (torch.arange(10)[None, :] < torch.tensor([[3], [8], [5], [2]])).long()
    assert stage_mfu.tokens_computed(MicroBatching(2, None, packed=False), mask) == 2 * 8 + 2 * 5  # longest rows
    assert stage_mfu.tokens_computed(MicroBatching(2, None, packed=True), mask) == 18
    assert stage_mfu.tokens_computed(MicroBatching(None, 8, packed=True), mask) == 18
    tokens = {"tokens_computed": 18, "real_tokens": 18}
    records = [
        {"shape": "s", "workload": "w", "stage": "old_log_prob", "variant": "packed, planned budget", "seconds": 1.0,
         "mfu": 0.3, **tokens},
        {"shape": "s", "workload": "w", "stage": "update", "variant": "packed, 8 rows", "seconds": 5.0, "mfu": 0.1,
         **tokens},
        {"shape": "s", "workload": "w", "stage": "update", "variant": "packed, budget 9", "seconds": 4.0, "mfu": 0.16,
         **tokens},
        {"shape": "s", "workload": "w", "stage": "decode", "variant": "fast", "seconds": 1.0, "tokens": 10,
         "tokens_per_s": 40000.0, "hbm_fraction": 0.475},
    ]
    lines = stage_mfu.goals(records)
    assert lines[0].startswith("s w: old_log_prob 1.00 s = 0.25 of the fastest update epoch (packed, budget 9, 4.00 s")
    assert "best update 16.0%" in lines[1] and "40000 tok/s, 47.5% of the HBM bound" in lines[2]
    assert "| s | w | decode | fast | 10 (40000 tok/s) | 1.000 | 47.5% HBM |" in stage_mfu.table(records)


def test_repeated_runs_give_their_median_and_spread_and_the_table_shows_them(stage_mfu, monkeypatch):
    clock = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])  # runs of 3, 1 and 2 seconds
    monkeypatch.setattr(stage_mfu, "synced", lambda device: next(clock))
    calls = []
    result, median, spread, peak = stage_mfu.measure_repeated(torch.device("cpu"), lambda: calls.append(1) or len(calls),
                                                              3)
    assert (result, median, spread, peak) == (3, 2.0, {"min_s": 1.0, "max_s": 3.0, "runs": 3}, None)
    record = {"shape": "s", "workload": "w", "stage": "update", "variant": "v", "seconds": median, "mfu": 0.4,
              "tokens_computed": 9, "real_tokens": 9, **spread}
    assert "| s | w | update | v | 9 / 9 | 2.000 (1.000-3.000) | 40.0% |" in stage_mfu.table([record])
