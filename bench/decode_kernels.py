"""The fast engine's decode-step kernels one by one, against the time of reading their bytes (issue 26's decode goal).

Each kernel is captured in a CUDA graph (``--calls`` launches a graph, as the engine replays its decode step) and
timed over ``--replays`` replays: the paged decode attention (archer/rollout/fast/kernels.py) for every split
count and tile size, and the layer's projections (q/k/v, o, gate/up, down) through cuBLAS and cuBLASLt. The
cache holds ``--rows`` rows whose contexts are ``--prompt`` tokens plus a uniform draw up to ``--new`` (a decode
half-way, on average); bytes bound = the keys and values read (attention) or the weights and activations
(projections) at ``--bandwidth`` GB/s (H100 SXM: 3,350; H200: 4,800). The engine's own choice of splits
(runner.attention_splits) is marked.

    python bench/decode_kernels.py --shape qwen2.5-1.5b --rows 64 128 256 512 [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_step import SHAPES

from archer.rollout.fast import kernels
from archer.rollout.fast.runner import attention_splits

PAGE = 32


def graph_time(fn, calls: int, replays: int) -> float:
    """Seconds of one ``fn()`` inside a CUDA graph of ``calls`` launches, averaged over ``replays`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * calls)


def attention_rows(args: argparse.Namespace, shape: str, rows: int) -> list[dict]:
    hidden, _, heads, kv_heads, _ = SHAPES[shape]
    dim = hidden // heads
    gen = torch.Generator().manual_seed(0)
    ctx = args.prompt + torch.randint(1, args.new + 1, (rows,), generator=gen)
    blocks = -(-int(ctx.max()) // PAGE)
    pages = rows * blocks + 1
    order = torch.randperm(pages - 1, generator=gen)[: rows * blocks] + 1  # scattered pages, as after churn
    tables = order.view(rows, blocks).to(torch.int32).cuda()
    k_cache = torch.randn(pages, kv_heads, PAGE, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
    ctx = ctx.cuda()
    read = int(ctx.sum()) * kv_heads * dim * 2 * 2
    chosen = attention_splits(rows, kv_heads, torch.cuda.get_device_properties(0).multi_processor_count)
    out = []
    for tile in args.tiles:
        for splits in (1, 2, 4, 8, 16):
            call = partial(kernels.decode_attention, q, k_cache, v_cache, tables, ctx, dim ** -0.5, splits, tile)
            seconds = graph_time(call, args.calls, args.replays)
            out.append({"shape": shape, "rows": rows, "kernel": "decode_attention", "tile_tokens": tile,
                        "splits": splits, "engine_splits": splits == chosen, "us": seconds * 1e6,
                        "bound_us": read / (args.bandwidth * 1e9) * 1e6})
    return out


def projection_rows(args: argparse.Namespace, shape: str, rows: int) -> list[dict]:
    hidden, _, heads, kv_heads, inter = SHAPES[shape]
    dim = hidden // heads
    projections = {"qkv": ((heads + 2 * kv_heads) * dim, hidden, True), "o": (hidden, heads * dim, False),
                   "gate_up": (2 * inter, hidden, False), "down": (hidden, inter, False)}
    out = []
    for name, (n, k, bias) in projections.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        moved = (n * k + rows * (n + k)) * 2
        for library in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(library)
            seconds = graph_time(partial(F.linear, x, weight, b), args.calls, args.replays)
            out.append({"shape": shape, "rows": rows, "kernel": f"{name} projection", "library": library,
                        "us": seconds * 1e6, "bound_us": moved / (args.bandwidth * 1e9) * 1e6})
    torch.backends.cuda.preferred_blas_library("cublas")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["qwen2.5-1.5b"])
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 128, 256, 512])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--tiles", nargs="+", type=int, default=[32, 64, 128], help="tile_tokens to try")
    parser.add_argument("--bandwidth", type=float, default=3350.0, help="HBM GB/s of the bound")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    records = []
    for shape in args.shape:
        for rows in args.rows:
            for record in attention_rows(args, shape, rows) + projection_rows(args, shape, rows):
                records.append(record)
                detail = (f"tile {record['tile_tokens']:4d} splits {record['splits']:2d}"
                          f"{' (engine)' if record['engine_splits'] else ''}" if "splits" in record
                          else record["library"])
                print(f"{shape} {rows:4d} rows {record['kernel']:18s} {detail:28s} {record['us']:8.1f} us "
                      f"(bound {record['bound_us']:6.1f} us: {record['bound_us'] / record['us']:5.1%})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(0), "command": " ".join(sys.argv), "records": records}, indent=1))


if __name__ == "__main__":
    main()
