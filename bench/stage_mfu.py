"""Per-stage efficiency of archer's RL step on one GPU, padded against packed side by side: the MFU of the no-grad
log-prob pass and of the update, and the decode's share of the HBM bound, for random models of Qwen2.5-0.5B's and
1.5B's shapes with Qwen's 151,936-row vocabulary (bench/gpu_step.py), on two workloads:

- ``grpo``: bench/grpo_vs_trl.py's (16 prompts of exactly 256 tokens x 8 responses of exactly 512; old log-probs in
  one pass as archer's defaults had it; update micro-batches of 32 rows, one mini-batch);
- ``archer2``: the Archer2.0 recipe's shapes on one of its two GPUs (examples/archer2_math_1.5b.sh: prompts and
  responses of up to 1024 tokens, 8 responses a prompt, mini-batches of 8 prompts x 8 a GPU, micro-batches of 8
  rows, ``log_prob_micro_batch_size_per_gpu=1``, the ASPO loss with a KL term, gradient checkpointing) with
  long-tailed lengths: 16 prompts of log-normal length (median 150 tokens) x 8 responses of exponential length
  (mean 400 tokens), both cut at 1024.

Each variant runs once on 16 rows (or two micro-batches) before it is timed ``--repeats`` times (3 by default: the
median is reported, with the fastest and slowest beside it; one run of the recipe's log-prob pass moved by 15%
between calls, 2026-11-29). Every stage runs archer's own worker code, an ActorWorker on the GPU
(``rollout.name=hf``: no engine holds memory beside it), with the micro-batching of each variant:

- old_log_prob (no grad): the workload's own micro-batches as archer ran them before (grpo: the whole batch in one
  padded pass; archer2: one sequence a pass, timed on 32 rows and scaled), and archer's default now: packed to
  the memory plan's token budget (workers/memory.py);
- update (one PPO epoch over the rows: forwards, backwards, optimiser steps): padded micro-batches of R rows,
  packed micro-batches of R rows, packed to a budget of R x the longest row (every layer checkpointed, and only the
  fewest layers whose activations 0.6 of the free memory holds: ``gradient_checkpointing_layers=auto``'s rule), and
  packed without gradient checkpointing at the largest budget that memory holds (``activation_bytes``);
  ``--profile`` prints torch.profiler's tables (kernel time against wall time) of the default log-prob pass and of
  the packed epoch of the workload's rows a micro-batch;
- ``--kernels``: ``compiled`` (archer's default on a GPU: ``actor.use_torch_compile=true``, the decoder layers
  compiled, archer/models/compiled_layers.py), ``eager`` (``use_torch_compile=false``: transformers' eager ops) or
  ``liger`` (``model.use_liger=true``, archer/models/liger.py);
- decode: archer's fast engine on the grpo workload's 128 rows (16 prompts shared by 8 samples each), its second
  call (the first one captures the CUDA graphs; its time is reported too).

MFU = model FLOPs / seconds / 989 TFLOP/s (H100 and H200 dense bf16), model FLOPs = 2 N D for a no-grad pass and
6 N D for the update (issue 26's convention): N the model's parameters, D the real tokens (prompt and response, no
padding); gradient checkpointing's second forward is not counted. HBM fraction: tokens/s over
``decode_hbm_bound`` (bench/rollout_throughput.py). Each variant also gives its peak GPU memory and, for the
no-grad passes, the largest log-prob difference from the workload's padded pass (bf16 rounding).

    python bench/stage_mfu.py --json /tmp/stage_mfu.json                       # GPU: both shapes and workloads
    python bench/stage_mfu.py --shapes tiny --workloads grpo archer2 --scale 8  # CPU: a smoke run, no MFU
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from gpu_step import QWEN_VOCAB, build_random_model
from rich.console import Console
from rollout_throughput import decode_hbm_bound, hbm_bandwidth

from archer.batch import Batch
from archer.config.loader import load_config
from archer.models.checkpointed_layers import checkpoint_first_layers
from archer.models.loading import load_tokenizer, set_gradient_checkpointing
from archer.models.micro_batches import MicroBatching
from archer.rollout.base import SamplingParams
from archer.rollout.fast import FastEngine
from archer.rollout.fast.model import model_spec
from archer.units import GIB
from archer.workers.actor import ActorWorker
from archer.workers.memory import activation_bytes, card_figures, plan_actor_memory

PEAK_FLOPS = 989e12  # dense bf16 of an H100 SXM (and of an H200)
ARCHER2_LOSS = (  # examples/archer2_math_1.5b.sh: what shapes the update's compute
    "actor_rollout_ref.actor.policy_loss.loss_mode=aspo", "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.token_entropy_quantile=0.8", "actor_rollout_ref.actor.high_entropy_clip_ratio_low=0.4",
    "actor_rollout_ref.actor.high_entropy_clip_ratio_high=0.4", "actor_rollout_ref.actor.optim.weight_decay=0.1")


@dataclass(frozen=True)
class Workload:
    """Rows (prompts x n) of prompts up to ``prompt`` and responses up to ``response`` tokens (exactly those, or
    long-tailed), the old log-prob pass's rows a micro-batch (None: all) and layout, the update's rows a
    micro-batch and prompts a mini-batch, and the config overrides of its loss."""

    name: str
    prompts: int
    n: int
    prompt: int
    response: int
    long_tailed: bool
    log_prob_rows: int | None
    remove_padding: bool  # how the old log-prob pass laid out its rows before it packed by tokens
    micro_rows: int
    mini_prompts: int
    overrides: tuple[str, ...]

    @property
    def rows(self) -> int:
        return self.prompts * self.n


WORKLOADS = {
    "grpo": Workload("grpo", 16, 8, 256, 512, False, None, False, 32, 16,
                     ("actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.entropy_coeff=0")),
    "archer2": Workload("archer2", 16, 8, 1024, 1024, True, 1, True, 8, 8, ARCHER2_LOSS),  # update: padded and packed
}


def make_batch(work: Workload, vocab: int, seed: int = 0) -> Batch:
    """The workload's rows: left-padded prompts (one length per prompt, shared by its n responses), right-padded
    responses, random token ids, and GRPO-like advantages (one value a row)."""
    gen = torch.Generator().manual_seed(seed)
    if work.long_tailed:
        prompt = torch.exp(math.log(150) + 0.6 * torch.randn(work.prompts, generator=gen)).long()
        prompt = prompt.clamp(32, work.prompt).repeat_interleave(work.n)
        response = (torch.empty(work.rows).exponential_(1 / 400, generator=gen).long() + 1).clamp(max=work.response)
    else:
        prompt = torch.full((work.rows,), work.prompt)
        response = torch.full((work.rows,), work.response)
    columns = torch.arange(work.prompt + work.response)
    attention = ((columns >= work.prompt - prompt[:, None]) & (columns < work.prompt + response[:, None])).long()
    input_ids = torch.randint(1, vocab, attention.shape, generator=gen) * attention
    response_mask = attention[:, work.prompt:]
    return Batch({"input_ids": input_ids, "attention_mask": attention,
                  "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "responses": input_ids[:, work.prompt:],
                  "response_mask": response_mask,
                  "advantages": torch.randn(work.rows, 1, generator=gen) * response_mask})


def synced(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def measure(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float, float | None]:
    """``fn()``, its seconds and its peak GPU memory in GiB (None on a CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = synced(device)
    result = fn()
    seconds = synced(device) - start
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    return result, seconds, peak


def measure_repeated(device: torch.device, fn: Callable[[], Any], repeats: int
                     ) -> tuple[Any, float, dict[str, Any], float | None]:
    """``fn()`` run ``repeats`` times: the last result, the median seconds, the spread ({"min_s", "max_s",
    "runs"}) and the highest peak GPU memory in GiB."""
    runs = [measure(device, fn) for _ in range(repeats)]
    seconds = [s for _, s, _ in runs]
    peaks = [p for _, _, p in runs if p is not None]
    spread = {"min_s": min(seconds), "max_s": max(seconds), "runs": len(seconds)}
    return runs[-1][0], statistics.median(seconds), spread, max(peaks) if peaks else None


def tokens_computed(micro: MicroBatching, attention_mask: torch.Tensor) -> int:
    """The positions the forwards of ``micro``'s micro-batches compute: padded, rows x the longest row (padded rows
    are left-aligned and cut to it, models/sequence_layout.py); packed, the real tokens."""
    return sum(int(micro.token_lengths(attention_mask[rows]).sum()) if micro.packed
               else len(rows) * int(attention_mask[rows].sum(dim=1).max()) for rows in micro.split(attention_mask))


def mfu(flops_per_token: float, tokens: int, seconds: float, device: torch.device) -> float | None:
    return flops_per_token * tokens / seconds / PEAK_FLOPS if device.type == "cuda" else None


def no_grad_rows(actor: ActorWorker, work: Workload, batch: Batch, device: torch.device, params: int,
                 console: Console, repeats: int, profile: bool) -> tuple[list[dict[str, Any]], Batch]:
    """The old log-prob pass: the workload's padded micro-batches and archer's default; returns the records and the
    batch with old log-probs (and, for a KL loss, reference log-probs) for the update. ``profile``: then
    torch.profiler's tables of archer's default."""
    real = int(batch["attention_mask"].sum())
    before = MicroBatching(work.log_prob_rows, None, packed=work.remove_padding)  # what archer ran before
    default = actor.log_prob_micro
    layout = "one sequence" if work.remove_padding else "padded"
    variants = [(f"{layout}, {work.log_prob_rows or 'all'} row(s) a pass", before),
                ("packed, planned budget", default)]
    records, logps = [], {}
    for name, micro in variants:
        actor.log_prob_micro = micro
        actor.compute_log_prob(batch.index(slice(0, 16)))  # warm-up: this layout's kernels, the allocator's blocks
        part = batch.index(slice(0, 32)) if micro.rows == 1 else batch  # one row a pass: timed on 32 rows
        out, seconds, spread, peak = measure_repeated(device, lambda part=part: actor.compute_log_prob(part), repeats)
        scale = len(batch) / len(part)
        logps[name] = out["old_log_probs"]
        record = {"stage": "old_log_prob", "variant": name, "micro": repr(micro), "seconds": seconds * scale,
                  "min_s": spread["min_s"] * scale, "max_s": spread["max_s"] * scale, "runs": spread["runs"],
                  "scaled_from_rows": len(part) if scale != 1 else None,
                  "tokens_computed": tokens_computed(micro, batch["attention_mask"]), "real_tokens": real,
                  "mfu": mfu(2 * params, real, seconds * scale, device), "peak_gib": peak}
        reference = logps[variants[0][0]]
        rows = min(len(reference), len(out["old_log_probs"]))
        mask = batch["response_mask"][:rows].bool()
        record["max_logp_diff"] = float((out["old_log_probs"][:rows] - reference[:rows])[mask].abs().max())
        records.append(record)
        console.log(record)
    actor.log_prob_micro = default
    if profile:
        profile_stage("the old log-prob pass, packed to the planned budget", lambda: actor.compute_log_prob(batch),
                      device)
    batch = batch.index(slice(0, len(batch)))
    set_update_inputs(batch, logps[variants[-1][0]])
    return records, batch


def set_update_inputs(batch: Batch, old_log_probs: torch.Tensor) -> None:
    """What the update reads beside the rows: the old log-probs, and reference log-probs 0.01 below them on the
    response tokens (so that a KL loss has a term to compute)."""
    batch["old_log_probs"] = old_log_probs
    batch["ref_log_prob"] = old_log_probs - 0.01 * batch["response_mask"]


def free_memory(device: torch.device) -> int:
    """Bytes this process may still take on the GPU: the card's free memory, or less under --card-gib."""
    free, total = torch.cuda.mem_get_info(device)
    allowed = torch.cuda.get_per_process_memory_fraction(device) * total - torch.cuda.memory_reserved(device)
    return int(min(free, allowed))


def update_rows(actor: ActorWorker, work: Workload, batch: Batch, device: torch.device, params: int,
                console: Console, profile: bool, repeats: int) -> list[dict[str, Any]]:
    """One PPO epoch over the rows with each micro-batching, and packed without checkpointing where memory allows;
    ``profile``: then torch.profiler's tables of the packed epoch of the workload's rows a micro-batch."""
    real = int(batch["attention_mask"].sum())
    longest = int(batch["attention_mask"].sum(1).max())
    budget = work.micro_rows * longest
    config = actor.model.config
    layers = config.num_hidden_layers
    variants = [(f"padded, {work.micro_rows} rows", MicroBatching(work.micro_rows, None, packed=False), layers),
                (f"packed, {work.micro_rows} rows", MicroBatching(work.micro_rows, None, packed=True), layers),
                (f"packed, budget {budget}", MicroBatching(None, budget, packed=True), layers)]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        room = 0.6 * free_memory(device)
        shape = {"hidden": config.hidden_size, "intermediate": config.intermediate_size, "layers": layers}
        fewest = next((k for k in range(layers + 1)
                       if activation_bytes(**shape, tokens=budget, checkpointed_layers=k) <= room), layers)
        if fewest < layers:  # gradient_checkpointing_layers=auto's choice at this budget, this room
            variants.append((f"packed, budget {budget}, {fewest} of {layers} layers checkpointed",
                             MicroBatching(None, budget, packed=True), fewest))
        fixed = activation_bytes(**shape, tokens=0, checkpointed_layers=0)  # the log-prob kernel's logit chunks
        fits = int((room - fixed) // (activation_bytes(**shape, tokens=1, checkpointed_layers=0) - fixed))
        if fits >= longest:
            variants.append((f"packed, budget {fits}, no checkpointing", MicroBatching(None, fits, packed=True), 0))
    records = []
    for name, micro, checkpointed in variants:
        actor.update_micro = micro
        set_gradient_checkpointing(actor.model, checkpointed > 0)
        if checkpointed:
            checkpoint_first_layers(actor.model, checkpointed)
        actor.update_actor(batch.index(slice(0, 2 * work.micro_rows)))  # warm-up, as for the no-grad passes
        out, seconds, spread, peak = measure_repeated(device, lambda: actor.update_actor(batch), repeats)
        record = {"stage": "update", "variant": name, "micro": repr(micro), "seconds": seconds, **spread,
                  "micro_batches": len(micro.split(batch["attention_mask"])),
                  "tokens_computed": tokens_computed(micro, batch["attention_mask"]), "real_tokens": real,
                  "mfu": mfu(6 * params, real, seconds, device), "peak_gib": peak,
                  "grad_norm": out.metrics.get("actor/grad_norm")}
        records.append(record)
        console.log(record)
    if profile:  # the workload's own rows a micro-batch, every layer checkpointed
        actor.update_micro = variants[1][1]
        set_gradient_checkpointing(actor.model, True)
        profile_stage(f"one update epoch, {variants[1][0]}", lambda: actor.update_actor(batch), device)
    set_gradient_checkpointing(actor.model, True)
    return records


def profile_stage(label: str, fn: Callable[[], Any], device: torch.device) -> None:
    """torch.profiler's table of one run of ``fn``: the kernels' time against the wall time, and where it goes."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = synced(device)
        fn()
        seconds = synced(device) - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"profile of {label}: {seconds:.3f} s wall, {sum(e.device_time for e in kernels) / 1e6:.3f} s in "
          f"{len(kernels)} kernels\n{prof.key_averages().table(sort_by=sort, row_limit=30)}\n"
          f"{prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=15)}", flush=True)


def decode_row(model: torch.nn.Module, tokenizer, device: torch.device, scale: int, console: Console
               ) -> dict[str, Any]:
    """The fast engine on the grpo workload's rows: 16 prompts of 256 tokens x 8 samples of 512 new tokens."""
    work = replace(WORKLOADS["grpo"], prompts=max(1, 16 // scale), prompt=256 // scale, response=512 // scale)
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, model.config.vocab_size, (work.prompts, work.prompt), generator=gen).tolist()
    engine = FastEngine(model, tokenizer, device=device, gpu_memory_utilization=0.25, max_num_seqs=work.rows,
                        max_model_len=work.prompt + work.response)
    params = SamplingParams(n=work.n, temperature=1.0, max_new_tokens=work.response, seed=0)
    _, first_s, _ = measure(device, lambda: engine.generate(prompts, params))
    out, seconds, peak = measure(device, lambda: engine.generate(prompts, params))
    tokens = int(out.response_mask.sum())
    record = {"stage": "decode", "variant": f"fast engine, {work.rows} rows ({work.prompts} prompts x {work.n})",
              "seconds": seconds, "first_call_seconds": first_s, "tokens": tokens, "tokens_per_s": tokens / seconds,
              "peak_gib": peak}
    bandwidth = hbm_bandwidth(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if bandwidth is not None:
        bound = decode_hbm_bound(model_spec(model), work.rows, work.prompt, work.response, bandwidth)
        record.update(hbm_bound_tokens_per_s=bound, hbm_fraction=tokens / seconds / bound)
    engine.release_memory(weights=True)
    console.log(record)
    return record


def build_actor(model_dir: Path, work: Workload, kernels: str, device: torch.device, tokenizer=None) -> ActorWorker:
    """archer's actor for ``work`` on ``device`` (``rollout.name=hf``: no engine beside it; ``kernels``: compiled,
    eager or liger), its no-grad budget from the card's memory plan on a GPU, as archer train makes it."""
    cfg = load_config("ppo_trainer", [
        f"actor_rollout_ref.model.path={model_dir}", "data.train_files=unused", "actor_rollout_ref.rollout.name=hf",
        f"actor_rollout_ref.rollout.n={work.n}", f"actor_rollout_ref.actor.ppo_mini_batch_size={work.mini_prompts}",
        f"data.max_prompt_length={work.prompt}", f"data.max_response_length={work.response}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={work.micro_rows}",
        f"actor_rollout_ref.model.use_liger={kernels == 'liger'}",
        f"actor_rollout_ref.actor.use_torch_compile={kernels == 'compiled'}", *work.overrides])
    actor = ActorWorker(cfg.actor_rollout_ref, device=device, total_steps=100,
                        tokenizer=tokenizer if tokenizer is not None else load_tokenizer(model_dir))
    if device.type == "cuda":
        total, elsewhere = card_figures(device)
        actor.plan_micro_batches(plan_actor_memory(cfg.actor_rollout_ref, actor.model, total=total,
                                                   fast_engine=False, elsewhere=elsewhere), announce=False)
    return actor


def run_shape(shape: str, workloads: list[str], args: argparse.Namespace, device: torch.device,
              console: Console) -> list[dict[str, Any]]:
    vocab = None if shape == "tiny" else QWEN_VOCAB
    model_dir = build_random_model(args.workdir, shape, vocab, dtype=torch.bfloat16,
                                   device=device.type if device.type == "cuda" else "cpu")
    tokenizer = load_tokenizer(model_dir)
    records: list[dict[str, Any]] = []
    for name in workloads:
        work = WORKLOADS[name]
        if args.scale > 1:  # a smoke run: fewer, shorter rows
            work = replace(work, prompts=max(1, work.prompts // args.scale), prompt=work.prompt // args.scale,
                           response=work.response // args.scale, micro_rows=max(1, work.micro_rows // args.scale))
        actor = build_actor(model_dir, work, args.kernels, device, tokenizer)
        params = sum(p.numel() for p in actor.model.parameters())
        batch = make_batch(work, actor.model.config.vocab_size)
        common = {"shape": shape, "workload": name, "rows": work.rows, "params": params,
                  "planned_no_grad_tokens": actor.log_prob_micro.max_tokens}
        console.log(f"{shape} / {name}: {work.rows} rows, {int(batch['attention_mask'].sum())} real tokens of "
                    f"{batch['attention_mask'].numel()} padded, no-grad budget {actor.log_prob_micro.max_tokens}")
        log_prob_records, batch = no_grad_rows(actor, work, batch, device, params, console, args.repeats, args.profile)
        updates = update_rows(actor, work, batch, device, params, console, args.profile, args.repeats)
        records += [{**common, **r} for r in log_prob_records + updates]
        if name == workloads[-1] and args.decode:
            records.append({**common, "workload": "grpo", **decode_row(actor.model, tokenizer, device, args.scale,
                                                                       console)})
        del actor
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def table(records: list[dict[str, Any]]) -> str:
    lines = ["| shape | workload | stage | variant | tokens computed / real | s (median; min-max) | "
             "MFU or HBM fraction | peak GiB | max dlogp |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        share = r.get("mfu") if r["stage"] != "decode" else r.get("hbm_fraction")
        share_text = "-" if share is None else f"{share:.1%}" + (" HBM" if r["stage"] == "decode" else "")
        tokens = (f"{r['tokens_computed']} / {r['real_tokens']}" if "tokens_computed" in r
                  else f"{r['tokens']} ({r['tokens_per_s']:.0f} tok/s)")
        peak = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.1f}"
        diff = f"{r['max_logp_diff']:.1e}" if "max_logp_diff" in r else ""
        scaled = f" (scaled from {r['scaled_from_rows']} rows)" if r.get("scaled_from_rows") else ""
        spread = f" ({r['min_s']:.3f}-{r['max_s']:.3f})" if r.get("runs", 1) > 1 else ""
        lines.append(f"| {r['shape']} | {r['workload']} | {r['stage']} | {r['variant']}{scaled} | {tokens} | "
                     f"{r['seconds']:.3f}{spread} | {share_text} | {peak} | {diff} |")
    return "\n".join(lines)


def goals(records: list[dict[str, Any]]) -> list[str]:
    """Issue 26's goals on these records: the no-grad pass against the update, MFU at 1.5B, the decode's share."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in records):
        for workload in dict.fromkeys(r["workload"] for r in records if r["shape"] == shape):
            rows = [r for r in records if r["shape"] == shape and r["workload"] == workload]
            packed_lp = next((r for r in rows if r["variant"] == "packed, planned budget"), None)
            updates = [r for r in rows if r["stage"] == "update"]
            if packed_lp and updates:
                best = min(updates, key=lambda r: r["seconds"])
                lines.append(f"{shape} {workload}: old_log_prob {packed_lp['seconds']:.2f} s = "
                             f"{packed_lp['seconds'] / best['seconds']:.2f} of the fastest update epoch "
                             f"({best['variant']}, {best['seconds']:.2f} s; goal <= 0.33)")
                if packed_lp.get("mfu") is not None:
                    lines.append(f"  MFU: old_log_prob {packed_lp['mfu']:.1%} (goal >= 50% at 1.5B), best update "
                                 f"{best['mfu']:.1%} (goal >= 40% at 1.5B)")
            for r in rows:
                if r["stage"] == "decode" and r.get("hbm_fraction") is not None:
                    lines.append(f"{shape} decode: {r['tokens_per_s']:.0f} tok/s, {r['hbm_fraction']:.1%} of the HBM "
                                 "bound (goal >= 50%)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["grpo", "archer2"])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/stage_mfu"))
    parser.add_argument("--scale", type=int, default=1, help="divide rows and lengths by this (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each variant (the median reported)")
    parser.add_argument("--no-decode", dest="decode", action="store_false", help="skip the decode stage")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's tables of the default log-prob "
                        "pass and of the packed update of the workload's rows a micro-batch")
    parser.add_argument("--kernels", choices=("compiled", "eager", "liger"), default="compiled",
                        help="compiled: archer's default on a GPU (actor.use_torch_compile=true); eager: "
                             "use_torch_compile=false; liger: model.use_liger=true (liger-kernel's fused RMSNorm, "
                             "SwiGLU and rotary kernels; they patch transformers for the whole process, so a run "
                             "measures one kind of kernels)")
    parser.add_argument("--card-gib", type=float, help="a GPU: let this process use only this much memory (80: an "
                        "H100's on a larger card; torch's per-process memory fraction), as the variants' room")
    parser.add_argument("--json", type=Path, help="write the records here")
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if args.card_gib and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(args.card_gib * GIB / torch.cuda.mem_get_info(device)[1], device)
    console = Console(stderr=True)
    common = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "transformers": transformers.__version__, "command": " ".join(["python", *sys.argv]),
              "kernels": args.kernels}
    records = []
    for shape in args.shapes:
        records += [{**common, **r} for r in run_shape(shape, args.workloads, args, device, console)]
        if args.json:  # after every shape, so a stopped run keeps what it measured
            args.json.write_text(json.dumps(records, indent=1))
    print(f"\n{common['device']}, torch {common['torch']}, transformers {common['transformers']}, {common['date']}, "
          f"{common['kernels']} RMSNorm / SwiGLU / rotary")
    print(table(records))
    print("\n".join(goals(records)))


if __name__ == "__main__":
    main()
