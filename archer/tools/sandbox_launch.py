"""How a call of the Python sandbox starts: its limits, its interpreter, and the command, environment and stdin that
start it at either isolation level (sandbox.py runs it).

- ``namespaces``: bubblewrap, whose settings (namespaces, hostname, mounts, ``/proc`` without the boot id, the
  scratch tmpfs) come through ``--args FD`` and whose seccomp filter comes through ``--seccomp FD`` (memfds: writing
  them never blocks), so that the sandbox's pid 1 shows none of them; bubblewrap reports its pid 1 on
  ``--info-fd``.
- ``rlimits``: a small launcher in a new session, in a scratch folder of the host's temporary folder.

At both levels the interpreter runs ``sandbox_prelude.py``, whose stdin starts with one line of configuration
(sys.path, limits, uid, the seccomp filter it loads itself at the rlimits level), then the snippet.
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import selectors
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from archer.errors import ArcherError

SCRATCH = "/scratch"  # the scratch directory's path inside a namespace sandbox: its own, never where a venv lives
HOSTNAME = "sandbox"
PRELUDE = (Path(__file__).with_name("sandbox_prelude.py")).read_text()
# the last argument of this process's snippets' interpreters: tells them apart in ps without the trainer's pid
CALL_MARK = f"archer-snippet-{secrets.token_hex(6)}"
# system folders the interpreter and its libraries may need, read-only (a symlink is recreated as the symlink)
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/nix/store", "/gnu/store",
                "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime")


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
class Interpreter:
    executable: str
    path: tuple[str, ...]  # its sys.path entries that the sandbox shows, which the prelude restores
    roots: tuple[str, ...]  # the folders it reads (its prefixes), none inside another


def _mounted(path: str, roots: tuple[str, ...]) -> bool:
    """Whether ``path`` and the file it leads to both lie inside the sandbox's mounts (the system folders, whose
    symlinks are recreated, and the interpreter's roots)."""
    inside = [*SYSTEM_PATHS, *roots]
    resolved = [os.path.realpath(p) for p in inside]
    return (any(Path(path).is_relative_to(p) for p in inside)
            and any(Path(os.path.realpath(path)).is_relative_to(p) for p in resolved))


@functools.cache
def describe_interpreter(python: str) -> Interpreter:
    """Ask ``python`` for its real executable, sys.path and prefixes (once per process).

    Only the prefixes are mounted: a sys.path entry outside them (an editable checkout, a project folder) is not,
    and is not passed on. An executable that is a link leading out of its prefix (a conda env's ``bin/python``) is
    run by its target when that lies inside, else that is the error.
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
    exe = next((e for e in (info["exe"], os.path.realpath(info["exe"])) if _mounted(e, roots)), None)
    if exe is None:
        raise ArcherError(f"the Python tool's interpreter {info['exe']} leads to {os.path.realpath(info['exe'])}, "
                          f"outside the folders the sandbox mounts (its prefixes {', '.join(roots)} and the "
                          "system folders)", "set tool_instances.<name>.params.python (or conda_path/conda_env) "
                          "to an interpreter that lies inside its own installation")
    path = tuple(p for p in info["path"] if _mounted(p, roots))
    return Interpreter(executable=exe, path=path, roots=roots)


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


def _stdin_header(interp: Interpreter, limits: SandboxLimits, uid: int | None, seccomp: bytes | None) -> bytes:
    """The prelude's configuration: the first line of its stdin (the snippet follows), a Python literal (``repr``
    escapes every newline), which the prelude reads without importing json."""
    return repr({
        "path": list(interp.path),
        "cpu_s": limits.cpu_s,
        "memory_bytes": limits.memory_mb << 20,
        "max_processes": limits.max_processes,
        "max_file_bytes": limits.max_file_mb << 20,
        "max_open_files": limits.max_open_files,
        "uid": uid,
        "seccomp": seccomp.hex() if seccomp else None,
    }).encode() + b"\n"


def _python_argv(interp: Interpreter) -> list[str]:
    return [interp.executable, "-I", "-S", "-X", "utf8", "-c", PRELUDE, CALL_MARK]


# The launcher of the rlimits level: the snippet runs as its child in a new session, not as the trainer's; it
# exits with the snippet's status (128 + N for signal N, as bwrap does).
_LAUNCHER = ("import os, sys\npid = os.fork()\nif pid == 0:\n    os.execv(sys.argv[1], sys.argv[1:])\n"
             "status = os.waitpid(pid, 0)[1]\n"
             "os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))")


def _data_fd(data: bytes) -> int:
    """A file descriptor to read ``data`` from, at its start (a memfd: unlike a pipe, writing never blocks)."""
    fd = os.memfd_create("archer-sandbox")
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _bwrap_args(interp: Interpreter, limits: SandboxLimits, info_fd: int, seccomp_fd: int, uid: int | None
                ) -> list[str]:
    """The sandbox's settings: namespaces, hostname, mounts, /proc without the boot id, the two scratch tmpfs."""
    args = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", HOSTNAME, "--die-with-parent", "--new-session", "--info-fd", str(info_fd),
            "--seccomp", str(seccomp_fd)]
    if uid is not None:  # root: stay out of a user namespace (uid 0 would map to root), drop uid in the prelude
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
    args += _mount_args(interp.roots)
    args += ["--proc", "/proc", "--ro-bind", "/dev/null", "/proc/sys/kernel/random/boot_id", "--dev", "/dev",
             "--perms", "1777", "--size", str(limits.scratch_mb << 20), "--tmpfs", "/dev/shm",
             "--perms", "1777", "--size", str(limits.scratch_mb << 20), "--tmpfs", SCRATCH,
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SCRATCH]
    return args


@dataclass
class Launch:
    """How to start a call's first process, and what to clean up after it."""

    argv: list[str]
    env: dict[str, str]
    stdin: bytes  # the prelude's configuration line; the snippet follows it
    cwd: str | None = None
    passed_fds: tuple[int, ...] = ()  # given to the first process, closed here once it started
    info_fd: int | None = None  # the read end of bubblewrap's --info-fd pipe
    scratch: str | None = None  # the rlimits level's scratch folder

    def close_passed(self) -> None:
        for fd in self.passed_fds:
            os.close(fd)
        self.passed_fds = ()

    def close(self) -> None:
        self.close_passed()
        if self.info_fd is not None:
            os.close(self.info_fd)
            self.info_fd = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def namespace_launch(bwrap: str, interp: Interpreter, limits: SandboxLimits, seccomp: bytes, uid: int | None
                     ) -> Launch:
    """bubblewrap (at path ``bwrap``) with its settings and filter through file descriptors, then the interpreter."""
    info_r, info_w = os.pipe()
    filter_fd = _data_fd(seccomp)
    args = _bwrap_args(interp, limits, info_w, filter_fd, uid)
    args_fd = _data_fd(b"".join(a.encode() + b"\0" for a in args))
    argv = [bwrap, "--args", str(args_fd), "--", *_python_argv(interp)]
    return Launch(argv, _environment(SCRATCH), _stdin_header(interp, limits, uid, None),
                  passed_fds=(info_w, filter_fd, args_fd), info_fd=info_r)


def rlimits_launch(interp: Interpreter, limits: SandboxLimits, seccomp: bytes | None, uid: int | None) -> Launch:
    """The launcher, then the snippet's interpreter, which loads the seccomp filter itself (where there is one)."""
    scratch = tempfile.mkdtemp(prefix="archer-python-")
    if uid is not None:
        os.chown(scratch, uid, uid)
    return Launch([interp.executable, "-I", "-S", "-c", _LAUNCHER, *_python_argv(interp)], _environment(scratch),
                  _stdin_header(interp, limits, uid, seccomp), cwd=scratch, scratch=scratch)


def read_info(fd: int, deadline: float) -> bytes | None:
    """What bubblewrap wrote on its --info-fd until it closed it; None when it did not by ``deadline``."""
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if sel.select(left):
                chunk = os.read(fd, 4096)
                if not chunk:
                    return data
                data += chunk
    return None


def sandbox_init(info: bytes) -> int | None:
    """The pid of the sandbox's pid 1 (from bwrap's --info-fd), or None when bwrap failed before it."""
    try:
        return int(json.loads(info)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None
