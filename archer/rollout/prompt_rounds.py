"""A prompt's responses as ARPO's rounds make them, whatever order its trajectories' turns end in.

ARPO's loop (archer/rollout/branching.py) runs in rounds: every active trajectory writes its next segment;
then, trajectory by trajectory in creation order, each decides its branches at the point kept after its
previous tool answer, each answered trajectory keeps a new point while the prompt has free slots of n, and a
prompt with no active trajectory gets one fresh sample (a refill). Those rules read what a prompt's
trajectories share (its free slots), so their order matters. The agentic loop (archer/rollout/agentic.py)
runs every trajectory as its own request instead: a turn ends when it ends, a tool answers when it answers.
A ``PromptGroup`` replays the rounds in logical time: round r is decided once every trajectory active in it
has written its r-th segment, in creation order, with ARPO's rules, so the responses are those of the
round-by-round loop whatever finishes first. Trajectories never wait for a round; only the decisions do (a
branch or a refill starts once its round is decided).

Each trajectory has a key, from which its seed comes: ``(k,)`` for the prompt's k-th fresh sample (global
samples and refills), and ``parent key + (calls, i)`` for the i-th branch at the point after its parent's
answer to its ``calls``-th call; the branch draws at a point come from a generator of the point. So a
trajectory's tokens do not depend on when it starts, and with ``speculate`` (an engine that decodes while
the loop waits) the group starts trajectories before their round is decided: the fresh samples that may
become refills and the branches a point would take. Each runs its first segment and waits; the decision
confirms it (it goes on from there) or cancels it (it cost only decoding). Speculative starts keep at most
n of a prompt's trajectories decoding at once, as many as a plain rollout decodes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from archer.rollout.base import Segment
from archer.rollout.branching import BranchSettings, branch_probability
from archer.rollout.rollout_stats import RolloutStats

_BRANCH_DRAWS = 1  # the seed stream of branch draws (agentic.py's streams)


def stream_seed(seed: int, stream: int, *path: int) -> int:
    """A seed for ``path`` within ``stream`` of a call's ``seed``."""
    return int(np.random.SeedSequence([seed % 2**63, stream, *path]).generate_state(1)[0])


@dataclass
class Point:
    """A branch point: a fork of a trajectory right after a tool answer, and its counters there."""

    seq: int
    length: int
    calls: int
    turns: int
    work: float  # the trajectory's own seconds when its answer came


@dataclass
class Turn:
    """What one segment did, for its prompt's rounds: its entropy H, whether it followed a tool answer, whether
    the trajectory ended with it, the trajectory's own seconds when it ended, the branch point forked after its
    answer (when one may be kept), whether its round kept that point (None until decided), and the branches a
    speculative decision at the point before it wanted."""

    h: float
    after_tool: bool
    ended: bool
    work: float
    point: Point | None = None
    keep: bool | None = None
    wanted: list[int] = field(default_factory=list)


@dataclass(eq=False)
class Trajectory:
    """One response being generated; ``learned`` is 1 on the model's tokens, 0 on tool output."""

    prompt: int
    key: tuple[int, ...]
    seq: int
    ordinal: int = -1  # its place among its prompt's responses; -1 while a speculative start is unconfirmed
    parent: int = -1  # ordinal of the trajectory it branched from (-1: a fresh sample)
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
    finish: str | None = None  # None while it generates
    limit_reached: bool = False
    # scheduling
    log: list[Turn] = field(default_factory=list)
    start_round: int = -1  # the round of its first segment
    done_round: int | None = None  # the round whose decisions saw it end
    kept: Turn | None = None  # the turn whose point its next decision reads
    held: tuple[Segment, float] | None = None  # a speculative start's first segment (and its seconds) before its confirmation
    decoding: bool = False
    submitted: float = 0.0  # when its turn was submitted
    ready: float = 0.0  # critical seconds when its first segment could start
    dep: float = 0.0  # critical seconds when the decision that keeps it could be made
    work: float = 0.0  # its own seconds: decoding and waiting for its tools
    first_work: float | None = None  # its own seconds when its first segment ended
    tool_wait: float = 0.0
    first_version: int | None = None  # the policy version of its first sampled token (a branch: its parent's)
    last_version: int | None = None  # and of its last

    @property
    def confirmed(self) -> bool:
        return self.ordinal >= 0

    def clock(self, work: float) -> float:
        """The critical time at which it had done ``work`` seconds of its own: its first segment from ``ready``,
        the rest once the decision that keeps it (``dep``) was made."""
        if self.first_work is None or work <= self.first_work:
            return self.ready + work
        return max(self.dep, self.ready + self.first_work) + work - self.first_work

    @property
    def finished_at(self) -> float:
        """The critical time of its end."""
        return self.clock(self.work)

    def extend(self, tokens: list[int], learned: int, log_probs: list[float] | None = None,
               entropies: list[float] | None = None) -> None:
        self.tokens += tokens
        self.learned += [learned] * len(tokens)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(tokens)
        self.entropies += entropies if entropies is not None else [0.0] * len(tokens)


class Launcher(ABC):
    """What a group asks of the loop that runs its trajectories."""

    @abstractmethod
    def launch(self, group: PromptGroup, key: tuple[int, ...], parent: Trajectory | None = None,
               point: Point | None = None) -> Trajectory:
        """Start a trajectory: a fresh sample of the group's prompt, or a branch of ``parent`` at ``point``."""

    @abstractmethod
    def process(self, group: PromptGroup, t: Trajectory, segment: Segment, seconds: float) -> None:
        """Take a confirmed trajectory's segment (decoded in ``seconds`` of its own)."""

    @abstractmethod
    def cancel(self, t: Trajectory) -> None:
        """Drop a speculative start."""

    @abstractmethod
    def drop_point(self, group: PromptGroup, turn: Turn) -> None:
        """Release the branch point forked after ``turn``'s answer, if there is one."""


class PromptGroup:
    """One prompt's ``settings.n`` responses (or its AEPO probe), ``initial`` of them global samples, sampled with
    ``seed`` and counted in ``stats``; ``prompt`` is its index in the call, ``global_prompt`` in the whole batch
    (seeds follow it); ``dep``: the critical seconds before it could start (AEPO: its probe's end).

    Critical times (seconds, for the loop's ``rollout/longest_trajectory_share``): a trajectory's turns and tool
    waits follow each other; a global sample starts at ``dep``, a branch once its parent wrote the segment that
    decides it, a refill once its prompt's earlier trajectories ended; with ``speculate`` the first segment of a
    branch or refill may run before that (a branch from its point, a refill from the start)."""

    def __init__(self, launcher: Launcher, prompt: int, global_prompt: int, settings: BranchSettings, initial: int,
                 seed: int, stats: RolloutStats, *, dep: float = 0.0, speculate: bool = False) -> None:
        self.launcher, self.prompt, self.global_prompt = launcher, prompt, global_prompt
        self.settings, self.initial, self.seed, self.stats = settings, initial, seed, stats
        self.speculate = speculate
        self.trajectories: list[Trajectory] = []
        self.candidates: dict[tuple[int, ...], Trajectory] = {}
        self.pending: list[tuple[Trajectory, Turn, Turn]] = []  # speculative decisions: (t, point turn, turn)
        self.round = 0
        self.active: list[Trajectory] | None = None  # the round's trajectories, in creation order
        self.taken = 0  # how many of them the round has taken
        self.fresh = 0
        self.root: int | None = None  # the loop's sequence of the prompt that fresh samples fork
        self.dep = dep

    def start(self) -> None:
        """Start the global samples."""
        for _ in range(self.initial):
            self._confirm((self.fresh,), 0, self.dep, self.dep)

    @property
    def free(self) -> int:
        return self.settings.n - len(self.trajectories)

    @property
    def done(self) -> bool:
        return self.free == 0 and all(t.done_round is not None for t in self.trajectories)

    # -- rounds ------------------------------------------------------------------------------------------------
    def advance(self) -> None:
        """Decide what the written segments allow, in order; then start speculative trajectories."""
        while not self.done and self._step():
            pass
        if self.done:
            for key in list(self.candidates):
                self.launcher.cancel(self.candidates.pop(key))
        elif self.speculate:
            self._start_speculative()

    def _step(self) -> bool:
        """Take the round's next segment in creation order (a trajectory's decision needs only those of the
        trajectories before it), or end the round once all are taken; False when the next is not written yet."""
        if self.active is None:
            self.active = [t for t in self.trajectories if t.start_round <= self.round and t.done_round is None]
            self.taken = 0
        if self.taken < len(self.active):
            t = self.active[self.taken]
            if len(t.log) <= self.round - t.start_round:
                return False
            turn = t.log[self.round - t.start_round]
            if turn.after_tool:
                self.stats.step_entropies.append(turn.h)
                if t.kept is not None:
                    self._decide(t, turn)
            if turn.ended:
                t.done_round = self.round
            self.taken += 1
            return True
        self._end_round()
        return True

    def _end_round(self) -> None:
        """Keep the answered trajectories' branch points while slots are free; refill a prompt with no active
        trajectory; next round."""
        r, active, self.active = self.round, self.active, None
        keep = self.settings.beam_size > 1 and self.free > 0
        for t in active:
            if t.done_round is None:  # answered: keep a branch point while slots are free
                turn = t.log[r - t.start_round]
                turn.keep = keep
                if keep:
                    t.kept = turn
                else:
                    self._cancel_branches(t, turn, granted=())
                    self.launcher.drop_point(self, turn)
        if self.free > 0 and all(t.done_round is not None for t in self.trajectories):
            ended = max(t.finished_at for t in self.trajectories)
            self._confirm((self.fresh,), r + 1, ended, self.dep if self.speculate else ended)
            self.stats.refills += 1
        self.round += 1
        for k in [k for k in self.candidates if len(k) == 1 and k[0] >= self.fresh + self.free]:
            self.launcher.cancel(self.candidates.pop(k))  # fresh samples no slot is left for

    def _draws(self, t: Trajectory, point: Point) -> np.ndarray:
        rng = np.random.default_rng(stream_seed(self.seed, _BRANCH_DRAWS, self.global_prompt, *t.key, point.calls))
        return rng.random(max(self.settings.beam_size - 1, 0))

    def _wanted(self, t: Trajectory, point: Point, h: float) -> list[int]:
        """ARPO's rule at ``point`` (entropy ``h`` after it): which of the prompt's tries branch."""
        p = branch_probability(self.settings, h - t.h_init, t.consecutive)
        tries = min(self.settings.beam_size - 1, self.free)
        return [i for i, u in enumerate(self._draws(t, point)[:tries]) if u < p]

    def _decide(self, t: Trajectory, turn: Turn) -> None:
        """ARPO's rule at the point before ``turn``: up to beam_size - 1 branches, each a trajectory."""
        at, t.kept = t.kept, None
        point = at.point
        granted = self._wanted(t, point, turn.h)
        decided = t.clock(turn.work)
        ready = t.clock(point.work) if self.speculate else decided
        children = [self._confirm(t.key + (point.calls, i), self.round + 1, decided, ready, t, point)
                    for i in granted]
        for _ in children:
            self.stats.branch_entropies.append(turn.h)
            self.stats.branch_deltas.append(turn.h - t.h_init)
        t.consecutive = t.consecutive + 1 if children else 0
        for child in children:
            child.consecutive = t.consecutive
        self._cancel_branches(t, at, granted)
        self.launcher.drop_point(self, at)

    def _confirm(self, key: tuple[int, ...], start_round: int, dep: float, ready: float,
                 parent: Trajectory | None = None, point: Point | None = None) -> Trajectory:
        t = self.candidates.pop(key, None) or self.launcher.launch(self, key, parent, point)
        t.ordinal, t.start_round, t.dep, t.ready = len(self.trajectories), start_round, dep, ready
        self.trajectories.append(t)
        if parent is None:
            self.fresh += 1
        if t.held is not None:
            (segment, seconds), t.held = t.held, None
            self.launcher.process(self, t, segment, seconds)
        return t

    # -- speculation -------------------------------------------------------------------------------------------
    def on_turn(self, t: Trajectory) -> None:
        """A confirmed trajectory wrote a segment: with speculation, guess the decision at its point before it."""
        if not self.speculate or len(t.log) < 2 or self.free == 0:
            return
        at, turn = t.log[-2], t.log[-1]
        if at.point is None or at.keep is False:
            return
        turn.wanted = self._wanted(t, at.point, turn.h)
        if turn.wanted:
            self.pending.append((t, at, turn))

    def _start_speculative(self) -> None:
        room = self.settings.n - sum(t.decoding for t in self.trajectories) - sum(
            t.decoding for t in self.candidates.values())
        pending = []
        for t, at, turn in self.pending:
            if at.point is None:  # decided already
                continue
            pending.append((t, at, turn))
            for i in turn.wanted:
                key = t.key + (at.point.calls, i)
                if room > 0 and key not in self.candidates:
                    self.candidates[key] = self.launcher.launch(self, key, t, at.point)
                    room -= 1
        self.pending = pending
        for k in range(self.fresh, self.fresh + self.free):
            if room > 0 and (k,) not in self.candidates:
                self.candidates[(k,)] = self.launcher.launch(self, (k,))
                room -= 1

    def _cancel_branches(self, t: Trajectory, at: Turn, granted) -> None:
        """Cancel the speculative branches at ``at``'s point that its decision did not take."""
        if at.point is None:
            return
        prefix = t.key + (at.point.calls,)
        for key in [k for k in self.candidates if k[:-1] == prefix and k[-1] not in granted]:
            self.launcher.cancel(self.candidates.pop(key))
