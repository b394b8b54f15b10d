"""The multi-turn tool rollout loop, with ARPO's entropy-based branching (archer/rollout/branching.py).

Written against the engine session interface (archer/rollout/base.py: add, decode, extend, fork, release), so
the HF engine (re-prefill per call) and an engine with real KV reuse run it alike. One call of ``generate``:

1. every prompt starts with its global samples (``initial_rollouts``, or AEPO's m from a probe);
2. a round decodes every active trajectory until an eos, a stop string (the tools' closing tags among them) or
   its own budget (``response_length`` minus what it already holds);
3. a segment that ends with a tool call (archer/rollout/call_formats.py) gets the tool's answer appended as
   context: attention 1, ``response_mask`` 0. A trajectory that asks for more than ``call_limit`` calls ends
   there, with an eos appended (learned, as ARPO does; not sampled, so its log-prob and entropy are 0) unless
   the segment already ends with one. The answer is cut (archer/rollout/tool_text.py) so that at least one
   token of the budget stays for the model: a response never ends on tool output. When not even the empty
   frame of the answer fits, the trajectory ends with the call, unanswered. A segment that ends inside a call
   (an opening tag left unclosed at eos or at the budget) gets no answer for it: the call counts in
   ``tools/invalid_calls``, not in the response's ``num_tool_calls`` (calls answered). Without other calls the
   response ends there with its finish reason; the closed calls of a Hermes turn before it still run. A prompt
   may bring its own tools (the data's per-row ``tools``: the configured tools that row may use); a call to
   another tool does not run: its answer is an error text naming the tools it may use, and it counts in
   ``tools/invalid_calls`` and ``tools/disallowed_calls`` (and toward call_limit). Token ids stay as generated:
   the model's tokens are never re-tokenised;
4. right after an answer, while its prompt has free slots, the loop keeps a fork of the trajectory (a branch
   point). The next segment's first ``entropy_window`` tokens give H; the branch rule decides how many
   branches start from that point, each sampling with its own seed;
5. a prompt without an active trajectory and with fewer than ``n`` gets one fresh sample per round (ARPO);
6. the loop ends when no trajectory is active: every prompt then has exactly ``n`` responses, in creation
   order (global samples first), and deterministic under the seed (each trajectory samples from its own
   seed; branch draws come from a generator of the call, so no state outlives a call: ARPO's stale
   initial-entropy record cannot happen).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from archer.rollout.base import RolloutEngine, SamplingParams, Segment
from archer.rollout.branching import BranchSettings, branch_probability, global_samples, segment_entropy
from archer.rollout.call_formats import CallFormat, ParsedCall
from archer.rollout.rollout_stats import RolloutStats
from archer.rollout.tool_text import clip_text, cut_ids, encode_plain, share_room
from archer.tools import ToolRegistry

_SAMPLE, _BRANCH_DRAWS, _PROBE = 0, 1, 2  # seed streams of a call


@dataclass(frozen=True)
class LoopSettings:
    """The loop's budgets: ``response_length`` tokens per response (tool output included), ``call_limit``
    calls, verl's character cut of each answer, and the entropy window of the branch rule."""

    response_length: int
    call_limit: int
    max_tool_response_length: int | None = None
    tool_response_truncate_side: str = "middle"
    entropy_window: int = 20


@dataclass
class _Point:
    """A branch point: a fork of a trajectory right after a tool answer, and its counters there."""

    seq: int
    length: int
    calls: int
    turns: int


@dataclass
class Trajectory:
    """One response being generated; ``learned`` is 1 on the model's tokens, 0 on tool output."""

    prompt: int
    ordinal: int  # its place among its prompt's trajectories (creation order)
    seq: int
    parent: int = -1  # ordinal of the trajectory it branched from (-1: a global sample or a refill)
    branch_position: int = -1  # its first token of its own: the tokens before it are the parent's (-1: none)
    depth: int = 0
    consecutive: int = 0  # consecutive branch points of its path that branched (AEPO's penalty)
    tokens: list[int] = field(default_factory=list)
    learned: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    calls: int = 0
    turns: int = 0
    h_init: float | None = None
    tool_entropies: list[float] = field(default_factory=list)  # H after each of its tool answers
    point: _Point | None = None
    finish: str | None = None  # None while active
    limit_reached: bool = False

    def extend(self, tokens: list[int], learned: int, log_probs: list[float] | None = None,
               entropies: list[float] | None = None) -> None:
        self.tokens += tokens
        self.learned += [learned] * len(tokens)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(tokens)
        self.entropies += entropies if entropies is not None else [0.0] * len(tokens)


@dataclass
class AgenticOutput:
    """``n`` rows per prompt, prompt-major, R = the longest response. ``response_mask`` is 1 on the model's
    tokens (a forced eos included), ``tool_mask`` 1 on tool output; log-probs and entropies are 0 off the
    model's sampled tokens. ``branch_parent`` is the row (within the prompt's n) a row branched from, or -1;
    ``branch_position`` the response position where it branched (its tokens before it are the parent's), or -1."""

    responses: torch.Tensor  # long [N, R], pad after the end
    response_mask: torch.Tensor  # long [N, R]
    tool_mask: torch.Tensor  # long [N, R]
    log_probs: torch.Tensor  # float [N, R]
    entropies: torch.Tensor  # float [N, R]
    finish_reasons: list[str]  # eos | stop | length | call_limit
    num_tool_calls: list[int]
    num_turns: list[int]
    branch_parent: list[int]
    branch_position: list[int]
    stats: RolloutStats


def _seed(seed: int, stream: int, *path: int) -> int:
    return int(np.random.SeedSequence([seed % 2**63, stream, *path]).generate_state(1)[0])


class AgenticRollout:
    """Generates tool-using responses with an engine's sessions, a tool registry and a call format."""

    def __init__(self, engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, registry: ToolRegistry,
                 call_format: CallFormat, settings: LoopSettings) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.registry = registry
        self.format = call_format
        self.settings = settings
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.vocab_size = len(tokenizer)
        self._frames: dict[int, list[list[int]]] = {}

    def encode(self, text: str) -> list[int]:
        """archer's own template text (the call format's frames): its special tokens are meant. Tool answers go
        through ``encode_plain`` instead."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def frame_ids(self, count: int) -> list[list[int]]:
        if count not in self._frames:
            self._frames[count] = [self.encode(piece) for piece in self.format.frame(count)]
        return self._frames[count]

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 branching: BranchSettings | None = None,
                 allowed_tools: Sequence[Collection[str] | None] | None = None) -> AgenticOutput:
        """``params.n`` responses per prompt (``branching`` for a training rollout; None: independent samples).
        ``allowed_tools`` gives each prompt the names of the tools it may call (None: every configured tool)."""
        if allowed_tools is not None and len(allowed_tools) != len(prompts):
            raise ValueError(f"allowed_tools has {len(allowed_tools)} entries for {len(prompts)} prompts")
        if params.seed is None:
            raise ValueError("the agentic loop needs a sampling seed")
        settings = branching or BranchSettings(n=params.n, initial_rollouts=params.n)
        if settings.n != params.n:
            raise ValueError(f"branching for n={settings.n} but sampling for n={params.n}")
        stops = tuple(dict.fromkeys((*params.stop, *self.format.stop_strings)))
        params = replace(params, n=1, stop=stops)
        initial, probed = [settings.initial_rollouts] * len(prompts), None
        if settings.dynamic_rollouts:
            initial, probed = self._probe(prompts, params, settings, allowed_tools)
        run = _Run(self, prompts, params, settings, params.seed, allowed_tools)
        if probed is not None:
            run.stats.add_calls(probed)  # the probes' tool calls are the step's work; their responses are not
        return run.execute(initial)

    def _probe(self, prompts: list[list[int]], params: SamplingParams, settings: BranchSettings,
               allowed_tools: Sequence[Collection[str] | None] | None) -> tuple[list[int], RolloutStats]:
        """AEPO's entropy pre-monitoring: one tool-using probe per prompt gives its number of global samples
        (returned with the probes' stats)."""
        probe = _Run(self, prompts, params, BranchSettings(n=1, initial_rollouts=1), _seed(params.seed, _PROBE),
                     allowed_tools)
        probe.execute([1] * len(prompts))
        out = []
        for (t,) in probe.trajectories:
            h_root = t.h_init or 0.0
            h_tool = float(np.mean(t.tool_entropies)) if t.tool_entropies else h_root
            out.append(global_samples(settings.n, h_root, h_tool, settings.dynamic_rollout_beta))
        return out, probe.stats


class _Run:
    """The state of one ``generate`` call: its session, trajectories, branch draws and stats."""

    def __init__(self, loop: AgenticRollout, prompts: list[list[int]], params: SamplingParams,
                 settings: BranchSettings, seed: int,
                 allowed_tools: Sequence[Collection[str] | None] | None = None) -> None:
        self.loop = loop
        self.prompts = prompts
        self.allowed = list(allowed_tools) if allowed_tools is not None else [None] * len(prompts)
        self.params = params
        self.settings = settings
        self.seed = seed
        self.first_prompt = params.first_prompt  # sample seeds follow the prompt's index in the whole batch
        self.budget = loop.settings.response_length
        self.session = loop.engine.session()
        self.trajectories: list[list[Trajectory]] = [[] for _ in prompts]
        self.draws = np.random.default_rng(_seed(seed, _BRANCH_DRAWS))
        self.stats = RolloutStats(tools=tuple(loop.registry.tools))

    # -- trajectories --------------------------------------------------------------------------------------
    def free(self, prompt: int) -> int:
        return self.settings.n - len(self.trajectories[prompt])

    def active(self) -> list[Trajectory]:
        return [t for group in self.trajectories for t in group if t.finish is None]

    def start(self, prompt: int) -> Trajectory:
        ordinal = len(self.trajectories[prompt])
        seq = self.session.add(self.prompts[prompt], _seed(self.seed, _SAMPLE, self.first_prompt + prompt, ordinal))
        t = Trajectory(prompt, ordinal, seq)
        self.trajectories[prompt].append(t)
        return t

    def branch(self, parent: Trajectory, point: _Point) -> Trajectory:
        ordinal = len(self.trajectories[parent.prompt])
        seq = self.session.fork(point.seq, _seed(self.seed, _SAMPLE, self.first_prompt + parent.prompt, ordinal))
        child = Trajectory(parent.prompt, ordinal, seq, parent=parent.ordinal, branch_position=point.length,
                           depth=parent.depth + 1,
                           tokens=parent.tokens[:point.length], learned=parent.learned[:point.length],
                           log_probs=parent.log_probs[:point.length], entropies=parent.entropies[:point.length],
                           calls=point.calls, turns=point.turns, h_init=parent.h_init)
        self.trajectories[parent.prompt].append(child)
        return child

    def finish(self, t: Trajectory, reason: str) -> None:
        t.finish = reason
        self.session.release(t.seq)

    # -- the loop ------------------------------------------------------------------------------------------------
    def execute(self, initial: list[int]) -> AgenticOutput:
        for prompt, count in enumerate(initial):
            for _ in range(count):
                self.start(prompt)
        self.stats.initial_rollouts = list(initial)
        while active := self.active():
            segments = self.session.decode([t.seq for t in active], self.params,
                                           [self.budget - len(t.tokens) for t in active])
            answering = []
            for t, segment in zip(active, segments, strict=True):
                self.take_segment(t, segment)
                text = self.loop.tokenizer.decode(segment.tokens, skip_special_tokens=True)
                calls = self.loop.format.parse(text, segment.finish_reason)
                if self.ends(t, segment, text, calls):
                    continue
                answering.append((t, calls))
            self.answer(answering)
            self.refill()
        return self.output()

    def take_segment(self, t: Trajectory, segment: Segment) -> None:
        """Append a decoded segment; measure its entropy (H_init, or H after a tool answer and branch there)."""
        t.extend(segment.tokens, 1, segment.log_probs.tolist(), segment.entropies.tolist())
        t.turns += 1
        h = segment_entropy(segment.entropies, self.loop.settings.entropy_window, self.loop.vocab_size)
        if t.h_init is None:
            t.h_init = h
            return
        t.tool_entropies.append(h)
        self.stats.step_entropies.append(h)
        if t.point is not None:
            self.decide(t, h)

    def decide(self, t: Trajectory, h: float) -> None:
        """ARPO's rule at the point before the segment just written: up to beam_size - 1 branches."""
        point, t.point = t.point, None
        delta = h - t.h_init
        children = []
        for _ in range(min(self.settings.beam_size - 1, self.free(t.prompt))):
            if self.draws.random() < branch_probability(self.settings, delta, t.consecutive):
                children.append(self.branch(t, point))
                self.stats.branch_entropies.append(h)
                self.stats.branch_deltas.append(delta)
        t.consecutive = t.consecutive + 1 if children else 0
        for child in children:
            child.consecutive = t.consecutive
        self.session.release(point.seq)

    def ends(self, t: Trajectory, segment: Segment, text: str, calls: list[ParsedCall]) -> bool:
        """Finish ``t`` when its segment calls no tool, calls beyond call_limit, or leaves no room for an answer."""
        stopped_at_call = bool(calls) and segment.finish_reason == "stop"  # ARPO: at the call's closing tag
        if not stopped_at_call and self.loop.format.unclosed(text):
            self.stats.invalid_calls += 1  # a call left open at eos or the budget: never answered
        if not calls:
            self.finish(t, segment.finish_reason)
            return True
        if t.calls + len(calls) > self.loop.settings.call_limit:
            t.limit_reached = True
            if segment.finish_reason != "eos" and len(t.tokens) < self.budget:
                t.extend([self.loop.eos_token_id], 1)  # ARPO: the response ends with an eos it is trained on
            self.finish(t, "call_limit")
            return True
        frame = sum(map(len, self.loop.frame_ids(len(calls))))
        if len(t.tokens) + frame >= self.budget:  # not even an empty answer leaves the model a token
            self.finish(t, "length")
            return True
        return False

    def refusal(self, prompt: int, call: ParsedCall) -> str | None:
        """The error text of a call that does not run: an unreadable one, or one to a configured tool the prompt
        may not use (a tool that is not configured gets the executor's own error); None for a call that runs."""
        allowed = self.allowed[prompt]
        if call.error is not None or allowed is None or call.call.tool not in self.loop.registry.tools \
                or call.call.tool in allowed:
            return call.error
        names = ", ".join(sorted(allowed)) or "none"
        return f"Error: the tool {call.call.tool!r} is not available for this question (its tools: {names})."

    def answer(self, answering: list[tuple[Trajectory, list[ParsedCall]]]) -> None:
        """Run the round's calls together, append each trajectory's answers, and keep branch points."""
        refusals = [[self.refusal(t.prompt, c) for c in calls] for t, calls in answering]
        requests = [c.call for (_, calls), refused in zip(answering, refusals, strict=True)
                    for c, error in zip(calls, refused, strict=True) if error is None]
        outcomes = iter(self.loop.registry.executor.run(requests))
        for (t, calls), refused in zip(answering, refusals, strict=True):
            texts = []
            for c, error in zip(calls, refused, strict=True):
                if error is not None:
                    texts.append(error)
                    self.stats.invalid_calls += 1
                    if c.error is None:
                        self.stats.disallowed_calls += 1
                    continue
                outcome = next(outcomes)
                texts.append(outcome.text)
                if outcome.record.tool in self.loop.registry.tools:
                    self.stats.records.append(outcome.record)
                else:
                    self.stats.invalid_calls += 1
            t.calls += len(calls)
            tokens = self.answer_tokens(texts, room=self.budget - 1 - len(t.tokens))
            self.session.extend(t.seq, tokens)
            t.extend(tokens, 0)
            if self.settings.beam_size > 1 and self.free(t.prompt) > 0:
                t.point = _Point(self.session.fork(t.seq, 0), len(t.tokens), t.calls, t.turns)

    def answer_tokens(self, texts: list[str], room: int) -> list[int]:
        """The frame and the answers, each answer clipped to max_tool_response_length characters, all cut to at
        most ``room`` tokens."""
        cfg = self.loop.settings
        frame = self.loop.frame_ids(len(texts))
        ids = [encode_plain(self.loop.tokenizer,
                            clip_text(text, cfg.max_tool_response_length, cfg.tool_response_truncate_side))
               for text in texts]
        keep = share_room([len(i) for i in ids], room - sum(map(len, frame)))
        tokens = list(frame[0])
        for answer, k, piece in zip(ids, keep, frame[1:], strict=True):
            tokens += cut_ids(answer, k, cfg.tool_response_truncate_side) + piece
        return tokens

    def refill(self) -> None:
        """ARPO: a prompt with no active trajectory and free slots gets one fresh sample per round."""
        for prompt, group in enumerate(self.trajectories):
            if self.free(prompt) > 0 and all(t.finish is not None for t in group):
                self.start(prompt)
                self.stats.refills += 1

    # -- output ------------------------------------------------------------------------------------------------
    def output(self) -> AgenticOutput:
        rows = [t for group in self.trajectories for t in group]
        width = max((len(t.tokens) for t in rows), default=0)
        pad = int(self.loop.tokenizer.pad_token_id)

        def tensor(values: list[list], fill: float, dtype: torch.dtype) -> torch.Tensor:
            out = torch.full((len(rows), width), fill, dtype=dtype)
            for i, v in enumerate(values):
                out[i, :len(v)] = torch.tensor(v, dtype=dtype)
            return out

        learned = tensor([t.learned for t in rows], 0, torch.long)
        present = tensor([[1] * len(t.tokens) for t in rows], 0, torch.long)
        stats = self.stats
        stats.calls_per_response = [t.calls for t in rows]
        stats.limit_reached = [t.limit_reached for t in rows]
        stats.turns = [t.turns for t in rows]
        stats.depths = [t.depth for t in rows]
        return AgenticOutput(
            responses=tensor([t.tokens for t in rows], pad, torch.long), response_mask=learned,
            tool_mask=present - learned, log_probs=tensor([t.log_probs for t in rows], 0.0, torch.float32),
            entropies=tensor([t.entropies for t in rows], 0.0, torch.float32),
            finish_reasons=[t.finish for t in rows], num_tool_calls=[t.calls for t in rows],
            num_turns=[t.turns for t in rows], branch_parent=[t.parent for t in rows],
            branch_position=[t.branch_position for t in rows], stats=stats)
