"""Several Ray nodes on this one machine, started by examples/slurm_multinode.sbatch's own functions with srun and
scontrol faked: every node a `ray start --block` of its own (its own --temp-dir, a custom resource naming it, its
own dashboard-agent port), token authentication with a token held in the environment (nothing under ~/.ray).

- The script's head and worker functions make a cluster of 2 (and 3) nodes that `wait_for_nodes` sees.
- `trainer.nnodes=N trainer.n_gpus_per_node=1` places one rank on each node (STRICT_SPREAD; every node has 2 CPUs,
  so a PACK placement would put two ranks on one node), the ranks'
  process group meets at rank 0's node address over TCP (the all-reduce of rank + 1 gives N(N+1)/2).
- What the test starts it stops: every node's `ray start --block` is ended by its pid, and its raylet goes with it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "slurm_multinode.sbatch"
WAIT_S = 90

# srun: run the command here, each `ray start` with the per-node flags one machine needs; the pid is kept so the
# test stops exactly what it started
FAKE_SRUN = """#!/bin/bash
host=""
while [ $# -gt 0 ]; do
    case "$1" in
        -w) host=$2; shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
if [ "$1" = ray ]; then
    port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    echo $$ >> "$FAKE_ROOT/pids"
    exec "$@" --node-ip-address=127.0.0.1 --num-cpus=2 --num-gpus=0 --temp-dir="$FAKE_ROOT/$host" \\
        --resources="{\\"node_$host\\": 1}" --dashboard-agent-listen-port=$port --disable-usage-stats
fi
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
tr ',' '\\n' <<< "$SLURM_JOB_NODELIST"
"""
DRIVER = """
import json, sys
import ray
from archer.controller.ray_group import RayWorkerGroup
from multinode_support import WhereWorker
nnodes = int(sys.argv[1])
group = RayWorkerGroup(WhereWorker, {}, nnodes=nnodes, n_gpus_per_node=1, device_kind="cpu", placement_timeout_s=60)
ranks = group.call("where")
nodes = {n["NodeID"]: {"address": n["NodeManagerAddress"], "resources": sorted(k for k in n["Resources"]
         if k.startswith("node_"))} for n in ray.nodes() if n["Alive"]}
group.shutdown()
print("RESULT " + json.dumps({"ranks": ranks, "nodes": nodes}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("nnodes", [2, 3])
def test_the_slurm_script_starts_a_cluster_that_places_one_rank_per_node(nnodes: int) -> None:
    # a short folder: Ray's sockets live under each node's --temp-dir, and a socket path is at most 107 bytes
    tmp_path = Path(tempfile.mkdtemp(prefix="archer-mn-", dir="/tmp"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    hosts = [f"n{i}" for i in range(nnodes)]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_ROOT": str(tmp_path),
           "SLURM_JOB_NODELIST": ",".join(hosts), "RAY_PORT": str(free_port()), "GPUS_PER_NODE": "0",
           "ARCHER_SLURM_SOURCE_ONLY": "1", "NODE_WAIT_S": str(WAIT_S), "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    (tmp_path / "driver.py").write_text(DRIVER)
    # the script's own steps, as main() runs them, with the driver in place of `archer train`; the nodes' output
    # goes to files (a background node holding the pipe would keep subprocess.run waiting)
    steps = f"""
        source {SCRIPT}
        mapfile -t nodes < <(job_nodes)
        head_addr=$(node_address "${{nodes[0]}}")
        start_head "${{nodes[0]}}" "$head_addr" > "$FAKE_ROOT/head.log" 2>&1
        sleep 5
        for node in "${{nodes[@]:1}}"; do start_worker "$node" "$head_addr" > "$FAKE_ROOT/$node.log" 2>&1; done
        wait_for_nodes "$head_addr" "${{#nodes[@]}}"
        echo "HEAD $head_addr"
        RAY_ADDRESS="$head_addr:$RAY_PORT" python {tmp_path / 'driver.py'} {nnodes}
    """
    pids: list[int] = []
    try:
        proc = subprocess.run(["bash", "-c", steps], env=env, capture_output=True, text=True, timeout=4 * WAIT_S,
                              start_new_session=True)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        head = proc.stdout.split("HEAD ")[1].split()[0]
        result = json.loads(proc.stdout.split("RESULT ")[1])
    finally:
        if (tmp_path / "pids").exists():
            pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        for pid in filter(alive, pids):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert head == "127.0.0.1"
    assert len(pids) == nnodes and not any(alive(pid) for pid in pids)
    nodes, ranks = result["nodes"], result["ranks"]
    assert sorted(r for n in nodes.values() for r in n["resources"]) == [f"node_{h}" for h in hosts]
    assert [r["rank"] for r in ranks] == list(range(nnodes))
    assert len({r["node"] for r in ranks}) == nnodes  # one rank on each node
    assert all(r["sum"] == nnodes * (nnodes + 1) / 2 for r in ranks)
    assert {r["master"] for r in ranks} == {nodes[ranks[0]["node"]]["address"]}
