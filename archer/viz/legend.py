"""What the explorer's columns and colours mean: one description per column of every table it shows
(``COLUMNS``), one per colour scale of its heatmaps, branch tree and health timeline (``COLOURS``), and the
legend the app puts under its tables (``legend_markdown``). The fields behind the columns are those of
archer/trace/format.py; influence's formula is docs/traces.md's.
"""

from __future__ import annotations

from collections.abc import Iterable

# statistics of the step: entropy over the policy's valid tokens, influence over the tokens it was computed for
_STATS = {f"entropy_{k}": f"the {name} of the token entropies of the step's valid tokens"
          for k, name in (("mean", "mean"), ("std", "standard deviation"), ("p50", "median"),
                          ("p90", "90th percentile"), ("p99", "99th percentile (the entropy heatmap's red)"))}
_STATS.update({f"influence_{k}": f"the {name} of the step's influence scores (signed; over the tokens that have one)"
               for k, name in (("mean", "mean"), ("std", "standard deviation"), ("p50", "median"),
                               ("p90", "90th percentile"), ("p99", "99th percentile"))})

COLUMNS: dict[str, str] = {
    **_STATS,
    "step": "the training step (global step) the trace recorded",
    "num_responses": "responses the step recorded",
    "num_valid_tokens": "tokens the policy wrote and learned from (response_mask), over all responses",
    "reward_mean": "mean reward of the responses counted (the step's, or the prompt group's when comparing steps)",
    "accepted_fraction": "share of the traced responses whose reward equals their group's best (the accepted ones)",
    "num_valid_influence": "tokens with an influence score (the traced responses' valid tokens)",
    "influence_abs_p99": "99th percentile of |influence| over the step: the step colour scale's full red and blue",
    # one row per response
    "row": "the response's row in this step's trace (type it under 'response row' to open it)",
    "response_index": "the response's row in the step's training batch (the numbering of health pointers and of "
                      "the rollout dump trainer.rollout_data_dir/step_N.jsonl)",
    "uid": "the prompt group: every response to one prompt shares it, and GRPO compares them with each other",
    "sample_index": "which of its prompt's responses this is (0 .. n-1)",
    "data_source": "the prompt's data_source: what the reward routed on",
    "learned_tokens": "the policy's own tokens the loss learned from (tool output and rejected tokens not counted)",
    "rejected_tokens": "tokens the rollout correction's rejection took out of the loss (struck through)",
    "tool_tokens": "tokens of tool output in the response: context the policy did not write, never learned from",
    "reward": "the response's score as trained on (the reward function's score after shaping such as the overlong "
              "penalty)",
    "acc": "the reward's accuracy of the response: its acc, or score > 0 when the reward gives none",
    "advantage": "mean advantage over the response's tokens: above 0 pushed up by the update, below 0 pushed down "
                 "(GRPO: reward against its group's mean)",
    "accepted": "the response's reward equals its group's best (influence's accepted side)",
    "group_id": "index of the response's prompt group within the traced responses of the step",
    "num_tool_calls": "tool calls answered in the response",
    "num_turns": "segments the model wrote (a turn ends at a tool call or the end)",
    "branch_parent": "sample_index of the response it branched from (ARPO / AEPO), -1 for a global sample",
    "branch_position": "position of its first token of its own (the tokens before are its parent's), -1 for a "
                       "global sample",
    "finish_reason": "why generation ended: eos, stop (a stop string), length (the response budget) or call_limit",
    "first_policy_version": "policy version of the response's first token: below policy_version when an "
                            "asynchronous partial rollout resumed it under newer weights",
    "policy_version": "policy version that sampled the response (the last one for a resumed partial rollout): the "
                      "step whose update made its weights, 0 the initial model",
    "staleness": "policy versions between the one that sampled the response and the one this step updates (0 in "
                 "the synchronous loop)",
    "entropy_mean": "mean token entropy over the response's valid tokens (nats)",
    "entropy_max": "largest token entropy of the response's valid tokens (nats)",
    "influence_mean": "mean influence over the response's scored tokens (signed: see the influence colours)",
    # one row per token
    "position": "the token's position in the response (0: its first token)",
    "token": "the token's text, whitespace shown as · (space), ↵ (newline) and → (tab)",
    "token_id": "the token's id in the tokenizer's vocabulary",
    "entropy": "entropy of the policy's next-token distribution where the token was sampled (nats, before the "
               "update): 0 when the policy was sure, high where it hesitated",
    "log_prob": "log-probability of the token under the policy before the update",
    "prob": "probability of the token under the policy before the update (exp of log_prob)",
    "influence": "the token's influence on the update: above 0 its gradient points towards the group's accepted "
                 "responses, below 0 towards the rejected ones (no unit; compare within a trace)",
    "valid": "the policy wrote the token and the loss learns from it (response_mask); false on padding and tool "
             "output",
    "rejected": "the rollout correction took the token out of the loss",
    "tool": "the token is tool output (context, not the policy's)",
    "tool_call": "the token is part of a tool call the model wrote",
    # top-K tokens, the prompt group compared across steps, the branch tree
    "rank": "the token's rank by entropy (1: the highest, or the lowest, of the step)",
    "responses": "responses counted (in the health flags: the rows of the batch the flag points at)",
    "rows": "their rows in the step's trace",
    "advantage_mean": "mean of the responses' advantages",
    "accepted_mean": "share of the responses that are accepted",
    "learned_tokens_mean": "mean learned_tokens of the responses",
    "parent": "sample_index of the response it branched from, -1 for a global sample",
    "parent_row": "row of the response it branched from, -1 for a global sample",
    "branch_token_entropy": "entropy of the branch's first token of its own (nats): the distribution parent and "
                            "branch both sampled from at the branch point",
    "depth": "branch points on the response's path (0: a global sample)",
    "branches": "responses that branched off this one",
    "all_tokens": "the response's length with tool output (learned_tokens counts the policy's only)",
    # the health flags and their pointers
    "flag": "the flag's number in this run (select it to open its first pointer)",
    "severity": "info, warning or critical (trainer.health.stop_on stops a run at that severity)",
    "check": "which health check raised the flag (docs/health.md has each rule)",
    "message": "what the check found, with the figures behind it",
    "pointer": "the pointer's number within its flag (select it to open the response)",
    "response": "the response's row in the step's batch (response_index)",
    "prompt group": "the response's uid",
    "tokens": "the positions the flag points at (boxed in green when opened); empty: the whole response",
    "value": "the figure that ranked this response for the flag",
    "why": "what that figure is",
}

COLOURS: dict[str, str] = {
    "entropy heatmap": "each token on white (entropy 0) to red (the step's 99th percentile of entropy, "
                       "entropy_p99, and above), linear in between: red tokens are where the policy hesitated",
    "influence heatmap": "red: the token's gradient points the way of its group's accepted responses (those with "
                         "the best reward) minus the rejected ones, so the update's push towards the accepted "
                         "answers goes through it; blue: it points the other way, as the rejected responses' tokens "
                         "do; white: neither; grey: not scored. Scores have no unit (projected gradients, "
                         "d^T (G^T G + lambda I)^-1 g_t, docs/traces.md): the colour saturates at the 99th "
                         "percentile of |influence| over this response (or over the step, the scale picked above), "
                         "so compare tokens within a response or a step, not across runs",
    "tool marks": "grey italic: tool output (not the policy's, never coloured); purple underline: a tool call the "
                  "model wrote",
    "struck through": "a token the rollout correction took out of the loss",
    "green box": "the tokens a health flag points at",
    "branch tree": "a line per response along its positions; the dot where a branch leaves its parent is coloured by "
                   "the entropy there (as the entropy heatmap); the dot at each end by the reward, from red (the "
                   "group's lowest) through amber to green (its highest)",
    "health timeline": "flags over the run's curves: blue info, orange warning, red critical",
}

REWARD_EXTRA = ("a number the reward function returned under this key (booleans as 0/1; empty where it returned "
                "none)")


def describe(column: str, extras: Iterable[str] = ()) -> str:
    """What ``column`` holds (``extras``: the reward extras' column names of the table)."""
    if column in extras or column.startswith("reward_extra/"):
        return REWARD_EXTRA
    return COLUMNS[column]


def legend_markdown(columns: Iterable[str], extras: Iterable[str] = (), colours: Iterable[str] = ()) -> str:
    """The legend of a view: each of its columns (in order, once) and each of its colour scales."""
    extras = set(extras)
    lines = [f"- **{name}**: {describe(name, extras)}" for name in dict.fromkeys(map(str, columns))]
    lines += [f"- *{name}*: {COLOURS[name]}" for name in colours]
    return "\n".join(lines)


def extra_columns(arrays: dict) -> list[str]:
    """The reward extras' column names of a step's tables (each under its key; a key that clashes with another
    column keeps its field name, which ``describe`` knows by its prefix)."""
    return [name.removeprefix("reward_extra/") for name in arrays if name.startswith("reward_extra/")]


def heatmap_colours(arrays: dict, flagged: bool = False) -> list[str]:
    """The colour scales of a step's heatmaps."""
    return (["entropy heatmap"] + (["influence heatmap"] if "influence" in arrays else [])
            + (["tool marks"] if "tool_mask" in arrays else [])
            + (["struck through"] if "rollout_rs_rejected" in arrays else []) + (["green box"] if flagged else []))
