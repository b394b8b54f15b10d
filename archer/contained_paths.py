"""Paths read out of a run's own files are data, never an instruction: one rule for every such path.

A trace's manifest names its step files, its summary.json its tokenizer folder; archer opens and (on a resume)
deletes what they name. Such a name must be a relative path that resolves, symlinks followed, strictly inside
the folder the file describes; otherwise ``resolve_inside`` raises ``OutsideFolderError`` naming the file, the
entry and the path, and the caller stops before it changes anything (a caller that deletes several files
resolves every name first). SECURITY.md lists the files this rule covers.
"""

from __future__ import annotations

from pathlib import Path

from archer.errors import ArcherError


class OutsideFolderError(ArcherError):
    """A path read from a file points outside the folder it belongs to (absolute, ``..``, a symlink out)."""


def resolve_inside(folder: Path, name: object, *, source: Path, entry: str, what: str = "its folder") -> Path:
    """``folder / name`` resolved, when ``name`` (read from the file ``source``, at ``entry``: "line 3",
    "key tokenizer") is a relative path that stays strictly inside ``folder`` (``what`` names the folder in
    the message); else OutsideFolderError."""
    root = Path(folder).resolve()
    problem = None
    if not isinstance(name, str) or not name:
        problem = f"names {name!r}, which is not a relative path"
    elif Path(name).is_absolute():
        problem = f"names the absolute path {name!r}"
    else:
        path = (root / name).resolve()
        if root in path.parents:
            return path
        problem = f"names {name!r} ({path})"
    raise OutsideFolderError(
        f"{source}, {entry}: {problem}, which lies outside {what} {root}; archer opens and deletes only files "
        "inside it, and changed nothing",
        f"this file is damaged or was written by hand: restore it, or remove that entry (its file must lie inside "
        f"{root})")
