"""The seccomp filter of the Python sandbox: a classic-BPF program that bubblewrap loads (``--seccomp FD``).

Inside the sandbox a snippet could otherwise make its own user and mount namespaces and mount a tmpfs of any
size, outside every limit. The filter refuses, with ``EPERM``: creating or entering namespaces (``unshare`` and
``clone`` with any ``CLONE_NEW*`` flag, ``setns``), every mount call (old and new mount API, ``pivot_root``,
``chroot``), the kernel keyring, ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring``, ``ptrace`` and
cross-process memory access, module and kexec loading, and a few host-wide calls (``swapon``, ``reboot``,
``acct``, ``quotactl``, ``syslog``, file handles). ``clone3`` answers ``ENOSYS`` (its flags sit in memory a
filter cannot read), so the C library falls back to ``clone``, whose flags it checks. A system call of another
ABI (32-bit, x32) is refused. Everything else is allowed.

The program is assembled here (about fifty instructions) rather than through libseccomp, whose Python binding
needs the C library installed; the system-call numbers are the kernel's for x86-64 and arm64.
"""

from __future__ import annotations

import errno
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
    "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265),
}
# refused when their first argument (the flags) holds a namespace flag: name -> (x86-64, arm64)
FLAG_CHECKED = {"clone": (56, 220), "unshare": (272, 97)}
CLONE3 = (435, 435)
# CLONE_NEWTIME | CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
NAMESPACE_FLAGS = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_ARCHES = {"x86_64": (0, 0xC000003E), "amd64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7), "arm64": (1, 0xC00000B7)}
_X32_BIT = 0x40000000

# classic BPF opcodes and seccomp return values
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # offsets in struct seccomp_data (little-endian: the low half of args[0] first)


def supported() -> bool:
    """Whether this machine's architecture has a filter here."""
    return platform.machine().lower() in _ARCHES


def build_filter(machine: str | None = None) -> bytes:
    """The filter for ``machine`` (default: this one) as bubblewrap reads it: packed ``struct sock_filter``s."""
    name = (machine or platform.machine()).lower()
    if name not in _ARCHES:
        raise ValueError(f"no seccomp filter for the {name} architecture (x86-64 and arm64 only)")
    column, audit_arch = _ARCHES[name]
    denied = sorted({numbers[column] for numbers in DENIED.values()})
    checked = [numbers[column] for numbers in FLAG_CHECKED.values()]
    # layout: head, one jump per denied or special call, then the tails below (targets counted from the end)
    head = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ, 1, 0, audit_arch), (_RET, 0, 0, _ERRNO | errno.EPERM),
            (_LD_W_ABS, 0, 0, _NR)]
    tails = [(_RET, 0, 0, _ALLOW),                      # allow
             (_LD_W_ABS, 0, 0, _ARG0_LOW),              # flags: check the namespace bits
             (_JSET, 1, 0, NAMESPACE_FLAGS),
             (_RET, 0, 0, _ALLOW),
             (_RET, 0, 0, _ERRNO | errno.EPERM),        # deny
             (_RET, 0, 0, _ERRNO | errno.ENOSYS)]       # enosys
    flags, deny, enosys = 1, 4, 5  # indices in tails; a call no test matches falls through to tails[0]: allow
    tests = [(_JGE, deny, _X32_BIT)] if column == 0 else []
    tests += [(_JEQ, deny, nr) for nr in denied] + [(_JEQ, flags, nr) for nr in checked]
    tests += [(_JEQ, enosys, CLONE3[column])]
    # a jump's offset counts the instructions after it: the tests left, then tails up to the target
    body = [(code, len(tests) - i - 1 + target, 0, k) for i, (code, target, k) in enumerate(tests)]
    program = head + body + tails
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)
