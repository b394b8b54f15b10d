"""Crash-safe checkpoint directories, the `latest` pointer, RNG state capture and torch state files.

Layout under `<run>/checkpoints`:
    global_step_N/        one complete checkpoint; holds a `COMPLETE` marker written last
    latest                text file with the name of the newest committed step directory
    .tmp-*                work in progress (or debris of a crash); never read as a checkpoint

A checkpoint is written into a `.tmp-` directory, marked complete, fsync'd and then renamed into place,
so a run killed at any moment leaves either the old or the new checkpoint, never a half-written one.
The manager assumes a single writer: `latest_step` and `save` clean up `.tmp-` debris, so do not call
them from a second process while the trainer may be saving.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from archer.atomic_files import TMP_PREFIX, fsync_dir, make_staging_dir, write_text_atomically
from archer.errors import ArcherError
from archer.units import GIB, MIB

COMPLETE_MARKER = "COMPLETE"
LATEST_POINTER = "latest"
_OLD_PREFIX = ".tmp-old-"
_STEP_DIR = re.compile(r"global_step_(\d+)")
NEARLY_FULL = MIB  # a save that fails with less free than this on its disk failed for want of space


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root` to disk, so a rename cannot outlive the data."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _write_marker(directory: Path, step: int) -> None:
    """Write the COMPLETE marker last and durably: its presence means everything else is on disk."""
    with (directory / COMPLETE_MARKER).open("w", encoding="utf-8") as f:
        f.write(json.dumps({"step": step}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(directory)


def _marker_step(directory: Path) -> int | None:
    """The step recorded in a directory's COMPLETE marker, or None when the marker is missing or torn."""
    try:
        record = json.loads((directory / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` is a full disk or quota (ENOSPC, EDQUOT), also wrapped: chained, a Ray task's cause, a
    distributed checkpoint's per-rank failures, or only the message of a wrapper that kept the text."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        pending += [current.__cause__, current.__context__, getattr(current, "cause", None)]
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            pending += [f for f in failures.values() if isinstance(f, BaseException)]
    return any(os.strerror(code) in str(error) for code in (errno.ENOSPC, errno.EDQUOT))


def _no_room_left(folder: Path) -> bool:
    """The disk is full (less than NEARLY_FULL free): what a writer that drops the OS's error code left behind
    (torch.save to a path fails with a C++ stream error, not ENOSPC)."""
    try:
        return shutil.disk_usage(folder).free < NEARLY_FULL
    except OSError:
        return False


def _tree_size(root: Path) -> int:
    """Bytes of the files under ``root`` (0 when it is gone)."""
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class CheckpointManager:
    """Saves, finds and prunes `global_step_N` checkpoint directories under `root`."""

    def __init__(self, root: Path, max_to_keep: int | None = None) -> None:
        self.root = Path(root)
        self.max_to_keep = max_to_keep if max_to_keep is not None and max_to_keep > 0 else None

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    def is_complete(self, step: int) -> bool:
        return (self.step_dir(step) / COMPLETE_MARKER).is_file()

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint directory, ascending."""
        if not self.root.is_dir():
            return []
        steps = []
        for entry in self.root.iterdir():
            match = _STEP_DIR.fullmatch(entry.name)
            if match and (entry / COMPLETE_MARKER).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Write checkpoint `step` with `write(directory)`, commit it atomically, point `latest` at it, prune.

        A previous checkpoint of the same step is replaced; the one just written is never pruned.
        """
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        self.root.mkdir(parents=True, exist_ok=True)
        self._recover_leftovers()
        tmp: Path | None = None
        try:
            tmp = make_staging_dir(self.step_dir(step))
            write(tmp)
            _fsync_tree(tmp)
            _write_marker(tmp, step)
            self._commit(tmp, step)
        except BaseException as error:
            written = _tree_size(tmp) if tmp is not None else 0
            full = isinstance(error, Exception) and (disk_full(error) or _no_room_left(self.root))
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if full:
                raise self._disk_full_error(step, written) from error
            raise
        try:
            write_text_atomically(self.root / LATEST_POINTER, self.step_dir(step).name + "\n")
        except OSError as error:
            if not disk_full(error):
                raise
            # no room for the pointer: without one the newest complete checkpoint (this one) is the latest
            (self.root / LATEST_POINTER).unlink(missing_ok=True)
            raise self._disk_full_error(step, 0, committed=True) from error
        self._prune(keep=step)
        return self.step_dir(step)

    def _disk_full_error(self, step: int, written: int, committed: bool = False) -> ArcherError:
        """The one error of a save the disk had no room for: the folder, the space a checkpoint takes (the newest
        complete one's size, else at least what this one had written) and the space free now."""
        complete = self.complete_steps()
        last = complete[-1] if complete else None
        if last is not None:
            needed = _tree_size(self.step_dir(last))
            basis = f"{_size(needed)} (the size of global_step_{last})"
        else:
            needed, basis = written, f"at least {_size(written)} (what it had written when the disk filled)"
        if committed:
            state = f"checkpoint step {step} is complete (the latest pointer had no room and was removed)"
        elif last is None:
            state = "there is no complete checkpoint yet, and the partial one was removed"
        else:
            state = f"the last complete checkpoint, global_step_{last}, is kept and the partial one was removed"
        resume = f"trainer.resume_mode=auto continues from step {last}" if last is not None else "it starts again"
        return ArcherError(
            f"no space left on the disk of {self.root} while saving checkpoint step {step}: a checkpoint of this "
            f"run needs {basis}; {_size(shutil.disk_usage(self.root).free)} is free now; {state}",
            f"make room so that more than {_size(needed)} is free there (or point trainer.default_local_dir at a "
            f"larger disk), then rerun the same command: {resume}")

    def _commit(self, tmp: Path, step: int) -> None:
        """Rename `tmp` to the step directory; an existing one is moved aside first, then deleted."""
        final = self.step_dir(step)
        old = self.root / f"{_OLD_PREFIX}{final.name}-{uuid.uuid4().hex}"
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(self.root)
        shutil.rmtree(old, ignore_errors=True)

    def _prune(self, keep: int) -> None:
        """Delete the oldest complete checkpoints past max_to_keep; never ``keep`` (the one just committed) nor a
        folder without its COMPLETE marker (a save in progress). Each loses its marker first and is renamed to
        ``.tmp-`` debris before it is deleted, so a clean-up cut short never leaves a half that reads as complete."""
        if self.max_to_keep is None:
            return
        others = [s for s in reversed(self.complete_steps()) if s != keep]
        for step in others[self.max_to_keep - 1 :]:
            directory = self.step_dir(step)
            if directory.is_symlink():  # a checkpoint kept elsewhere: only the link is the run's
                directory.unlink()
                continue
            (directory / COMPLETE_MARKER).unlink()
            fsync_dir(directory)
            doomed = self.root / f"{TMP_PREFIX}pruned-{directory.name}-{uuid.uuid4().hex}"
            os.replace(directory, doomed)
            shutil.rmtree(doomed)

    def _recover_leftovers(self) -> None:
        """Clean up `.tmp-` debris of an interrupted save.

        A complete checkpoint stranded in a temp directory (the run died between moving an older copy of
        its step aside and renaming the new one into place) is moved back to its step directory; the new
        copy is preferred over the older one. Everything else is deleted.
        """
        if not self.root.is_dir():
            return
        leftovers = [e for e in self.root.iterdir() if e.name.startswith(TMP_PREFIX)]
        for entry in sorted(leftovers, key=lambda e: e.name.startswith(_OLD_PREFIX)):
            step = _marker_step(entry) if entry.is_dir() and not entry.is_symlink() else None
            if step is not None and not self.step_dir(step).exists():
                os.replace(entry, self.step_dir(step))
            else:
                _remove(entry)

    def latest_step(self) -> int | None:
        """The newest usable checkpoint step, or None when there is none.

        The step named by `latest` when that directory is complete; otherwise (pointer missing, corrupt,
        or naming an incomplete or deleted directory) the highest complete `global_step_N`.
        """
        self._recover_leftovers()
        pointer = self.root / LATEST_POINTER
        if pointer.is_file():
            match = _STEP_DIR.fullmatch(pointer.read_text(encoding="utf-8", errors="replace").strip())
            if match and self.is_complete(int(match.group(1))):
                return int(match.group(1))
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def load_dir(self, step: int) -> Path:
        """The directory of complete checkpoint `step`; ArcherError when it is missing or incomplete."""
        if not self.is_complete(step):
            available = ", ".join(str(s) for s in self.complete_steps()) or "none"
            raise ArcherError(
                f"no complete checkpoint for step {step} in {self.root} (complete steps: {available})",
                "resume from one of the complete steps, or start a fresh run (trainer.resume_mode=disable)",
            )
        return self.step_dir(step)


def capture_rng_state() -> dict[str, Any]:
    """Generator states of python `random`, numpy's global generator, torch CPU and every CUDA device.

    Everything is stored as tensors and plain Python values, so the dict loads with weights_only=True.
    """
    _, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators captured by `capture_rng_state` (CUDA states only for devices present)."""
    random.setstate(state["python"])
    np_state = state["numpy"]
    key = np_state["key"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", key, np_state["pos"], np_state["has_gauss"], np_state["gauss"]))
    torch.set_rng_state(state["torch"])
    if "torch_cuda" in state and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["torch_cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def save_torch_state(path: Path, obj: Any) -> None:
    """torch.save `obj` (tensors, containers and plain values, so it loads with weights_only=True), through a Python
    file so that a full disk is an OSError with its code (torch's own writer of a path loses it)."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def load_torch_state(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """Load a file written by `save_torch_state`.

    weights_only=True: archer writes only tensors, containers and plain values (RNG states included), so
    loading never has to unpickle arbitrary objects, even from a checkpoint someone else handed you.
    """
    return torch.load(path, map_location=map_location, weights_only=True)
