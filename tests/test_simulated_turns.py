"""ARCHER_SIMULATED_TURNS (archer/rollout/simulated_turns.py), the benchmarks' script of agentic turns: a scripted
session over an inner one that always decodes its whole budget, the drawn lengths and calls checked by hand, the
fast engine's sessions scripted only when the variable is set, and malformed values refused."""

from __future__ import annotations

import math
import random

import pytest
import torch

from archer.errors import ArcherError
from archer.rollout import simulated_turns
from archer.rollout.base import ContinuousSession, DecodeCounters, SamplingParams, Segment
from archer.rollout.fast import FastEngine, FastSession
from archer.rollout.simulated_turns import ScriptedTurns, TurnScript

PARAMS = SamplingParams(max_new_tokens=400, stop=("</python>",))


class WholeBudget(ContinuousSession):
    """An inner session whose every turn decodes its whole budget of token 5 (log-prob -1, entropy 2)."""

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}
        self.submitted: dict[int, int] = {}

    def add(self, prompt: list[int], seed: int) -> int:
        self.seqs[len(self.seqs)] = list(prompt)
        return len(self.seqs) - 1

    def fork(self, seq: int, seed: int) -> int:
        return self.add(self.seqs[seq], seed)

    def extend(self, seq: int, tokens: list[int]) -> None:
        self.seqs[seq] += tokens

    def release(self, seq: int) -> None:
        del self.seqs[seq]

    def tokens(self, seq: int) -> list[int]:
        return list(self.seqs[seq])

    def submit(self, seq: int, params: SamplingParams, max_new_tokens: int, lookback: int = 0) -> None:
        self.submitted[seq] = max_new_tokens

    def poll(self) -> list[tuple[int, Segment]]:
        out = [(seq, Segment([5] * n, -torch.ones(n), torch.full((n,), 2.0), "length"))
               for seq, n in self.submitted.items()]
        for seq, segment in out:
            self.seqs[seq] += segment.tokens
        self.submitted = {}
        return out

    @property
    def busy(self) -> bool:
        return bool(self.submitted)

    def pause(self) -> list[tuple[int, Segment]]:
        return []

    def counters(self) -> DecodeCounters:
        return DecodeCounters()


def drawn_length(seed: int, median: float, sigma: float, limit: int) -> int:
    rng = random.Random(seed)
    return min(limit, max(16, round(math.exp(rng.gauss(math.log(median), sigma)))))


def test_a_turn_without_a_call_ends_the_response_at_its_drawn_length(parts) -> None:
    tokenizer = parts[1]
    script = TurnScript(median=100, sigma=0.5, limit=300, tool_rate=0.0)
    session = ScriptedTurns(WholeBudget(), script, tokenizer)
    for seed in (1, 2, 3):
        seq = session.add([1, 2, 3], seed)
        session.submit(seq, PARAMS, 400)
        [(got, segment)] = session.poll()
        assert got == seq and segment.finish_reason == "eos"
        assert len(segment.tokens) == drawn_length(seed, 100, 0.5, 300)


def test_a_calling_turn_ends_with_the_call_as_the_models_tokens(parts) -> None:
    tokenizer = parts[1]
    script = TurnScript(median=200, sigma=0.0, limit=300, tool_rate=1.0, later_rate=0.0)
    session = ScriptedTurns(WholeBudget(), script, tokenizer)
    seq = session.add([1, 2, 3], seed=7)
    session.submit(seq, PARAMS, 400)
    [(_, first)] = session.poll()
    # the script's draws for seed 7, by hand: the length (sigma 0: the median), the call's coin, where it comes
    rng = random.Random(7)
    total = round(math.exp(rng.gauss(math.log(200), 0.0)))
    assert rng.random() < 1.0
    number = rng.randrange(10**6)
    before_call = rng.randint(16, total // 2)
    call = tokenizer.encode(f"<python>print({number})</python>", add_special_tokens=False)
    assert first.finish_reason == "stop" and first.tokens == [5] * before_call + call
    assert tokenizer.decode(first.tokens[before_call:]) == f"<python>print({number})</python>"
    assert first.log_probs.tolist() == [-1.0] * before_call + [0.0] * len(call)  # the call: no sampled log-prob
    assert first.entropies.tolist() == [2.0] * len(first.tokens)  # the turn's mean entropy
    answer = [9, 9, 9]
    session.extend(seq, answer)  # the tool's answer, as the loop adds it
    session.submit(seq, PARAMS, 400)
    [(_, second)] = session.poll()
    assert second.finish_reason == "eos"  # later_rate 0: no second call
    assert len(first.tokens) + len(answer) + len(second.tokens) == total


def test_fast_engine_sessions_are_scripted_only_when_the_variable_is_set(parts, monkeypatch) -> None:
    engine = FastEngine(*parts, max_num_seqs=2, page_size=16)
    monkeypatch.delenv(simulated_turns.ENV, raising=False)
    simulated_turns._parsed.cache_clear()
    assert type(engine.session()) is FastSession
    monkeypatch.setenv(simulated_turns.ENV, "median=64,sigma=0.5,limit=128,tool_rate=0.5")
    simulated_turns._parsed.cache_clear()
    try:
        session = engine.session()
        assert isinstance(session, ScriptedTurns) and isinstance(session.inner, FastSession)
        assert session.script == TurnScript(64.0, 0.5, 128, 0.5, 0.3, 3)
    finally:
        monkeypatch.delenv(simulated_turns.ENV)
        simulated_turns._parsed.cache_clear()


@pytest.mark.parametrize(("value", "message"), [
    ("median=64,sigma=0.5", "cannot be read"),
    ("median=64,sigma=0.5,limit=128,tool_rate=x", "cannot be read"),
    ("median=64,sigma=0.5,limit=128,tool_rate=0.5,speed=2", r"unknown field\(s\) \['speed'\]"),
    ("median=64,sigma=0.5,limit=8,tool_rate=0.5", "limit >= 16"),
    ("median=64,sigma=0.5,limit=128,tool_rate=1.5", "the rates in"),
])
def test_a_malformed_script_is_refused_naming_the_variable(value: str, message: str, monkeypatch) -> None:
    monkeypatch.setenv(simulated_turns.ENV, value)
    simulated_turns._parsed.cache_clear()
    try:
        with pytest.raises(ArcherError, match=message) as error:
            simulated_turns.from_environment()
        assert simulated_turns.ENV in str(error.value)
    finally:
        monkeypatch.delenv(simulated_turns.ENV)
        simulated_turns._parsed.cache_clear()
