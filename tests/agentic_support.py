"""A scripted engine for tests of the agentic loop, where a real tiny model cannot write tool calls: each decode
call asks a script for the next turn of a sequence (its text, the entropy of its tokens, whether it ends with
eos) and cuts it as an engine would, at the first stop string, at eos, or at the sequence's budget. Its
continuous variant returns each submitted turn after a drawn number of polls, as a running batch would."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from archer.models.tiny import train_tokenizer
from archer.rollout.base import (
    ContinuousSession,
    EngineSession,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    Segment,
)
from archer.tools import Tool, ToolRegistry, ToolResult

CORPUS = [
    "<think>let me compute</think> <python>print(6 * 7)</python> <result>\n42\n</result> <answer>\\boxed{42}</answer>",
    "<search>capital of France</search> <result>\nPage 1: Paris is the capital.\n</result>",
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>',
    "What is six times seven? Who wrote it? The answer is here. abcdefghijklmnopqrstuvwxyz 0123456789",
]


def tokenizer():
    """A byte-level BPE with Qwen's special tokens and chat template (eos <|im_end|>)."""
    return train_tokenizer(CORPUS * 3, vocab_size=330)


@dataclass
class Turn:
    text: str
    entropy: float = 1.0
    eos: bool = False


@dataclass
class SeqState:
    prompt: list[int]
    response: list[int]
    rng: random.Random
    turns: int = 0  # decode calls this sequence (and the sequence it was forked from) answered


Script = Callable[[SeqState, "ScriptedSession"], Turn]


class ScriptedSession(EngineSession):
    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine = engine
        self.seqs: dict[int, SeqState] = {}
        self.next_id = 0
        self.decode_calls: list[list[int]] = []
        self.forks = 0

    def text(self, tokens: list[int]) -> str:
        return self.engine.tokenizer.decode(tokens, skip_special_tokens=True)

    def _new(self, state: SeqState) -> int:
        seq, self.next_id = self.next_id, self.next_id + 1
        self.seqs[seq] = state
        return seq

    def add(self, prompt: list[int], seed: int) -> int:
        return self._new(SeqState(list(prompt), [], random.Random(seed)))

    def extend(self, seq: int, tokens: list[int]) -> None:
        self.seqs[seq].response += tokens

    def fork(self, seq: int, seed: int) -> int:
        self.forks += 1
        s = self.seqs[seq]
        return self._new(SeqState(s.prompt, list(s.response), random.Random(seed), s.turns))

    def release(self, seq: int) -> None:
        del self.seqs[seq]

    def tokens(self, seq: int) -> list[int]:
        s = self.seqs[seq]
        return s.prompt + s.response

    def decode(self, seqs: list[int], params: SamplingParams, max_new_tokens: list[int]) -> list[Segment]:
        self.decode_calls.append(list(seqs))
        out = []
        tok = self.engine.tokenizer
        for seq, budget in zip(seqs, max_new_tokens, strict=True):
            state = self.seqs[seq]
            turn = self.engine.script(state, self)
            state.turns += 1
            ids = tok.encode(turn.text, add_special_tokens=False) + ([tok.eos_token_id] if turn.eos else [])
            reason, kept = "length", []
            for i in ids[:budget]:
                kept.append(i)
                if turn.eos and i == tok.eos_token_id:
                    reason = "eos"
                    break
                if any(s in self.text(kept) for s in params.stop):
                    reason = "stop"
                    break
            state.response += kept
            entropies = torch.full((len(kept),), float(turn.entropy))
            out.append(Segment(kept, torch.full((len(kept),), -0.5), entropies, reason))
        return out


class ScriptedEngine(RolloutEngine):
    def __init__(self, script: Script, tok=None) -> None:
        self.script = script
        self.tokenizer = tok if tok is not None else tokenizer()
        self.sessions: list[ScriptedSession] = []

    def session(self) -> ScriptedSession:
        self.sessions.append(ScriptedSession(self))
        return self.sessions[-1]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        raise NotImplementedError

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        pass

    def release_memory(self, weights: bool = False) -> None:
        pass

    def reclaim_memory(self) -> None:
        pass


class Echo(Tool):
    """Answers ``answer`` (a fixed text) or, without it, the call's content reversed; records the calls."""

    def __init__(self, name: str = "python", *, trigger_tag: str = "python", answer: str | None = None) -> None:
        super().__init__(name, trigger_tag)
        self.answer = answer
        self.calls: list[str] = []

    def execute(self, text: str) -> ToolResult:
        self.calls.append(text)
        return ToolResult(self.answer if self.answer is not None else text[::-1])


def registry(*tools: Tool, call_limit: int = 3) -> ToolRegistry:
    return ToolRegistry(list(tools) or [Echo()], call_limit=call_limit, max_workers=4, timeout=10.0, retry_count=0)


class ContinuousScriptedSession(ScriptedSession, ContinuousSession):
    """The scripted session as a running batch: a submitted turn is scripted at once and comes back after a number
    of polls drawn from ``schedule`` (0 to 3), so turns end in an order that depends on the schedule's seed."""

    def __init__(self, engine: ContinuousScriptedEngine, schedule: random.Random) -> None:
        super().__init__(engine)
        self.schedule = schedule
        self.running: dict[int, list] = {}  # seq -> [segment, polls left]
        self.started: list[int] = []  # every sequence submitted, in order
        self.returned: list[int] = []  # every segment returned, in order
        self.polls: list[int] = []  # how many had been submitted at each poll

    def submit(self, seq: int, params: SamplingParams, max_new_tokens: int, lookback: int = 0) -> None:
        (segment,) = self.decode([seq], params, [max_new_tokens])
        self.running[seq] = [segment, self.schedule.randint(0, 3)]
        self.started.append(seq)

    def poll(self) -> list[tuple[int, Segment]]:
        self.polls.append(len(self.started))
        out = []
        for seq, entry in list(self.running.items()):
            entry[1] -= 1
            if entry[1] < 0:
                out.append((seq, entry[0]))
                del self.running[seq]
        self.schedule.shuffle(out)
        self.returned += [seq for seq, _ in out]
        return out

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def pause(self) -> list[tuple[int, Segment]]:
        """A scripted turn is whole from its submit on: there is nothing to pause (the agentic loop never does)."""
        if self.running:
            raise NotImplementedError("a scripted session decodes whole turns: it cannot pause one")
        return []

    def release(self, seq: int) -> None:
        self.running.pop(seq, None)
        super().release(seq)


class ContinuousScriptedEngine(ScriptedEngine):
    """A ScriptedEngine whose sessions are continuous, their turns ending in the order of ``schedule_seed``."""

    def __init__(self, script: Script, tok=None, schedule_seed: int = 0) -> None:
        super().__init__(script, tok)
        self.schedule = random.Random(schedule_seed)

    def session(self) -> ContinuousScriptedSession:
        self.sessions.append(ContinuousScriptedSession(self, self.schedule))
        return self.sessions[-1]
