"""Processes a test spawns (multiprocessing's spawn context): started together, and reaped whatever the test saw."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def spawned(*targets: tuple) -> Iterator[None]:
    """Start a process for each (function, args) of ``targets``; at the end of the block join each for up to 30 s
    and kill the ones still running."""
    context = mp.get_context("spawn")
    procs = [context.Process(target=target, args=args) for target, args in targets]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
