"""The Python tool: runs the code inside ``<python>...</python>`` in a fresh sandboxed interpreter.

The result is what the code printed (the value of a final bare expression is printed too, as in ARPO), or
the traceback after it when the code failed, or a one-line error when a limit stopped it. See sandbox.py for
what is isolated and how.
"""

from __future__ import annotations

import re
import signal
import sys

from archer.errors import ArcherError
from archer.tools.base import Tool, ToolResult
from archer.tools.sandbox import Sandbox, SandboxLimits, SandboxRun

_FENCE = re.compile(r"^\s*```[A-Za-z0-9_+-]*[ \t]*\n(.*?)\n?```\s*$", re.DOTALL)


def strip_code_fence(text: str) -> str:
    """The code inside a Markdown fence (```python ... ```) when the whole text is one, else the text."""
    match = _FENCE.match(text)
    return match.group(1) if match else text


def _describe_signal(returncode: int) -> str:
    sig = -returncode
    if sig == signal.SIGXCPU:
        return "Error: the code used up its CPU time limit and was stopped."
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    return f"Error: the code was stopped by {name}."


class PythonTool(Tool):
    """Params (``tool_instances.python.params``): ``timeout`` (wall-clock seconds per call; the CPU-time limit, per
    process and for all the call's processes together, is one second more), ``memory_mb`` (per process, and for all
    the call's processes together), ``max_processes``, ``max_file_mb``, ``max_open_files``, ``scratch_mb`` (each of
    the scratch tmpfs), ``max_output_chars`` (stdout or stderr past four times this ends the call),
    ``require_isolation`` (default true: refuse to start without the namespace sandbox; false is unsafe for
    untrusted models, SECURITY.md), ``max_total_memory_mb`` (what the calls running at once may hold together;
    null: half the machine's memory), ``python`` (the interpreter; null: the one running archer)."""

    def __init__(self, name: str = "python", *, trigger_tag: str = "python", python: str | None = None,
                 timeout: float = 10.0, memory_mb: int = 1024, max_processes: int = 16, max_file_mb: int = 16,
                 max_open_files: int = 64, scratch_mb: int = 64, max_output_chars: int = 4096,
                 require_isolation: bool = True, max_total_memory_mb: int | None = None) -> None:
        super().__init__(name, trigger_tag)
        sizes = {"timeout": timeout, "memory_mb": memory_mb, "max_processes": max_processes,
                 "max_file_mb": max_file_mb, "max_open_files": max_open_files, "scratch_mb": scratch_mb,
                 "max_output_chars": max_output_chars}
        if max_total_memory_mb is not None:
            sizes["max_total_memory_mb"] = max_total_memory_mb
        for key, value in sizes.items():
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ArcherError(f"tool {name!r}: params.{key} must be a positive number, got {value!r}",
                                  f"set tool_instances.{name}.params.{key} to a number above 0")
        self.limits = SandboxLimits(timeout_s=float(timeout), memory_mb=memory_mb, max_processes=max_processes,
                                    max_file_mb=max_file_mb, max_open_files=max_open_files,
                                    scratch_mb=scratch_mb, max_output_chars=max_output_chars)
        self.sandbox = Sandbox(python or sys.executable, self.limits, require_isolation=require_isolation,
                               max_total_memory_mb=max_total_memory_mb)

    @property
    def isolation(self) -> str:
        return self.sandbox.level

    def execute(self, text: str) -> ToolResult:
        return self.result_of(self.sandbox.run(strip_code_fence(text)))

    def result_of(self, run: SandboxRun) -> ToolResult:
        """The text the model sees, and whether the code ran to a normal end with its whole output."""
        out = run.stdout
        if run.stopped_for == "memory":
            return ToolResult(f"{out}Error: the code's processes together used more than {self.limits.memory_mb} MB "
                              "of memory and were stopped.", ok=False)
        if run.stopped_for == "cpu":
            return ToolResult(f"{out}Error: the code's processes together used more than {self.limits.cpu_s} s of "
                              "CPU time and were stopped.", ok=False)
        if run.stopped_for == "stderr":
            return ToolResult(f"{out}{run.stderr}\n[error output truncated: more than "
                              f"{4 * self.limits.max_output_chars} characters; the code was stopped]", ok=False)
        if run.timed_out:
            return ToolResult(f"{out}Error: the code did not finish within {self.limits.timeout_s:g} s and was "
                              "stopped.", ok=False)
        if run.output_truncated and run.returncode in (0, None):
            return ToolResult(f"{out}\n[output truncated: more than {self.limits.max_output_chars} characters]",
                              ok=False)
        if run.returncode == 0:
            return ToolResult(out)
        if run.returncode is not None and run.returncode < 0:
            return ToolResult(f"{out}{run.stderr}{_describe_signal(run.returncode)}", ok=False)
        return ToolResult(f"{out}{run.stderr}".rstrip("\n"), ok=False)
