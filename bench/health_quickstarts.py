"""The health checks on healthy runs: both quickstarts (arithmetic and tool) at their default seed and two others,
or with the presets of archer/config/algorithm (``--algorithms``), run one after the other, each checked for
flags while it trained and by a replay afterwards.

For each run it reads the RL stage's ``health.jsonl`` (the flags raised while training), replays the checks
with the current code and default thresholds over its ``metrics.jsonl`` alone (what CI's test does with the
stored fixtures) and over its metrics plus entropy trace (what ``archer health`` does), and times the checks
(``timing_s/health`` of every step: building the step's rows and running the checks). With ``--fixtures DIR``
it stores what the CI test needs, small: each run's metrics.jsonl without its timing, memory and influence
keys, and its health.jsonl (no config.yaml: the test replays with the defaults of the day).

    python bench/health_quickstarts.py --out runs/health_quickstarts --fixtures tests/fixtures/health/quickstarts
    python bench/health_quickstarts.py --out runs/health_quickstarts --skip-existing   # replay finished runs only
    python bench/health_quickstarts.py --out runs/health_presets --tasks arithmetic --seeds 1 --algorithms dapo rloo

Prints a Markdown table (device, date and command above it) for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from archer.health.engine import Flag
from archer.health.monitor import HEALTH_FILE
from archer.health.offline import replay
from archer.step_lines import METRICS_FILE, read_step_records

TASKS = ("arithmetic", "tool_arithmetic")
DROPPED = ("timing_s/", "perf/", "influence/", "prompt_length/")  # keys no check reads


def run_quickstart(out: Path, task: str, seed: int, algorithm: str | None) -> None:
    command = [sys.executable, "-m", "archer.cli", "quickstart", "--out", str(out), f"task={task}", f"seed={seed}"]
    if algorithm is not None:
        command.append(f"algorithm={algorithm}")
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def counts(flags: list[Flag]) -> str:
    by = {s: sum(f.severity == s for f in flags) for s in ("warning", "critical", "info")}
    return " / ".join(str(by[s]) for s in ("warning", "critical", "info"))


def same_flags(live: list[Flag], replayed: list[Flag]) -> bool:
    """The same flags, pointers and figures, numbers to 1e-5 relative (the trace stores float32: a replay's
    pointer values differ from the live float64 ones in the 7th digit)."""

    def close(a: Any, b: Any) -> bool:
        if isinstance(a, float) or isinstance(b, float):
            return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-5)
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(map(close, a, b))
        return a == b

    return close([f.to_json() for f in live], [f.to_json() for f in replayed])


def store_fixture(rl: Path, fixture: Path) -> None:
    fixture.mkdir(parents=True, exist_ok=True)
    records = [{k: v for k, v in r.items() if not k.startswith(DROPPED)} for r in read_step_records(rl / METRICS_FILE)]
    (fixture / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    (fixture / HEALTH_FILE).write_text((rl / HEALTH_FILE).read_text())


def measure(out: Path) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    rl = Path(summary["rl_run_dir"])
    live = [Flag.from_json(r) for r in read_step_records(rl / HEALTH_FILE)]
    seconds = [r["timing_s/health"] for r in read_step_records(rl / METRICS_FILE) if "timing_s/health" in r]
    with_trace = replay(rl)
    metrics_dir = out / "metrics_only"  # the metrics alone, as the CI fixture holds them
    store_fixture(rl, metrics_dir)
    metrics_only = replay(metrics_dir)
    return {"task": summary["task"], "seed": summary["seed"], "before": summary["val_acc_before_rl"],
            "after": summary["val_acc_after_rl"], "steps": summary["steps"], "live": live,
            "replay": with_trace.flags, "metrics_only": metrics_only.flags,
            "same": same_flags(live, with_trace.flags),
            "ms_mean": 1000 * statistics.mean(seconds), "ms_max": 1000 * max(seconds), "rl_s": summary["rl_wall_time_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/health_quickstarts"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--algorithms", nargs="+", default=[None], metavar="NAME",
                        help="presets of archer/config/algorithm to run the RL stage with (default: the quickstart's "
                        "own GRPO); a preset's run is <task>_<NAME>_seed<N>")
    parser.add_argument("--fixtures", type=Path, default=None, help="store each run's fixture under DIR/<task>_seed<N>")
    parser.add_argument("--skip-existing", action="store_true", help="replay runs already in --out, run the others")
    args = parser.parse_args()
    rows = []
    for task in args.tasks:
        for algorithm in args.algorithms:
            for seed in args.seeds:
                name = f"{task}_seed{seed}" if algorithm is None else f"{task}_{algorithm}_seed{seed}"
                out = args.out / name
                if not (args.skip_existing and (out / "summary.json").is_file()):
                    started = time.perf_counter()
                    run_quickstart(out, task, seed, algorithm)
                    print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
                row = {**measure(out), "algorithm": algorithm or "grpo (the quickstart's)"}
                if args.fixtures is not None:
                    rl = Path(json.loads((out / "summary.json").read_text())["rl_run_dir"])
                    store_fixture(rl, args.fixtures / name)
                rows.append(row)
    print(f"device: {platform.processor() or platform.machine()} CPU, {time.strftime('%Y-%m-%d')}; command: "
          f"python {' '.join(shlex.quote(a) for a in sys.argv)}\n")
    print("| task | algorithm | seed | val acc before -> after | steps | flags while training (warning / critical / info) | "
          "replay with the trace | replay of metrics alone | replay = live | checks ms per step (mean / max) | "
          "RL wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['algorithm']} | {r['seed']} | {r['before']:.3f} -> {r['after']:.3f} | {r['steps']} | {counts(r['live'])} | "
              f"{counts(r['replay'])} | {counts(r['metrics_only'])} | {'yes' if r['same'] else 'no'} | "
              f"{r['ms_mean']:.1f} / {r['ms_max']:.1f} | {r['rl_s']:.0f} |")
    for r in rows:
        for flag in r["live"] + r["replay"]:
            print(f"{r['task']} {r['algorithm']} seed {r['seed']}: {flag.line()}")


if __name__ == "__main__":
    main()
