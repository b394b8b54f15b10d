"""Scoring throughput of archer eval's math verification: the verify pool (N math-verify processes, scored by N
threads as RewardManager(score_workers=N) does) against one worker process, on the same responses.

The responses: ``--samples`` per MATH-500 problem (``--problems`` of them, from ``--data-dir``'s
benchmarks/math500/test.jsonl), each a short solution ending in a boxed answer drawn (seeded) from the gold answer,
an equivalent rewriting of it, and wrong answers, so samples repeat answers as a model's do. Each configuration
starts with an empty verdict cache and warm worker processes; ``--uncached-problems N`` also times one worker
without the cache on the first N problems (scaled to all rows). Prints one JSON object: rows, distinct
(gold, answer) pairs, seconds and rows/s of each configuration, their ratio, and the CPU count.

    python bench/eval_speed.py --data-dir ../shared/data --problems 500 --samples 64 --workers 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from archer.rewards import math as math_reward
from archer.rewards.math import _VerifyPool
from archer.rewards.routing import default_compute_score

SOURCE = "HuggingFaceH4/MATH-500"


def responses(golds: list[str], samples: int, seed: int) -> list[tuple[str, str]]:
    """(response, gold) rows: per problem, ``samples`` responses over a handful of candidate answers."""
    rng = random.Random(seed)
    rows = []
    for i, gold in enumerate(golds):
        candidates = [gold, f"{{{gold}}}", f"{i + 7}", f"\\frac{{{i + 1}}}{{{i + 3}}}", f"x + {i}"]
        for _ in range(samples):
            rows.append((f"Working it out step by step. The answer is \\boxed{{{rng.choice(candidates)}}}.", gold))
    return rows


def score_all(rows: list[tuple[str, str]], workers: int, cache: bool = True) -> tuple[float, list[float]]:
    """Seconds to score every row with ``workers`` verify processes (cache emptied, or off; processes warm)."""
    math_reward._POOL.CACHE_SIZE = _VerifyPool.CACHE_SIZE if cache else 0  # 0: every verdict is dropped at once
    math_reward.set_verify_workers(workers)
    math_reward._POOL.warm()  # every process started before timing
    math_reward._POOL.clear_cache()
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        scores = list(pool.map(lambda row: float(default_compute_score(SOURCE, row[0], row[1])), rows))
    return time.perf_counter() - start, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True, help="folder holding benchmarks/math500/test.jsonl")
    parser.add_argument("--problems", type=int, default=500)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--uncached-problems", type=int, default=0,
                        help="also time one worker without the verdict cache on this many problems, scaled to all")
    args = parser.parse_args()
    path = args.data_dir / "benchmarks" / "math500" / "test.jsonl"
    golds = [json.loads(line)["answer"] for line in path.read_text(encoding="utf-8").splitlines()][: args.problems]
    rows = responses(golds, args.samples, args.seed)
    bare_s = None
    if args.uncached_problems:
        bare_rows = responses(golds[: args.uncached_problems], args.samples, args.seed)
        bare_s = score_all(bare_rows, 1, cache=False)[0] * len(rows) / len(bare_rows)
    one_s, one_scores = score_all(rows, 1)
    pool_s, pool_scores = score_all(rows, args.workers)
    print(json.dumps({
        "rows": len(rows), "distinct_pairs": len({(r, g) for r, g in rows}), "cpus": os.cpu_count(),
        "one_worker_s": round(one_s, 2), "one_worker_rows_per_s": round(len(rows) / one_s),
        f"pool_{args.workers}_s": round(pool_s, 2), f"pool_{args.workers}_rows_per_s": round(len(rows) / pool_s),
        "speedup": round(one_s / pool_s, 2),
        **({} if bare_s is None else {"one_worker_uncached_s_scaled": round(bare_s, 1),
                                      "uncached_problems": args.uncached_problems}), "accuracy": sum(one_scores) / len(rows),
        # verdicts that differ: only a verification that hit the time limit in one run (a loaded machine)
        "rows_scored_differently": sum(a != b for a, b in zip(one_scores, pool_scores, strict=True)),
        "pairs_scored_differently": sorted({(r[-60:], g) for (r, g), a, b in zip(rows, one_scores, pool_scores,
                                                                                strict=True) if a != b}),
    }))


if __name__ == "__main__":
    main()
