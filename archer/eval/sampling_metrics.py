"""Sampling metrics of an evaluation: mean@n, the unbiased pass@k, best@k and maj@k, per data source and overall.

Every problem has n scored samples (accuracy ``acc`` in [0, 1], and the sample's normalised final answer, or
None when it gave none). Per problem:

- mean@n: the mean accuracy of its n samples (pass@1 estimated as avg@n);
- pass@k: the unbiased estimator of Chen et al. (2021), ``1 - C(n-c, k) / C(n, k)``, computed exactly (Python's
  integer binomials and one rounding to float at the end), so pass@1 is c/n to the last bit, the same number
  as mean@n of 0/1 accuracies; c counts the samples with acc >= 0.5 (``CORRECT_AT``);
- best@k: the best accuracy among the first k samples;
- maj@k: the accuracy of the majority answer among the first k samples. Samples without an answer do not vote;
  the answer with most votes wins, and a tie goes to the answer whose first vote came earliest (the lowest
  sample index), so the result never depends on hashing or dict order. The winner's accuracy is that of its
  earliest sample. A problem where no sample among the first k gave an answer scores 0.

The figures of a data source are the means over its problems; "all" pools every problem. Training's validation
and ``archer eval`` report these under the same keys (``val-core/<source>/acc/...``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from math import comb

import numpy as np

from archer.algorithms.grouping import group_rows
from archer.errors import ArcherError
from archer.rewards.extras import CORRECT_AT


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a problem with ``c`` correct samples out of ``n`` (1 <= k <= n)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    return float(1 - Fraction(comb(n - c, k), comb(n, k)))


def majority_index(answers: Sequence[str | None]) -> int | None:
    """Index of the earliest sample holding the majority answer (ties: the answer seen first); None without answers."""
    votes: dict[str, int] = defaultdict(int)
    first: dict[str, int] = {}
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        votes[answer] += 1
        first.setdefault(answer, i)
    if not votes:
        return None
    winner = min(votes, key=lambda a: (-votes[a], first[a]))
    return first[winner]


@dataclass(frozen=True)
class ProblemSamples:
    """The n samples of one problem: their accuracies and normalised answers (None: no maj@k), in sample order."""

    source: str
    acc: Sequence[float]
    answers: Sequence[str | None] | None = None


def problem_metrics(samples: ProblemSamples, ks: Sequence[int]) -> dict[str, float]:
    """mean@n, and pass@k, best@k, maj@k for each k, of one problem."""
    acc = np.asarray(samples.acc, dtype=np.float64)
    n = len(acc)
    c = int(np.sum(acc >= CORRECT_AT))
    out = {f"mean@{n}": float(acc.mean())}
    for k in ks:
        out[f"pass@{k}"] = pass_at_k(n, c, k)
        out[f"best@{k}"] = float(acc[:k].max())
        if samples.answers is not None:
            winner = majority_index(samples.answers[:k])
            out[f"maj@{k}"] = 0.0 if winner is None else float(acc[winner])
    return out


def default_ks(n: int) -> list[int]:
    """k of a run that names none: 1, the powers of two below n, and n."""
    return sorted({1, n, *(2**i for i in range(1, n.bit_length()) if 2**i < n)})


def check_ks(ks: Sequence[int], n: int) -> list[int]:
    """The k values, sorted and unique; each must be in [1, n]."""
    bad = [k for k in ks if not 1 <= int(k) <= n]
    if bad:
        raise ArcherError(f"k={list(ks)} holds {bad}, outside 1..n={n}: pass@k and maj@k need at least k samples",
                          f"choose k between 1 and n, or raise n (n={max(int(k) for k in ks)} covers them)")
    return sorted({int(k) for k in ks})


def sampling_metrics(problems: Sequence[ProblemSamples], ks: Sequence[int]) -> dict[str, float]:
    """``val-core/<source>/acc/{mean@n, best@k/mean, maj@k/mean, pass@k}`` for each source and "all"; with one
    sample per problem only mean@1 (every other figure would repeat it)."""
    if not problems:
        return {}
    n = len(problems[0].acc)
    if any(len(p.acc) != n for p in problems):
        raise ValueError("every problem needs the same number of samples")
    by_source: dict[str, list[dict[str, float]]] = defaultdict(list)
    for problem in problems:
        figures = problem_metrics(problem, ks if n > 1 else [])
        by_source[problem.source].append(figures)
        by_source["all"].append(figures)
    out: dict[str, float] = {}
    for source, rows in by_source.items():
        for name in rows[0]:
            key = name if name.startswith(("mean@", "pass@")) else f"{name}/mean"
            out[f"val-core/{source}/acc/{key}"] = float(np.mean([r[name] for r in rows]))
    return out


def _means_by_source(sources: np.ndarray, values: np.ndarray) -> dict[str, float]:
    """Mean of the values that are not NaN, per data source and over "all"; a source without any gets none."""
    means = {}
    for name, rows in [*((s, sources == s) for s in dict.fromkeys(sources)), ("all", slice(None))]:
        kept = values[rows][~np.isnan(values[rows])]
        if kept.size:
            means[name] = float(np.mean(kept))
    return means


def validation_metrics(data_sources: Sequence[str], uids: Sequence[object], acc: np.ndarray, scores: np.ndarray,
                       n: int, extras: Mapping[str, np.ndarray] | None = None,
                       answers: Sequence[str | None] | None = None, ks: Sequence[int] | None = None
                       ) -> dict[str, float]:
    """The metrics of scored samples (each prompt's n rows share a uid): ``sampling_metrics`` of the prompts
    (``answers``: each row's normalised answer, for maj@k; ``ks``: default ``default_ks(n)``), and the mean@n of
    the score and of each numeric reward extra (``extras``: key -> column, NaN where a row lacks it) as
    ``val-aux/<source>/<name>/mean@n``."""
    sources = np.asarray([str(ds) for ds in data_sources])
    acc = np.asarray(acc, dtype=np.float64)
    problems = [ProblemSamples(str(sources[rows[0]]), acc[rows],
                               None if answers is None else [answers[i] for i in rows])
                for rows in group_rows(list(zip(sources, uids)))]
    if any(len(p.acc) != n for p in problems):
        raise ValueError(f"validation_metrics: every prompt needs n={n} rows")
    metrics = sampling_metrics(problems, check_ks(ks, n) if ks is not None else default_ks(n))
    for name, column in {"score": scores, **(extras or {})}.items():
        for ds, mean in _means_by_source(sources, np.asarray(column, dtype=np.float64)).items():
            metrics[f"val-aux/{ds}/{name}/mean@{n}"] = mean
    return metrics
