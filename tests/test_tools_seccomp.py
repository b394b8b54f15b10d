"""The sandbox's seccomp filter, run through a small classic-BPF evaluator for both architectures it supports.

(test_tools_python.py checks the same filter in a real sandbox on this machine's architecture.)
"""

from __future__ import annotations

import errno
import struct

import pytest

from archer.tools.seccomp_filter import (
    DENIED,
    FLAG_CHECKED,
    SETSOCKOPT,
    SOCKET_CALLS,
    SYSV_IPC,
    UNACCOUNTED,
    build_filter,
)

ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
EAFNOSUPPORT = 0x00050000 | errno.EAFNOSUPPORT
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET, AF_VSOCK = 1, 2, 10, 16, 17, 40
SOL_SOCKET, SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_KEEPALIVE, IPPROTO_TCP = 1, 7, 8, 32, 9, 6
ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
COLUMN = {"x86_64": 0, "aarch64": 1}
CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD, CLONE_VM_THREAD = 0x10000000, 0x20000, 17, 0x100 | 0x10000


def evaluate(program: bytes, arch: int, nr: int, *args: int) -> int:
    """What the filter returns for one system call (struct seccomp_data: nr, arch, ip, args)."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *args, *[0] * (6 - len(args)))
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


def full(machine: str) -> bytes:
    """The filter of a call with a memory cgroup and an IPC namespace of its own: the fewest refusals."""
    return build_filter(machine, accounted=True, ipc_namespace=True)


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_filter_refuses_namespaces_mounts_and_the_rest(machine: str) -> None:
    program, arch, col = full(machine), ARCH[machine], COLUMN[machine]
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
        if nr not in (numbers[col] for numbers in [*DENIED.values(), *FLAG_CHECKED.values(), SETSOCKOPT,
                                                   *SOCKET_CALLS.values()]):
            assert evaluate(program, arch, nr) == ALLOW, nr
    assert evaluate(program, 0x40000003, 1) == EPERM  # another ABI (i386)


def test_x32_system_calls_are_refused_on_x86_64() -> None:
    assert evaluate(full("x86_64"), ARCH["x86_64"], 0x40000000 | 1) == EPERM


def test_an_unknown_architecture_has_no_filter() -> None:
    with pytest.raises(ValueError, match="x86-64 and arm64 only"):
        full("riscv64")


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
@pytest.mark.parametrize("accounted", [True, False])
def test_sockets_of_families_outside_unix_netlink_and_ip_are_refused(machine: str, accounted: bool) -> None:
    # AF_VSOCK reaches the hypervisor whatever the network namespace; without a memory cgroup, IP buffers are
    # bounded only host-wide, so IP sockets are refused too
    program = build_filter(machine, accounted=accounted, ipc_namespace=True)
    arch, col = ARCH[machine], COLUMN[machine]
    for call in SOCKET_CALLS.values():
        for family in (AF_UNIX, AF_NETLINK):
            assert evaluate(program, arch, call[col], family, 1, 0) == ALLOW
        for family in (AF_INET, AF_INET6):
            assert evaluate(program, arch, call[col], family, 1, 0) == (ALLOW if accounted else EAFNOSUPPORT)
        for family in (AF_PACKET, AF_VSOCK, 0, 45):
            assert evaluate(program, arch, call[col], family, 1, 0) == EAFNOSUPPORT


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_without_a_cgroup_what_holds_memory_outside_every_limit_is_refused(machine: str) -> None:
    arch, col = ARCH[machine], COLUMN[machine]
    for accounted, ipc_namespace in [(True, True), (True, False), (False, True), (False, False)]:
        program = build_filter(machine, accounted=accounted, ipc_namespace=ipc_namespace)
        for name, numbers in SYSV_IPC.items():  # only a cgroup and an IPC namespace of the call's own bound them
            assert evaluate(program, arch, numbers[col]) == (ALLOW if accounted and ipc_namespace else EPERM), name
        for name, numbers in UNACCOUNTED.items():
            assert evaluate(program, arch, numbers[col]) == (ALLOW if accounted else EPERM), name
        setsockopt = SETSOCKOPT[col]
        for option in (SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE):  # no cgroup counts unix buffers: default sizes only
            assert evaluate(program, arch, setsockopt, 3, SOL_SOCKET, option) == EPERM
        assert evaluate(program, arch, setsockopt, 3, SOL_SOCKET, SO_KEEPALIVE) == ALLOW
        assert evaluate(program, arch, setsockopt, 3, IPPROTO_TCP, SO_SNDBUF) == ALLOW  # TCP_SYNCNT, not a buffer
