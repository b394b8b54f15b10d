"""CheckpointManager (atomic save, latest pointer, pruning, crash recovery) and RNG state round trips."""

from __future__ import annotations

import json
import random
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from archer.errors import ArcherError
from archer.trainer.checkpoint_dirs import (
    CheckpointManager,
    capture_rng_state,
    load_torch_state,
    restore_rng_state,
    save_torch_state,
)


def _writer(payload: str):
    def write(directory: Path) -> None:
        (directory / "weights.txt").write_text(payload)

    return write


def _visible(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_save_commits_directory_marker_and_latest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ckpt")
    path = manager.save(3, _writer("three"))

    assert path == tmp_path / "ckpt" / "global_step_3" == manager.step_dir(3)
    assert (path / "weights.txt").read_text() == "three"
    assert json.loads((path / "COMPLETE").read_text()) == {"step": 3}
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step_3\n"
    assert _visible(tmp_path / "ckpt") == ["global_step_3", "latest"]
    assert manager.latest_step() == 3
    assert manager.load_dir(3) == path


def test_a_checkpoint_folder_gets_the_mode_of_an_ordinary_folder(tmp_path: Path) -> None:
    ordinary = tmp_path / "ordinary"
    ordinary.mkdir()
    path = CheckpointManager(tmp_path / "ckpt").save(1, _writer("one"))  # was 0700 (mkdtemp's), its files 0644
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(ordinary.stat().st_mode)


def test_keep_all_when_max_to_keep_is_none_or_not_positive(tmp_path: Path) -> None:
    for max_to_keep, sub in ((None, "a"), (0, "b"), (-1, "c")):
        manager = CheckpointManager(tmp_path / sub, max_to_keep=max_to_keep)
        for step in (1, 2, 3):
            manager.save(step, _writer(str(step)))
        assert manager.complete_steps() == [1, 2, 3]


def test_prune_keeps_newest_k(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (10, 20, 30, 40):
        manager.save(step, _writer(str(step)))
    assert _visible(tmp_path) == ["global_step_30", "global_step_40", "latest"]
    assert manager.latest_step() == 40


def test_prune_never_deletes_the_checkpoint_just_written(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (5, 7, 9):
        manager.save(step, _writer(str(step)))
    # Rolling back and saving an older step: it survives, the oldest of the others goes.
    manager.save(6, _writer("six"))
    assert manager.complete_steps() == [6, 9]
    assert manager.latest_step() == 6


def test_save_replaces_existing_step(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(4, _writer("old"))
    (manager.step_dir(4) / "stale.txt").write_text("from the old save")
    manager.save(4, _writer("new"))

    assert sorted(p.name for p in manager.step_dir(4).iterdir()) == ["COMPLETE", "weights.txt"]
    assert (manager.step_dir(4) / "weights.txt").read_text() == "new"
    assert _visible(tmp_path) == ["global_step_4", "latest"]


def test_failed_write_leaves_previous_state_untouched(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, _writer("one"))

    def broken(directory: Path) -> None:
        (directory / "partial.bin").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        manager.save(2, broken)
    assert _visible(tmp_path) == ["global_step_1", "latest"]
    assert manager.latest_step() == 1


def test_crash_debris_recovers_to_newest_complete_step(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, _writer("one"))
    manager.save(2, _writer("two"))
    # A save of step 3 killed mid-write: temp dir without COMPLETE. A torn pointer-update temp file.
    (tmp_path / ".tmp-global_step_3-abcd").mkdir()
    (tmp_path / ".tmp-global_step_3-abcd" / "weights.txt").write_text("partial")
    (tmp_path / ".tmp-latest-xyz").write_text("global_st")
    # A step directory without a marker (copied by hand, interrupted) and a pointer to a missing dir.
    (tmp_path / "global_step_9").mkdir()
    (tmp_path / "latest").write_text("global_step_5\n")

    assert manager.latest_step() == 2
    assert _visible(tmp_path) == ["global_step_1", "global_step_2", "global_step_9", "latest"]

    (tmp_path / "latest").write_text("global_step_9\n")  # pointer to the incomplete directory
    assert manager.latest_step() == 2
    (tmp_path / "latest").write_text("garbage\x00")
    assert manager.latest_step() == 2
    (tmp_path / "latest").unlink()
    assert manager.latest_step() == 2
    (tmp_path / "latest").write_text("global_step_1\n")  # a valid pointer wins over a newer directory
    assert manager.latest_step() == 1


def test_stranded_complete_checkpoint_is_moved_back(tmp_path: Path) -> None:
    # Killed while replacing step 4: old copy moved aside, new copy complete but not yet renamed.
    manager = CheckpointManager(tmp_path)
    manager.save(4, _writer("old"))
    old, new = tmp_path / ".tmp-old-global_step_4-1", tmp_path / ".tmp-global_step_4-2"
    manager.step_dir(4).rename(old)
    manager.save(4, _writer("new"))
    manager.step_dir(4).rename(new)

    assert manager.latest_step() == 4
    assert (manager.step_dir(4) / "weights.txt").read_text() == "new"
    assert _visible(tmp_path) == ["global_step_4", "latest"]


def test_empty_root(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "missing")
    assert manager.latest_step() is None
    assert manager.complete_steps() == []


def test_load_dir_rejects_incomplete_step(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(2, _writer("two"))
    manager.step_dir(3).mkdir()
    with pytest.raises(ArcherError, match=r"step 3 .*complete steps: 2") as err:
        manager.load_dir(3)
    assert err.value.fix is not None


def _draws() -> tuple[list[float], list[float], list[float]]:
    py = [random.random() for _ in range(3)]
    npy = np.random.standard_normal(3).tolist()  # standard_normal exercises the cached-gauss state
    th = torch.rand(3).tolist()
    return py, npy, th


def test_rng_state_round_trip_through_file(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leave a cached gaussian in numpy's state
    state = capture_rng_state()
    save_torch_state(tmp_path / "rng.pt", state)
    expected = _draws()

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert _draws() != expected

    restore_rng_state(load_torch_state(tmp_path / "rng.pt"))
    assert _draws() == expected


def test_torch_state_round_trip(tmp_path: Path) -> None:
    obj = {"step": 7, "weights": torch.arange(4.0), "nested": [1, (2.5, "x")]}
    save_torch_state(tmp_path / "state.pt", obj)
    loaded = load_torch_state(tmp_path / "state.pt")
    assert loaded["step"] == 7
    assert torch.equal(loaded["weights"], torch.tensor([0.0, 1.0, 2.0, 3.0]))
    assert loaded["nested"] == [1, (2.5, "x")]
