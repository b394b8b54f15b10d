"""What the influence trace's hooks and scoring cost at a real model's shape, without the model's own work.

Hooks the seven projections (q/k/v/o/gate/up/down) of every decoder layer of a model of ``--shape``'s widths
(bench/gpu_step.py's SHAPES; Qwen2.5-0.5B by default: 24 layers, 896 wide, 4864 in the MLP) with the trace's
defaults (projection factor 512), and drives them as one traced policy update does: per micro-batch, each
module gets an input activation and, in the backward, an output gradient of the real shapes [rows, prompt +
response, width] (random, in ``--dtype``: bfloat16 is what the layers see under the GPU's autocast). The
modules are stubs (their forward is a cheap view of a fixed tensor), so the time with hooks less the time
without them is the hooks' own cost. Then collects the factors and scores them as the trace does.

    python bench/influence_cost.py --threads 1                      # CPU: 2 prompts x 8, 2 micro-batches
    python bench/influence_cost.py --device cuda --dtype bfloat16 --prompts 32 --micro 32   # trace_cost's GPU step
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from gpu_step import SHAPES
from torch import nn

from archer.config.loader import load_config
from archer.trace.influence import InfluenceTrace, select_responses
from archer.trace.influence_capture import (
    CaptureSettings,
    InfluenceCapture,
    TokenCapture,
    module_projections,
    select_modules,
)

MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


class StubLinear(nn.Linear):
    """A linear layer's shape and device without its weights; its forward returns zeros of the output's shape
    that depend on a parameter (so they require grad, and their backward is one cheap reduction)."""

    def __init__(self, in_features: int, out_features: int, device: torch.device, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.zeros(1, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.expand(*x.shape[:-1], self.out_features)


class StubDecoder(nn.Module):
    def __init__(self, shape: tuple[int, int, int, int, int], device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, layers, heads, kv, inter = shape
        kv_width = hidden // heads * kv
        dims = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, kv_width),
                "self_attn.v_proj": (hidden, kv_width), "self_attn.o_proj": (hidden, hidden),
                "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)}
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.self_attn, layer.mlp = nn.Module(), nn.Module()
            for name, (i, o) in dims.items():
                part, leaf = name.split(".")
                setattr(getattr(layer, part), leaf, StubLinear(i, o, device, dtype))
            self.layers.append(layer)


def run_update(modules: dict[str, StubLinear], tensors: dict[int, tuple[torch.Tensor, torch.Tensor]],
               micro_rows: list[list[int]], capture: TokenCapture | None, input_length: int,
               response_length: int) -> None:
    """Each micro-batch: every module's forward, then the backward of its output (one at a time, to keep
    memory down), inside the capture's micro-batch block when tracing."""
    for rows in micro_rows:
        # left-padded prompts: every response starts at the same column, scored from the one before it
        firsts = [i * input_length + input_length - response_length - 1 for i in range(len(rows))]
        with capture.micro_batch(rows, firsts, (len(rows), input_length)) if capture else nullcontext():
            for module in modules.values():
                x, _ = tensors[module.in_features]
                _, grad = tensors[module.out_features]
                module(x).backward(grad)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--micro", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # steadier figures on a CPU that other work shares
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shape = SHAPES[args.shape]
    model = StubDecoder(shape, device, dtype)
    gen = torch.Generator().manual_seed(0)
    rows, length = args.prompts * args.n, args.prompt_length + args.response_length
    tensors = {}  # width -> (input activation, output gradient) of a micro-batch
    for width in sorted({m.in_features for m in model.modules() if isinstance(m, StubLinear)}
                        | {m.out_features for m in model.modules() if isinstance(m, StubLinear)}):
        tensors[width] = tuple(torch.randn(args.micro, length, width, generator=gen).to(device, dtype)
                               for _ in range(2))
    # Responses of random lengths; rewards alternate within each group, so every group is traced.
    lengths = torch.randint(args.response_length // 4, args.response_length + 1, (rows,), generator=gen).numpy()
    mask = np.arange(args.response_length)[None, :] < lengths[:, None]
    uids = [f"p{i // args.n}" for i in range(rows)]
    rewards = (np.arange(rows) % 2).astype(np.float64)
    sel = select_responses(uids, rewards, mask, max_groups=0, max_responses=0, max_tokens_per_response=-1)
    if rows % args.micro:
        parser.error(f"--micro must divide the {rows} rows")
    micro_rows = [list(range(s, s + args.micro)) for s in range(0, rows, args.micro)]

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("ppo_trainer", [f"actor_rollout_ref.model.path={tmp}", "data.train_files=x",
                                          "trainer.influence_trace.enable=true"])
        settings = CaptureSettings.from_config(cfg.trainer.influence_trace)
        modules = select_modules(model, list(settings.module_name_filter), None, -1)
        trace = InfluenceTrace(cfg, Path(tmp), None, list(modules), device)
        projections = module_projections(modules, settings.projection)  # once per run, as the actor does
        times: dict[str, list[float]] = {"update without hooks": [], "update with hooks": [], "collect": [],
                                         "score": []}
        for _ in range(args.repeats + 1):  # the first round warms up
            synchronize(device)
            start = time.perf_counter()
            run_update(modules, tensors, micro_rows, None, length, args.response_length)
            synchronize(device)
            plain = time.perf_counter()
            capture = TokenCapture(InfluenceCapture(modules, projections, num_tokens=len(sel.token_response),
                                                    store_device=device), sel.tokens)
            with capture.hooks():
                run_update(modules, tensors, micro_rows, capture, length, args.response_length)
            synchronize(device)
            hooked = time.perf_counter()
            captured = capture.collect()
            synchronize(device)
            collected = time.perf_counter()
            trace.score(sel, captured)
            scored = time.perf_counter()
            for key, value in zip(times, (plain - start, hooked - plain, collected - hooked, scored - collected)):
                times[key].append(value)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
    print(f"{args.shape} on {args.device} ({args.dtype}): {len(modules)} modules, {rows} rows of {length} "
          f"positions in micro-batches of {args.micro}, {len(sel.token_response)} traced tokens; medians of "
          f"{args.repeats} rounds after a warm-up")
    print("| hooks s | collect s | score s | hooks + collect + score s | stub update s |")
    print("|---|---|---|---|---|")
    hooks = med["update with hooks"] - med["update without hooks"]
    print(f"| {hooks:.3f} | {med['collect']:.3f} | {med['score']:.3f} | "
          f"{hooks + med['collect'] + med['score']:.3f} | {med['update without hooks']:.3f} |")


if __name__ == "__main__":
    main()
