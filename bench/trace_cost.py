"""What the entropy and influence traces cost, as a share of the RL step, measured side by side.

Runs the same GRPO steps (same model, data and seed) three times: without traces, with the entropy trace, and
with the influence trace at its defaults (the seven projections of every decoder layer, output function
training_loss), and prints per-variant medians over the steps after the first (warm-up):

    python bench/trace_cost.py --out /tmp/tc                 # CPU: the quickstart's GRPO stage, SFT'd model
    python bench/trace_cost.py --out /tmp/tc --shape qwen2.5-0.5b --batch 32 --n 8 --response-length 256
    python bench/trace_cost.py --out /tmp/tc --shape qwen2.5-0.5b --grpo-workload   # bench/grpo_vs_trl.py's

The first form runs `archer quickstart` for one RL step to get the warm-started model, then times the
quickstart's own RL configuration. The second builds a random model of a real shape (bench/gpu_step.py) and
rewards the share of digits in a response, so prompt groups have mixed rewards and the influence trace has
work to do (short arithmetic prompts, a KL loss, two optimiser steps per batch). With ``--grpo-workload`` it
runs archer's half of bench/grpo_vs_trl.py instead: that script's model, prompts of exactly 256 tokens, 16 x 8
responses of 512 tokens, one optimiser step, no KL (``--batch``, ``--n`` and ``--response-length`` do not
apply). The trace cost is read from the run's own timings (timing_s/entropy_trace, timing_s/influence_*),
and the hook overhead from timing_s/update_actor against the run without traces (identical work: same seed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from gpu_step import build_random_model

from archer.data.tasks import write_task_files
from archer.trainer.quickstart import RL_OVERRIDES

VARIANTS = {
    "none": [],
    "entropy": ["+trainer.entropy_trace.enable=True"],
    "influence": ["+trainer.influence_trace.enable=True"],
}
DIGIT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''


def quickstart_setup(out: Path) -> list[str]:
    """The quickstart's RL-stage arguments (its traces off), pointed at a warm-started model (made once)."""
    if not (out / "quickstart" / "summary.json").is_file():
            subprocess.run([sys.executable, "-m", "archer.cli", "quickstart", "--out", str(out / "quickstart"),
                        "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1"],
                       check=True)
    summary = json.loads((out / "quickstart" / "summary.json").read_text())
    return [f"actor_rollout_ref.model.path={summary['sft_model_path']}", f"data.train_files={summary['train_files'][0]}",
            *[o for o in RL_OVERRIDES if not o.startswith(("trainer.total_training_steps", "trainer.test_freq",
                                                           "trainer.entropy_trace", "trainer.influence_trace"))]]


def grpo_workload_setup(out: Path, args: argparse.Namespace) -> list[str]:
    """bench/grpo_vs_trl.py's workload of ``args.shape``, archer's overrides for it."""
    import grpo_vs_trl  # here, not at the top: grpo_vs_trl imports this module

    workload = grpo_vs_trl.workload_args(args.shape)
    model_dir, _, train_file, reward = grpo_vs_trl.prepare_workload(out, workload, workload.prompts * args.steps)
    return grpo_vs_trl.archer_overrides(workload, model_dir, train_file, reward)


def random_model_setup(out: Path, args: argparse.Namespace) -> list[str]:
    model_dir = build_random_model(out, args.shape)
    files = write_task_files("arithmetic", out / "data", n_train=1000, n_val=16, n_sft=10, seed=0)
    reward = out / "digit_reward.py"
    reward.write_text(DIGIT_REWARD)
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={files['train']}",
            f"custom_reward_function.path={reward}", "algorithm.adv_estimator=grpo",
            f"data.train_batch_size={args.batch}", f"actor_rollout_ref.rollout.n={args.n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch // 2}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32", "data.max_prompt_length=64",
            f"data.max_response_length={args.response_length}", "actor_rollout_ref.actor.use_kl_loss=true"]


def run_variant(out: Path, base: list[str], name: str, steps: int) -> list[dict]:
    run = out / f"run_{name}"
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "archer.cli", "train", *base, *VARIANTS[name],
           f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
           "trainer.save_freq=-1", f"trainer.default_local_dir={run}", "trainer.resume_mode=disable",
           "trainer.logger=[jsonl]", "trainer.plots=false"]
    subprocess.run(cmd, check=True)
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def median(lines: list[dict], key: str) -> float:
    values = [line[key] for line in lines if key in line]
    return statistics.median(values) if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default=None, help="random model of this shape (see bench/gpu_step.py)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--grpo-workload", action="store_true",
                        help="with --shape: bench/grpo_vs_trl.py's workload of that shape")
    args = parser.parse_args()
    if args.grpo_workload and not args.shape:
        parser.error("--grpo-workload needs --shape (one of bench/grpo_vs_trl.py's workloads)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.grpo_workload:
        base = grpo_workload_setup(args.out, args)
    else:
        base = random_model_setup(args.out, args) if args.shape else quickstart_setup(args.out)
    results = {name: run_variant(args.out, base, name, args.steps)[1:] for name in VARIANTS}

    none = results["none"]
    step, update = median(none, "timing_s/step"), median(none, "timing_s/update_actor")
    print(f"\nmedians over steps 2..{args.steps}; no traces: step {step:.3f} s, update_actor {update:.3f} s")
    print("| variant | step s | update_actor s | trace on the step s | update_actor vs no trace | cost share of step "
          "| selected responses | traced tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for name, lines in results.items():
        v_update = median(lines, "timing_s/update_actor")
        # What the training thread spends on the trace (array copies, scoring; files are written off-thread).
        own = sum(median(lines, k) for k in ("timing_s/entropy_trace", "timing_s/influence_score",
                                             "timing_s/influence_write"))
        hooks = max(v_update - update, 0.0) if name == "influence" else 0.0  # only influence touches the update
        print(f"| {name} | {median(lines, 'timing_s/step'):.3f} | {v_update:.3f} | {own:.4f} | {v_update / update:.3f}x | "
              f"{100 * (own + hooks) / step:.2f}% | {median(lines, 'influence/selected_responses'):.0f} | "
              f"{median(lines, 'influence/traced_tokens'):.0f} |")


if __name__ == "__main__":
    main()
