"""The update epoch's and the no-grad log-prob pass's time against the token budget of a packed micro-batch, on one
GPU, for bench/stage_mfu.py's workloads and model shapes (its docstring): where the update's time goes when its
micro-batches are small. For each budget (``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``; packed rows):
seconds, micro-batches, MFU (6ND / 2ND over the seconds at 989 TFLOP/s, D the real tokens) and peak memory, with
gradient checkpointing and, for the smaller budgets, without. ``--profile`` adds torch.profiler's tables (by GPU
time and by CPU time) of the old-log-prob pass and of one checkpointed update epoch at 16,384 tokens.

    python bench/update_budgets.py --json /tmp/update_budgets.json             # eager RMSNorm / SwiGLU / rotary
    python bench/update_budgets.py --liger --json /tmp/update_budgets_liger.json   # use_liger=true (another process)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_step import QWEN_VOCAB, build_random_model
from stage_mfu import WORKLOADS, build_actor, make_batch, measure, mfu

from archer.models.loading import set_gradient_checkpointing
from archer.models.micro_batches import MicroBatching

LOG_PROB_BUDGETS = (16384, 32768, 65536)
CHECKPOINTED_BUDGETS = (4096, 8192, 16384, 32768, 65536)
UNCHECKPOINTED_BUDGETS = (8192, 16384)


def profile_tables(fn: Callable[[], Any], label: str) -> str:
    """torch.profiler's tables of ``fn()`` by GPU time and by CPU time, with the wall time."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    return (f"== {label}: {wall:.3f} s under the profiler\n"
            f"{averages.table(sort_by='self_device_time_total', row_limit=25)}\n"
            f"{averages.table(sort_by='self_cpu_time_total', row_limit=15)}\n")


def run_workload(name: str, model_dir: Path, args: argparse.Namespace, device: torch.device
                 ) -> tuple[list[dict], list[str]]:
    """The workload's records, and with ``--profile`` its profiler tables."""
    work = WORKLOADS[name]
    actor = build_actor(model_dir, work, args.liger, device)
    params = sum(p.numel() for p in actor.model.parameters())
    batch = make_batch(work, actor.model.config.vocab_size)
    mask = batch["response_mask"].float()
    batch["old_log_probs"], batch["ref_log_prob"] = -2.0 * mask, -2.01 * mask  # the loss's inputs, not its values
    real = int(batch["attention_mask"].sum())
    common = {"workload": name, "kernels": "liger" if args.liger else "eager", "real_tokens": real}
    records: list[dict] = []
    profiles: list[str] = []
    for budget in LOG_PROB_BUDGETS:
        actor.log_prob_micro = MicroBatching(None, budget, packed=True)
        actor.compute_log_prob(batch.index(slice(0, 16)))  # warm-up
        _, seconds, peak = measure(device, lambda: actor.compute_log_prob(batch))
        records.append({**common, "stage": "old_log_prob", "budget": budget, "seconds": seconds,
                        "mfu": mfu(2 * params, real, seconds, device), "peak_gib": peak})
        print(json.dumps(records[-1]), flush=True)
    if args.profile:
        profiles.append(profile_tables(lambda: actor.compute_log_prob(batch), f"{name} old_log_prob"))
    for checkpointing, budgets in ((True, CHECKPOINTED_BUDGETS), (False, UNCHECKPOINTED_BUDGETS)):
        set_gradient_checkpointing(actor.model, checkpointing)
        for budget in budgets:
            actor.update_micro = MicroBatching(None, budget, packed=True)
            record = {**common, "stage": "update", "checkpointing": checkpointing, "budget": budget,
                      "micro_batches": len(actor.update_micro.split(batch["attention_mask"]))}
            try:
                actor.update_actor(batch.index(slice(0, 16)))  # warm-up
                _, seconds, peak = measure(device, lambda: actor.update_actor(batch))
                record.update(seconds=seconds, mfu=mfu(6 * params, real, seconds, device), peak_gib=peak)
            except torch.OutOfMemoryError:
                record["out_of_memory"] = True
            torch.cuda.empty_cache()
            records.append(record)
            print(json.dumps(record), flush=True)
        if checkpointing and args.profile:
            actor.update_micro = MicroBatching(None, 16384, packed=True)
            profiles.append(profile_tables(lambda: actor.update_actor(batch), f"{name} update, 16384"))
    return records, profiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["archer2", "grpo"])
    parser.add_argument("--liger", action="store_true", help="actor_rollout_ref.model.use_liger=true")
    parser.add_argument("--profile", type=Path, help="write torch.profiler's tables here")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/update_budgets"))
    parser.add_argument("--json", type=Path, help="write the records here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/update_budgets.py measures a GPU: no CUDA device here")
    device = torch.device("cuda")
    model_dir = build_random_model(args.workdir, args.shape, QWEN_VOCAB, dtype=torch.bfloat16, device="cuda")
    records, profiles = [], []
    for name in args.workloads:
        measured, tables = run_workload(name, model_dir, args, device)
        records += [{"device": torch.cuda.get_device_name(), "shape": args.shape, **r} for r in measured]
        profiles += tables
        if args.json:  # after every workload, so a stopped run keeps what it measured
            args.json.write_text(json.dumps(records, indent=1))
    if args.profile:
        args.profile.write_text("".join(profiles))


if __name__ == "__main__":
    main()
