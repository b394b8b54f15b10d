"""Queries of the trace explorer: pure numpy/pandas functions over one step's arrays and the manifest.

A step is the dict of arrays ``TraceReader.load_step`` returns (fields in trace/format.py). Token texts come
from a ``decode`` callable (token ids -> one string per id) so nothing here needs a tokenizer. Entropy
statistics use the valid tokens (``response_mask``); influence statistics use the valid tokens whose
influence is not NaN. A response's text is its valid tokens and, in a run with tools, the tool output between
them (``tool_mask``): shown, never counted as the policy's; its tool calls are the spans between the call tags
the trace's summary records (``call_tags``). ``branch_tree`` lays out one prompt's responses as the tree the
agentic loop grew (``branch_parent``, ``branch_position``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from archer.algorithms import grouping
from archer.errors import ArcherError
from archer.tagged_text import tag_spans
from archer.trace.format import REWARD_EXTRA_PREFIX, value_stats

Arrays = dict[str, np.ndarray]
Decode = Callable[[np.ndarray], list[str]]
CallTags = tuple[tuple[str, str], ...]  # (opening, closing) tag of each kind of tool call

SORTS = ("position", "entropy_asc", "entropy_desc")
# The calls of a trace whose summary records no call_tags (one written before archer recorded them): ARPO's
# built-in tools and Hermes' tool_call.
DEFAULT_CALL_TAGS: CallTags = (("<python>", "</python>"), ("<search>", "</search>"), ("<tool_call>", "</tool_call>"))
# Manifest keys that are bookkeeping, not curves.
_NOT_CURVES = {"step", "created_at", "file", "num_responses", "response_len"}
_STEP_STATS = ("mean", "std", "p50", "p90", "p99")


def influence_valid(arrays: Arrays) -> np.ndarray:
    """Valid tokens with a computed (non-NaN) influence; all False for an entropy trace."""
    mask = arrays["response_mask"]
    if "influence" not in arrays:
        return np.zeros_like(mask)
    return mask & ~np.isnan(arrays["influence"])


def step_stats(arrays: Arrays) -> dict[str, float]:
    """Entropy mean/std/p50/p90/p99 over valid tokens, counts, reward mean, influence stats when present."""
    mask = arrays["response_mask"]
    entropy = value_stats(arrays["entropies"][mask], "entropy")
    stats: dict[str, float] = {"num_responses": int(mask.shape[0]), "num_valid_tokens": int(mask.sum())}
    stats.update({f"entropy_{k}": entropy[f"entropy_{k}"] for k in _STEP_STATS})
    if "reward" in arrays:
        stats["reward_mean"] = float(np.mean(arrays["reward"], dtype=np.float64)) if mask.shape[0] else np.nan
    if "accepted" in arrays:
        stats["accepted_fraction"] = float(np.mean(arrays["accepted"])) if mask.shape[0] else np.nan
    if "influence" in arrays:
        valid = influence_valid(arrays)
        values = arrays["influence"][valid].astype(np.float64)
        influence = value_stats(values, "influence")
        stats["num_valid_influence"] = int(valid.sum())
        stats.update({f"influence_{k}": influence[f"influence_{k}"] for k in _STEP_STATS})
        stats["influence_abs_p99"] = float(np.percentile(np.abs(values), 99)) if values.size else np.nan
    return stats


INFLUENCE_SCALES = ("response", "step")  # the influence heatmap's colour scale: p99 of |influence| over either


def _positive(value: float | None) -> float:
    return float(value) if value is not None and np.isfinite(value) and value > 0 else 1.0


def colour_scales(stats: dict[str, float]) -> tuple[float, float]:
    """Heatmap scale maxima of a step: p99 of the entropy and of |influence| (1.0 when not positive)."""
    return _positive(stats.get("entropy_p99")), _positive(stats.get("influence_abs_p99"))


def response_influence_scale(arrays: Arrays, row: int) -> float:
    """p99 of |influence| over one response's computed tokens (1.0 when not positive): a step's largest values
    can be hundreds of times a response's, which the step's scale would leave all white."""
    values = arrays["influence"][row][influence_valid(arrays)[row]].astype(np.float64)
    return _positive(float(np.percentile(np.abs(values), 99)) if values.size else None)


def _row_means(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    total = np.where(valid, values.astype(np.float64), 0.0).sum(axis=1)
    count = valid.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def overview_table(arrays: Arrays) -> pd.DataFrame:
    """One row per response: its metadata (its policy versions and staleness when the trace has them),
    learned_tokens (the policy's tokens the loss learned from: response_mask less rollout_rs_rejected, whose
    count is rejected_tokens), reward extras (each under its key, or its field name when the key is taken) and
    mean/max entropy (and mean influence)."""
    mask = arrays["response_mask"]
    n = mask.shape[0]
    table: dict[str, Any] = {"row": np.arange(n), "response_index": arrays["response_index"]}
    for name in ("uid", "sample_index", "data_source"):
        if name in arrays:
            table[name] = arrays[name]
    rejected = arrays.get("rollout_rs_rejected")
    # the policy's own tokens the loss learned from; tool output and the rollout correction's rejections not counted
    table["learned_tokens"] = mask.sum(axis=1) - (0 if rejected is None else rejected.sum(axis=1))
    if rejected is not None:
        table["rejected_tokens"] = rejected.sum(axis=1)
    if "tool_mask" in arrays:
        table["tool_tokens"] = arrays["tool_mask"].sum(axis=1)
    for name in ("reward", "acc", "advantage", "accepted", "group_id", "num_tool_calls", "num_turns",
                 "branch_parent", "branch_position", "finish_reason", "first_policy_version", "policy_version",
                 "staleness"):
        if name in arrays:
            table[name] = arrays[name]
    for name in sorted(n for n in arrays if n.startswith(REWARD_EXTRA_PREFIX)):  # the reward's extras
        key = name.removeprefix(REWARD_EXTRA_PREFIX)
        table[name if key in table else key] = arrays[name]
    entropies = arrays["entropies"]
    table["entropy_mean"] = _row_means(entropies, mask)
    table["entropy_max"] = np.where(mask, entropies.astype(np.float64), -np.inf).max(axis=1, initial=-np.inf)
    table["entropy_max"][~mask.any(axis=1)] = np.nan
    if "influence" in arrays:
        table["influence_mean"] = _row_means(arrays["influence"], influence_valid(arrays))
    return pd.DataFrame(table)


def prompt_ids(arrays: Arrays, row: int) -> np.ndarray | None:
    """The real (unpadded) prompt token ids of a response; None when the step has no prompts."""
    if "prompts" not in arrays:
        return None
    prompt = arrays["prompts"][row]
    if "prompt_length" not in arrays:
        return prompt
    length = int(arrays["prompt_length"][row])
    return prompt[prompt.shape[0] - length:] if length > 0 else prompt[:0]


def content_mask(arrays: Arrays) -> np.ndarray:
    """[num_responses, response_len] the tokens of each response: the valid ones and the tool output."""
    mask = arrays["response_mask"]
    return mask | arrays["tool_mask"] if "tool_mask" in arrays else mask


def response_ids(arrays: Arrays, row: int) -> np.ndarray:
    """The token ids of a response (its valid tokens and tool output), in order."""
    return arrays["responses"][row][content_mask(arrays)[row]]


def call_tags(summary: Mapping[str, Any]) -> CallTags:
    """The run's call tags as its trace summary records them (``call_tags``: [opening, closing] pairs, the tool
    tags of multi_turn.format=arpo or Hermes' tool_call); DEFAULT_CALL_TAGS when it records none."""
    recorded = summary.get("call_tags")
    if recorded is None:
        return DEFAULT_CALL_TAGS
    if not isinstance(recorded, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) and t for t in pair)
            for pair in recorded):
        raise ArcherError(f"the trace's summary.json has call_tags {recorded!r}, not a list of [opening, closing] "
                          "tag pairs", "the trace directory is damaged; restore its summary.json or delete its "
                          "call_tags key (the explorer then highlights the built-in tools' calls)")
    return tuple((opening, closing) for opening, closing in recorded)


def call_tokens(texts: Sequence[str], written: np.ndarray, tags: CallTags = DEFAULT_CALL_TAGS) -> np.ndarray:
    """bool per token: inside a tool call (an opening tag of ``tags``, then its closing tag) within one run of
    tokens the model ``written``; a token the call's text only touches (a tag fused with other text) counts."""
    out = np.zeros(len(texts), dtype=bool)
    if not tags:
        return out
    ends = np.cumsum([len(t) for t in texts])
    starts = ends - np.array([len(t) for t in texts], dtype=ends.dtype)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], written.astype(np.int8), [0]])))
    for first, last in zip(edges[::2], edges[1::2]):  # each run of written tokens [first, last)
        offset = starts[first]
        for start, end, _ in tag_spans("".join(texts[first:last]), tags):  # linear: model text is hostile
            a, b = start + offset, end + offset
            out[first:last] |= (starts[first:last] < b) & (ends[first:last] > a)
    return out


def check_row(arrays: Arrays, row: int) -> int:
    n = arrays["response_mask"].shape[0]
    if not 0 <= int(row) < n:
        raise IndexError(f"response row {row} is out of range (the step has {n} responses: 0..{n - 1})")
    return int(row)


def token_table(arrays: Arrays, row: int, decode: Decode, *, tags: CallTags = DEFAULT_CALL_TAGS) -> pd.DataFrame:
    """Every position of one response: position, token, token_id, entropy, log_prob, prob, influence, valid,
    rejected (when the trace records the rollout correction's rejections) and, in a run with tools, tool (tool
    output) and tool_call (the model's tokens of a call: ``tags``, the run's ``call_tags``)."""
    row = check_row(arrays, row)
    ids = arrays["responses"][row]
    texts = decode(ids)
    table: dict[str, Any] = {"position": np.arange(ids.shape[0]), "token": texts, "token_id": ids,
                             "entropy": arrays["entropies"][row].astype(np.float64)}
    if "old_log_probs" in arrays:
        log_probs = arrays["old_log_probs"][row].astype(np.float64)
        table["log_prob"] = log_probs
        table["prob"] = np.exp(log_probs)
    if "influence" in arrays:
        table["influence"] = arrays["influence"][row].astype(np.float64)
    table["valid"] = arrays["response_mask"][row]
    if "rollout_rs_rejected" in arrays:
        table["rejected"] = arrays["rollout_rs_rejected"][row]
    if "tool_mask" in arrays:
        table["tool"] = arrays["tool_mask"][row]
        table["tool_call"] = call_tokens(texts, arrays["response_mask"][row], tags)
    return pd.DataFrame(table)


def in_response(tokens: pd.DataFrame) -> np.ndarray:
    """The rows of a token table that are part of the response (valid or tool output), not padding."""
    valid = tokens["valid"].to_numpy()
    return valid | tokens["tool"].to_numpy() if "tool" in tokens.columns else valid


def view_mask(tokens: pd.DataFrame, *, entropy_range: tuple[float | None, float | None] = (None, None),
              search: str = "") -> np.ndarray:
    """Tokens inside the entropy range (inclusive; None = open end) whose text contains ``search``.

    The search is a case-insensitive substring match on the token's decoded text; empty matches everything.
    Tool output is outside every entropy range: its entropy is not the policy's.
    """
    keep = np.ones(len(tokens), dtype=bool)
    low, high = entropy_range
    entropy = tokens["entropy"].to_numpy()
    if low is not None:
        keep &= entropy >= low
    if high is not None:
        keep &= entropy <= high
    if (low is not None or high is not None) and "tool" in tokens.columns:
        keep &= ~tokens["tool"].to_numpy()
    if search:
        needle = search.lower()
        keep &= np.fromiter((needle in text.lower() for text in tokens["token"]), dtype=bool, count=len(tokens))
    return keep


def token_view(tokens: pd.DataFrame, *, entropy_range: tuple[float | None, float | None] = (None, None),
               search: str = "", show_padding: bool = False, sort: str = "position") -> pd.DataFrame:
    """The selected response view: padding hidden unless asked, filtered, sorted.

    ``sort``: "position", "entropy_asc" or "entropy_desc"; ties keep position order, and tool output comes
    after the policy's tokens.
    """
    if sort not in SORTS:
        raise ValueError(f"unknown sort {sort!r}; expected one of {SORTS}")
    keep = view_mask(tokens, entropy_range=entropy_range, search=search)
    if not show_padding:
        keep &= in_response(tokens)
    view = tokens[keep]
    if sort != "position":
        entropy = view["entropy"].to_numpy()
        tool = view["tool"].to_numpy() if "tool" in view.columns else np.zeros(len(view), dtype=bool)
        order = np.lexsort((view["position"].to_numpy(), entropy if sort == "entropy_asc" else -entropy, tool))
        view = view.iloc[order]
    return view.reset_index(drop=True)


def view_csv(view: pd.DataFrame, step: int, row: int) -> str:
    """CSV text of a response view: step and row first, then the view's columns, floats at full precision."""
    out = view.copy()
    out.insert(0, "row", row)
    out.insert(0, "step", step)
    return out.to_csv(index=False, lineterminator="\n")


def top_tokens(arrays: Arrays, k: int, decode: Decode, *, highest: bool = True) -> pd.DataFrame:
    """The k valid tokens of the step with the highest (or lowest) entropy.

    Ties are broken by row, then position, so the answer is deterministic.
    """
    mask = arrays["response_mask"]
    flat = np.flatnonzero(mask)
    columns = ["rank", "row", "response_index", "position", "token", "token_id", "entropy"]
    k = min(int(k), flat.size)
    if k <= 0:
        return pd.DataFrame(columns=columns)
    values = arrays["entropies"].reshape(-1)[flat].astype(np.float32)
    key = -values if highest else values
    threshold = key[np.argpartition(key, k - 1)[:k]].max()
    candidates = np.flatnonzero(key <= threshold)
    chosen = flat[candidates[np.lexsort((flat[candidates], key[candidates]))[:k]]]
    rows, positions = np.divmod(chosen, mask.shape[1])
    ids = arrays["responses"][rows, positions]
    return pd.DataFrame({"rank": np.arange(1, k + 1), "row": rows, "response_index": arrays["response_index"][rows],
                         "position": positions, "token": decode(ids), "token_id": ids,
                         "entropy": arrays["entropies"][rows, positions].astype(np.float64)})


def entropy_histogram(arrays: Arrays, bins: int = 50,
                      value_range: tuple[float, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Counts and bin edges of the valid tokens' entropies (range: 0 .. max unless given)."""
    values = arrays["entropies"][arrays["response_mask"]].astype(np.float64)
    if value_range is None:
        top = float(values.max()) if values.size else 1.0
        value_range = (0.0, top if top > 0 else 1.0)
    return np.histogram(values, bins=int(bins), range=value_range)


def curves(entries: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """Numeric manifest statistics by step (one column per statistic, NaN where a step lacks it)."""
    records = []
    for entry in entries:
        record = {"step": int(entry["step"])}
        for key, value in entry.items():
            if key not in _NOT_CURVES and isinstance(value, (int, float)) and not isinstance(value, bool):
                record[key] = float(value)
        records.append(record)
    if not records:
        return pd.DataFrame({"step": pd.Series(dtype=np.int64)})
    return pd.DataFrame.from_records(records).sort_values("step").reset_index(drop=True)


def group_rows(arrays: Arrays, uid: str) -> np.ndarray:
    """Rows of the responses to one prompt (sharing ``uid``), ordered by sample_index then row."""
    if "uid" not in arrays:
        return np.zeros(0, dtype=np.int64)
    rows = np.flatnonzero(arrays["uid"] == uid)
    if "sample_index" in arrays:
        rows = rows[np.lexsort((rows, arrays["sample_index"][rows]))]
    return rows


def matching_rows(arrays: Arrays, row: int, other: Arrays) -> np.ndarray:
    """Rows of ``other`` whose prompt token ids equal those of ``row`` in ``arrays`` (uids are per step)."""
    wanted = prompt_ids(arrays, check_row(arrays, row))
    if wanted is None or "prompts" not in other:
        return np.zeros(0, dtype=np.int64)
    n = other["response_mask"].shape[0]
    rows = np.array([r for r in range(n) if np.array_equal(prompt_ids(other, r), wanted)], dtype=np.int64)
    if rows.size and "sample_index" in other:
        rows = rows[np.lexsort((rows, other["sample_index"][rows]))]
    return rows


def prompt_uids(arrays: Arrays) -> list[str]:
    """The step's prompt uids, in the order of their first response."""
    if "uid" not in arrays:
        return []
    return [str(arrays["uid"][rows[0]]) for rows in grouping.group_rows(arrays["uid"])]


def branch_tree(arrays: Arrays, uid: str) -> pd.DataFrame:
    """The responses to one prompt as the tree the tool loop grew, one row per response in drawing order (each
    response right after the one it branched from, its branches by branch position):

    row, sample_index, parent (the sample_index it branched from, -1 for a root), parent_row, branch_position
    (its first token of its own, -1 for a root), branch_token_entropy (the traced entropy of that one token,
    in nats: the distribution it and its parent both sampled from there; not the windowed, normalised H the
    branching rule compares), depth, branches (responses that branched from it), all_tokens (its
    tokens, tool output included), tool_tokens, reward, num_tool_calls, finish_reason (the last three when the
    trace has them). Without ``branch_parent`` (a run without tools), or when a parent is not an earlier response
    of the group, a response is a root.
    """
    rows = group_rows(arrays, uid).tolist()
    n = len(rows)
    sample = dict(zip(rows, (arrays["sample_index"][rows] if "sample_index" in arrays else range(n))))
    sample = {r: int(s) for r, s in sample.items()}
    row_of = {s: r for r, s in sample.items()}
    parent_of = arrays["branch_parent"] if "branch_parent" in arrays else np.full(len(arrays["response_mask"]), -1)
    parent_row = {}
    for r in rows:
        p = int(parent_of[r])
        parent_row[r] = row_of[p] if 0 <= p < sample[r] and p in row_of else -1  # a root otherwise
    position = {r: int(arrays["branch_position"][r]) if parent_row[r] >= 0 else -1 for r in rows}
    children: dict[int, list[int]] = {}
    for r in rows:
        children.setdefault(parent_row[r], []).append(r)
    order: list[tuple[int, int]] = []  # (row, depth), depth first
    stack = [(r, 0) for r in reversed(children.get(-1, []))]
    while stack:
        r, depth = stack.pop()
        order.append((r, depth))
        below = sorted(children.get(r, []), key=lambda c: (position[c], sample[c]))
        stack += [(c, depth + 1) for c in reversed(below)]
    content = content_mask(arrays)
    ordered = [r for r, _ in order]
    table: dict[str, Any] = {
        "row": ordered, "sample_index": [sample[r] for r in ordered],
        "parent": [sample[parent_row[r]] if parent_row[r] >= 0 else -1 for r in ordered],
        "parent_row": [parent_row[r] for r in ordered],
        "branch_position": [position[r] for r in ordered],
        "branch_token_entropy": [float(arrays["entropies"][r, position[r]]) if position[r] >= 0 else np.nan
                           for r in ordered],
        "depth": [d for _, d in order],
        "branches": [len(children.get(r, [])) for r in ordered],
        "all_tokens": [int(np.flatnonzero(content[r])[-1]) + 1 if content[r].any() else 0 for r in ordered],
        "tool_tokens": [int(arrays["tool_mask"][r].sum()) if "tool_mask" in arrays else 0 for r in ordered],
    }
    for name in ("reward", "num_tool_calls", "finish_reason"):
        if name in arrays:
            table[name] = arrays[name][np.asarray(ordered, dtype=np.int64)]
    return pd.DataFrame(table)
