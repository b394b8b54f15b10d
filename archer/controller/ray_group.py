"""The Ray worker group: one Ray actor per rank on one placement group, driven by the trainer process.

- Cluster: ``RAY_ADDRESS`` connects to a running cluster; without it a local Ray instance on the loopback
  interface is started (controller/ray_cluster.py), and shut down with the group.
- Placement: one placement group of ``nnodes * n_gpus_per_node`` bundles, ``{"CPU": 1, "GPU": 1}`` per rank on
  GPUs and ``{"CPU": 1}`` per rank on CPU, ``STRICT_PACK`` on one node, ``STRICT_SPREAD`` for one rank per node
  on several nodes (``trainer.n_gpus_per_node=1``: each rank on a node of its own, as the keys say) and ``PACK``
  otherwise. Ranks follow
  the nodes' addresses, then the bundle order, so rank -> node is stable from run to run. The driver prints one
  line of which ranks run on which node and where their process group meets.
- Each rank actor gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` (found by a task on rank 0's bundle) and the driver's ``PYTHONPATH``, so that
  ``torch.distributed`` initialises from the environment and the workers import the driver's archer. On GPUs
  each rank sees its node's GPUs in local-rank order, so its own device is ``cuda:LOCAL_RANK``, as under torchrun.
- Two groups on one node (separate_async's trainer and rollout ranks) can see each other's GPUs, so that NCCL
  between them takes the direct GPU-to-GPU path: ``share_node_gpus`` starts both groups' workers with every GPU
  of their node visible, each rank's own as ``cuda:LOCAL_RANK``.
- ``call`` puts the arguments in the object store once and hands the same reference to every rank; a rank that
  dies, raises or overruns the call timeout becomes one ArcherError naming the rank and the method, and the
  group is shut down (the other ranks may be waiting in a collective that can no longer finish). A rank whose
  node is lost (Ray lists the node as dead, or its raylet refuses connections) is named with its node's id and
  address, whichever rank's error reached the driver first.
- Workers' stdout and stderr reach the driver prefixed with ``(rank N pid=...)``.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from archer.controller.ray_cluster import LocalRay, connect_ray, import_ray
from archer.controller.worker_group import PendingCall, WorkerGroup
from archer.distributed.context import DeviceKind
from archer.errors import ArcherError
from archer.workers.dispatch import collector_of

RESUME_FIX = ("restart the run from its last checkpoint with trainer.resume_mode=auto (the same command); "
              "the rank's own log lines above, prefixed (rank N pid=...), show why it stopped")
_PLACEMENT_NOTICE_S = 5.0  # a placement that takes longer gets a line saying what it waits for
_ERROR_GRACE_S = 3.0  # after one rank fails, how long to look for a rank that died (the root cause)
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its node id
_PROBE_S = 2.0  # how long a lost node's raylet may take to accept a connection before it counts as gone


def worker_pythonpath() -> str:
    """The ranks' PYTHONPATH: the folder this archer is imported from (unless it is an installed package),
    then the driver's PYTHONPATH, so every rank runs the driver's archer."""
    import archer

    entries = []
    root = Path(archer.__file__).resolve().parent.parent
    if root.name not in ("site-packages", "dist-packages"):
        entries.append(str(root))
    entries += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(entries))


def placement_strategy(nnodes: int, n_gpus_per_node: int) -> str:
    """The placement group's strategy: one node, one rank on each of ``nnodes`` nodes, or packed."""
    if nnodes == 1:
        return "STRICT_PACK"
    return "STRICT_SPREAD" if n_gpus_per_node == 1 else "PACK"


def not_on_nodes(node_ids: tuple[str, ...]) -> dict[str, str]:
    """A bundle's label selector that keeps it off the Ray nodes ``node_ids``."""
    return {NODE_ID_LABEL: f"!in({','.join(node_ids)})"}


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs: its placement-group bundle, node, and rank within the node."""

    bundle: int
    node_id: str
    local_rank: int
    local_world_size: int


def rank_layout(bundle_nodes: dict[int, str], node_ips: dict[str, str]) -> list[RankPlace]:
    """Ranks in order of (node address, bundle index): the ranks of one node are consecutive and the
    assignment does not depend on which node Ray listed first."""
    order = sorted(bundle_nodes, key=lambda b: (node_ips[bundle_nodes[b]], bundle_nodes[b], b))
    per_node: dict[str, int] = {}
    local: list[int] = []
    for b in order:
        node = bundle_nodes[b]
        local.append(per_node.get(node, 0))
        per_node[node] = local[-1] + 1
    return [RankPlace(b, bundle_nodes[b], lr, per_node[bundle_nodes[b]])
            for b, lr in zip(order, local)]


def visible_devices(layout: list[RankPlace], gpu_ids: list[list[str]]) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` for each rank: its node's GPUs in local-rank order (Ray gives each actor only
    its own GPU; sharing the node's list keeps ``cuda:LOCAL_RANK`` the rank's own device and lets NCCL see
    its peers)."""
    for place, ids in zip(layout, gpu_ids):
        if len(ids) != 1:
            raise RuntimeError(f"rank on bundle {place.bundle} holds GPUs {ids}; each rank should hold one")
    node_gpus: dict[str, list[str]] = {}
    for place, ids in sorted(zip(layout, gpu_ids), key=lambda pair: pair[0].local_rank):
        node_gpus.setdefault(place.node_id, []).append(ids[0])
    return [",".join(node_gpus[place.node_id]) for place in layout]


def placement_line(layout: list[RankPlace], node_ips: dict[str, str]) -> str:
    """Where the ranks run, one clause per node: ``2 ranks on 2 nodes: rank 0 on node 1f2e.. (10.0.0.1), ..``."""
    nodes: dict[str, list[int]] = {}
    for rank, place in enumerate(layout):
        nodes.setdefault(place.node_id, []).append(rank)
    clauses = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on node {node} "
               f"({node_ips.get(node, '?')})" for node, ranks in nodes.items()]
    return f"{len(layout)} ranks on {len(nodes)} node(s): " + "; ".join(clauses)


def raylet_answers(address: str, port: int, timeout_s: float = _PROBE_S) -> bool:
    """Whether a node's raylet accepts a connection at ``address:port`` (its node manager's port)."""
    try:
        socket.create_connection((address, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def death_cause(ray_message: str) -> str:
    """The few facts of Ray's long actor-death message: which process, and how it ended."""
    text = " ".join(ray_message.split())
    pid = re.search(r"\bpid: (\d+)", text)
    ip = re.search(r"\bip: (\S+)", text)
    kind = re.search(r"Worker exit type: (\S+)", text)
    detail = re.search(r"Worker exit detail: (.*?)(?: Some common causes|$)", text)
    if not (pid and detail):
        return text[:400]
    where = f"its process {pid.group(1)}" + (f" on {ip.group(1)}" if ip else "")
    how = f"{kind.group(1)}: {detail.group(1)}" if kind else detail.group(1)
    return (f"{where} ended ({how}); a kill -9, the kernel's out-of-memory killer (see dmesg on that node) "
            "or a crash of the process ends a rank this way")


def _master_address() -> tuple[str, int]:
    """This node's address and a free port (run as a task on rank 0's bundle)."""
    import ray

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), int(port)


class _RankActor:
    """One rank's process: holds the worker object and runs its methods."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker: object | None = None

    def __repr__(self) -> str:  # Ray prefixes the rank's log lines with it: "(rank 1 pid=...)"
        return f"rank {self.rank}"

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]

    def start(self, worker_cls: type, init_kwargs: dict[str, Any], env: dict[str, str]) -> None:
        os.environ.update(env)
        if "CUDA_VISIBLE_DEVICES" in env:  # "cuda" means this rank's own card, also at world 1
            import torch

            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        self.worker = worker_cls(**init_kwargs)

    def call(self, method_name: str, payload: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        args, kwargs = payload
        return getattr(self.worker, method_name)(*args, **kwargs)


class RayWorkerGroup(WorkerGroup):
    """``nnodes * n_gpus_per_node`` ranks of ``worker_cls(**init_kwargs)``, one Ray actor each."""

    def __init__(
        self,
        worker_cls: type,
        init_kwargs: dict[str, Any],
        *,
        nnodes: int,
        n_gpus_per_node: int,
        device_kind: DeviceKind | Literal["auto"] = "auto",
        placement_timeout_s: float = 120.0,
        call_timeout_s: float | None = None,
        object_store_memory: int | None = None,
        start: bool = True,
        size_keys: str = "trainer.nnodes / trainer.n_gpus_per_node",
        local_ray: LocalRay | None = None,
        avoid_nodes: tuple[str, ...] = (),
    ) -> None:
        """``start=False`` places the rank actors without building their workers: ``start_workers`` (or
        ``share_node_gpus`` for two groups) does it. ``size_keys``: the config keys that size this group (named
        when it cannot be placed). ``local_ray``: the settings of a local Ray this group starts.
        ``avoid_nodes``: Ray node ids that no bundle may be placed on (a label selector on each bundle)."""
        self.size_keys = size_keys
        self._world = nnodes * n_gpus_per_node
        self._ray = import_ray(self._world)
        self._worker_cls = worker_cls
        self.call_timeout_s = call_timeout_s
        self._actors: list[Any] = []
        self._pg: Any = None
        self._closed = False
        self._owns_ray = connect_ray(self._world, object_store_memory=object_store_memory, local=local_ray)
        try:
            self.device_kind = self._resolve_device(device_kind)
            self._pg = self._placement_group(nnodes, n_gpus_per_node, placement_timeout_s, avoid_nodes)
            self.layout = self._layout()
            self._init_kwargs = init_kwargs
            self.gpu_ids = self._place_actors(placement_timeout_s)
            if start:
                self.start_workers()
        except BaseException:
            self.shutdown()
            raise

    # -- set-up ------------------------------------------------------------------------------------
    def _resolve_device(self, device_kind: DeviceKind | Literal["auto"]) -> DeviceKind:
        if device_kind not in ("auto", "cpu", "cuda"):
            raise ArcherError(f"trainer.device must be auto, cpu or cuda, got {device_kind!r}",
                              "set trainer.device=cuda for GPUs or trainer.device=cpu for CPU processes")
        if device_kind != "auto":
            return device_kind
        return "cuda" if self._ray.cluster_resources().get("GPU", 0) > 0 else "cpu"

    def _placement_group(self, nnodes: int, n_gpus_per_node: int, timeout_s: float, avoid_nodes: tuple[str, ...]
                         ) -> Any:
        from ray.util.placement_group import placement_group, remove_placement_group

        bundle = {"CPU": 1, "GPU": 1} if self.device_kind == "cuda" else {"CPU": 1}
        strategy = placement_strategy(nnodes, n_gpus_per_node)
        selector = {"bundle_label_selector": [not_on_nodes(avoid_nodes)] * self._world} if avoid_nodes else {}
        pg = placement_group([dict(bundle) for _ in range(self._world)], strategy=strategy, **selector)
        first = min(_PLACEMENT_NOTICE_S, timeout_s)
        if pg.wait(timeout_seconds=first):
            return pg
        if timeout_s > first:
            print(f"archer: waiting up to {timeout_s - first:g} s more for Ray to place {self._world} x "
                  f"{bundle} ({strategy}); `ray status` shows what the cluster holds", file=sys.stderr, flush=True)
            if pg.wait(timeout_seconds=timeout_s - first):
                return pg
        remove_placement_group(pg)
        asked = {k: v * self._world for k, v in bundle.items()}
        have = {k: self._ray.available_resources().get(k, 0) for k in bundle}
        total = {k: self._ray.cluster_resources().get(k, 0) for k in bundle}
        nodes = sum(1 for n in self._ray.nodes() if n.get("Alive"))
        per = "GPU" if self.device_kind == "cuda" else "CPU process"
        apart = f", on none of the {len(avoid_nodes)} node(s) of the trainer's ranks" if avoid_nodes else ""
        raise ArcherError(
            f"Ray could not place {self._world} ranks ({nnodes} node(s) x {n_gpus_per_node} {per}s, "
            f"{bundle} each, {strategy}{apart}) within {timeout_s:g} s: they ask {asked}, the cluster has {have} "
            f"free of {total} on {nodes} node(s)",
            f"lower {self.size_keys} to what the cluster has, add nodes with "
            "`ray start --address=<head>:6379`, or stop what holds the resources (`ray status` shows them)"
            + ("; on CPU set trainer.device=cpu" if self.device_kind == "cuda" else ""),
        )

    def _layout(self) -> list[RankPlace]:
        from ray.util import placement_group_table

        bundle_nodes = {int(b): n for b, n in placement_group_table(self._pg)["bundles_to_node_id"].items()}
        return rank_layout(bundle_nodes, self._node_ips())

    def _node_ips(self) -> dict[str, str]:
        return {n["NodeID"]: n["NodeManagerAddress"] for n in self._ray.nodes()}

    def _lost_nodes(self, ranks: list[int]) -> dict[int, str]:
        """Which of ``ranks`` lost their node, and how (Ray lists it as dead, or its raylet refuses connections):
        a node whose raylet is gone takes its ranks with it, and Ray's error says only that an actor went."""
        nodes = {n["NodeID"]: n for n in self._ray.nodes()}
        how_lost: dict[str, str | None] = {}
        for node_id in {self.layout[r].node_id for r in ranks}:
            node = nodes.get(node_id)
            if node is None or not node.get("Alive"):
                how_lost[node_id] = "Ray lists it as dead"
                continue
            address, port = node["NodeManagerAddress"], int(node["NodeManagerPort"])
            answers = raylet_answers(address, port)
            how_lost[node_id] = None if answers else f"its raylet does not answer at {address}:{port}"
        return {r: how for r in ranks if (how := how_lost[self.layout[r].node_id]) is not None}

    def _where(self, rank: int) -> str:
        node_id = self.layout[rank].node_id
        return f"node {node_id} ({self._node_ips().get(node_id, 'address unknown')})"

    def _on_bundle(self, bundle: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=bundle)

    def _place_actors(self, timeout_s: float) -> list[list[str]]:
        """One rank actor per bundle; returns the GPU ids Ray gave each (empty lists on CPUs)."""
        ray = self._ray
        master = ray.remote(num_cpus=0)(_master_address).options(scheduling_strategy=self._on_bundle(
            self.layout[0].bundle)).remote()
        self.master_addr, self.master_port = ray.get(master, timeout=timeout_s)
        print(f"archer: {placement_line(self.layout, self._node_ips())}; the process group meets at rank 0's "
              f"node, {self.master_addr}:{self.master_port}", file=sys.stderr, flush=True)
        actor_cls = ray.remote(_RankActor)
        gpus = 1 if self.device_kind == "cuda" else 0
        pythonpath = worker_pythonpath()
        for rank, place in enumerate(self.layout):
            env = {"RANK": str(rank), "WORLD_SIZE": str(self._world), "LOCAL_RANK": str(place.local_rank),
                   "LOCAL_WORLD_SIZE": str(place.local_world_size), "MASTER_ADDR": self.master_addr,
                   "MASTER_PORT": str(self.master_port), "PYTHONPATH": pythonpath}
            self._actors.append(actor_cls.options(
                num_cpus=1, num_gpus=gpus, scheduling_strategy=self._on_bundle(place.bundle),
                runtime_env={"env_vars": env}).remote(rank))
        if self.device_kind != "cuda":
            return [[] for _ in self._actors]
        return self._gather([a.gpu_ids.remote() for a in self._actors], "gpu_ids", timeout_s)

    def start_workers(self, envs: list[dict[str, str]] | None = None) -> None:
        """Build every rank's worker; ``envs``: each rank's extra environment (default: on GPUs, its node's
        GPUs of this group visible, its own as ``cuda:LOCAL_RANK``)."""
        if envs is None:
            envs = [{} for _ in self._actors]
            if self.device_kind == "cuda":
                envs = [{"CUDA_VISIBLE_DEVICES": v} for v in visible_devices(self.layout, self.gpu_ids)]
        self._gather([a.start.remote(self._worker_cls, self._init_kwargs, e) for a, e in zip(self._actors, envs)],
                     f"{self._worker_cls.__name__}.__init__", None)

    # -- calls -------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._world

    def call(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return self.submit(method_name, *args, **kwargs).result()

    def submit(self, method_name: str, *args: Any, **kwargs: Any) -> PendingCall:
        if self._closed:
            raise ArcherError(f"cannot call {method_name}: the worker group was shut down",
                              "a rank failed earlier (see the error above); " + RESUME_FIX)
        collector = collector_of(self._worker_cls, method_name)
        payload = self._ray.put((args, kwargs))
        refs = [actor.call.remote(method_name, payload) for actor in self._actors]
        return _RayCall(self, refs, method_name, collector)

    def _gather(self, refs: list[Any], what: str, timeout_s: float | None) -> list[Any]:
        """Per-rank results in rank order; any failure shuts the group down and raises."""
        ray = self._ray
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                ranks = sorted(pending.values())
                self.shutdown()
                raise ArcherError(
                    f"{what} did not finish within {timeout_s:g} s on rank(s) {ranks} of {self._world}",
                    "a rank is stuck (often a collective that another rank never entered) or slower than the "
                    "timeout: check the rank log lines above, raise the timeout, then " + RESUME_FIX)
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                raise self._failure(what, rank, exc, pending) from None
        return results

    def _failure(self, what: str, rank: int, exc: Exception, pending: dict[Any, int]) -> BaseException:
        """The error to raise for a failed rank, preferring a rank that died (the usual root cause: its peers
        then fail in their collectives); shuts the group down."""
        ray = self._ray
        if not isinstance(exc, ray.exceptions.RayActorError) and pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_ERROR_GRACE_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as died:
                    rank, exc = pending[ref], died
                    break
                except ray.exceptions.RayError:
                    continue
        # a node went down: name it, and its rank, whatever error reached the driver first (a rank's own
        # ArcherError, a config or data problem, is reported as it is)
        own_error = isinstance(getattr(exc, "cause", None), ArcherError)
        lost = {} if own_error else self._lost_nodes(sorted({rank, *pending.values()}))
        if lost:
            rank = min(lost)
            where = self._where(rank)
            self.shutdown()
            return ArcherError(
                f"rank {rank} of {self._world} lost its {where} during {what}: {lost[rank]} (the node went down "
                "or off the network, or its raylet was killed), and its ranks with it",
                f"{RESUME_FIX}; once the node is back, or on the nodes left with a lower trainer.nnodes (a checkpoint "
                "resumes on any number of ranks)")
        where = self._where(rank)
        self.shutdown()
        if isinstance(exc, ray.exceptions.RayActorError):
            return ArcherError(f"rank {rank} of {self._world} on {where} died during {what}: "
                               f"{death_cause(str(exc))}", RESUME_FIX)
        missing = re.search(r"No module named '([^']+)'", str(exc))
        if missing:
            return ArcherError(
                f"rank {rank} of {self._world} cannot import module {missing.group(1)!r} ({what})",
                "install the same Python packages (and archer) on every node, or put the module's folder on "
                "PYTHONPATH before starting the run (the ranks get the driver's PYTHONPATH)")
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ArcherError):
            return ArcherError(f"rank {rank}, {what}: {cause.problem}", cause.fix)
        return exc

    # -- teardown ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception as exc:  # an actor already gone: nothing left to release
                print(f"archer: could not kill a rank actor ({exc})", file=sys.stderr)
        self._actors = []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray:
            ray.shutdown()


class _RayCall(PendingCall):
    """A call in flight on every rank of a RayWorkerGroup."""

    def __init__(self, group: RayWorkerGroup, refs: list[Any], method_name: str, collector: Any) -> None:
        self.group, self.refs, self.method_name, self.collector = group, refs, method_name, collector

    def result(self) -> Any:
        return self.collector(self.group._gather(self.refs, self.method_name, self.group.call_timeout_s))


def wait_all(calls: list[PendingCall]) -> list[Any]:
    """The results of calls running side by side on several groups (separate_async's weight sync: trainer rank 0
    sends while the rollout ranks receive), in order. A rank that fails in any of them raises at once, as its
    group's error, without waiting for the others, which may be blocked in a collective the failed rank never
    joins (the caller then shuts every group down)."""
    ray_calls = [call for call in calls if isinstance(call, _RayCall)]
    if ray_calls:
        ray = ray_calls[0].group._ray
        pending = {ref: call for call in ray_calls for ref in call.refs}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            call = pending.pop(ready[0])
            try:
                ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                others = {ref: call.refs.index(ref) for ref, owner in pending.items() if owner is call}
                raise call.group._failure(call.method_name, call.refs.index(ready[0]), exc, others) from None
    return [call.result() for call in calls]


def share_node_gpus(groups: list[RayWorkerGroup]) -> None:
    """Start the workers of ``groups`` (placed with ``start=False``) with every GPU that these groups hold on
    a rank's node visible to it, in group order then local-rank order; each rank's own GPU is ``cuda:LOCAL_RANK``
    (LOCAL_RANK set to its index in that list). On CPUs each group starts as it would alone."""
    if any(g.device_kind != "cuda" for g in groups):
        for group in groups:
            group.start_workers()
        return
    node_gpus: dict[str, list[str]] = {}
    for group in groups:
        for place, ids in sorted(zip(group.layout, group.gpu_ids), key=lambda pair: pair[0].local_rank):
            if len(ids) != 1:
                raise RuntimeError(f"rank on bundle {place.bundle} holds GPUs {ids}; each rank should hold one")
            node_gpus.setdefault(place.node_id, []).append(ids[0])
    for group in groups:
        envs = []
        for place, ids in zip(group.layout, group.gpu_ids):
            visible = node_gpus[place.node_id]
            envs.append({"CUDA_VISIBLE_DEVICES": ",".join(visible), "LOCAL_RANK": str(visible.index(ids[0]))})
        group.start_workers(envs)
