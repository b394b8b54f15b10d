"""GRPO, ARPO and AEPO on the tool task, side by side: accuracy, tool calls, branches, wall time.

Builds the tool quickstart's task data, tiny model and supervised warm start once (the ``tool_arithmetic``
Recipe of ``archer quickstart task=tool_arithmetic``; ``DIR/base``, seeded), then runs the quickstart's RL stage
from that same warm-started model once per method, with the same seed (so the same prompts in the same order),
the same responses per prompt and the same steps:

- ``grpo``: the quickstart's own GRPO (group-normalised advantages, token-mean, clip 0.2, no KL), which is the
  ``arpo`` preset's update without its branching (the ``grpo`` preset would add a KL loss and
  seq-mean-token-mean, so it would differ from ARPO in more than the rollout);
- ``arpo``: ``algorithm=arpo`` with the branching scaled to the task (SCALED_BRANCHING);
- ``aepo``: ``algorithm=aepo``, scaled the same way.

Scaling, here and nowhere else: the presets' values are the papers', for 16 responses per prompt (8 global
samples, 8 from branches) of thousands of tokens and 3 tool calls. The task keeps its own budget, 8 responses of
at most 64 tokens with one tool call (its RL overrides set ``rollout.n`` and ``tools.call_limit``, over the
presets'), and SCALED_BRANCHING sets ``initial_rollouts`` to n/2 = 4 and ``beam_size`` to 2 (the papers'), so
that as in the papers up to half of each group comes from branches. AEPO's dynamic rollouts choose each prompt's
global samples from its probe (``initial_rollouts`` then does not apply). ``branch_probability``,
``entropy_weight``, AEPO's ``dynamic_rollout_beta`` and ``consecutive_branch_penalty`` keep the papers' values.
As in bench/compare_algorithms.py, the quickstart's traces are left off and logging is console + jsonl.

Read from each run's metrics.jsonl and summary.json:

- greedy validation accuracy and tool-call rate (200 held-out prompts, with the tool) before RL (step 0), every
  ``--test-freq`` steps and at the last step, and the first validated step whose accuracy reached ACC_THRESHOLD;
- the means over the steps of STEP_MEANS: the training rollouts' tool calls and the tool's failures and
  latency, the global samples per prompt, branches, refills, branch depth, the entropy H (and dH) at the points
  where branches were made, AEPO's policy-update figures, the generation and step times;
- the RL stage's wall time (``wall_time_s`` of summary.json: loading, validations and plots included) and the
  machine's mean 1-minute load average while the run ran (other work on a shared machine slows it).

    python bench/compare_agentic.py --out runs/compare_agentic --device cpu         # 20 steps, seed 1
    python bench/compare_agentic.py --out /tmp/cag --steps 2 --test-freq 1 --methods grpo,arpo

Writes DIR/results.json (per method: the figures and the curves), DIR/results.md (two tables) and
DIR/compare_agentic.png (validation accuracy, validation tool-call rate and the training rollouts' tool-call
rate against the step, a line per method), and prints the tables with the device, date and command, ready for
BENCHMARKS.md. The runs are in DIR/runs/NAME. A method that fails is recorded with its error message, the others
still run, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from compare_algorithms import (
    after_rl,
    attempt,
    build_base,
    cell,
    curve,
    finish_comparison,
    run_comparison,
    run_stage,
    start_comparison,
    step_means,
    write_outputs,
)

from archer.errors import ArcherError
from archer.trainer.plots import read_series
from archer.trainer.quickstart import DEFAULT_ALGORITHM_OVERRIDES, RECIPES, TOOL_TASK

RECIPE = RECIPES[TOOL_TASK]
ACC_KEY = RECIPE.reported["acc"]
TOOL_RATE_KEY = RECIPE.reported["tool_call_rate"]
TRAIN_TOOL_RATE_KEY = "reward/used_tool/mean"  # share of the training rollouts that made a Python call
ACC_THRESHOLD = 0.9


def override_value(overrides: Sequence[str], key: str) -> str:
    """The value the last ``key=value`` (or ``+key=value``) of ``overrides`` gives ``key``."""
    values = [o.lstrip("+").partition("=")[2] for o in overrides if o.lstrip("+").partition("=")[0] == key]
    if not values:
        raise ArcherError(f"the {RECIPE.task} recipe's RL overrides do not set {key}",
                          f"add {key}=VALUE to its rl_overrides in archer/trainer/quickstart.py")
    return values[-1]


N = int(override_value(RECIPE.rl_overrides, "actor_rollout_ref.rollout.n"))
# the ARPO/AEPO presets' branching scaled to the task's n (module docstring)
SCALED_BRANCHING = [f"actor_rollout_ref.rollout.initial_rollouts={N // 2}", "actor_rollout_ref.rollout.beam_size=2"]
# method -> its algorithm overrides, given before the task's (which set n and call_limit for all three)
METHODS: dict[str, list[str]] = {
    "grpo": list(DEFAULT_ALGORITHM_OVERRIDES),
    "arpo": ["algorithm=arpo", *SCALED_BRANCHING],
    "aepo": ["algorithm=aepo", *SCALED_BRANCHING],
}
# metric key -> table column; the value is the mean over the steps where the run logged the key
STEP_MEANS = {
    "tools/calls_per_response": "tool calls per response (train)",
    "tools/python/failures": "tool failures per step",
    "tools/python/mean_latency_s": "tool latency s",
    "rollout/initial_rollouts": "global samples per prompt",
    "rollout/branches": "branches per step",
    "rollout/refills": "refills per step",
    "rollout/branch_depth_mean": "branch depth",
    "rollout/branch_entropy_mean": "H at branch points",
    "rollout/branch_entropy_delta_mean": "dH at branch points",
    "rollout/tool_step_entropy_mean": "H after tool answers",
    "actor/entropy_adv_flipped_frac": "entropy-adv flipped frac",
    "actor/entropy_balanced_clip_kept_frac": "balanced-clip kept frac",
    "timing_s/gen": "gen s per step",
    "timing_s/step": "step s",
}
# the figure's panels: (curve of read_run, title, y label)
PANELS = (("val_acc", "validation accuracy", "validation accuracy (greedy)"),
          ("val_tool_call_rate", "validation tool-call rate", "responses that call the tool (greedy)"),
          ("train_tool_call_rate", "training tool-call rate", "rollouts that call the tool (sampled)"))
FIGURE = "compare_agentic.png"
Row = dict[str, Any]


def parse_methods(text: str) -> list[str]:
    """``a,b`` as a list of METHODS names without repeats."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in METHODS]
    if unknown or not names:
        problem = f"unknown methods: {', '.join(unknown)}" if unknown else "no method names"
        raise ArcherError(f"{problem} in --methods {text!r}", f"pick from {','.join(METHODS)}")
    return names


def first_step_at(points: dict[int, float], threshold: float) -> int | None:
    """The first validated step whose value reached ``threshold`` (0: already before RL), None if none did."""
    return next((step for step in sorted(points) if points[step] >= threshold), None)


def read_run(run_dir: Path) -> Row:
    """A finished run's figures and curves, from its metrics.jsonl and summary.json."""
    series = read_series(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    acc, rate = series.get(ACC_KEY, {}), series.get(TOOL_RATE_KEY, {})
    return {
        "status": "ok",
        "val_acc_before": acc.get(0),
        "val_acc_after": after_rl(acc),
        "first_step_at_threshold": first_step_at(acc, ACC_THRESHOLD),
        "val_tool_call_rate_before": rate.get(0),
        "val_tool_call_rate_after": after_rl(rate),
        "wall_time_s": summary["wall_time_s"],
        "steps": summary["steps"],
        "step_means": step_means(series, list(STEP_MEANS)),
        "curves": {"val_acc": curve(acc), "val_tool_call_rate": curve(rate),
                   "train_tool_call_rate": curve(series.get(TRAIN_TOOL_RATE_KEY, {}))},
        "run_dir": str(run_dir),
    }


def _mean(key: str) -> Callable[[Row], str]:
    return lambda r: cell(r["step_means"].get(key), ".3g")


def _first_step(r: Row) -> str:
    step = r["first_step_at_threshold"]
    return "not reached" if step is None else str(step)


ACCURACY_COLUMNS: list[tuple[str, Callable[[Row], str]]] = [
    ("val acc before", lambda r: cell(r["val_acc_before"], ".3f")),
    ("val acc after", lambda r: cell(r["val_acc_after"], ".3f")),
    (f"first step val acc >= {ACC_THRESHOLD}", _first_step),
    ("val tool-call rate before", lambda r: cell(r["val_tool_call_rate_before"], ".3f")),
    ("val tool-call rate after", lambda r: cell(r["val_tool_call_rate_after"], ".3f")),
    *((STEP_MEANS[key], _mean(key)) for key in ("tools/calls_per_response", "tools/python/failures",
                                                 "tools/python/mean_latency_s")),
    ("wall time s", lambda r: cell(r["wall_time_s"], ".0f")),
    ("mean load", lambda r: cell(r.get("load_mean"), ".1f")),
]
ROLLOUT_COLUMNS: list[tuple[str, Callable[[Row], str]]] = [
    (STEP_MEANS[key], _mean(key)) for key in STEP_MEANS if not key.startswith("tools/")]


def markdown_table(results: dict[str, Row], columns: Sequence[tuple[str, Callable[[Row], str]]]) -> str:
    """One row per method, one column per (header, cell of a result) of ``columns``."""
    header = ["method", *(name for name, _ in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, r in results.items():
        cells = [name, *(value(r) for _, value in columns)] if r["status"] == "ok" else \
            [name, "failed", *["-"] * (len(header) - 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(results: dict[str, Row]) -> str:
    return (f"accuracy and tools:\n\n{markdown_table(results, ACCURACY_COLUMNS)}\n\n"
            f"rollout, branching and time (means over the steps that logged them):\n\n"
            f"{markdown_table(results, ROLLOUT_COLUMNS)}")


def describe(r: Row) -> str:
    return (f"val acc {cell(r['val_acc_before'], '.3f')} -> {cell(r['val_acc_after'], '.3f')}, "
            f"tool-call rate {cell(r['val_tool_call_rate_before'], '.3f')} -> "
            f"{cell(r['val_tool_call_rate_after'], '.3f')}, "
            f"branches per step {cell(r['step_means'].get('rollout/branches'), '.3g')}")


@contextmanager
def sampled_load(every_s: float = 5.0) -> Iterator[list[float]]:
    """The machine's 1-minute load average, sampled every ``every_s`` seconds while the block runs (and once at
    its start), into the list it yields."""
    samples = [os.getloadavg()[0]]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(every_s):
            samples.append(os.getloadavg()[0])

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (base/, runs/, results.*)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the data, models and RL runs")
    default_steps = int(override_value(RECIPE.rl_overrides, "trainer.total_training_steps"))
    parser.add_argument("--steps", type=int, default=default_steps,
                        help=f"RL steps per method (default: the tool quickstart's {default_steps})")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from " + ",".join(METHODS))
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--test-freq", type=int, default=2, help="validate every N steps (and at the last)")
    args = parser.parse_args()
    methods = parse_methods(args.methods)
    console, meta = start_comparison(args, RECIPE.rl_overrides, methods={name: METHODS[name] for name in methods})

    console.rule(f"[bold]base: {RECIPE.task} data, tiny model, supervised warm start")
    with sampled_load() as load:
        meta["base"] = build_base(args.out / "base", args.seed, args.device, console, recipe=RECIPE)
    meta["base_load_mean"] = statistics.fmean(load)
    results: dict[str, Row] = {}
    title = f"GRPO, ARPO, AEPO on {RECIPE.task}: seed {args.seed}, {args.steps} steps, {meta['device']}"
    for i, name in enumerate(methods, 1):
        console.rule(f"[bold]{i}/{len(methods)} {name}")
        with sampled_load() as load:
            results[name] = attempt(
                name, args.out / "runs" / name,
                lambda run_dir, name=name: run_stage(METHODS[name], meta["base"], meta["shared_overrides"],
                                                     run_dir),
                read_run, describe, console)
        results[name]["load_mean"] = statistics.fmean(load)
        text = write_outputs(args.out, meta, results, tables(results), FIGURE, title, PANELS)

    return finish_comparison(console, text, args.out, FIGURE, results)


if __name__ == "__main__":
    run_comparison(main, "compare_agentic")
