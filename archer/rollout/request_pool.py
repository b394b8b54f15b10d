"""Requests that outlive a weight update: the rollout pool of the asynchronous modes (docs/async.md).

A pool holds prompt groups (a prompt and its n requests) from the step that admitted them until they are
complete and handed to the trainer. ``run`` decodes every unfinished request of the pool in one running batch
(a ``ContinuousSession``) until ``quota`` more groups are complete, then pauses the others: each keeps the tokens it
sampled, their behaviour log-probs and entropies, and the policy versions that sampled them, and the next
``run`` (after the weights change) continues it from there (a partial rollout): its prompt and tokens so far are
prefilled with the new weights, and it samples on with the same noise (keyed by its seed and the token
position), so a paused request draws what it would have drawn unpaused under the same weights.

Policy versions follow docs/algorithms.md: a request records the version of its first sampled token and of its
last; a group's age at a step is the step's version minus the oldest version that sampled for it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from archer.batch import Batch
from archer.rollout.base import (
    PAUSED,
    ContinuousSession,
    DecodeCounters,
    RolloutEngine,
    RoundSession,
    SamplingParams,
    Segment,
)
from archer.rollout.policy_versions import version_age

POLICY_VERSION = "policy_version"  # batch row: the newest policy version that wrote a token of the response
FIRST_POLICY_VERSION = "first_policy_version"  # batch row: the oldest (the version of its first token)

K = TypeVar("K", bound=Hashable)  # a group's key: a prompt's uid in the pool, its number in a tool run


def stamp_policy_version(batch: Batch, version: int) -> None:
    """Mark every response of ``batch`` as sampled, from its first token to its last, by policy ``version``."""
    versions = np.full(len(batch), int(version), dtype=np.int64)
    batch[POLICY_VERSION] = versions
    batch[FIRST_POLICY_VERSION] = versions.copy()


@dataclass
class Request:
    """One response being sampled: its seed, what it sampled so far and why it ended (None: not yet)."""

    seed: int
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    reason: str | None = None
    first_version: int | None = None
    last_version: int | None = None
    started: int | None = None  # the version of its very first token, kept when it restarts

    @property
    def done(self) -> bool:
        return self.reason is not None

    def take(self, segment: Segment, version: int) -> None:
        """Append a segment sampled by policy ``version``; it ends the request unless it was paused."""
        if segment.tokens:
            self.tokens += segment.tokens
            self.log_probs += segment.log_probs.tolist()
            self.entropies += segment.entropies.tolist()
            if self.first_version is None:
                self.first_version = version
            if self.started is None:
                self.started = version
            self.last_version = version
        if segment.finish_reason != PAUSED:
            self.reason = segment.finish_reason

    def restart(self) -> None:
        """Forget what was sampled (partial rollouts off: a paused request starts again under new weights); when
        it started is kept, so that the staleness bound still sees how long it has been in flight."""
        self.tokens, self.log_probs, self.entropies = [], [], []
        self.first_version = self.last_version = None


@dataclass
class PoolGroup:
    """A prompt and its requests; ``key`` is the caller's name for it (the prompt's uid)."""

    key: Hashable
    prompt: list[int]
    requests: list[Request]
    order: int  # admission order: older groups are handed out first

    @property
    def complete(self) -> bool:
        return all(r.done for r in self.requests)

    @property
    def started(self) -> int | None:
        """The oldest version that sampled for the group, tokens dropped by a restart included (None before its
        first token)."""
        versions = [r.started for r in self.requests if r.started is not None]
        return min(versions) if versions else None

    def age(self, version: int) -> int:
        """Versions between ``version`` and when the group started (0 before its first token)."""
        return version_age(version, self.started)


@dataclass
class PoolRun:
    """What one ``run`` did: the groups it hands out (complete, oldest first), the requests it paused and
    resumed, and the engine's decode counters (prefilled tokens include the resumed requests' re-prefill)."""

    groups: list[PoolGroup]
    paused: int
    resumed: int
    counters: DecodeCounters


class RolloutPool:
    """Prompt groups in flight across steps (see the module docstring); ``max_new_tokens`` is every request's
    budget, counted over all its segments."""

    def __init__(self, max_new_tokens: int) -> None:
        self.max_new_tokens = max_new_tokens
        self.groups: dict[Hashable, PoolGroup] = {}
        self._order = 0

    def __len__(self) -> int:
        return len(self.groups)

    def admit(self, key: Hashable, prompt: list[int], seeds: list[int]) -> None:
        """A new group: ``prompt`` (token ids) answered once per seed."""
        if key in self.groups:
            raise ValueError(f"prompt group {key!r} is already in the pool")
        self.groups[key] = PoolGroup(key, list(prompt), [Request(seed) for seed in seeds], self._order)
        self._order += 1

    def oldest_first(self) -> list[PoolGroup]:
        return sorted(self.groups.values(), key=lambda g: g.order)

    def evict(self, keys: list[Hashable]) -> None:
        for key in keys:
            del self.groups[key]

    def run(self, engine: RolloutEngine, params: SamplingParams, version: int, quota: int, *,
            must_finish: frozenset = frozenset(), partial: bool = True) -> PoolRun:
        """Decode with policy ``version`` until ``quota`` more groups than at the start and every group of
        ``must_finish`` (keys) are complete, or nothing is left to decode; pause the rest (``partial=False``: what
        they sampled is dropped and they start again at the next run). Each run thus completes as many groups
        as it hands out (a colocated engine's turn does a batch's worth of work, however many complete groups
        it already holds). Hands out and removes the complete groups of ``must_finish`` and then the oldest
        others, ``quota`` in all when there are that many."""
        session = engine.session()
        if not isinstance(session, ContinuousSession):
            session = RoundSession(session)
        owners: dict[int, Request] = {}
        roots: list[int] = []
        resumed = 0
        try:
            for group in self.oldest_first():
                waiting = [r for r in group.requests if not r.done]
                if not waiting:
                    continue
                root = session.add(group.prompt, 0)  # the forks share its prefill
                roots.append(root)
                for request in waiting:
                    seq = session.fork(root, request.seed)
                    owners[seq] = request
                    if request.tokens:
                        session.extend(seq, request.tokens)
                        resumed += 1
            session.expect(len(owners))
            for seq, request in owners.items():  # a resumed request's stop strings may start in its earlier tokens
                session.submit(seq, params, self.max_new_tokens - len(request.tokens), lookback=len(request.tokens))

            complete_before = sum(g.complete for g in self.groups.values())

            def satisfied() -> bool:
                completed = sum(g.complete for g in self.groups.values()) - complete_before
                return completed >= quota and all(self.groups[k].complete for k in must_finish)

            while session.busy and not satisfied():
                for seq, segment in session.poll():
                    owners[seq].take(segment, version)
            paused = session.pause()
            for seq, segment in paused:
                owners[seq].take(segment, version)
                if not partial:
                    owners[seq].restart()
            counters = session.counters()
        finally:
            for seq in [*owners, *roots]:
                session.release(seq)
        return PoolRun(self._hand_out(quota, must_finish), len(paused), resumed, counters)

    def _hand_out(self, quota: int, must_finish: frozenset) -> list[PoolGroup]:
        keys = hand_out([g.key for g in self.oldest_first() if g.complete], must_finish, quota)
        chosen = [self.groups[key] for key in keys]
        self.evict(keys)
        return sorted(chosen, key=lambda g: g.order)


def hand_out(complete: list[K], must_finish: frozenset, quota: int) -> list[K]:
    """Which complete groups (their keys, oldest first) a call hands back: those that must finish, then the oldest
    others, ``quota`` in all (more when more must finish)."""
    forced = [key for key in complete if key in must_finish]
    return forced + [key for key in complete if key not in must_finish][: max(0, quota - len(forced))]
