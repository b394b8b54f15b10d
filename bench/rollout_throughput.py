"""Rollout throughput: archer's fast engine against Hugging Face generate with a static cache and
torch.compile (the best HF path), HF generate with the dynamic cache, and archer's HF engine, on one randomly
initialised bfloat16 model of a real shape (the real 151,936-row vocabulary), the same prompts and lengths,
in one run.

No weights can be downloaded here, so the model is random and its tokenizer a small BPE one (the embedding
has Qwen's 151,936 rows all the same): the figures are the cost of generation, not of any text. Every path
samples at temperature 1 from the full vocabulary; the HF paths are told no eos (they write exactly --new
tokens per row), the fast engine stops at the tokenizer's eos, which a random model draws about once in
150k tokens. tokens/s = generated tokens / wall time of the generate call (prefill included), after a
warm-up (compilation, graph capture) that is reported apart. The fast engine's record also gives its share of
the HBM bound (``decode_hbm_bound``: each decode step reads the bf16 weights once and every row's KV cache once).

    python bench/rollout_throughput.py --shape qwen2.5-0.5b --batch 128 --prompt 256 --new 512 \
        --peers fast hf-static hf-dynamic --out results.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import transformers
from gpu_step import QWEN_VOCAB, SHAPES
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from archer.models.logprobs import response_logprobs
from archer.models.tiny import train_tokenizer
from archer.rollout.base import SamplingParams
from archer.rollout.fast import FastEngine
from archer.rollout.fast.model import ModelSpec, model_spec, weight_bytes
from archer.rollout.hf_engine import HFGenerateEngine

PEERS = ("fast", "hf-static", "hf-dynamic", "hf-engine")
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}  # the vendors' datasheets (SXM, HBM3 / HBM3e)


def hbm_bandwidth(device_name: str) -> float | None:
    """Bytes/s of the card named ``device_name`` (None when it is not one of HBM_BYTES_PER_S)."""
    return next((bw for card, bw in HBM_BYTES_PER_S.items() if card in device_name), None)


def decode_hbm_bound(spec: ModelSpec, rows: int, prompt: int, new: int, bandwidth: float) -> float:
    """The tokens/s of ``rows`` rows decoding ``new`` tokens after ``prompt`` if every step only read the bf16
    weights once (``weight_bytes``) and each row's keys and values once (at the mean context, prompt + new / 2)."""
    kv_per_token = spec.layers * 2 * spec.kv_heads * spec.head_dim * torch.bfloat16.itemsize
    step_bytes = weight_bytes(spec, torch.bfloat16) + rows * (prompt + new / 2) * kv_per_token
    return rows * bandwidth / step_bytes


def build_model(shape: str, device: torch.device):
    """A random bfloat16 Qwen2 model of ``shape`` with Qwen's vocabulary size, and a small BPE tokenizer."""
    texts = [f"Compute {i}+{i + 1}-{i + 2}. The answer is {i - 1}." for i in range(500)]
    tokenizer = train_tokenizer(texts, 400)
    hidden, layers, heads, kv, inter = SHAPES[shape]
    config = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                         max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def _timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def run_fast(model, tokenizer, prompts, args) -> dict:
    rows = len(prompts) * args.n
    engine, build_s = _timed(lambda: FastEngine(
        model, tokenizer, gpu_memory_utilization=args.util, max_num_seqs=args.max_num_seqs or rows,
        max_num_batched_tokens=args.batched_tokens, max_model_len=args.prompt + args.new))
    _, warm_s = _timed(lambda: engine.generate(prompts, SamplingParams(n=args.n, max_new_tokens=8, seed=1)))
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new, seed=0)
    prefill_s = []
    prefill = engine.scheduler.prefill

    def timed_prefill(cache, seqs):
        prefill_s.append(_timed(lambda: prefill(cache, seqs))[1])

    engine.scheduler.prefill = timed_prefill
    out, seconds = _timed(lambda: engine.generate(prompts, params))
    first_prefill_s = sum(prefill_s)
    again, seconds_2 = _timed(lambda: engine.generate(prompts, params))
    tokens = int(out.response_mask.sum())
    record = {"peer": "fast", "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
              "prefill_s": first_prefill_s, "decode_tokens_per_s": tokens / (seconds - first_prefill_s),
              "repeat_tokens_per_s": int(again.response_mask.sum()) / seconds_2,
              "repeat_prefill_s": sum(prefill_s) - first_prefill_s, "warmup_s": build_s + warm_s,
              "same_tokens_on_repeat": bool(torch.equal(out.responses, again.responses)),
              "kv_pages": engine.cache.pages, "eos_rows": out.finish_reasons.count("eos")}
    record.update(decode_split(engine, prompts, params))
    bandwidth = hbm_bandwidth(torch.cuda.get_device_name())
    if bandwidth is not None:
        bound = decode_hbm_bound(model_spec(model), len(prompts) * args.n, args.prompt, args.new, bandwidth)
        record.update(hbm_bound_tokens_per_s=bound, hbm_fraction=record["tokens_per_s"] / bound,
                      repeat_hbm_fraction=record["repeat_tokens_per_s"] / bound)
    if args.check:
        record.update(_check(model, prompts, out, args))
    if args.profile:
        args.profile.write_text(profile_decode(engine, prompts, args))
    held = torch.cuda.memory_reserved()
    engine.release_memory()
    record["released_gib"] = (held - torch.cuda.memory_reserved()) / 2**30
    return record


def decode_split(engine: FastEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Where the wall time of one more generate call goes: the decode windows' graph replays (CUDA events around
    each window's steps, GPU time), the prefills (GPU time) and the rest, the host's work between windows while
    the GPU waits (reading a window, admitting rows, stop strings)."""
    scheduler, runner = engine.scheduler, engine.scheduler.runner
    run, collect, prefill = runner.run, scheduler._collect, scheduler.prefill
    windows: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    prefills: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    window_start: list[torch.cuda.Event] = []  # the event before the open window's first step

    def event() -> torch.cuda.Event:
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def timed_run(bucket: int, filtered: bool, cache) -> None:
        if not window_start:
            window_start.append(event())
        run(bucket, filtered, cache)

    def timed_collect(bucket: int, steps: int):
        windows.append((window_start.pop(), event()))
        return collect(bucket, steps)

    def timed_prefill(cache, seqs) -> None:
        start = event()
        prefill(cache, seqs)
        prefills.append((start, event()))

    runner.run, scheduler._collect, scheduler.prefill = timed_run, timed_collect, timed_prefill
    try:
        steps_before = scheduler.counters.steps
        _, wall = _timed(lambda: engine.generate(prompts, params))
        steps = scheduler.counters.steps - steps_before
    finally:
        del runner.run
        scheduler._collect, scheduler.prefill = collect, prefill
    replay_s = sum(a.elapsed_time(b) for a, b in windows) / 1e3
    prefill_s = sum(a.elapsed_time(b) for a, b in prefills) / 1e3
    return {"split_wall_s": wall, "split_decode_gpu_s": replay_s, "split_prefill_gpu_s": prefill_s,
            "split_host_gap_s": wall - replay_s - prefill_s, "split_windows": len(windows),
            "split_steps": steps, "split_ms_per_step": 1e3 * replay_s / max(steps, 1)}


def profile_decode(engine: FastEngine, prompts: list[list[int]], args, new: int = 64) -> str:
    """torch.profiler's table of the GPU kernels of a ``new``-token generate call (the graphs replayed as in the
    timed calls, prefill included), the costliest first: where a decode step's time goes."""
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=new, seed=2)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    header = (f"{args.shape}, {len(prompts)} x {args.n} rows, prompt {args.prompt}, {new} new tokens, "
              f"{torch.cuda.get_device_name()}\n")
    return header + prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70)


def _check(model, prompts, out, args, rows: int = 16) -> dict:
    """The engine's log-probs and entropies against the training forward (bf16 HF model) on a few rows."""
    picked = list(range(min(rows, len(out.finish_reasons))))
    prompt_rows = [prompts[i] for i in out.prompt_index[picked].tolist()]
    ids = torch.cat([torch.tensor(prompt_rows), out.responses[picked]], dim=1).cuda()
    mask = torch.cat([torch.ones(len(picked), args.prompt, dtype=torch.long), out.response_mask[picked]], 1).cuda()
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with torch.no_grad():
        logp, entropy = response_logprobs(model, ids, mask, positions, out.responses.shape[1])
    valid = out.response_mask[picked].bool()
    dlogp = (out.log_probs[picked] - logp.float().cpu())[valid].abs()
    dent = (out.entropies[picked] - entropy.float().cpu())[valid].abs()
    return {"check_rows": len(picked), "logp_diff_mean": float(dlogp.mean()), "logp_diff_max": float(dlogp.max()),
            "entropy_diff_mean": float(dent.mean()), "entropy_diff_max": float(dent.max())}


def run_hf_generate(model, tokenizer, prompts, args, static: bool) -> dict:
    ids = torch.tensor(prompts, device="cuda").repeat_interleave(args.n, dim=0)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new,
                              eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
                              cache_implementation="static" if static else None)

    def generate(max_new: int):
        config.max_new_tokens = max_new
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)

    # the static cache is sized by the total length, so its warm-up (compilation) runs the full length
    _, warm_s = _timed(lambda: generate(args.new if static else 8))
    out, seconds = _timed(lambda: generate(args.new))
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"peer": "hf-static" if static else "hf-dynamic", "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "warmup_s": warm_s}


def run_hf_engine(model, tokenizer, prompts, args) -> dict:
    engine = HFGenerateEngine(model, tokenizer, max_batch_size=len(prompts) * args.n)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new, seed=0)
    _, warm_s = _timed(lambda: engine.generate(prompts[:4], SamplingParams(max_new_tokens=8, seed=1)))
    out, seconds = _timed(lambda: engine.generate(prompts, params))
    tokens = int(out.response_mask.sum())
    return {"peer": "hf-engine", "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "warmup_s": warm_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--batch", type=int, default=128, help="prompts")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    parser.add_argument("--new", type=int, default=512, help="new tokens per response")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--util", type=float, default=0.5, help="rollout.gpu_memory_utilization")
    parser.add_argument("--max-num-seqs", type=int, default=0, help="rollout.max_num_seqs (0: every row)")
    parser.add_argument("--batched-tokens", type=int, default=8192, help="rollout.max_num_batched_tokens")
    parser.add_argument("--check", action="store_true", help="compare log-probs with the training forward")
    parser.add_argument("--out", type=Path, help="append one JSON line per peer here")
    parser.add_argument("--profile", type=Path, help="fast: write the profiler's kernel table of a short "
                        "generate call here")
    args = parser.parse_args()
    model, tokenizer = build_model(args.shape, torch.device("cuda"))
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, QWEN_VOCAB, (args.batch, args.prompt), generator=generator).tolist()
    runners = {"fast": lambda: run_fast(model, tokenizer, prompts, args),
               "hf-static": lambda: run_hf_generate(model, tokenizer, prompts, args, static=True),
               "hf-dynamic": lambda: run_hf_generate(model, tokenizer, prompts, args, static=False),
               "hf-engine": lambda: run_hf_engine(model, tokenizer, prompts, args)}
    common = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "transformers": transformers.__version__, "shape": args.shape,
              "batch": args.batch, "n": args.n, "prompt": args.prompt, "new": args.new,
              "command": " ".join(["python", *sys.argv])}
    records = []
    for peer in args.peers:
        record = {**common, **runners[peer]()}
        records.append(record)
        torch.cuda.empty_cache()
        print(json.dumps(record), flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(record) + "\n")
    best_hf = max((r["tokens_per_s"] for r in records if r["peer"] != "fast"), default=None)
    print(f"\n{args.shape} B={args.batch}x{args.n} P={args.prompt} N={args.new} on {common['device']}")
    for r in records:
        ratio = f"  {r['tokens_per_s'] / best_hf:.2f}x best HF" if best_hf and r["peer"] == "fast" else ""
        if "repeat_hbm_fraction" in r:
            ratio += f"  (HBM bound {r['hbm_bound_tokens_per_s']:.0f} tok/s: {r['hbm_fraction']:.0%}, repeat " \
                     f"{r['repeat_hbm_fraction']:.0%})"
        print(f"  {r['peer']:<11} {r['tokens_per_s']:>10.0f} tok/s  ({r['tokens']} tokens in {r['seconds']:.2f} s,"
              f" warm-up {r['warmup_s']:.1f} s){ratio}")
        if "split_wall_s" in r:
            print(f"              one more call: {r['split_wall_s']:.3f} s = decode graphs {r['split_decode_gpu_s']:.3f} s"
                  f" ({r['split_steps']} steps, {r['split_ms_per_step']:.3f} ms each) + prefill "
                  f"{r['split_prefill_gpu_s']:.3f} s + host between windows {r['split_host_gap_s']:.3f} s "
                  f"({r['split_windows']} windows)")


if __name__ == "__main__":
    main()
