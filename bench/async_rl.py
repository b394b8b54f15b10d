"""Asynchronous RL against the synchronous loop (issue 25): tokens/s/GPU of whole GRPO steps, per trainer mode.

Each mode is one ``archer train`` run in a subprocess, exactly what a user runs, at the Qwen2.5-1.5B shape with Qwen's
real 151,936-row vocabulary (bench/gpu_step.py's random model and small tokenizer), prompts of exactly
``--prompt-length`` tokens and responses of up to ``--response-length``. A random model never samples its eos
token, so the fast engine ends each response at a length drawn for it (``ARCHER_SIMULATED_LENGTHS``,
archer/rollout/fast/simulated_lengths.py): lognormal with median ``--median-fraction`` of the limit and a shape
that puts ``--at-limit`` of the responses at the limit (a real reasoning run's long tail). Modes:

- ``sync``: archer's default loop (generate, then train, each step);
- ``colocate_async``: trainer.v1.trainer_mode=colocate_async with ``--warmup`` batches generated ahead and
  ``max_off_policy_threshold=--threshold`` (partial rollouts on);
- ``separate_async``: trainer.v1.trainer_mode=separate_async, ``--rollout-gpus`` of the run's ``--gpus`` generate
  (the rest train) with ``--separate-warmup`` batches admitted ahead, the weights broadcast every step.

``--recipe arpo`` runs ARPO's rollout instead of GRPO's (``initial_rollouts`` n / 2, beam 2, branch probability
0.5 + 0.2 dH, 3 calls at most): the responses' turns are scripted (``ARCHER_SIMULATED_TURNS``,
archer/rollout/simulated_turns.py: the same long-tailed lengths, ``--tool-rate`` of the first turns and 0.3 of later
ones ending in a ``<python>`` call) and the Python tool is bench/agentic_rollout.py's stand-in, which answers after
the latencies archer's sandbox took (0.12-1.3 s, times ``--tool-latency-scale``).

Each mode runs in each ``--variants``: ``plain`` (archer's defaults: padded micro-batches of ``--micro-batch``
rows) and ``packed`` (``use_remove_padding`` and ``use_dynamic_bsz``: the update's micro-batches packed to
ppo_max_token_len_per_gpu tokens, no padding computed).

    python bench/async_rl.py                                    # both modes, one GPU each, side by side
    python bench/async_rl.py --variants plain,packed            # 4 runs side by side on 4 GPUs
    python bench/async_rl.py --gpus 4 --prompts 32              # 4 ranks per run (one run at a time)
    python bench/async_rl.py --gpus 4 --modes sync,separate_async --rollout-gpus 2   # 2 train, 2 generate
    python bench/async_rl.py --gpus 4 --prompts 32 --recipe arpo --modes sync,separate_async --rollout-gpus 1
    python bench/async_rl.py --tiny --steps 3                   # CPU: the tiny model, a smoke test

Per mode, from the run's own metrics.jsonl, over the steps after the first (warm-up, and for the async modes the
step that generates the warm-up batches): the mean step time, the stage times, tokens/s/GPU (the trained
sequences' prompt and response tokens, ``perf/total_num_tokens``, over the step time and GPUs) and the model
FLOPs utilisation of the step (8 N per trained token: the update's 6 N and the old-log-prob pass's 2 N, plus
2 N per generated token, over the GPUs' bf16 peak; attention left out). The records go to ``--out`` (JSON) and
a table is printed with each async mode's speed-up over sync.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import NormalDist
from typing import Any

import torch
from model_sizes import archer_command, failure
from scale_out import gpu_name, measure, read_metrics, workload_files

from archer.rollout.fast.simulated_lengths import ENV
from archer.rollout.simulated_turns import ENV as TURNS_ENV

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
VARIANTS = {"plain": [], "packed": ["actor_rollout_ref.model.use_remove_padding=true",
                                    "actor_rollout_ref.actor.use_dynamic_bsz=true"]}
QWEN_VOCAB = 151_936
PARAMS_1_5B = 1.54e9  # Qwen2.5-1.5B's parameters (embeddings included)
H100_BF16_FLOPS = 989e12  # dense bf16 peak of an H100 SXM


def length_env(args: argparse.Namespace) -> tuple[str, str]:
    """The script of the responses, (variable, value): a lognormal with median at ``median_fraction`` of the limit
    and a shape such that ``at_limit`` of the draws reach it. Plain: ``ARCHER_SIMULATED_LENGTHS``; arpo:
    ``ARCHER_SIMULATED_TURNS``, whose turns also call the tool (``--tool-rate`` of the first turns)."""
    median = args.response_length * args.median_fraction
    sigma = math.log(args.response_length / median) / NormalDist().inv_cdf(1 - args.at_limit)
    if args.recipe == "arpo":
        return TURNS_ENV, (f"median={median:g},sigma={sigma:.4f},limit={args.response_length},"
                           f"tool_rate={args.tool_rate}")
    return ENV, f"prompt={args.prompt_length},median={median:g},sigma={sigma:.4f}"


def recipe_overrides(args: argparse.Namespace) -> list[str]:
    """arpo: ARPO's rollout (bench/agentic_rollout.py's arpo_tools row) with the Python tool's stand-in, which
    answers after the latencies archer's sandbox took; plain: nothing."""
    if args.recipe != "arpo":
        return []
    tool = "+actor_rollout_ref.rollout.tools.tool_instances.python"
    return [f"{tool}.class_path=agentic_rollout.SandboxLatency", f"{tool}.params.scale={args.tool_latency_scale}",
            "actor_rollout_ref.rollout.tools.call_limit=3", f"actor_rollout_ref.rollout.initial_rollouts={args.n // 2}",
            "actor_rollout_ref.rollout.beam_size=2", "actor_rollout_ref.rollout.branch_probability=0.5",
            "actor_rollout_ref.rollout.entropy_weight=0.2"]


MODES = ("sync", "colocate_async", "separate_async")


def mode_overrides(mode: str, args: argparse.Namespace) -> list[str]:
    trainer_gpus = args.gpus - args.rollout_gpus if mode == "separate_async" else args.gpus
    common = [f"trainer.n_gpus_per_node={trainer_gpus}", "actor_rollout_ref.rollout.name=fast",
              *(["trainer.device=cpu"] if args.tiny else [])]
    if mode == "sync":
        return common
    if mode == "separate_async":  # the bench's mini-batch is the whole batch: one sync a step is one mini-batch
        return [*common, "trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.nnodes=1",
                f"actor_rollout_ref.rollout.n_gpus_per_node={args.rollout_gpus}",
                f"trainer.v1.separate_async.num_warmup_batches={args.separate_warmup}",
                "trainer.v1.separate_async.parameter_sync_step=1",
                f"trainer.v1.sampler.max_off_policy_threshold={max(args.threshold, args.separate_warmup + 1)}"]
    return [*common, "trainer.v1.trainer_mode=colocate_async",
            f"trainer.v1.colocate_async.num_warmup_batches={args.warmup}",
            f"trainer.v1.sampler.max_off_policy_threshold={args.threshold}"]


def launch(args: argparse.Namespace, work: argparse.Namespace, files: tuple[Path, Path, Path], mode: str,
           variant: str, device: int | None) -> tuple[subprocess.Popen, Path, list[str]]:
    out = args.workdir / f"{mode}_{variant}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    overrides = mode_overrides(mode, args) + VARIANTS[variant] + recipe_overrides(args) + args.archer_override
    cmd = archer_command(work, *files, overrides, out / "run")
    variable, value = length_env(args)
    env = {**os.environ, variable: value}
    if args.recipe == "arpo":  # the ranks import the tool's stand-in from bench/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH")) if p)
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(device)
    log = (out / "train.log").open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True), out, cmd


def mfu(record: dict[str, Any], gpus: int) -> float | None:
    """The step's model FLOPs utilisation (see the module docstring); None without the token counts."""
    stages = record["stages_s"]
    if "response_length/mean" not in record:
        return None
    tokens = record["tokens"][-1]
    generated = record["response_length/mean"] * record["responses"]
    flops = 8 * PARAMS_1_5B * tokens + 2 * PARAMS_1_5B * generated
    return flops / (record["timed_step_s"] * gpus * H100_BF16_FLOPS) if stages else None


def collect(out: Path, mode: str, variant: str, cmd: list[str], code: int, args: argparse.Namespace
            ) -> dict[str, Any]:
    lines = read_metrics(out / "run")
    record: dict[str, Any] = {"mode": mode, "variant": variant, "gpus": args.gpus, "ran": False,
                              "archer_command": " ".join(["python", *cmd[1:]])}
    if code != 0 or len(lines) < 2:
        return {**record, "error": failure((out / "train.log").read_text()) if code else "fewer than 2 steps",
                "log": str(out / "train.log")}
    timed = lines[1:]
    record.update(ran=True, **measure(lines))
    record["tokens_per_s_per_gpu"] = record["tokens_per_s"] / args.gpus
    for key in ("response_length/mean", "response_length/clip_ratio", "training/off_policy/trajectory_staleness/mean",
                "training/off_policy/trajectory_spans/max", "async/paused_requests", "async/resumed_requests",
                "async/generation_s"):
        values = [line[key] for line in timed if key in line]
        if values:
            record[key] = sum(values) / len(values)
    record["responses"] = args.prompts * args.n
    if not args.tiny:
        record["mfu"] = mfu(record, args.gpus)
    return record


def table(records: list[dict[str, Any]]) -> str:
    """One row per run; "vs sync" against the sync run of the same variant."""
    sync = {r["variant"]: r for r in records if r["mode"] == "sync" and r["ran"]}
    rows = ["| mode | variant | GPUs | step | tokens/s/GPU | vs sync | MFU | gen | old_log_prob | update_actor | "
            "weight sync | staleness | response length |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if not r["ran"]:
            rows.append(f"| {r['mode']} | {r['variant']} | {r['gpus']} | not run: {r['error']} | | | | | | | | | |")
            continue
        s = r["stages_s"]
        base = sync.get(r["variant"])
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        share = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        rows.append(f"| {r['mode']} | {r['variant']} | {r['gpus']} | {r['timed_step_s']:.2f} s | "
                    f"{r['tokens_per_s_per_gpu']:,.0f} | "
                    f"{ratio} | {share} | {s.get('gen', 0):.2f} s | {s.get('old_log_prob', 0):.2f} s | "
                    f"{s.get('update_actor', 0):.2f} s | "
                    + (f"{s['update_weights']:.3f} s | " if "update_weights" in s else "- | ")
                    + f"{r.get('training/off_policy/trajectory_staleness/mean', 0):.2f} | "
                    f"{r.get('response_length/mean', 0):.0f} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="sync,colocate_async", help=f"modes, from {','.join(MODES)}")
    parser.add_argument("--variants", default="plain", help=f"variants, from {','.join(VARIANTS)}")
    parser.add_argument("--gpus", type=int, default=1, help="ranks per run; with 1 and several GPUs visible the "
                        "modes run side by side, one GPU each")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (data.train_batch_size)")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompt-length", type=int, default=1024)
    parser.add_argument("--response-length", type=int, default=2048, help="the response limit")
    parser.add_argument("--median-fraction", type=float, default=0.25, help="median response / the limit")
    parser.add_argument("--at-limit", type=float, default=0.05, help="share of responses that reach the limit")
    parser.add_argument("--micro-batch", type=int, default=8, help="ppo_micro_batch_size_per_gpu")
    parser.add_argument("--warmup", type=int, default=2, help="colocate_async: num_warmup_batches")
    parser.add_argument("--threshold", type=int, default=2, help="colocate_async: max_off_policy_threshold")
    parser.add_argument("--rollout-gpus", type=int, default=None,
                        help="separate_async: of --gpus, how many generate (default half, at least 1)")
    parser.add_argument("--separate-warmup", type=int, default=1, help="separate_async: num_warmup_batches")
    parser.add_argument("--recipe", choices=("plain", "arpo"), default="plain",
                        help="plain: GRPO; arpo: ARPO's tool-calling rollout with branches (scripted turns)")
    parser.add_argument("--tool-rate", type=float, default=0.5, help="arpo: share of first turns that call the tool")
    parser.add_argument("--tool-latency-scale", type=float, default=1.0,
                        help="arpo: the tool's stand-in answers after the sandbox's latencies times this")
    parser.add_argument("--steps", type=int, default=5, help="steps per mode (the first is left out)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (trainer.device=cpu)")
    parser.add_argument("--out", type=Path, help="the JSON records (default: bench/results/async_rl_<device>.json)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench_async_rl"))
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds one mode may run")
    parser.add_argument("--archer-override", nargs="*", default=[], help="more archer train overrides, every run")
    return parser


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes {args.modes!r}: choose from {','.join(MODES)}")
    args.rollout_gpus = max(1, args.gpus // 2) if args.rollout_gpus is None else args.rollout_gpus
    if "separate_async" in modes and not 1 <= args.rollout_gpus < args.gpus:
        parser.error(f"separate_async needs --gpus 2 or more with 1 <= --rollout-gpus < --gpus (got --gpus "
                     f"{args.gpus}, --rollout-gpus {args.rollout_gpus})")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants {args.variants!r}: choose from {','.join(VARIANTS)}")
    if args.steps < 2:
        parser.error("--steps must be 2 or more (the first is left out)")
    visible = torch.cuda.device_count()
    if not args.tiny and visible < args.gpus:
        parser.error(f"{args.gpus} GPU(s) per run, {visible} visible (on a CPU, run with --tiny)")
    shape = "tiny" if args.tiny else "qwen2.5-1.5b"
    if args.tiny:
        args.prompt_length, args.response_length, args.micro_batch = 32, 128 if args.recipe == "arpo" else 32, 4
    work = argparse.Namespace(shape=shape, prompts=args.prompts, n=args.n, prompt_length=args.prompt_length,
                              response_length=args.response_length, micro_batch=args.micro_batch,
                              vocab=None if args.tiny else QWEN_VOCAB, steps=args.steps, out=args.workdir)
    device = "cpu" if args.tiny else gpu_name()
    slug = "".join(c if c.isalnum() else "_" for c in device.lower()).strip("_")
    args.out = args.out or RESULTS / f"async_rl_{slug}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    from rich.console import Console

    files = workload_files(args.workdir, work, args.prompts * (args.steps + args.warmup + 1), Console(stderr=True))
    runs = [(mode, variant) for variant in variants for mode in modes]
    side_by_side = not args.tiny and args.gpus == 1 and visible >= len(runs)
    common = {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "command": " ".join(["python", "bench/async_rl.py", *argv]), "lengths": "=".join(length_env(args)),
              "recipe": args.recipe,
              **{k: getattr(args, k) for k in ("prompts", "n", "prompt_length", "response_length", "warmup",
                                               "threshold", "steps", "rollout_gpus", "separate_warmup")}}
    records = []
    batches = [runs] if side_by_side else [[run] for run in runs]
    for batch in batches:
        started = [(mode, variant, *launch(args, work, files, mode, variant, i if side_by_side else None))
                   for i, (mode, variant) in enumerate(batch)]
        for mode, variant, proc, out, cmd in started:
            try:
                code = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                code = proc.wait()
            record = {**common, **collect(out, mode, variant, cmd, code, args)}
            records.append(record)
            print(f"{mode} ({variant}): " + (f"{record['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU" if record["ran"]
                                 else f"not run: {record['error']}"), flush=True)
            args.out.write_text(json.dumps(records, indent=1))
    print(f"\n{shape}: {args.prompts} prompts x {args.n}, prompt {args.prompt_length}, responses up to "
          f"{args.response_length} ({length_env(args)}), {args.steps} steps (first left out) on {device}, "
          f"{'side by side' if side_by_side else 'one after another'}")
    print(table(records))
    print(f"records: {args.out}")
    return records


if __name__ == "__main__":
    main()
