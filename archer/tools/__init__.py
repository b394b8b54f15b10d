"""Tools for agentic RL rollouts: the Tool interface, the sandboxed Python tool, the search tool (cache file,
local BM25 index or HTTP retriever), the registry built from ``actor_rollout_ref.rollout.tools`` and the
concurrent executor with its per-step metrics."""

from archer.tools.base import Tool, ToolResult
from archer.tools.executor import CallOutcome, CallRecord, ToolCall, ToolExecutor, tool_metrics
from archer.tools.registry import ToolRegistry, build_tool

__all__ = ["CallOutcome", "CallRecord", "Tool", "ToolCall", "ToolExecutor", "ToolRegistry", "ToolResult",
           "build_tool", "tool_metrics"]
