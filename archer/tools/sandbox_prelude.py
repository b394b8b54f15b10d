"""The first code a sandboxed Python process runs (passed as ``python -I -S -c <this file's text> <mark>``).

Its stdin holds one line of JSON (the configuration: sys.path, limits, uid, seccomp filter), then the snippet; the
command line holds nothing of the trainer's (its pid, its paths), since every process of the call may read it.
It imports nothing from archer (the sandbox may not see archer's files) and only the standard library. In
order: read the configuration and the snippet from stdin, put the interpreter's own ``sys.path`` back (``-S``
skipped ``site`` and its ``.pth`` hooks), apply the resource limits (no POSIX message queues either), leave root
for the given unprivileged uid (when there is one), load the given seccomp filter (the rlimits level: under
bubblewrap, bubblewrap loads it), then compile and run the snippet as ``__main__``. The value of a final bare
expression is printed, as ARPO's Python tool does, unless it is None. An exception prints the snippet's part of the traceback and exits 1.
"""

import ast
import json
import os
import resource
import sys
import traceback

LIMITS = {
    "cpu_s": resource.RLIMIT_CPU,
    "memory_bytes": resource.RLIMIT_AS,
    "max_processes": resource.RLIMIT_NPROC,
    "max_file_bytes": resource.RLIMIT_FSIZE,
    "max_open_files": resource.RLIMIT_NOFILE,
}


def _print_last_expression(tree: ast.Module) -> ast.Module:
    """Rewrite a final ``expr`` statement into ``__archer_show__(expr)``."""
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        call = ast.Call(func=ast.Name(id="__archer_show__", ctx=ast.Load()), args=[last.value], keywords=[])
        tree.body[-1] = ast.copy_location(ast.Expr(value=call), last)
        ast.fix_missing_locations(tree)
    return tree


def _show(value: object) -> None:
    if value is not None:
        print(value)


def _load_seccomp(program: bytes) -> None:
    """Install a classic-BPF seccomp filter on this process and its future children (no_new_privs first)."""
    import ctypes

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buffer = ctypes.create_string_buffer(program, len(program))
    libc = ctypes.CDLL(None, use_errno=True)
    prog = Program(len(program) // 8, ctypes.addressof(buffer))
    # PR_SET_NO_NEW_PRIVS = 38; PR_SET_SECCOMP = 22 with SECCOMP_MODE_FILTER = 2
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:
        sys.exit(f"the sandbox could not load its seccomp filter: {os.strerror(ctypes.get_errno())}")


def main() -> None:
    header, _, code = sys.stdin.buffer.read().partition(b"\n")
    config = json.loads(header)
    sys.path[:] = config["path"]
    source = code.decode("utf-8", errors="replace")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))  # POSIX message queues outlive the call
    for key, which in LIMITS.items():
        resource.setrlimit(which, (config[key], config[key] + (1 if key == "cpu_s" else 0)))
    uid = config["uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if config.get("seccomp"):
        _load_seccomp(bytes.fromhex(config["seccomp"]))
    sys.argv = ["<snippet>"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__, "__archer_show__": _show}
    try:
        tree = _print_last_expression(ast.parse(source, filename="<snippet>"))
        exec(compile(tree, "<snippet>", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as e:  # the snippet's error is its result: show it as Python would, without our frames
        sys.stdout.flush()
        frames = None if isinstance(e, SyntaxError) or e.__traceback__ is None else e.__traceback__.tb_next
        traceback.print_exception(type(e), e, frames)
        sys.exit(1)


main()
