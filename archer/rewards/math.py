"""Math reward: extract the final answer of a response and check it against the gold answer.

The answer is the last ``\\boxed{...}`` (searched in the last ``<answer>`` block first), or, for
GSM8K-style prompts, the number after the last ``####``. Plain numbers are compared directly; anything
else goes to math-verify (``verify(parse(gold), parse(pred))``, gold first), which runs in a separate
worker process so that a hostile answer (a tower of exponents, deeply nested LaTeX) can never hang the
caller: past the time limit the worker is killed, restarted on the next call, and the answer scores 0.
The worker's memory is capped too (math_worker.py). ``set_verify_workers(n)`` lets n callers (threads) verify
at once in n processes; verdicts are cached per (gold, answer) (a timeout is not: it is tried again), keyed by a
16-byte digest, so that the cache's size does not grow with the answers' length.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path

from archer.errors import ArcherError
from archer.tagged_text import last_tag_block

DEFAULT_TIMEOUT_S = 5.0
VERIFY_MEMORY_MB = 1024  # address-space cap of a math-verify worker process
_STARTUP_TIMEOUT_S = 120.0
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_HASHES_ANSWER = re.compile(r"####\s*([^\n]+)")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_UNBRACED_END = re.compile(r"[\s$]")


# -- extraction -----------------------------------------------------------------------------------
def _braced_content(text: str, open_at: int) -> str | None:
    """The text inside the brace group that opens at ``open_at``, or None when it never closes."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    after = start + len(cmd)
    if text.startswith("{", after):
        return _braced_content(text, after)
    if text.startswith(" ", after):
        rest = text[after:].lstrip(" ")
        end = _UNBRACED_END.search(rest)
        content = (rest if end is None else rest[: end.start()]).rstrip(".,;")
        return content or None
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces kept; ``\\boxed 5`` accepted).

    The last ``<answer>...</answer>`` block is searched first, then the whole text. None when no
    complete box is found. A sentence's final period after an unbraced box is not part of it.
    """
    block = last_tag_block(text, "<answer>", "</answer>")
    if block is not None:
        found = _last_boxed(block)
        if found is not None:
            return found
    return _last_boxed(text)


def extract_prediction(text: str) -> str | None:
    """The final answer of a response: the last box (see ``extract_boxed``), else the text after the last ``####``."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    hashes = _HASHES_ANSWER.findall(text)
    return hashes[-1].strip() if hashes else None


def _gold_answer(ground_truth: str) -> str:
    """The gold answer: text after ``####`` (GSM8K) or inside a box when the gold is a full solution."""
    if "####" in ground_truth:
        return ground_truth.split("####")[-1].strip()
    return (extract_boxed(ground_truth) or ground_truth).strip()


def plain_number(text: str) -> Decimal | None:
    """``text`` as a Decimal when it is a plain number (``-1,234.5``), else None."""
    text = text.strip()
    if _PLAIN_NUMBER.fullmatch(text) is None:
        return None
    return Decimal(text.replace(",", ""))


# -- math-verify worker process -------------------------------------------------------------------
def _read_line(process: subprocess.Popen[bytes], timeout_s: float) -> str | None:
    """One line from the worker, or None when none arrives within ``timeout_s`` or the worker died."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    buffer = b""
    while not buffer.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        buffer += chunk
    return buffer.decode()


class _VerifyWorker:
    """One ``archer.rewards.math_worker`` process, started lazily and replaced after a timeout or crash."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None

    def forget_after_fork(self) -> None:
        """In a forked child: drop the parent's worker and lock; the child starts its own worker."""
        if self._process is not None:
            for pipe in (self._process.stdin, self._process.stdout):
                if pipe is not None:
                    pipe.close()  # the child's copies only; the parent keeps talking to its worker
        self._lock = threading.Lock()
        self._process = None

    def _start(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)
        process = subprocess.Popen(
            [sys.executable, "-m", "archer.rewards.math_worker", "--max-memory-mb", str(VERIFY_MEMORY_MB)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env=env,
        )
        line = _read_line(process, _STARTUP_TIMEOUT_S)
        status = None if line is None else json.loads(line)
        if status != "ready":
            self._kill(process)
            problem = (
                f"the math-verify worker process did not start within {_STARTUP_TIMEOUT_S:.0f}s"
                if status is None
                else f"the math-verify worker could not import math_verify ({status['error']})"
            )
            raise ArcherError(
                problem, "check that `python -c 'import math_verify'` works (pip install math-verify)"
            )
        self._process = process
        return process

    @staticmethod
    def _kill(process: subprocess.Popen[bytes]) -> None:
        process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()

    def close(self) -> None:
        """Stop the worker (it is restarted by the next call)."""
        with self._lock:
            if self._process is not None:
                self._kill(self._process)
            self._process = None

    def start_if_stopped(self) -> subprocess.Popen[bytes]:
        """The running process, started first when there is none (callers hold the lock, or own the worker)."""
        process = self._process
        if process is None or process.poll() is not None:
            process = self._start()
        return process

    def equivalent(self, gold: str, pred: str, timeout_s: float) -> bool | None:
        """The worker's verdict; None when it ran past ``timeout_s`` (or died) and was killed."""
        with self._lock:
            process = self.start_if_stopped()
            request = {"gold": gold, "pred": pred, "stage_timeout": max(1, int(timeout_s / 3))}
            assert process.stdin is not None
            try:
                process.stdin.write((json.dumps(request) + "\n").encode())
                line = _read_line(process, timeout_s)
            except OSError:
                line = None
            if line is not None:
                return bool(json.loads(line))
            self._kill(process)
            self._process = None
            return None


def verdict_key(gold: str, pred: str) -> bytes:
    """The cache key of a (gold, answer) pair: a digest, whatever the answer's length (hostile ones run to 100 KB)."""
    pair = json.dumps([gold, pred]).encode()  # JSON: unambiguous, and any str encodes (lone surrogates escaped)
    return hashlib.blake2b(pair, digest_size=16).digest()


class _VerifyPool:
    """Up to ``size`` verify workers, each serving one caller at a time: concurrent callers (the evaluator's
    scoring threads) verify in parallel processes. Workers start on first use; a verdict (a timeout's False
    included) is cached per (gold, pred), so a repeated answer, hostile or not, costs one verification. The cache
    holds ``CACHE_SIZE`` digests and verdicts (a few MB), not the answers."""

    CACHE_SIZE = 100_000

    def __init__(self) -> None:
        self._workers = [_VerifyWorker()]
        self._idle: queue.SimpleQueue[_VerifyWorker] = queue.SimpleQueue()
        self._idle.put(self._workers[0])
        self._cache: OrderedDict[bytes, bool] = OrderedDict()
        self._pending: dict[bytes, Future[bool | None]] = {}  # pairs being verified now
        self._cache_lock = threading.Lock()

    @property
    def size(self) -> int:
        return len(self._workers)

    def resize(self, size: int) -> None:
        """Keep ``size`` workers (the first stays; the others are stopped). Call it while nothing is verifying."""
        if size < 1:
            raise ValueError("the verify pool needs at least one worker")
        for worker in self._workers[1:]:
            worker.close()
        self._workers = self._workers[:1] + [_VerifyWorker() for _ in range(size - 1)]
        self._idle = queue.SimpleQueue()
        for worker in self._workers:
            self._idle.put(worker)

    def warm(self) -> None:
        """Start every worker's process now (in parallel), rather than on first use."""
        with ThreadPoolExecutor(len(self._workers)) as pool:
            list(pool.map(lambda w: w.start_if_stopped(), self._workers))

    def clear_cache(self) -> None:
        with self._cache_lock:
            self._cache.clear()

    def forget_after_fork(self) -> None:
        """In a forked child: every worker is idle and has no process; the child starts its own."""
        for worker in self._workers:
            worker.forget_after_fork()
        self._idle = queue.SimpleQueue()
        for worker in self._workers:
            self._idle.put(worker)
        self._pending = {}
        self._cache_lock = threading.Lock()

    def close(self) -> None:
        for worker in self._workers:
            worker.close()

    def equivalent(self, gold: str, pred: str, timeout_s: float) -> bool | None:
        """The verdict (None: timed out; not cached, so a later call tries again)."""
        key = verdict_key(gold, pred)
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            pending = self._pending.get(key)
            owner = pending is None
            if owner:  # the first caller verifies; a concurrent caller of the same pair waits for its verdict
                pending = self._pending[key] = Future[bool | None]()
        if not owner:
            return pending.result()
        try:
            worker = self._idle.get()
            try:
                verdict = worker.equivalent(gold, pred, timeout_s)
            finally:
                self._idle.put(worker)
        except BaseException as exc:
            with self._cache_lock:
                del self._pending[key]
            pending.set_exception(exc)
            raise
        with self._cache_lock:
            if verdict is not None:
                self._cache[key] = verdict
            del self._pending[key]
            if len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        pending.set_result(verdict)
        return verdict


_POOL = _VerifyPool()
_WORKER = _POOL._workers[0]  # the first worker (the only one unless set_verify_workers raised the size)
atexit.register(_POOL.close)
os.register_at_fork(after_in_child=_POOL.forget_after_fork)


def set_verify_workers(size: int) -> None:
    """How many math-verify processes may verify at once (default 1); call it while nothing is scoring."""
    if size != _POOL.size:
        _POOL.resize(size)


def answers_match(pred: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether ``pred`` equals ``gold``: numerically for plain numbers, else by math-verify.

    math-verify runs in a worker process; past ``timeout_s`` seconds it is killed and the answer
    does not match.
    """
    pred_number, gold_number = plain_number(pred), plain_number(gold)
    if pred_number is not None and gold_number is not None:
        return pred_number == gold_number
    if not pred.strip():
        return False
    return bool(_POOL.equivalent(gold, pred, timeout_s))


def compute_math_score(solution_str: str, ground_truth: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 when the response's final answer equals the gold answer, else 0.0."""
    pred = extract_prediction(solution_str)
    if pred is None:
        return 0.0
    return 1.0 if answers_match(pred, _gold_answer(str(ground_truth)), timeout_s) else 0.0
