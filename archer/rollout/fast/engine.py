"""FastEngine: archer's own generation engine for the Qwen2 family (RolloutEngine), and its sessions.

It owns a copy of the actor's weights (``sync_weights`` copies them in place), a paged KV cache sized from
``gpu_memory_utilization`` as verl means it (the share of the card the engine holds: weights, KV cache and
workspace; pages.py), freed by ``release_memory`` during the policy update (with ``weights=True`` the weight
copy too, taken again by the next ``sync_weights``) and made again by ``reclaim_memory``, and decodes with continuous batching over ``max_num_seqs`` slots, as CUDA graphs on a
GPU (eagerly with ``enforce_eager`` or on a CPU). Samples follow per-row seeds; every sampled token carries
its float32 log-prob and full-vocabulary entropy of softmax(logits / T), as the HF engine reports them.

Its sessions are continuous (``ContinuousSession``): the agentic loop submits each trajectory's next turn to
the engine's one running batch and polls for the turns that ended, so a trajectory waiting for a tool holds
no decode slot (its pages stay cached), and resumed turns, branches and refills join the batch as they come.
A fork shares its parent's pages; a fork of a sequence whose last tokens are not cached yet (a prompt, a turn
just extended with a tool answer) waits for the next poll, which prefills those tokens once, batched, for
the parent and all its forks. When the cache is dropped (new weights, memory freed for the update), a fork
that decodes again shares its prefix with its nearest ancestor that costs no extra prefill (one cached that
far, one decoding in the same poll, or a prompt's root), so a prompt kept across weight syncs is prefilled
once again, not once per sample and branch.

With ``record_routes`` (routing replay, models/router_replay.py; an MoE model) ``generate`` also returns the
experts each position of each row was routed to: its prompt's, prefilled once for its samples, then every fed
sampled token's (``RolloutOutput.routed_experts``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from archer.errors import ArcherError
from archer.models.loading import default_dtype
from archer.rollout import simulated_turns
from archer.rollout.base import (
    PAUSED,
    ContinuousSession,
    DecodeCounters,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    Segment,
    padded_samples,
)
from archer.rollout.endings import eos_ids
from archer.rollout.fast import ops
from archer.rollout.fast.model import FastModel, ModelSpec
from archer.rollout.fast.pages import KVCache, Sequence, budget_pages
from archer.rollout.fast.runner import DecodeRunner
from archer.rollout.fast.sampling import noise_key
from archer.rollout.fast.scheduler import Job, Scheduler
from archer.units import GIB

_MIB = 1 << 20
log = logging.getLogger("archer.rollout")
PAGE_SIZE = 32  # tokens per KV-cache page (the engine's default)


def workspace_bytes(spec: ModelSpec, dtype: torch.dtype, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Activations beside the cache: the decode step of every slot (logits and the float32 work of the
    sampler, kept by the graphs' pool) and a prefill of max_num_batched_tokens tokens."""
    item = dtype.itemsize
    decode = max_num_seqs * spec.vocab * (item + 28)
    prefill = max_num_batched_tokens * item * (
        8 * spec.hidden + spec.qkv_width + 3 * spec.intermediate + 4 * spec.heads * spec.head_dim)
    return decode + prefill + 256 * _MIB


class FastEngine(RolloutEngine):
    """Generation with archer's own Qwen2-family forward (see the module docstring).

    ``model`` is the actor (any device and dtype: its weights are copied); the engine runs on ``device``
    (default: the model's) in ``dtype`` (default: bfloat16 on a GPU, float32 on a CPU). Positions are bounded
    by ``max_model_len`` (default: the model's max_position_embeddings). The cache is made of pages of
    ``page_size`` tokens; the host reads the decoded tokens every ``window`` steps, which is when stop strings
    are checked and an ended row's slot is given to a waiting one. ``weights``: the first weights (default: the
    model's own; a sharded actor passes its stream of full tensors, see ``sync_weights``).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        gpu_memory_utilization: float = 0.5,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        page_size: int = PAGE_SIZE,
        window: int = 16,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
        record_routes: bool = False,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ArcherError("the tokenizer has no pad token, which batched generation needs",
                              "load it with archer.models.loading.load_tokenizer (pad falls back to eos)")
        checks = (
            (0 < gpu_memory_utilization <= 1, f"rollout.gpu_memory_utilization={gpu_memory_utilization}",
             "use a fraction in (0, 1]"),
            (max_num_seqs >= 1, f"rollout.max_num_seqs={max_num_seqs}", "use 1 or more"),
            (max_num_batched_tokens >= 1, f"rollout.max_num_batched_tokens={max_num_batched_tokens}",
             "use 1 or more"),
            (page_size >= 16 and page_size & (page_size - 1) == 0, f"page_size={page_size}",
             "use a power of two >= 16"),
            (window >= 1, f"window={window}", "use 1 or more"),
        )
        for ok, value, fix in checks:
            if not ok:
                raise ArcherError(f"invalid fast engine setting {value}", fix)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = dtype or default_dtype(self.device)
        self.max_model_len = int(max_model_len or model.config.max_position_embeddings)
        self.model = FastModel(model, device=self.device, dtype=self.dtype, max_len=self.max_model_len + 1,
                               weights=weights)
        if record_routes and not any(self.model.spec.sparse_layers):
            raise ArcherError(f"routing replay records the experts of an MoE model, and "
                              f"{self.model.spec.model_type} has no sparse layers",
                              "leave actor_rollout_ref.rollout.enable_rollout_routing_replay=false and "
                              "actor_rollout_ref.actor.router_replay.mode=disabled for a dense model")
        self.model.record_routes = record_routes
        self.tokenizer = tokenizer
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.eos_token_ids = eos_ids(model, tokenizer)
        self.utilization, self.page_size = gpu_memory_utilization, page_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        use_graphs = self.device.type == "cuda" and not enforce_eager and ops.kernels is not None
        self.runner = DecodeRunner(self.model, slots=max_num_seqs, table_width=-(-self.max_model_len // page_size),
                                   eos_ids=self.eos_token_ids, window=window, use_graphs=use_graphs)
        self.scheduler = Scheduler(self.model, self.runner, tokenizer, max_batched_tokens=max_num_batched_tokens,
                                   release_idle=self._release_idle)
        self.cache: KVCache | None = None
        self.live: set[Sequence] = set()  # session sequences, whose keys/values a weight sync invalidates
        self.expected_rows = 0  # the largest running batch a session announced (FastSession.expect)
        self.shrink_warned = False  # the warning that the cache got less than its share is given once
        self.cache_bytes = 0  # the KV cache's bytes when last sized
        self.reclaim_memory()

    @classmethod
    def from_config(cls, model: nn.Module, tokenizer: PreTrainedTokenizerBase, rollout, *,
                    device: torch.device | str, weights: Iterable[tuple[str, torch.Tensor]] | None = None,
                    record_routes: bool = False) -> FastEngine:
        """Build from ``actor_rollout_ref.rollout`` (verl's keys): gpu_memory_utilization, max_num_seqs,
        max_num_batched_tokens, max_model_len (null: prompt_length + response_length), enforce_eager and,
        on a GPU, dtype."""
        device = torch.device(device)
        max_len = rollout.max_model_len or int(rollout.prompt_length) + int(rollout.response_length)
        dtype = getattr(torch, str(rollout.dtype)) if device.type == "cuda" else None
        return cls(model, tokenizer, device=device, dtype=dtype,
                   gpu_memory_utilization=float(rollout.gpu_memory_utilization),
                   max_num_seqs=int(rollout.max_num_seqs), max_num_batched_tokens=int(rollout.max_num_batched_tokens),
                   max_model_len=int(max_len), enforce_eager=bool(rollout.enforce_eager), weights=weights,
                   record_routes=record_routes)

    # -- memory and weights ------------------------------------------------------------------------------

    def reclaim_memory(self) -> None:
        """Allocate the KV cache (once: a no-op while it exists)."""
        if self.cache is not None:
            return
        if self.model.released:
            raise ArcherError("the fast engine's weights were released and not taken again",
                              "call sync_weights with the policy's weights before generating")
        spec = self.model.spec
        blocks = -(-self.max_model_len // self.page_size)  # at least: one sequence of max_model_len tokens, the
        # partly filled last page of the prompt it forks from, and page 0 (TRASH_PAGE)
        workspace = workspace_bytes(spec, self.dtype, self.max_num_seqs, self.max_num_batched_tokens)
        budget = budget_pages(spec, self.page_size, self.dtype, self.device, self.utilization, workspace,
                              max_pages=(self.max_num_seqs + 1) * blocks + 1, min_pages=blocks + 2)
        if budget.shrunk and not self.shrink_warned:
            self.shrink_warned = True
            fitting = (budget.total * self.utilization - (budget.wanted - budget.pages) * budget.page) / budget.total
            log.warning(
                "the fast engine's KV cache gets %.1f GiB, not the %.1f GiB that rollout.gpu_memory_utilization=%s "
                "gives it: the GPU has %.1f GiB free and the engine's activations take %.1f GiB. Generation queues "
                "the rows the smaller cache cannot hold (this warning is not repeated; the cache is sized again each "
                "generation); actor_rollout_ref.rollout.gpu_memory_utilization=%.2f asks for what fits",
                budget.pages * budget.page / GIB, budget.wanted * budget.page / GIB, self.utilization,
                budget.free / GIB, workspace / GIB, max(fitting, 0.01))
        self.cache_bytes = budget.pages * budget.page
        self.cache = KVCache(spec, budget.pages, self.page_size, self.dtype, self.device)

    def release_memory(self, weights: bool = False) -> None:
        """Free the KV cache and the CUDA graphs (with ``weights``, the weight copy too: ``sync_weights`` takes
        it again); live session sequences keep their tokens and are prefilled again when they next decode."""
        self.scheduler.reset()  # nothing decodes between generation calls, unless one failed
        for seq in self.live:
            seq.pages.clear()
            seq.cached = 0
        self.expected_rows = 0
        self.runner.release_graphs()
        self.cache = None
        if weights:
            self.model.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _release_idle(self, busy: set[Sequence]) -> bool:
        """Free the pages of the session sequences that neither wait nor decode (kept for their next turn) and are
        not in ``busy``; they are prefilled again when they next decode. Whether any pages went back."""
        idle = [seq for seq in self.live if seq.pages and seq not in busy]
        for seq in idle:
            self.cache.release(seq)
        return bool(idle)

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the stream of named weights (LoRA layers merged) into the engine's, in place (its graphs stay
        valid); every tensor must have its place by name and shape (FastModel.load). Session sequences'
        keys/values were made by the old weights, so they are dropped and recomputed on next use. After
        ``release_memory(weights=True)`` the copy is allocated again first."""
        self.model.load(weights)
        for seq in self.live:
            if self.cache is not None:
                self.cache.release(seq)

    # -- generation ------------------------------------------------------------------------------------------

    def budget(self, length: int, max_new_tokens: int) -> int:
        """Tokens a sequence of ``length`` may still sample: max_new_tokens, within max_model_len."""
        if length > self.max_model_len:
            raise ArcherError(f"a sequence of {length} tokens is longer than rollout.max_model_len="
                              f"{self.max_model_len}", "raise actor_rollout_ref.rollout.max_model_len")
        return min(max_new_tokens, self.max_model_len - length + 1)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ArcherError(f"prompt {i} is empty", "every prompt needs at least one token")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        parents = [Sequence(list(prompt), key=0) for prompt in prompts]
        jobs = [Job(budget=self.budget(len(prompt), params.max_new_tokens), parent=parent,
                    key=noise_key(seed, (params.first_prompt + i) * params.n + j))
                for i, (prompt, parent) in enumerate(zip(prompts, parents)) for j in range(params.n)]
        self.reclaim_memory()
        routes = None
        try:
            with torch.no_grad():
                self.scheduler.run(self.cache, jobs, params)
            if self.model.record_routes:
                routes = self._routes(jobs)
        finally:
            self.scheduler.reset()  # a no-op unless the run failed
            if self.cache is not None:
                for seq in parents + [job.seq for job in jobs if job.seq is not None]:
                    self.cache.release(seq)
        return self._output(jobs, len(prompts), params.n, routes)

    def _routes(self, jobs: list[Job]) -> list[torch.Tensor]:
        """Each job's recorded experts, int16 [prompt + sampled tokens - 1, sparse layers, top_k]: its prompt's
        prefilled positions, then the tokens it fed (the prompt's last one first; the last sampled token is never
        fed)."""
        spec = self.model.spec
        empty = torch.zeros(0, sum(spec.sparse_layers), spec.top_k, dtype=torch.int16)
        out = []
        for job in jobs:
            pieces = [ids for _, ids in self.scheduler.prefilled.get(job.parent, [])]
            out.append(torch.cat([empty, *pieces, *job.routes]))
        return out

    def _output(self, jobs: list[Job], prompts: int, n: int, routes: list[torch.Tensor] | None = None
                ) -> RolloutOutput:
        responses, mask, log_probs, entropies = padded_samples(jobs, self.pad_token_id)
        return RolloutOutput(responses=responses, response_mask=mask, log_probs=log_probs, entropies=entropies,
                             prompt_index=torch.arange(prompts).repeat_interleave(n),
                             finish_reasons=[job.reason for job in jobs], routed_experts=routes)

    def session(self) -> ContinuousSession:
        """A FastSession (scripted when ``ARCHER_SIMULATED_TURNS`` is set: benchmarks, rollout/simulated_turns.py)."""
        script = simulated_turns.from_environment()
        session = FastSession(self)
        return session if script is None else simulated_turns.ScriptedTurns(session, script, self.tokenizer)


class FastSession(ContinuousSession):
    """Turn-by-turn sequences on a FastEngine's running batch (see the module docstring): tokens added by ``add`` /
    ``extend`` are prefilled when the sequence next decodes or is forked, only the new ones, batched across
    sequences; ``fork`` shares the pages."""

    def __init__(self, engine: FastEngine) -> None:
        self.engine = engine
        self._seqs: dict[int, Sequence] = {}
        self._origins: dict[Sequence, tuple[Sequence, int]] = {}  # a fork waiting for its parent's prefill
        # every fork: the sequence it was forked from and how many leading tokens they shared then; and each
        # sequence's forks (so that a release re-points only its own)
        self._lineage: dict[Sequence, tuple[Sequence, int]] = {}
        self._forks: dict[Sequence, list[Sequence]] = {}
        self._queued: list[Job] = []
        self._in_flight: set[Job] = set()  # submitted and not yet returned by poll
        self._ended: list[tuple[int, Segment]] = []
        self._params: SamplingParams | None = None
        self._next = 0
        start = engine.scheduler.counters
        self._start = DecodeCounters(start.steps, start.tokens, 0, start.prefilled)
        self._peak = 0

    def _get(self, seq: int) -> Sequence:
        if seq not in self._seqs:
            raise ArcherError(f"sequence {seq} is not in this session",
                              "use an id that add or fork returned and that was not released")
        return self._seqs[seq]

    def _register(self, sequence: Sequence) -> int:
        self.engine.budget(len(sequence.tokens), 1)
        sid, self._next = self._next, self._next + 1
        self._seqs[sid] = sequence
        self.engine.live.add(sequence)
        return sid

    def add(self, prompt: list[int], seed: int) -> int:
        if not prompt:
            raise ArcherError("the prompt is empty", "a sequence needs at least one token")
        return self._register(Sequence(list(prompt), key=noise_key(seed)))

    def extend(self, seq: int, tokens: list[int]) -> None:
        sequence = self._get(seq)
        self._check_idle(sequence, "extended")
        self.engine.budget(len(sequence.tokens) + len(tokens), 1)
        sequence.tokens.extend(tokens)

    def fork(self, seq: int, seed: int) -> int:
        """A copy of ``seq``: at once sharing its pages when all its tokens but the last are cached, else at the
        next poll (after one prefill of the parent's new tokens, shared by all its forks)."""
        parent = self._get(seq)
        self._check_idle(parent, "forked")
        key = noise_key(seed)
        if parent in self._origins:  # a fork of a fork that waits: share from the same source
            origin, shared = self._origins[parent]
            child = Sequence(list(parent.tokens), key)
            self._origins[child] = (origin, min(shared, len(parent.tokens)))
        elif self.engine.cache is not None and parent.ready and parent.pages:
            child = self.engine.cache.fork(parent, key)
        else:
            child = Sequence(list(parent.tokens), key)
            self._origins[child] = (parent, len(parent.tokens))
        self._descends(child, parent, len(parent.tokens))
        return self._register(child)

    def _descends(self, child: Sequence, parent: Sequence, shared: int) -> None:
        self._lineage[child] = (parent, shared)
        self._forks.setdefault(parent, []).append(child)

    def release(self, seq: int) -> None:
        sequence = self._get(seq)
        if any(origin is sequence for origin, _ in self._origins.values()):
            if self.engine.cache is None:  # no pages to share (memory released): its forks prefill themselves
                self._origins = {c: o for c, o in self._origins.items() if o[0] is not sequence}
            else:
                self._share_prefixes()  # its waiting forks take its pages first
        for job in [j for j in self._in_flight if j.seq is sequence]:
            self._in_flight.discard(job)
            if job in self._queued:
                self._queued.remove(job)
            else:
                self.engine.scheduler.cancel(job)
        self._ended = [(sid, segment) for sid, segment in self._ended if sid != seq]
        del self._seqs[seq]
        self._origins.pop(sequence, None)
        inherited = self._lineage.pop(sequence, None)  # its forks now descend from its own source
        if inherited is not None:
            self._forks[inherited[0]].remove(sequence)
        for child in self._forks.pop(sequence, []):
            shared = self._lineage.pop(child)[1]
            if inherited is not None:
                self._descends(child, inherited[0], min(shared, inherited[1]))
        self.engine.live.discard(sequence)
        if self.engine.cache is not None:
            self.engine.cache.release(sequence)

    def tokens(self, seq: int) -> list[int]:
        return list(self._get(seq).tokens)

    def _check_idle(self, sequence: Sequence, what: str) -> None:
        if any(job.seq is sequence for job in self._in_flight):
            raise ArcherError(f"a sequence was {what} while it decodes",
                              "wait until poll returns its segment")

    # -- the running batch ------------------------------------------------------------------------------

    def expect(self, rows: int) -> None:
        self.engine.expected_rows = max(self.engine.expected_rows, rows)

    def submit(self, seq: int, params: SamplingParams, max_new_tokens: int, lookback: int = 0) -> None:
        sequence = self._get(seq)
        self._check_idle(sequence, "submitted")
        if max_new_tokens < 1:
            raise ArcherError(f"max_new_tokens={max_new_tokens}", "every budget must be at least 1")
        if self._params is not None and params != self._params:
            raise ArcherError("a session's decodes sample with different parameters",
                              "use one SamplingParams for every decode of a session")
        self._params = params
        job = Job(budget=self.engine.budget(len(sequence.tokens), max_new_tokens), seq=sequence, tag=(self, seq),
                  lookback=sequence.tokens[-lookback:] if lookback > 0 else [])
        self._queued.append(job)
        self._in_flight.add(job)

    @property
    def busy(self) -> bool:
        return bool(self._in_flight)

    def pause(self) -> list[tuple[int, Segment]]:
        """Every decode of this session that is queued, waiting or running stops; a running one frees its slot
        and its sequence takes the tokens it sampled (read at the last window, stop strings checked), so that a
        later ``submit`` continues it. Its cached keys and values stay until the weights change."""
        paused = []
        for job in list(self._in_flight):
            if job in self._queued:
                self._queued.remove(job)
            else:
                self.engine.scheduler.interrupt(job)
            self._in_flight.discard(job)
            paused.append((job.tag[1], Segment(list(job.tokens), torch.tensor(job.log_probs, dtype=torch.float32),
                                               torch.tensor(job.entropies, dtype=torch.float32), PAUSED)))
        return sorted(paused, key=lambda item: item[0])

    def poll(self) -> list[tuple[int, Segment]]:
        engine, scheduler = self.engine, self.engine.scheduler
        engine.reclaim_memory()
        with torch.no_grad():
            self._restore_shares()
            self._share_prefixes()
            if self._queued:
                if not scheduler.busy:
                    scheduler.open(engine.cache, self._params, rows=max(engine.expected_rows, len(self._queued)))
                elif scheduler.params != self._params:
                    raise ArcherError("two sessions decode with different sampling parameters at once",
                                      "use one SamplingParams for the sessions of one generation call")
                scheduler.add(self._queued)
                self._queued = []
            if scheduler.busy:
                ended = scheduler.step()
                self._peak = max(self._peak, scheduler.last_rows)
                for job in ended:
                    session, sid = job.tag
                    session._take(sid, job)
        out, self._ended = self._ended, []
        return out

    def _take(self, sid: int, job: Job) -> None:
        """An ended job of this session (another session's poll may have decoded it)."""
        self._in_flight.discard(job)
        self._ended.append((sid, Segment(job.tokens, torch.tensor(job.log_probs, dtype=torch.float32),
                                         torch.tensor(job.entropies, dtype=torch.float32), job.reason)))

    def _restore_shares(self) -> None:
        """A queued fork with nothing cached (the cache was dropped) waits, as a new fork does, for the pages of its
        nearest ancestor whose prefill costs nothing beyond what they share (``_source``); only where that shares
        a page or more, and while the sources to prefill take at most half the free pages (the rest prefill alone
        when the scheduler admits them)."""
        cache = self.engine.cache
        queued = {job.seq for job in self._queued}
        decoding = {job.seq for job in self._in_flight} - queued
        room, planned = cache.free_pages // 2, set()
        for seq in (job.seq for job in self._queued):  # in submission order: the same sharing on every run
            if seq.pages or seq in self._origins or seq not in self._lineage:
                continue
            source, shared = self._source(seq, queued, decoding)
            if source is None or shared - 1 < cache.page_size:
                continue
            if source.cached < shared - 1 and source not in planned:
                need = cache.pages_needed(source, len(source.tokens) - 1)
                if need > room:
                    continue
                room -= need
                planned.add(source)
            self._origins[seq] = (source, shared)

    def _source(self, seq: Sequence, queued: set[Sequence], decoding: set[Sequence]) -> tuple[Sequence | None, int]:
        """The ancestor of ``seq`` to share from and the leading tokens they have in common: the nearest one that is
        not decoding and is cached that far, decodes in this poll (prefilled anyway) or is a root that has not grown
        since (a prompt's; a fork that never decodes, such as ARPO's branch point, would be prefilled from its
        first token, so the search goes past it); (None, 0) when there is none."""
        parent, shared = self._lineage[seq]
        while parent in decoding or not (parent.cached >= shared - 1 or parent in queued
                                         or (len(parent.tokens) == shared and parent not in self._lineage)):
            if parent not in self._lineage:
                return None, 0
            parent, upto = self._lineage[parent]
            shared = min(shared, upto)
        return parent, shared

    def _share_prefixes(self) -> None:
        """Give every waiting fork its source's pages, prefilling the sources' uncached tokens first (once, in one
        batch a round; a source that waits for its own source goes a round later); a fork whose source was
        released prefills itself when it decodes."""
        engine = self.engine
        cache = engine.cache
        while self._origins:
            waiting = {child: entry for child, entry in self._origins.items() if entry[0] in engine.live}
            now = [(child, origin, shared) for child, (origin, shared) in waiting.items() if origin not in waiting]
            self._origins = {child: entry for child, entry in waiting.items() if entry[0] in waiting}
            parents = list({origin: None for _, origin, shared in now if origin.cached < shared - 1})
            copies = []
            for parent in parents:
                copies += cache.make_writable(parent, len(parent.tokens) - 1)
            cache.copy_pages(copies)
            engine.scheduler.prefill(cache, parents)
            for child, origin, shared in now:
                cache.share(origin, child, shared - 1)

    def restart_peak(self) -> None:
        self._peak = 0

    def counters(self) -> DecodeCounters:
        now = self.engine.scheduler.counters
        return DecodeCounters(now.steps - self._start.steps, now.tokens - self._start.tokens, self._peak,
                              now.prefilled - self._start.prefilled)

    def decode(self, seqs: list[int], params: SamplingParams, max_new_tokens: list[int]) -> list[Segment]:
        if len(seqs) != len(max_new_tokens) or len(set(seqs)) != len(seqs):
            raise ArcherError(f"decode got {len(seqs)} sequences ({len(set(seqs))} distinct) and "
                              f"{len(max_new_tokens)} budgets", "pass each sequence once, with one budget each")
        if any(m < 1 for m in max_new_tokens):
            raise ArcherError(f"max_new_tokens={max_new_tokens}", "every budget must be at least 1")
        if self.busy:
            raise ArcherError("decode was called while submitted sequences decode", "poll them first")
        previous, self._params = self._params, None
        segments = super().decode(seqs, params, max_new_tokens)
        self._params = previous
        return segments
