"""Continuous batching for the fast engine: one running batch that jobs join and leave. Jobs wait for a slot and
pages, are prefilled (only their tokens not yet cached, batched up to ``max_num_batched_tokens`` padded tokens),
decode in slots, and leave the moment they end, so waiting jobs start at the next read of the window.

A job decodes one sequence: either a session's, or (in ``generate``) a fork of its prompt's sequence, made
when the job is admitted, so the n samples of a prompt share the prompt's pages and the prompt is prefilled
once. ``open`` starts a running batch with one set of sampling parameters, ``add`` queues jobs (also while
others decode: the agentic loop's resumed turns, branches and refills join the batch as they come), ``step``
decodes one window and returns the jobs that ended in it, ``cancel`` takes a job out; ``run`` does all of it
for a fixed set of jobs. The host reads the window every ``window`` steps (fewer when every row's budget ends
sooner), checks stop strings on the decoded text, cuts a row after the token that completes one, and frees its
slot. ``counters`` count the decode steps, the tokens they sampled and the tokens prefilled.

Where the model records its routing (routing replay, models/router_replay.py), a job keeps the expert ids of
each token it fed (``Job.routes``: the step's input token, its sequence's last token first) and ``prefilled``
those of the prefilled positions of each sequence, until ``reset``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from archer.errors import ArcherError
from archer.rollout.base import DecodeCounters, SamplingParams
from archer.rollout.endings import StopMatcher
from archer.rollout.fast import simulated_lengths
from archer.rollout.fast.model import FastModel
from archer.rollout.fast.pages import TRASH_PAGE, KVCache, Sequence
from archer.rollout.fast.runner import EOS, RUNNING, DecodeRunner, SlotInit


@dataclass(eq=False)
class Job:
    """One row to decode: up to ``budget`` tokens onto ``seq`` (or onto a fork of ``parent`` keyed ``key``);
    ``tag`` is the submitter's (a session's name for the sequence)."""

    budget: int
    seq: Sequence | None = None
    parent: Sequence | None = None
    key: int = 0
    tag: object = None
    lookback: list[int] = field(default_factory=list)  # earlier tokens of the same text (stop strings may start there)
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    reason: str | None = None
    routes: list[torch.Tensor] = field(default_factory=list)  # int16 [steps, sparse layers, top_k] per window

    def cut(self, length: int) -> None:
        del self.tokens[length:], self.log_probs[length:], self.entropies[length:]
        if self.routes:
            self.routes = [torch.cat(self.routes)[:length]]


class Scheduler:
    """The running batch over the runner's slots and the cache's pages."""

    def __init__(self, model: FastModel, runner: DecodeRunner, tokenizer, *, max_batched_tokens: int,
                 release_idle: Callable[[set[Sequence]], bool] | None = None) -> None:
        """``release_idle``: frees the pages of sequences the cache keeps for later (a session's, between its
        turns) other than those given; whether it freed any. The scheduler calls it when no job decodes and the
        next one does not fit, before it gives up."""
        self.model, self.runner, self.tokenizer = model, runner, tokenizer
        self.release_idle = release_idle
        self.max_batched_tokens = max_batched_tokens
        self.counters = DecodeCounters()
        self.params: SamplingParams | None = None
        self.cache: KVCache | None = None
        self.capacity = 0
        self.last_rows = 0  # rows that decoded in the last window
        self.waiting: deque[Job] = deque()
        self.running: dict[int, Job] = {}
        self.children: Counter = Counter()
        self.filtered = False
        self.stops = StopMatcher(tokenizer, ())
        self._matchers: dict[tuple[str, ...], StopMatcher] = {}  # kept across batches: they learn the vocabulary once
        self.prefilled: dict[Sequence, list[tuple[int, torch.Tensor]]] = {}  # recorded routes: (start, ids) pieces

    # -- prefill -------------------------------------------------------------------------------------------

    def prefill(self, cache: KVCache, seqs: list[Sequence]) -> None:
        """Cache every token but the last of each sequence (its pages must be writable)."""
        pieces = [(seq, start, min(start + self.max_batched_tokens, len(seq.tokens) - 1))
                  for seq in seqs for start in range(seq.cached, len(seq.tokens) - 1, self.max_batched_tokens)]
        batch: list[tuple[Sequence, int, int]] = []
        for piece in pieces:
            longest = max([end - start for _, start, end in batch] + [piece[2] - piece[1]])
            if batch and (len(batch) + 1) * longest > self.max_batched_tokens:
                self._prefill_batch(cache, batch)
                batch = []
            batch.append(piece)
        if batch:
            self._prefill_batch(cache, batch)

    def _prefill_batch(self, cache: KVCache, batch: list[tuple[Sequence, int, int]]) -> None:
        device, page = self.model.device, cache.page_size
        rows, length = len(batch), max(end - start for _, start, end in batch)
        width = max(cache.blocks(end) for _, _, end in batch)
        tokens = torch.zeros(rows, length, dtype=torch.long)
        tables = torch.zeros(rows, width, dtype=torch.long)
        starts = torch.tensor([start for _, start, _ in batch])
        ends = torch.tensor([end for _, _, end in batch])
        for i, (seq, start, end) in enumerate(batch):
            tokens[i, : end - start] = torch.tensor(seq.tokens[start:end])
            tables[i, : cache.blocks(end)] = torch.tensor(seq.pages[: cache.blocks(end)])
        offsets = torch.arange(length)
        valid = offsets < (ends - starts).unsqueeze(1)
        positions = torch.minimum(starts.unsqueeze(1) + offsets, ends.unsqueeze(1) - 1)
        slots = tables.gather(1, positions // page) * page + positions % page
        slots = torch.where(valid, slots, TRASH_PAGE * page + offsets % page)
        self.model.prefill(tokens.to(device), positions.to(device), slots.flatten().to(device), tables.to(device),
                           ends.to(device), cache.layers, max_kv=int(ends.max()), fresh=not bool(starts.any()))
        self.counters.prefilled += int((ends - starts).sum())
        if self.model.record_routes:
            routes = self.model.routes.view(rows, length, *self.model.routes.shape[1:]).cpu()
            for i, (seq, start, end) in enumerate(batch):
                pieces = [piece for piece in self.prefilled.get(seq, []) if piece[0] < start]
                self.prefilled[seq] = [*pieces, (start, routes[i, : end - start])]
        for seq, _, end in batch:
            seq.cached = end

    # -- the running batch -----------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether jobs wait or decode."""
        return bool(self.waiting or self.running)

    def open(self, cache: KVCache, params: SamplingParams, rows: int) -> None:
        """Start an empty running batch sampling with ``params``, of at most ``rows`` sequences decoding at once
        (the CUDA graphs of its batch sizes are captured now, so more rows wait for a slot)."""
        if self.busy:
            raise ArcherError("the fast engine's running batch is still decoding",
                              "let its jobs end (step until not busy) before opening another")
        vocab = self.model.spec.vocab
        self.params, self.cache = params, cache
        self.filtered = not params.greedy and (0 < params.top_k < vocab or params.top_p < 1)
        self.stops = self._matchers.setdefault(params.stop, StopMatcher(self.tokenizer, params.stop))
        self.capacity = max(1, min(rows, self.runner.slots))
        self.runner.prepare(self.filtered, cache, rows=self.capacity)
        self.children = Counter()

    def add(self, jobs: list[Job]) -> None:
        """Queue jobs on the open batch; they start as slots and pages allow."""
        draws = simulated_lengths.from_environment()
        for job in jobs:
            if draws is not None:  # benchmarks: a random model's responses end at drawn lengths
                seq = job.seq or job.parent
                job.budget = draws.cap(job.budget, job.key if job.seq is None else seq.key, len(seq.tokens))
            if job.lookback:  # a stop string spans at most the matcher's window of tokens
                job.lookback = job.lookback[-self.stops.window:]
        self.waiting.extend(jobs)
        self.children.update(job.parent for job in jobs if job.parent is not None)

    def cancel(self, job: Job) -> None:
        """Take a session job out: waiting, it never starts; decoding, its slot is freed and what it decoded is
        dropped (its sequence keeps its tokens and cached prefix)."""
        if self._take_out(job):
            self.cache.shrink(job.seq)
            self._compact()

    def interrupt(self, job: Job) -> None:
        """Stop a session job where it is: waiting, it never starts; decoding, its slot is freed and its sequence
        takes the tokens it sampled (as when it ends), so that a later job continues it."""
        if self._take_out(job):
            self._finish(self.cache, job)
            self._compact()

    def _take_out(self, job: Job) -> bool:
        """Remove ``job`` from the waiting queue or its slot; whether it was decoding."""
        if job in self.waiting:
            self.waiting.remove(job)
            return False
        slot = next((s for s, j in self.running.items() if j is job), None)
        if slot is None:
            return False
        self.runner.clear([slot])
        del self.running[slot]
        return True

    def reset(self) -> None:
        """Drop every job (after a generation that failed) and the cache (the engine's to free: a reference kept
        here held the last generation's KV cache through the update, issue 44): the slots idle, the jobs' pages
        stay their owners'."""
        self.runner.clear(list(self.running))
        self.running.clear()
        self.waiting.clear()
        self.children.clear()
        self.prefilled.clear()
        self.cache = None

    def step(self) -> list[Job]:
        """Admit what fits, decode one window and return the jobs that ended in it (tokens, log_probs,
        entropies and reason filled in); nothing when no job waits or decodes."""
        if not self.busy:
            return []
        self._admit_all()
        if not self.running and self.release_idle is not None and self.release_idle(self._held_by_jobs()):
            self._admit_all()
        if not self.running:
            job = self.waiting[0]
            raise ArcherError(
                f"a sequence of {len((job.seq or job.parent).tokens)} + {job.budget} tokens does not fit in the "
                f"fast engine's KV cache ({self.cache.pages} pages of {self.cache.page_size} tokens)",
                "raise actor_rollout_ref.rollout.gpu_memory_utilization, or shorten prompts / responses")
        bucket = self.runner.bucket(max(self.running) + 1)
        steps = min(self.runner.window, max(job.budget - len(job.tokens) for job in self.running.values()))
        for _ in range(steps):
            self.runner.run(bucket, self.filtered, self.cache)
        self.counters.steps += steps
        self.counters.peak = max(self.counters.peak, len(self.running))
        self.last_rows = len(self.running)
        finished = self._collect(bucket, steps)
        self._compact()
        return finished

    def _admit_all(self) -> None:
        while self.waiting and self._admit():  # again: forks that started free their parents' pages for the next
            pass

    def _held_by_jobs(self) -> set[Sequence]:
        """The sequences the waiting and decoding jobs decode or fork from."""
        return {job.seq or job.parent for job in (*self.waiting, *self.running.values())}

    def run(self, cache: KVCache, jobs: list[Job], params: SamplingParams) -> None:
        """Decode every job until its eos, stop string or budget; fills tokens, log_probs, entropies, reason.
        A ``parent`` job decodes a fork (in ``job.seq``) whose pages return when it ends; a parent's pages
        return when all its jobs have started; a session job's sequence takes its tokens when it ends."""
        self.open(cache, params, rows=len(jobs))
        self.add(jobs)
        while self.busy:
            self.step()

    def _admit(self) -> bool:
        """Start the waiting jobs that fit in the free slots and pages, in order; whether any started. A prompt's
        parent holds its pages until its forks start, so a second call may fit jobs the first could not."""
        cache = self.cache
        free = [slot for slot in range(self.capacity) if slot not in self.running]
        pages, chosen, counted = cache.free_pages, [], set()
        for job in self.waiting:
            if len(chosen) == len(free):
                break
            need = self._pages_needed(cache, job, counted)
            if need > pages:
                break
            pages -= need
            chosen.append(job)
        if not chosen:
            return False
        for _ in chosen:
            self.waiting.popleft()
        to_prefill, copies = [], []
        for job in chosen:
            seq = job.parent or job.seq
            if not seq.ready and seq not in to_prefill:
                copies += cache.make_writable(seq, len(seq.tokens) - 1 if job.parent else self._capacity(job))
                to_prefill.append(seq)
        cache.copy_pages(copies)
        self.prefill(cache, to_prefill)
        copies = []
        for job in chosen:
            if job.parent is not None:
                job.seq = cache.fork(job.parent, job.key)
                self.children[job.parent] -= 1
                if self.children[job.parent] == 0:
                    cache.release(job.parent)
            copies += cache.make_writable(job.seq, self._capacity(job))
        cache.copy_pages(copies)
        params = self.params
        greedy = params.greedy
        rows = [SlotInit(token=job.seq.tokens[-1], position=len(job.seq.tokens) - 1, pages=job.seq.pages,
                         key=job.seq.key, temperature=1.0 if greedy else params.temperature, greedy=greedy,
                         top_k=max(params.top_k, 0), top_p=params.top_p, budget=job.budget) for job in chosen]
        slots = free[: len(chosen)]
        self.runner.place(slots, rows)
        self.running.update(zip(slots, chosen))
        return True

    @staticmethod
    def _capacity(job: Job) -> int:
        """Positions the job writes: its sequence's tokens but the last, then one per sampled token."""
        return len((job.seq or job.parent).tokens) - 1 + job.budget

    @staticmethod
    def _pages_needed(cache: KVCache, job: Job, counted: set) -> int:
        if job.parent is None:
            return cache.pages_needed(job.seq, Scheduler._capacity(job))
        prefix = len(job.parent.tokens) - 1
        need = cache.fork_pages_needed(prefix, Scheduler._capacity(job))
        if not job.parent.ready and job.parent not in counted:
            counted.add(job.parent)
            need += cache.pages_needed(job.parent, prefix)
        return need

    def _collect(self, bucket: int, steps: int) -> list[Job]:
        window = self.runner.read(bucket, steps)
        slots, starts = list(self.running), []
        for slot in slots:
            job = self.running[slot]
            starts.append(len(job.tokens))
            for token, logp, entropy, live in zip(window.tokens[slot], window.log_probs[slot],
                                                  window.entropies[slot], window.live[slot]):
                if live:
                    job.tokens.append(token)
                    job.log_probs.append(logp)
                    job.entropies.append(entropy)
            if window.routes is not None:
                job.routes.append(window.routes[slot][torch.tensor(window.live[slot], dtype=torch.bool)])
        self.counters.tokens += sum(len(self.running[slot].tokens) - start for slot, start in zip(slots, starts))
        jobs = [self.running[slot] for slot in slots]  # a resumed job's text starts in its lookback
        found = self.stops.first_stops([job.lookback + job.tokens if job.lookback else job.tokens for job in jobs],
                                       [len(job.lookback) + start for job, start in zip(jobs, starts, strict=True)])
        stops = [None if stop is None else stop - len(job.lookback) for job, stop in zip(jobs, found, strict=True)]
        finished = []
        for slot, stop in zip(slots, stops, strict=True):
            job, code = self.running[slot], window.finish[slot]
            if stop is not None and not (code == EOS and stop == len(job.tokens) - 1):
                job.cut(stop + 1)
                job.reason = "stop"
            elif code != RUNNING:
                job.reason = "eos" if code == EOS else "length"
            if job.reason is not None:
                finished.append(slot)
        self.runner.clear(finished)
        ended = [self.running.pop(slot) for slot in finished]
        for job in ended:
            self._finish(self.cache, job)
        return ended

    @staticmethod
    def _finish(cache: KVCache, job: Job) -> None:
        """Return an ended job's pages at once: all of a fork made for ``generate``; past the cached prefix
        for a session's sequence, which takes the decoded tokens (the last one pending)."""
        if job.parent is not None:
            cache.release(job.seq)
            return
        job.seq.tokens.extend(job.tokens)
        job.seq.cached = len(job.seq.tokens) - 1
        cache.shrink(job.seq)

    def _compact(self) -> None:
        """Move the rows above slot len(running) into the free slots below it."""
        running = self.running
        count = len(running)
        sources = sorted(slot for slot in running if slot >= count)
        if sources:
            targets = [slot for slot in range(count) if slot not in running][: len(sources)]
            self.runner.move(sources, targets)
            for src, dst in zip(sources, targets):
                running[dst] = running.pop(src)
