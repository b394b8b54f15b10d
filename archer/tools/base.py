"""The tool interface that a multi-turn rollout loop calls.

A tool has a ``name`` (its key under ``tools.tool_instances``, and in its metrics), the ``trigger_tag`` the
model writes around a call (``<python>...</python>``; generation stops at ``</python>``), and
``execute(text) -> ToolResult`` for the text inside the tag. A result that is an error for the model (a
traceback, a query the cache lacks) is returned with ``ok=False``; an exception means a failure worth
retrying (a retriever that did not answer), which the executor retries and, at the end, turns into text.
``call_deadline()`` tells a tool when the executor stops waiting for the call it answers.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

_CALL_DEADLINE: ContextVar[float | None] = ContextVar("archer_tool_call_deadline", default=None)


def call_deadline() -> float | None:
    """When the executor gives up on the call being answered (``time.monotonic()``), None outside the executor. A
    tool that can stop early (the Python sandbox) stops by then, so that a call the executor abandoned holds no
    worker or memory that later calls need."""
    return _CALL_DEADLINE.get()


@contextlib.contextmanager
def answering_by(deadline: float) -> Iterator[None]:
    """Run a call with ``call_deadline()`` set (the executor's threads answer one call at a time)."""
    token = _CALL_DEADLINE.set(deadline)
    try:
        yield
    finally:
        _CALL_DEADLINE.reset(token)


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
