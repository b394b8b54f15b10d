"""The Ray that `archer train` starts itself (no RAY_ADDRESS; archer/controller/ray_cluster.py), on two CPU ranks:

- while the run trains, every port its Ray processes listen on is on the loopback interface, and the dashboard
  process Ray keeps even with include_dashboard=False (a minimal head) listens on none: no dashboard answers;
- whatever ends the run, the process tree it started is gone afterwards (the GCS, the raylet, the agents, the
  rank workers): at its end (exit code 0), at an error (a reward function that raises), at Ctrl-C (SIGINT:
  130) and at SIGTERM (143, the shell's).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_async_training import overrides, task  # noqa: F401

pytestmark = pytest.mark.slow

WAIT_S = 240
FAILING_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("this reward function fails on purpose")
"""
SLOW_REWARD = """
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.5)
    return 0.0
"""
LOOPBACK = ("127.", "::1", "::ffff:127.")


def ray_processes(root: psutil.Process) -> list[psutil.Process]:
    """The processes under ``root`` (the run's Ray: the GCS, the raylet, agents and workers)."""
    try:
        return root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def running(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


def listening(procs: list[psutil.Process]) -> dict[int, list[str]]:
    pids = {p.pid for p in procs}
    found: dict[int, list[str]] = {pid: [] for pid in pids}
    for conn in psutil.net_connections("inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            found[conn.pid].append(f"{conn.laddr.ip}:{conn.laddr.port}")
    return found


def start(task: dict[str, Path], run_dir: Path, reward: str) -> subprocess.Popen:  # noqa: F811
    (run_dir.parent / "reward.py").write_text(reward)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # nothing written under ~/.ray
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "archer.cli", "train", *overrides(task, run_dir, 2),
               "trainer.n_gpus_per_node=2", f"custom_reward_function.path={run_dir.parent / 'reward.py'}"]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_ranks(proc: subprocess.Popen) -> list[psutil.Process]:
    """The run's process tree once both rank workers have started (then the step is under way)."""
    deadline = time.monotonic() + WAIT_S
    root = psutil.Process(proc.pid)
    while time.monotonic() < deadline and proc.poll() is None:
        tree = ray_processes(root)
        names = [" ".join(p.cmdline()) for p in running(tree)]
        if sum("_RankActor" in n for n in names) >= 2 and any("raylet" in n for n in names):
            time.sleep(3)
            return ray_processes(root)
        time.sleep(0.5)
    pytest.fail(f"the run's ranks did not start (exit {proc.poll()}): {proc.stderr.read()[-3000:] if proc.poll() else ''}")


def assert_nothing_left(tree: list[psutil.Process]) -> None:
    deadline = time.monotonic() + 30
    while running(tree) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = running(tree)
    for proc in left:  # the test stops what the run left before failing
        proc.kill()
    assert not left, [" ".join(p.cmdline())[:120] for p in left]


@pytest.mark.parametrize("ending", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_run_and_its_ray_which_listened_on_loopback_only(
        task: dict[str, Path], tmp_path: Path, ending: str) -> None:  # noqa: F811
    proc = start(task, tmp_path / "run", SLOW_REWARD)
    try:
        tree = wait_for_ranks(proc)
        ports = listening(tree)
        assert sum(map(len, ports.values())) >= 3  # the GCS, the raylet, the workers at least
        outside = {pid: addrs for pid, addrs in ports.items() if any(not a.startswith(LOOPBACK) for a in addrs)}
        assert not outside, outside
        dashboards = [p for p in running(tree) if any("dashboard/dashboard.py" in part for part in p.cmdline())]
        assert all(ports[p.pid] == [] for p in dashboards), {p.pid: ports[p.pid] for p in dashboards}
        proc.send_signal(getattr(signal, ending))
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_nothing_left(tree)
    assert proc.returncode == {"SIGTERM": 143, "SIGINT": 130}[ending], stderr[-3000:]


@pytest.mark.parametrize("ending", ["finished", "error"])
def test_the_run_stops_its_ray_when_it_ends_or_fails(task: dict[str, Path], tmp_path: Path,  # noqa: F811
                                                     ending: str) -> None:
    proc = start(task, tmp_path / "run", SLOW_REWARD if ending == "finished" else FAILING_REWARD)
    try:
        tree = wait_for_ranks(proc)
        _, stderr = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    if ending == "finished":
        assert proc.returncode == 0, stderr[-3000:]
        assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2
    else:
        assert proc.returncode != 0 and "this reward function fails on purpose" in stderr, stderr[-3000:]
    assert_nothing_left(tree)
