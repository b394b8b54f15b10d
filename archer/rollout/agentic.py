"""The multi-turn tool rollout loop, with ARPO's entropy-based branching (archer/rollout/branching.py), run as
one scheduler in which every trajectory is its own request.

Written against the engine session interface (archer/rollout/base.py). Each trajectory (global sample, ARPO
branch or refill, AEPO probe) submits its turns to the session on its own: a turn that ends with a tool call
leaves the running batch, its calls start in the tool executor (archer/tools/executor.py, concurrently with
every other trajectory's), and when they answer the answer is appended and the next turn submitted. With a
continuous session (the fast engine's) the engine keeps decoding the other trajectories meanwhile, and the
waiting one keeps its cached pages; an engine whose session decodes only in calls (the HF engine) runs the
same loop as rounds (``RoundSession``). What a prompt's trajectories decide together (branches, refills) follows
ARPO's rounds in logical time (archer/rollout/prompt_rounds.py), so the responses do not depend on which turn
or tool finishes first, nor on the engine. One call of ``generate``:

1. every prompt starts with its global samples (``initial_rollouts``, or AEPO's m from a probe, which runs in
   the same loop first: a prompt's samples start when its own probe ends); fresh samples are forks of the
   prompt's sequence, so an engine that shares pages prefills the prompt once;
2. a turn decodes until an eos, a stop string (the tools' closing tags among them) or the trajectory's budget
   (``response_length`` minus what it already holds);
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
6. the call ends when every prompt has exactly ``n`` ended responses, in creation order (global samples
   first), deterministic under the seed (each trajectory samples from a seed of its key, branch draws come
   from a generator of their point, so no state outlives a call: ARPO's stale initial-entropy record cannot
   happen).

Besides ``rollout/*`` and ``tools/*`` (archer/rollout/rollout_stats.py), a call measures its decoding (steps,
tokens sampled, the largest batch), the seconds trajectories waited for tools, and its critical time: the
longest chain of turns, tool waits and the decisions a trajectory depends on (a branch on its parent's turns,
a refill on its prompt's other trajectories), each turn timed by what the trajectory itself decoded.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from archer.rollout.base import (
    ContinuousSession,
    DecodeCounters,
    RolloutEngine,
    RoundSession,
    SamplingParams,
    Segment,
)
from archer.rollout.branching import BranchSettings, global_samples, segment_entropy
from archer.rollout.call_formats import CallFormat, ParsedCall
from archer.rollout.prompt_rounds import Launcher, Point, PromptGroup, Trajectory, Turn, stream_seed
from archer.rollout.rollout_stats import RolloutStats
from archer.rollout.tool_text import clip_text, cut_ids, encode_plain, share_room
from archer.tools import ToolRegistry
from archer.tools.executor import PendingCalls

_SAMPLE, _PROBE = 0, 2  # seed streams of a call (1: branch draws, prompt_rounds.py)


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
    first_versions: list[int]  # the policy version of each row's first sampled token (its branch's parent's)
    last_versions: list[int]  # and of its last


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
        run = self.open(params, branching)
        start = time.monotonic()
        run.admit(prompts, allowed_tools or [None] * len(prompts), params.seed,
                  range(params.first_prompt, params.first_prompt + len(prompts)))
        try:
            run.run()
        except BaseException:
            run.abandon()
            raise
        return run.output(list(run.prompts), time.monotonic() - start)

    def open(self, params: SamplingParams, branching: BranchSettings | None = None) -> AgenticRun:
        """A run with no prompts yet (``generate``'s, or the asynchronous modes' pool of trajectories that outlive
        a weight sync: workers/async_tool_rollout.py), sampling with ``params`` (its seed and first prompt unused:
        each admission brings its own)."""
        settings = branching or BranchSettings(n=params.n, initial_rollouts=params.n)
        if settings.n != params.n:
            raise ValueError(f"branching for n={settings.n} but sampling for n={params.n}")
        stops = tuple(dict.fromkeys((*params.stop, *self.format.stop_strings)))
        return AgenticRun(self, replace(params, n=1, stop=stops), settings)


def _continuous(session) -> ContinuousSession:
    return session if isinstance(session, ContinuousSession) else RoundSession(session)


class AgenticRun(Launcher):
    """The trajectories of admitted prompts: the sessions (AEPO's probes in their own), each prompt's groups (keyed
    by the prompt's number in the run), the trajectories decoding or waiting for tools, and the stats.

    ``generate`` admits its prompts and runs them all to the end. The asynchronous modes keep one run across
    weight syncs: ``run`` until enough groups are complete, ``pause`` (a decoding trajectory keeps what it sampled
    of its turn, ``partials``; a tool call keeps running), hand out the complete groups (``output`` and
    ``remove``), let the weights change, ``resume`` (the engine prefills the sequences again with the new weights)
    and admit more. Each trajectory records the policy ``version`` of its first sampled token and of its last."""

    def __init__(self, loop: AgenticRollout, params: SamplingParams, settings: BranchSettings) -> None:
        self.loop, self.params, self.settings = loop, params, settings
        self.prompts: dict[int, list[int]] = {}  # a prompt's number in the run -> its token ids
        self.allowed: dict[int, Collection[str] | None] = {}
        self.seeds: dict[int, int] = {}  # the sampling seed of the prompt's batch
        self.global_index: dict[int, int] = {}  # its index in that batch (seeds follow it)
        self.version = 0  # the policy version the engine holds
        self.numbered = 0  # prompts admitted so far
        self.budget = loop.settings.response_length
        self.probe_session = _continuous(loop.engine.session()) if settings.dynamic_rollouts else None
        self.session = _continuous(loop.engine.session())
        self.sessions = [s for s in (self.probe_session, self.session) if s is not None]
        self.speculate = all(s.continuous for s in self.sessions)
        self.groups: dict[int, PromptGroup] = {}  # AEPO: a prompt's group starts when its probe ends
        self.probes: dict[int, PromptGroup] = {}
        self.partials: dict[Trajectory, Segment] = {}  # paused decodes: what they sampled of their turn
        self.session_of: dict[PromptGroup, ContinuousSession] = {}
        self.by_seq: dict[tuple[int, int], Trajectory] = {}  # (session, sequence) -> its trajectory
        self.group_of: dict[Trajectory, PromptGroup] = {}
        self.tool_calls: dict[Trajectory, tuple[list[ParsedCall], list[str | None], PendingCalls]] = {}

    # -- the loop ------------------------------------------------------------------------------------------------
    def admit(self, prompts: Sequence[list[int]], allowed: Sequence[Collection[str] | None], seed: int,
              global_index: Sequence[int]) -> list[int]:
        """Start ``prompts`` (of one batch sampled with ``seed``, at ``global_index`` in it); their numbers."""
        numbers = []
        for ids, tools, index in zip(prompts, allowed, global_index, strict=True):
            prompt, self.numbered = self.numbered, self.numbered + 1
            self.prompts[prompt], self.allowed[prompt] = ids, tools
            self.seeds[prompt], self.global_index[prompt] = int(seed), int(index)
            numbers.append(prompt)
            if self.probe_session is not None:
                probe = PromptGroup(self, prompt, int(index), BranchSettings(n=1, initial_rollouts=1), 1,
                                    stream_seed(int(seed), _PROBE), self._stats())
                self._start(probe, self.probe_session)
                self.probes[prompt] = probe
            else:
                self._start_prompt(prompt, self.settings.initial_rollouts, dep=0.0)
        self.expect()
        return numbers

    def expect(self) -> None:
        """Tell the sessions how many rows the run's prompts may decode at once (an engine sizes its batch)."""
        self.session.expect(len(self.prompts) * self.settings.n)
        if self.probe_session is not None:
            self.probe_session.expect(len(self.probes))

    @property
    def counted(self) -> list[ContinuousSession]:
        """The sessions whose counters sum to the run's decoding: continuous sessions decode in their engine's one
        running batch and each counts all of it, so one of them."""
        return [self.session] if self.speculate else self.sessions

    @property
    def all_done(self) -> bool:
        return len(self.groups) == len(self.prompts) and all(g.done for g in self.groups.values())

    def run(self, enough: Callable[[], bool] | None = None) -> None:
        """Decode and answer tools until every prompt's group is done, or ``enough()`` holds."""
        changed = True  # a segment ended or a tool answered since the rounds were last advanced
        while True:
            if changed:  # otherwise the rounds have nothing new to decide (advance reaches a fixed point)
                self._advance()
            if self.all_done or (enough is not None and enough()):
                break
            ended = self._poll()
            answered = False
            if self.tool_calls:
                if not any(s.busy for s in self.sessions):  # nothing decodes: wait for the tools
                    self.loop.registry.executor.wait([c[2] for c in self.tool_calls.values()],
                                                     every=not self.speculate)
                answered = self._collect_answers()
            elif not ended and not any(s.busy for s in self.sessions):
                raise RuntimeError("the agentic loop has nothing to decode and no tool to wait for")
            changed = ended or answered

    def abandon(self) -> None:
        """After a failure: release every sequence the run holds (their decodes stop) and cancel its tool calls."""
        self.remove(list(self.prompts))

    def remove(self, prompts: Collection[int]) -> None:
        """Forget ``prompts``: release their sequences (a decode stops) and give up their tool calls."""
        for prompt in prompts:
            for group in (self.probes.pop(prompt, None), self.groups.pop(prompt, None)):
                if group is not None:
                    self._drop_group(group)
            for table in (self.prompts, self.allowed, self.seeds, self.global_index):
                table.pop(prompt, None)

    def _drop_group(self, group: PromptGroup) -> None:
        session = self.session_of[group]
        for t in group.trajectories + list(group.candidates.values()):
            if (id(session), t.seq) in self.by_seq:
                self._release(t)
            if t in self.tool_calls:
                self.tool_calls.pop(t)[2].outcomes()  # gives up the calls still queued
            for turn in t.log:
                self.drop_point(group, turn)
            self.group_of.pop(t, None)
        if group.root is not None:
            session.release(group.root)
            group.root = None
        del self.session_of[group]

    def pause(self) -> int:
        """Stop every decode; each keeps what it sampled of its turn (``partials``) until ``resume``. How many."""
        paused = 0
        for session in self.sessions:
            now = time.monotonic()
            for seq, segment in session.pause():
                t = self.by_seq[(id(session), seq)]
                t.decoding = False
                if session.continuous:  # its own seconds so far in the turn (a resubmit starts the clock again)
                    t.work += now - t.submitted
                self._sampled(t, segment)
                earlier = self.partials.get(t)
                self.partials[t] = segment if earlier is None else _joined(earlier, segment)
                paused += 1
        return paused

    def resume(self) -> int:
        """Submit the paused decodes again (the engine prefills what changed since, after new weights all of it);
        each continues its turn, looking back into what it sampled of it for stop strings. How many."""
        self.expect()  # the engine sizes its running batch anew after releasing its memory
        for t in self.partials:
            self._submit(t)
        return len(self.partials)

    def started(self, prompt: int) -> int | None:
        """The oldest policy version that sampled a token of ``prompt``'s responses (None before the first)."""
        group = self.groups.get(prompt)
        versions = [t.first_version for t in group.trajectories if t.first_version is not None] if group else []
        return min(versions) if versions else None

    def _sampled(self, t: Trajectory, segment: Segment) -> None:
        """Tokens of ``t`` just came back from the engine: sampled by the policy it holds."""
        if segment.tokens:
            if t.first_version is None:
                t.first_version = self.version
            t.last_version = self.version

    def _stats(self) -> RolloutStats:
        return RolloutStats(tools=tuple(self.loop.registry.tools))

    def _start(self, group: PromptGroup, session: ContinuousSession) -> None:
        self.session_of[group] = session
        group.start()

    def _start_prompt(self, prompt: int, initial: int, dep: float) -> None:
        group = PromptGroup(self, prompt, self.global_index[prompt], self.settings, initial,
                            self.seeds[prompt], self._stats(), dep=dep, speculate=self.speculate)
        self.groups[prompt] = group
        self._start(group, self.session)

    def _advance(self) -> None:
        """Decide what each prompt's rounds allow (AEPO: a prompt's samples start when its probe ends)."""
        for probe in list(self.probes.values()):
            if probe.prompt not in self.groups:
                probe.advance()
                if probe.done:
                    (t,) = probe.trajectories
                    h_root = t.h_init or 0.0
                    h_tool = float(np.mean(t.tool_entropies)) if t.tool_entropies else h_root
                    m = global_samples(self.settings.n, h_root, h_tool, self.settings.dynamic_rollout_beta)
                    self._start_prompt(probe.prompt, m, dep=t.finished_at)
        for prompt in sorted(self.groups):  # in prompt order (AEPO starts groups as their probes end)
            group = self.groups[prompt]
            if not (group.done and not group.candidates):
                group.advance()
                if group.done and group.root is not None:
                    self.session_of[group].release(group.root)
                    group.root = None

    def _poll(self) -> bool:
        """Decode a little in every busy session and take the segments that ended."""
        ended = False
        for session in self.sessions:
            if not session.busy:
                continue
            began = time.monotonic()
            segments = session.poll()
            now = time.monotonic()
            longest = max((len(s.tokens) for _, s in segments), default=0) or 1
            for seq, segment in segments:
                t = self.by_seq[(id(session), seq)]
                t.decoding = False
                self._sampled(t, segment)
                if t in self.partials:  # the rest of a turn that a pause interrupted
                    segment = _joined(self.partials.pop(t), segment)
                # a trajectory's own time: in a running batch, until it left; in a round, its share of the steps
                seconds = now - t.submitted if session.continuous else (now - began) * len(segment.tokens) / longest
                if t.confirmed:
                    self.process(self.group_of[t], t, segment, seconds)
                else:
                    t.held = (segment, seconds)
                ended = True
        return ended

    def _collect_answers(self) -> bool:
        """Go on with the trajectories whose calls are answered; whether there was one."""
        answered = False
        for t, (calls, refusals, pending) in list(self.tool_calls.items()):
            if pending.done():
                del self.tool_calls[t]
                self._answer(t, calls, refusals, pending)
                answered = True
        return answered

    def _submit(self, t: Trajectory) -> None:
        partial = len(self.partials[t].tokens) if t in self.partials else 0
        self.session_of[self.group_of[t]].submit(t.seq, self.params, self.budget - len(t.tokens) - partial,
                                                 lookback=partial)
        t.decoding, t.submitted = True, time.monotonic()

    # -- the launcher (prompt_rounds.py) ----------------------------------------------------------------------
    def launch(self, group: PromptGroup, key: tuple[int, ...], parent: Trajectory | None = None,
               point: Point | None = None) -> Trajectory:
        session = self.session_of[group]
        seed = stream_seed(group.seed, _SAMPLE, group.global_prompt, *key)
        if parent is None:
            prompt = self.prompts[group.prompt]
            if group.settings.n == 1:
                seq = session.add(prompt, seed)
            else:
                if group.root is None:
                    group.root = session.add(prompt, 0)
                seq = session.fork(group.root, seed)
            t = Trajectory(group.prompt, key, seq)
        else:
            seq = session.fork(point.seq, seed)
            t = Trajectory(group.prompt, key, seq, parent=parent.ordinal, branch_position=point.length,
                           depth=parent.depth + 1, tokens=parent.tokens[:point.length],
                           learned=parent.learned[:point.length], log_probs=parent.log_probs[:point.length],
                           entropies=parent.entropies[:point.length], calls=point.calls, turns=point.turns,
                           h_init=parent.h_init, first_version=parent.first_version,
                           last_version=parent.last_version)
        self.by_seq[(id(session), seq)] = t
        self.group_of[t] = group
        self._submit(t)
        return t

    def cancel(self, t: Trajectory) -> None:
        self._release(t)
        del self.group_of[t]  # nothing refers to it any more (a kept run would hold its group for good)

    def drop_point(self, group: PromptGroup, turn: Turn) -> None:
        if turn.point is not None:
            self.session_of[group].release(turn.point.seq)
            turn.point = None

    def process(self, group: PromptGroup, t: Trajectory, segment: Segment, seconds: float) -> None:
        """Append a segment; measure its entropy (H_init, or H after a tool answer); end the trajectory or start
        the calls it ends with."""
        t.work += seconds
        if t.first_work is None:
            t.first_work = t.work
        t.extend(segment.tokens, 1, segment.log_probs.tolist(), segment.entropies.tolist())
        t.turns += 1
        h = segment_entropy(segment.entropies, self.loop.settings.entropy_window, self.loop.vocab_size)
        after_tool = t.h_init is not None
        if after_tool:
            t.tool_entropies.append(h)
        else:
            t.h_init = h
        text = self.loop.tokenizer.decode(segment.tokens, skip_special_tokens=True)
        calls = self.loop.format.parse(text, segment.finish_reason)
        ended = self._ends(group, t, segment, text, calls)
        t.log.append(Turn(h, after_tool, ended, t.work))
        group.on_turn(t)
        if not ended:
            refusals = [self._refusal(t.prompt, c) for c in calls]
            requests = [c.call for c, error in zip(calls, refusals, strict=True) if error is None]
            self.tool_calls[t] = (calls, refusals, self.loop.registry.executor.submit(requests))

    # -- a trajectory's turns ---------------------------------------------------------------------------------
    def _release(self, t: Trajectory) -> None:
        session = self.session_of[self.group_of[t]]
        del self.by_seq[(id(session), t.seq)]
        session.release(t.seq)
        t.decoding = False
        self.partials.pop(t, None)

    def _finish(self, t: Trajectory, reason: str) -> None:
        t.finish = reason
        self._release(t)

    def _ends(self, group: PromptGroup, t: Trajectory, segment: Segment, text: str, calls: list[ParsedCall]) -> bool:
        """Finish ``t`` when its segment calls no tool, calls beyond call_limit, or leaves no room for an answer."""
        stopped_at_call = bool(calls) and segment.finish_reason == "stop"  # ARPO: at the call's closing tag
        if not stopped_at_call and self.loop.format.unclosed(text):
            group.stats.invalid_calls += 1  # a call left open at eos or the budget: never answered
        if not calls:
            self._finish(t, segment.finish_reason)
            return True
        if t.calls + len(calls) > self.loop.settings.call_limit:
            t.limit_reached = True
            if segment.finish_reason != "eos" and len(t.tokens) < self.budget:
                t.extend([self.loop.eos_token_id], 1)  # ARPO: the response ends with an eos it is trained on
            self._finish(t, "call_limit")
            return True
        frame = sum(map(len, self.loop.frame_ids(len(calls))))
        if len(t.tokens) + frame >= self.budget:  # not even an empty answer leaves the model a token
            self._finish(t, "length")
            return True
        return False

    def _refusal(self, prompt: int, call: ParsedCall) -> str | None:
        """The error text of a call that does not run: an unreadable one, or one to a configured tool the prompt
        may not use (a tool that is not configured gets the executor's own error); None for a call that runs."""
        allowed = self.allowed[prompt]
        if call.error is not None or allowed is None or call.call.tool not in self.loop.registry.tools \
                or call.call.tool in allowed:
            return call.error
        names = ", ".join(sorted(allowed)) or "none"
        return f"Error: the tool {call.call.tool!r} is not available for this question (its tools: {names})."

    def _answer(self, t: Trajectory, calls: list[ParsedCall], refusals: list[str | None],
                pending: PendingCalls) -> None:
        """Append a trajectory's answers, keep a branch point while its prompt may branch, and go on."""
        group = self.group_of[t]
        waited = pending.seconds()  # until the last call answered (the loop may see it a window later)
        t.work += waited
        t.tool_wait += waited
        outcomes = iter(pending.outcomes())
        texts = []
        for c, error in zip(calls, refusals, strict=True):
            if error is not None:
                texts.append(error)
                group.stats.invalid_calls += 1
                if c.error is None:
                    group.stats.disallowed_calls += 1
                continue
            outcome = next(outcomes)
            texts.append(outcome.text)
            if outcome.record.tool in self.loop.registry.tools:
                group.stats.records.append(outcome.record)
            else:
                group.stats.invalid_calls += 1
        t.calls += len(calls)
        tokens = self._answer_tokens(texts, room=self.budget - 1 - len(t.tokens))
        session = self.session_of[group]
        session.extend(t.seq, tokens)
        t.extend(tokens, 0)
        turn = t.log[-1]
        # a point its round keeps (decided already, or not yet: then the free slots can only be fewer by then)
        if group.settings.beam_size > 1 and (turn.keep or (turn.keep is None and group.free > 0)):
            turn.point = Point(session.fork(t.seq, 0), len(t.tokens), t.calls, t.turns, t.work)
        self._submit(t)

    def _answer_tokens(self, texts: list[str], room: int) -> list[int]:
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

    # -- output ------------------------------------------------------------------------------------------------
    def output(self, prompts: Sequence[int], seconds: float, since: Sequence[DecodeCounters] = ()) -> AgenticOutput:
        """The responses of ``prompts`` (done), prompt-major; the stats of their groups, with the sessions'
        decoding (since their counters were ``since``) and ``seconds`` of generation."""
        groups = [self.groups[p] for p in prompts]
        probes = [self.probes[p] for p in prompts if p in self.probes]
        rows = [t for group in groups for t in group.trajectories]
        lengths = np.array([len(t.tokens) for t in rows], dtype=np.int64)
        # each row's positions, left-aligned: one vectorised fill per field (a host pass while the GPU waits)
        present = np.arange(int(lengths.max(initial=0)))[None, :] < lengths[:, None]
        pad = int(self.loop.tokenizer.pad_token_id)

        def tensor(values: list[list], fill: float, dtype: np.dtype) -> torch.Tensor:
            out = np.full(present.shape, fill, dtype=dtype)
            out[present] = np.fromiter(itertools.chain.from_iterable(values), dtype=dtype, count=int(lengths.sum()))
            return torch.from_numpy(out)

        learned = tensor([t.learned for t in rows], 0, np.int64)
        stats = RolloutStats.merge([group.stats for group in groups])  # in prompt order
        for probe in probes:
            stats.add_calls(probe.stats)  # the probes' tool calls are the step's work; their responses are not
        stats.initial_rollouts = [group.initial for group in groups]
        stats.calls_per_response = [t.calls for t in rows]
        stats.limit_reached = [t.limit_reached for t in rows]
        stats.turns = [t.turns for t in rows]
        stats.depths = [t.depth for t in rows]
        counters = [s.counters() for s in self.counted]
        for now, before in zip(counters, since):
            now.steps, now.tokens = now.steps - before.steps, now.tokens - before.tokens
        stats.decode_steps = sum(c.steps for c in counters)
        stats.decode_tokens = sum(c.tokens for c in counters)
        stats.decode_slot_steps = sum(c.steps * c.peak for c in counters)
        stats.tool_wait_s = sum(t.tool_wait for t in rows)
        stats.generation_s = seconds
        stats.critical_s = max((t.finished_at for t in rows), default=0.0)
        return AgenticOutput(
            responses=tensor([t.tokens for t in rows], pad, np.int64), response_mask=learned,
            tool_mask=torch.from_numpy(present.astype(np.int64)) - learned,
            log_probs=tensor([t.log_probs for t in rows], 0.0, np.float32),
            entropies=tensor([t.entropies for t in rows], 0.0, np.float32),
            finish_reasons=[t.finish for t in rows], num_tool_calls=[t.calls for t in rows],
            num_turns=[t.turns for t in rows], branch_parent=[t.parent for t in rows],
            branch_position=[t.branch_position for t in rows], stats=stats,
            first_versions=[self.version if t.first_version is None else t.first_version for t in rows],
            last_versions=[self.version if t.last_version is None else t.last_version for t in rows])


def _joined(first: Segment, rest: Segment) -> Segment:
    """One turn's segment from its part before a pause and its part after (which says why it ended)."""
    return Segment(first.tokens + rest.tokens, torch.cat([first.log_probs, rest.log_probs]),
                   torch.cat([first.entropies, rest.entropies]), rest.finish_reason)
