"""Math reward: extract the final answer of a response and check it against the gold answer.

The answer is the last ``\\boxed{...}`` (searched in the last ``<answer>`` block first), or, for
GSM8K-style prompts, the number after the last ``####``. Plain numbers are compared directly; anything
else goes to math-verify (``verify(parse(gold), parse(pred))``, gold first), which runs in a separate
worker process so that a hostile answer (a tower of exponents, deeply nested LaTeX) can never hang the
caller: past the time limit the worker is killed, restarted on the next call, and the answer scores 0.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from decimal import Decimal
from pathlib import Path

from archer.errors import ArcherError
from archer.tagged_text import last_tag_block

DEFAULT_TIMEOUT_S = 5.0
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


def _extract_prediction(text: str) -> str | None:
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


def _as_plain_number(text: str) -> Decimal | None:
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
            [sys.executable, "-m", "archer.rewards.math_worker"],
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

    def equivalent(self, gold: str, pred: str, timeout_s: float) -> bool:
        with self._lock:
            process = self._process
            if process is None or process.poll() is not None:
                process = self._start()
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
            return False


_WORKER = _VerifyWorker()
atexit.register(_WORKER.close)
os.register_at_fork(after_in_child=_WORKER.forget_after_fork)


def answers_match(pred: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether ``pred`` equals ``gold``: numerically for plain numbers, else by math-verify.

    math-verify runs in a worker process; past ``timeout_s`` seconds it is killed and the answer
    does not match.
    """
    pred_number, gold_number = _as_plain_number(pred), _as_plain_number(gold)
    if pred_number is not None and gold_number is not None:
        return pred_number == gold_number
    if not pred.strip():
        return False
    return _WORKER.equivalent(gold, pred, timeout_s)


def compute_math_score(solution_str: str, ground_truth: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 when the response's final answer equals the gold answer, else 0.0."""
    pred = _extract_prediction(solution_str)
    if pred is None:
        return 0.0
    return 1.0 if answers_match(pred, _gold_answer(str(ground_truth)), timeout_s) else 0.0
