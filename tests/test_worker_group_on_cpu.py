"""Worker groups on a 2-rank local Ray cluster (2 cores, gloo), with toy workers: environment, collection,
a real process group, failures, and the in-process group for world 1."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from archer.batch import Batch
from archer.controller.factory import build_worker_group
from archer.controller.ray_cluster import check_ray_address
from archer.controller.ray_group import (
    RankPlace,
    placement_line,
    rank_layout,
    raylet_answers,
    visible_devices,
)
from archer.controller.worker_group import LocalWorkerGroup, WorkerGroup
from archer.errors import ArcherError
from archer.workers.dispatch import (
    FIRST_ROW,
    Seat,
    collect,
    collector_of,
    concat_batches,
    own_rows,
    rank_zero,
)

ray = pytest.importorskip("ray")

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class ToyWorker:
    """Knows its rank from the environment the group sets, like the real workers."""

    def __init__(self, scale: int) -> None:
        self.scale = scale
        self.rank = int(os.environ.get("RANK", "0"))
        self.ctx = Seat(self.rank, int(os.environ.get("WORLD_SIZE", "1")))

    @collect(list)
    def environment(self) -> dict[str, str | None]:
        return {k: os.environ.get(k) for k in ENV_KEYS} | {"pid": str(os.getpid())}

    @collect(rank_zero)
    def rank_times_scale(self) -> int:
        return self.rank * self.scale + 1

    @collect(concat_batches, split=own_rows)
    def scaled_rows(self, part: Batch, *, offset: int = 0) -> Batch:
        return Batch({"x": part["x"] * self.scale + offset, "rank": torch.full((len(part),), self.rank)},
                     {"uid": part.rows["uid"]}, {"rows_seen": len(part), "first_row": part.info.get(FIRST_ROW, 0)})

    @collect(list)
    def all_reduce(self, value: float) -> float:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
        t = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(t)
        return float(t.item())

    @collect(rank_zero)
    def die_in_collective(self, rank: int) -> float:
        """``rank`` kills its own process; the others enter an all_reduce it never joins."""
        if self.rank == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return self._reduce_once()

    def _reduce_once(self) -> float:
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t.item())

    @collect(rank_zero)
    def refuse_on(self, rank: int) -> str:
        if self.rank == rank:
            raise ArcherError("the toy value is out of range", "use a smaller toy value")
        return "ok"

    @collect(rank_zero)
    def sleep_on(self, rank: int, seconds: float) -> str:
        if self.rank == rank:
            time.sleep(seconds)
        return "done"

    @collect(rank_zero)
    def shout(self, text: str) -> None:
        # distinct words per rank: Ray folds lines that differ only in numbers into "[repeated 2x]"
        print(f"{text} {('zero', 'one')[self.rank]}", flush=True)

    def undeclared(self) -> int:
        return self.rank


# -- pure helpers --------------------------------------------------------------------------------------
def test_collect_is_declared_on_the_method() -> None:
    assert collector_of(ToyWorker, "scaled_rows") is concat_batches
    assert collector_of(ToyWorker, "rank_times_scale") is rank_zero
    with pytest.raises(TypeError, match=r"ToyWorker.undeclared declares no collector"):
        collector_of(ToyWorker, "undeclared")
    with pytest.raises(AttributeError, match="no method 'missing'"):
        collector_of(ToyWorker, "missing")


def test_rank_layout_orders_nodes_by_address_and_shares_the_node_gpus() -> None:
    # bundles 0 and 2 landed on node b (10.0.0.2), 1 and 3 on node a (10.0.0.1)
    layout = rank_layout({0: "b", 1: "a", 2: "b", 3: "a"}, {"a": "10.0.0.1", "b": "10.0.0.2"})
    assert layout == [RankPlace(1, "a", 0, 2), RankPlace(3, "a", 1, 2), RankPlace(0, "b", 0, 2), RankPlace(2, "b", 1, 2)]
    # Ray gave each rank one GPU id; each rank sees its node's GPUs with its own at index LOCAL_RANK
    assert visible_devices(layout, [["3"], ["1"], ["0"], ["5"]]) == ["3,1", "3,1", "0,5", "0,5"]


def test_the_placement_line_names_each_nodes_ranks() -> None:
    layout = rank_layout({0: "b", 1: "a", 2: "b", 3: "a"}, {"a": "10.0.0.1", "b": "10.0.0.2"})
    assert placement_line(layout, {"a": "10.0.0.1", "b": "10.0.0.2"}) == (
        "4 ranks on 2 node(s): ranks 0, 1 on node a (10.0.0.1); ranks 2, 3 on node b (10.0.0.2)")
    assert placement_line(layout[:1], {}) == "1 ranks on 1 node(s): rank 0 on node a (?)"


def test_a_raylet_that_refuses_connections_does_not_answer() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert raylet_answers("127.0.0.1", port)
    start = time.monotonic()
    assert not raylet_answers("127.0.0.1", port)  # closed: refused at once
    assert time.monotonic() - start < 1


def test_an_unreachable_ray_address_fails_at_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    start = time.monotonic()
    with pytest.raises(ArcherError, match=rf"no Ray cluster answers at RAY_ADDRESS=127.0.0.1:{port}") as err:
        check_ray_address(f"127.0.0.1:{port}")
    assert time.monotonic() - start < 6 and "ray start --head --port=6379" in err.value.fix
    with pytest.raises(ArcherError, match="is not host:port"):
        check_ray_address("my-head-node")
    check_ray_address("auto")  # left to Ray: a cluster `ray start` began on this machine


# -- world 1: in process, no Ray ------------------------------------------------------------------------
def test_local_group_calls_the_worker_directly() -> None:
    group = build_worker_group(ToyWorker, {"scale": 10}, nnodes=1, n_gpus_per_node=1)
    assert isinstance(group, LocalWorkerGroup) and group.world_size == 1
    batch = Batch({"x": torch.arange(7)}, {"uid": [f"u{i}" for i in range(7)]})
    out = group.call("scaled_rows", batch, offset=1)
    assert out["x"].tolist() == [10 * i + 1 for i in range(7)] and out.info == {"rows_seen": 7, "first_row": 0}
    assert group.call("rank_times_scale") == 1
    with pytest.raises(TypeError, match="declares no collector"):
        group.call("undeclared")
    with group:
        pass
    with pytest.raises(RuntimeError, match="shut down"):
        group.call("rank_times_scale")


def test_bad_world_sizes_name_the_keys() -> None:
    with pytest.raises(ArcherError, match=r"trainer.n_gpus_per_node must be a whole number >= 1, got 0"):
        build_worker_group(ToyWorker, {"scale": 1}, nnodes=1, n_gpus_per_node=0)


def test_world_one_never_imports_ray() -> None:
    code = ("import sys; from archer.controller.factory import build_worker_group\n"
            "from archer.workers.dispatch import collect, rank_zero\n"
            "class W:\n    @collect(rank_zero)\n    def f(self, a): return a + 1\n"
            "import archer.cli, archer.trainer.ppo\n"
            "g = build_worker_group(W, {}, nnodes=1, n_gpus_per_node=1)\n"
            "assert g.call('f', 1) == 2\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_missing_ray_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ArcherError) as err:
        build_worker_group(ToyWorker, {"scale": 1}, nnodes=1, n_gpus_per_node=2, device_kind="cpu")
    assert "runs on Ray, which is not installed" in err.value.problem
    assert 'pip install "archer[ray]"' in err.value.fix


# -- world 2 on a local Ray cluster ---------------------------------------------------------------------
def test_a_group_starts_its_own_ray_and_stops_it() -> None:
    """Without RAY_ADDRESS the group starts a local Ray (one logical CPU per rank at least) and stops it on
    shutdown; ``device_kind="auto"`` picks CPU on a cluster without GPUs. In a fresh process (before the
    shared session below starts)."""
    code = ("import ray\nfrom archer.controller.factory import build_worker_group\n"
            "from test_worker_group_on_cpu import ToyWorker\n"
            "g = build_worker_group(ToyWorker, {'scale': 2}, nnodes=1, n_gpus_per_node=2)\n"
            "print(g.device_kind, ray.cluster_resources()['CPU'] >= 2, g.call('rank_times_scale'),"
            " [e['RANK'] for e in g.call('environment')])\n"
            "g.shutdown()\nprint(ray.is_initialized())")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-3:] == ["cpu True 1 ['0', '1']", "False", ""], out.stdout


def test_a_local_ray_is_new_even_beside_a_cluster_ray_start_left() -> None:
    """`ray start --head` records its cluster in Ray's temp folder, and ray.init() without an address joins it
    (then refuses the run's num_cpus): archer's own Ray is a new instance (address "local") unless RAY_ADDRESS
    names a cluster. The head here has 1 CPU; the run's instance has at least 3."""
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="archer-rs-", dir="/tmp"))  # short: Ray's socket paths are <= 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(tmp), RAY_USAGE_STATS_ENABLED="0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head = subprocess.Popen(["ray", "start", "--head", "--block", "--num-cpus=1", f"--port={port}",
                             "--node-ip-address=127.0.0.1", "--include-dashboard=false", f"--temp-dir={tmp}/ray"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (tmp / "ray" / "ray_current_cluster").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (tmp / "ray" / "ray_current_cluster").exists(), "ray start wrote no ray_current_cluster"
        code = ("import ray\nfrom archer.controller.ray_cluster import connect_ray\n"
                "print(connect_ray(3), ray.cluster_resources()['CPU'])\nray.shutdown()")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        started, cpus = out.stdout.split()[-2:]
        assert started == "True" and float(cpus) >= 3, out.stdout
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
        subprocess.run(["rm", "-rf", str(tmp)], check=False)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """One local Ray instance for the file (starting one takes seconds): room for two 2-rank groups; the
    toy workers import from tests/ through the PYTHONPATH the group passes to its ranks."""
    from archer.controller.ray_cluster import connect_ray

    tests_dir = str(Path(__file__).resolve().parent)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_ADDRESS", raising=False)
        mp.setenv("PYTHONPATH", os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
        assert connect_ray(4, object_store_memory=int(1e9)) is True
        yield
        ray.shutdown()


@pytest.fixture(scope="module")
def pair(ray_cluster: None) -> Iterator[WorkerGroup]:
    group = build_worker_group(ToyWorker, {"scale": 10}, nnodes=1, n_gpus_per_node=2, device_kind="cpu")
    yield group
    group.shutdown()


def test_each_rank_sees_its_environment(pair: WorkerGroup) -> None:
    assert pair.world_size == 2
    envs = pair.call("environment")
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] == ray.util.get_node_ip_address()
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and int(envs[0]["MASTER_PORT"]) > 0
    assert len({e["pid"] for e in envs} | {str(os.getpid())}) == 3  # two processes, neither the driver


def test_rank_zero_and_uneven_concat(pair: WorkerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    assert pair.call("rank_times_scale") == 1  # rank 0's 0 * 10 + 1, not rank 1's 11
    batch = Batch({"x": torch.arange(7)}, {"uid": [f"u{i}" for i in range(7)]}, {"step": 3})
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(value) or real_put(value, **kw))
    out = pair.call("scaled_rows", batch, offset=2)
    assert len(puts) == 1 and puts[0][0][0] is batch  # one object-store copy for both ranks
    assert out["x"].tolist() == [10 * i + 2 for i in range(7)]
    assert out["rank"].tolist() == [0, 0, 0, 0, 1, 1, 1]  # 7 rows on 2 ranks: 4 + 3
    assert out.rows["uid"].tolist() == [f"u{i}" for i in range(7)]
    assert out.info == {"rows_seen": 4, "first_row": 0}  # rank 0's info: the split was made on the rank


def test_ranks_form_a_gloo_process_group(pair: WorkerGroup) -> None:
    assert pair.call("all_reduce", 1.5) == [1.5 * 1 + 1.5 * 2] * 2


def test_worker_output_reaches_the_driver_with_the_rank(pair: WorkerGroup,
                                                          capfd: pytest.CaptureFixture[str]) -> None:
    pair.call("shout", "hello from toy rank")
    seen = ""
    deadline = time.monotonic() + 15
    lines = {0: "(rank 0 pid=", 1: "(rank 1 pid="}
    words = {0: "hello from toy rank zero", 1: "hello from toy rank one"}

    def shown(r: int) -> bool:
        return any(lines[r] in line and words[r] in line for line in seen.splitlines())

    while time.monotonic() < deadline and not (shown(0) and shown(1)):
        time.sleep(0.2)
        seen += capfd.readouterr().out
    assert shown(0) and shown(1), seen


def test_undeclared_methods_are_refused(pair: WorkerGroup) -> None:
    with pytest.raises(TypeError, match="declares no collector"):
        pair.call("undeclared")


def test_unplaceable_group_fails_in_time_with_resources(ray_cluster: None,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    with pytest.raises(ArcherError) as err:
        build_worker_group(ToyWorker, {"scale": 1}, nnodes=1, n_gpus_per_node=2, device_kind="cuda",
                           placement_timeout_s=5.5)
    assert 5 <= time.monotonic() - start < 20  # Ray waits whole seconds
    assert "archer: waiting up to 0.5 s more for Ray to place 2 x {'CPU': 1, 'GPU': 1} (STRICT_PACK)" in \
        capfd.readouterr().err
    assert "they ask {'CPU': 2, 'GPU': 2}" in err.value.problem and "'GPU': 0" in err.value.problem
    assert "trainer.n_gpus_per_node" in err.value.fix
    assert ray.is_initialized()  # the group did not start Ray, so it leaves it running


def test_a_rank_killed_mid_call_names_the_rank_and_resume(ray_cluster: None) -> None:
    group = build_worker_group(ToyWorker, {"scale": 1}, nnodes=1, n_gpus_per_node=2, device_kind="cpu")
    assert group.call("all_reduce", 1.0) == [3.0, 3.0]
    pid = group.call("environment")[1]["pid"]
    pg = group._pg
    start = time.monotonic()
    with pytest.raises(ArcherError) as err:
        group.call("die_in_collective", 1)  # rank 0 waits in all_reduce for rank 1, which is gone
    assert time.monotonic() - start < 30
    node_id = group.layout[1].node_id
    assert re.search(rf"rank 1 of 2 on node {node_id} \(\S+\) died during die_in_collective: its process {pid} on ",
                     err.value.problem), err.value.problem
    assert "trainer.resume_mode=auto" in err.value.fix
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"  # the group was shut down
    with pytest.raises(ArcherError, match="the worker group was shut down"):
        group.call("rank_times_scale")
    assert ray.is_initialized()


def test_a_rank_error_comes_back_as_one_archer_error(ray_cluster: None) -> None:
    group = build_worker_group(ToyWorker, {"scale": 1}, nnodes=1, n_gpus_per_node=2, device_kind="cpu")
    with pytest.raises(ArcherError) as err:
        group.call("refuse_on", 1)
    assert err.value.problem == "rank 1, refuse_on: the toy value is out of range"
    assert err.value.fix == "use a smaller toy value"


def test_a_call_past_its_timeout_names_the_stuck_rank(ray_cluster: None) -> None:
    group = build_worker_group(ToyWorker, {"scale": 1}, nnodes=1, n_gpus_per_node=2, device_kind="cpu",
                               call_timeout_s=2)
    assert group.call("sleep_on", 1, 0.1) == "done"
    start = time.monotonic()
    with pytest.raises(ArcherError) as err:
        group.call("sleep_on", 1, 60)
    assert time.monotonic() - start < 10
    assert err.value.problem == "sleep_on did not finish within 2 s on rank(s) [1] of 2"
    assert "trainer.resume_mode=auto" in err.value.fix


def test_a_worker_module_the_ranks_cannot_import_is_named(ray_cluster: None, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "driver_only_worker.py").write_text("class Far:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # importable here, not on the ranks' PYTHONPATH
    from driver_only_worker import Far

    with pytest.raises(ArcherError) as err:
        build_worker_group(Far, {}, nnodes=1, n_gpus_per_node=2, device_kind="cpu")
    assert "of 2 cannot import module 'driver_only_worker' (Far.__init__)" in err.value.problem
    assert "PYTHONPATH" in err.value.fix


def test_calls_side_by_side_on_two_groups_fail_at_the_first_failing_rank(ray_cluster: None) -> None:
    """separate_async's weight sync waits on both groups at once: a rollout rank that fails does not leave the
    driver waiting for the trainer's rank, blocked in a collective the failed rank never finishes."""
    from archer.controller.ray_group import RayWorkerGroup, wait_all

    sender, receiver = (RayWorkerGroup(ToyWorker, {"scale": 1}, nnodes=1, n_gpus_per_node=1, device_kind="cpu")
                        for _ in range(2))
    try:
        assert wait_all([sender.submit("rank_times_scale"), receiver.submit("sleep_on", 0, 0.1)]) == [1, "done"]
        start = time.monotonic()
        with pytest.raises(ArcherError) as err:
            wait_all([sender.submit("sleep_on", 0, 60), receiver.submit("refuse_on", 0)])
        assert time.monotonic() - start < 10
        assert err.value.problem == "rank 0, refuse_on: the toy value is out of range"
    finally:
        sender.shutdown()
        receiver.shutdown()
