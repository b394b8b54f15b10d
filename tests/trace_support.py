"""Small synthetic traces for the explorer's tests, written with the real TraceWriter and a real tokenizer.

Each step has ``num_prompts`` prompts x ``rollout_n`` responses. Responses are real text encoded with the
tokenizer (spaces, newlines and tabs included), right-padded with the pad id; entropies and log-probs are
float16 from a seeded generator (padding entropy 0). uids differ between steps while the prompts repeat, as
in training, so the same prompt is found at two steps only by its token ids. Every step has one reward extra,
``reward_extra/f1`` (NaN on every third response). Influence traces add influence (NaN at padding and at every
fifth valid token), accepted (reward equals the group maximum) and group_id. Without ``off_policy`` a step holds
the fields archer wrote before the policy versions (an old trace). ``write_tool_trace`` writes the entropy trace
of a tool run: tool output, tool calls and branches (TOOL_GROUPS).
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
                response_len: int = 32, prompt_len: int = 40, seed: int = 0,
                off_policy: bool = False) -> dict[str, np.ndarray]:
    """The arrays of one step (fields of trace/format.py), deterministic in (step, seed). ``off_policy`` adds
    policy_version, first_policy_version and staleness (odd rows sampled one version before the step's, as an
    asynchronous run, and every fourth row's first token one version earlier still: a partial rollout) and
    rollout_rs_rejected (the first token of every response of the first prompt)."""
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
    if off_policy:
        stale = (np.arange(n) % 2).astype(np.int32)
        rejected = np.zeros_like(mask)
        rejected[:rollout_n, 0] = True
        first = (step - 1 - stale - (np.arange(n) % 4 == 3)).astype(np.int32)  # rows 3, 7, ...: partial rollouts
        arrays.update({"policy_version": (step - 1 - stale).astype(np.int32), "first_policy_version": first,
                       "staleness": stale, "rollout_rs_rejected": rejected})
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


# A tool run's step: per prompt, its responses as (branch, segments); a segment is (text, is_tool_output) and
# branch is None for a global sample or (parent, k): the response repeats its parent's tokens up to the end of
# the parent's k-th tool answer and writes its own segments from there, as the agentic loop's branches do.
CALL = "I will compute it. <python>print(2 ** 10)</python>"
ANSWER = " <result>\n1024\n</result>"
SEARCH = "<search>quick brown fox</search>"
FOUND = " <result>\nThe quick brown fox jumps over the lazy dog.\n</result>"
TOOL_GROUPS = [
    [(None, [(CALL, False), (ANSWER, True), (" The answer is 1024.", False)]),
     (None, [(SEARCH, False), (FOUND, True), (" I think the answer is 8.", False)]),
     ((0, 1), [(" Let me check. <python>print(3 + 5)</python>", False), (" <result>\n8\n</result>", True),
               (" The answer is 8.", False)]),
     ((2, 2), [(" Done. The answer is 1024.", False)])],
    [(None, [("The quick brown fox.", False)]),
     (None, [(SEARCH, False), (FOUND, True), (" The lazy dog.", False)]),
     ((1, 1), [(" <python>print(1)</python>", False), (" <result>\n1\n</result>", True), (" Done.", False)]),
     (None, [(CALL, False), (ANSWER, True), (" 1024", False)])],
]
TOOL_REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.5, 1.0]]


@dataclass
class ToolResponse:
    ids: list[int] = field(default_factory=list)
    tool: list[bool] = field(default_factory=list)
    parent: int = -1
    position: int = -1
    answer_ends: list[int] = field(default_factory=list)  # the position after each tool answer


def tool_responses(tokenizer: Any, group: list) -> list[ToolResponse]:
    """The responses of one of TOOL_GROUPS, each segment encoded on its own (as the loop does)."""
    out: list[ToolResponse] = []
    for branch, segments in group:
        response = ToolResponse()
        if branch is not None:
            parent, k = out[branch[0]], branch[1]
            position = parent.answer_ends[k - 1]
            response = ToolResponse(parent.ids[:position], parent.tool[:position], branch[0], position,
                                    parent.answer_ends[:k])
        for text, is_tool in segments:
            piece = tokenizer.encode(text, add_special_tokens=False)
            response.ids += piece
            response.tool += [is_tool] * len(piece)
            if is_tool:
                response.answer_ends.append(len(response.ids))
        out.append(response)
    return out


def tool_step_arrays(tokenizer: Any, step: int, *, seed: int = 0) -> dict[str, np.ndarray]:
    """An entropy-trace step of a tool run: TOOL_GROUPS (2 prompts x 4 responses) with their tool fields."""
    rng = np.random.default_rng([seed, step])
    responses = [r for group in TOOL_GROUPS for r in tool_responses(tokenizer, group)]
    n, width = len(responses), max(len(r.ids) for r in responses) + 2
    pad = tokenizer.pad_token_id
    ids = np.full((n, width), pad, dtype=np.int32)
    mask = np.zeros((n, width), dtype=bool)
    tool = np.zeros((n, width), dtype=bool)
    for i, r in enumerate(responses):
        ids[i, :len(r.ids)] = r.ids
        tool[i, :len(r.ids)] = r.tool
        mask[i, :len(r.ids)] = ~np.asarray(r.tool, dtype=bool)
    prompt_len = 40
    prompts = np.full((n, prompt_len), pad, dtype=np.int32)
    prompt_length = np.zeros(n, dtype=np.int32)
    for i in range(n):
        p_ids = tokenizer.encode(PROMPTS[2 + i // 4], add_special_tokens=False)
        prompts[i, prompt_len - len(p_ids):] = p_ids
        prompt_length[i] = len(p_ids)
    present = mask | tool
    reward = np.asarray(TOOL_REWARDS, dtype=np.float32).reshape(-1)
    return {
        "entropies": np.where(present, rng.uniform(0.0, 3.0, (n, width)), 0.0).astype(np.float16),
        "response_mask": mask,
        "responses": ids,
        "response_index": np.arange(n, dtype=np.int32),
        "prompt_length": prompt_length,
        "prompts": prompts,
        "uid": np.asarray([f"t{step}-g{i // 4}" for i in range(n)]),
        "sample_index": np.asarray([i % 4 for i in range(n)], dtype=np.int32),
        "old_log_probs": np.where(mask, -rng.exponential(1.0, (n, width)), 0.0).astype(np.float16),
        "reward": reward,
        "advantage": (reward - reward.reshape(2, 4).mean(axis=1).repeat(4)).astype(np.float32),
        "data_source": np.asarray(["arpo"] * n),
        "reward_extra/f1": reward.copy(),
        "finish_reason": np.asarray(["eos"] * n),
        "tool_mask": tool,
        "num_tool_calls": np.asarray([len(r.answer_ends) for r in responses], dtype=np.int32),
        "num_turns": np.asarray([len(r.answer_ends) + 1 for r in responses], dtype=np.int32),
        "branch_parent": np.asarray([r.parent for r in responses], dtype=np.int32),
        "branch_position": np.asarray([r.position for r in responses], dtype=np.int32),
    }


def write_tool_trace(out_dir: str | Path, tokenizer: Any, steps=(1, 2)) -> Path:
    """An entropy trace of a tool run (tool_step_arrays), with the tokenizer saved in it."""
    writer = TraceWriter(out_dir, kind="entropy", metadata={"project_name": "viz-tests", "experiment_name": "tools"},
                         tokenizer=tokenizer)
    for step in steps:
        arrays = tool_step_arrays(tokenizer, step)
        writer.write_step(step, arrays, manifest_stats(arrays))
    return Path(out_dir)


def hostile_texts(port: int) -> list[str]:
    """Text that would load http://127.0.0.1:PORT/... or run a script if a page took it as HTML or Markdown."""
    base = f"http://127.0.0.1:{port}"
    return [f"<img src={base}/img>", f"<script>fetch('{base}/script')</script>", f"![m]({base}/md)",
            f'<iframe src="{base}/frame"></iframe>']


def write_hostile_trace(out_dir: str | Path, port: int, steps=(1, 2)) -> Path:
    """An entropy trace whose text is hostile_texts(port) everywhere a trace holds text: single tokens of its own
    tokenizer (added tokens), the response and prompt of row 0, its uid, data_source and finish_reason, a reward
    extra's key, the summary's project and experiment names."""
    hostile = hostile_texts(port)
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(hostile)
    writer = TraceWriter(out_dir, kind="entropy", metadata={"project_name": hostile[0], "experiment_name": hostile[2]},
                         tokenizer=tokenizer)
    for step in steps:
        arrays = step_arrays(tokenizer, step, response_len=48, prompt_len=48)
        ids = tokenizer.convert_tokens_to_ids(hostile) + tokenizer.encode(" and " + " ".join(hostile),
                                                                          add_special_tokens=False)
        ids = ids[:47]
        arrays["responses"][0] = tokenizer.pad_token_id
        arrays["responses"][0, : len(ids)] = ids
        arrays["response_mask"][0] = np.arange(48) < len(ids)
        arrays["entropies"][0] = np.where(arrays["response_mask"][0], 1.0, 0.0).astype(np.float16)
        arrays["old_log_probs"][0] = np.where(arrays["response_mask"][0], -1.0, 0.0).astype(np.float16)
        arrays["prompts"][0] = tokenizer.pad_token_id
        arrays["prompts"][0, -len(ids[:8]):] = ids[:8]
        arrays["prompt_length"][0] = len(ids[:8])
        for name, text in (("uid", hostile[0]), ("data_source", hostile[1]), ("finish_reason", hostile[2])):
            column = arrays.get(name, np.asarray(["eos"] * len(arrays["uid"])))
            arrays[name] = np.asarray([text, *column[1:].tolist()])
        arrays[f"reward_extra/{hostile[3]}"] = np.ones(len(arrays["uid"]), np.float32)
        writer.write_step(step, arrays, manifest_stats(arrays))
    return Path(out_dir)
