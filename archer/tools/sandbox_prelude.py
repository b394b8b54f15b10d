"""The first code a sandboxed Python process runs (passed as ``python -I -S -c <this file's text> <mark>``).

Its stdin holds one line, a Python literal (the configuration: sys.path, limits, uid, seccomp filter), then the
snippet; the command line holds nothing of the trainer's (its pid, its paths), since every process of the call may
read it. It imports nothing from archer (the sandbox may not see archer's files) and only the standard library's
built-in modules (``_ast``, ``os``, ``resource``, ``sys``): json, ast and traceback would pull in ``re``, ``enum``
and ``tokenize``, two-thirds of an interpreter's start on every call (about 20 ms of 31, 2026-11-29), so the
configuration is read through ``_ast`` and an error is printed by the interpreter's own hook. In
order: read the configuration and the snippet from stdin, put the interpreter's own ``sys.path`` back (``-S``
skipped ``site`` and its ``.pth`` hooks), apply the resource limits (no POSIX message queues either), leave root
for the given unprivileged uid (when there is one), load the given seccomp filter (the rlimits level: under
bubblewrap, bubblewrap loads it), then compile and run the snippet as ``__main__``. The value of a final bare
expression is printed, as ARPO's Python tool does, unless it is None. An exception prints the snippet's part of the traceback and exits 1.
"""

import _ast
import os
import resource
import sys

LIMITS = {
    "cpu_s": resource.RLIMIT_CPU,
    "memory_bytes": resource.RLIMIT_AS,
    "max_processes": resource.RLIMIT_NPROC,
    "max_file_bytes": resource.RLIMIT_FSIZE,
    "max_open_files": resource.RLIMIT_NOFILE,
}


def _literal(node: _ast.AST) -> object:
    """The value of the configuration literal (``repr`` of a dict of str, int, None and lists of str)."""
    if isinstance(node, _ast.Constant):
        return node.value
    if isinstance(node, _ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, _ast.Dict):
        return {_literal(key): _literal(value) for key, value in zip(node.keys, node.values)}
    if isinstance(node, _ast.UnaryOp) and isinstance(node.op, _ast.USub):
        return -_literal(node.operand)
    raise ValueError(f"the sandbox's configuration holds a {type(node).__name__}, not a literal")


def _print_last_expression(tree: _ast.Module) -> _ast.Module:
    """Rewrite a final ``expr`` statement into ``__archer_show__(expr)``."""
    if tree.body and isinstance(tree.body[-1], _ast.Expr):
        last = tree.body[-1]
        name = _ast.Name(id="__archer_show__", ctx=_ast.Load())
        call = _ast.Call(func=name, args=[last.value], keywords=[])
        for node in (name, call):
            for where in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
                setattr(node, where, getattr(last, where))
        last.value = call
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
    config = _literal(compile(header.decode("utf-8"), "<config>", "eval", _ast.PyCF_ONLY_AST).body)
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
        tree = _print_last_expression(compile(source, "<snippet>", "exec", _ast.PyCF_ONLY_AST))
        exec(compile(tree, "<snippet>", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as e:  # the snippet's error is its result: show it as Python would, without our frames
        sys.stdout.flush()
        frames = None if isinstance(e, SyntaxError) or e.__traceback__ is None else e.__traceback__.tb_next
        # the interpreter's own hook prints what traceback.print_exception would, with no import; it reads the
        # exception's __traceback__, so that is cut to the snippet's frames first
        sys.__excepthook__(type(e), e.with_traceback(frames), frames)
        sys.exit(1)


main()
