"""Peak extra memory and time of the log-prob + entropy kernel, forward and backward: the previous kernel
(each chunk of 1024 tokens checkpointed through autograd) against archer's (archer/models/logprobs.py), in the
same run, on the same inputs, with the differences of their outputs and gradients.

    python bench/logprob_memory.py                        # GPU: 65536 tokens x 151936 vocabulary, hidden 896
    python bench/logprob_memory.py --device cpu --tokens 2048 8192 --vocab 32768 --hidden 64

Peak extra memory: the most bytes allocated during forward + backward above what was allocated before the
forward (the hidden states and the head, without gradients); it includes the gradients the backward leaves
(hidden states and head weight). On a GPU from torch.cuda's allocator statistics, on the CPU from the
profiler's allocation events. The head runs under bf16 autocast on a GPU (as in training), in float32 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from archer.models.loading import autocast_for
from archer.models.logprobs import auto_chunk_size, logprobs_from_hidden

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


def _previous_chunk(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight).float() / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_norm
    return logp, log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def previous_kernel(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                    chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel before this change: autograd ops on each chunk, under activation checkpointing."""
    pieces = [checkpoint(_previous_chunk, hidden[i:i + chunk_size], weight, labels[i:i + chunk_size], temperature,
                         use_reentrant=False) for i in range(0, hidden.shape[0], chunk_size)]
    return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])


def archer_kernel(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return logprobs_from_hidden(hidden, (weight, None), labels, temperature=temperature)


def _step(kernel: Kernel, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
          weights: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    hidden.grad = weight.grad = None
    with autocast_for(device):
        logp, entropy = kernel(hidden, weight, labels, 0.9)
    ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    return logp.detach(), entropy.detach()


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """The most bytes of CPU tensors alive at once while ``fn`` runs, above what was alive when it began."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


def measure(kernel: Kernel, inputs: tuple[torch.Tensor, ...], device: torch.device, repeats: int) -> dict:
    """Peak extra bytes of one forward + backward, its median time over ``repeats``, and its results."""
    run = lambda: _step(kernel, *inputs, device)  # noqa: E731
    run()  # warm-up
    hidden, weight = inputs[0], inputs[1]
    hidden.grad = weight.grad = None  # the gradients the measured run leaves count as extra memory
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = cpu_peak_bytes(run)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"peak_extra_gib": peak / 2**30, "time_s": statistics.median(times),
            "results": (*outputs, hidden.grad.clone(), weight.grad.clone())}


def compare(tokens: int, vocab: int, hidden_size: int, device: torch.device, repeats: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device=device, generator=gen).requires_grad_(True)
    weight = (torch.randn(vocab, hidden_size, device=device, generator=gen) / hidden_size**0.5).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    weights = (torch.randn(tokens, device=device, generator=gen), torch.randn(tokens, device=device, generator=gen))
    inputs = (hidden, weight, labels, weights)
    old = measure(previous_kernel, inputs, device, repeats)
    new = measure(archer_kernel, inputs, device, repeats)
    names = ("logp", "entropy", "grad_hidden", "grad_weight")
    old_results, new_results = old.pop("results"), new.pop("results")
    diffs = {f"max_abs_diff_{name}": float((a.float() - b.float()).abs().max())
             for name, a, b in zip(names, old_results, new_results, strict=True)}
    scale = {f"max_abs_{name}": float(b.float().abs().max()) for name, b in zip(names, new_results, strict=True)}
    return {"tokens": tokens, "vocab": vocab, "hidden": hidden_size, "chunk_tokens": auto_chunk_size(vocab),
            "previous": old, "archer": new, **diffs, **scale}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[65536])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows = [compare(n, args.vocab, args.hidden, device, args.repeats) for n in args.tokens]
    print(f"device: {name}, torch {torch.__version__}; vocabulary {args.vocab}, hidden {args.hidden}")
    print("| tokens | kernel | chunk tokens | peak extra GiB | fwd+bwd s |")
    print("|---|---|---|---|---|")
    for row in rows:
        for kernel, chunk in (("previous", 1024), ("archer", row["chunk_tokens"])):
            result = row[kernel]
            print(f"| {row['tokens']} | {kernel} | {chunk} | {result['peak_extra_gib']:.2f} | {result['time_s']:.3f} |")
    print(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
