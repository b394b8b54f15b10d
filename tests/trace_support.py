"""Small synthetic traces for the explorer's tests, written with the real TraceWriter and a real tokenizer.

Each step has ``num_prompts`` prompts x ``rollout_n`` responses. Responses are real text encoded with the
tokenizer (spaces, newlines and tabs included), right-padded with the pad id; entropies and log-probs are
float16 from a seeded generator (padding entropy 0). uids differ between steps while the prompts repeat, as
in training, so the same prompt is found at two steps only by its token ids. Every step has one reward extra,
``reward_extra/f1`` (NaN on every third response). Influence traces add influence (NaN at padding and at every
fifth valid token), accepted (reward equals the group maximum) and group_id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from archer.models.tiny import train_tokenizer
from archer.trace.entropy import step_stats
from archer.trace.format import TraceWriter
from archer.trace.influence import influence_stats

PROMPTS = ["Question: what is 3 + 5? Answer:", "Solve the problem step by step.",
           "Use the python tool: print(2 ** 10)", "The quick brown fox"]
RESPONSES = ["The answer is 8.\nDone.", "Let me think.\tFirst add 3 and 5, the sum is 8.",
             "<think>First add the tens, then the ones.</think> <answer>42</answer>",
             "The quick brown fox jumps over the lazy dog.", "I think the answer is 1024.",
             "Reinforcement learning trains a policy with rewards."]
CORPUS = PROMPTS + RESPONSES + ["what is the answer? the critic estimates values.", "1 2 3 4 5 6 7 8 9 0"]


def tiny_tokenizer(vocab_size: int = 300) -> Any:
    """A byte-level BPE tokenizer trained on the texts above (every id decodes)."""
    return train_tokenizer(CORPUS * 4, vocab_size)


def step_arrays(tokenizer: Any, step: int, *, kind: str = "entropy", num_prompts: int = 2, rollout_n: int = 3,
                response_len: int = 32, prompt_len: int = 40, seed: int = 0) -> dict[str, np.ndarray]:
    """The arrays of one step (fields of trace/format.py), deterministic in (step, seed)."""
    rng = np.random.default_rng([seed, step])
    n = num_prompts * rollout_n
    pad = tokenizer.pad_token_id
    responses = np.full((n, response_len), pad, dtype=np.int32)
    mask = np.zeros((n, response_len), dtype=bool)
    prompts = np.full((n, prompt_len), pad, dtype=np.int32)
    prompt_length = np.zeros(n, dtype=np.int32)
    for i in range(n):
        group = i // rollout_n
        text = RESPONSES[(step + i) % len(RESPONSES)]
        ids = tokenizer.encode(text, add_special_tokens=False)[: response_len - 1 - (i % 4)]
        responses[i, : len(ids)] = ids
        mask[i, : len(ids)] = True
        p_ids = tokenizer.encode(PROMPTS[(group + step // 2) % len(PROMPTS)], add_special_tokens=False)[-prompt_len:]
        prompts[i, prompt_len - len(p_ids):] = p_ids
        prompt_length[i] = len(p_ids)
    entropies = np.where(mask, rng.uniform(0.0, 3.0, (n, response_len)), 0.0).astype(np.float16)
    reward = rng.integers(0, 2, n).astype(np.float32)
    arrays = {
        "entropies": entropies,
        "response_mask": mask,
        "responses": responses,
        "response_index": np.arange(n, dtype=np.int32),
        "prompt_length": prompt_length,
        "prompts": prompts,
        "uid": np.asarray([f"s{step}-g{i // rollout_n}" for i in range(n)]),
        "sample_index": np.asarray([i % rollout_n for i in range(n)], dtype=np.int32),
        "old_log_probs": np.where(mask, -rng.exponential(1.0, (n, response_len)), 0.0).astype(np.float16),
        "reward": reward,
        "advantage": (reward - reward.reshape(num_prompts, rollout_n).mean(axis=1).repeat(rollout_n)).astype(
            np.float32),
        "data_source": np.asarray(["arithmetic" if i % 2 == 0 else "countdown" for i in range(n)]),
        "reward_extra/f1": np.where(np.arange(n) % 3 == 2, np.nan, 0.25 + 0.5 * reward).astype(np.float32),
    }
    if kind == "influence":
        influence = rng.normal(0.0, 0.5, (n, response_len))
        computed = mask & (np.arange(response_len) % 5 != 4)
        group_max = reward.reshape(num_prompts, rollout_n).max(axis=1).repeat(rollout_n)
        arrays.update({"influence": np.where(computed, influence, np.nan).astype(np.float16),
                       "selected_row_id": np.arange(n, dtype=np.int32),
                       "accepted": reward == group_max,
                       "group_id": np.asarray([i // rollout_n for i in range(n)], dtype=np.int32)})
    return arrays


def manifest_stats(arrays: dict[str, np.ndarray]) -> dict[str, float]:
    """The manifest statistics the real writers record for the step's kind."""
    return influence_stats(arrays) if "influence" in arrays else step_stats(arrays)


def write_trace(out_dir: str | Path, tokenizer: Any, *, kind: str = "entropy", steps=(1, 2, 3),
                save_tokenizer: bool = True, **shape: Any) -> Path:
    """Write a trace of ``steps`` into ``out_dir`` (with the tokenizer saved in it unless told not to)."""
    writer = TraceWriter(out_dir, kind=kind, metadata={"project_name": "viz-tests", "experiment_name": kind},
                         tokenizer=tokenizer if save_tokenizer else None)
    for step in steps:
        add_step(writer, tokenizer, step, **shape)
    return Path(out_dir)


def add_step(writer: TraceWriter, tokenizer: Any, step: int, **shape: Any) -> dict[str, np.ndarray]:
    """Write one more step with ``writer`` (as a running training does); returns its arrays."""
    arrays = step_arrays(tokenizer, step, kind=writer.kind, **shape)
    writer.write_step(step, arrays, manifest_stats(arrays))
    return arrays
