"""The seccomp filter of the Python sandbox: a classic-BPF program that bubblewrap loads (``--seccomp FD``).

Inside the sandbox a snippet could otherwise make its own user and mount namespaces and mount a tmpfs of any
size, outside every limit. The filter refuses, with ``EPERM``: creating or entering namespaces (``unshare`` and
``clone`` with any ``CLONE_NEW*`` flag, ``setns``), every mount call (old and new mount API, ``pivot_root``,
``chroot``), the kernel keyring, ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring``, ``ptrace`` and
cross-process memory access, ``memfd_secret``, module and kexec loading, and a few host-wide calls (``swapon``,
``reboot``, ``acct``, ``quotactl``, ``syslog``, file handles). ``clone3`` answers ``ENOSYS`` (its flags sit in
memory a filter cannot read), so the C library falls back to ``clone``, whose flags it checks. Sockets of a
family other than unix, netlink and IP (``AF_VSOCK`` reaches the hypervisor whatever the network namespace) answer
``EAFNOSUPPORT``. A system call of another ABI (32-bit, x32) is refused. Everything else is allowed.

Memory that no process's RSS shows is bounded by the call's memory cgroup where there is one (memory_cgroup.py).
Where there is none (``accounted=False``) the filter also refuses what would hold it unbounded: ``memfd_create``
and IP sockets (TCP and UDP buffers, bounded only host-wide). SysV IPC (shared memory, message queues, semaphore
sets) is allowed only with a cgroup and an IPC namespace of the call's own (``ipc_namespace``), which dies with the
call; otherwise its objects would outlive the call, in the host's namespace. Unix socket buffers are counted by no
cgroup (v1 or v2), so resizing a socket's buffers (``setsockopt`` of ``SO_SNDBUF``, ``SO_RCVBUF`` and their
``FORCE`` forms) is always refused: each socket keeps the kernel's default size, and a call's sockets are bounded
by its open files.

The program is assembled here (under a hundred instructions) rather than through libseccomp, whose Python binding
needs the C library installed; the system-call numbers are the kernel's for x86-64 and arm64.
"""

from __future__ import annotations

import errno
import functools
import platform
import struct

# the system calls refused outright: name -> (x86-64 number, arm64 number)
DENIED = {
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51), "setns": (308, 268),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "ptrace": (101, 117),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "swapon": (167, 224), "swapoff": (168, 225),
    "reboot": (169, 142), "acct": (163, 89), "quotactl": (179, 60), "syslog": (103, 116),
    "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265), "memfd_secret": (447, 447),
}
# refused without a memory cgroup: memory that outlives every process's mapping, outside any limit
UNACCOUNTED = {"memfd_create": (319, 279)}
# refused unless the call has a memory cgroup and an IPC namespace of its own
SYSV_IPC = {
    "shmget": (29, 194), "shmat": (30, 196), "shmctl": (31, 195), "shmdt": (67, 197), "msgget": (68, 186),
    "msgsnd": (69, 189), "msgrcv": (70, 188), "msgctl": (71, 187), "semget": (64, 190), "semop": (65, 193),
    "semctl": (66, 191), "semtimedop": (220, 192),
}
# refused when their first argument (the flags) holds a namespace flag: name -> (x86-64, arm64)
FLAG_CHECKED = {"clone": (56, 220), "unshare": (272, 97)}
CLONE3 = (435, 435)
# checked by their first argument, the address family
SOCKET_CALLS = {"socket": (41, 198), "socketpair": (53, 199)}
SETSOCKOPT = (54, 208)
# Linux's address family numbers
UNIX_FAMILIES = (1, 16)  # AF_UNIX, AF_NETLINK (the C library asks netlink for the machine's addresses)
IP_FAMILIES = (2, 10)  # AF_INET, AF_INET6
# setsockopt(SOL_SOCKET, ...) options that resize a socket's buffers: SO_SNDBUF, SO_RCVBUF and the FORCE pair
BUFFER_OPTIONS = (7, 8, 32, 33)
SOL_SOCKET = 1
# CLONE_NEWTIME | CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
NAMESPACE_FLAGS = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_ARCHES = {"x86_64": (0, 0xC000003E), "amd64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7), "arm64": (1, 0xC00000B7)}
_X32_BIT = 0x40000000

# classic BPF opcodes and seccomp return values
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_NR, _ARCH = 0, 4  # offsets in struct seccomp_data
_ARG_LOW = (16, 24, 32)  # the low half of args[0..2] (little-endian)


def supported() -> bool:
    """Whether this machine's architecture has a filter here."""
    return platform.machine().lower() in _ARCHES


def refused_calls(*, accounted: bool, ipc_namespace: bool) -> dict[str, tuple[int, int]]:
    """The system calls refused outright under these conditions."""
    refused = dict(DENIED)
    if not accounted:
        refused |= UNACCOUNTED
    if not (accounted and ipc_namespace):
        refused |= SYSV_IPC
    return refused


def socket_families(*, accounted: bool) -> tuple[int, ...]:
    """The address families a snippet may open sockets of."""
    return UNIX_FAMILIES + (IP_FAMILIES if accounted else ())


class _Program:
    """Classic-BPF instructions whose jumps name labels; ``bytes`` resolves them (forward jumps only)."""

    def __init__(self) -> None:
        self.insns: list[tuple[int, int | str, int | str, int]] = []
        self.labels: dict[str, int] = {}

    def load(self, offset: int) -> None:
        self.insns.append((_LD_W_ABS, 0, 0, offset))

    def jump(self, code: int, k: int, true: int | str = 0, false: int | str = 0) -> None:
        self.insns.append((code, true, false, k))

    def ret(self, k: int) -> None:
        self.insns.append((_RET, 0, 0, k))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.insns)

    def __bytes__(self) -> bytes:
        out = []
        for i, (code, true, false, k) in enumerate(self.insns):
            jt, jf = (self.labels[t] - i - 1 if isinstance(t, str) else t for t in (true, false))
            if not (0 <= jt < 256 and 0 <= jf < 256):
                raise ValueError(f"a jump of instruction {i} does not fit classic BPF ({jt}, {jf})")
            out.append(struct.pack("=HBBI", code, jt, jf, k))
        return b"".join(out)


@functools.cache
def build_filter(machine: str | None = None, *, accounted: bool, ipc_namespace: bool) -> bytes:
    """The filter for ``machine`` (default: this one) as bubblewrap reads it: packed ``struct sock_filter``s.
    ``accounted``: the call runs in a memory cgroup; ``ipc_namespace``: it has an IPC namespace of its own."""
    name = (machine or platform.machine()).lower()
    if name not in _ARCHES:
        raise ValueError(f"no seccomp filter for the {name} architecture (x86-64 and arm64 only)")
    column, audit_arch = _ARCHES[name]
    p = _Program()
    p.load(_ARCH)
    p.jump(_JEQ, audit_arch, false="deny")
    p.load(_NR)
    if column == 0:
        p.jump(_JGE, _X32_BIT, true="deny")
    for nr in sorted({numbers[column] for numbers in refused_calls(accounted=accounted,
                                                                    ipc_namespace=ipc_namespace).values()}):
        p.jump(_JEQ, nr, true="deny")
    for numbers in FLAG_CHECKED.values():
        p.jump(_JEQ, numbers[column], true="flags")
    p.jump(_JEQ, CLONE3[column], true="enosys")
    for numbers in SOCKET_CALLS.values():
        p.jump(_JEQ, numbers[column], true="family")
    p.jump(_JEQ, SETSOCKOPT[column], true="sockopt")
    p.ret(_ALLOW)
    p.label("flags")  # clone, unshare: no namespace flag
    p.load(_ARG_LOW[0])
    p.jump(_JSET, NAMESPACE_FLAGS, true="deny")
    p.ret(_ALLOW)
    p.label("family")  # socket, socketpair: an allowed address family
    p.load(_ARG_LOW[0])
    for family in socket_families(accounted=accounted):
        p.jump(_JEQ, family, true="allow")
    p.ret(_ERRNO | errno.EAFNOSUPPORT)
    p.label("sockopt")  # setsockopt(SOL_SOCKET, a buffer size): refused
    p.load(_ARG_LOW[1])
    p.jump(_JEQ, SOL_SOCKET, false="allow")
    p.load(_ARG_LOW[2])
    for option in BUFFER_OPTIONS:
        p.jump(_JEQ, option, true="deny")
    p.label("allow")
    p.ret(_ALLOW)
    p.label("deny")
    p.ret(_ERRNO | errno.EPERM)
    p.label("enosys")
    p.ret(_ERRNO | errno.ENOSYS)
    return bytes(p)
