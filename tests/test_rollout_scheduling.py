"""The agentic loop as one scheduler (archer/rollout/agentic.py, prompt_rounds.py) on scripted engines: every
trajectory is its own request, yet the responses, branches, refills and AEPO's splits are those of ARPO's rounds
whatever order turns end in and tools answer; speculative starts leave no trace; the engine keeps decoding
while a tool runs; and the decode, tool-wait and critical-time figures by hand."""

from __future__ import annotations

import random
import time
import zlib

import pytest
from agentic_support import ContinuousScriptedEngine, ScriptedEngine, Turn, registry, tokenizer

from archer.rollout.agentic import AgenticRollout, LoopSettings
from archer.rollout.base import SamplingParams
from archer.rollout.branching import BranchSettings
from archer.rollout.call_formats import ArpoTags
from archer.tools import Tool, ToolResult

TOK = tokenizer()
PROMPTS = ["What is six times seven?", "Who wrote it?", "The answer is here.", "abcdefghij", "0123456789"]


class Latent(Tool):
    """Answers the call reversed after a latency drawn from the call text and ``seed`` (0 to ``most`` s), and
    records when each call started and ended."""

    def __init__(self, seed: int, most: float = 0.02) -> None:
        super().__init__("python", "python")
        self.seed, self.most = seed, most
        self.spans: list[tuple[float, float]] = []

    def execute(self, text: str) -> ToolResult:
        began = time.monotonic()
        time.sleep(self.most * (zlib.crc32(f"{self.seed}:{text}".encode()) % 1000) / 1000)
        self.spans.append((began, time.monotonic()))
        return ToolResult(text[::-1])


def random_script(state, session) -> Turn:
    """A turn drawn from the sequence's own generator: a tool call (60%, the call text random) or the answer,
    with a random entropy, so trajectories call, branch and end at different turns."""
    word = str(state.rng.randrange(10**6))
    entropy = state.rng.uniform(0.5, 3.0)
    if state.rng.random() < 0.6:
        return Turn(f"<think>{word}</think> <python>print({word})</python>", entropy)
    return Turn(f" <answer>{word}</answer>", entropy, eos=True)


def make_loop(engine, tool: Tool) -> AgenticRollout:
    reg = registry(tool, call_limit=3)
    return AgenticRollout(engine, TOK, reg, ArpoTags(reg), LoopSettings(response_length=300, call_limit=3))


def fingerprint(out) -> tuple:
    metrics = out.stats.metrics()
    counted = {k: v for k, v in metrics.items()
               if k.startswith("rollout/") and k not in ("rollout/decode_batch_mean", "rollout/decode_occupancy",
                                                          "rollout/tool_wait_s", "rollout/longest_trajectory_share")}
    return (out.responses.tolist(), out.response_mask.tolist(), out.tool_mask.tolist(), out.log_probs.tolist(),
            out.entropies.tolist(), out.finish_reasons, out.num_tool_calls, out.num_turns, out.branch_parent,
            out.branch_position, metrics["tools/python/calls"], metrics["tools/invalid_calls"], counted)


SETTINGS = {
    "arpo": BranchSettings(n=6, initial_rollouts=2, beam_size=3, branch_probability=0.3, entropy_weight=0.5),
    "aepo": BranchSettings(n=6, initial_rollouts=6, beam_size=2, branch_probability=0.4, entropy_weight=0.5,
                           dynamic_rollouts=True, consecutive_branch_penalty=0.5),
}


@pytest.mark.parametrize("method", list(SETTINGS))
def test_responses_do_not_depend_on_turn_order_or_tool_latency(method):
    settings = SETTINGS[method]
    prompts = [TOK.encode(p, add_special_tokens=False) for p in PROMPTS]
    params = SamplingParams(n=settings.n, seed=11)
    rounds = make_loop(ScriptedEngine(random_script, TOK), Latent(0)).generate(prompts, params, settings)
    runs = []
    for seed in (1, 2):
        loop = make_loop(ContinuousScriptedEngine(random_script, TOK, schedule_seed=seed), Latent(seed))
        runs.append((loop, loop.generate(prompts, params, settings)))
    for _, out in runs:
        assert fingerprint(out) == fingerprint(rounds)
    assert sum(p >= 0 for p in rounds.branch_parent) >= 3 and rounds.stats.refills >= 1  # the rules were exercised
    # the two continuous runs saw their turns end in different orders, and started trajectories before their
    # round was decided (speculative refills and branches) that the rounds never made
    main = [loop.engine.sessions[-1] for loop, _ in runs]
    assert main[0].returned != main[1].returned
    assert all(len(s.started) > len(rounds.branch_parent) for s in main)  # a rounds run starts only its rows


def test_the_engine_keeps_decoding_while_a_tool_runs():
    """One prompt's trajectory waits 0.4 s for its tool; another's turns keep coming back meanwhile, and the call
    takes about the slow trajectory's own time, not the sum of the waves."""
    def script(state, session):
        slow = session.text(state.prompt) == "slow"
        if slow:
            return Turn("<python>wait</python>") if state.turns == 0 else Turn(" <answer>1</answer>", eos=True)
        return Turn(" <python>x</python>") if state.turns < 3 else Turn(" <answer>2</answer>", eos=True)

    class Slow(Tool):
        def __init__(self) -> None:
            super().__init__("python", "python")
            self.spans: dict[str, tuple[float, float]] = {}

        def execute(self, text: str) -> ToolResult:
            began = time.monotonic()
            time.sleep(0.4 if text == "wait" else 0.05)
            self.spans.setdefault(text, (began, time.monotonic()))
            return ToolResult("ok")

    tool = Slow()
    loop = make_loop(ContinuousScriptedEngine(script, TOK), tool)
    returned_at: list[float] = []
    original = ContinuousScriptedEngine.session

    def session(self):
        s = original(self)
        poll = s.poll

        def timed():
            out = poll()
            returned_at.extend(time.monotonic() for _ in out)
            return out

        s.poll = timed
        return s

    loop.engine.session = session.__get__(loop.engine)
    began = time.monotonic()
    out = loop.generate([TOK.encode(p, add_special_tokens=False) for p in ("slow", "busy")], SamplingParams(seed=0))
    wall = time.monotonic() - began
    start, end = tool.spans["wait"]
    assert sum(start < t < end for t in returned_at) >= 3  # the busy trajectory's turns came back meanwhile
    assert out.num_tool_calls == [1, 3] and wall < 0.4 + 1.0
    metrics = out.stats.metrics()
    assert metrics["rollout/tool_wait_s"] >= 0.4 / 2  # the slow one waited 0.4 s, of two responses
    # the stage took about its critical time: the slow trajectory's turns and its 0.4 s wait (a busy machine
    # adds the loop's own time to the wall time only)
    assert metrics["rollout/longest_trajectory_share"] * wall >= 0.4
    assert 0.5 < metrics["rollout/longest_trajectory_share"] <= 1.0 + 1e-6


def test_decode_figures_by_hand_on_rounds():
    """A rounds engine: each round steps every row until its longest segment ends."""
    def script(state, session):
        if state.turns == 0 and state.rng.random() < 0.5:
            return Turn("<python>print(1)</python>")
        return Turn(" <answer>" + "x" * state.rng.randrange(1, 30) + "</answer>", eos=True)

    loop = make_loop(ScriptedEngine(script, TOK), Latent(0, most=0.0))
    out = loop.generate([TOK.encode(p, add_special_tokens=False) for p in PROMPTS],
                        SamplingParams(n=2, seed=3))
    learned = out.response_mask.tolist()
    segments = []  # per row: the lengths of its model-written runs, in order
    for row in learned:
        runs, length = [], 0
        for flag in row + [0]:
            if flag:
                length += 1
            elif length:
                runs.append(length)
                length = 0
        segments.append(runs)
    assert {len(s) for s in segments} == {1, 2}  # some rows called the tool, some did not
    rounds = [[s[i] for s in segments if len(s) > i] for i in range(2)]
    steps = sum(max(r) for r in rounds)
    tokens = sum(map(sum, rounds))
    metrics = out.stats.metrics()
    assert metrics["rollout/decode_batch_mean"] == pytest.approx(tokens / steps)
    assert metrics["rollout/decode_occupancy"] == pytest.approx(tokens / (steps * len(out.responses)))
    assert 0 < metrics["rollout/longest_trajectory_share"] <= 1.0


def test_speculation_follows_the_prompts_free_slots():
    """Without tool calls ARPO's refills come one per round, after the prompt's trajectories end; on a
    continuous engine they are started at once (speculatively) and kept in the same order."""
    def script(state, session):
        return Turn(" <answer>" + str(state.rng.randrange(10**6)) + "</answer>", eos=True)

    settings = BranchSettings(n=4, initial_rollouts=1, beam_size=2)
    prompts = [TOK.encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
    rounds_engine = ScriptedEngine(script, TOK)
    rounds = make_loop(rounds_engine, Latent(0)).generate(prompts, SamplingParams(n=4, seed=5), settings)
    engine = ContinuousScriptedEngine(script, TOK, schedule_seed=random.Random(1).randrange(100))
    out = make_loop(engine, Latent(0)).generate(prompts, SamplingParams(n=4, seed=5), settings)
    assert fingerprint(out) == fingerprint(rounds) and out.stats.refills == 6
    assert [len(c) for c in rounds_engine.sessions[-1].decode_calls] == [2, 2, 2, 2]  # one refill a round
    assert engine.sessions[-1].polls[0] == 2 * 4  # every sample started before the first turn came back
