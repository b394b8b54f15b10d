"""Per-step figures the checks need that verl's metrics lack, computed from the step's responses (rows.py):

    health/near_deterministic_frac   share of learned tokens with entropy below trainer.health.near_deterministic_entropy
    health/logp_adv_cov              covariance of log-prob and advantage over the learned tokens: the entropy
                                     mechanism paper's driver of entropy change (Clip-Cov and KL-Cov act on its
                                     largest terms); positive lowers the entropy
    health/zero_adv_group_frac       share of prompt groups (2+ responses) whose responses all scored the same
    health/repetition_frac           mean over responses of their share of repeated n-grams of learned tokens
                                     (over evenly spaced responses of at most 65,536 token positions: it
                                     sorts the n-grams, the one figure whose cost grows faster than the batch)
    health/repeated_call_frac        share of tool calls repeating an earlier identical call of the same response

Also the per-token and per-response scores the pointers rank (``token_covariance``, ``repeated_ngrams``). All are
numpy over the step's arrays: no model work.
"""

from __future__ import annotations

import numpy as np

from archer.health.rows import StepRows

# The figures' metric names, which the checks (checks.py) read.
NEAR_DETERMINISTIC = "health/near_deterministic_frac"
LOGP_ADV_COV = "health/logp_adv_cov"
ZERO_ADV = "health/zero_adv_group_frac"
REPETITION = "health/repetition_frac"
REPEATED_CALLS = "health/repeated_call_frac"
FIGURES = (NEAR_DETERMINISTIC, LOGP_ADV_COV, ZERO_ADV, REPETITION, REPEATED_CALLS)

_HASH_BITS = 40  # an n-gram's hash keeps this many bits; the response's row takes the bits above
REPETITION_TOKENS = 1 << 16  # the repetition figure reads evenly spaced responses of at most this many positions


def step_figures(rows: StepRows, *, near_deterministic_entropy: float, ngram: int) -> dict[str, float]:
    """The step's ``health/*`` figures (a figure without data, e.g. calls in a run without tools, is left out)."""
    figures: dict[str, float] = {}
    mask = rows.mask
    if mask.any():
        figures[NEAR_DETERMINISTIC] = float(np.mean(rows.entropies[mask] < near_deterministic_entropy))
        figures[LOGP_ADV_COV] = float(token_covariance(rows)[mask].mean())
    share = zero_advantage_share(rows.uid, rows.reward)
    if share is not None:
        figures[ZERO_ADV] = share
    if len(rows):
        figures[REPETITION] = float(repetition_shares(rows.take(sample_rows(rows)), ngram).mean())
    if rows.calls is not None:
        total = sum(len(c) for c in rows.calls)
        if total:
            figures[REPEATED_CALLS] = sum(len(c) - len(set(c)) for c in rows.calls) / total
    return figures


def sample_rows(rows: StepRows, tokens: int = REPETITION_TOKENS) -> np.ndarray:
    """Evenly spaced responses holding at most ``tokens`` token positions (at least one response)."""
    count = max(1, min(len(rows), tokens // max(rows.mask.shape[1], 1)))
    return np.unique(np.linspace(0, len(rows) - 1, count).round().astype(np.int64))


def token_covariance(rows: StepRows) -> np.ndarray:
    """[N, L] each learned token's term of Cov(log-prob, advantage), ``(logp - mean)(A - mean)`` over the learned
    tokens (Clip-Cov's and KL-Cov's per-token covariance); 0 elsewhere."""
    mask = rows.mask
    out = np.zeros(mask.shape, dtype=np.float64)
    if not mask.any():
        return out
    logp, adv = rows.log_probs[mask].astype(np.float64), rows.advantages[mask].astype(np.float64)
    out[mask] = (logp - logp.mean()) * (adv - adv.mean())
    return out


def zero_advantage_share(uid: np.ndarray, reward: np.ndarray) -> float | None:
    """Share of the prompt groups of two or more responses whose rewards are all equal; None without such groups."""
    if not len(uid):
        return None
    _, group, sizes = np.unique(uid, return_inverse=True, return_counts=True)
    low = np.full(len(sizes), np.inf)
    high = np.full(len(sizes), -np.inf)
    np.minimum.at(low, group, reward)
    np.maximum.at(high, group, reward)
    real = sizes >= 2
    return float(np.mean(low[real] == high[real])) if real.any() else None


def _windows(mask: np.ndarray, n: int) -> np.ndarray:
    """[N, L - n + 1] bool: the n positions from here on are all learned tokens."""
    starts = mask.shape[1] - n + 1
    full = np.ones((mask.shape[0], max(starts, 0)), dtype=bool)
    for k in range(n):
        full &= mask[:, k:k + starts]
    return full


def repeated_ngrams(rows: StepRows, n: int) -> np.ndarray:
    """[N, L] bool: the learned token starts an n-gram of learned tokens that already occurred earlier in the
    same response (a hash of the n token ids; two different n-grams share one with probability ~2^-40)."""
    out = np.zeros(rows.mask.shape, dtype=bool)
    full = _windows(rows.mask, n)
    response, position = np.nonzero(full)
    if not len(response):
        return out
    ids = rows.responses.astype(np.uint64)
    digest = np.zeros(len(response), dtype=np.uint64)
    for k in range(n):
        digest = digest * np.uint64(1_000_003) + ids[response, position + k] + np.uint64(1)
    keys = (response.astype(np.uint64) << np.uint64(_HASH_BITS)) | (digest & np.uint64((1 << _HASH_BITS) - 1))
    _, first = np.unique(keys, return_index=True)  # np.nonzero's order: the earliest position of each key
    repeat = np.ones(len(keys), dtype=bool)
    repeat[first] = False
    out[response[repeat], position[repeat]] = True
    return out


def repetition_shares(rows: StepRows, n: int) -> np.ndarray:
    """[N] each response's share of its n-grams that repeat an earlier one (0 for responses without an n-gram)."""
    ngrams = _windows(rows.mask, n).sum(axis=1)
    repeats = repeated_ngrams(rows, n).sum(axis=1)
    return np.divide(repeats, ngrams, out=np.zeros(len(rows), dtype=np.float64), where=ngrams > 0)
