"""Scale-out: tokens/s of a full GRPO step and peak memory per GPU on 1..N GPUs, with and without FSDP2 offload
(issues 18 and 19).

Each configuration (world size x memory setting) is one ``archer train`` run in a subprocess with
``trainer.n_gpus_per_node=N``, exactly what a user runs, on bench/grpo_vs_trl.py's workload (16 prompts of 256
tokens x 8 samples of 512 new tokens, micro-batches of 32) at the Qwen2.5-1.5B shape with Qwen's real 151,936-row
vocabulary (bench/gpu_step.py's random model and small tokenizer). Settings:

- ``plain``: archer's defaults (FSDP2 sharding across the ranks when world > 1; one process when world = 1);
- ``fsdp_offload``: plus ``actor.fsdp_config.param_offload`` and ``optimizer_offload``.

    python bench/scale_out.py                                   # 1 and every GPU count up to the visible ones
    python bench/scale_out.py --gpus 1,2 --settings plain       # one comparison: the issue's goal check
    python bench/scale_out.py --tiny --gpus 1,2 --steps 2       # CPU: the tiny model, worker processes

Per configuration, from the run's own metrics.jsonl: the step times (``timing_s/step``), the tokens of each step
(``perf/total_num_tokens``: prompt and response tokens), tokens/s = the timed steps' tokens / their summed step
time (the first step is warm-up and left out), the peak GPU memory per GPU (``perf/max_memory_allocated_gb`` and
``_reserved_gb``: archer reports the largest rank's) and the speed-up over world size 1 with the same setting.
The records go to ``--out`` (JSON), a table is printed, and a PNG of tokens/s and memory against the world size
goes beside the JSON. A configuration that fails (refused by archer's config check, out of memory, stopped after
``--config-timeout``) is recorded with its error, and the bench goes on. When world sizes 1 and 2 both ran, the
goal of issue 19 is checked: >= 1.7x the 1-GPU tokens/s on 2 GPUs (setting ``plain``). The model and prompts are
built once under ``--workdir`` and reused by later calls with the same workload.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from grpo_vs_trl import prepare_workload, workload_args
from matplotlib.figure import Figure
from model_sizes import BOTH_OFFLOADS, archer_command, config_check, run, short
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

SHAPE = "qwen2.5-1.5b"
SETTINGS: dict[str, list[str]] = {"plain": [], "fsdp_offload": BOTH_OFFLOADS}
GOAL_SPEEDUP = 1.7  # issue 19: tokens/s on 2 GPUs over 1 GPU, setting "plain"
RESULTS = Path(__file__).resolve().parent / "results"
WORKLOAD_KEYS = ("shape", "prompts", "n", "prompt_length", "response_length", "micro_batch", "vocab")


def parse_gpus(text: str) -> list[int]:
    """``1,2,4`` as sorted distinct world sizes (positive integers)."""
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus {text!r}: give GPU counts separated by commas, e.g. 1,2") from None
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"--gpus {text!r}: every count must be 1 or more")
    return counts


def parse_settings(text: str) -> list[str]:
    names = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in names if name not in SETTINGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--settings {text!r}: pick from {','.join(SETTINGS)}")
    return names


def default_gpus(visible: int, work: argparse.Namespace) -> list[int]:
    """1 and every count up to ``visible`` that divides the workload's prompts and responses evenly (1, 2, 4, 8
    on eight GPUs): generation shards prompts and the update shards each mini-batch's rows."""
    return [n for n in range(1, max(visible, 1) + 1) if work.prompts % n == 0 and work.prompts * work.n % n == 0]


def gpu_name() -> str:
    """The first visible GPU's name, from nvidia-smi where it answers (this process then holds no CUDA context
    on the card the runs measure), else from torch."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30, check=True).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        names = []
    return names[0].strip() if names and names[0].strip() else torch.cuda.get_device_name()


def device_slug(name: str) -> str:
    """A file-name form of the device's name: "NVIDIA H100 80GB HBM3" -> "h100_80gb_hbm3"."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower().removeprefix("nvidia ")).strip("_") or "device"


def config_overrides(world: int, setting: str, tiny: bool) -> list[str]:
    return [f"trainer.n_gpus_per_node={world}", *SETTINGS[setting], *(["trainer.device=cpu"] if tiny else [])]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The step lines of ``run_dir``/metrics.jsonl (none when the run wrote none)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [line for line in lines if "timing_s/step" in line]


def _peak(lines: list[dict[str, Any]], key: str) -> float | None:
    values = [line[key] for line in lines if key in line]
    return max(values) if values else None


def measure(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Step times, tokens, tokens/s and each stage's mean time (``timing_s/<stage>``: which stage limits the
    speed-up) over the steps after the first (the only one when there is one), and the peaks over every step."""
    step_s = [float(line["timing_s/step"]) for line in lines]
    tokens = [int(line["perf/total_num_tokens"]) for line in lines]
    timed = slice(1, None) if len(lines) > 1 else slice(None)
    stages = dict.fromkeys(k for line in lines for k in line if k.startswith("timing_s/") and k != "timing_s/step")
    return {"steps": len(lines), "step_s": step_s, "tokens": tokens, "timed_steps": len(step_s[timed]),
            "timed_step_s": sum(step_s[timed]) / len(step_s[timed]),
            "stages_s": {k.removeprefix("timing_s/"): sum(line.get(k, 0.0) for line in lines[timed]) / len(lines[timed])
                         for k in stages},
            "tokens_per_s": sum(tokens[timed]) / sum(step_s[timed]),
            "peak_memory_per_gpu_gb": _peak(lines, "perf/max_memory_allocated_gb"),
            "peak_reserved_per_gpu_gb": _peak(lines, "perf/max_memory_reserved_gb"),
            "cpu_memory_used_gb": _peak(lines, "perf/cpu_memory_used_gb")}


def workload_files(workdir: Path, work: argparse.Namespace, prompt_rows: int, console: Console
                   ) -> tuple[Path, Path, Path]:
    """The model folder, prompts file and reward file of ``work`` under ``workdir``: built once (the 1.5B model is 6 GB
    of float32 weights to draw and write), reused by a later call whose workload is the same and needs no more prompts."""
    stamp = workdir / "workload.json"
    wanted = {key: getattr(work, key) for key in WORKLOAD_KEYS}
    if stamp.is_file():
        built = json.loads(stamp.read_text())
        model_dir, train_file, reward = (Path(path) for path in built["files"])
        if ({key: built.get(key) for key in WORKLOAD_KEYS} == wanted and built["prompt_rows"] >= prompt_rows
                and model_dir.is_dir() and train_file.is_file() and reward.is_file()):
            console.print(f"reusing the {work.shape} workload in {workdir}")
            return model_dir, train_file, reward
    stamp.unlink(missing_ok=True)
    console.print(f"building the {work.shape} workload in {workdir} ...")
    model_dir, _, train_file, reward = prepare_workload(workdir, work, prompt_rows)
    files = (model_dir, train_file, reward)
    stamp.write_text(json.dumps({**wanted, "prompt_rows": prompt_rows, "files": [str(path) for path in files]}))
    return files


def run_config(args: argparse.Namespace, work: argparse.Namespace, files: tuple[Path, Path, Path], world: int,
               setting: str) -> dict[str, Any]:
    """One configuration: archer's config check (``--cfg job``), then the run, then its metrics; a failure at
    either stage is the record's ``error``."""
    out = args.workdir / f"world{world}_{setting}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    overrides = config_overrides(world, setting, args.tiny) + args.archer_override
    record: dict[str, Any] = {"world_size": world, "setting": setting, "overrides": overrides, "ran": False}
    if not args.tiny and world > args.visible_gpus:
        return {**record, "error": f"needs {world} GPUs, {args.visible_gpus} visible"}
    ok, error = config_check(work, overrides, out)
    if not ok:
        return {**record, "error": error, "log": str(out / "check.log")}
    cmd = archer_command(work, *files, overrides, out / "run")
    record["archer_command"] = " ".join(["python", *cmd[1:]])
    ok, error = run(cmd, out / "train.log", args.config_timeout)
    lines = read_metrics(out / "run")
    if not ok or not lines:
        return {**record, "error": error or "no step finished", "steps": len(lines), "log": str(out / "train.log")}
    return {**record, "ran": True, **measure(lines)}


def add_speedups(records: list[dict[str, Any]]) -> None:
    """Each run's tokens/s over world size 1's with the same setting (None where that did not run)."""
    base = {r["setting"]: r["tokens_per_s"] for r in records if r["ran"] and r["world_size"] == 1}
    for r in records:
        one = base.get(r["setting"])
        r["speedup_vs_world1"] = r["tokens_per_s"] / one if r["ran"] and one else None


def goal_line(records: list[dict[str, Any]]) -> str | None:
    """Issue 19's goal on setting "plain" when world sizes 1 and 2 were both asked for; None otherwise."""
    plain = {r["world_size"]: r for r in records if r["setting"] == "plain"}
    if not {1, 2} <= plain.keys():
        return None
    if not (plain[1]["ran"] and plain[2]["ran"]):
        missing = " and ".join(f"world {w}" for w in (1, 2) if not plain[w]["ran"])
        return f"goal (2 GPUs >= {GOAL_SPEEDUP}x 1 GPU, plain): not checked, {missing} did not run"
    speedup = plain[2]["speedup_vs_world1"]
    verdict = "met" if speedup >= GOAL_SPEEDUP else "missed"
    return f"goal (2 GPUs >= {GOAL_SPEEDUP}x 1 GPU, plain): {speedup:.2f}x ({verdict})"


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(records: list[dict[str, Any]]) -> str:
    lines = ["| world | setting | step s | tokens/step | tokens/s | speed-up vs 1 | peak GiB per GPU (reserved) |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        if not r["ran"]:
            lines.append(f"| {r['world_size']} | {r['setting']} | not run: {short(r['error'])} | - | - | - | - |")
            continue
        speedup = "-" if r["speedup_vs_world1"] is None else f"{r['speedup_vs_world1']:.2f}x"
        tokens = sum(r["tokens"][-r["timed_steps"]:]) / r["timed_steps"]
        lines.append(f"| {r['world_size']} | {r['setting']} | {r['timed_step_s']:.2f} | {tokens:.0f} | "
                     f"{r['tokens_per_s']:.1f} | {speedup} | {_gb(r['peak_memory_per_gpu_gb'])} "
                     f"({_gb(r['peak_reserved_per_gpu_gb'])}) |")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Tokens/s and peak memory per GPU against the world size, a line per setting; False when nothing ran."""
    ran = [r for r in records if r["ran"]]
    if not ran:
        return False
    figure = Figure(figsize=(10, 4), layout="constrained")
    speed, memory = figure.subplots(1, 2)
    for setting in dict.fromkeys(r["setting"] for r in ran):
        rows = sorted((r for r in ran if r["setting"] == setting), key=lambda r: r["world_size"])
        worlds = [r["world_size"] for r in rows]
        speed.plot(worlds, [r["tokens_per_s"] for r in rows], marker="o", label=setting)
        peaks = [(r["world_size"], r["peak_memory_per_gpu_gb"]) for r in rows if r["peak_memory_per_gpu_gb"] is not None]
        if peaks:
            memory.plot(*zip(*peaks), marker="o", label=setting)
    worlds = sorted({r["world_size"] for r in ran})
    for ax, label in ((speed, "tokens/s (whole step)"), (memory, "peak GPU memory per GPU (GiB, allocated)")):
        ax.set_xlabel("GPUs (trainer.n_gpus_per_node)")
        ax.set_ylabel(label)
        ax.set_xticks(worlds)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend()
    if not memory.has_data():
        memory.text(0.5, 0.5, "no GPU memory figures (a CPU run)", ha="center", va="center",
                    transform=memory.transAxes)
    figure.suptitle(title)
    figure.savefig(path, dpi=120)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=parse_gpus, help="world sizes, e.g. 1,2 (default: 1 and every count up to "
                        "the visible GPUs that divides the workload; --tiny: 1,2 worker processes)")
    parser.add_argument("--settings", type=parse_settings, default=list(SETTINGS),
                        help=f"memory settings, from {','.join(SETTINGS)} (default: both)")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per configuration (the first is warm-up)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (trainer.device=cpu)")
    parser.add_argument("--out", type=Path, help="the JSON records (default: bench/results/scale_out_<device>.json)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench_scale_out"),
                        help="the model, data and each configuration's run and log")
    parser.add_argument("--config-timeout", type=float, default=900.0, help="seconds one configuration may run")
    parser.add_argument("--archer-override", nargs="*", default=[], help="more archer train overrides, every run")
    return parser


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be 1 or more")
    args.visible_gpus = torch.cuda.device_count()
    if not args.tiny and not args.visible_gpus:
        parser.error("no GPU is visible: the 1.5B workload needs GPUs (on a CPU, run with --tiny)")
    work = workload_args("tiny" if args.tiny else SHAPE, steps=args.steps, out=args.workdir)
    gpus = args.gpus or ([1, 2] if args.tiny else default_gpus(args.visible_gpus, work))
    device = "cpu" if args.tiny else gpu_name()
    args.out = args.out or RESULTS / f"scale_out_{device_slug(device)}{'_tiny' if args.tiny else ''}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    common = {"device": device, "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "command": " ".join(["python", "bench/scale_out.py", *argv]),
              "shape": work.shape, "prompts": work.prompts, "n": work.n, "prompt_length": work.prompt_length,
              "response_length": work.response_length, "micro_batch": work.micro_batch, "vocab": work.vocab}
    files = workload_files(args.workdir, work, work.prompts * args.steps, console)
    records: list[dict[str, Any]] = []
    configs = [(world, setting) for world in gpus for setting in args.settings]
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("configurations", total=len(configs))
        for world, setting in configs:
            progress.update(task, description=f"world {world}, {setting}")
            record = {**common, **run_config(args, work, files, world, setting)}
            records.append(record)
            if record["ran"]:
                progress.console.print(f"world {world}, {setting}: {record['tokens_per_s']:.1f} tokens/s")
            else:
                progress.console.print(f"world {world}, {setting}: not run: {record['error']}")
            add_speedups(records)
            args.out.write_text(json.dumps(records, indent=1))
            progress.advance(task)
    print(f"\n{work.shape}: {work.prompts} prompts x {work.n}, prompt {work.prompt_length}, "
          f"{work.response_length} new tokens, micro-batch {work.micro_batch}, {args.steps} steps "
          f"(first left out) on {device}")
    print(table(records))
    goal = goal_line(records)
    if goal:
        print(goal)
    figure = args.out.with_suffix(".png")
    if plot(records, figure, f"archer GRPO step, {work.shape} on {device}"):
        print(f"plot: {figure}")
    print(f"records: {args.out}")
    return records


if __name__ == "__main__":
    main()
