"""Files replaced atomically: write a temporary file beside the target, then os.replace it into place.

A reader (or a run killed at any moment) sees the old file or the new one, never a mix. With ``fsync`` the
data and the directory entry are on disk before the function returns. Temporary files start with ``.tmp-``
so that their owners can clean up what a crash left. A replaced file gets the permissions of a file made with
open() (0666 less the umask), like every other file of a run, not mkstemp's private 0600; a staging folder
(built whole, then renamed into place) those of a folder made with mkdir (0777 less the umask), not mkdtemp's
0700. ``replace_dir`` puts a staged folder in place of an old one in one step (Linux's renameat2 exchange), so
a reader sees the whole old folder or the whole new one.

``recorded_path`` is how a run's JSON files (summary.json, results.json) name a local path: absolute
(``os.path.abspath``: from the directory archer was started in, symlinks kept as given), so that the file reads the
same from anywhere; a name that is no local path (a Hugging Face hub id, ``hdfs://...``) stays as given.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

TMP_PREFIX = ".tmp-"


def recorded_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a run's JSON records it: absolute when it exists here, else as given."""
    return os.path.abspath(path) if os.path.exists(path) else str(path)


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once at import: os.umask cannot be read without setting it
FILE_MODE = 0o666 & ~_UMASK
DIR_MODE = 0o777 & ~_UMASK


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: Path, write: Callable[[BinaryIO], object], *, fsync: bool = True) -> None:
    """Call ``write`` on a temporary file in ``path``'s folder, then replace ``path`` with it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}-", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def make_staging_dir(target: Path) -> Path:
    """A new empty folder beside ``target`` (``.tmp-<name>-XXXX``) with the mode of an ordinary folder, to be
    filled and then renamed to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=target.parent))
    os.chmod(staging, DIR_MODE)
    return staging


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap the two paths in one step (Linux renameat2); False where the system or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def replace_dir(staging: Path, target: Path) -> None:
    """Put the folder ``staging`` (beside ``target``) at ``target``, then delete the folder it replaced.

    An existing ``target`` is exchanged with ``staging`` in one step where Linux allows it; elsewhere it is
    renamed aside first (a crash in between leaves it whole under a ``.tmp-`` name). The caller decides
    whether ``target`` may be replaced: this function replaces whatever folder is there.
    """
    if not target.exists():
        os.replace(staging, target)
    elif _exchange(staging, target):
        shutil.rmtree(staging)
    else:
        old = target.with_name(f"{TMP_PREFIX}{target.name}-old-{os.getpid()}")
        os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old)
    fsync_dir(target.parent)


def write_text_atomically(path: Path, text: str, *, fsync: bool = True) -> None:
    replace_atomically(path, lambda f: f.write(text.encode("utf-8")), fsync=fsync)


def write_json_atomically(path: Path, data: Any, *, fsync: bool = True) -> None:
    """``data`` as indented JSON (values JSON cannot hold are written with str())."""
    write_text_atomically(path, json.dumps(data, indent=2, default=str) + "\n", fsync=fsync)
