"""trainer.v1.trainer_mode=separate_async (docs/async.md): rollout GPUs apart from the trainer's, generating the
next step's groups while the trainer trains on this step's.

Two Ray worker groups: the trainer's ranks (``RankWorkers`` without engines) on trainer.nnodes x
trainer.n_gpus_per_node GPUs, and the rollout ranks (``RolloutRank``) on actor_rollout_ref.rollout.nnodes x
n_gpus_per_node GPUs, every GPU of a node visible to both groups' ranks there (NCCL's direct path). Step k:

1. take the groups of the call in flight (started during step k - 1; at the first step, start one and wait);
2. sync the trainer's weights, version k - 1, to the rollout ranks (skipped when they hold it already);
3. dynamic sampling's further calls, if any, run now, with those weights;
4. start the call for step k + 1 (the rollout ranks decode under version k - 1, and pause what is unfinished
   when a batch's worth of groups is complete), and return: the trainer trains on step k's groups meanwhile.

So from the second step on, every trained response is at least one version old (the trainer is one update ahead
of the weights that sampled it), and a step takes about the longer of generation and training, plus the sync.
Validation waits for the call in flight (its groups are kept for the next step), syncs the newest weights and
generates on the rollout ranks.
"""

from __future__ import annotations

import logging
import time

import torch
from omegaconf import DictConfig

from archer.batch import Batch
from archer.controller.ray_cluster import alive_nodes, connect_ray, places_by_label
from archer.controller.ray_group import RayWorkerGroup, share_node_gpus, wait_all
from archer.controller.worker_group import DoneCall, PendingCall
from archer.distributed.weight_sync import WeightManifest, bucket_bytes
from archer.errors import ArcherError
from archer.rollout.policy_versions import engine_version
from archer.trainer.async_batches import AsyncBatches
from archer.trainer.config_check import ray_settings
from archer.workers.colocated import RankWorkers
from archer.workers.rollout_rank import RolloutRank, engine_dtype

log = logging.getLogger("archer.trainer")

IDLE_SHARE = 0.3  # a side idle this share of the step for BALANCE_STEPS steps in a row gets one hint
BALANCE_STEPS = 3


class PipelineBalance:
    """Which side of separate_async waits for the other, step by step: the trainer's wait for generation
    (``timing_s/gen``) and the rollout ranks' idle time between finishing a call and being asked for its groups
    (``async/rollout_idle_s``), each against the step's period (from one take of groups to the next). When one
    side idles ``IDLE_SHARE`` of the period for ``BALANCE_STEPS`` steps in a row, ``observe`` returns one hint
    (once a run) naming the GPUs to move."""

    def __init__(self, trainer_gpus: int, rollout_gpus: int) -> None:
        self.trainer_gpus, self.rollout_gpus = trainer_gpus, rollout_gpus
        self.last_take: float | None = None
        self.streak: dict[str, int] = {"rollout": 0, "trainer": 0}
        self.hinted = False

    def observe(self, launched: float, taken: float, generation_s: float, wait_s: float,
                metrics: dict[str, float]) -> str | None:
        """One take of groups at ``taken`` (perf_counter seconds) from a call launched at ``launched`` whose ranks
        worked ``generation_s``, after the trainer waited ``wait_s``; adds ``async/rollout_idle_s``."""
        idle = max(0.0, taken - launched - generation_s)
        metrics["async/rollout_idle_s"] = idle
        period = None if self.last_take is None else taken + wait_s - self.last_take
        self.last_take = taken + wait_s
        if not period or period <= 0:
            return None
        for side, share in (("rollout", idle / period), ("trainer", wait_s / period)):
            self.streak[side] = self.streak[side] + 1 if share >= IDLE_SHARE else 0
        if self.hinted:
            return None
        if self.streak["rollout"] >= BALANCE_STEPS and self.rollout_gpus > 1:
            self.hinted = True
            return (f"separate_async: the {self.rollout_gpus} rollout GPU(s) idled {idle / period:.0%} of the last step "
                    f"({BALANCE_STEPS} steps in a row above {IDLE_SHARE:.0%}): training is the bottleneck; move a GPU "
                    "to training (trainer.n_gpus_per_node + 1, actor_rollout_ref.rollout.n_gpus_per_node - 1)")
        if self.streak["trainer"] >= BALANCE_STEPS and self.trainer_gpus > 1:
            self.hinted = True
            return (f"separate_async: the trainer waited for generation {wait_s / period:.0%} of the last step "
                    f"({BALANCE_STEPS} steps in a row above {IDLE_SHARE:.0%}): generation is the bottleneck; move a "
                    "GPU to generation (actor_rollout_ref.rollout.n_gpus_per_node + 1, trainer.n_gpus_per_node - 1)")
        return None


def rollout_world(cfg: DictConfig) -> int:
    """The standalone rollout ranks: actor_rollout_ref.rollout.nnodes x n_gpus_per_node."""
    rollout = cfg.actor_rollout_ref.rollout
    return int(rollout.nnodes) * int(rollout.n_gpus_per_node)


def rollout_avoid_nodes(placement: str, trainer_nodes: set[str], alive: list[str], rollout_nnodes: int,
                        *, by_label: bool = True) -> tuple[str, ...]:
    """The Ray nodes the rollout ranks keep off (trainer.v1.separate_async.node_placement): the trainer ranks'
    nodes with ``apart``, and with ``auto`` when ``alive`` has ``rollout_nnodes`` nodes without trainer ranks;
    none with ``shared`` (Ray places them, next to the trainer's or not). ``by_label``: whether this Ray can keep
    bundles off nodes (``places_by_label``)."""
    others = [node for node in alive if node not in trainer_nodes]
    if placement == "shared" or placement == "auto" and (len(others) < rollout_nnodes or not by_label):
        return ()
    if not by_label:
        raise ArcherError("trainer.v1.separate_async.node_placement=apart needs a Ray whose placement groups take "
                          "bundle_label_selector, which this Ray's lack", "upgrade Ray (2.60 has it), or set "
                          "trainer.v1.separate_async.node_placement=shared")
    if len(others) < rollout_nnodes:
        raise ArcherError(f"trainer.v1.separate_async.node_placement=apart: the cluster has {len(others)} live "
                          f"node(s) without trainer ranks, and actor_rollout_ref.rollout.nnodes={rollout_nnodes} asks "
                          "for more", "add nodes (`ray start --address=<head>:6379`), lower "
                          "actor_rollout_ref.rollout.nnodes, or set trainer.v1.separate_async.node_placement=shared")
    return tuple(sorted(trainer_nodes))


def build_separate_groups(cfg: DictConfig, trainer_kwargs: dict, rollout_kwargs: dict
                          ) -> tuple[RayWorkerGroup, RayWorkerGroup, bool]:
    """The trainer's and the rollout's Ray worker groups (the rollout ranks on nodes of their own as
    ``rollout_avoid_nodes`` says), their workers started with the node's GPUs of both visible; returns them and
    whether this call started Ray (then ``SeparateRollout.shutdown`` stops it)."""
    trainer_cfg, rollout = cfg.trainer, cfg.actor_rollout_ref.rollout
    trainer_world = int(trainer_cfg.nnodes) * int(trainer_cfg.n_gpus_per_node)
    owns_ray = connect_ray(trainer_world + rollout_world(cfg), local=ray_settings(cfg))
    device = str(trainer_cfg.device)
    groups: list[RayWorkerGroup] = []
    try:
        groups.append(RayWorkerGroup(RankWorkers, {**trainer_kwargs, "generates": False},
                                     nnodes=int(trainer_cfg.nnodes), n_gpus_per_node=int(trainer_cfg.n_gpus_per_node),
                                     device_kind=device, start=False))
        placement = str(trainer_cfg.v1.separate_async.node_placement)
        trainer_nodes = {place.node_id for place in groups[0].layout}
        avoid = rollout_avoid_nodes(placement, trainer_nodes, alive_nodes(), int(rollout.nnodes),
                                    by_label=places_by_label())
        groups.append(RayWorkerGroup(RolloutRank, rollout_kwargs, nnodes=int(rollout.nnodes),
                                     n_gpus_per_node=int(rollout.n_gpus_per_node), device_kind=device, start=False,
                                     size_keys="actor_rollout_ref.rollout.nnodes / n_gpus_per_node (which defaults "
                                               "to trainer.n_gpus_per_node) or trainer.n_gpus_per_node",
                                     avoid_nodes=avoid))
        rollout_nodes = {place.node_id for place in groups[1].layout}
        log.info("separate_async: trainer ranks on node(s) %s, rollout ranks on node(s) %s (node_placement=%s: %s)",
                 ", ".join(sorted(n[:8] for n in trainer_nodes)), ", ".join(sorted(n[:8] for n in rollout_nodes)),
                 placement, "apart" if avoid else "where Ray placed them")
        share_node_gpus(groups)
    except BaseException:
        stop_groups(groups[::-1], owns_ray)
        raise
    trainer, rollout_group = groups
    return trainer, rollout_group, owns_ray


class SeparateRollout:
    """The pipeline of separate_async over the trainer's group (``trainer``) and the rollout ranks
    (``batches.workers``)."""

    def __init__(self, cfg: DictConfig, trainer: RayWorkerGroup, batches: AsyncBatches, owns_ray: bool) -> None:
        self.trainer, self.batches, self.owns_ray = trainer, batches, owns_ray
        self.rollout: RayWorkerGroup = batches.workers  # type: ignore[assignment]
        # the call for the next step's groups and when it started (None once a validation waited for it: its
        # groups stay admitted until the step takes them, so a checkpoint in between keeps them)
        self.in_flight: tuple[PendingCall, float | None] | None = None
        self.balance = PipelineBalance(trainer.world_size, self.rollout.world_size)
        self.rollout_version: int | None = None  # the policy version the rollout ranks hold
        self.validation_timings: dict[str, float] = {}  # the syncs of validations since the last take_validation_timings
        self.set_up_weight_sync(cfg)

    def set_up_weight_sync(self, cfg: DictConfig) -> None:
        """The weight-sync group: trainer rank 0 hosts it, every rollout rank joins; the buckets are planned
        from the policy's weight stream."""
        rollout = cfg.actor_rollout_ref.rollout
        host, port = self.trainer.call("open_weight_sync")
        shapes = self.trainer.call("weight_shapes")
        device = torch.device("cuda" if self.trainer.device_kind == "cuda" else "cpu")
        manifest = WeightManifest.plan(shapes, engine_dtype(rollout, device),
                                       bucket_bytes(rollout.checkpoint_engine.update_weights_bucket_megabytes))
        size = 1 + self.rollout.world_size
        wait_all([group.submit("join_weight_sync", host, port, size, manifest) for group in (self.trainer, self.rollout)])
        log.info("separate_async: %d trainer rank(s), %d rollout rank(s); weights of %.2f GB sync in %d bucket(s)",
                 self.trainer.world_size, self.rollout.world_size, manifest.num_bytes / 1e9, len(manifest.buckets))

    def sync(self, version: int, timings: dict[str, float]) -> None:
        """The trainer's weights (policy ``version``) into the rollout ranks' engines, unless they hold them."""
        if self.rollout_version == version:
            return
        start = time.perf_counter()
        wait_all([self.trainer.submit("send_weights"), self.rollout.submit("receive_weights")])
        timings["update_weights"] = timings.get("update_weights", 0.0) + time.perf_counter() - start
        self.rollout_version = version

    def prepare(self, step: int, timings: dict[str, float]) -> None:
        """Before step ``step``'s groups are taken: with no call in flight for it (the run's first step, a resumed
        run's), sync the weights of version step - 1 and start one."""
        if self.in_flight is None:
            self.sync(engine_version(step), timings)
            self.launch(step)

    def more_groups(self, step: int, quota: int | None, metrics: dict[str, float]) -> Batch:
        """A further call of dynamic sampling at ``step``, under the weights of version step - 1."""
        return self.batches.finish(self.batches.start(step, quota=quota, extra=True, version=self.rollout_version),
                                   metrics)

    def launch(self, step: int) -> None:
        """Start the call for ``step``'s groups under the weights the rollout ranks hold."""
        self.in_flight = (self.batches.start(step, version=self.rollout_version), time.perf_counter())

    def launch_next(self, step: int, last_step: int) -> None:
        """Start step + 1's call while step ``step`` scores and trains (once; none after ``last_step``)."""
        if self.in_flight is None and step < last_step:
            self.launch(step + 1)

    def take(self, metrics: dict[str, float]) -> Batch:
        """The groups of the call in flight (the step's first batch); which side waited for the other
        (``PipelineBalance``; not for a call a validation already waited for)."""
        call, launched = self.in_flight
        self.in_flight = None
        asked, before = time.perf_counter(), metrics.get("async/generation_s", 0.0)
        batch = self.batches.finish(call, metrics)
        if launched is not None:
            wait = time.perf_counter() - asked
            hint = self.balance.observe(launched, asked, metrics.get("async/generation_s", 0.0) - before, wait,
                                        metrics)
            if hint is not None:
                log.warning(hint)
        return batch

    def generate(self, prompts: Batch, version: int) -> Batch:
        """Validation's responses under policy ``version`` (the trainer's newest): the call in flight is waited for
        first (its result kept for its step, its groups still admitted), the weights synced, then the rollout
        ranks generate (this sync's time goes to ``take_validation_timings``, not the step's)."""
        if self.in_flight is not None:
            self.in_flight = (DoneCall(self.in_flight[0].result()), None)
        self.sync(version, self.validation_timings)
        return self.rollout.call("generate_sequences", prompts)

    def take_validation_timings(self) -> dict[str, float]:
        """The weight syncs validations made since the last call, as ``timing_s/testing_update_weights``."""
        seconds = self.validation_timings.pop("update_weights", None)
        return {} if seconds is None else {"timing_s/testing_update_weights": seconds}

    def shutdown(self) -> None:
        """Stop both groups, and Ray if this run started it (``stop_groups``)."""
        stop_groups([self.rollout, self.trainer], self.owns_ray)


def stop_groups(groups: list[RayWorkerGroup], owns_ray: bool) -> None:
    """Stop ``groups`` in order (the rollout ranks first: they may wait on a sync the trainer's ranks no longer
    serve), then Ray when this run started it."""
    for group in groups:
        group.shutdown()
    if owns_ray:
        import ray

        ray.shutdown()
