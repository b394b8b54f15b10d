"""Python tool calls per second with and without a memory cgroup per call (archer/tools/memory_cgroup.py).

    python bench/sandbox_calls.py [--calls 128] [--workers 16] [--rounds 3]

Runs ``--calls`` calls of ``print(6 * 7)`` through the tool executor, ``--workers`` at once, in each mode, the modes
alternating for ``--rounds`` rounds (the median round counts), and prints a Markdown table. "no cgroup" is what a
machine without a writable cgroup gets (the seccomp filter refuses memfd, SysV IPC and IP sockets instead). Needs
the namespace sandbox and, for the cgroup mode, a machine where archer may create cgroups (root).
"""

from __future__ import annotations

import argparse
import statistics
import time

from archer.tools import ToolCall, ToolExecutor, memory_cgroup
from archer.tools.python_tool import PythonTool

MODES = ("cgroup", "no cgroup")


def round_seconds(mode: str, calls: int, workers: int) -> float:
    found = memory_cgroup.find_parent
    if mode == "no cgroup":
        memory_cgroup.find_parent = lambda: (None, "bench: no cgroup")
    try:
        tool = PythonTool()
    finally:
        memory_cgroup.find_parent = found
    executor = ToolExecutor({"python": tool}, max_workers=workers)
    try:
        executor.run([ToolCall("python", "pass")])  # warm
        start = time.perf_counter()
        outcomes = executor.run([ToolCall("python", "print(6 * 7)")] * calls)
        seconds = time.perf_counter() - start
    finally:
        executor.close()
    failed = [o.text for o in outcomes if o.text != "42\n"]
    if failed:
        raise SystemExit(f"a call failed in mode {mode!r}: {failed[0]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=128)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    parent, reason = memory_cgroup.find_parent()
    if parent is None:
        raise SystemExit(f"no memory cgroup on this machine ({reason}): nothing to compare")
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            seconds[mode].append(round_seconds(mode, args.calls, args.workers))
    print(f"{args.calls} calls, {args.workers} at once, median of {args.rounds} rounds ({parent.describe()})\n")
    print("| mode | seconds | calls/s |\n|---|---|---|")
    for mode in MODES:
        median = statistics.median(seconds[mode])
        print(f"| {mode} | {median:.2f} | {args.calls / median:.1f} |")


if __name__ == "__main__":
    main()
