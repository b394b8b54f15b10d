"""archer's GRPO step against TRL's GRPOTrainer: the same random model, prompts and reward, one run, one GPU.

The workload (issue 11): a randomly initialised model of Qwen2.5-0.5B's shape with Qwen's 151,936-row
vocabulary (a small BPE tokenizer; the rows past it decode to nothing), 16 prompts of exactly 256 tokens x 8
samples, 512 new tokens at temperature 1, one optimiser step per batch in micro-batches of 32 responses, no KL,
float32 master weights with bf16 autocast on a GPU, a reward that is the share of digits in the response.

    python bench/grpo_vs_trl.py --out /tmp/gvt                         # GPU: the workload above
    python bench/grpo_vs_trl.py --out /tmp/gvt --shape tiny --steps 2  # CPU: a tiny model, short prompts

- **archer**: ``python -m archer.cli train`` with the overrides below (rollout.name=auto: the fast engine on a
  GPU); its stage times are the run's own ``timing_s/*`` from metrics.jsonl.
- **trl**: ``trl.GRPOTrainer`` (pip install -e ".[bench]") with num_generations=8, max_completion_length=512,
  beta=0, per_device_train_batch_size=32 x gradient_accumulation_steps=4 (one optimiser step per 16 prompts),
  bf16, use_vllm off (``model.generate``), the model loaded from the same folder at TRL's default dtype
  (float32). Gradient checkpointing, on by TRL's default, is off unless --trl-gradient-checkpointing (archer's
  own default is on since issue 14: pass actor_rollout_ref.model.enable_gradient_checkpointing=false through
  --archer-override to compare both without it). Its step is timed from the
  trainer's on_step_begin to on_step_end; "generate" is its ``_generate_single_turn`` (the ``model.generate``
  call), "score" the rest of ``_generate_and_score_completions`` (decoding, reward, advantages; no old-log-prob
  pass: TRL skips it when one optimiser step follows each generation), "update" the rest of the step (forward,
  backward and optimiser over the micro-batches). Every timer synchronises the GPU first.

A random model rarely draws eos, so both write (nearly) the full 512 tokens; the mean response length of each
is reported. The first step of each (warm-up, graph capture) is dropped: "steady" is the median of the rest.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transformers
from gpu_step import LLAMA_VOCAB, QWEN_VOCAB, build_random_model
from trace_cost import DIGIT_REWARD
from transformers import PreTrainedTokenizerBase

from archer.models.loading import load_tokenizer

DATA_SOURCE = "bench/digits"
# prompts, samples, prompt tokens, new tokens, micro-batch, padded vocabulary (None: the tokenizer's size)
WORKLOADS: dict[str, tuple[int, int, int, int, int, int | None]] = {
    "tiny": (4, 4, 32, 16, 8, None),
    "qwen2.5-0.5b": (16, 8, 256, 512, 32, QWEN_VOCAB),
    "qwen2.5-1.5b": (16, 8, 256, 512, 32, QWEN_VOCAB),
    "qwen2.5-3b": (16, 8, 256, 512, 32, QWEN_VOCAB),
    "qwen2.5-7b": (16, 8, 256, 512, 32, QWEN_VOCAB),
    "llama-3.1-8b": (16, 8, 256, 512, 32, LLAMA_VOCAB),
}


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, content: str) -> list[int]:
    """The prompt ids archer trains on (data/rl_dataset.py: template as text, then tokens, no special tokens)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def exact_prompts(tokenizer: PreTrainedTokenizerBase, count: int, length: int) -> list[str]:
    """``count`` distinct user messages whose chat prompt is exactly ``length`` tokens, as archer and TRL
    tokenise it. The tokenizer isolates every digit, so a digit appended to the message adds one token."""
    contents = []
    for i in range(count):
        text = "".join(f"Compute {i + k}+{k}-{2 * k}. " for k in range(length // 4 + 1))
        while len(chat_prompt_ids(tokenizer, text)) > length:
            text = text[: -max(1, (len(chat_prompt_ids(tokenizer, text)) - length) // 2)]
        while len(chat_prompt_ids(tokenizer, text)) < length:
            text += str(len(text) % 10)
        trl_ids = tokenizer.apply_chat_template(conversation=[[{"role": "user", "content": text}]],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"][0]
        if list(trl_ids) != chat_prompt_ids(tokenizer, text):
            raise RuntimeError(f"prompt {i}: TRL's tokenisation differs from archer's ({len(trl_ids)} tokens)")
        contents.append(text)
    return contents


def write_prompts(path: Path, contents: list[str]) -> Path:
    rows = [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": c}], "ability": "bench",
             "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": i}}
            for i, c in enumerate(contents)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def steady(values: list[float]) -> float:
    """The median over the steps after the first (warm-up); the only value when there is one step."""
    return statistics.median(values[1:] or values)


def workload_args(shape: str, **more: Any) -> argparse.Namespace:
    """The workload of ``shape`` as the attributes the functions here read (``more`` adds to them)."""
    prompts, n, prompt_length, response_length, micro_batch, vocab = WORKLOADS[shape]
    return argparse.Namespace(shape=shape, prompts=prompts, n=n, prompt_length=prompt_length,
                              response_length=response_length, micro_batch=micro_batch, vocab=vocab, **more)


def prepare_workload(out: Path, args: argparse.Namespace, prompt_count: int, **model: Any
                     ) -> tuple[Path, list[str], Path, Path]:
    """Under ``out``: the random model (``model``: build_random_model's dtype / device), ``prompt_count`` prompts of
    the exact length (their contents and the parquet file) and the reward file."""
    model_dir = build_random_model(out, args.shape, args.vocab, **model)
    contents = exact_prompts(load_tokenizer(model_dir), prompt_count, args.prompt_length)
    train_file = write_prompts(out / "data" / "train.parquet", contents)
    reward = out / "digit_reward.py"
    reward.write_text(DIGIT_REWARD)
    return model_dir, contents, train_file, reward


def archer_overrides(args: argparse.Namespace, model_dir: Path, train_file: Path, reward: Path) -> list[str]:
    """``archer train``'s overrides for the workload (the run's folder, steps and logging aside)."""
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={train_file}",
            f"custom_reward_function.path={reward}", "algorithm.adv_estimator=grpo",
            f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.rollout.n={args.n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
            f"data.max_prompt_length={args.prompt_length}", f"data.max_response_length={args.response_length}",
            "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
            "actor_rollout_ref.actor.entropy_coeff=0"]


def run_archer(args: argparse.Namespace, model_dir: Path, train_file: Path, reward: Path) -> dict[str, Any]:
    run = args.out / "archer_run"
    cmd = [sys.executable, "-m", "archer.cli", "train", *archer_overrides(args, model_dir, train_file, reward),
           f"trainer.total_training_steps={args.steps}",
           "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
           f"trainer.default_local_dir={run}", "trainer.resume_mode=disable", "trainer.logger=[jsonl]",
           "trainer.plots=false", *args.archer_override]
    subprocess.run(cmd, check=True)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    stage_keys = [k for k in lines[0] if k.startswith("timing_s/") and k != "timing_s/step"]
    return {"peer": "archer", "archer_command": " ".join(cmd[1:]),
            "step_s": [line["timing_s/step"] for line in lines],
            "stages_s": {k.removeprefix("timing_s/"): steady([line.get(k, 0.0) for line in lines])
                         for k in stage_keys},
            "response_length_mean": statistics.mean(line["response_length/mean"] for line in lines)}


def _synced() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def run_trl(args: argparse.Namespace, model_dir: Path, contents: list[str], reward: Path) -> dict[str, Any]:
    import datasets
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    namespace: dict[str, Any] = {}
    exec(compile(reward.read_text(), str(reward), "exec"), namespace)  # the reward archer runs
    compute_score: Callable[..., float] = namespace["compute_score"]

    def digit_share(completions: list, **_: Any) -> list[float]:
        return [compute_score(DATA_SOURCE, c[0]["content"], "") for c in completions]

    gen_s: list[float] = []
    score_s: list[float] = []
    lengths: list[float] = []

    class TimedGRPOTrainer(trl.GRPOTrainer):
        def _generate_single_turn(self, *a: Any, **kw: Any) -> Any:
            start = _synced()
            completion_ids, logprobs = super()._generate_single_turn(*a, **kw)
            gen_s.append(_synced() - start)
            lengths.append(statistics.mean(len(ids) for ids in completion_ids))
            return completion_ids, logprobs

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            start = _synced()
            out = super()._generate_and_score_completions(inputs)
            score_s.append(_synced() - start - gen_s[-1])
            return out

    step_s: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.start = _synced()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            step_s.append(_synced() - self.start)

    rows = args.prompts * args.n
    config = trl.GRPOConfig(
        output_dir=str(args.out / "trl_run"), num_generations=args.n, max_completion_length=args.response_length,
        beta=0.0, num_iterations=1, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rows // args.micro_batch, learning_rate=1e-6, temperature=1.0, top_p=1.0,
        top_k=0, use_vllm=False, bf16=torch.cuda.is_available(), gradient_checkpointing=bool(getattr(args, "trl_gradient_checkpointing", False)),
        max_steps=args.trl_steps, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        seed=1, dataloader_num_workers=0)
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": c}]} for c in contents])
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    trainer = TimedGRPOTrainer(model=str(model_dir), reward_funcs=digit_share, args=config,
                               train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    update_s = [s - g - c for s, g, c in zip(step_s, gen_s, score_s)]
    peak = torch.cuda.max_memory_allocated() / (1 << 30) if torch.cuda.is_available() else None
    return {"peer": "trl", "trl_version": trl.__version__, "step_s": step_s, "max_memory_allocated_gb": peak,
            "stages_s": {"generate": steady(gen_s), "score": steady(score_s), "update": steady(update_s)},
            "response_length_mean": statistics.mean(lengths)}


RATIO_GOALS = {"qwen2.5-0.5b": 0.2, "qwen2.5-1.5b": 0.25}  # issue 26's archer / TRL step goals (others: 1/3)


def report(records: list[dict[str, Any]]) -> str:
    """One table: each peer's steady step, first step, mean response length and stage times, and the ratio."""
    lines = ["| peer | steady step s | first step s | steps | response length mean | stages (steady, s) |",
             "|---|---|---|---|---|---|"]
    for r in records:
        stages = ", ".join(f"{k} {v:.2f}" for k, v in r["stages_s"].items())
        lines.append(f"| {r['peer']} | {r['steady_step_s']:.2f} | {r['step_s'][0]:.2f} | {len(r['step_s'])} | "
                     f"{r['response_length_mean']:.1f} | {stages} |")
    by_peer = {r["peer"]: r["steady_step_s"] for r in records}
    if {"archer", "trl"} <= by_peer.keys():
        ratio = by_peer["archer"] / by_peer["trl"]
        goal = RATIO_GOALS.get(records[0].get("shape", ""), 1 / 3)
        lines.append(f"\narcher / trl steady step: {ratio:.3f} (goal <= {goal:.3g}: {'met' if ratio <= goal else 'missed'})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(WORKLOADS), default="qwen2.5-0.5b")
    parser.add_argument("--steps", type=int, default=4, help="archer's steps (the first is warm-up)")
    parser.add_argument("--trl-steps", type=int, default=None, help="TRL's steps (default: --steps)")
    parser.add_argument("--peers", nargs="+", choices=("archer", "trl"), default=["archer", "trl"])
    parser.add_argument("--archer-override", nargs="*", default=[], help="more archer train overrides")
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="TRL with gradient checkpointing (its default; archer's default since issue 14)")
    args = workload_args(**vars(parser.parse_args()))
    args.trl_steps = args.trl_steps or args.steps
    if args.prompts * args.n % args.micro_batch:
        raise SystemExit("the micro-batch must divide the batch")
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, contents, train_file, reward = prepare_workload(args.out, args,
                                                               args.prompts * max(args.steps, args.trl_steps))
    common = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "transformers": transformers.__version__, "shape": args.shape, "prompts": args.prompts, "n": args.n,
              "prompt_length": args.prompt_length, "response_length": args.response_length,
              "micro_batch": args.micro_batch, "vocab": args.vocab, "command": " ".join(["python", *sys.argv])}
    records = []
    for peer in args.peers:
        record = (run_archer(args, model_dir, train_file, reward) if peer == "archer"
                  else run_trl(args, model_dir, contents, reward))
        record = {**common, **record, "steady_step_s": steady(record["step_s"])}
        records.append(record)
        print(json.dumps(record), flush=True)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    print(f"\n{args.shape}: {args.prompts} prompts x {args.n}, prompt {args.prompt_length}, "
          f"{args.response_length} new tokens, micro-batch {args.micro_batch} on {common['device']}")
    print(report(records))


if __name__ == "__main__":
    main()
