"""Continuous batching for the fast engine: jobs wait for a slot and pages, are prefilled (once per prompt,
batched up to ``max_num_batched_tokens`` padded tokens), decode in slots, and leave the moment they end, so
waiting jobs start at the next read of the window.

A job decodes one sequence: either a session's, or (in ``generate``) a fork of its prompt's sequence, made
when the job is admitted, so the n samples of a prompt share the prompt's pages and the prompt is prefilled
once. The host reads the window every ``window`` steps (fewer when every row's budget ends sooner), checks
stop strings on the decoded text, cuts a row after the token that completes one, and frees its slot.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from archer.errors import ArcherError
from archer.rollout.base import SamplingParams
from archer.rollout.fast.model import FastModel
from archer.rollout.fast.pages import TRASH_PAGE, KVCache, Sequence
from archer.rollout.fast.runner import EOS, RUNNING, DecodeRunner, SlotInit
from archer.rollout.hf_engine import _StopMatcher


@dataclass(eq=False)
class Job:
    """One row to decode: up to ``budget`` tokens onto ``seq`` (or onto a fork of ``parent`` keyed ``key``)."""

    budget: int
    seq: Sequence | None = None
    parent: Sequence | None = None
    key: int = 0
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    reason: str | None = None

    def cut(self, length: int) -> None:
        del self.tokens[length:], self.log_probs[length:], self.entropies[length:]


class Scheduler:
    """Runs jobs to completion over the runner's slots and the cache's pages."""

    def __init__(self, model: FastModel, runner: DecodeRunner, tokenizer, *, max_batched_tokens: int) -> None:
        self.model, self.runner, self.tokenizer = model, runner, tokenizer
        self.max_batched_tokens = max_batched_tokens

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
        for seq, _, end in batch:
            seq.cached = end

    # -- the decode loop -------------------------------------------------------------------------------------

    def run(self, cache: KVCache, jobs: list[Job], params: SamplingParams) -> None:
        """Decode every job until its eos, stop string or budget; fills tokens, log_probs, entropies, reason.
        A ``parent`` job decodes a fork (in ``job.seq``) whose pages return when it ends; a parent's pages
        return when all its jobs have started; a session job's sequence takes its tokens when it ends."""
        vocab = self.model.spec.vocab
        filtered = not params.greedy and (0 < params.top_k < vocab or params.top_p < 1)
        stops = _StopMatcher(self.tokenizer, params.stop)
        self.runner.prepare(filtered, cache, rows=len(jobs))
        waiting = deque(jobs)
        running: dict[int, Job] = {}
        children = Counter(job.parent for job in jobs if job.parent is not None)
        while waiting or running:
            self._admit(cache, waiting, running, children, params)
            if not running:
                raise ArcherError(
                    f"a sequence of {len((waiting[0].seq or waiting[0].parent).tokens)} + {waiting[0].budget} tokens "
                    f"does not fit in the fast engine's KV cache ({cache.pages} pages of {cache.page_size} tokens)",
                    "raise actor_rollout_ref.rollout.gpu_memory_utilization, or shorten prompts / responses")
            bucket = self.runner.bucket(max(running) + 1)
            steps = min(self.runner.window, min(job.budget - len(job.tokens) for job in running.values()))
            for _ in range(steps):
                self.runner.run(bucket, filtered, cache)
            self._collect(cache, running, bucket, steps, stops)
            self._compact(running)

    def _admit(self, cache: KVCache, waiting: deque, running: dict[int, Job], children: Counter,
               params: SamplingParams) -> None:
        free = [slot for slot in range(self.runner.slots) if slot not in running]
        pages, chosen, counted = cache.free_pages, [], set()
        for job in waiting:
            if len(chosen) == len(free):
                break
            need = self._pages_needed(cache, job, counted)
            if need > pages:
                break
            pages -= need
            chosen.append(job)
        if not chosen:
            return
        for _ in chosen:
            waiting.popleft()
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
                children[job.parent] -= 1
                if children[job.parent] == 0:
                    cache.release(job.parent)
            copies += cache.make_writable(job.seq, self._capacity(job))
        cache.copy_pages(copies)
        greedy = params.greedy
        rows = [SlotInit(token=job.seq.tokens[-1], position=len(job.seq.tokens) - 1, pages=job.seq.pages,
                         key=job.seq.key, temperature=1.0 if greedy else params.temperature, greedy=greedy,
                         top_k=max(params.top_k, 0), top_p=params.top_p, budget=job.budget) for job in chosen]
        slots = free[: len(chosen)]
        self.runner.place(slots, rows)
        running.update(zip(slots, chosen))

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

    def _collect(self, cache: KVCache, running: dict[int, Job], bucket: int, steps: int,
                 stops: _StopMatcher) -> None:
        window = self.runner.read(bucket, steps)
        finished = []
        for slot, job in running.items():
            start = len(job.tokens)
            for token, logp, entropy, live in zip(window.tokens[slot], window.log_probs[slot],
                                                  window.entropies[slot], window.live[slot]):
                if live:
                    job.tokens.append(token)
                    job.log_probs.append(logp)
                    job.entropies.append(entropy)
            code = window.finish[slot]
            stop = self._first_stop(stops, job.tokens, start)
            if stop is not None and not (code == EOS and stop == len(job.tokens) - 1):
                job.cut(stop + 1)
                job.reason = "stop"
            elif code != RUNNING:
                job.reason = "eos" if code == EOS else "length"
            if job.reason is not None:
                finished.append(slot)
        self.runner.clear(finished)
        for slot in finished:
            self._finish(cache, running.pop(slot))

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

    def _first_stop(self, stops: _StopMatcher, tokens: list[int], start: int) -> int | None:
        """The first index >= start whose token completes a stop string (as the HF engine checks them)."""
        if not stops.stop or start == len(tokens):
            return None
        tail = self.tokenizer.decode(tokens[max(0, start - stops.window) :])
        if not any(s in tail for s in stops.stop):
            return None
        hits = stops.matches([tokens[: j + 1] for j in range(start, len(tokens))],
                             list(range(len(tokens) - start)))
        return start + min(hits) if hits else None

    def _compact(self, running: dict[int, Job]) -> None:
        """Move the rows above slot len(running) into the free slots below it."""
        count = len(running)
        sources = sorted(slot for slot in running if slot >= count)
        if sources:
            targets = [slot for slot in range(count) if slot not in running][: len(sources)]
            self.runner.move(sources, targets)
            for src, dst in zip(sources, targets):
                running[dst] = running.pop(src)
