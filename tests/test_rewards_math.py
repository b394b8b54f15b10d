"""Tests of archer.rewards.math: answer extraction, the numeric fast path, math-verify in a worker."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from archer.rewards import math as math_reward
from archer.rewards.math import answers_match, compute_math_score, extract_boxed

pytestmark = pytest.mark.serial  # asserts wall-clock bounds: `make test` runs it alone


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\sqrt{a_{1}}+{b}}", r"\sqrt{a_{1}}+{b}"),
        (r"x \boxed{9} <answer>final \boxed{7}</answer> \boxed{8}", "7"),
        (r"<answer>one</answer> \boxed{3} <answer>two \boxed{4}</answer>", "4"),
        (r"<answer>no box here</answer> earlier \boxed{5}", "5"),
        (r"the answer is \boxed 42.", "42"),
        (r"$\boxed 42$", "42"),
        (r"\fbox{6}", "6"),
        (r"\boxed{unclosed {", None),
        ("no box at all", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.fixture(autouse=True)
def one_verify_worker() -> None:
    """The module's pool as a fresh process has it (one worker: _WORKER), whatever earlier tests resized it to."""
    math_reward.set_verify_workers(1)


@pytest.fixture
def no_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if math-verify's worker is consulted: the case must be decided by the fast path."""

    def fail(*args: object) -> bool:
        raise AssertionError("the numeric fast path should have decided this case")

    monkeypatch.setattr(math_reward._WORKER, "equivalent", fail)


@pytest.mark.parametrize(
    ("solution", "gold", "score"),
    [
        (r"\boxed{64}", "64", 1.0),
        (r"\boxed{65}", "64", 0.0),
        (r"\boxed{1,234}", "1234", 1.0),
        (r"\boxed{-7}", "-7", 1.0),
        (r"\boxed{64.0}", "64", 1.0),
        (r"\boxed{0.5}", "0.50", 1.0),
        ("Natalia sold 48+24 = 72 clips.\n#### 72", "72", 1.0),
        (r"\boxed{72}", "She sold 48/2 = 24 in May.\n#### 72", 1.0),
        ("no final answer", "72", 0.0),
        (r"\boxed{}", "72", 0.0),
    ],
)
def test_plain_numbers_use_the_fast_path(no_worker: None, solution: str, gold: str, score: float) -> None:
    assert compute_math_score(solution, gold) == score


@pytest.mark.parametrize(
    ("pred", "gold", "match"),
    [
        (r"\frac{1}{2}", "0.5", True),
        (r"-6+3\sqrt{3}", r"3\sqrt{3} - 6", True),
        ("1+274i", "1+274i", True),
        (r"[4, \infty)", r"[4,\infty)", True),
        (r"\frac{1}{3}", "0.5", False),
        ("x+1", "x+2", False),
    ],
)
def test_symbolic_answers_go_to_math_verify(pred: str, gold: str, match: bool) -> None:
    assert answers_match(pred, gold) is match
    assert compute_math_score(f"<answer>\\boxed{{{pred}}}</answer>", gold) == float(match)


def test_hostile_answer_times_out_and_the_worker_recovers() -> None:
    assert compute_math_score(r"\boxed{\frac{2}{4}}", "0.5") == 1.0  # worker started and warm
    before = math_reward._WORKER._process
    start = time.monotonic()
    assert compute_math_score(r"\boxed{9^{9^{9^{9^{9}}}}}", r"10^{10}", timeout_s=0.5) == 0.0
    assert time.monotonic() - start < 2.0
    assert math_reward._WORKER._process is None and before is not None and before.poll() is not None
    assert compute_math_score(r"\boxed{\sqrt{4}}", "2") == 1.0  # a fresh worker answers


def test_concurrent_callers_get_their_own_answers() -> None:
    cases = [
        (r"\boxed{\frac{3}{6}}", "0.5", 1.0),
        (r"\boxed{\sqrt{9}}", "3", 1.0),
        (r"\boxed{\pi}", "3", 0.0),
    ] * 3
    results: list[float | None] = [None] * len(cases)

    def score(i: int) -> None:
        results[i] = compute_math_score(cases[i][0], cases[i][1])

    threads = [threading.Thread(target=score, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [c[2] for c in cases]


def test_a_forked_process_starts_its_own_worker() -> None:
    assert compute_math_score(r"\boxed{\frac{1}{4}}", "0.25") == 1.0
    parent_worker = math_reward._WORKER._process
    pid = os.fork()
    if pid == 0:  # child: exit code 0 only if it scored correctly with a worker of its own
        ok = (
            compute_math_score(r"\boxed{\sqrt{16}}", "4") == 1.0
            and math_reward._WORKER._process is not parent_worker
        )
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert math_reward._WORKER._process is parent_worker
    assert compute_math_score(r"\boxed{\sqrt{25}}", "5") == 1.0


def test_the_verify_pool_scores_in_parallel_processes_and_caches_verdicts() -> None:
    pool = math_reward._VerifyPool()
    pool.resize(2)
    try:
        pool.warm()
        pids = {w._process.pid for w in pool._workers}
        assert len(pids) == 2 and os.getpid() not in pids
        pairs = [("0.5", rf"\frac{{{i}}}{{{2 * i}}}") for i in range(1, 7)] + [("3", r"\sqrt{8}")]
        with ThreadPoolExecutor(4) as threads:
            verdicts = list(threads.map(lambda p: pool.equivalent(*p, 5.0), pairs * 2))
        assert verdicts == [True] * 6 + [False] + [True] * 6 + [False]
        assert set(pool._cache) == {math_reward.verdict_key(*p) for p in pairs} and not pool._pending
        assert {w._process.pid for w in pool._workers} == pids  # no worker was replaced
    finally:
        pool.close()


def test_a_timeout_is_not_cached_and_the_worker_memory_is_capped() -> None:
    pool = math_reward._VerifyPool()
    try:
        hostile = ("10", r"9^{9^{9^{9^{9}}}}")
        assert pool.equivalent(*hostile, 0.5) is None  # killed past the limit: no verdict, nothing cached
        assert math_reward.verdict_key(*hostile) not in pool._cache
        assert pool.equivalent("2", r"\sqrt{4}", 5.0) is True
        limits = Path(f"/proc/{pool._workers[0]._process.pid}/limits").read_text()
        (line,) = [x for x in limits.splitlines() if x.startswith("Max address space")]
        assert line.split()[3] == str(math_reward.VERIFY_MEMORY_MB * 1024 * 1024)
    finally:
        pool.close()


class CountingWorker:
    """A verify worker that answers at once and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def equivalent(self, gold: str, pred: str, timeout_s: float) -> bool:
        self.calls += 1
        return False


def test_the_verdict_cache_holds_digests_not_the_answers() -> None:
    # at capacity, 100 KB answers used to take ~9 GB of keys
    pool = math_reward._VerifyPool()
    worker = CountingWorker()
    pool._workers, pool._idle = [worker], math_reward.queue.SimpleQueue()
    pool._idle.put(worker)
    answers = [f"{i}" + "x" * 100_000 for i in range(3)]
    assert [pool.equivalent("5", a, 5.0) for a in answers + answers] == [False] * 6
    assert worker.calls == 3  # the repeats are cache hits
    assert list(pool._cache) == [math_reward.verdict_key("5", a) for a in answers]
    assert all(len(key) == 16 for key in pool._cache) and not pool._pending
