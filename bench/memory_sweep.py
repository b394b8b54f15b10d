"""Issue 44's memory sweep: every configuration either trains its steps at archer's defaults or is refused at start
with figures and a fix; none stops later. One GPU (the record names it: an 80 GB H100 is the
card the issue asks about).

Each row is a randomly initialised model of a real shape and vocabulary (bench/grpo_vs_trl.py's models and
prompts of exactly ``prompt`` tokens) training GRPO on 16 prompts x 8 for ``--steps`` steps at archer's defaults:
no micro-batch key (the memory plan chooses), default gpu_memory_utilization, the row's layout (padded, or packed
with use_remove_padding and use_dynamic_bsz), trainer mode (sync or colocate_async) and tools (off, or ARPO's
rollout with the Python tool's latency stand-in, bench/async_rl.py). Responses end at lengths drawn from a long
tail (``ARCHER_SIMULATED_LENGTHS``: median a quarter of the limit, 5% at it), since a random model never stops.

    python bench/memory_sweep.py --out /tmp/sweep --json bench/results/memory_sweep.json            # the grid
    python bench/memory_sweep.py --out /tmp/sweep --rows qwen2.5-1.5b:1536:512:padded:sync:off      # one row

Issue 44's own run (a real dataset's prompts, the issue's micro-batch key, every response at the limit):

    python bench/memory_sweep.py --out /tmp/first --rows qwen2.5-1.5b:1536:512:padded:sync:off \
        --train-file train_10k.parquet --full-length --set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8

Per row: ``ran`` (steps done), ``refused`` (stopped before step 1 with archer's one error: a fix, not a failure)
or ``failed`` (stopped after step 1: what the plan guarantees never happens), the peak allocated memory of each
stage (GiB), the KV cache the engine got each step (``perf/kv_cache_gb``) and the step times.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
from pathlib import Path
from typing import Any

import torch
from async_rl import length_env, recipe_overrides
from grpo_vs_trl import prepare_workload, workload_args
from model_sizes import BIG, LORA, archer_command, run

SHAPES = {"tiny": [], "qwen2.5-0.5b": [], "qwen2.5-1.5b": [], "qwen2.5-3b": [], "qwen2.5-7b": LORA}
LAYOUTS = {"padded": [], "packed": ["actor_rollout_ref.model.use_remove_padding=true",
                                    "actor_rollout_ref.actor.use_dynamic_bsz=true"]}
MODES = {"sync": [], "colocate_async": ["trainer.v1.trainer_mode=colocate_async"]}
STAGES = ("gen", "old_log_prob", "adv", "update_actor")
# "tiny" checks the bench on a CPU; the grid: the real shapes x (prompt, response) pairs x layouts x modes x tools; --rows names others
PAIRS = ((256, 512), (1536, 512), (1024, 2048), (4096, 1024), (1024, 8192))


def parse_row(name: str) -> dict[str, Any]:
    shape, prompt, response, layout, mode, tools = name.split(":")
    if shape not in SHAPES or layout not in LAYOUTS or mode not in MODES or tools not in ("off", "on"):
        raise SystemExit(f"bad row {name!r}: SHAPE:PROMPT:RESPONSE:padded|packed:sync|colocate_async:off|on")
    return {"name": name, "shape": shape, "prompt": int(prompt), "response": int(response), "layout": layout,
            "mode": mode, "tools": tools}


def grid() -> list[str]:
    return [f"{shape}:{p}:{r}:{layout}:{mode}:{tools}" for shape, (p, r), layout, mode, tools in
            itertools.product([s for s in SHAPES if s != "tiny"], PAIRS, LAYOUTS, MODES, ("off", "on"))]


def row_overrides(row: dict[str, Any], settings: list[str]) -> list[str]:
    """The row's settings beyond bench/grpo_vs_trl.py's workload: no micro-batch key, its layout, mode, tools;
    then ``settings`` (KEY=VALUE), each replacing an earlier value of its key."""
    tools = argparse.Namespace(recipe="arpo" if row["tools"] == "on" else "plain", n=8, tool_latency_scale=1.0)
    overrides = [*SHAPES[row["shape"]], *LAYOUTS[row["layout"]], *MODES[row["mode"]], *recipe_overrides(tools),
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "trainer.balance_batch=false"]
    keys = {setting.partition("=")[0] for setting in settings}
    return [o for o in overrides if o.partition("=")[0] not in keys] + settings


def outcome(lines: list[dict[str, Any]], ok: bool, error: str, steps: int) -> str:
    if ok and len(lines) == steps:
        return "ran"
    return "refused" if not lines and error else "failed"


def sweep_row(args: argparse.Namespace, row: dict[str, Any]) -> dict[str, Any]:
    out = args.out / row["name"].replace(":", "_")
    out.mkdir(parents=True, exist_ok=True)
    work = workload_args(row["shape"], steps=args.steps, out=out)
    work.prompt_length, work.response_length = row["prompt"], row["response"]
    big = row["shape"] in BIG and torch.cuda.is_available()
    model_dir, _, train_file, reward = prepare_workload(out, work, work.prompts * args.steps,
                                                        **({"dtype": torch.bfloat16, "device": "cuda"} if big else {}))
    if args.train_file:  # a real dataset: its prompts past the row's length are dropped, as a user's run drops them
        train_file = args.train_file.resolve()
    settings = [*args.set, *(["data.filter_overlong_prompts=true"] if args.train_file else [])]
    cmd = archer_command(work, model_dir, train_file, reward, row_overrides(row, settings), out / "run")
    lengths = argparse.Namespace(response_length=row["response"], median_fraction=0.25, at_limit=0.05,
                                 prompt_length=row["prompt"], tool_rate=0.5,
                                 recipe="arpo" if row["tools"] == "on" else "plain")
    variable, value = length_env(lengths)
    if not args.full_length:
        os.environ[variable] = value
    bench = str(Path(__file__).resolve().parent)  # the tools' stand-in is imported from bench/ by the run
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (bench, os.environ.get("PYTHONPATH")) if p)
    ok, error = run(cmd, out / "train.log", args.row_timeout)
    os.environ.pop(variable, None)
    metrics = out / "run" / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    record = {**row, "command": " ".join(["python", *cmd[1:]]),
              "lengths": "every response at the limit" if args.full_length else f"{variable}={value}",
              "outcome": outcome(lines, ok, error, args.steps), "steps_done": len(lines), "error": error}
    if lines:
        record.update({
            "peak_allocated_gb": {s: max(line.get(f"perf/max_memory_allocated_gb/{s}", 0.0) for line in lines)
                                  for s in STAGES},
            "max_memory_allocated_gb": [line.get("perf/max_memory_allocated_gb") for line in lines],
            "kv_cache_gb": [line.get("perf/kv_cache_gb") for line in lines],
            "step_s": [line["timing_s/step"] for line in lines],
            "response_length_mean": [line.get("response_length/mean") for line in lines]})
    return record


def table(records: list[dict[str, Any]]) -> str:
    head = ("| row | outcome | steps | peak GiB gen / old log-prob / update | KV cache GiB (steps) | note |\n"
            "|---|---|---|---|---|---|")
    body = []
    for r in records:
        peak = r.get("peak_allocated_gb", {})
        peaks = " / ".join(f"{peak.get(s, 0):.1f}" for s in ("gen", "old_log_prob", "update_actor")) if peak else ""
        kv = ", ".join(f"{v:.1f}" for v in r.get("kv_cache_gb", []) if v is not None)
        note = r["error"][:120] if r["outcome"] != "ran" else ""
        body.append(f"| {r['name']} | {r['outcome']} | {r['steps_done']} | {peaks} | {kv} | {note} |")
    return "\n".join([head, *body])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", nargs="*", help="SHAPE:PROMPT:RESPONSE:LAYOUT:MODE:TOOLS (default: the grid)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--row-timeout", type=float, default=900)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--train-file", type=Path, help="a parquet of prompts to train on instead of the "
                        "exact-length ones (data.filter_overlong_prompts drops those past the row's length)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="settings past the row's")
    parser.add_argument("--full-length", action="store_true", help="no simulated lengths: every response runs "
                        "to the limit, as a random model's do")
    args = parser.parse_args()
    records = []
    for name in args.rows or grid():
        records.append(sweep_row(args, parse_row(name)))
        print(table(records[-1:]).splitlines()[-1], flush=True)
        if args.json:
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "device": device,
                                             "steps": args.steps,
                                             "rows": records}, indent=1))
    print(table(records))


if __name__ == "__main__":
    main()
