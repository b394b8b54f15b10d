"""The sandbox's seccomp filter, run through a small classic-BPF evaluator for both architectures it supports.

(test_tools_python.py checks the same filter in a real sandbox on this machine's architecture.)
"""

from __future__ import annotations

import errno
import struct

import pytest

from archer.tools.seccomp_filter import DENIED, FLAG_CHECKED, build_filter

ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
COLUMN = {"x86_64": 0, "aarch64": 1}
CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD, CLONE_VM_THREAD = 0x10000000, 0x20000, 17, 0x100 | 0x10000


def evaluate(program: bytes, arch: int, nr: int, arg0: int = 0) -> int:
    """What the filter returns for one system call (struct seccomp_data: nr, arch, ip, args)."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == 0x06:  # ret k
            return k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        pc += 1


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_filter_refuses_namespaces_mounts_and_the_rest(machine: str) -> None:
    program, arch, col = build_filter(machine), ARCH[machine], COLUMN[machine]
    for name, numbers in DENIED.items():
        assert evaluate(program, arch, numbers[col]) == EPERM, name
    clone, unshare = FLAG_CHECKED["clone"][col], FLAG_CHECKED["unshare"][col]
    assert evaluate(program, arch, clone, SIGCHLD) == ALLOW  # fork
    assert evaluate(program, arch, clone, CLONE_VM_THREAD) == ALLOW  # a thread
    assert evaluate(program, arch, clone, CLONE_NEWUSER | SIGCHLD) == EPERM
    assert evaluate(program, arch, unshare, CLONE_NEWNS) == EPERM
    assert evaluate(program, arch, unshare, 0x400) == ALLOW  # CLONE_FILES: no namespace
    assert evaluate(program, arch, 435) == ENOSYS  # clone3: the C library falls back to clone
    for nr in (0, 1, 3, 57, 59, 60, 231):  # read, write, close, ... (x86-64 numbers; harmless on arm64 too)
        if nr not in (numbers[col] for numbers in [*DENIED.values(), *FLAG_CHECKED.values()]):
            assert evaluate(program, arch, nr) == ALLOW, nr
    assert evaluate(program, 0x40000003, 1) == EPERM  # another ABI (i386)


def test_x32_system_calls_are_refused_on_x86_64() -> None:
    assert evaluate(build_filter("x86_64"), ARCH["x86_64"], 0x40000000 | 1) == EPERM


def test_an_unknown_architecture_has_no_filter() -> None:
    with pytest.raises(ValueError, match="x86-64 and arm64 only"):
        build_filter("riscv64")
