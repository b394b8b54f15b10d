"""A full disk during a checkpoint (trainer/checkpoint_dirs.py): the last complete checkpoint is kept, the partial
one removed, and one ArcherError names the folder and the space needed; the clean-up of old checkpoints never
deletes a save in progress or leaves a half that reads as complete. A real 1 MiB tmpfs where mounting is allowed,
else simulated ENOSPC."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException

from archer.errors import ArcherError
from archer.trainer import checkpoint_dirs
from archer.trainer.checkpoint_dirs import CheckpointManager, disk_full, load_torch_state, save_torch_state


def _bytes(size: int):
    def write(directory: Path) -> None:
        (directory / "weights.bin").write_bytes(b"w" * size)

    return write


def _full_after(size: int):
    """A write that fills the disk after ``size`` bytes, as the OS reports it."""
    def write(directory: Path) -> None:
        (directory / "weights.bin").write_bytes(b"w" * size)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "optimizer.pt"))

    return write


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_enospc_in_a_save_keeps_the_last_checkpoint_and_names_folder_and_space(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(1, _bytes(3000))
    with pytest.raises(ArcherError) as info:
        manager.save(2, _full_after(1000))
    err = info.value
    # global_step_1 holds weights.bin (3000 bytes) and its COMPLETE marker ('{"step": 1}\n', 12 bytes)
    assert err.problem.startswith(f"no space left on the disk of {manager.root} while saving checkpoint step 2: a "
                                  "checkpoint of this run needs 2.9 KiB (the size of global_step_1); ")
    assert err.problem.endswith("is free now; the last complete checkpoint, global_step_1, is kept and the partial "
                                "one was removed")
    assert "more than 2.9 KiB is free" in err.fix and "trainer.resume_mode=auto continues from step 1" in err.fix
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOSPC
    assert _listing(manager.root) == ["global_step_1", "latest"]  # no .tmp- staging left
    assert (manager.step_dir(1) / "weights.bin").read_bytes() == b"w" * 3000
    assert manager.latest_step() == 1


def test_enospc_in_a_first_save_counts_what_it_had_written(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ArcherError, match=r"needs at least 2.0 KiB \(what it had written when the disk filled\); "
                                          r".* there is no complete checkpoint yet, and the partial one was removed"):
        manager.save(1, _full_after(2048))
    assert _listing(tmp_path) == [] and manager.latest_step() is None


def test_enospc_writing_the_latest_pointer_leaves_the_new_checkpoint_the_latest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, _bytes(10))

    def no_room(path: Path, text: str, **_: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(checkpoint_dirs, "write_text_atomically", no_room)
    with pytest.raises(ArcherError, match="checkpoint step 2 is complete \\(the latest pointer had no room and was "
                                          "removed\\)"):
        manager.save(2, _bytes(10))
    assert _listing(tmp_path) == ["global_step_1", "global_step_2"]
    assert manager.latest_step() == 2  # the pointer named step 1: a resume would have gone back a step


def test_other_errors_of_a_save_pass_unchanged(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)

    def denied(directory: Path) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(directory))

    with pytest.raises(PermissionError):
        manager.save(1, denied)
    assert _listing(tmp_path) == []


def test_a_full_disk_is_recognised_through_the_wrappers_of_ranks_and_ray() -> None:
    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    chained = RuntimeError("rank 1 failed")
    chained.__cause__ = enospc
    ray_like = RuntimeError("task failed")
    ray_like.cause = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    dcp = CheckpointException("save failed", {0: enospc})
    text_only = RuntimeError(f"worker said: [Errno 28] {os.strerror(errno.ENOSPC)}")
    assert all(disk_full(e) for e in (enospc, chained, ray_like, dcp, text_only))
    assert not disk_full(OSError(errno.EACCES, "Permission denied")) and not disk_full(RuntimeError("disk"))


def test_pruning_cut_short_never_leaves_a_half_checkpoint_that_reads_as_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = CheckpointManager(tmp_path, max_to_keep=1)
    manager.save(1, _bytes(10))
    real_rmtree = shutil.rmtree

    def killed(path: Path, *args: object, **kwargs: object) -> None:
        if ".tmp-pruned-" in str(path):
            next(Path(path).iterdir()).unlink()  # a file gone, then the process dies
            raise KeyboardInterrupt
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_dirs.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        manager.save(2, _bytes(10))
    monkeypatch.setattr(checkpoint_dirs.shutil, "rmtree", real_rmtree)
    assert manager.complete_steps() == [2]  # the half of step 1 is debris, not a checkpoint
    assert manager.latest_step() == 2 and _listing(tmp_path) == ["global_step_2", "latest"]  # debris cleaned


def test_pruning_leaves_saves_in_progress_and_what_a_link_points_at(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints", max_to_keep=1)
    manager.save(1, _bytes(10))
    elsewhere = tmp_path / "elsewhere" / "global_step_1"
    shutil.move(manager.step_dir(1), elsewhere.parent.mkdir() or elsewhere)
    manager.step_dir(1).symlink_to(elsewhere)  # a checkpoint moved to another disk
    in_progress = manager.root / "global_step_3"  # written by hand or by a save that has not committed
    in_progress.mkdir()
    (in_progress / "weights.bin").write_bytes(b"half")
    manager.save(2, _bytes(10))
    assert not manager.step_dir(1).is_symlink() and (elsewhere / "weights.bin").read_bytes() == b"w" * 10
    assert (in_progress / "weights.bin").read_bytes() == b"half"
    assert manager.complete_steps() == [2]


@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (skipped where this process may not mount one)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_real_full_disk_keeps_the_last_checkpoint_and_the_next_save_works_once_there_is_room(
        small_disk: Path) -> None:
    manager = CheckpointManager(small_disk / "checkpoints")
    weights = torch.arange(100_000, dtype=torch.float32)  # 400 KB a checkpoint: two fit in 1 MiB, three do not

    def write(directory: Path) -> None:
        save_torch_state(directory / "state.pt", {"weights": weights})

    manager.save(1, write)
    manager.save(2, write)
    with pytest.raises(ArcherError) as info:
        manager.save(3, write)
    size = checkpoint_dirs._size(checkpoint_dirs._tree_size(manager.step_dir(2)))
    assert info.value.problem.startswith(f"no space left on the disk of {manager.root} while saving checkpoint step 3"
                                         f": a checkpoint of this run needs {size} (the size of global_step_2)")
    assert 400_000 < checkpoint_dirs._tree_size(manager.step_dir(2)) < 404_000  # the tensor, torch's framing, COMPLETE
    assert _listing(manager.root) == ["global_step_1", "global_step_2", "latest"]
    assert manager.latest_step() == 2
    assert torch.equal(load_torch_state(manager.step_dir(2) / "state.pt")["weights"], weights)
    shutil.rmtree(manager.step_dir(1))  # the user makes room
    manager.save(3, write)
    assert manager.complete_steps() == [2, 3] and manager.latest_step() == 3
