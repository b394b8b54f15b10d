"""Which Ray the worker groups run on: the cluster at ``RAY_ADDRESS``, or a local Ray that archer starts, binds to
the loopback interface and stops (docs/many_gpus.md, "Which ports Ray binds").

- ``RAY_ADDRESS`` (``host:6379``, or ``auto`` for a cluster started on this machine with ``ray start --head``):
  connect to that running cluster (something must answer there first) and leave it running at the end.
- Otherwise a local Ray for this run: its node address is ``127.0.0.1``, so that the GCS, the raylet, the agents
  and every worker listen on the loopback interface only (Ray binds its servers to every interface unless the
  node's address is the loopback one, and ``ray.init`` replaces a loopback ``_node_ip_address`` by the machine's
  own address unless Ray's switch for clusters, ``ENABLE_RAY_CLUSTER``, is off while it starts); no dashboard
  unless ``ray_kwargs.ray_init.include_dashboard`` (then on ``dashboard_host``, ``127.0.0.1`` by default); at
  least one logical CPU per rank (``ray_kwargs.ray_init.num_cpus`` otherwise).
- After ``ray.init``, a SIGTERM raises ``Terminated(143)`` (a KeyboardInterrupt) in the driver in place of Ray's
  own handler (which exits with 15): the trainer's ``finally`` blocks stop the worker groups and the Ray that
  archer started, as they do on an error and on Ctrl-C, and the process ends with the shell's code for SIGTERM.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from archer.errors import ArcherError

log = logging.getLogger("archer.controller")

LOOPBACK = "127.0.0.1"
RAY_INIT = "ray_kwargs.ray_init"


def import_ray(world: int) -> Any:
    """Ray, or one clear error naming the install command when it is missing."""
    try:
        import ray
    except ImportError as exc:
        raise ArcherError(
            f"training on {world} ranks (trainer.nnodes x trainer.n_gpus_per_node) runs on Ray, "
            f"which is not installed ({exc})",
            'pip install "archer[ray]", or set trainer.nnodes=1 trainer.n_gpus_per_node=1 for one device',
        ) from None
    return ray


@dataclass(frozen=True)
class LocalRay:
    """verl's ``ray_kwargs.ray_init`` keys that archer acts on, for the local Ray it starts: logical CPUs (None:
    the machine's, at least one a rank) and the dashboard (off by default; on ``dashboard_host``)."""

    num_cpus: int | None = None
    include_dashboard: bool = False
    dashboard_host: str = LOOPBACK
    dashboard_port: int | None = None

    @classmethod
    def from_config(cls, ray_init: Mapping[str, Any]) -> LocalRay:
        """The settings of ``ray_kwargs.ray_init``, each checked."""
        known = ("num_cpus", "include_dashboard", "dashboard_host", "dashboard_port")
        unknown = sorted(set(ray_init) - set(known))
        if unknown:
            raise ArcherError(f"{RAY_INIT}.{unknown[0]}: archer starts Ray with {', '.join(known)} only",
                              f"drop {RAY_INIT}.{unknown[0]}, or start Ray yourself with it (`ray start --head ...`) "
                              "and set RAY_ADDRESS")
        settings = cls(**dict(ray_init))
        for key in ("num_cpus", "dashboard_port"):
            value = getattr(settings, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ArcherError(f"{RAY_INIT}.{key}={value!r} must be a whole number >= 1 or null",
                                  f"set {RAY_INIT}.{key}=null for Ray's choice")
        if not isinstance(settings.include_dashboard, bool):
            raise ArcherError(f"{RAY_INIT}.include_dashboard={settings.include_dashboard!r} must be true or false",
                              f"set {RAY_INIT}.include_dashboard=false (the default: no dashboard)")
        if not isinstance(settings.dashboard_host, str) or not settings.dashboard_host:
            raise ArcherError(f"{RAY_INIT}.dashboard_host={settings.dashboard_host!r} must be an address",
                              f"set {RAY_INIT}.dashboard_host=127.0.0.1 (this machine only) or 0.0.0.0 (every "
                              "interface)")
        return settings

    def init_kwargs(self, world: int) -> dict[str, Any]:
        """``ray.init``'s keywords for these settings and ``world`` ranks."""
        kwargs: dict[str, Any] = {"num_cpus": self.num_cpus or max(world, os.cpu_count() or 1),
                                  "include_dashboard": self.include_dashboard}
        if self.include_dashboard:
            kwargs["dashboard_host"] = self.dashboard_host
            if self.dashboard_port is not None:
                kwargs["dashboard_port"] = self.dashboard_port
        return kwargs


def connect_ray(world: int, *, object_store_memory: int | None = None, local: LocalRay | None = None) -> bool:
    """Connect this process to Ray: the running cluster at ``RAY_ADDRESS`` when set, else a new local
    instance on the loopback interface (``local``'s settings). Returns whether this call started Ray (then the
    caller shuts it down); an already-initialised Ray is used as is."""
    ray = import_ray(world)
    if ray.is_initialized():
        return False
    local = local or LocalRay()
    address = os.environ.get("RAY_ADDRESS")
    try:
        if address:
            check_ray_address(address)
            if local != LocalRay():
                log.warning("%s applies to the Ray that archer starts; the cluster at RAY_ADDRESS=%s keeps the "
                            "settings it was started with (ray start's own flags)", RAY_INIT, address)
            ray.init(address=address, log_to_driver=True)
        else:
            # "local": a new instance even where `ray start` left a cluster on this machine (ray.init's default
            # joins it through Ray's ray_current_cluster file, then refuses num_cpus)
            with loopback_node():
                ray.init(address="local", object_store_memory=object_store_memory, log_to_driver=True,
                         **local.init_kwargs(world))
    except ConnectionError as exc:
        raise ArcherError(f"cannot connect to the Ray cluster at RAY_ADDRESS={address}: {exc}",
                          "check `ray status` on the head node, or unset RAY_ADDRESS to start a local Ray") from None
    exit_on_sigterm()
    return True


@contextmanager
def loopback_node() -> Iterator[None]:
    """Ray started inside this block takes ``127.0.0.1`` as its node's address (every server it starts then
    listens on the loopback interface only): Ray's switch for clusters off meanwhile."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def alive_nodes() -> list[str]:
    """The node ids of the connected cluster's live nodes."""
    import ray

    return [node["NodeID"] for node in ray.nodes() if node.get("Alive")]


def places_by_label() -> bool:
    """Whether this Ray's placement groups take a label selector per bundle (``bundle_label_selector``)."""
    from ray.util.placement_group import placement_group

    return "bundle_label_selector" in inspect.signature(placement_group).parameters


class Terminated(KeyboardInterrupt):
    """A SIGTERM, raised in the driver's main thread: ``code`` is the shell's 128 + 15. A KeyboardInterrupt, so
    that Ray's blocking calls give it up as they give up Ctrl-C (an exception of another kind raised while
    ``ray.get`` waits ended the process with 1 and no message)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


_received: list[int] = []  # the SIGTERMs this driver got (Ray may raise a KeyboardInterrupt of its own for one)


def _terminated(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    raise Terminated(128 + signum)


def termination(stop: KeyboardInterrupt) -> Terminated | None:
    """What ``stop`` is when a SIGTERM caused it (None: a Ctrl-C)."""
    if isinstance(stop, Terminated):
        return stop
    return Terminated(128 + _received[-1]) if _received else None


def exit_on_sigterm() -> None:
    """A SIGTERM to the driver raises ``Terminated(143)`` (in place of Ray's handler), so that
    ``finally`` blocks stop what the run started; only the main thread can set it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast when nothing listens at ``RAY_ADDRESS`` (``ray.init`` would retry for minutes); ``auto``
    (a cluster started on this machine) is left to Ray."""
    if address == "auto":
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    fix = ("start the cluster with `ray start --head --port=6379` on the head node and set "
           "RAY_ADDRESS=<head address>:6379, or unset RAY_ADDRESS to start a local Ray for this run")
    if not host or not port.isdigit():
        raise ArcherError(f"RAY_ADDRESS={address!r} is not host:port", fix)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ArcherError(f"no Ray cluster answers at RAY_ADDRESS={address} ({exc})", fix) from None
