"""Two costs of archer's one-GPU update that its several-GPU update does not pay, measured side by side (issue 26).

1. **Precision of the layers' compute.** On one device archer keeps float32 weights and runs the forward under bf16
   autocast (models/loading.autocast_for): every matrix product casts its inputs, and the residual stream,
   RMSNorm and SwiGLU run in float32. With several ranks FSDP2's mixed precision gathers each layer's weights in
   bf16 and the layers compute in bf16 (distributed/fsdp.shard_model). This times one checkpointed forward +
   backward epoch of the decoder layers (``--micro-batches`` x ``--rows`` rows of ``--length`` random tokens, a
   float32 loss on the last hidden state) in three set-ups: (a) float32 weights under autocast, (b) FSDP2 on a
   one-rank mesh with bf16 compute and float32 gradient reduction, (c) bf16 weights (no master copy: the compute's
   lower bound). ``--liger``: with liger-kernel's RMSNorm / SwiGLU / rotary (``model.use_liger``). ``--compile``:
   each set-up again with every decoder layer compiled as archer compiles them (archer/models/compiled_layers.py:
   inductor fuses the norms, SwiGLU, rotary and autocast's casts; dynamic shapes); not with ``--liger``, whose
   autograd functions torch.compile cannot trace.
2. **The optimiser step.** torch's AdamW over the shape's parameters in float32 (as the trainer keeps them):
   its default (foreach) implementation against the fused one, which archer uses on GPUs (models/optim.py).

    python bench/update_precision.py --shape qwen2.5-1.5b [--liger] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from gpu_step import QWEN_VOCAB, SHAPES
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

H100_BF16_FLOPS = 989e12


def build(shape: str, dtype: torch.dtype, liger: bool, compiled: bool = False) -> Qwen2ForCausalLM:
    hidden, layers, heads, kv, inter = SHAPES[shape]
    config = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=32768,
                         tie_word_embeddings=True, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if liger:
        from archer.models.liger import apply_liger
        apply_liger(model, torch.device("cuda"), "--liger")
    if compiled:
        from archer.models.compiled_layers import compile_decoder_layers
        compile_decoder_layers(model)
    return model


def time_epochs(model: Qwen2ForCausalLM, args: argparse.Namespace, repeats: int = 2) -> float:
    """Seconds of one epoch (after one warm-up epoch)."""
    tokens = torch.randint(0, QWEN_VOCAB, (args.rows, args.length), device="cuda")

    def epoch() -> None:
        for _ in range(args.micro_batches):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                hidden = model.model(input_ids=tokens).last_hidden_state
                loss = hidden.float().pow(2).mean()
            loss.backward()

    epoch()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        epoch()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def layer_flops(shape: str, tokens: int) -> float:
    """8 N D of the decoder layers (forward, recomputed forward, backward), embedding and head left out."""
    hidden, layers, heads, kv, inter = SHAPES[shape]
    head_dim = hidden // heads
    per_layer = hidden * (hidden + 2 * kv * head_dim) + hidden * hidden + 3 * hidden * inter
    return 8 * layers * per_layer * tokens


def precision_rows(args: argparse.Namespace, mesh) -> list[dict]:
    rows = []
    tokens = args.rows * args.length * args.micro_batches
    setups = ("float32 weights + bf16 autocast", "FSDP2 on one rank, bf16 compute", "bf16 weights")
    for compiled, setup in itertools.product((False, True) if args.compile else (False,), setups):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = build(args.shape, torch.bfloat16 if setup == "bf16 weights" else torch.float32, args.liger, compiled)
        if setup.startswith("FSDP2"):
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model.model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        start = time.perf_counter()
        seconds = time_epochs(model, args)
        rows.append({"setup": f"compiled: {setup}" if compiled else setup, "seconds": seconds, "tokens": tokens,
                     "layer_mfu": layer_flops(args.shape, tokens) / seconds / H100_BF16_FLOPS,
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                     "wall_with_warm_up": time.perf_counter() - start})
        del model
    return rows


def optimizer_rows(args: argparse.Namespace) -> list[dict]:
    model = build(args.shape, torch.float32, liger=False)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    rows = []
    for implementation in ("foreach", "fused"):
        optimizer = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.01, **{implementation: True})
        for _ in range(3):
            optimizer.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            optimizer.step()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / 10
        moved = sum(p.numel() for p in params) * 4 * 7  # read weight, gradient, both moments; write three
        rows.append({"optimizer": implementation, "seconds": seconds, "hbm_gb_per_s": moved / seconds / 1e9})
        del optimizer
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=3072)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--liger", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.liger and args.compile:
        parser.error("--compile times torch.compile's fusions of the eager ops; liger's kernels cannot be compiled: "
                     "run --liger and --compile apart")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    try:
        precision = precision_rows(args, init_device_mesh("cuda", (1,)))
        optimizer = optimizer_rows(args)
    finally:
        dist.destroy_process_group()
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
              "command": " ".join(["python", "bench/update_precision.py", *sys.argv[1:]]),
              "precision": precision, "optimizer": optimizer}
    base = precision[0]["seconds"]
    print(f"{record['device']}, {args.shape}, {precision[0]['tokens']} tokens an epoch"
          f"{', liger' if args.liger else ''}")
    for row in precision:
        print(f"  {row['setup']:<44} {row['seconds']:.3f} s ({base / row['seconds']:.2f}x), decoder-layer MFU "
              f"{row['layer_mfu']:.1%}, peak {row['peak_gib']:.1f} GiB, "
              f"{row['wall_with_warm_up']:.0f} s with the warm-up")
    for row in optimizer:
        print(f"  AdamW {row['optimizer']:<8} {1e3 * row['seconds']:.1f} ms a step ({row['hbm_gb_per_s']:.0f} GB/s)")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
