"""The one generation interface (docs/architecture.md): sampling parameters, the output of a rollout, and the abstract
engine that turns token-id prompts into responses with exact per-token log-probs and entropies.

An engine offers
- ``generate``: prompts -> ``n`` responses each (the plain RL rollout);
- ``session()``: sequences that grow turn by turn (the agentic loop): add a prompt, decode until a stop, extend
  with tool-result tokens, fork a sequence with its state (ARPO's branch), release it. A ``ContinuousSession``
  (the fast engine's) also decodes asynchronously: ``submit`` puts a sequence into the running batch, ``poll``
  decodes a little and returns the segments that ended, so the agentic loop resumes, branches and refills
  trajectories while the others decode; ``RoundSession`` gives any session that interface, one ``decode`` call
  per poll;
- ``sync_weights(weights)``: take the actor's weights after an update, as a stream of (state-dict name, full
  tensor) pairs (models/lora.py's ``policy_weights``: plain or LoRA-merged; under FSDP each rank's stream of
  gathered tensors), copied in place (an engine that runs the actor's own module leaves the stream unread), and ``release_memory()`` / ``reclaim_memory()`` around the policy update
  (verl's ``free_cache_engine``).
The rollout worker owns its engine: the trainer never sees one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from archer.errors import ArcherError


@dataclass
class SamplingParams:
    """How to sample: n samples per prompt, temperature, top-p / top-k filtering, length and stop strings.

    ``top_k <= 0`` and ``top_p == 1`` switch filtering off. ``do_sample=False`` or ``temperature == 0``
    decodes greedily. ``seed`` makes sampling reproducible; ``first_prompt``: the index of the first prompt
    in the whole batch (a data-parallel rank generates a slice, each prompt with the seed of its global index).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    stop: tuple[str, ...] = ()
    do_sample: bool = True
    seed: int | None = None
    first_prompt: int = 0

    def __post_init__(self) -> None:
        self.stop = tuple(self.stop)
        checks = (
            (self.n >= 1, f"n={self.n}", "n must be at least 1"),
            (self.temperature >= 0, f"temperature={self.temperature}", "temperature must be >= 0"),
            (0 < self.top_p <= 1, f"top_p={self.top_p}", "top_p must be in (0, 1]"),
            (self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens}", "must be at least 1"),
            (all(self.stop), f"stop={self.stop!r}", "stop strings must not be empty"),
        )
        for ok, value, fix in checks:
            if not ok:
                raise ArcherError(f"invalid sampling parameter {value}", fix)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


@dataclass
class RolloutOutput:
    """N = len(prompts) * n responses, prompt-major (prompt i owns rows i*n .. i*n+n-1), R = longest response.

    responses      LongTensor [N, R]   generated ids, pad_token_id after the end
    response_mask  LongTensor [N, R]   1 for every generated token, eos / stop tokens included
    log_probs      FloatTensor [N, R]  log p of each token under softmax(logits / T), before top-k/top-p
    entropies      FloatTensor [N, R]  full-vocabulary entropy of that distribution, 0 where the mask is 0
    prompt_index   LongTensor [N]      which prompt each row answers
    finish_reasons list[str]           "eos" | "stop" | "length" per row
    routed_experts list[IntTensor]     per row, where the engine records its routing (routing replay): the experts
                                       each position was routed to, int16 [P_i + R_i - 1, MoE layers, top_k]
                                       (prompt then response; the last response token was never fed); else None
    """

    responses: torch.Tensor
    response_mask: torch.Tensor
    log_probs: torch.Tensor
    entropies: torch.Tensor
    prompt_index: torch.Tensor
    finish_reasons: list[str]
    routed_experts: list[torch.Tensor] | None = None


PAUSED = "paused"  # a Segment's finish_reason when ContinuousSession.pause stopped its decode


class Sampled(Protocol):
    """A response being or having been sampled: its tokens, their log-probs and entropies."""

    tokens: list[int]
    log_probs: list[float]
    entropies: list[float]


def padded_samples(samples: Sequence[Sampled], pad_token_id: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Responses of different lengths as right-padded [N, R] tensors (R: the longest): token ids (the pad token
    after the end), the mask (1 on sampled tokens), float32 log-probs and entropies (0 after the end)."""
    width = max((len(sample.tokens) for sample in samples), default=0)
    responses = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    log_probs = torch.zeros(len(samples), width)
    entropies = torch.zeros(len(samples), width)
    for row, sample in enumerate(samples):
        length = len(sample.tokens)
        responses[row, :length] = torch.tensor(sample.tokens, dtype=torch.long)
        mask[row, :length] = 1
        log_probs[row, :length] = torch.tensor(sample.log_probs)
        entropies[row, :length] = torch.tensor(sample.entropies)
    return responses, mask, log_probs, entropies


@dataclass
class Segment:
    """What one ``EngineSession.decode`` call appended to one sequence: the sampled tokens (the stop string's or
    the eos token included), their log-probs and full-vocabulary entropies, and why decoding ended."""

    tokens: list[int]
    log_probs: torch.Tensor  # float32 [len(tokens)]
    entropies: torch.Tensor  # float32 [len(tokens)]
    finish_reason: str       # "eos" | "stop" | "length" (| "paused": ContinuousSession.pause)


class EngineSession(ABC):
    """Sequences that grow turn by turn; each is named by the int the engine returns for it.

    A sequence's tokens are exactly the prompt, the decoded segments and the extended tokens, in order: the
    engine never re-tokenises text. Sampling of a sequence follows its own seed, so its tokens do not depend
    on which other sequences decode beside it.
    """

    @abstractmethod
    def add(self, prompt: list[int], seed: int) -> int:
        """A new sequence holding ``prompt``; its samples follow ``seed``."""

    @abstractmethod
    def extend(self, seq: int, tokens: list[int]) -> None:
        """Append ``tokens`` (tool output) to ``seq`` as context; they are not sampled."""

    @abstractmethod
    def decode(self, seqs: list[int], params: SamplingParams, max_new_tokens: list[int]) -> list[Segment]:
        """Sample onto each sequence until an eos id, a stop string of ``params`` or its own token budget."""

    @abstractmethod
    def fork(self, seq: int, seed: int) -> int:
        """A copy of ``seq`` (tokens and state) that samples from ``seed`` from now on."""

    @abstractmethod
    def release(self, seq: int) -> None:
        """Forget ``seq`` and free what it holds."""

    @abstractmethod
    def tokens(self, seq: int) -> list[int]:
        """All tokens of ``seq``: prompt, segments and extensions."""


@dataclass
class DecodeCounters:
    """What decoding did: decode steps, the tokens they sampled (rows decoding, summed over the steps), the most
    rows that decoded at once, and the tokens prefilled (computed as context without sampling)."""

    steps: int = 0
    tokens: int = 0
    peak: int = 0
    prefilled: int = 0


class ContinuousSession(EngineSession):
    """A session whose sequences decode in one running batch that they join and leave: ``submit`` queues a
    decode (as ``decode`` would run it), ``poll`` decodes a few steps and returns the segments that ended, and
    the others keep decoding while the caller waits for tools. ``continuous`` says whether decoding goes on
    while submitted sequences wait for others (False: a poll decodes everything submitted, as one round)."""

    continuous = True

    @abstractmethod
    def submit(self, seq: int, params: SamplingParams, max_new_tokens: int, lookback: int = 0) -> None:
        """Queue a decode of ``seq`` (one at a time per sequence); one ``params`` for all that decode at once.
        ``lookback``: the sequence's last tokens that belong to the text being continued (a paused response's
        earlier tokens), so that a stop string that starts in them and ends in the new tokens is found."""

    @abstractmethod
    def poll(self) -> list[tuple[int, Segment]]:
        """Decode a little; the (sequence, segment) of every submitted decode that ended (none when idle)."""

    @property
    @abstractmethod
    def busy(self) -> bool:
        """Whether submitted decodes have not all come back from ``poll``."""

    @abstractmethod
    def pause(self) -> list[tuple[int, Segment]]:
        """Stop every submitted decode that has not come back from ``poll``: the (sequence, segment) of each, with
        what it sampled so far (possibly nothing) and finish_reason ``"paused"``. The sequences keep those tokens,
        and a later ``submit`` continues them (a partial rollout, docs/async.md)."""

    def restart_peak(self) -> None:
        """Count ``counters().peak`` from now on: a run kept across calls reports each call's own largest batch."""

    def decode(self, seqs: list[int], params: SamplingParams, max_new_tokens: list[int]) -> list[Segment]:
        """``submit`` each sequence, then ``poll`` until every one has come back."""
        for seq, budget in zip(seqs, max_new_tokens, strict=True):
            self.submit(seq, params, budget)
        ended: dict[int, Segment] = {}
        while self.busy:
            ended.update(self.poll())
        return [ended[seq] for seq in seqs]

    def expect(self, rows: int) -> None:
        """Hint: up to ``rows`` sequences may decode at once (an engine sizes its running batch by it)."""

    def counters(self) -> DecodeCounters:
        """The decoding done for this session so far (steps, tokens, peak rows, prefilled tokens)."""
        return DecodeCounters()


class RoundSession(ContinuousSession):
    """Any session as a ContinuousSession: a poll decodes everything submitted in one ``decode`` call (a round,
    which waits for its slowest sequence), so its engine decodes nothing while the caller waits for tools."""

    continuous = False

    def __init__(self, inner: EngineSession) -> None:
        self.inner = inner
        self._queued: list[tuple[int, int]] = []
        self._params: SamplingParams | None = None
        self._counters = DecodeCounters()

    def add(self, prompt: list[int], seed: int) -> int:
        return self.inner.add(prompt, seed)

    def extend(self, seq: int, tokens: list[int]) -> None:
        self.inner.extend(seq, tokens)

    def decode(self, seqs: list[int], params: SamplingParams, max_new_tokens: list[int]) -> list[Segment]:
        return self.inner.decode(seqs, params, max_new_tokens)

    def fork(self, seq: int, seed: int) -> int:
        return self.inner.fork(seq, seed)

    def release(self, seq: int) -> None:
        self._queued = [(s, m) for s, m in self._queued if s != seq]
        self.inner.release(seq)

    def tokens(self, seq: int) -> list[int]:
        return self.inner.tokens(seq)

    def submit(self, seq: int, params: SamplingParams, max_new_tokens: int, lookback: int = 0) -> None:
        self._params = params  # a round's decode never pauses, so it has no earlier segment to look back into
        self._queued.append((seq, max_new_tokens))

    @property
    def busy(self) -> bool:
        return bool(self._queued)

    def pause(self) -> list[tuple[int, Segment]]:
        """A round decodes nothing until it is polled: every queued decode comes back empty."""
        queued, self._queued = self._queued, []
        return [(seq, Segment([], torch.zeros(0), torch.zeros(0), PAUSED)) for seq, _ in queued]

    def poll(self) -> list[tuple[int, Segment]]:
        if not self._queued:
            return []
        queued, self._queued = self._queued, []
        seqs = [seq for seq, _ in queued]
        segments = self.inner.decode(seqs, self._params, [m for _, m in queued])
        lengths = [len(s.tokens) for s in segments]
        # a decode call steps every row until its longest segment ends
        self._counters.steps += max(lengths, default=0)
        self._counters.tokens += sum(lengths)
        self._counters.peak = max(self._counters.peak, len(seqs))
        return list(zip(seqs, segments, strict=True))

    def counters(self) -> DecodeCounters:
        return replace(self._counters)

    def restart_peak(self) -> None:
        self._counters.peak = 0


@torch.no_grad()
def copy_weights(targets: Mapping[str, torch.Tensor], weights: Iterable[tuple[str, torch.Tensor]], *, engine: str,
                 fix: str) -> None:
    """Copy a stream of (state-dict name, tensor) pairs into ``targets`` (an engine's tensors by name), in place;
    a name with no target (or given twice), a shape that differs, or a target left unfilled is an ArcherError
    naming the ``engine`` and ``fix``."""
    missing = dict(targets)
    for name, tensor in weights:
        target = missing.pop(name, None)
        if target is None:
            raise ArcherError(f"the {engine} engine has no place for the weight {name!r}"
                              f"{' (given twice)' if name in targets else ''}", fix)
        if target.shape != tensor.shape:
            raise ArcherError(f"the {engine} engine's {name} is {tuple(target.shape)}, the weight given is "
                              f"{tuple(tensor.shape)}", fix)
        target.copy_(tensor)
    if missing:
        raise ArcherError(f"the weights given to the {engine} engine lack {len(missing)} tensors "
                          f"({', '.join(sorted(missing)[:3])}, ...)", fix)


class RolloutEngine(ABC):
    """Turns prompts (lists of token ids) and sampling parameters into a RolloutOutput."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Sample params.n responses for every prompt."""

    def session(self) -> EngineSession:
        """A session for turn-by-turn generation (the agentic loop)."""
        raise ArcherError(f"the {type(self).__name__} engine has no turn-by-turn sessions",
                          "use actor_rollout_ref.rollout.name=hf or fast (both have sessions) for multi-turn tool "
                          "rollouts, or give this engine a session()")

    @abstractmethod
    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the policy's current weights, (state-dict name, tensor) pairs named as in the plain model (in
        place: no reallocation); a wrong name or shape is an ArcherError."""

    @abstractmethod
    def release_memory(self, weights: bool = False) -> None:
        """Free what generation holds (KV cache, graphs) while the policy update runs; with ``weights``, also an
        engine's own copy of the weights (the next ``sync_weights`` takes it again)."""

    @abstractmethod
    def reclaim_memory(self) -> None:
        """Allocate again what ``release_memory`` freed, before the next generation."""
