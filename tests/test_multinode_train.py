"""`archer train` on a Ray cluster of three nodes on this one machine (ray.cluster_utils.Cluster: a head of 2 CPUs and
two nodes of 1 CPU, each node with a custom resource of its own, its own raylet and object store), the ranks CPU
processes (gloo). tests/test_multinode.py has the placement and rendezvous of bare ranks on a SLURM-script cluster;
here whole runs train on it.

- `trainer.nnodes=2 trainer.n_gpus_per_node=1` puts one rank on each of two nodes, and the driver says so; their
  process group meets over TCP at rank 0's node address (MASTER_ADDR/MASTER_PORT, no file); every logged number of
  three steps equals the 2-rank run on one node (`trainer.n_gpus_per_node=2`, on the head), bit for bit, and so do
  the trained weights. Each checkpoint holds both ranks' DCP shards in its one folder: the run folder must be
  storage every node shares, which the run checks at start (tests/test_shared_folder.py has the failing check).
- `trainer.nnodes=3` puts one rank on each node and trains what 2 ranks train (within float-sum order).
- A node lost mid-step (its raylet killed) stops the driver within 120 s with one error naming the rank and the
  node's id; the checkpoints are intact (written into a temporary folder, committed by a rename); the run resumes
  from the last one on one rank (in the driver's process), then on 2 ranks on the two nodes left, and logs what
  the uninterrupted run logged.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_scale_out_on_cpu import (
    DIGIT_REWARD,
    TIME_BASED,
    assert_close_metrics,
    command,
    environment,
    metrics,
)
from train_support import task_model

from archer.data.tasks import write_task_files
from archer.trace.format import TraceReader

pytestmark = pytest.mark.slow

STEPS = 3  # test_scale_out_on_cpu.command's trainer.total_training_steps
WAIT_S = 420
LOST_BOUND_S = 120.0
PLACED = re.compile(r"archer: (\d+) ranks on (\d+) node\(s\): (.*); the process group meets at rank 0's node, "
                    r"(\S+):(\d+)")


class OneMachineCluster:
    """A head (2 CPUs, resource node_head) and two nodes (1 CPU each, node_w1 / node_w2) of one Ray cluster."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        # a short folder: Ray's sockets live under it, and a socket path is at most 107 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="archer-mt-", dir="/tmp")
        self.cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args={
            "num_cpus": 2, "resources": {"node_head": 1}, "temp_dir": self.temp_dir, "include_dashboard": False})
        self.workers = [self.cluster.add_node(num_cpus=1, resources={f"node_w{i}": 1}) for i in (1, 2)]
        self.names = {self.cluster.head_node.node_id: "node_head",
                      **{w.node_id: f"node_w{i}" for i, w in enumerate(self.workers, 1)}}

    def env(self, reward_delay_s: float = 0.0) -> dict[str, str]:
        return {**environment(reward_delay_s), "RAY_ADDRESS": self.cluster.address, "RAY_USAGE_STATS_ENABLED": "0"}

    def kill_raylet(self, node_id: str) -> None:
        """SIGKILL the raylet of worker node ``node_id`` (its other processes are left to the cluster's shutdown)."""
        node = next(w for w in self.workers if w.node_id == node_id)
        node.kill_raylet()

    def shutdown(self) -> None:
        self.cluster.shutdown()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def placements(stderr: str) -> list[dict]:
    """Every worker group's placement line: ranks, nodes, each rank's node id and address, the master address."""
    found = []
    for match in PLACED.finditer(stderr):
        ranks: dict[int, tuple[str, str]] = {}
        for clause in match.group(3).split("; "):
            head, node, address = re.fullmatch(r"ranks? ([\d, ]+) on node (\w+) \((\S+)\)", clause).groups()
            ranks.update({int(r): (node, address) for r in head.split(", ")})
        found.append({"world": int(match.group(1)), "nodes": int(match.group(2)), "ranks": ranks,
                      "master": match.group(4)})
    return found


@pytest.fixture(scope="module")
def cluster() -> Iterator[OneMachineCluster]:
    cluster = OneMachineCluster()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multinode_train")
    files = write_task_files("arithmetic", root / "data", n_train=64, n_val=16, n_sft=64, seed=0, max_operand=9)
    reward = root / "digit_reward.py"
    reward.write_text(DIGIT_REWARD)
    return {**files, "reward": reward, "model": task_model(root / "model", files["sft"], max_positions=512)}


def train_on(cluster: OneMachineCluster, task: dict[str, Path], run_dir: Path, nnodes: int, per_node: int,
             *extra: str) -> str:
    """One `archer train` on the cluster; returns its stderr."""
    proc = subprocess.run(command(task, run_dir, per_node, f"trainer.nnodes={nnodes}", *extra), env=cluster.env(),
                          capture_output=True, text=True, timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.fixture(scope="module")
def two_nodes(cluster: OneMachineCluster, task: dict[str, Path],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("two_nodes") / "run"
    return run_dir, train_on(cluster, task, run_dir, 2, 1)


def hf_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"global_step_{step}" / "actor" / "model.safetensors"))


@pytest.mark.timeout(1200)
def test_two_nodes_train_what_two_ranks_of_one_node_train(cluster: OneMachineCluster, task: dict[str, Path],
                                                          two_nodes: tuple[Path, str], tmp_path: Path) -> None:
    spread_dir, spread_log = two_nodes
    packed_dir = tmp_path / "one_node"
    packed_log = train_on(cluster, task, packed_dir, 1, 2)

    (spread,), (packed,) = placements(spread_log), placements(packed_log)
    assert spread["world"] == 2 and spread["nodes"] == 2
    spread_nodes = [spread["ranks"][r][0] for r in (0, 1)]
    assert len(set(spread_nodes)) == 2 and set(spread_nodes) <= set(cluster.names)
    # the rendezvous: rank 0's node address, a TCP port there (MASTER_ADDR/MASTER_PORT, env://)
    assert spread["master"] == spread["ranks"][0][1]
    assert packed["nodes"] == 1 and {n for n, _ in packed["ranks"].values()} == {cluster.cluster.head_node.node_id}

    want, got = metrics(packed_dir), metrics(spread_dir)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert want[1]["actor/grad_norm"] > 0.1 and want[1]["actor/kl_loss"] > 0  # the policy moves
    for step in want:
        numbers = {k: v for k, v in want[step].items() if not k.startswith(TIME_BASED)}
        assert {k: got[step][k] for k in numbers} == numbers, f"step {step}"
    single, spread_weights = hf_weights(packed_dir, STEPS), hf_weights(spread_dir, STEPS)
    assert single.keys() == spread_weights.keys()
    assert all(torch.equal(spread_weights[name], single[name]) for name in single)

    checkpoints = spread_dir / "checkpoints"
    dcp = checkpoints / f"global_step_{STEPS}" / "actor" / "dcp"
    assert {p.name for p in dcp.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".tmp-")]  # the shared-folder markers


@pytest.mark.timeout(900)
def test_three_nodes_take_one_rank_each_and_train_what_two_ranks_train(
        cluster: OneMachineCluster, task: dict[str, Path], two_nodes: tuple[Path, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    log = train_on(cluster, task, run_dir, 3, 1, "trainer.total_training_steps=2")
    (placed,) = placements(log)
    assert placed["world"] == 3 and placed["nodes"] == 3
    assert {placed["ranks"][r][0] for r in range(3)} == set(cluster.names)  # every node holds one rank
    want, got = metrics(two_nodes[0]), metrics(run_dir)
    assert sorted(got) == [1, 2]
    for step in got:
        assert_close_metrics(got[step], want[step], step)
    dcp = run_dir / "checkpoints" / "global_step_2" / "actor" / "dcp"
    assert {p.name for p in dcp.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}


def wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + WAIT_S
    while not (latest.is_file() and latest.read_text().strip() == f"global_step_{step}"):
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before checkpoint {step}"
        assert time.monotonic() < deadline, f"no checkpoint {step} within {WAIT_S}s"
        time.sleep(0.01)


@pytest.mark.timeout(1500)
def test_a_lost_node_stops_the_run_and_it_resumes_on_one_rank_then_on_two(
        cluster: OneMachineCluster, task: dict[str, Path], two_nodes: tuple[Path, str], tmp_path: Path) -> None:
    run_dir, log_path = tmp_path / "run", tmp_path / "lost.log"
    with log_path.open("w") as log:
        # a slow reward (0.2 s a response, 3.6 s a step) so that the kill lands inside step 2
        proc = subprocess.Popen(command(task, run_dir, 1, "trainer.nnodes=2"), env=cluster.env(reward_delay_s=0.2),
                                stdout=log, stderr=log, text=True)
        try:
            wait_for_checkpoint(proc, run_dir, 1)
            (placed,) = placements(log_path.read_text())
            head = cluster.cluster.head_node.node_id
            rank, node = next((r, n) for r, (n, _) in sorted(placed["ranks"].items(), reverse=True) if n != head)
            cluster.kill_raylet(node)
            killed = time.monotonic()
            proc.wait(timeout=LOST_BOUND_S)
            stopped_s = time.monotonic() - killed
        finally:
            if proc.poll() is None:
                proc.kill()
    stderr = log_path.read_text()
    assert proc.returncode != 0 and stopped_s < LOST_BOUND_S
    errors = [line for line in stderr.splitlines() if line.startswith("archer: error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert f"rank {rank} of 2 lost its node {node} (" in errors[0], errors[0]
    assert "Traceback" not in stderr, stderr[-3000:]

    # the checkpoints are whole: step 1 is committed, step 2 never was (no step 2 logged either)
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "global_step_1"
    assert max(metrics(run_dir)) == 1, "step 2 finished before the node was lost"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("global_step_")) == ["global_step_1"]
    assert (checkpoints / "global_step_1" / "COMPLETE").is_file()

    want = metrics(two_nodes[0])
    # on the node left: one rank (world 1 runs in the driver's process) resumes from checkpoint 1 and trains step 2
    train_on(cluster, task, run_dir, 1, 1, "trainer.total_training_steps=2")
    assert sorted(metrics(run_dir)) == [1, 2]
    assert_close_metrics(metrics(run_dir)[2], want[2], 2)
    # and on the two nodes left: 2 ranks resume from checkpoint 2 and train step 3
    log = train_on(cluster, task, run_dir, 2, 1)
    (placed,) = placements(log)
    assert placed["nodes"] == 2 and node not in {n for n, _ in placed["ranks"].values()}
    got = metrics(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(2, STEPS + 1):
        assert_close_metrics(got[step], want[step], step)
    assert "global_seqlen/mean" in got[3] and "global_seqlen/mean" not in got[2]  # 2 ranks, then 1, then 2


SEPARATE_ON_NODES = ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.num_warmup_batches=0",
                     "trainer.v1.separate_async.parameter_sync_step=2", "trainer.v1.sampler.max_off_policy_threshold=1",
                     "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
                     "actor_rollout_ref.rollout.name=hf", "+trainer.influence_trace.enable=false"]
SEPARATE_PLACED = re.compile(r"separate_async: trainer ranks on node\(s\) (\S+), rollout ranks on node\(s\) (\S+) "
                             r"\(node_placement=(\w+)")


@pytest.mark.timeout(1200)
def test_separate_rollout_ranks_on_another_node_train_what_they_train_on_one(
        cluster: OneMachineCluster, task: dict[str, Path], tmp_path: Path) -> None:
    """Issue 50 point 3 as a user runs it: `archer train` in separate_async with one trainer rank and one rollout
    rank on the cluster (node_placement=apart keeps the rollout rank off the trainer's node); the weights go over
    the sync group's TCP store and gloo endpoints on the nodes' addresses. Every logged number and the entropy
    trace's policy versions equal the same run on a local one-node Ray."""
    run_dir, local_dir = tmp_path / "apart", tmp_path / "local"
    extra = [*SEPARATE_ON_NODES, "trainer.v1.separate_async.node_placement=apart"]
    proc = subprocess.run(command(task, run_dir, 1, *extra), env=cluster.env(), capture_output=True, text=True,
                          timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trainer_node, rollout_node, placement = SEPARATE_PLACED.search(proc.stderr).groups()
    assert placement == "apart" and trainer_node != rollout_node
    assert {trainer_node, rollout_node} <= {node[:8] for node in cluster.names}
    local_env = {k: v for k, v in cluster.env().items() if k != "RAY_ADDRESS"}
    local = subprocess.run(command(task, local_dir, 1, *SEPARATE_ON_NODES), env=local_env, capture_output=True,
                           text=True, timeout=WAIT_S)
    assert local.returncode == 0, local.stderr[-3000:]

    want, got = metrics(local_dir), metrics(run_dir)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert want[2]["actor/grad_norm"] > 0.1  # the policy moves, so stale weights would change what step 3 samples
    for step in want:
        numbers = {k: v for k, v in want[step].items() if not k.startswith((*TIME_BASED, "async/"))}
        assert {k: got[step][k] for k in numbers} == numbers, f"step {step}"
    for step in (2, 3):  # sampled by the weights the trainer sent one update before
        versions = TraceReader(run_dir / "entropy_trace").load_step(step)["policy_version"].tolist()
        assert versions and set(versions) == {step - 2}
