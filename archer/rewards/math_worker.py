"""The math-verify worker process: ``python -m archer.rewards.math_worker``.

Reads one JSON request per line on stdin (``{"gold", "pred", "stage_timeout"}``) and answers one JSON
line on its own copy of stdout: ``true`` or ``false``. The first line it writes is ``"ready"`` once
math-verify is imported and has verified one warm-up pair (so the first real request is not slowed by sympy's
lazy loading), or ``{"error": ...}`` when the import fails; it exits when stdin closes.
Anything else printed while verifying goes to stderr, so the reply channel stays clean.
``--max-memory-mb N`` caps the process's address space (RLIMIT_AS): an answer whose verification would grow
past it (a huge power expanded by sympy) fails with MemoryError and does not match, instead of taking the
machine's memory; the worker then goes on serving.
archer.rewards.math starts, times and kills this process; nothing else talks to it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import signal
import sys
from collections.abc import Callable
from typing import Any, TextIO

WARM_UP_TIMEOUT_S = 30


def _equivalent(
    parse: Callable[..., Any], verify: Callable[..., Any], gold: str, pred: str, stage_timeout: int
) -> bool:
    try:
        gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=stage_timeout)
        pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=stage_timeout)
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=stage_timeout))
    except (Exception, MemoryError):  # any failure to parse or compare means the answer does not match
        return False


def _reply(out: TextIO, value: object) -> None:
    out.write(json.dumps(value) + "\n")
    out.flush()


def _cap_memory(max_memory_mb: int) -> None:
    if max_memory_mb > 0:
        limit = max_memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="archer.rewards.math_worker")
    parser.add_argument("--max-memory-mb", type=int, default=0, help="address-space cap (0: none)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; stdin EOF ends us
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        from math_verify import parse, verify
    except Exception as exc:
        _reply(out, {"error": f"{type(exc).__name__}: {exc}"})
        return
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    _cap_memory(args.max_memory_mb)  # after the imports, whose size is known; verification is what is bounded
    _equivalent(parse, verify, "\\frac{1}{2}", "0.5", WARM_UP_TIMEOUT_S)  # sympy's lazy parts load now, not in
    _reply(out, "ready")                                                  # the first request's time limit
    for line in sys.stdin:
        request = json.loads(line)
        _reply(out, _equivalent(parse, verify, request["gold"], request["pred"], request["stage_timeout"]))


if __name__ == "__main__":
    main()
