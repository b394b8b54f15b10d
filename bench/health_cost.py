"""What the health checks cost per training step, at the quickstart's size and at larger batches.

A step's cost is what the trainer pays (archer/health/monitor.py): ``StepRows.from_batch`` (copying the step's
entropies, log-probs, advantages, masks and token ids to numpy) plus ``HealthEngine.step`` (the figures, the
nine checks over the history). The batch is synthetic (random entropies, log-probs and advantages, rewards
that differ within some groups), the history ``--history`` steps long, so the trends read a full horizon; every
check finds nothing, as on a healthy step (a flag adds its pointers: the same ranking over the same arrays).

    python bench/health_cost.py                      # 256 x 48 (the quickstart), 1024 x 1024, 512 x 8192
    python bench/health_cost.py --sizes 256x48 --repeats 50

Prints a Markdown table (device, date and command above it) for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time

import torch

from archer.batch import Batch
from archer.health.engine import HealthEngine
from archer.health.rows import StepRows
from archer.health.settings import HealthSettings, default_health_config

HEALTHY = {"actor/entropy": 0.5, "critic/score/mean": 0.3, "critic/acc/mean": 0.3, "response_length/mean": 100.0,
           "response_length/clip_ratio": 0.0, "actor/ppo_kl": 0.001, "actor/pg_clipfrac": 0.01, "actor/grad_norm": 1.0}


def synthetic_batch(responses: int, length: int, n: int = 8, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (responses,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    score = (torch.rand(responses, generator=g) < 0.3).float()
    scores = torch.zeros(responses, length)
    scores[torch.arange(responses), lengths - 1] = score
    advantages = (torch.randn(responses, 1, generator=g) * mask).float()
    return Batch(tensors={"entropies": torch.rand(responses, length, generator=g) * mask,
                          "old_log_probs": -torch.rand(responses, length, generator=g) * 3 * mask,
                          "response_mask": mask, "advantages": advantages, "token_level_scores": scores,
                          "responses": torch.randint(0, 150_000, (responses, length), generator=g)},
                 rows={"uid": [f"g{i // n}" for i in range(responses)], "acc": score.numpy().astype(object),
                       "finish_reason": ["eos"] * responses})


def step_seconds(batch: Batch, settings: HealthSettings, history: int, repeats: int) -> list[float]:
    engine = HealthEngine(settings)
    for step in range(1, history + 1):
        engine.step(step, dict(HEALTHY), None)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        rows = StepRows.from_batch(batch)
        _, flags = engine.step(history + 1 + i, dict(HEALTHY), rows)
        times.append(time.perf_counter() - start)
        assert not flags, [f.line() for f in flags]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["256x48", "1024x1024", "512x8192"],
                        help="responses x response length")
    parser.add_argument("--history", type=int, default=1000, help="steps already in the history")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = HealthSettings.from_config(default_health_config())
    print(f"device: {platform.processor() or platform.machine()} CPU, 1 torch thread, {time.strftime('%Y-%m-%d')}; "
          f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}\n")
    print("| responses x length | tokens | ms per step (median) | min | max |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        responses, length = (int(x) for x in size.split("x"))
        ms = [1000 * t for t in step_seconds(synthetic_batch(responses, length), settings, args.history, args.repeats)]
        print(f"| {responses} x {length} | {responses * length:,} | {statistics.median(ms):.1f} | {min(ms):.1f} | "
              f"{max(ms):.1f} |", flush=True)


if __name__ == "__main__":
    main()
