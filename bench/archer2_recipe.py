"""The Archer2.0 recipe as published (examples/archer2_math_1.5b_entropy_trace.sh: Qwen2.5-1.5B's shape, 64 prompts
x 8 responses a step, 1024 + 1024 tokens, ASPO with KL, one PPO epoch (the trace run's; its base recipe has 3),
log_prob_micro_batch_size_per_gpu=1, the entropy trace, 2 GPUs) timed step by step: issue 26's goal is <= 15 s a
step on two 80 GB GPUs.

The script runs exactly as a user runs it (``bash examples/archer2_math_1.5b_entropy_trace.sh`` with its variables
set), on a random model of the shape with Qwen's 151,936-row vocabulary (bench/gpu_step.py) and math-like prompts of
long-tailed length (log-normal, median 150 tokens, at most 1000). Two things differ from the published run, both
forced by the random model: the reward is bench/trace_cost.py's digit share (the math reward gives a random model 0
everywhere, and the recipe's rejection sampling would then drop every group), and responses run to the 1024-token
limit (a random model draws eos about once in 150k tokens), so generation and the update see the longest rows the
recipe allows. Checkpoints and validation are off (``trainer.save_freq=-1``, ``trainer.test_freq=-1``).

    python bench/archer2_recipe.py --gpus 2 --steps 4 --json /tmp/archer2_recipe.json   # the goal's run
    python bench/archer2_recipe.py --tiny --steps 2                                     # CPU: the plumbing only
    python bench/archer2_recipe.py --gpus 2 --archer-override actor_rollout_ref.model.use_liger=true   # one key more

The run's own metrics.jsonl gives each step's time and stages (``timing_s/*``); the first step is warm-up. Each model
stage's MFU over the steady steps: 6 N D x ppo_epochs (update_actor) or 2 N D (old_log_prob, ref) over the stage's
seconds on all the GPUs at the bf16 peak (989 TFLOP/s, an H100's or H200's), N the model's parameters, D the step's
tokens (``perf/total_num_tokens``); gradient checkpointing's second forward is not counted as work. With
``--tiny`` the tiny shape runs on the CPU with small batches and lengths appended as overrides and rejection sampling
off (two responses of a tiny model often agree, and a step whose groups are all dropped trains nothing): a check
that the script and the recipe run, not a timing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from gpu_step import QWEN_VOCAB, build_random_model
from model_sizes import run
from omegaconf import OmegaConf
from scale_out import gpu_name, read_metrics
from trace_cost import DIGIT_REWARD
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from archer.models.loading import load_tokenizer

RECIPE = Path(__file__).resolve().parent.parent / "examples" / "archer2_math_1.5b_entropy_trace.sh"
GOAL_STEP_S = 15.0
BF16_PEAK_FLOPS = 989e12  # dense bf16 of an H100 / H200 SXM
TINY = ("trainer.device=cpu", "trainer.rejection_sample=False",  # 2 responses of a tiny model often agree: no step
        "trainer.n_gpus_per_node=1", "data.train_batch_size=4", "data.gen_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.max_prompt_length=64",
        "data.max_response_length=32", "actor_rollout_ref.rollout.max_model_len=96",
        "actor_rollout_ref.rollout.max_num_batched_tokens=96", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=96",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=96",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=96")


def stage_mfu(lines: list[dict], params: int, ppo_epochs: int, gpus: int) -> dict[str, float]:
    """MFU of update_actor, old_log_prob and ref (those the run timed) over ``lines``, the steady steps' metrics:
    the stage's FLOPs summed over the steps against its seconds on ``gpus`` GPUs at the bf16 peak."""
    passes = {"update_actor": 6 * ppo_epochs, "old_log_prob": 2, "ref": 2}
    out = {}
    for stage, flops_per_param_token in passes.items():
        seconds = sum(line.get(f"timing_s/{stage}", 0.0) for line in lines)
        if seconds > 0:
            flops = sum(flops_per_param_token * params * line["perf/total_num_tokens"] for line in lines)
            out[stage] = flops / (seconds * gpus * BF16_PEAK_FLOPS)
    return out


def parameter_count(model_dir: Path) -> int:
    """Parameters of the model folder's architecture (tied weights once), counted on the meta device."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def write_prompts(path: Path, tokenizer: PreTrainedTokenizerBase, rows: int, max_tokens: int, seed: int = 0) -> Path:
    """``rows`` math-like prompts of log-normal length (median 150 tokens, at most ``max_tokens``), in the recipe's
    schema (data_source math, a ground truth the digit reward does not read)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.exp(math.log(150) + 0.6 * torch.randn(rows, generator=gen)).long().clamp(16, max_tokens)
    records = []
    for i, length in enumerate(lengths.tolist()):
        text = "".join(f"Compute {i + k}+{k}-{2 * k}. " for k in range(length // 4 + 1))
        content = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:length])
        records.append({"data_source": "math", "prompt": [{"role": "user", "content": content}],
                        "ability": "math", "reward_model": {"style": "rule", "ground_truth": "42"},
                        "extra_info": {"index": i}})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def archer_shim(folder: Path) -> Path:
    """A folder with an ``archer`` executable that runs this checkout's archer (the recipe calls ``archer train``;
    a machine may have the package on PYTHONPATH only)."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "archer"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m archer.cli "$@"\n')
    shim.chmod(0o755)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2, help="N_GPUS_PER_NODE")
    parser.add_argument("--steps", type=int, default=4, help="training steps (the first is warm-up)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/archer2_recipe"))
    parser.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU: the plumbing only")
    parser.add_argument("--timeout", type=float, default=1500, help="seconds the run may take")
    parser.add_argument("--json", type=Path, help="write the record here")
    parser.add_argument("--archer-override", nargs="*", default=[],
                        help="overrides appended to the recipe's (e.g. actor_rollout_ref.model.use_liger=true)")
    args = parser.parse_args()
    shape = "tiny" if args.tiny else "qwen2.5-1.5b"
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    model_dir = build_random_model(args.workdir, shape, None if args.tiny else QWEN_VOCAB, dtype=torch.bfloat16,
                                   device=device)
    batch = 4 if args.tiny else 64
    train = write_prompts(args.workdir / "data" / "train.parquet", load_tokenizer(model_dir), batch * (args.steps + 1),
                          40 if args.tiny else 1000)
    reward = args.workdir / "digit_reward.py"
    reward.write_text(DIGIT_REWARD)
    run_dir = args.workdir / "run"
    env = {**os.environ, "MODEL_PATH": str(model_dir), "TRAIN_FILES": str(train), "VAL_FILES": str(train),
           "CKPTS_DIR": str(run_dir), "LOGGER": "[jsonl]", "N_GPUS_PER_NODE": str(args.gpus),
           "PATH": f"{archer_shim(args.workdir / 'bin')}:{os.environ.get('PATH', '')}"}
    overrides = [f"custom_reward_function.path={reward}", f"trainer.total_training_steps={args.steps}",
                 "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.resume_mode=disable",
                 *(TINY if args.tiny else ()), *args.archer_override]
    cmd = ["bash", str(RECIPE), *overrides]
    log = args.workdir / "train.log"
    os.environ.update(env)  # model_sizes.run starts the command with this process's environment
    ok, error = run(cmd, log, args.timeout)
    lines = read_metrics(run_dir)
    steps = [line["timing_s/step"] for line in lines]
    stages = sorted({k for line in lines for k in line if k.startswith("timing_s/") and k != "timing_s/step"})
    steady = lines[1:] or lines
    record = {"device": gpu_name() if device == "cuda" else "cpu", "gpus": args.gpus, "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "command": " ".join(["python", *sys.argv]),
              "recipe_command": " ".join(cmd), "ok": ok, "error": error or None, "log": str(log), "step_s": steps,
              "steady_step_s": statistics.median(s["timing_s/step"] for s in steady) if steady else None,
              "stages_s": {k.removeprefix("timing_s/"): statistics.median(s.get(k, 0.0) for s in steady)
                           for k in stages} if steady else {},
              "response_length_mean": [line.get("response_length/mean") for line in lines],
              "tokens": [line.get("perf/total_num_tokens") for line in lines]}
    config = run_dir / "config.yaml"
    if steady and config.is_file():
        resolved = OmegaConf.load(config)
        gpus = int(resolved.trainer.n_gpus_per_node) * int(resolved.trainer.nnodes)
        record["params"] = parameter_count(model_dir)
        record["stage_mfu"] = stage_mfu(steady, record["params"], int(resolved.actor_rollout_ref.actor.ppo_epochs), gpus)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    if record["steady_step_s"] is not None and not args.tiny:
        verdict = "met" if record["steady_step_s"] <= GOAL_STEP_S else "missed"
        print(f"steady step {record['steady_step_s']:.1f} s on {args.gpus} GPU(s) (goal <= {GOAL_STEP_S:.0f} s on 2: "
              f"{verdict}); stage MFU: " + ", ".join(f"{k} {v:.1%}" for k, v in record.get("stage_mfu", {}).items()))
    if not ok:
        raise SystemExit(f"the recipe's run failed: {error} (log: {log})")


if __name__ == "__main__":
    main()
