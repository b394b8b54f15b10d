"""The check that the driver and every rank see one run folder (archer/distributed/shared_folder.py), with the ranks'
views of the folder played in this process: a node that mounts another disk at the same path is a rank whose view
is another folder.

- Every process seeing the one folder passes, and the check leaves nothing behind in it.
- A rank that sees another folder than the driver's (which commits the checkpoints) stops the run with one error
  naming trainer.default_local_dir, that rank and its host; so does a rank that misses another rank's files.
- The real ranks' side (RankWorkers.check_shared_folder, over Ray on two nodes) runs in every run of
  tests/test_multinode_train.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from archer.distributed.shared_folder import check_shared_folder, rank_name, unseen_markers, write_marker
from archer.errors import ArcherError

KEY = "trainer.default_local_dir"


def ranks_seeing(views: list[Path]):
    """A worker group's ``call`` whose rank r sees the run's folder as ``views[r]`` (hosts node0, node1, ...)."""

    def call(method: str, folder: Path, token: str) -> list[dict]:
        assert method == "check_shared_folder"
        for rank, view in enumerate(views):  # every rank writes before any looks: the ranks' barrier
            write_marker(view, token, rank_name(rank))
        return [{"host": f"node{rank}", "unseen": unseen_markers(view, token, len(views))}
                for rank, view in enumerate(views)]

    return call


def test_one_folder_for_everyone_passes_and_is_left_as_it_was(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "checkpoints"
    check_shared_folder(ranks_seeing([folder, folder, folder]), folder, 3, KEY)
    assert list(folder.iterdir()) == []


def test_a_rank_on_another_disk_is_named_with_its_host(tmp_path: Path) -> None:
    folder, other_disk = tmp_path / "run" / "checkpoints", tmp_path / "node1_disk" / "checkpoints"
    with pytest.raises(ArcherError) as err:
        check_shared_folder(ranks_seeing([folder, other_disk, folder]), folder, 3, KEY)
    assert err.value.problem.startswith(f"{KEY}={folder} is not one folder for the whole run: rank 1 (host node1) "
                                        "does not see the files the driver wrote there; ")
    assert KEY in err.value.fix and "same path" in err.value.fix
    assert list(folder.iterdir()) == []  # nothing left behind in the run's folder


def test_every_rank_apart_from_the_driver_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    with pytest.raises(ArcherError) as err:  # the driver alone on its disk: both ranks see another folder
        check_shared_folder(ranks_seeing([tmp_path / "node0", tmp_path / "node1"]), folder, 2, KEY)
    assert "rank 0 (host node0), rank 1 (host node1) do not see the files the driver wrote" in err.value.problem


def test_a_rank_whose_files_another_rank_misses_is_named_by_what_it_misses(tmp_path: Path) -> None:
    folder = tmp_path / "run"

    def call(method: str, folder: Path, token: str) -> list[dict]:  # rank 1's marker never reaches rank 0's view
        write_marker(folder, token, rank_name(0))
        return [{"host": "node0", "unseen": [rank_name(1)]}, {"host": "node1", "unseen": []}]

    with pytest.raises(ArcherError) as err:
        check_shared_folder(call, folder, 2, KEY)
    assert "rank 0 (host node0) does not see the files that rank 1 wrote there" in err.value.problem
