"""Whether the driver and every rank see one folder: the run's checkpoints need storage every node shares.

A checkpoint of several ranks is written by all of them into one temporary folder (each rank its DCP shard,
rank 0 the HF export; archer/distributed/sharded_checkpoint.py), which the driver then commits by renaming it
(archer/trainer/checkpoint_dirs.py); on resume every rank reads every shard (DCP reshards). So the checkpoint
folder must be the same folder on every node. ``check_shared_folder`` (the driver) proves it before the first
step: the driver and each rank write a marker named after themselves into ``<folder>/.tmp-shared-<token>/``
(``write_marker``), every rank lists the markers it cannot see (``unseen_markers``, after the ranks' barrier),
and any marker missing anywhere is one ArcherError naming the key and the ranks (with their hosts) that do not
see the driver's marker: the driver commits the checkpoints, so the folder it sees is the run's. The marker folder
starts with ``.tmp-``, which the checkpoint manager clears as debris if a run dies in between.
"""

from __future__ import annotations

import shutil
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from archer.atomic_files import TMP_PREFIX
from archer.errors import ArcherError

DRIVER = "driver"


def marker_folder(folder: Path, token: str) -> Path:
    return folder / f"{TMP_PREFIX}shared-{token}"


def rank_name(rank: int) -> str:
    return f"rank{rank}"


def write_marker(folder: Path, token: str, name: str) -> None:
    """Create ``name``'s marker (the marker folder too: the first writer on a node makes it)."""
    markers = marker_folder(folder, token)
    markers.mkdir(parents=True, exist_ok=True)
    (markers / name).write_text(socket.gethostname() + "\n", encoding="utf-8")


def unseen_markers(folder: Path, token: str, world: int) -> list[str]:
    """The markers of the driver and of ranks ``0 .. world-1`` that this process does not see."""
    markers = marker_folder(folder, token)
    return [name for name in (DRIVER, *map(rank_name, range(world))) if not (markers / name).is_file()]


def shown(name: str) -> str:
    """A marker's writer as the error names it: ``the driver``, ``rank 1``."""
    return "the driver" if name == DRIVER else name.replace("rank", "rank ")


def check_shared_folder(call: Callable[..., list[dict[str, Any]]], folder: Path, world: int, key: str) -> None:
    """Fail with one ArcherError unless the driver and all ``world`` ranks see the same ``folder`` (``key``: the
    config key that names it). ``call(method, folder, token)`` runs the ranks' side on every rank and returns,
    per rank in rank order, ``{"host": ..., "unseen": [...]}`` (RankWorkers.check_shared_folder)."""
    token = uuid.uuid4().hex
    folder.mkdir(parents=True, exist_ok=True)
    write_marker(folder, token, DRIVER)
    try:
        reports = call("check_shared_folder", folder, token)
        missing = [(rank_name(rank), report["host"], report["unseen"]) for rank, report in enumerate(reports)
                   if report["unseen"]]
        driver_unseen = unseen_markers(folder, token, world)
        if driver_unseen:
            missing.append((DRIVER, socket.gethostname(), driver_unseen))
    finally:
        shutil.rmtree(marker_folder(folder, token), ignore_errors=True)
    if missing:
        # the driver commits every checkpoint: a rank that misses the driver's marker sees another folder there
        apart = [f"{shown(who)} (host {host})" for who, host, unseen in missing if DRIVER in unseen]
        if apart:
            what = f"{', '.join(apart)} {'does' if len(apart) == 1 else 'do'} not see the files the driver wrote there"
        else:
            who, host, unseen = missing[0]
            what = f"{shown(who)} (host {host}) does not see the files that {', '.join(map(shown, unseen))} wrote there"
        raise ArcherError(
            f"{key}={folder} is not one folder for the whole run: {what}; the ranks write each checkpoint into it "
            "together, the driver commits it, and on resume each rank reads every rank's shards",
            f"put {key} on storage that every node mounts at the same path (NFS, Lustre, a cloud file system), "
            "or train on one node (trainer.nnodes=1)")
