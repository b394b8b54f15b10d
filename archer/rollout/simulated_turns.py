"""For benchmarks only: agentic turns scripted over a random-weight model, which never stops by itself nor writes a
tool call, so that a benchmark of the agentic loop (bench/agentic_rollout.py) or of a whole tool-using training
run (bench/async_rl.py --recipe arpo) sees a real run's turns: responses of long-tailed lengths, some of whose
turns end in a call of the Python tool.

Set ``ARCHER_SIMULATED_TURNS=median=M,sigma=S,limit=L,tool_rate=R`` (optional ``later_rate=R2``, default 0.3, and
``calls=C``, default 3) and every session of the fast engine is scripted: a response's length is drawn from a
log-normal (median M tokens, shape S, clipped to 16..L) from its sequence's seed; its first turn ends in a call
with probability R, each later turn with R2 (at most C calls), after 16 tokens to half of what is left; the call's
text (``<python>print(N)</python>``, N drawn) is appended to the turn as the model's tokens (log-prob 0, the turn's
mean entropy), so the loop runs the tool and the engine prefills the call with the answer. Every other token is
the model's own sample. A fork (ARPO's branch) draws its own length past what its parent holds; a turn paused
by the asynchronous modes continues as planned when submitted again. Unset (the
default), nothing changes.
"""

from __future__ import annotations

import functools
import math
import os
import random
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from archer.errors import ArcherError
from archer.rollout.base import ContinuousSession, DecodeCounters, SamplingParams, Segment

ENV = "ARCHER_SIMULATED_TURNS"
SHORTEST = 16  # tokens: the shortest drawn response, and the fewest a turn writes before its call


@dataclass(frozen=True)
class TurnScript:
    """How responses end and which turns call the tool, drawn per sequence from its seed."""

    median: float
    sigma: float
    limit: int
    tool_rate: float
    later_rate: float = 0.3
    calls: int = 3

    def length(self, rng: random.Random) -> int:
        """A response's drawn length in tokens."""
        return min(self.limit, max(SHORTEST, round(math.exp(rng.gauss(math.log(self.median), self.sigma)))))

    def call_ids(self, rng: random.Random, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """A call's tokens."""
        return tokenizer.encode(f"<python>print({rng.randrange(10**6)})</python>", add_special_tokens=False)


class _Plan:
    """One sequence's script: its response length, the tokens it holds, its calls, and the turn under way."""

    def __init__(self, rng: random.Random, total: int, held: int = 0, calls: int = 0) -> None:
        self.rng, self.total, self.held, self.calls = rng, total, held, calls
        self.call: list[int] | None = None  # the call text the turn under way ends with
        self.cap = 0  # the tokens the turn under way samples (less what it sampled before a pause)
        self.paused = False  # the turn under way was paused: its next submit continues it


class ScriptedTurns(ContinuousSession):
    """An engine session whose turns end where the script says (see the module docstring)."""

    def __init__(self, inner: ContinuousSession, script: TurnScript, tokenizer: PreTrainedTokenizerBase) -> None:
        self.inner, self.script, self.tokenizer = inner, script, tokenizer
        self.plans: dict[int, _Plan] = {}

    def add(self, prompt: list[int], seed: int) -> int:
        seq = self.inner.add(prompt, seed)
        rng = random.Random(seed)
        self.plans[seq] = _Plan(rng, self.script.length(rng))
        return seq

    def fork(self, seq: int, seed: int) -> int:
        child = self.inner.fork(seq, seed)
        parent, rng = self.plans[seq], random.Random(seed)
        total = max(self.script.length(rng), parent.held + SHORTEST)  # a branch's own length, past what it holds
        self.plans[child] = _Plan(rng, min(total, self.script.limit), parent.held, parent.calls)
        return child

    def extend(self, seq: int, tokens: list[int]) -> None:
        self.inner.extend(seq, tokens)
        self.plans[seq].held += len(tokens)

    def release(self, seq: int) -> None:
        self.inner.release(seq)
        del self.plans[seq]

    def tokens(self, seq: int) -> list[int]:
        return self.inner.tokens(seq)

    def submit(self, seq: int, params: SamplingParams, max_new_tokens: int, lookback: int = 0) -> None:
        plan, script = self.plans[seq], self.script
        if plan.paused:  # the rest of the turn, as planned
            plan.paused = False
            self.inner.submit(seq, params, min(plan.cap, max_new_tokens), lookback)
            return
        left = max(1, plan.total - plan.held)
        rate = script.tool_rate if plan.calls == 0 else script.later_rate
        plan.call = None
        if plan.calls < script.calls and left > 3 * SHORTEST and plan.rng.random() < rate:
            plan.call = script.call_ids(plan.rng, self.tokenizer)
            left = plan.rng.randint(SHORTEST, left // 2)
            if left + len(plan.call) >= max_new_tokens:
                plan.call, left = None, max(1, plan.total - plan.held)
        plan.cap = min(left, max_new_tokens)
        self.inner.submit(seq, params, plan.cap, lookback)

    def poll(self) -> list[tuple[int, Segment]]:
        return [(seq, self._scripted(seq, segment)) for seq, segment in self.inner.poll()]

    def _scripted(self, seq: int, segment: Segment) -> Segment:
        """A turn that reached its drawn cap ends as the script says: with its call, or as the response's end."""
        plan = self.plans[seq]
        if segment.finish_reason == "length" and len(segment.tokens) == plan.cap:
            if plan.call is not None:  # the turn writes its call
                self.inner.extend(seq, plan.call)
                pad = torch.full((len(plan.call),), float(segment.entropies.mean()))
                segment = Segment(segment.tokens + plan.call, torch.cat([segment.log_probs, torch.zeros_like(pad)]),
                                  torch.cat([segment.entropies, pad]), "stop")
                plan.calls += 1
            elif plan.held + plan.cap >= plan.total:  # the response ends where it was drawn to
                segment = Segment(segment.tokens, segment.log_probs, segment.entropies, "eos")
        plan.held += len(segment.tokens)
        return segment

    def pause(self) -> list[tuple[int, Segment]]:
        paused = self.inner.pause()
        for seq, segment in paused:
            plan = self.plans[seq]
            plan.held += len(segment.tokens)
            plan.cap = max(1, plan.cap - len(segment.tokens))
            plan.paused = True
        return paused

    @property
    def busy(self) -> bool:
        return self.inner.busy

    def expect(self, rows: int) -> None:
        self.inner.expect(rows)

    def counters(self) -> DecodeCounters:
        return self.inner.counters()

    def restart_peak(self) -> None:
        self.inner.restart_peak()


def from_environment() -> TurnScript | None:
    """The script ``ARCHER_SIMULATED_TURNS`` asks for now (None when it is unset)."""
    text = os.environ.get(ENV, "").strip()
    return _parsed(text) if text else None


@functools.cache
def _parsed(text: str) -> TurnScript:
    fix = ("set it as median=M,sigma=S,limit=L,tool_rate=R[,later_rate=R2][,calls=C] (e.g. "
           "median=512,sigma=0.84,limit=2048,tool_rate=0.5), or unset it")
    try:
        fields = dict(part.split("=", 1) for part in text.split(","))
        script = TurnScript(float(fields.pop("median")), float(fields.pop("sigma")), int(fields.pop("limit")),
                            float(fields.pop("tool_rate")), float(fields.pop("later_rate", 0.3)),
                            int(fields.pop("calls", 3)))
    except (KeyError, ValueError) as e:
        raise ArcherError(f"{ENV}={text!r} cannot be read ({e})", fix) from None
    if fields:
        raise ArcherError(f"{ENV}={text!r}: unknown field(s) {sorted(fields)}", fix)
    rates_ok = 0 <= script.tool_rate <= 1 and 0 <= script.later_rate <= 1
    if script.median <= 0 or script.sigma < 0 or script.limit < SHORTEST or not rates_ok or script.calls < 0:
        raise ArcherError(f"{ENV}={text!r}: median must be > 0, sigma >= 0, limit >= {SHORTEST}, the rates in "
                          "[0, 1] and calls >= 0", "fix the values")
    return script
