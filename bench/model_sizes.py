"""The seeds' model sizes on one GPU: which run, with which settings, in how much memory, how fast (issue 14).

For each row, a randomly initialised model of a real shape with its real vocabulary (Qwen2.5: 151,936 rows;
LLaMA 3.1: 128,256; a small BPE tokenizer padded to it, as bench/grpo_vs_trl.py builds it) trains GRPO for
``--steps`` steps of bench/grpo_vs_trl.py's workload (16 prompts of 256 tokens x 8 samples of 512 new tokens,
micro-batches of 32), at archer's defaults plus the row's settings. A row whose config archer refuses (``archer
train --cfg job``: LoRA before it lands, say) or whose run fails is reported as "not run: <the error>", and the
bench goes on. TRL's GRPOTrainer runs the same workload for the rows that name it (bench/grpo_vs_trl.py, same
machine, same run), with gradient checkpointing as archer's defaults (and TRL's) have it.

    python bench/model_sizes.py --out /tmp/ms                                  # every row (a GPU)
    python bench/model_sizes.py --out /tmp/ms --rows qwen2.5-0.5b --peers archer  # one row, archer alone

The row "qwen2.5-1.5b+offload" runs the 1.5B shape with optimizer_offload and param_offload: against the 1.5B
row at defaults it prices the two offloads; "qwen2.5-1.5b+remove_padding" times padding-free micro-batches.

Per row: whether it ran, its settings, the steady step time (median of the steps after the first), the peak GPU
memory (allocated) of each stage and of the step, and TRL's step and peak; ``--json`` gets the records (rows of
an existing file that this run does not redo are kept) and ``--markdown`` the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from grpo_vs_trl import archer_overrides, prepare_workload, steady, workload_args

LORA = ["actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.model.lora_alpha=32"]
OFFLOAD = ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]
BOTH_OFFLOADS = [*OFFLOAD, "actor_rollout_ref.actor.fsdp_config.param_offload=true"]
# row: (shape, archer's settings beyond its defaults, whether TRL runs it too); "+offload" rows price the offloads
ROWS: dict[str, tuple[str, list[str], bool]] = {
    "qwen2.5-0.5b": ("qwen2.5-0.5b", [], True),
    "qwen2.5-1.5b": ("qwen2.5-1.5b", [], True),
    "qwen2.5-1.5b+offload": ("qwen2.5-1.5b", BOTH_OFFLOADS, False),
    "qwen2.5-1.5b+remove_padding": ("qwen2.5-1.5b", ["actor_rollout_ref.model.use_remove_padding=true"], False),
    "qwen2.5-3b": ("qwen2.5-3b", OFFLOAD, False),
    "qwen2.5-7b": ("qwen2.5-7b", LORA, False),
    "llama-3.1-8b": ("llama-3.1-8b", LORA, False),
}
STAGES = ("gen", "old_log_prob", "adv", "update_actor")
BIG = ("qwen2.5-3b", "qwen2.5-7b", "llama-3.1-8b")  # stored in bf16 and drawn on the GPU (archer loads float32)


def archer_command(args: argparse.Namespace, model_dir: Path, train_file: Path, reward: Path, settings: list[str],
                   run: Path) -> list[str]:
    return [sys.executable, "-m", "archer.cli", "train", *archer_overrides(args, model_dir, train_file, reward),
            *settings, f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false",
            "trainer.test_freq=-1", "trainer.save_freq=-1", f"trainer.default_local_dir={run}",
            "trainer.resume_mode=disable", "trainer.logger=[jsonl]", "trainer.plots=false"]


def failure(log: str) -> str:
    """The error a failed run ended with: archer's one-line error (and its fix), else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("archer: error:"):
            return " ".join(lines[i:i + 2]).removeprefix("archer: error: ")
    return lines[-1] if lines else "no output"


def run(cmd: list[str], log: Path, timeout: float) -> tuple[bool, str]:
    """Runs ``cmd`` in a process group of its own with its output in ``log``; (finished well, the error it ended
    with). Past ``timeout`` the whole group is killed: a run's worker processes (Ray's, one per GPU) would hold
    their GPUs through the next run otherwise."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return False, f"stopped after {timeout:.0f} s"
    return code == 0, "" if code == 0 else failure(log.read_text())


def config_check(work: argparse.Namespace, settings: list[str], out: Path) -> tuple[bool, str]:
    """archer's config check of the run with ``settings`` (``archer train --cfg job``, log in ``out``/check.log):
    (passed, the error it ended with). It needs no weights, so a refused run builds nothing."""
    placeholder = out / "unbuilt"
    check = archer_command(work, placeholder, placeholder, placeholder, settings, out / "check")
    check[4:4] = ["--cfg", "job"]  # after "-m archer.cli train"
    return run(check, out / "check.log", 120)


def archer_row(args: argparse.Namespace, name: str, shape: str, settings: list[str]) -> dict[str, Any]:
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    work = workload_args(shape, steps=args.steps, out=out)
    record: dict[str, Any] = {"model": name, "shape": shape, "peer": "archer", "settings": settings or ["defaults"],
                              "vocab": work.vocab}
    ok, error = config_check(work, settings, out)
    if not ok:
        return {**record, "ran": False, "error": error}
    big = shape in BIG and torch.cuda.is_available()
    model_dir, _, train_file, reward = prepare_workload(out, work, work.prompts * args.steps,
                                                        **({"dtype": torch.bfloat16, "device": "cuda"} if big else {}))
    cmd = archer_command(work, model_dir, train_file, reward, settings, out / "run")
    record["command"] = " ".join(["python", *cmd[1:]])
    ok, error = run(cmd, out / "train.log", args.row_timeout)
    lines = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()] \
        if (out / "run" / "metrics.jsonl").exists() else []
    if not ok or not lines:
        return {**record, "ran": False, "error": error or "no step finished", "steps_done": len(lines)}
    peak = {stage: max(line.get(f"perf/max_memory_allocated_gb/{stage}", 0.0) for line in lines) for stage in STAGES}
    return {**record, "ran": True, "step_s": [line["timing_s/step"] for line in lines],
            "steady_step_s": steady([line["timing_s/step"] for line in lines]),
            "stages_s": {s: steady([line.get(f"timing_s/{s}", 0.0) for line in lines]) for s in STAGES},
            "peak_allocated_gb": peak,
            "max_memory_allocated_gb": max(line.get("perf/max_memory_allocated_gb", 0.0) for line in lines),
            "max_memory_reserved_gb": max(line.get("perf/max_memory_reserved_gb", 0.0) for line in lines),
            "cpu_memory_used_gb": max(line.get("perf/cpu_memory_used_gb", 0.0) for line in lines),
            "response_length_mean": statistics.mean(line["response_length/mean"] for line in lines)}


def trl_row(args: argparse.Namespace, shape: str) -> dict[str, Any]:
    out = args.out / f"trl_{shape}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).with_name("grpo_vs_trl.py")), "--out", str(out), "--shape", shape,
           "--peers", "trl", "--trl-steps", str(args.trl_steps), "--json", str(out / "trl.json"),
           "--trl-gradient-checkpointing"]
    ok, error = run(cmd, out / "trl.log", args.row_timeout)
    record: dict[str, Any] = {"model": shape, "peer": "trl", "command": " ".join(["python", *cmd[1:]])}
    if not ok:
        return {**record, "ran": False, "error": error}
    trl = json.loads((out / "trl.json").read_text())[0]
    return {**record, "ran": True, "step_s": trl["step_s"], "steady_step_s": trl["steady_step_s"],
            "stages_s": trl["stages_s"], "max_memory_allocated_gb": trl.get("max_memory_allocated_gb"),
            "trl_version": trl["trl_version"], "response_length_mean": trl["response_length_mean"]}


def short(error: str) -> str:
    """An error's first sentence, at most 140 characters, for the table (the JSON keeps it whole)."""
    first = error.split(". ")[0]
    return first if len(first) <= 140 else first[:139] + "…"


def table(records: list[dict[str, Any]]) -> str:
    """One line per model: archer's settings, whether it ran, its step and peaks; TRL's step, peak and the ratio."""
    trl = {r["model"]: r for r in records if r["peer"] == "trl"}
    lines = ["| model | settings | archer | step s | peak GiB: gen / old log-prob / update (step) | TRL step s "
             "(peak GiB) | archer / TRL |", "|---|---|---|---|---|---|---|"]
    for r in (r for r in records if r["peer"] == "archer"):
        settings = ", ".join(s.rsplit(".", 1)[-1] if "=" in s else s for s in r["settings"])
        peer = trl.get(r["model"])
        peer_text, ratio = "-", "-"
        if peer is not None and peer["ran"]:
            peer_text = f"{peer['steady_step_s']:.2f} ({peer['max_memory_allocated_gb'] or 0:.1f})"
            if r["ran"]:
                ratio = f"{r['steady_step_s'] / peer['steady_step_s']:.2f}"
        elif peer is not None:
            peer_text = f"not run: {short(peer['error'])}"
        if r["ran"]:
            p = r["peak_allocated_gb"]
            lines.append(f"| {r['model']} | {settings} | ran | {r['steady_step_s']:.2f} | {p['gen']:.1f} / "
                         f"{p['old_log_prob']:.1f} / {p['update_actor']:.1f} ({r['max_memory_allocated_gb']:.1f}) | "
                         f"{peer_text} | {ratio} |")
        else:
            lines.append(f"| {r['model']} | {settings} | not run: {short(r['error'])} | - | - | {peer_text} | - |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    parser.add_argument("--steps", type=int, default=6, help="archer's GRPO steps per row (the first is warm-up)")
    parser.add_argument("--trl-steps", type=int, default=6, help="TRL's steps per row")
    parser.add_argument("--peers", nargs="+", choices=("archer", "trl"), default=["archer", "trl"],
                        help="which peers run (TRL only for the rows that name it)")
    parser.add_argument("--row-timeout", type=float, default=600.0, help="seconds a row may run")
    parser.add_argument("--json", type=Path, help="write the records here (keeping other rows already there)")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    common = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "command": " ".join(["python", *sys.argv])}
    records: list[dict[str, Any]] = []
    if args.json and args.json.exists():
        records = json.loads(args.json.read_text())
    for name in args.rows:
        shape, settings, with_trl = ROWS[name]
        for peer in [p for p in args.peers if p == "archer" or with_trl]:
            record = {**(archer_row(args, name, shape, settings) if peer == "archer" else trl_row(args, shape)),
                      **common}
            records = [r for r in records if (r["model"], r["peer"]) != (record["model"], record["peer"])] + [record]
            print(json.dumps(record), flush=True)
            if args.json:
                args.json.write_text(json.dumps(records, indent=1))
    order = {shape: i for i, shape in enumerate(ROWS)}
    records.sort(key=lambda r: (order[r["model"]], r["peer"]))
    text = table(records)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
