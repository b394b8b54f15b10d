"""SFT's packed rows (``data.packing``) through archer's attention against transformers' block-diagonal mask.

A packed SFT row holds several examples one after another, their position ids restarting at 0 with each. archer
now runs such rows as one sequence of examples with their bounds through its own attention (one varlen flash call a
layer on a GPU: each example attends to itself, O(sum of squared lengths); models/sequence_layout.py, ``ScoredRows``).
Before, the rows went to the model without a mask and transformers built a [T x T] block-diagonal mask from the
restarts, which SDPA runs with a masked kernel over every pair of positions. This bench times one ``sft_backward``
(forward and backward of the mean response-token NLL) of the same packed batch both ways, in one process, on a
random model of a real shape with Qwen's vocabulary: long-tailed example lengths (lognormal, median a quarter of
``--max-length``, cut at it), ``--micro`` examples' worth of tokens a row, as ``archer sft data.packing=true`` packs
them; then the loss and gradient norms of the two must agree.

    python bench/sft_packing.py --shape qwen2.5-0.5b --max-length 8192 --micro 4 --examples 32     # a GPU
    python bench/sft_packing.py --shape tiny --max-length 256 --examples 16                      # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from gpu_step import QWEN_VOCAB, build_random_model
from stage_mfu import PEAK_FLOPS, measure_repeated

from archer.data.sft_dataset import pack_sft
from archer.models.loading import load_causal_lm
from archer.models.packed_attention import PACKED_ATTENTION
from archer.trainer.sft import sft_backward


def examples(count: int, max_length: int, vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` examples of lognormal lengths (median max_length / 4, cut at max_length), the second half of each
    learned (loss_mask 1)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(count, generator=gen) * 0.8 + math.log(max_length / 4)).exp().clamp(16, max_length).long()
    items = []
    for length in lengths.tolist():
        ids = torch.randint(3, vocab, (length,), generator=gen)
        learn = torch.zeros(length, dtype=torch.long)
        learn[length // 2:] = 1
        items.append({"input_ids": ids, "loss_mask": learn})
    return items


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = build_random_model(args.workdir, args.shape, None if args.shape == "tiny" else QWEN_VOCAB,
                                   dtype=torch.bfloat16 if device.type == "cuda" else None, device=device.type)
    model = load_causal_lm(model_dir, device=device, gradient_checkpointing=True).train()
    items = examples(args.examples, args.max_length, model.config.vocab_size - 8, args.seed)
    batch = pack_sft(items, 0, args.micro * args.max_length, unpacked_micro_batch_size=args.micro)  # kept on the host
    tokens = int(batch["attention_mask"].sum())
    params = sum(p.numel() for p in model.parameters())
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(), "torch": torch.__version__, "command": command,
        "shape": args.shape, "examples": args.examples, "rows": len(batch), "tokens": tokens,
        "max_length": args.max_length, "micro": args.micro, "variants": {}}
    for name, attention in (("archer's attention, examples apart", PACKED_ATTENTION),
                            ("transformers' block-diagonal mask (before)", "sdpa")):
        model.set_attn_implementation(attention)

        def step() -> tuple[float, float]:
            model.zero_grad(set_to_none=True)
            loss, _ = sft_backward(model, batch, 1)
            grads = [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
            return loss, float(torch.stack(grads).norm())

        try:
            step()  # warm-up
            (loss, grad_norm), seconds, spread, peak = measure_repeated(device, step, args.repeats)
        except torch.OutOfMemoryError as err:
            record["variants"][name] = {"error": f"out of memory: {str(err).splitlines()[0]}"}
            torch.cuda.empty_cache()
            continue
        record["variants"][name] = {
            "seconds": seconds, **spread, "peak_gib": peak, "loss": loss, "grad_norm": grad_norm,
            "tokens_per_s": tokens / seconds,
            "mfu": 6 * params * tokens / seconds / PEAK_FLOPS if device.type == "cuda" else None}
    return record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--max-length", type=int, default=8192, help="data.max_length")
    parser.add_argument("--micro", type=int, default=4, help="data.micro_batch_size_per_gpu: a row holds this many "
                                                              "examples' worth of tokens")
    parser.add_argument("--examples", type=int, default=32, help="examples in the batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/sft_packing"))
    parser.add_argument("--json", type=Path, help="write the record here")
    args = parser.parse_args(argv)
    record = run(args, " ".join(["python bench/sft_packing.py", *(sys.argv[1:] if argv is None else argv)]))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    print(f"{record['device']}, {args.shape}: {record['examples']} examples, {record['tokens']} tokens in "
          f"{record['rows']} packed rows of up to {args.micro * args.max_length}")
    for name, got in record["variants"].items():
        if "error" in got:
            print(f"  {name}: {got['error']}")
            continue
        mfu = "" if got["mfu"] is None else f", MFU {got['mfu']:.1%}"
        peak = "" if got["peak_gib"] is None else f", peak {got['peak_gib']:.1f} GiB"
        print(f"  {name}: {got['seconds']:.3f} s ({got['min_s']:.3f}-{got['max_s']:.3f}), "
              f"{got['tokens_per_s']:,.0f} tokens/s{mfu}{peak}; loss {got['loss']:.5f}, grad norm {got['grad_norm']:.4f}")
    return record


if __name__ == "__main__":
    main()
