"""Every algorithm preset on the quickstart task, side by side: accuracy, entropy, wall time, mechanisms.

Builds the quickstart's task data, tiny model and supervised warm start once (``DIR/base``, seeded), then runs
the quickstart's RL stage from that same warm-started model once per preset (``algorithm=NAME``, see
archer/config/algorithm/), with the same seeds and step budget, and reads what each run logged:

- validation accuracy (greedy decoding of 200 held-out prompts, ``val-core/archer/arithmetic/acc/mean@1``)
  before RL (step 0), every ``--test-freq`` steps and at the last step;
- the mean entropy of the response tokens of each step's training batch (``actor/entropy``, from the
  old-log-prob pass; after dynamic sampling and rejection, so over the tokens the preset trains on);
- the RL stage's wall time (``wall_time_s`` of the run's summary.json: model loading, validations and plots
  included);
- the figures of the presets' own mechanisms, averaged over the steps where the run logged them (MECHANISMS).

Every preset gets the quickstart's RL overrides (among them ``reward_model.overlong_buffer.len=16``: the
presets' 4096-token buffer does not fit 48-token responses) without its two traces, so that every preset pays
the same, and console + jsonl logging. A preset that fails is recorded with its error message, the others
still run, and the exit code is 1.

    python bench/compare_algorithms.py --out runs/compare                  # all presets, 40 steps, seed 1
    python bench/compare_algorithms.py --out /tmp/cmp --steps 2 --test-freq 1 --presets grpo,dapo,archer

Writes DIR/results.json (per preset: the figures and the curves), DIR/results.md (the table) and
DIR/compare_algorithms.png (validation accuracy and entropy against the step, a line per preset), and prints
the table with the device, date and command, ready for BENCHMARKS.md. The runs are in DIR/runs/NAME.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from rich.console import Console

from archer.cli import quiet_libraries
from archer.config.loader import group_options, load_config
from archer.errors import ArcherError
from archer.models.loading import pick_device
from archer.trainer.plots import read_series
from archer.trainer.ppo import PPOTrainer
from archer.trainer.quickstart import (
    RECIPES,
    RL_OVERRIDES,
    TASK,
    VAL_KEY,
    Recipe,
    warm_start,
)

PRESET_ORDER = ("ppo", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "dapo", "archer", "aspo",
                "top_entropy", "clip_cov", "kl_cov", "gspo")
ENTROPY_KEY = "actor/entropy"
# metric key -> table column; the value is the mean over the steps where the run logged the key
MECHANISMS = {
    "train/num_gen_batches": "gen batches per step",
    "train/num_rejected_groups": "rejected groups per step",
    "reward/overlong_penalised_frac": "overlong-penalised frac",
    "actor/entropy_high_clipfrac": "high-entropy clipfrac",
    "actor/top_entropy_selected_frac": "top-entropy selected frac",
    "actor/cov_selected_tokens": "cov-selected tokens",
}
# keys of the quickstart's RL overrides that this bench sets itself (its traces are left off)
REPLACED_KEYS = ("trainer.total_training_steps", "trainer.test_freq", "trainer.logger",
                 "trainer.entropy_trace.enable", "trainer.influence_trace.enable")
# a look per preset (14 of them, arpo and aepo included); more presets would wrap round
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
           "tab:gray", "tab:olive", "tab:cyan", "black", "gold", "teal", "maroon")
LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "h", "<", ">", "p", "d", "8")
# the figure's panels: (curve of read_run, title, y label)
PANELS = (("val_acc", "validation accuracy", "validation accuracy (greedy)"),
          ("entropy", "entropy", "mean token entropy (training batch)"))
FIGURE = "compare_algorithms.png"


def available_presets() -> list[str]:
    """The presets in archer/config/algorithm/, in PRESET_ORDER and then any others by name."""
    found = group_options("algorithm")
    return [p for p in PRESET_ORDER if p in found] + [p for p in found if p not in PRESET_ORDER]


def parse_presets(text: str | None) -> list[str]:
    """``a,b,c`` as a list of known preset names without repeats; None means every preset."""
    known = available_presets()
    if text is None:
        return known
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        problem = f"unknown presets: {', '.join(unknown)}" if unknown else "no preset names"
        raise ArcherError(f"{problem} in --presets {text!r}",
                          f"pick from {','.join(known)}")
    return names


def build_base(base_dir: Path, seed: int, device: str, console: Console,
               recipe: Recipe = RECIPES[TASK]) -> dict[str, str]:
    """The quickstart's task data, tiny model and supervised warm start (of ``recipe``'s task), built fresh in
    ``base_dir``."""
    shutil.rmtree(base_dir, ignore_errors=True)
    files, sft_model = warm_start(base_dir, seed, console, sft_extra=[f"trainer.device={device}"], recipe=recipe)
    return {"train_file": str(files["train"]), "val_file": str(files["val"]),
            "base_model": str(base_dir / "base_model"), "sft_model": str(sft_model)}


def shared_overrides(args: argparse.Namespace, rl_overrides: Sequence[str] = RL_OVERRIDES) -> list[str]:
    """The RL overrides every run gets: the quickstart's task budget and shapes (``rl_overrides``, a recipe's),
    this bench's settings."""
    kept = [o for o in rl_overrides if o.lstrip("+").split("=", 1)[0] not in REPLACED_KEYS]
    return [*kept, f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.test_freq}",
            f"trainer.device={args.device}",
            f"trainer.seed={args.seed}", f"data.seed={args.seed}", "trainer.logger=[console,jsonl]",
            "trainer.resume_mode=disable"]


def run_stage(algorithm: Sequence[str], base: dict[str, str], shared: list[str], run_dir: Path) -> None:
    """The RL stage from the warm-started model with the ``algorithm`` overrides (``algorithm=NAME`` for a
    preset) before the shared ones, into a fresh ``run_dir``."""
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [*algorithm, f"actor_rollout_ref.model.path={base['sft_model']}",
                 f"data.train_files={base['train_file']}", f"data.val_files={base['val_file']}",
                 f"trainer.default_local_dir={run_dir}", *shared]
    PPOTrainer(load_config("ppo_trainer", overrides)).fit()


def curve(points: dict[int, float]) -> dict[str, list]:
    steps = sorted(points)
    return {"step": steps, "value": [points[s] for s in steps]}


def after_rl(points: dict[int, float]) -> float | None:
    """The value at the last step a validation curve has after step 0 (before RL), None without one."""
    last = max(points, default=0)
    return points[last] if last > 0 else None


def step_means(series: dict[str, dict[int, float]], keys: Sequence[str]) -> dict[str, float]:
    """For each of ``keys`` that the run logged: its mean over the steps where it was logged."""
    return {key: statistics.fmean(series[key].values()) for key in keys if key in series}


def read_run(run_dir: Path) -> dict[str, Any]:
    """A finished run's figures and curves, from its metrics.jsonl and summary.json."""
    series = read_series(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    val = series.get(VAL_KEY, {})
    entropy = series.get(ENTROPY_KEY, {})
    return {
        "status": "ok",
        "val_acc_before": val.get(0),
        "val_acc_after": after_rl(val),
        "entropy_end": entropy[max(entropy)] if entropy else None,
        "wall_time_s": summary["wall_time_s"],
        "steps": summary["steps"],
        "mechanisms": step_means(series, list(MECHANISMS)),
        "curves": {"val_acc": curve(val), "entropy": curve(entropy)},
        "run_dir": str(run_dir),
    }


def cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    """One row per preset; a mechanism column for each MECHANISMS key that some run logged."""
    logged = {key for r in results.values() for key in r.get("mechanisms", {})}
    mechanisms = [key for key in MECHANISMS if key in logged]
    header = ["preset", "val acc before", "val acc after", "entropy at end", "wall time s",
              *(MECHANISMS[key] for key in mechanisms)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, r in results.items():
        if r["status"] != "ok":
            cells = [name, "failed", *["-"] * (len(header) - 2)]
        else:
            cells = [name, cell(r["val_acc_before"], ".3f"), cell(r["val_acc_after"], ".3f"),
                     cell(r["entropy_end"], ".3f"), cell(r["wall_time_s"], ".1f"),
                     *(cell(r["mechanisms"].get(key), ".3g") for key in mechanisms)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(r: dict[str, Any]) -> str:
    return (f"val acc {cell(r['val_acc_before'], '.3f')} -> {cell(r['val_acc_after'], '.3f')}, "
            f"entropy at end {cell(r['entropy_end'], '.3f')}")


def failures(results: dict[str, dict[str, Any]]) -> list[str]:
    """One line per failed preset: its name and error message."""
    return [f"{name}: {' / '.join(line.strip() for line in r['error'].splitlines())}"
            for name, r in results.items() if r["status"] != "ok"]


def draw_curves(results: dict[str, dict[str, Any]], path: Path, title: str,
                panels: Sequence[tuple[str, str, str]] = PANELS) -> None:
    """One panel per (curve, title, y label) of ``panels``, each curve against the step, one colour, style and
    marker per preset; hollow markers, so that presets with equal values (all of them at step 0) stay
    visible."""
    fig = Figure(figsize=(1 + 6 * len(panels), 5), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    order = available_presets()  # a preset keeps its look whichever presets are compared
    for name, r in results.items():
        if r["status"] != "ok":
            continue
        i = order.index(name)
        style = {"color": COLOURS[i % len(COLOURS)], "linestyle": LINE_STYLES[i % len(LINE_STYLES)],
                 "marker": MARKERS[i % len(MARKERS)], "markersize": 6, "markerfacecolor": "none",
                 "label": name}
        for ax, (key, _, _) in zip(axes, panels, strict=True):
            points = r["curves"][key]
            ax.plot(points["step"], points["value"], markevery=max(1, len(points["step"]) // 8), **style)
    for ax, (_, panel_title, label) in zip(axes, panels, strict=True):
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(label)
        ax.set_title(panel_title)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right center", fontsize="small")
    fig.savefig(path, dpi=100)


def write_outputs(out: Path, meta: dict[str, Any], results: dict[str, dict[str, Any]], table: str,
                  figure: str, title: str, panels: Sequence[tuple[str, str, str]] = PANELS) -> str:
    """results.json, results.md (the context line, ``table`` and the failures) and the ``figure`` PNG of
    ``panels``; returns the Markdown."""
    (out / "results.json").write_text(json.dumps({**meta, "presets": results}, indent=2))
    text = f"device: {meta['device']} | date: {meta['date']} | command: `{meta['command']}`\n\n{table}\n"
    failed = failures(results)
    if failed:
        text += "\nfailed presets:\n" + "".join(f"- {line}\n" for line in failed)
    (out / "results.md").write_text(text)
    draw_curves(results, out / figure, title, panels)
    return text


def attempt(name: str, run_dir: Path, run: Callable[[Path], None], read: Callable[[Path], dict[str, Any]],
            describe: Callable[[dict[str, Any]], str], console: Console) -> dict[str, Any]:
    """``run(run_dir)`` and then ``read(run_dir)``'s figures, or the run's failure with its error message: one
    run's failure is a result, and the others still run. Prints the outcome (``describe`` of the figures)."""
    started = time.perf_counter()
    try:
        run(run_dir)
        result = read(run_dir)
    except Exception as e:
        if not isinstance(e, ArcherError):
            console.print_exception(max_frames=5)
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}", "run_dir": str(run_dir)}
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    took = time.perf_counter() - started
    if result["status"] == "ok":
        console.print(f"[green]{name} done[/] in {took:.0f} s: {describe(result)}")
    else:
        console.print(f"[red]{name} failed[/] after {took:.0f} s: {result['error']}")
    return result


def device_name(device: str) -> str:
    resolved = pick_device(device)
    return torch.cuda.get_device_name(resolved) if resolved.type == "cuda" else "CPU"


def start_comparison(args: argparse.Namespace, rl_overrides: Sequence[str] = RL_OVERRIDES,
                     **more: Any) -> tuple[Console, dict[str, Any]]:
    """Checks --steps / --test-freq, quiets the libraries, makes --out; the console and the run's record (device,
    date, command, seed, steps, the overrides every run shares, and ``more``)."""
    if args.steps < 1 or args.test_freq < 1:
        raise ArcherError(f"--steps {args.steps} and --test-freq {args.test_freq} must be at least 1",
                          "pass positive integers, e.g. --steps 20 --test-freq 2")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_libraries()
    meta: dict[str, Any] = {
        "device": device_name(args.device), "date": time.strftime("%Y-%m-%d"),
        "command": "python " + shlex.join(sys.argv), "seed": args.seed, "steps": args.steps,
        "test_freq": args.test_freq, **more, "shared_overrides": shared_overrides(args, rl_overrides)}
    args.out.mkdir(parents=True, exist_ok=True)
    return Console(), meta


def finish_comparison(console: Console, text: str, out: Path, figure: str, results: dict[str, dict[str, Any]]) -> int:
    """Prints the tables and what was written; the exit code (1 when a run failed)."""
    console.rule("[bold]results")
    print(text)
    console.print(f"written: {out / 'results.json'}, {out / 'results.md'}, {out / figure}")
    return 1 if failures(results) else 0


def run_comparison(main: Callable[[], int], prog: str) -> None:
    """Exits with ``main``'s code, or 2 with one line for an ArcherError (bad arguments)."""
    try:
        sys.exit(main())
    except ArcherError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        sys.exit(2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (base/, runs/, results.*)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the data, models and RL runs")
    parser.add_argument("--steps", type=int, default=40, help="RL steps per preset")
    parser.add_argument("--presets", default=None, help="comma-separated preset names (default: all)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--test-freq", type=int, default=5, help="validate every N steps (and at the last)")
    args = parser.parse_args()
    presets = parse_presets(args.presets)
    console, meta = start_comparison(args)

    console.rule("[bold]base: task data, tiny model, supervised warm start")
    meta["base"] = build_base(args.out / "base", args.seed, args.device, console)
    results: dict[str, dict[str, Any]] = {}
    title = f"archer presets on the quickstart task: seed {args.seed}, {args.steps} steps, {meta['device']}"
    for i, name in enumerate(presets, 1):
        console.rule(f"[bold]{i}/{len(presets)} {name}")
        results[name] = attempt(
            name, args.out / "runs" / name,
            lambda run_dir, name=name: run_stage([f"algorithm={name}"], meta["base"], meta["shared_overrides"],
                                                 run_dir),
            read_run, describe, console)
        text = write_outputs(args.out, meta, results, markdown_table(results), FIGURE, title)

    return finish_comparison(console, text, args.out, FIGURE, results)


if __name__ == "__main__":
    run_comparison(main, "compare_algorithms")
