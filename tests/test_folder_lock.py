"""One writing process per output folder (archer/folder_lock.py), with real processes: a second `archer train` on a
held run folder is refused naming the holder's PID and changes nothing; a SIGKILLed holder leaves the folder free
(also while a child it forked lives on); `archer sft` and `archer eval` likewise; holds within one process count."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from archer import cli, folder_lock
from archer.errors import ArcherError
from archer.folder_lock import LOCK_FILE, hold_folder, refuse_if_held

ROOT = Path(__file__).resolve().parents[1]
# What the trainers call before they write (PPOTrainer, run_sft, EvalRun.run); with a child forked after it.
HOLDER = textwrap.dedent("""
    import os, sys, time
    from archer.folder_lock import hold_folder
    lock = hold_folder(sys.argv[1], sys.argv[2])
    child = os.fork() if sys.argv[3] == "fork" else 0
    if sys.argv[3] != "fork" or child:
        print("held", child, flush=True)
    time.sleep(600)
""")


@contextmanager
def holder(folder: Path, command: str = "archer train",
           fork: bool = False) -> Iterator[tuple[subprocess.Popen, int]]:
    """A process holding ``folder`` and the pid of a child it forked after taking it (0 without ``fork``); both
    SIGKILLed at the end."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), command, "fork" if fork else "-"],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        line = process.stdout.readline().split()
        assert line[0] == "held", line
        child = int(line[1])
        yield process, child
    finally:
        for pid in (process.pid, child):
            with suppress(ProcessLookupError):
                if pid:
                    os.kill(pid, signal.SIGKILL)
        process.wait()


def entries(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder`` with its bytes and modification time (folders by their mtime)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"dir", p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def try_hold(folder: Path) -> subprocess.CompletedProcess:
    """Another process asking for ``folder`` (and letting go at once)."""
    code = "import sys; from archer.folder_lock import hold_folder; hold_folder(sys.argv[1], 'archer train')"
    return subprocess.run([sys.executable, "-c", code, str(folder)], cwd=ROOT, capture_output=True, text=True)


def run_folder_with_a_run(folder: Path) -> None:
    (folder / "checkpoints" / "global_step_1").mkdir(parents=True)
    (folder / "checkpoints" / "global_step_1" / "COMPLETE").write_text('{"step": 1}\n')
    (folder / "checkpoints" / "latest").write_text("global_step_1\n")
    (folder / "config.yaml").write_text("trainer: {}\n")
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')


def test_a_second_archer_train_is_refused_naming_the_holder_and_a_killed_holder_frees_the_folder(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_folder_with_a_run(run)
    with holder(run) as (process, _):
        pid = process.pid
        before = entries(run)
        second = subprocess.run([sys.executable, "-m", "archer.cli", "train", f"trainer.default_local_dir={run}",
                                 "actor_rollout_ref.model.path=/nonexistent/model",
                                 "data.train_files=/nonexistent/train.parquet"],
                                cwd=ROOT, capture_output=True, text=True)
        assert second.returncode == 2, second.stderr
        assert second.stderr.startswith(f"archer: error: {run} is in use by another process (PID {pid}): ")
        assert "this archer train wrote nothing" in second.stderr and "trainer.default_local_dir=NEW_DIR" in second.stderr
        assert "Traceback" not in second.stderr
        assert entries(run) == before  # not a byte, nor a modification time, changed
        process.kill()  # SIGKILL: no clean-up runs, the kernel drops the lock with the process
        process.wait()
        with hold_folder(run, "archer train"):
            assert entries(run) == before
    assert try_hold(run).returncode == 0


def test_a_child_forked_by_the_holder_does_not_keep_the_folder_after_the_holder_is_killed(tmp_path: Path) -> None:
    with holder(tmp_path / "run", fork=True) as (process, child):
        refused = try_hold(tmp_path / "run")
        assert refused.returncode == 1 and f"(PID {process.pid})" in refused.stderr
        process.kill()
        process.wait()
        os.kill(child, 0)  # the child lives on, writing nothing: a rank or reward worker of the killed run
        assert try_hold(tmp_path / "run").returncode == 0


def test_holds_within_one_process_are_counted(tmp_path: Path) -> None:
    first = hold_folder(tmp_path / "run", "archer train")
    again = hold_folder(tmp_path / "run" / ".." / "run", "archer sft")  # the same folder by another path
    first.release()
    first.release()  # once per hold
    refused = try_hold(tmp_path / "run")
    assert refused.returncode == 1 and f"(PID {os.getpid()})" in refused.stderr
    again.release()
    assert try_hold(tmp_path / "run").returncode == 0
    assert (tmp_path / "run" / LOCK_FILE).read_bytes() == b""


def test_archer_sft_and_eval_refuse_a_held_folder(tmp_path: Path, tiny_model_dir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    sft_run, eval_out = tmp_path / "sft", tmp_path / "eval"
    (tmp_path / "sums.jsonl").write_text(json.dumps({"question": "3 + 3?", "answer": "6"}) + "\n")
    (tmp_path / "sums.yaml").write_text("file: sums.jsonl\ndata_source: archer/arithmetic\nprompt: '{question}'\n")
    for folder, command, args in [
            (sft_run, "archer sft", ["sft", f"model.partial_pretrain={tiny_model_dir}", f"data.train_files={tmp_path}"
                                     "/none.parquet", f"trainer.default_local_dir={sft_run}", "trainer.device=cpu"]),
            (eval_out, "archer eval", ["eval", f"model={tiny_model_dir}", f"benchmark=[{tmp_path / 'sums.yaml'}]",
                                       f"output_dir={eval_out}", "device=cpu"])]:
        with holder(folder, command) as (process, _):
            pid = process.pid
            before = entries(folder)
            capsys.readouterr()
            assert cli.main(args) == 2
            err = capsys.readouterr().err
            assert f"{folder} is in use by another process (PID {pid})" in err and f"this {command} wrote" in err
            assert entries(folder) == before



def test_a_file_system_without_locks_warns_and_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(folder_lock.fcntl, "lockf", no_locks)
    with hold_folder(tmp_path / "run", "archer train"):
        assert "its file system takes no locks" in caplog.text and str(tmp_path / "run") in caplog.text


def test_the_early_look_refuses_a_held_folder_and_writes_nothing(tmp_path: Path) -> None:
    """What a run calls before its read-only checks: no folder or lock file is made, a held folder is refused."""
    refuse_if_held(tmp_path / "new", "archer train")
    (tmp_path / "old").mkdir()
    refuse_if_held(tmp_path / "old", "archer sft")
    assert not (tmp_path / "new").exists() and list((tmp_path / "old").iterdir()) == []
    with holder(tmp_path / "old", "archer eval") as (process, _), pytest.raises(ArcherError) as info:
        refuse_if_held(tmp_path / "old", "archer eval")
    assert f"in use by another process (PID {process.pid})" in str(info.value) and "output_dir=NEW" in str(info.value)
    refuse_if_held(tmp_path / "old", "archer eval")  # the holder is gone
