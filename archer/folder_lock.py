"""One writing process per output folder: ``archer train`` and ``archer sft`` hold their run folder
(``trainer.default_local_dir``), ``archer eval`` its output folder, from before they write anything until they end.

The lock is a POSIX record lock (``fcntl.lockf``) on ``<folder>/.archer.lock``. The kernel drops it when the
holding process ends, however it ends (kill -9 included), so a dead run never leaves its folder locked; the
processes it starts do not inherit it, and the Ray ranks that write checkpoints for the driver never take it.
A second process is refused with one ArcherError naming the holder's PID (the kernel's answer to F_GETLK), and
changes nothing in the folder: the lock file stays empty, created once where there is none, so that a refused or
finished run's rerun leaves every byte of the folder as it was. Within one process a folder is held once and
counted, so a command may open a folder it holds again (a quickstart's stages; a test's runs one after the
other). On a file system that takes no locks the run goes on with a warning.

A record lock belongs to the process and the file: closing any descriptor of that file in the holding process
would drop it, so only this module opens the lock file, once per folder and process.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
from pathlib import Path

from archer.errors import ArcherError

LOCK_FILE = ".archer.lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # a file system without POSIX locks (some FUSE ones)
log = logging.getLogger("archer")
_held: dict[Path, list[int]] = {}  # resolved folder -> [descriptor, holds]
_guard = threading.RLock()  # re-entrant: a collected FolderLock may release inside hold_folder


class FolderLock:
    """One hold of a folder; ``release`` (or leaving the ``with`` block, or the object being collected) ends it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._released = False

    def release(self) -> None:
        """End this hold (once); the lock itself goes with the process's last hold of the folder."""
        with _guard:
            if self._released:
                return
            self._released = True
            entry = _held[self.folder]
            entry[1] -= 1
            if entry[1] == 0:
                del _held[self.folder]
                os.close(entry[0])  # drops the record lock

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            self.release()


def hold_folder(folder: str | Path, command: str) -> FolderLock:
    """Make ``folder`` if needed and hold it for ``command`` ("archer train"); an ArcherError naming the holder's
    PID when another process holds it."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    key = path.resolve()
    with _guard:
        if key in _held:
            _held[key][1] += 1
            return FolderLock(key)
        fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            locked = _lock(fd, key, command)
        except BaseException:
            os.close(fd)
            raise
        if not locked:  # the folder stays writable; only the guard is gone
            log.warning("%s: its file system takes no locks; nothing stops a second process from writing this "
                        "folder at the same time", key)
        _held[key] = [fd, 1]
        return FolderLock(key)


def refuse_if_held(folder: str | Path, command: str) -> None:
    """The ArcherError of ``hold_folder`` when another process holds ``folder`` now, found without writing
    anything (no folder or lock file is made): a run calls it before its read-only checks of the folder, and
    ``hold_folder`` once it is about to write, so that a run those checks refuse leaves the folder as it was."""
    key = Path(folder).resolve()
    with _guard:
        if key in _held:
            return
        try:
            fd = os.open(key / LOCK_FILE, os.O_RDWR)
        except OSError:  # no lock file: no run of this archer holds the folder
            return
        try:
            _lock(fd, key, command)
        finally:
            os.close(fd)  # the lock taken for the look goes with it


def _lock(fd: int, key: Path, command: str) -> bool:
    """Lock the open lock file ``fd``: True when locked, False on a file system without locks; an ArcherError
    naming the holder when another process holds it."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in _NO_LOCKS:
            return False
        if e.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        holder = _holder(fd)
        raise ArcherError(
            f"{key} is in use by another process ({holder}): two runs writing one folder would overwrite each "
            f"other's checkpoints, metrics and traces, so this {command} wrote nothing",
            "wait for that run to end (or stop it), or give this one another folder "
            f"({_folder_key(command)}=NEW_DIR)") from None


def _folder_key(command: str) -> str:
    return "output_dir" if command == "archer eval" else "trainer.default_local_dir"


def _holder(fd: int) -> str:
    pid = _lock_owner_pid(fd)
    return f"PID {pid}" if pid else "its PID is not visible here: another host or PID namespace"


def _lock_owner_pid(fd: int) -> int | None:
    """F_GETLK's PID of the process holding a write lock on the file (Linux' struct flock on 64-bit systems);
    None where the kernel does not say (another PID namespace, another layout)."""
    if struct.calcsize("l") != 8:
        return None
    query = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    try:
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query)
    except OSError:
        return None
    lock_type, _, _, _, pid = struct.unpack("hhqqi4x", answer)
    return pid if lock_type != fcntl.F_UNLCK and pid > 0 else None
