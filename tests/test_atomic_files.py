"""Tests of archer.atomic_files: replaced files are complete, readable like the rest of a run, and no
temporary file is left behind."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from archer.atomic_files import (
    TMP_PREFIX,
    make_staging_dir,
    replace_atomically,
    replace_dir,
    write_json_atomically,
    write_text_atomically,
)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_replaced_files_get_the_mode_of_an_ordinary_file(tmp_path: Path) -> None:
    ordinary = tmp_path / "ordinary.txt"
    ordinary.write_text("x")
    atomic = tmp_path / "atomic.txt"
    write_text_atomically(atomic, "y", fsync=False)
    assert mode_of(atomic) == mode_of(ordinary)
    umask = os.umask(0)
    os.umask(umask)
    if not umask & 0o044:  # others may read a run's files: so may they read the replaced ones (not mkstemp's 0600)
        assert mode_of(atomic) & 0o044 == 0o044


def test_a_staging_folder_gets_the_mode_of_an_ordinary_folder(tmp_path: Path) -> None:
    ordinary = tmp_path / "ordinary"
    ordinary.mkdir()
    staging = make_staging_dir(tmp_path / "sub" / "index")
    assert staging.parent == tmp_path / "sub" and staging.name.startswith(f"{TMP_PREFIX}index-")
    assert list(staging.iterdir()) == []
    assert mode_of(staging) == mode_of(ordinary)
    umask = os.umask(0)
    os.umask(umask)
    if not umask & 0o055:  # others may list an ordinary folder: so may they list a staged one (not mkdtemp's 0700)
        assert mode_of(staging) & 0o055 == 0o055


def test_json_is_written_whole_and_tmp_files_are_gone(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "summary.json"
    write_json_atomically(path, {"a": 1, "p": Path("/x")})
    assert json.loads(path.read_text()) == {"a": 1, "p": "/x"}
    assert path.read_text().endswith("\n")
    assert not [p for p in path.parent.iterdir() if p.name.startswith(TMP_PREFIX)]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    write_text_atomically(path, "old")

    def fail(f) -> None:
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        replace_atomically(path, fail)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_dir_puts_the_staged_folder_in_place_and_leaves_nothing_behind(tmp_path: Path, monkeypatch,
                                                                               exchange: bool) -> None:
    import archer.atomic_files as atomic_files

    if not exchange:  # a system without renameat2's exchange: the old folder is renamed aside, then deleted
        monkeypatch.setattr(atomic_files, "_exchange", lambda a, b: False)
    target = tmp_path / "index"
    for content in ("first", "second"):
        staging = make_staging_dir(target)
        (staging / "data.txt").write_text(content)
        replace_dir(staging, target)
        assert (target / "data.txt").read_text() == content
        assert [p.name for p in tmp_path.iterdir()] == ["index"]
