"""The Python tool: runs the code inside ``<python>...</python>`` in a fresh sandboxed interpreter.

The result is what the code printed (the value of a final bare expression is printed too, as in ARPO), or
the traceback after it when the code failed, or a one-line error when a limit stopped it. See sandbox.py for
what is isolated and how.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

from archer.errors import ArcherError
from archer.tools.base import Tool, ToolResult, call_deadline
from archer.tools.sandbox import Sandbox, SandboxLimits, SandboxRun

_FENCE = re.compile(r"^\s*```[A-Za-z0-9_+-]*[ \t]*\n(.*?)\n?```\s*$", re.DOTALL)


def strip_code_fence(text: str) -> str:
    """The code inside a Markdown fence (```python ... ```) when the whole text is one, else the text."""
    match = _FENCE.match(text)
    return match.group(1) if match else text


def conda_python(name: str, python: str | None, conda_path: str | None, conda_env: str | None) -> str:
    """ARPO's interpreter choice: ``{conda_path}/envs/{conda_env}/bin/python``, which must exist and run."""
    key = f"tool_instances.{name}.params"
    if python is not None:
        raise ArcherError(f"tool {name!r}: both {key}.python and conda_path/conda_env name the interpreter",
                          f"keep one: {key}.python=PATH, or {key}.conda_path + {key}.conda_env")
    if not conda_path or not conda_env:
        raise ArcherError(f"tool {name!r}: {key}.conda_path and {key}.conda_env go together (got {conda_path!r}, "
                          f"{conda_env!r})", "set both (ARPO: the conda install folder and the env name)")
    path = Path(conda_path).expanduser() / "envs" / conda_env / "bin" / "python"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ArcherError(f"tool {name!r}: the Python interpreter {path} (conda_path={conda_path!r}, "
                          f"conda_env={conda_env!r}) does not exist or is not executable",
                          f"set {key}.conda_path to your conda folder (holding envs/{conda_env}/bin/python) and "
                          f"conda_env to an env there, or drop both to run the code with archer's own Python")
    return str(path)


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
    the call's processes together; with a memory cgroup, for everything the call holds), ``max_processes``, ``max_file_mb``, ``max_open_files``, ``scratch_mb`` (each of
    the scratch tmpfs), ``max_output_chars`` (stdout or stderr past four times this ends the call),
    ``require_isolation`` (default true: refuse to start without the namespace sandbox; false is unsafe for
    untrusted models, SECURITY.md), ``max_total_memory_mb`` (what the calls running at once may hold together;
    null: half the machine's memory), ``python`` (the interpreter; null: the one running archer), or ARPO's
    ``conda_path`` + ``conda_env`` (the interpreter ``{conda_path}/envs/{conda_env}/bin/python``)."""

    def __init__(self, name: str = "python", *, trigger_tag: str = "python", python: str | None = None,
                 conda_path: str | None = None, conda_env: str | None = None,
                 timeout: float = 10.0, memory_mb: int = 1024, max_processes: int = 16, max_file_mb: int = 16,
                 max_open_files: int = 64, scratch_mb: int = 64, max_output_chars: int = 4096,
                 require_isolation: bool = True, max_total_memory_mb: int | None = None) -> None:
        super().__init__(name, trigger_tag)
        if conda_path is not None or conda_env is not None:
            python = conda_python(name, python, conda_path, conda_env)
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
        return self.result_of(self.sandbox.run(strip_code_fence(text), call_deadline()))

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
