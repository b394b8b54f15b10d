"""One PPO epoch of a bench/stage_mfu.py workload at one micro-batching, timed on its own: the process builds the
actor, computes the old log-probs once, runs a whole warm-up epoch (every micro-batch size the epoch has, so no
compile or autotune lands in a timed run) and then times ``--repeats`` epochs (median, fastest, slowest). One
configuration a process, so that runs with different libraries (e.g. two transformers releases on the path) or
kernels compare side by side in one call:

    python bench/update_epoch.py --workload archer2 --rows 8 --card-gib 79.2        # the recipe's own micro-batches
    python bench/update_epoch.py --workload archer2 --rows 8 --kernels eager

``--rows R`` packs R rows a micro-batch (``--padded``: padded rows), every decoder layer checkpointed unless
``--no-checkpointing``. MFU as stage_mfu's (6 N D over the median, 989 TFLOP/s). On a CPU (``--shape tiny``) it
is a smoke run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import transformers
from gpu_step import QWEN_VOCAB, build_random_model
from stage_mfu import PEAK_FLOPS, WORKLOADS, build_actor, make_batch, measure_repeated, set_update_inputs

from archer.models.loading import load_tokenizer, set_gradient_checkpointing
from archer.models.micro_batches import MicroBatching
from archer.units import GIB


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if args.card_gib and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(args.card_gib * GIB / torch.cuda.mem_get_info(device)[1], device)
    work = WORKLOADS[args.workload]
    if args.shape == "tiny":  # a smoke run: fewer, shorter rows
        work = replace(work, prompts=2, prompt=64, response=64)
    model_dir = build_random_model(args.workdir, args.shape, None if args.shape == "tiny" else QWEN_VOCAB,
                                   dtype=torch.bfloat16, device=device.type)
    actor = build_actor(model_dir, work, args.kernels, device, load_tokenizer(model_dir))
    batch = make_batch(work, actor.model.config.vocab_size)
    set_update_inputs(batch, actor.compute_log_prob(batch)["old_log_probs"])
    actor.update_micro = MicroBatching(args.rows, None, packed=not args.padded)
    set_gradient_checkpointing(actor.model, args.checkpointing)
    actor.update_actor(batch)  # the warm-up epoch
    _, seconds, spread, peak = measure_repeated(device, lambda: actor.update_actor(batch), args.repeats)
    params = sum(p.numel() for p in actor.model.parameters())
    real = int(batch["attention_mask"].sum())
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "transformers": transformers.__version__, "command": command,
            "shape": args.shape, "workload": args.workload, "kernels": args.kernels, "rows": args.rows,
            "packed": not args.padded, "checkpointing": args.checkpointing, "real_tokens": real,
            "seconds": seconds, **spread, "peak_gib": peak,
            "mfu": 6 * params * real / seconds / PEAK_FLOPS if device.type == "cuda" else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="archer2")
    parser.add_argument("--rows", type=int, default=8, help="rows a micro-batch")
    parser.add_argument("--padded", action="store_true", help="padded micro-batches (default: packed)")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="keep every layer's activations (default: every layer checkpointed)")
    parser.add_argument("--kernels", choices=("compiled", "eager", "liger"), default="compiled")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--card-gib", type=float, help="a GPU: let this process use only this much memory")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/update_epoch"))
    parser.add_argument("--json", type=Path, help="write the record here")
    args = parser.parse_args(argv)
    record = run(args, " ".join(["python bench/update_epoch.py", *(sys.argv[1:] if argv is None else argv)]))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    mfu = "-" if record["mfu"] is None else f"{record['mfu']:.1%}"
    print(f"{record['device']}, transformers {record['transformers']}, {args.kernels}, {args.rows} rows "
          f"{'packed' if record['packed'] else 'padded'}: {record['seconds']:.3f} s an epoch "
          f"({record['min_s']:.3f}-{record['max_s']:.3f}, {record['runs']} runs), MFU {mfu}")
    return record


if __name__ == "__main__":
    main()
