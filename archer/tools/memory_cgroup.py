"""Memory cgroups for the Python tool's calls: the kernel's own count of everything a call holds in memory.

A process's RSS misses memory a snippet can hold without mapping it: SysV shared memory, memfd files, tmpfs pages
(``/scratch``, ``/dev/shm``), pipe and TCP buffers, kernel objects. A cgroup's memory controller counts all of
it, so where archer may create cgroups each call runs in a cgroup of its own whose hard limit is the call's
``memory_mb``: past it the kernel reclaims what it can, then kills a process of the call (an OOM kill), and the
sandbox stops the call for memory. The call's first process enters its cgroup before it starts bubblewrap or the
launcher (``CallCgroup.enter``), so every process of the call is inside.

Where the calls' cgroups live (``find_parent``, once per process; each call's is ``archer-<pid>-<n>`` below it,
removed after the call; a trainer killed mid-call leaves an empty one behind):

- ``$ARCHER_SANDBOX_CGROUP`` when set: a cgroup folder archer may create cgroups in (delegated to its user, with
  the memory controller enabled for its children on cgroup v2);
- else, on a cgroup v1 memory hierarchy, archer's own memory cgroup (v1 lets a cgroup with processes have
  children); on cgroup v2, archer's own cgroup or the hierarchy's root, the first that has the memory controller
  for its children or can be given it (v2 gives it only to a cgroup without processes, or to the root).

Writing there needs root or a delegated cgroup. cgroup v1 counts TCP buffers apart from the rest: they get a limit
of ``memory_mb`` of their own (``memory.kmem.tcp.limit_in_bytes``). Neither version counts unix socket buffers
(seccomp_filter.py keeps them at the kernel's default size). Without a cgroup, seccomp_filter.py refuses what would
hold memory outside every limit instead.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "ARCHER_SANDBOX_CGROUP"
_PREFIX = "archer-"
_COUNTER = itertools.count()
_REMOVE_S = 2.0  # how long removing a call's cgroup waits for its processes to be gone
# the first process of a call: joins the cgroup whose cgroup.procs is $0, then becomes the call's program
_ENTER = 'echo $$ > "$0" && exec "$@"'


@dataclass(frozen=True)
class CgroupParent:
    """A cgroup folder where archer makes one cgroup per call; ``version`` 1 or 2."""

    path: Path
    version: int

    def describe(self) -> str:
        sockets = ("TCP buffers counted with the rest" if self.version == 2 else
                   "TCP buffers under a limit of memory_mb of their own (cgroup v1 counts them apart)")
        return f"cgroup v{self.version} below {self.path}: each call's memory limited to memory_mb, {sockets}"


class CallCgroup:
    """One call's cgroup: made with its limits, entered by the call's first process, removed after the call."""

    def __init__(self, parent: CgroupParent, memory_mb: int) -> None:
        self.version = parent.version
        self.path = parent.path / f"{_PREFIX}{os.getpid()}-{next(_COUNTER)}"
        self.path.mkdir()
        try:
            if not (self.path / "cgroup.procs").exists():  # the kernel makes a cgroup's files with it
                raise NotADirectoryError(errno.ENOTDIR, f"{parent.path} is not a cgroup folder")
            _set_limits(self.path, self.version, memory_mb << 20)
        except OSError:
            self.remove()
            raise

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` started inside this cgroup (through ``/bin/sh``, which joins it and then execs ``argv``)."""
        return ["/bin/sh", "-c", _ENTER, str(self.path / "cgroup.procs"), *argv]

    def oom_kills(self) -> int:
        """How many processes of the call the kernel killed for the memory limit."""
        events = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            found = re.search(r"^oom_kill (\d+)$", (self.path / events).read_text(), re.MULTILINE)
            return int(found[1]) if found else 0
        return 0

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (daemons that left the call's session or namespace included)."""
        if self.version == 2 and (self.path / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.path / "cgroup.kill").write_text("1")
                return
        for pid in _pids(self.path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def remove(self) -> None:
        """Kill what is left and remove the cgroup (its processes take a moment to leave it)."""
        deadline = time.monotonic() + _REMOVE_S
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    logger.warning("could not remove the Python tool call's cgroup %s: %s", self.path, e)
                    return
            self.kill()
            time.sleep(0.01)


def _set_limits(path: Path, version: int, limit: int) -> None:
    if version == 2:
        _write(path / "memory.max", limit)
        _write(path / "memory.swap.max", 0, optional=True)
        _write(path / "memory.oom.group", 1, optional=True)  # an OOM kill takes the whole call
    else:
        _write(path / "memory.limit_in_bytes", limit)
        _write(path / "memory.memsw.limit_in_bytes", limit, optional=True)  # memory + swap (after the first)
        _write(path / "memory.kmem.tcp.limit_in_bytes", limit, optional=True)


def _write(path: Path, value: int, *, optional: bool = False) -> None:
    if optional and not path.exists():
        return
    path.write_text(str(value))


def _pids(path: Path) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    return []


def _unescape(field: str) -> str:
    """A /proc/self/mountinfo path field (spaces and the like written as octal escapes)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _mounts(mountinfo: str) -> Iterator[tuple[str, Path, str, set[str]]]:
    """(root inside the hierarchy, mount point, file system type, super options) of each mount of a
    /proc/self/mountinfo text."""
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3:
            yield _unescape(fields[3]), Path(_unescape(fields[4])), tail[0], set(tail[2].split(","))


def _own_cgroups(cgroups: str) -> dict[str, str]:
    """A process's cgroup path per v1 controller, and under "" its cgroup v2 path, from its /proc/<pid>/cgroup."""
    own = {}
    for line in cgroups.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            own[controller] = path
    return own


def _folder(mount_root: str, mount_point: Path, path: str) -> Path | None:
    """The folder of cgroup ``path`` under a mount of the hierarchy from ``mount_root``; None if outside it."""
    if not Path(path).is_relative_to(mount_root):
        return None
    return mount_point / Path(path).relative_to(mount_root)


def candidates(mountinfo: str, cgroups: str) -> list[CgroupParent]:
    """Where a process with these /proc files (mountinfo, cgroup) might make cgroups, best first."""
    own = _own_cgroups(cgroups)
    found = []
    for root, point, fstype, options in _mounts(mountinfo):
        if fstype == "cgroup" and "memory" in options and "memory" in own:
            folder = _folder(root, point, own["memory"])
            found += [CgroupParent(folder, 1)] if folder else []
        elif fstype == "cgroup2" and "" in own:
            folder = _folder(root, point, own[""])
            found += [CgroupParent(f, 2) for f in dict.fromkeys((folder, point)) if f is not None]
    return found


def _usable(parent: CgroupParent) -> str:
    """Why the calls cannot have cgroups below ``parent`` ("" when they can): the memory controller must be there
    for its children, and a cgroup made there must take a limit and a process."""
    if parent.version == 2:
        controllers = (parent.path / "cgroup.controllers").read_text().split()
        if "memory" not in controllers:
            return f"{parent.path} has no memory controller"
        if "memory" not in (parent.path / "cgroup.subtree_control").read_text().split():
            try:
                (parent.path / "cgroup.subtree_control").write_text("+memory")
            except OSError as e:
                return (f"the memory controller cannot be enabled for the children of {parent.path} "
                        f"({os.strerror(e.errno)}: a cgroup with processes of its own cannot give it)")
    call = CallCgroup(parent, 64)
    try:
        entered = subprocess.run(call.enter(["/bin/true"]), capture_output=True, text=True, timeout=30)
        if entered.returncode != 0:
            return f"a process cannot join a cgroup below {parent.path}: {entered.stderr.strip()}"
    finally:
        call.remove()
    return ""


@functools.cache
def find_parent() -> tuple[CgroupParent | None, str]:
    """(where this process makes its calls' cgroups, "") or (None, why there is no such place)."""
    named = os.environ.get(ENV)
    try:
        if named:
            path = Path(named)
            version = 2 if (path / "cgroup.controllers").exists() else 1
            places = [CgroupParent(path, version)]
        else:
            places = candidates(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text())
    except OSError as e:
        return None, f"cannot read this process's cgroups ({e})"
    if not places:
        return None, "no cgroup hierarchy with a memory controller is mounted"
    reasons = []
    for parent in places:
        try:
            reason = _usable(parent)
        except (OSError, subprocess.SubprocessError) as e:
            reason = f"cannot make a cgroup below {parent.path} ({e.strerror if isinstance(e, OSError) else e})"
        if not reason:
            return parent, ""
        reasons.append(reason)
    hint = f"run archer as root, or set {ENV} to a cgroup delegated to archer's user"
    return None, "; ".join(reasons) + f" ({hint})"
