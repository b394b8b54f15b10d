"""Agentic rollouts against a plain one (issue 24): what tools, ARPO's refills and branches and real tool calls
cost in the generation stage, on archer's fast engine, one call per row after a warm-up.

Workload (issue 24's): a random Qwen2.5-1.5B-shaped bfloat16 model with Qwen's 151,936-row vocabulary; ARPO's
first training prompts (``--prompts`` of them, 16) rendered with the chat template and encoded by a byte-level
BPE of 277 tokens trained on arithmetic text (bench/gpu_step.py's), so 1,113-1,403 tokens each (none reaches
the ``--prompt-len`` 1536 left cut); ``--n`` 8 responses of at most ``--new`` 512 tokens.

A random model never stops, so a script decides where each response ends and which turns call the Python tool
(``ScriptedTurns`` of archer/rollout/simulated_turns.py, wrapped around the engine's own session): a response's length is drawn from a log-normal
(median ``--median-len`` 220 tokens, sigma 0.6, clipped to 16..512: about 7% reach 512); with tools, its first
turn ends with a call with probability ``--tool-rate`` (0.5), each later turn with 0.3 (at most 3 calls), after
16 tokens to half of what is left; the call's text (``<python>print(N)</python>``, N random) is appended to the
turn as the model's tokens (the engine prefills them with the answer). Every turn's tokens are the model's own
samples. The plain row's rows end at the lengths the script draws for the same (prompt, sample), so both decode
the same number of tokens. The Python tool is a stand-in that sleeps like archer's sandbox did on the dev
machine (2026-11-28, ``PythonTool``: a plain snippet 0.11-0.21 s, numpy 0.37-0.45 s, sympy 1.2-1.35 s): 0.12 s
for 60% of calls, 0.40 s for 25%, 1.3 s for 15%, each +-20%, drawn from the call's text.

Rows (``--rows``): ``plain`` (FastEngine.generate, GRPO), ``tools_idle`` (the agentic loop with the Python tool
configured, never called), ``arpo_refills`` (ARPO, initial_rollouts=4 of n=8, beam 2, no call: 64 refills),
``tools`` (calls in --tool-rate of the responses, no branching), ``arpo_tools`` (ARPO with calls and branches),
and the ``*_rounds`` variants of the last three: the same loop with the engine driven round by round
(RoundSession), as the loop ran before issue 24. Goals: tools_idle <= 1.05x plain, arpo_refills <= 1.15x
plain, and with tool calls the stage <= 1.1x its critical time (``rollout/longest_trajectory_share`` >= 0.91).

The HBM bound of a row: every decode step reads the weights once, and every sampled token its row's keys and
values (the mean context of the row's tokens); over the card's bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s).

    python bench/agentic_rollout.py --export-prompts /tmp/arpo_prompts.json     # where ARPO's data is
    python bench/agentic_rollout.py --prompts-file /tmp/arpo_prompts.json --json results.json
    python bench/agentic_rollout.py --shape tiny --vocab 512 --device cpu --prompts 2 --n 4 --new 48 \\
        --prompt-len 64 --median-len 24 --repeats 1 --latency-scale 0.05      # a check on a CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
from gpu_step import QWEN_VOCAB, SHAPES
from transformers import Qwen2Config, Qwen2ForCausalLM

from archer.models.tiny import train_tokenizer
from archer.rollout.agentic import AgenticRollout, LoopSettings
from archer.rollout.base import (
    ContinuousSession,
    RolloutEngine,
    RoundSession,
    SamplingParams,
)
from archer.rollout.branching import BranchSettings
from archer.rollout.call_formats import ArpoTags
from archer.rollout.fast import FastEngine
from archer.rollout.fast.pages import Sequence, page_bytes
from archer.rollout.fast.sampling import noise_key
from archer.rollout.fast.scheduler import Job
from archer.rollout.prompt_rounds import stream_seed
from archer.rollout.simulated_turns import ScriptedTurns, TurnScript
from archer.tools import Tool, ToolRegistry, ToolResult

_REPO = Path(__file__).resolve().parents[1]
ARPO_DATA = next((p for p in (_REPO.parent / "shared", _REPO.parents[1] / "shared") if p.is_dir()),
                 _REPO.parent / "shared") / "data" / "arpo" / "train_10k.parquet"  # ../shared beside the checkout
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s
CALL_LIMIT = 3
LATENCIES = ((0.60, 0.12), (0.25, 0.40), (0.15, 1.30))  # (share of calls, seconds): archer's sandbox, see above
ROWS = ("plain", "tools_idle", "arpo_refills", "tools", "arpo_tools", "arpo_refills_rounds", "tools_rounds",
        "arpo_tools_rounds")


# -- the script ----------------------------------------------------------------------------------------------------
class ScriptedEngine(RolloutEngine):
    """The fast engine, its sessions scripted (archer/rollout/simulated_turns.py; ``rounds``: driven round by
    round)."""

    def __init__(self, engine: FastEngine, script: TurnScript, rounds: bool) -> None:
        self.engine, self.script, self.rounds = engine, script, rounds
        self.last: ContinuousSession | None = None

    def session(self):
        scripted = ScriptedTurns(self.engine.session(), self.script, self.engine.tokenizer)
        self.last = scripted
        return RoundSession(scripted) if self.rounds else scripted

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    def sync_weights(self, weights) -> None:
        self.engine.sync_weights(weights)

    def release_memory(self, weights: bool = False) -> None:
        self.engine.release_memory(weights)

    def reclaim_memory(self) -> None:
        self.engine.reclaim_memory()


class SandboxLatency(Tool):
    """The Python tool's stand-in: answers after the latency archer's sandbox took (LATENCIES), drawn from the call,
    times ``scale`` (a training run names it by ``tool_instances.python.class_path=agentic_rollout.SandboxLatency``
    with bench/ on PYTHONPATH)."""

    def __init__(self, name: str = "python", *, trigger_tag: str = "python", scale: float = 1.0) -> None:
        super().__init__(name, trigger_tag)
        self.scale = scale

    def execute(self, text: str) -> ToolResult:
        time.sleep(self.latency(text) * self.scale)
        return ToolResult("42")

    @staticmethod
    def latency(text: str) -> float:
        u = zlib.crc32(text.encode()) / 2**32
        jitter = 0.8 + 0.4 * (zlib.crc32(text.encode()[::-1]) / 2**32)
        shares = [share for share, _ in LATENCIES]
        kind = next((i for i in range(len(shares)) if u < sum(shares[: i + 1])), len(shares) - 1)
        return LATENCIES[kind][1] * jitter


# -- the rows ------------------------------------------------------------------------------------------------------
def turn_script(args, tool_rate: float) -> TurnScript:
    """The module docstring's script: lengths of median --median-len, sigma 0.6, up to --new tokens."""
    return TurnScript(median=args.median_len, sigma=0.6, limit=args.new, tool_rate=tool_rate, calls=CALL_LIMIT)


def plain_generate(engine: FastEngine, prompts: list[list[int]], n: int, seed: int, script: TurnScript) -> int:
    """FastEngine.generate's own jobs (each prompt prefilled once, n forks of it), each row's budget the length the
    script draws for its (prompt, sample); returns the tokens generated."""
    parents = [Sequence(list(p), key=0) for p in prompts]
    jobs = [Job(budget=script.length(random.Random(stream_seed(seed, 0, i, j))), parent=parent,
                key=noise_key(seed, i * n + j))
            for i, parent in enumerate(parents) for j in range(n)]
    engine.reclaim_memory()
    with torch.no_grad():
        engine.scheduler.run(engine.cache, jobs, SamplingParams(n=n, max_new_tokens=script.limit, seed=seed))
    for seq in parents + [job.seq for job in jobs]:
        engine.cache.release(seq)
    return sum(len(job.tokens) for job in jobs)


def row_settings(row: str, n: int) -> tuple[float, BranchSettings | None]:
    """(tool rate, branching) of a row."""
    base = row.removesuffix("_rounds")
    arpo = BranchSettings(n=n, initial_rollouts=n // 2, beam_size=2, branch_probability=0.5, entropy_weight=0.2)
    return {"tools_idle": (0.0, None), "arpo_refills": (0.0, arpo), "tools": (None, None),
            "arpo_tools": (None, arpo)}[base]


def synced(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def run_row(row: str, engine: FastEngine, tokenizer, prompts: list[list[int]], args, seed: int) -> dict:
    script = turn_script(args, args.tool_rate)
    before = engine.scheduler.counters
    steps0, tokens0 = before.steps, before.tokens
    if row == "plain":
        generated, seconds = synced(lambda: plain_generate(engine, prompts, args.n, seed, script))
        steps = engine.scheduler.counters.steps - steps0
        tokens = engine.scheduler.counters.tokens - tokens0
        return {"row": row, "seed": seed, "gen_s": seconds, "tokens": generated, "decode_steps": steps,
                "decode_tokens": tokens, "responses": len(prompts) * args.n,
                "mean_context": statistics.mean(len(p) for p in prompts) + generated / (2 * len(prompts) * args.n)}
    rate, branching = row_settings(row, args.n)
    wrapped = ScriptedEngine(engine, turn_script(args, args.tool_rate if rate is None else rate),
                             row.endswith("_rounds"))
    registry = ToolRegistry([SandboxLatency(scale=args.latency_scale)], call_limit=CALL_LIMIT, max_workers=64,
                            timeout=120.0, retry_count=0)
    loop = AgenticRollout(wrapped, tokenizer, registry, ArpoTags(registry),
                          LoopSettings(response_length=args.new, call_limit=CALL_LIMIT))
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new, seed=seed)
    out, seconds = synced(lambda: loop.generate(prompts, params, branching))
    registry.executor.close()
    metrics = out.stats.metrics()
    learned = out.response_mask.sum(1).float()
    present = (out.response_mask + out.tool_mask).sum(1).float()
    return {"row": row, "seed": seed, "gen_s": seconds, "tokens": int(learned.sum()),
            "decode_steps": engine.scheduler.counters.steps - steps0,
            "decode_tokens": engine.scheduler.counters.tokens - tokens0, "responses": len(out.responses),
            "mean_context": statistics.mean(len(p) for p in prompts) + float(present.mean()) / 2,
            "critical_s": out.stats.critical_s,
            **{k: v for k, v in metrics.items() if k.startswith("rollout/") or k in (
                "tools/python/calls", "tools/calls_per_response", "tools/invalid_calls")}}


def hbm_bound_s(record: dict, spec, dtype: torch.dtype, weight_bytes: int, bandwidth: float) -> float:
    """Seconds to read the weights every decode step and every sampled token's keys and values once."""
    kv_per_token = page_bytes(spec, 1, dtype)
    return (record["decode_steps"] * weight_bytes + record["decode_tokens"] * record["mean_context"] * kv_per_token) \
        / bandwidth


# -- setup ---------------------------------------------------------------------------------------------------------
def prompt_messages(args) -> list[list[dict]]:
    if args.prompts_file:
        return json.loads(args.prompts_file.read_text())[: args.prompts]
    import pyarrow.parquet as pq
    return [r["prompt"] for r in pq.read_table(args.data).slice(0, args.prompts).to_pylist()]


def build(args):
    texts = [f"Compute {i}+{i + 1}-{i + 2}. The answer is {i - 1}." for i in range(2000)]
    tokenizer = train_tokenizer(texts, 400)  # gpu_step's: 277 tokens
    prompts = []
    for messages in prompt_messages(args):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"][-args.prompt_len:])  # left cut
    hidden, layers, heads, kv, inter = SHAPES[args.shape]
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                         max_position_embeddings=args.prompt_len + args.new + 64, rope_theta=1e6,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    engine = FastEngine(model, tokenizer, device=device, gpu_memory_utilization=args.util,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.prompt_len + args.new)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return tokenizer, prompts, engine, weight_bytes


def summarize(records: list[dict], args) -> dict:
    by_row: dict[str, list[dict]] = {}
    for r in records:
        by_row.setdefault(r["row"], []).append(r)
    plain = statistics.mean(r["gen_s"] for r in by_row.get("plain", [])) if "plain" in by_row else None
    table = {}
    for row, rs in by_row.items():
        gen = statistics.mean(r["gen_s"] for r in rs)
        entry = {"gen_s": [round(r["gen_s"], 3) for r in rs], "gen_s_mean": round(gen, 3),
                 "hbm_fraction": round(statistics.mean(r["hbm_bound_s"] / r["gen_s"] for r in rs), 3),
                 "vs_plain": round(gen / plain, 3) if plain else None}
        for key in ("rollout/longest_trajectory_share", "rollout/decode_occupancy", "rollout/decode_batch_mean",
                    "rollout/tool_wait_s", "rollout/refills", "rollout/branches", "tools/python/calls"):
            values = [r[key] for r in rs if key in r]
            if values:
                entry[key] = round(statistics.mean(values), 3)
        table[row] = entry
    goals = {}
    if plain:
        for row, bound in (("tools_idle", 1.05), ("arpo_refills", 1.15)):
            if row in table:
                goals[f"{row} <= {bound}x plain"] = table[row]["vs_plain"] <= bound
    for row in ("tools", "arpo_tools"):
        if row in table and "rollout/longest_trajectory_share" in table[row]:
            goals[f"{row}: stage <= 1.1x its critical time"] = 1 / table[row]["rollout/longest_trajectory_share"] <= 1.1
    return {"rows": table, "goals": goals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vocab", type=int, default=QWEN_VOCAB, help="rows of the embedding and LM head")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new", type=int, default=512, help="response_length")
    parser.add_argument("--prompt-len", type=int, default=1536, help="prompts are cut to their last N tokens")
    parser.add_argument("--median-len", type=float, default=220.0, help="median response length (tokens)")
    parser.add_argument("--tool-rate", type=float, default=0.5, help="share of responses that call the tool")
    parser.add_argument("--latency-scale", type=float, default=1.0, help="multiplies the sandbox latencies")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per row, after one warm-up call")
    parser.add_argument("--util", type=float, default=0.5, help="rollout.gpu_memory_utilization")
    parser.add_argument("--time-limit", type=float, default=float("inf"), help="start no call after N seconds")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--prompts-file", type=Path, help="JSON: a list of chat messages lists (--export-prompts)")
    parser.add_argument("--data", type=Path, default=ARPO_DATA, help="ARPO's train parquet (without --prompts-file)")
    parser.add_argument("--export-prompts", type=Path, help="write the first --prompts prompts of --data here, exit")
    parser.add_argument("--json", type=Path, help="write the records and the summary here")
    args = parser.parse_args()
    if args.export_prompts:
        args.export_prompts.write_text(json.dumps(prompt_messages(args)))
        return
    tokenizer, prompts, engine, weight_bytes = build(args)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    bandwidth = next((b for key, b in BANDWIDTH.items() if key in name), BANDWIDTH["H100"])
    lengths = [len(p) for p in prompts]
    print(f"device {name}; prompts {len(prompts)}: {min(lengths)}-{max(lengths)} tokens (mean "
          f"{statistics.mean(lengths):.0f})", flush=True)
    records, failed, began = [], {}, time.monotonic()
    for row in args.rows:
        for i in range(args.repeats + 1):
            if time.monotonic() - began > args.time_limit:
                print(f"time limit: {row} call {i} not run", flush=True)
                break
            try:
                record = run_row(row, engine, tokenizer, prompts, args, seed=100 + i)
            except Exception as e:  # one row's failure leaves the others their time
                failed[row] = repr(e)
                print(f"{row} failed: {e!r}", flush=True)
                break
            record["hbm_bound_s"] = hbm_bound_s(record, engine.model.spec, engine.dtype, weight_bytes, bandwidth)
            record["warmup"] = i == 0
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}), flush=True)
            if i:
                records.append(record)
    summary = {"failed": failed, "device": name, "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
               "prompt_lengths": lengths, **summarize(records, args)}
    print(json.dumps(summary, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "records": records}, indent=1))


if __name__ == "__main__":
    main()
