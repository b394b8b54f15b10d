"""Running tool calls concurrently, and the per-step tool metrics.

``ToolExecutor.submit`` takes some calls (tool name + the text inside its tag: a turn's calls) and starts them
in a thread pool (``max_workers``) shared by every submission, so the calls of many trajectories run at once;
the ``PendingCalls`` it returns is done when every call answered or ``timeout`` seconds after the submission,
and then gives, in call order, the text for the model and a ``CallRecord`` for the metrics. A tool learns that
deadline from ``call_deadline()`` (the Python tool stops its snippet by then, and a call still waiting for
memory does not start); a call whose tool raised is retried (``retry_count`` more attempts, none after the
deadline). ``wait`` blocks until one (or every) submission is done; ``run`` is submit-and-wait. Nothing raises
for what a call does: a failure becomes ARPO's error text. ``tool_metrics`` turns a step's records into
``tools/<name>/{calls, failures, mean_latency_s}``, ``tools/calls_per_response`` and ``tools/call_limit_reached``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from archer.tools.base import Tool, ToolResult, answering_by

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    tool: str  # the tool's name
    content: str  # the text inside its tag


@dataclass(frozen=True)
class CallRecord:
    tool: str
    ok: bool
    latency_s: float
    attempts: int


@dataclass(frozen=True)
class CallOutcome:
    text: str
    record: CallRecord


def _attempt(tool: Tool, content: str, retry_count: int, deadline: float) -> tuple[ToolResult, int]:
    attempt = 0
    while True:
        attempt += 1
        try:
            with answering_by(deadline):
                result = tool.execute(content)
            if not (isinstance(result, ToolResult) and isinstance(result.text, str)):
                got = type(result.text if isinstance(result, ToolResult) else result).__name__
                return ToolResult(f"Error: Tool({tool.name}) returned {got} instead of text.", ok=False), attempt
            return result, attempt
        except Exception as e:  # a tool's failure is the model's tool result, never the trainer's crash
            logger.debug("tool %s failed (attempt %d): %s", tool.name, attempt, e)
            if attempt > retry_count or time.monotonic() >= deadline:
                return ToolResult(f"Error: Tool({tool.name}) execution failed with message: {e}", ok=False), attempt


def _timed(tool: Tool, content: str, retry_count: int, deadline: float) -> CallOutcome:
    start = time.monotonic()
    result, attempts = _attempt(tool, content, retry_count, deadline)
    text = result.text if result.text.strip() else f"Tool({tool.name}) returned empty output."
    return CallOutcome(text, CallRecord(tool.name, result.ok, time.monotonic() - start, attempts))


class PendingCalls:
    """Calls submitted together, running in the executor's pool until each answered or the deadline passed."""

    def __init__(self, calls: Sequence[ToolCall], immediate: dict[int, CallOutcome], futures: dict[int, Future],
                 timeout: float, start: float) -> None:
        self.calls, self.immediate, self.futures = list(calls), immediate, futures
        self.timeout = timeout
        self.start = start
        self.deadline = self.start + timeout
        self._last = self.start  # when the last call answered
        for future in futures.values():
            future.add_done_callback(self._answered)

    def _answered(self, _: Future) -> None:
        self._last = max(self._last, time.monotonic())

    def done(self) -> bool:
        return all(f.done() for f in self.futures.values()) or time.monotonic() >= self.deadline

    def seconds(self) -> float:
        """How long the calls took: until the last answered, or the deadline if one never did."""
        if all(f.done() for f in self.futures.values()):
            return self._last - self.start
        return self.timeout

    def outcomes(self) -> list[CallOutcome]:
        """The outcomes in call order; a call still running is given up (its answer is an error text)."""
        outcomes = dict(self.immediate)
        for i, future in self.futures.items():
            if future.done():
                outcomes[i] = future.result()
            else:
                future.cancel()  # a call still queued never starts; a running one ends by the deadline it was given
                name = self.calls[i].tool
                outcomes[i] = CallOutcome(f"Error: Tool({name}) did not answer within {self.timeout:g} s.",
                                          CallRecord(name, False, time.monotonic() - self.start, 1))
        return [outcomes[i] for i in range(len(self.calls))]


class ToolExecutor:
    def __init__(self, tools: Mapping[str, Tool], *, max_workers: int = 64, timeout: float = 120.0,
                 retry_count: int = 3) -> None:
        self.tools = dict(tools)
        self.timeout = float(timeout)
        self.retry_count = retry_count
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="archer-tool")

    def submit(self, calls: Sequence[ToolCall]) -> PendingCalls:
        """Start ``calls`` concurrently (a call to an unknown tool is answered at once with an error text)."""
        start = time.monotonic()
        futures: dict[int, Future] = {}
        immediate: dict[int, CallOutcome] = {}
        for i, call in enumerate(calls):
            tool = self.tools.get(call.tool)
            if tool is None:
                known = ", ".join(sorted(self.tools)) or "none"
                immediate[i] = CallOutcome(f"Error: there is no tool named {call.tool!r} (tools: {known}).",
                                           CallRecord(call.tool, False, 0.0, 0))
            else:
                futures[i] = self._pool.submit(_timed, tool, call.content, self.retry_count, start + self.timeout)
        return PendingCalls(calls, immediate, futures, self.timeout, start)

    @staticmethod
    def wait(pending: Collection[PendingCalls], every: bool = False) -> None:
        """Block until one of ``pending`` is done (``every``: all of them); at once when one already is."""
        while pending and not (all if every else any)(p.done() for p in pending):
            running = [f for p in pending if not p.done() for f in p.futures.values() if not f.done()]
            left = min(p.deadline for p in pending if not p.done()) - time.monotonic()
            wait(running, timeout=max(left, 0.0), return_when=FIRST_COMPLETED)

    def run(self, calls: Sequence[ToolCall]) -> list[CallOutcome]:
        """Run every call concurrently; outcomes in the order of ``calls``."""
        pending = self.submit(calls)
        self.wait([pending], every=True)
        return pending.outcomes()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def tool_metrics(records: Iterable[CallRecord], *, tools: Iterable[str] = (),
                 calls_per_response: Sequence[int] | None = None,
                 limit_reached: Sequence[bool] | None = None) -> dict[str, float]:
    """A step's tool metrics. Every name in ``tools`` gets its three keys even without calls (steady curves).

    ``calls_per_response`` (one count per response) gives the mean; ``limit_reached`` (one flag per response:
    it asked for a call beyond ``call_limit``) gives the fraction of responses that did.
    """
    calls: dict[str, int] = dict.fromkeys(tools, 0)
    failures: dict[str, int] = dict.fromkeys(tools, 0)
    latency: dict[str, float] = dict.fromkeys(tools, 0.0)
    for r in records:
        calls[r.tool] = calls.get(r.tool, 0) + 1
        failures[r.tool] = failures.get(r.tool, 0) + (not r.ok)
        latency[r.tool] = latency.get(r.tool, 0.0) + r.latency_s
    metrics: dict[str, float] = {}
    for name in sorted(calls):
        metrics[f"tools/{name}/calls"] = float(calls[name])
        metrics[f"tools/{name}/failures"] = float(failures[name])
        metrics[f"tools/{name}/mean_latency_s"] = latency[name] / calls[name] if calls[name] else 0.0
    if calls_per_response:
        metrics["tools/calls_per_response"] = sum(calls_per_response) / len(calls_per_response)
    if limit_reached:
        metrics["tools/call_limit_reached"] = sum(map(bool, limit_reached)) / len(limit_reached)
    return metrics
