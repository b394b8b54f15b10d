"""The tool executor (concurrency, retries, timeout, error texts), the step metrics, and the registry."""

from __future__ import annotations

import threading
import time

import pytest

from archer.config.loader import load_config
from archer.errors import ArcherError
from archer.tools import (
    CallRecord,
    Tool,
    ToolCall,
    ToolExecutor,
    ToolRegistry,
    ToolResult,
    build_tool,
    tool_metrics,
)
from archer.tools.python_tool import PythonTool
from archer.tools.search import SearchTool

pytestmark = pytest.mark.serial  # asserts wall-clock bounds: `make test` runs it alone


class Sleepy(Tool):
    def __init__(self, name: str = "sleepy", *, trigger_tag: str = "sleep", seconds: float = 0.3) -> None:
        super().__init__(name, trigger_tag)
        self.seconds = seconds
        self.running = 0
        self.peak = 0
        self._lock = threading.Lock()

    def execute(self, text: str) -> ToolResult:
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(self.seconds)
        with self._lock:
            self.running -= 1
        return ToolResult(text.upper(), ok=text != "bad")


class Flaky(Tool):
    """Raises ``failures`` times, then answers."""

    def __init__(self, failures: int) -> None:
        super().__init__("flaky", "flaky")
        self.failures = failures
        self.calls = 0

    def execute(self, text: str) -> ToolResult:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError(f"retriever down ({self.calls})")
        return ToolResult("answer")


def test_calls_of_a_round_run_concurrently_and_come_back_in_order() -> None:
    tool = Sleepy()
    executor = ToolExecutor({"sleepy": tool}, max_workers=4)
    start = time.monotonic()
    outcomes = executor.run([ToolCall("sleepy", t) for t in ("a", "b", "bad", "d")])
    elapsed = time.monotonic() - start
    executor.close()
    assert [o.text for o in outcomes] == ["A", "B", "BAD", "D"]
    assert [o.record.ok for o in outcomes] == [True, True, False, True]
    assert tool.peak == 4 and elapsed < 0.3 * 2
    assert all(0.3 <= o.record.latency_s < 0.6 and o.record.attempts == 1 for o in outcomes)


def test_submissions_run_side_by_side_and_wait_returns_with_the_first_done() -> None:
    """The agentic loop's use: each trajectory submits its calls when its turn ends; ``wait`` returns as soon as
    one submission is done (the loop then resumes that trajectory), each with its own deadline."""
    executor = ToolExecutor({"slow": Sleepy("slow", seconds=0.4), "quick": Sleepy("quick", seconds=0.05)},
                            timeout=0.25)
    start = time.monotonic()
    slow = executor.submit([ToolCall("slow", "a")])
    quick = executor.submit([ToolCall("quick", "b"), ToolCall("none", "c")])
    executor.wait([slow, quick])
    assert quick.done() and not slow.done() and time.monotonic() - start < 0.2
    assert [o.text for o in quick.outcomes()] == ["B", "Error: there is no tool named 'none' (tools: quick, slow)."]
    executor.wait([slow], every=True)  # its own deadline: 0.25 s after its submission
    assert 0.2 < time.monotonic() - start < 0.38
    assert slow.outcomes()[0].text == "Error: Tool(slow) did not answer within 0.25 s."
    executor.wait([executor.submit([])])  # nothing to run: done at once
    executor.close()


def test_max_workers_bounds_concurrency() -> None:
    tool = Sleepy(seconds=0.05)
    executor = ToolExecutor({"sleepy": tool}, max_workers=2)
    executor.run([ToolCall("sleepy", str(i)) for i in range(6)])
    executor.close()
    assert tool.peak == 2


def test_a_raising_tool_is_retried_then_answers() -> None:
    tool = Flaky(failures=2)
    executor = ToolExecutor({"flaky": tool}, retry_count=3)
    [outcome] = executor.run([ToolCall("flaky", "q")])
    executor.close()
    assert outcome.text == "answer" and outcome.record.ok and outcome.record.attempts == 3


def test_retries_exhausted_give_arpos_error_text() -> None:
    tool = Flaky(failures=5)
    executor = ToolExecutor({"flaky": tool}, retry_count=1)
    [outcome] = executor.run([ToolCall("flaky", "q")])
    executor.close()
    assert outcome.text == "Error: Tool(flaky) execution failed with message: retriever down (2)"
    assert not outcome.record.ok and outcome.record.attempts == 2 and tool.calls == 2


def test_a_call_past_the_round_timeout_is_answered_with_an_error() -> None:
    executor = ToolExecutor({"sleepy": Sleepy(seconds=1.0), "quick": Sleepy("quick", seconds=0.0)}, timeout=0.2)
    start = time.monotonic()
    slow, quick = executor.run([ToolCall("sleepy", "x"), ToolCall("quick", "y")])
    assert time.monotonic() - start < 0.6
    executor.close()
    assert slow.text == "Error: Tool(sleepy) did not answer within 0.2 s." and not slow.record.ok
    assert quick.text == "Y" and quick.record.ok


def test_empty_output_and_unknown_tools_get_readable_texts() -> None:
    executor = ToolExecutor({"sleepy": Sleepy(seconds=0.0)})
    empty, unknown = executor.run([ToolCall("sleepy", "  "), ToolCall("calc", "1+1")])
    executor.close()
    assert empty.text == "Tool(sleepy) returned empty output." and empty.record.ok
    assert unknown.text == "Error: there is no tool named 'calc' (tools: sleepy)." and not unknown.record.ok


class Careless(Tool):
    """A user's tool that answers a number where text is due, or no ToolResult at all."""

    def __init__(self) -> None:
        super().__init__("careless", "careless")

    def execute(self, text: str) -> ToolResult:
        return ToolResult(42) if text == "number" else None  # type: ignore[arg-type, return-value]


def test_a_tool_that_answers_no_text_is_an_error_result_not_a_crash() -> None:
    executor = ToolExecutor({"careless": Careless()})
    number, nothing = executor.run([ToolCall("careless", "number"), ToolCall("careless", "none")])
    executor.close()
    assert number.text == "Error: Tool(careless) returned int instead of text." and not number.record.ok
    assert nothing.text == "Error: Tool(careless) returned NoneType instead of text." and not nothing.record.ok


def test_tool_metrics_by_hand() -> None:
    records = [CallRecord("python", True, 0.5, 1), CallRecord("python", False, 1.5, 1),
               CallRecord("python", True, 1.0, 1), CallRecord("search", False, 0.2, 4)]
    metrics = tool_metrics(records, tools=["python", "search", "calc"], calls_per_response=[3, 1, 0, 0],
                           limit_reached=[True, False, False, False])
    assert metrics == {
        "tools/calc/calls": 0.0, "tools/calc/failures": 0.0, "tools/calc/mean_latency_s": 0.0,
        "tools/python/calls": 3.0, "tools/python/failures": 1.0, "tools/python/mean_latency_s": 1.0,
        "tools/search/calls": 1.0, "tools/search/failures": 1.0, "tools/search/mean_latency_s": 0.2,
        "tools/calls_per_response": 1.0, "tools/call_limit_reached": 0.25,
    }


# --- registry ---

BASE = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]
TOOLS = "actor_rollout_ref.rollout.tools"


def test_registry_from_config_with_arpos_keys(tmp_path) -> None:
    cache = tmp_path / "cache.json"
    cache.write_text('{"capital of France": "Page 1: Paris."}')
    cfg = load_config("ppo_trainer", BASE + [
        f"{TOOLS}.call_limit=5", f"{TOOLS}.max_workers=4", f"{TOOLS}.timeout=30", f"{TOOLS}.retry_count=1",
        f"+{TOOLS}.tool_instances.python.class_path=python",
        f"+{TOOLS}.tool_instances.python.params.timeout=3",
        f"+{TOOLS}.tool_instances.web.class_path=archer.tools.search.SearchTool",
        f"+{TOOLS}.tool_instances.web.params.cache_file={cache}",
    ])
    registry = ToolRegistry.from_config(cfg.actor_rollout_ref.rollout.tools)
    try:
        assert set(registry.tools) == {"python", "web"}
        assert isinstance(registry.tools["python"], PythonTool) and registry.tools["python"].limits.timeout_s == 3
        assert isinstance(registry.tools["web"], SearchTool)
        assert registry.call_limit == 5 and registry.executor.timeout == 30 and registry.executor.retry_count == 1
        assert registry.stop_strings == ["</python>", "</search>"]
        call = registry.find_call("<think>look it up</think> <search> capital of France </search>")
        assert call == ToolCall("web", " capital of France ")
        [outcome] = registry.executor.run([call])
        assert outcome.text == "Page 1: Paris."
    finally:
        registry.close()


def test_the_default_config_has_no_tools() -> None:
    registry = ToolRegistry.from_config(load_config("ppo_trainer", BASE).actor_rollout_ref.rollout.tools)
    assert registry.tools == {} and registry.stop_strings == [] and registry.find_call("<python>1</python>") is None
    assert registry.call_limit == 3 and registry.executor.retry_count == 3
    registry.close()


@pytest.mark.parametrize(("text", "expected"), [
    ("<python>print(1)</python>", "print(1)"),
    ("<python>a</python> then <python>b</python>\n", "b"),  # the last call, trailing whitespace allowed
    ("<python>x <python>inner</python>", "inner"),  # the innermost opening tag
    ("<python>a</python> and some answer", None),  # the text does not end at a call
    ("print(1)</python>", None),  # no opening tag
    ("<search>q</search>", None),  # not a registered tag
])
def test_find_call(text: str, expected: str | None) -> None:
    registry = ToolRegistry([Sleepy("python", trigger_tag="python")])
    call = registry.find_call(text)
    registry.close()
    assert (call.content if call else None) == expected
    assert call is None or call.tool == "python"


def test_bad_tool_config_is_a_clear_error() -> None:
    with pytest.raises(ArcherError, match="tool 'calc': cannot import 'nowhere.Calc'"):
        build_tool("calc", "nowhere.Calc", {})
    with pytest.raises(ArcherError, match="is not a Tool class"):
        build_tool("calc", "archer.errors.ArcherError", {})
    with pytest.raises(ArcherError, match="bad params for PythonTool") as err:
        build_tool("python", "python", {"timout": 3})
    assert "timeout" in str(err.value) and "memory_mb" in str(err.value)
    with pytest.raises(ArcherError, match="has no class_path"):
        ToolRegistry.from_config({"tool_instances": {"python": {"params": {}}}})
    with pytest.raises(ArcherError, match="share a trigger tag"):
        ToolRegistry([Sleepy("a", trigger_tag="t"), Sleepy("b", trigger_tag="t")])
