"""``archer tools check``: which of the Python tool's protections this machine gives (SECURITY.md explains each).

Each line is a protection and whether it is active here, with the reason when it is not. The sandbox's own probes
decide (a snippet must start under bubblewrap with the seccomp filter holding; a cgroup must take a limit and a
process), so the answer is what a training run would get with the same interpreter. The memory figures are for
the Python tool's default limits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from archer.tools import memory_cgroup, sandbox, sandbox_launch, sandbox_watch, seccomp_filter

_FAMILIES = {1: "unix", 16: "netlink", 2: "IPv4", 10: "IPv6"}


@dataclass(frozen=True)
class Protection:
    name: str
    active: bool
    detail: str


def socket_buffer_bound_mb(limits: sandbox_launch.SandboxLimits) -> int:
    """The most a call's unix, UDP and netlink socket buffers hold (no cgroup counts unix ones): every socket it
    can have open or in flight (``max_open_files`` per process, and as many in flight) at the kernel's default
    size, which the seccomp filter keeps."""
    sizes = [int(Path(f"/proc/sys/net/core/{name}").read_text()) for name in ("wmem_default", "rmem_default")]
    return ((limits.max_processes + 1) * limits.max_open_files * max(sizes)) >> 20


def protections(python: str) -> list[Protection]:
    """The protections a Python tool running ``python`` gets on this machine."""
    interp = sandbox_launch.describe_interpreter(python)
    level, reason = sandbox.isolation_level(interp)
    isolated = level == sandbox.NAMESPACES
    filtered = seccomp_filter.supported()
    cgroup, no_cgroup = memory_cgroup.find_parent()
    accounted = cgroup is not None
    bwrap = sandbox.bwrap_executable()
    root = os.geteuid() == 0
    off = f"off: {reason}"
    refused = seccomp_filter.refused_calls(accounted=accounted, ipc_namespace=isolated)
    families = ", ".join(_FAMILIES[f] for f in seccomp_filter.socket_families(accounted=accounted))
    limits = sandbox_launch.SandboxLimits()
    return [
        Protection("bubblewrap installed", bwrap is not None, bwrap or f"missing: {sandbox.INSTALL_HINT}"),
        Protection("namespace sandbox (pid, network, IPC, UTS, cgroup, mount)", isolated,
                   "active" if isolated else off),
        Protection("seccomp filter: no nested namespaces, mounts, keyrings, bpf, io_uring, ptrace", filtered,
                   f"{len(refused)} system calls refused, clone/unshare checked for namespace flags" if filtered
                   else f"off: no filter for this architecture ({os.uname().machine})"),
        Protection("socket families limited (no vsock, packet or other families)", filtered,
                   f"{families} only" + ("" if accounted else " (IP refused: no memory cgroup bounds its buffers)")
                   if filtered else "off: no seccomp filter"),
        Protection("minimal read-only mounts (system and interpreter folders; scratch at /scratch)", isolated,
                   f"interpreter folders: {', '.join(interp.roots)}" if isolated else off),
        Protection("no network", isolated, "own loopback only" if isolated else off),
        Protection("/proc hides the host (hostname, boot id, the trainer's pid and paths)", isolated,
                   f"hostname {sandbox_launch.HOSTNAME!r}; the interpreter's folders keep their host paths" if isolated
                   else off),
        Protection("unix sockets inside the interpreter's folders unreachable", False,
                   "not enforced: a read-only mount does not stop connect() (SECURITY.md); keep no live socket "
                   f"in {', '.join(interp.roots)}"),
        Protection("snippet never runs as root", True,
                   "a fresh random uid per call" if root else "archer's own (non-root) user"
                   + ("" if isolated else ", trainer made non-dumpable")),
        Protection("memory cgroup per call (counts shared memory, memfd, tmpfs, pipes, TCP buffers)", accounted,
                   cgroup.describe() if accounted else f"off: {no_cgroup}; instead the seccomp filter refuses "
                   "SysV IPC, memfd_create and IP sockets"),
        Protection("unix, UDP and netlink socket buffers at the kernel's default size (no cgroup counts unix ones)",
                   filtered,
                   f"at most {socket_buffer_bound_mb(limits)} MB per call at the default limits "
                   f"(max_processes={limits.max_processes}, max_open_files={limits.max_open_files})" if filtered
                   else "off: no seccomp filter"),
        Protection("memory and CPU limits over all of a call's processes", True,
                   "archer's watchdog (" + ("/proc children lists" if sandbox_watch.children_files() else "/proc scan")
                   + ("), and the cgroup's kills for memory" if accounted else ")")),
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
