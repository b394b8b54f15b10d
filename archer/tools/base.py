"""The tool interface that a multi-turn rollout loop calls.

A tool has a ``name`` (its key under ``tools.tool_instances``, and in its metrics), the ``trigger_tag`` the
model writes around a call (``<python>...</python>``; generation stops at ``</python>``), and
``execute(text) -> ToolResult`` for the text inside the tag. A result that is an error for the model (a
traceback, a query the cache lacks) is returned with ``ok=False``; an exception means a failure worth
retrying (a retriever that did not answer), which the executor retries and, at the end, turns into text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolResult:
    text: str
    ok: bool = True


class Tool(ABC):
    def __init__(self, name: str, trigger_tag: str) -> None:
        self.name = name
        self.trigger_tag = trigger_tag

    @abstractmethod
    def execute(self, text: str) -> ToolResult:
        """Answer one call; thread-safe (the executor runs a round's calls concurrently)."""

    def close(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Release what the tool holds (files, connections); the default holds nothing."""
