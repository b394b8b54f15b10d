"""Measures the warm start of `archer quickstart task=tool_arithmetic` on its validation set, greedy:
accuracy without the tool (plain generation, as a rollout without tools runs), how often the output calls
the tool, and accuracy when each call is executed (the Python tool's output appended as ARPO's loop does).

    python bench/tool_warm_start.py --out runs/bench_tool_ws [--seed 1] [--knob tool_fraction=0.3] [--sft KEY=VALUE]

The tool execution here is a stand-in for archer's multi-turn rollout loop (one call per response, as the
quickstart's call_limit=1): once `archer train` runs tools, its validation before RL gives the same figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from rich.console import Console

from archer.cli import _parse_knob
from archer.data.tasks.tool_arithmetic import RESULT_FRAME, tool_solution
from archer.models.loading import load_causal_lm, load_tokenizer
from archer.rewards.routing import default_compute_score
from archer.rollout.base import SamplingParams
from archer.rollout.hf_engine import HFGenerateEngine
from archer.tools.python_tool import PythonTool
from archer.trainer.quickstart import RECIPES, TOOL_TASK, warm_start

MAX_NEW_TOKENS = 64
CALL = re.compile(r"<python>(.*?)</python>", re.DOTALL)


def _generate(engine: HFGenerateEngine, prompts: list[list[int]], strip_output: bool,
              forced: list[int]) -> tuple[list[bool], list[str], list[str]]:
    """Greedy responses that start with the ``forced`` tokens: whether each called the tool, its text up to the
    call (or whole), and its text with the call executed and the response continued."""
    tokenizer, tool = engine.tokenizer, PythonTool()
    session = engine.session()
    seqs = [session.add(p + forced, seed=0) for p in prompts]
    greedy = SamplingParams(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, stop=("</python>",))
    first = session.decode(seqs, greedy, [MAX_NEW_TOKENS - len(forced)] * len(seqs))
    called = [s.finish_reason == "stop" for s in first]
    budgets = []
    for seq, prompt, did in zip(seqs, prompts, called, strict=True):
        if did:
            text = tokenizer.decode(session.tokens(seq)[len(prompt):], skip_special_tokens=True)
            output = tool.execute(CALL.findall(text)[-1]).text
            output = output.rstrip("\n") if strip_output else output
            # the frame and the answer tokenised apart, as the loop does
            for piece in (RESULT_FRAME[0], output, RESULT_FRAME[1]):
                session.extend(seq, tokenizer.encode(piece, add_special_tokens=False))
        budgets.append(max(MAX_NEW_TOKENS - (len(session.tokens(seq)) - len(prompt)), 0) if did else 0)
    plain = [tokenizer.decode(session.tokens(s)[len(p):], skip_special_tokens=True) for s, p in zip(seqs, prompts)]
    session.decode(seqs, SamplingParams(do_sample=False, max_new_tokens=MAX_NEW_TOKENS), budgets)
    full = [tokenizer.decode(session.tokens(s)[len(p):], skip_special_tokens=True) for s, p in zip(seqs, prompts)]
    return called, plain, full


def evaluate(model_dir: Path, val_file: Path, strip_output: bool) -> dict[str, object]:
    tokenizer = load_tokenizer(model_dir)
    engine = HFGenerateEngine(load_causal_lm(model_dir, device="cpu", dtype=torch.float32), tokenizer)
    rows = pq.read_table(val_file).to_pylist()
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False) for r in rows]

    def acc(texts: list[str]) -> float:
        return sum(default_compute_score(r["data_source"], t, r["reward_model"]["ground_truth"])["acc"]
                   for r, t in zip(rows, texts, strict=True)) / len(rows)

    called, plain, full = _generate(engine, prompts, strip_output, [])
    # the ceiling RL can reach by calling the tool: each response forced to start with the call's first token
    call_start = tokenizer.encode(tool_solution("1*1", 1), add_special_tokens=False)[:1]
    _, _, forced = _generate(engine, prompts, strip_output, call_start)
    return {"acc_without_tool": acc(plain), "tool_call_rate": sum(called) / len(rows), "acc_with_tool": acc(full),
            "acc_when_forced_to_call": acc(forced), "examples": full[:4], "forced_examples": forced[:4]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_tool_ws"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--knob", action="append", default=[], help="task knob NAME=VALUE over the recipe's")
    parser.add_argument("--n-sft", type=int, default=None)
    parser.add_argument("--sft", action="append", default=[], help="archer sft override over the recipe's")
    parser.add_argument("--strip-output", action="store_true",
                        help="drop the tool output's final newline (a loop that strips answers, as ARPO's tool does)")
    parser.add_argument("--eval-only", action="store_true", help="evaluate the warm start already in --out")
    args = parser.parse_args()
    recipe = RECIPES[TOOL_TASK]
    recipe = dataclasses.replace(recipe, knobs={**recipe.knobs, **dict(map(_parse_knob, args.knob))},
                                 n_sft=args.n_sft or recipe.n_sft)
    start = time.perf_counter()
    if args.eval_only:
        files, model = {"val": args.out / "data" / "val.parquet"}, args.out / "sft" / "hf_model"
    else:
        files, model = warm_start(args.out, args.seed, Console(), sft_extra=args.sft, recipe=recipe)
    warm_s = time.perf_counter() - start
    result = evaluate(model, files["val"], args.strip_output)
    result |= {"warm_start_s": warm_s, "eval_s": time.perf_counter() - start - warm_s, "knobs": recipe.knobs,
               "n_sft": recipe.n_sft, "sft": args.sft}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
