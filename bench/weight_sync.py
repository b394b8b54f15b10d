"""separate_async's weight sync alone: the policy from T FSDP2 trainer ranks to R rollout ranks (issue 25's goal:
<= 0.2 s for 1.5B within one node), the two ways archer's trainer makes the buckets, side by side in one run:

- ``per_tensor``: the policy's stream (models/lora.policy_weights: a DTensor cast and all-gather per tensor)
  packed into the buckets on trainer rank 0 (what a LoRA policy still does);
- ``bucket_gather``: each rank packs its shards of a bucket and one gather a bucket brings them to rank 0
  (distributed/shard_buckets.py; what a plain sharded policy does).

Both broadcast the same buckets (distributed/weight_sync.py) to the rollout ranks, which copy every tensor into
a tensor of their own as the engine does. The weights are a random model of ``--shape`` with Qwen's vocabulary,
float32 shards as the trainer keeps them, sent in bf16. Trainer rank i runs on GPU i; rollout ranks take the GPUs
after them, and share the last trainer GPUs when there are fewer GPUs than ranks (never trainer rank 0's: the
sync group cannot hold one GPU twice), so 2 GPUs can time 2 trainer ranks and a rollout rank.

    python bench/weight_sync.py --shape qwen2.5-1.5b --trainer-ranks 3 --rollout-ranks 1 [--json out.json]
    python bench/weight_sync.py --shape tiny --device cpu        # the same on gloo processes, to try it
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from gpu_step import QWEN_VOCAB, SHAPES
from transformers import Qwen2Config, Qwen2ForCausalLM

from archer.distributed.context import DistContext
from archer.distributed.fsdp import shard_model
from archer.distributed.shard_buckets import ShardGather
from archer.distributed.weight_sync import (
    WeightManifest,
    WeightReceiver,
    WeightSender,
    bucket_bytes,
    join_group,
    open_store,
    packed_buckets,
)
from archer.models.lora import plain_policy_parameters, policy_weight_shapes, policy_weights

PATHS = ("per_tensor", "bucket_gather")
TIMEOUT_S = 300.0


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gpu_of(args: argparse.Namespace, sync_rank: int) -> int:
    """The GPU of sync rank 0 (trainer rank 0) or of rollout rank ``sync_rank - 1``."""
    if sync_rank == 0:
        return 0
    slot = args.trainer_ranks + sync_rank - 1
    return slot if slot < args.gpus else args.gpus - 1 - (sync_rank - 1) % (args.gpus - 1)


def build(args: argparse.Namespace, device: torch.device) -> Qwen2ForCausalLM:
    hidden, layers, heads, kv, inter = SHAPES[args.shape]
    config = Qwen2Config(vocab_size=QWEN_VOCAB if args.shape != "tiny" else 320, hidden_size=hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                         intermediate_size=inter, tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(0)
    with device:
        return Qwen2ForCausalLM(config)


def trainer(rank: int, args: argparse.Namespace, ports: mp.Queue, results: mp.Queue) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % args.gpus)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.trainer_ranks), LOCAL_RANK=str(rank % args.gpus),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    ctx = DistContext.init_from_env(args.device, TIMEOUT_S)
    model = shard_model(build(args, ctx.device), ctx, param_dtype=torch.bfloat16)
    manifest = WeightManifest.plan(policy_weight_shapes(model), torch.bfloat16, bucket_bytes(args.bucket_mb))
    sender = None
    if rank == 0:
        store = open_store("127.0.0.1", TIMEOUT_S)
        for _ in range(args.rollout_ranks):
            ports.put(store.port)
        group = join_group("127.0.0.1", store.port, 0, args.rollout_ranks + 1, ctx.device, TIMEOUT_S, store=store)
        sender = WeightSender(group, manifest, ctx.device)
    record: dict = {"bytes": manifest.num_bytes, "buckets": len(manifest.buckets)}
    for path in PATHS:
        seconds = []
        for _ in range(args.repeats + 1):
            if path == "per_tensor":
                buckets = packed_buckets(policy_weights(model, manifest.dtype), manifest, ctx.device, pack=rank == 0)
            else:
                buckets = ShardGather(plain_policy_parameters(model), manifest, ctx.device).buckets()
            ctx.barrier()
            started = time.perf_counter()
            if sender is not None:
                sender.send_buckets(buckets)
            else:
                for _ in buckets:
                    pass
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        record[path] = seconds[1:]  # the first paid for NCCL's set-up
    if rank == 0:
        results.put(("trainer", record))
    ctx.destroy()


def rollout(sync_rank: int, args: argparse.Namespace, ports: mp.Queue, results: mp.Queue) -> None:
    device = torch.device(args.device, gpu_of(args, sync_rank)) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shapes = policy_weight_shapes(build(args, torch.device("meta")))
    manifest = WeightManifest.plan(shapes, torch.bfloat16, bucket_bytes(args.bucket_mb))
    port = ports.get(timeout=TIMEOUT_S)
    group = join_group("127.0.0.1", port, sync_rank, args.rollout_ranks + 1, device, TIMEOUT_S)
    receiver = WeightReceiver(group, manifest, device)
    engine = {name: torch.empty(shape, dtype=torch.bfloat16, device=device) for name, shape in shapes}
    for _ in range(len(PATHS) * (args.repeats + 1)):
        for name, tensor in receiver.receive():
            engine[name].copy_(tensor)
    if sync_rank == 1:
        results.put(("rollout", {"sum": float(sum(t.float().sum() for t in engine.values()))}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--trainer-ranks", type=int, default=2)
    parser.add_argument("--rollout-ranks", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--bucket-mb", type=float, default=2048, help="update_weights_bucket_megabytes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.gpus = args.gpus or (torch.cuda.device_count() if args.device == "cuda" else 1)
    if args.device == "cuda" and args.gpus < 2:
        parser.error("the sync needs trainer rank 0 and a rollout rank on different GPUs: 2 GPUs at least")
    args.port = free_port()
    context = mp.get_context("spawn")
    ports, results = context.Queue(), context.Queue()
    procs = [context.Process(target=trainer, args=(rank, args, ports, results)) for rank in range(args.trainer_ranks)]
    procs += [context.Process(target=rollout, args=(1 + j, args, ports, results)) for j in range(args.rollout_ranks)]
    for proc in procs:
        proc.start()
    got = dict(results.get(timeout=TIMEOUT_S * 2) for _ in range(2))
    for proc in procs:
        proc.join(timeout=60)
    record, gb = got["trainer"], got["trainer"]["bytes"] / 1e9
    rows = []
    for path in PATHS:
        seconds = record[path]
        median = statistics.median(seconds)
        rows.append({"path": path, "median_s": median, "min_s": min(seconds), "max_s": max(seconds),
                     "gb": gb, "gb_per_s": gb / median})
        print(f"{path:14s} {median:.4f} s a sync (min {min(seconds):.4f}, max {max(seconds):.4f}) for {gb:.2f} GB "
              f"in {record['buckets']} bucket(s): {gb / median:.1f} GB/s")
    out = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
           "command": " ".join(sys.argv), "shape": args.shape, "trainer_ranks": args.trainer_ranks,
           "rollout_ranks": args.rollout_ranks, "gpus": args.gpus, "rows": rows,
           "received_sum": got["rollout"]["sum"]}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
