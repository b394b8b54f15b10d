"""The sandbox's watchdog: what all the processes of a call hold together, read from /proc.

A call's processes are its pid 1 and everything below it (a sandbox's pid 1 adopts its orphans), found through the
kernel's children lists where it has them (``CONFIG_PROC_CHILDREN``), else by scanning the parent pids in /proc.
``watchdog`` makes the check the sandbox runs every 50 ms: anonymous and shared memory and CPU time (reaped
children included) of the call's processes together, and the kills for memory in the call's cgroup.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from archer.tools.memory_cgroup import CallCgroup

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def children_files() -> bool:
    """Whether the kernel lists each task's children (CONFIG_PROC_CHILDREN); else the watchdog scans /proc."""
    return Path(f"/proc/self/task/{os.getpid()}/children").exists()


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for tid in tasks:
        with contextlib.suppress(OSError, ValueError):
            found += map(int, Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
    return found


def _parents() -> dict[int, list[int]]:
    """Every process's children, from the parent pids in /proc/*/stat (without children files)."""
    below: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                below.setdefault(ppid, []).append(int(entry))
    return below


def process_tree(root: int) -> list[int]:
    """``root`` and every live process below it (a sandbox's pid 1 adopts every orphan of the sandbox)."""
    below = None if children_files() else _parents()
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += _children(pid) if below is None else below.get(pid, [])
    return tree


def usage(pids: list[int]) -> tuple[int, float]:
    """(bytes of anonymous and shared memory, CPU seconds including reaped children) of ``pids`` together."""
    memory, ticks = 0, 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(("RssAnon:", "RssShmem:")):
                    memory += int(line.split()[1]) << 10
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return memory, ticks / _CLK_TCK


def watchdog(root: int | None, memory_bytes: int, cpu_s: float, cgroup: CallCgroup | None
             ) -> Callable[[], str | None]:
    """A check of the whole call's limits: the limit it passed (``memory``: a kill for memory in its cgroup, or the
    processes below ``root`` together past ``memory_bytes``; ``cpu``: past ``cpu_s``), or None."""

    def check() -> str | None:
        if cgroup is not None and cgroup.oom_kills():
            return "memory"
        if root is None:
            return None
        memory, cpu = usage(process_tree(root))
        if memory > memory_bytes:
            return "memory"
        return "cpu" if cpu > cpu_s else None

    return check
