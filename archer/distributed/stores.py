"""The TCP stores archer's process groups meet at, each listening on one address only: torch's own store server
listens on every interface of the machine, the run's cluster ports then reach beyond the address it was given
(docs/many_gpus.md: loopback when the run's Ray is its own)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def hosted_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The store this process hosts at ``host``:``port`` (0: a free port, ``store.port``), on that address only."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family)
    return dist.TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=listener.detach())


def joined_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the store another process hosts at ``host``:``port``."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
