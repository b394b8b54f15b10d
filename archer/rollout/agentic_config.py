"""The agentic keys of ``actor_rollout_ref.rollout``: their checks (before any model loads), and the loop and
branch settings they give.

The loop runs when ``tools.tool_instances`` names a tool, for training and validation alike (verl's
``mode=sync_with_tool``, ARPO's switch for it, is accepted and requires a tool). Its keys:
``multi_turn.{format, max_tool_response_length, tool_response_truncate_side}``, ``tools.call_limit``,
``entropy_window``; ARPO's branching: ``n``, ``initial_rollouts`` (null: n), ``beam_size``,
``branch_probability``, ``entropy_weight``; AEPO's switches: ``enable_dynamic_rollouts`` (with
``dynamic_rollout_beta``) and ``consecutive_branch_penalty``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from archer.errors import ArcherError
from archer.rollout.agentic import AgenticRollout, LoopSettings
from archer.rollout.base import RolloutEngine, SamplingParams
from archer.rollout.branching import BranchSettings
from archer.rollout.call_formats import CALL_FORMATS, HermesCalls, arpo_call_tags, build_call_format
from archer.rollout.tool_text import TRUNCATE_SIDES
from archer.tools import ToolRegistry
from archer.tools.registry import check_tool_specs, trigger_tags

KEY = "actor_rollout_ref.rollout"


def uses_tools(rollout: DictConfig) -> bool:
    return bool(rollout.tools.tool_instances)


def tool_call_tags(rollout: DictConfig) -> tuple[tuple[str, str], ...]:
    """The (opening, closing) tags of the tool calls the model writes under ``rollout`` (multi_turn.format and
    the tools' trigger tags; what the trace explorer highlights), from the config alone; () without tools."""
    if not uses_tools(rollout):
        return ()
    if str(rollout.multi_turn.format) == "hermes":
        return HermesCalls.call_tags
    return arpo_call_tags(trigger_tags(rollout.tools))


def _initial_rollouts(rollout: DictConfig) -> int:
    return int(rollout.n) if rollout.initial_rollouts is None else int(rollout.initial_rollouts)


def _check(ok: bool, problem: str, fix: str) -> None:
    if not ok:
        raise ArcherError(problem, fix)


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


ROLLOUT_MODES = ("sync", "async", "sync_with_tool")  # verl's; archer generates every one synchronously


def check_agentic_config(rollout: DictConfig) -> None:
    """Values of the loop's and the branching keys, branching without a tool to branch at, ARPO's
    ``mode=sync_with_tool`` without a tool, and every tool's class and params (before any data or model loads)."""
    _check(rollout.mode in ROLLOUT_MODES, f"unknown {KEY}.mode {rollout.mode!r}", f"use one of {', '.join(ROLLOUT_MODES)}")
    _check(rollout.mode != "sync_with_tool" or uses_tools(rollout),
           f"{KEY}.mode=sync_with_tool (ARPO: rollouts with tools) but no tool is configured",
           f"configure the tools under {KEY}.tools.tool_instances (docs/agentic.md), or set {KEY}.mode=sync")
    check_tool_specs(rollout.tools)
    n, initial, beam = rollout.n, rollout.initial_rollouts, rollout.beam_size
    _check(initial is None or (_is_int(initial, 1) and initial <= n),
           f"{KEY}.initial_rollouts={initial!r} must be an integer from 1 to rollout.n={n}",
           "set it between 1 and rollout.n, or null for rollout.n (no branching)")
    _check(_is_int(beam, 1), f"{KEY}.beam_size={beam!r} must be an integer of at least 1", "use 1 (no branching) or more")
    p = rollout.branch_probability
    _check(isinstance(p, int | float) and 0 <= p <= 1, f"{KEY}.branch_probability={p!r} is not a probability",
           "set it between 0 and 1")
    _check(_is_int(rollout.entropy_window, 1), f"{KEY}.entropy_window={rollout.entropy_window!r} must be an "
           "integer of at least 1", "set the number of tokens whose entropy the branch rule reads (ARPO: 20)")
    penalty = rollout.consecutive_branch_penalty
    _check(isinstance(penalty, int | float) and penalty >= 0,
           f"{KEY}.consecutive_branch_penalty={penalty!r} must be >= 0", "use 0 (off) or AEPO's 0.05")
    turn = rollout.multi_turn
    _check(turn.format in CALL_FORMATS, f"unknown {KEY}.multi_turn.format {turn.format!r}",
           f"use one of: {', '.join(CALL_FORMATS)}")
    _check(turn.tool_response_truncate_side in TRUNCATE_SIDES,
           f"unknown {KEY}.multi_turn.tool_response_truncate_side {turn.tool_response_truncate_side!r}",
           f"use one of: {', '.join(TRUNCATE_SIDES)}")
    limit = turn.max_tool_response_length
    _check(limit is None or _is_int(limit, 1), f"{KEY}.multi_turn.max_tool_response_length={limit!r} must be an "
           "integer of at least 1", "set a number of characters, or null for no limit")
    _check(_is_int(rollout.tools.call_limit, 0), f"{KEY}.tools.call_limit={rollout.tools.call_limit!r} must be an "
           "integer of at least 0", "set the tool calls allowed per response")
    _check(rollout.tools.call_limit > 0 or not uses_tools(rollout),
           f"{KEY}.tools.call_limit=0 with tools configured ({', '.join(rollout.tools.tool_instances)}): every "
           "response that calls a tool would end at its first call, and no tool would ever run",
           f"set {KEY}.tools.call_limit to the calls allowed per response (ARPO: 3), or drop "
           f"{KEY}.tools.tool_instances to train without tools")
    branching = beam > 1 or _initial_rollouts(rollout) < n or rollout.enable_dynamic_rollouts
    _check(not branching or uses_tools(rollout),
           f"ARPO/AEPO branching is set ({KEY}.initial_rollouts={initial}, beam_size={beam}, n={n}, "
           f"enable_dynamic_rollouts={rollout.enable_dynamic_rollouts}) but no tool is configured, and branches "
           "start only after tool calls", f"configure the tools ({KEY}.tools.tool_instances, docs/agentic.md"
           "), or set initial_rollouts=null, beam_size=1 and enable_dynamic_rollouts=false")


def check_row_tools(row_tools: Iterable[Sequence[str] | None], rollout: DictConfig, where: str) -> None:
    """The data's per-row ``tools`` name only configured tools (checked when the data loads; rows without tools,
    or a run without tools, pass)."""
    if not uses_tools(rollout):
        return
    configured = set(rollout.tools.tool_instances)
    unknown = sorted({name for names in row_tools if names is not None for name in names} - configured)
    _check(not unknown, f"{where}: rows name tool(s) {unknown} in their tools, which {KEY}.tools.tool_instances "
           f"does not configure (its tools: {sorted(configured)})",
           f"configure those tools under {KEY}.tools.tool_instances.<name>, or name only configured tools in the "
           "rows' tools (leave a row's tools out for every tool)")


def loop_settings(rollout: DictConfig) -> LoopSettings:
    turn = rollout.multi_turn
    limit = turn.max_tool_response_length
    return LoopSettings(response_length=int(rollout.response_length), call_limit=int(rollout.tools.call_limit),
                        max_tool_response_length=None if limit is None else int(limit),
                        tool_response_truncate_side=str(turn.tool_response_truncate_side),
                        entropy_window=int(rollout.entropy_window))


def branch_settings(rollout: DictConfig, params: SamplingParams, *, validate: bool) -> BranchSettings | None:
    """The branching of a training rollout; validation and greedy decoding never branch (as ARPO)."""
    if validate or params.greedy:
        return None
    return BranchSettings(
        n=int(rollout.n), initial_rollouts=_initial_rollouts(rollout), beam_size=int(rollout.beam_size),
        branch_probability=float(rollout.branch_probability), entropy_weight=float(rollout.entropy_weight),
        dynamic_rollouts=bool(rollout.enable_dynamic_rollouts),
        dynamic_rollout_beta=float(rollout.dynamic_rollout_beta),
        consecutive_branch_penalty=float(rollout.consecutive_branch_penalty))


def build_agentic_rollout(engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, rollout: DictConfig, *,
                          chat_template: str | None = None, template_kwargs: Mapping[str, Any] | None = None
                          ) -> AgenticRollout:
    """The loop over ``engine`` with the tools of ``rollout.tools`` (call ``uses_tools`` first)."""
    check_agentic_config(rollout)
    registry = ToolRegistry.from_config(rollout.tools)
    call_format = build_call_format(str(rollout.multi_turn.format), registry, tokenizer,
                                    chat_template=chat_template, template_kwargs=template_kwargs)
    return AgenticRollout(engine, tokenizer, registry, call_format, loop_settings(rollout))
