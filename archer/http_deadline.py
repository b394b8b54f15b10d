"""HTTP requests with a deadline for the whole request, not for each read.

httpx's timeouts bound each network operation: a server that sends a byte every half second holds a request for
as long as it likes under a 2 s read timeout. ``DeadlineClient.post`` bounds the whole request (connect, TLS,
sending, the headers and the body): each connection's socket is taken from httpx's ``trace`` extension as it
opens, and when the deadline passes a timer shuts it down (the blocked read returns at once), so the call raises
``TimeoutError`` within the deadline plus a few milliseconds. Connections are not kept alive between requests:
a reused connection opens no socket the trace could hand over.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import httpx


class _Watch:
    """The sockets of one request; ``expire`` shuts them down (and any opened later)."""

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []
        self.expired = False
        self._lock = threading.Lock()

    def trace(self, event: str, info: dict[str, Any]) -> None:
        if event != "connection.connect_tcp.complete":
            return
        sock = info["return_value"].get_extra_info("socket")
        if sock is None:
            return
        with self._lock:
            self.sockets.append(sock)
            if self.expired:
                _shut(sock)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self.sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # closed already: the request ended
        sock.shutdown(socket.SHUT_RDWR)


class DeadlineClient:
    """An httpx client whose requests end within ``timeout`` seconds each, whatever the server does."""

    def __init__(self, timeout: float) -> None:
        self.timeout = float(timeout)
        self._client = httpx.Client(timeout=self.timeout, limits=httpx.Limits(max_keepalive_connections=0))

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        """``httpx.Client.post`` within the deadline; ``TimeoutError`` naming the URL past it."""
        watch = _Watch()
        timer = threading.Timer(self.timeout, watch.expire)
        timer.daemon = True
        start = time.monotonic()
        timer.start()
        try:
            return self._client.post(url, extensions={"trace": watch.trace}, **kwargs)
        except httpx.HTTPError as e:
            if watch.expired or time.monotonic() - start >= self.timeout:
                raise TimeoutError(f"{url} timed out: the request did not end within {self.timeout:g} s") from e
            raise
        finally:
            timer.cancel()

    def close(self) -> None:
        self._client.close()
