"""``archer tools check``: which of the Python tool's protections this machine gives (SECURITY.md explains each).

Each line is a protection and whether it is active here, with the reason when it is not. The sandbox's own probe
decides (a snippet must start under bubblewrap with the seccomp filter holding), so the answer is what a training
run would get with the same interpreter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from archer.tools import sandbox, seccomp_filter


@dataclass(frozen=True)
class Protection:
    name: str
    active: bool
    detail: str


def protections(python: str) -> list[Protection]:
    """The protections a Python tool running ``python`` gets on this machine."""
    interp = sandbox.describe_interpreter(python)
    level, reason = sandbox.isolation_level(interp)
    isolated = level == sandbox.NAMESPACES
    bwrap = sandbox.bwrap_executable()
    root = os.geteuid() == 0
    off = f"off: {reason}"
    return [
        Protection("bubblewrap installed", bwrap is not None, bwrap or f"missing: {sandbox.INSTALL_HINT}"),
        Protection("namespace sandbox (pid, network, IPC, UTS, mount)", isolated, "active" if isolated else off),
        Protection("seccomp filter: no nested namespaces, mounts, keyrings, bpf", isolated,
                   f"{len(seccomp_filter.DENIED) + len(seccomp_filter.FLAG_CHECKED) + 1} system calls checked"
                   if isolated else off),
        Protection("minimal read-only mounts (system and interpreter folders; scratch at /scratch)", isolated,
                   f"interpreter folders: {', '.join(interp.roots)}" if isolated else off),
        Protection("no network", isolated, "own loopback only" if isolated else off),
        Protection("snippet never runs as root", True,
                   "a fresh random uid per call" if root else "archer's own (non-root) user"
                   + ("" if isolated else ", trainer made non-dumpable")),
        Protection("memory and CPU limits over all of a call's processes", True,
                   "archer's watchdog (" + ("/proc children lists" if sandbox.children_files() else "/proc scan")
                   + "); cgroup v2 is not used"),
        Protection("memory cap over concurrent calls", True,
                   f"max_total_memory_mb (default {sandbox.default_total_memory_mb()} MB: half of this machine's)"),
        Protection("tool text encoded as plain text, bounded parsing of model output", True, "always"),
    ]


def report(python: str) -> tuple[str, bool]:
    """The printed report, and whether the Python tool can run with its default require_isolation=true."""
    rows = protections(python)
    lines = [f"Python tool protections on this machine (interpreter {python}):"]
    lines += [f"  [{'on' if p.active else 'OFF':>3}] {p.name}: {p.detail}" for p in rows]
    ready = rows[1].active
    lines.append("ready: untrusted model code runs isolated" if ready else
                 "NOT ready: the Python tool refuses to start (require_isolation=false runs it unisolated, unsafe "
                 "for untrusted models: SECURITY.md)")
    return "\n".join(lines), ready
