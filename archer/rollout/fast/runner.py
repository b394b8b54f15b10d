"""The decode step of the fast engine over a fixed set of slots, and its CUDA graphs.

Everything a decoding row needs lives in per-slot tensors allocated once (input token, position, page table,
noise key, sampling settings, token budget), and one step updates them on the device: forward, sampling,
eos and budget checks, and the write of the sampled token, its log-prob and entropy (and, where the model
records its routing, the input token's expert ids) into a small window buffer that the host reads every few steps. So steps run back to back without a host round trip, and on a
GPU each bucket of batch sizes is one captured CUDA graph (for plain sampling, and for top-k / top-p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archer.rollout.fast import sampling
from archer.rollout.fast.model import FastModel
from archer.rollout.fast.pages import KVCache

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
RUNNING, EOS, LENGTH = 0, 1, 2


@dataclass
class SlotInit:
    """What a row starts decoding with."""

    token: int
    position: int
    pages: list[int]
    key: int
    temperature: float
    greedy: bool
    top_k: int
    top_p: float
    budget: int


@dataclass
class Window:
    """The steps since the last read, per slot: tokens, log-probs, entropies, which were live, and each
    slot's finish code (RUNNING, EOS, LENGTH); ``routes``: the expert ids each step's input token was routed to,
    int16 [slots, steps, sparse layers, top_k] (None unless the model records them)."""

    tokens: list[list[int]]
    log_probs: list[list[float]]
    entropies: list[list[float]]
    live: list[list[bool]]
    finish: list[int]
    routes: torch.Tensor | None = None


def attention_splits(rows: int, kv_heads: int, sms: int) -> int:
    """How many programs share one row's context in the decode attention: doubled (up to 16) while the rows' key /
    value heads leave streaming multiprocessors idle. More splits cost more than they hide (their partial results
    are merged by a second kernel): BENCHMARKS.md, "The decode attention's tiles"."""
    splits = 1
    while splits < 16 and rows * kv_heads * splits < sms:
        splits *= 2
    return splits


class DecodeRunner:
    """Per-slot decode state, the step over slots [0, bucket) and its graphs."""

    def __init__(self, model: FastModel, *, slots: int, table_width: int, eos_ids: list[int], window: int,
                 use_graphs: bool) -> None:
        self.model, self.use_graphs, self.window = model, use_graphs, window
        device = model.device

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.tokens, self.positions, self.keys, self.top_k = zeros(slots), zeros(slots), zeros(slots), zeros(slots)
        self.tables = zeros(slots, table_width, dtype=torch.int32)
        self.active, self.greedy = zeros(slots, dtype=torch.bool), zeros(slots, dtype=torch.bool)
        self.temperature = torch.ones(slots, device=device)
        self.top_p = torch.ones(slots, device=device)
        self.n_gen, self.budget = zeros(slots), zeros(slots)
        self.finish = zeros(slots, dtype=torch.uint8)
        self.no_threshold = torch.full((slots,), float("-inf"), device=device)
        self.out_tokens = zeros(slots, window)
        self.out_logp, self.out_ent = zeros(slots, window, dtype=torch.float32), zeros(slots, window, dtype=torch.float32)
        self.out_live = zeros(slots, window, dtype=torch.bool)
        spec = model.spec
        self.out_routes = (zeros(slots, window, sum(spec.sparse_layers), spec.top_k, dtype=torch.int16)
                           if model.record_routes else None)
        self.column = zeros(1)
        self.eos = torch.tensor(eos_ids or [-1], device=device)
        self.state = [self.tokens, self.positions, self.keys, self.top_k, self.tables, self.active, self.greedy,
                      self.temperature, self.top_p, self.n_gen, self.budget, self.finish]
        self.slots = slots
        self.buckets = [b for b in BUCKETS if b < slots] + [slots]
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        self._sms = sms
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._graph_cache: KVCache | None = None
        self._pool = None

    def bucket(self, rows: int) -> int:
        """The smallest bucket that covers slots [0, rows)."""
        return next(b for b in self.buckets if b >= rows)

    def splits(self, bucket: int) -> int:
        """How many programs share one row's context in the attention kernel (``attention_splits``)."""
        return attention_splits(bucket, self.model.spec.kv_heads, self._sms)

    # -- the step (runs eagerly, or is captured) ----------------------------------------------------------

    def step(self, bucket: int, filtered: bool, cache: KVCache) -> None:
        b, page = bucket, cache.page_size
        live, positions, tokens = self.active[:b], self.positions[:b], self.tokens[:b]
        table_pages = self.tables[:b].gather(1, (positions // page).unsqueeze(1)).squeeze(1).long()
        slots = torch.where(live, table_pages * page, 0) + positions % page
        logits = self.model.decode_logits(tokens, positions, slots, self.tables[:b], cache.layers, self.splits(b))
        temperature = self.temperature[:b]
        threshold = (sampling.filter_thresholds(logits, temperature, self.top_k[:b], self.top_p[:b]) if filtered
                     else self.no_threshold[:b])
        token, logp, entropy = sampling.sample(logits, temperature, self.greedy[:b], self.keys[:b], positions + 1,
                                               threshold)
        column = self.column.expand(b).unsqueeze(1)
        self.out_tokens[:b].scatter_(1, column, token.unsqueeze(1))
        self.out_logp[:b].scatter_(1, column, logp.unsqueeze(1))
        self.out_ent[:b].scatter_(1, column, entropy.unsqueeze(1))
        self.out_live[:b].scatter_(1, column, live.unsqueeze(1))
        if self.out_routes is not None:
            routes = self.model.routes.unsqueeze(1)
            self.out_routes[:b].scatter_(1, column[:, :, None, None].expand_as(routes), routes)
        n_gen = self.n_gen[:b] + live.long()
        is_eos = live & torch.isin(token, self.eos)
        is_full = live & (n_gen >= self.budget[:b])
        self.finish[:b] = torch.where(is_eos, EOS, torch.where(is_full, LENGTH, self.finish[:b]))
        self.n_gen[:b] = n_gen
        self.tokens[:b] = torch.where(live, token, tokens)
        self.positions[:b] = positions + live.long()
        self.active[:b] = live & ~(is_eos | is_full)
        self.column += 1

    def run(self, bucket: int, filtered: bool, cache: KVCache) -> None:
        if self.use_graphs:
            self.graphs[(bucket, filtered)].replay()
        else:
            self.step(bucket, filtered, cache)

    def prepare(self, filtered: bool, cache: KVCache, rows: int | None = None) -> None:
        """Idle every slot; on a GPU, capture the graphs of this sampling variant that are missing, for the
        buckets up to the one of ``rows`` sequences (default: every slot): a decode of fewer sequences never
        runs a larger bucket, and capturing one costs a decode step over all its slots and vocabulary."""
        self.active.zero_()
        self.positions.zero_()
        self.column.zero_()
        if not self.use_graphs:
            return
        if self._graph_cache is not cache:
            self.release_graphs()
            self._graph_cache = cache
        largest = self.bucket(min(rows or self.slots, self.slots))
        self._capture([b for b in reversed(self.buckets) if b <= largest], filtered, cache)

    def _capture(self, buckets: list[int], filtered: bool, cache: KVCache) -> None:
        """Capture the graphs of ``buckets`` that are missing (each run once eagerly first, which compiles its
        kernels)."""
        missing = [b for b in buckets if (b, filtered) not in self.graphs]
        if not missing:
            return
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        for bucket in missing:
            self.column.zero_()  # each eager run writes one window column: more buckets than columns would overflow
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step(bucket, filtered, cache)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self.step(bucket, filtered, cache)
            self.graphs[(bucket, filtered)] = graph
        self.column.zero_()

    def release_graphs(self) -> None:
        self.graphs.clear()
        self._graph_cache = None
        self._pool = None

    # -- host side -----------------------------------------------------------------------------------------

    def place(self, slots: list[int], rows: list[SlotInit]) -> None:
        """Start ``rows`` decoding in ``slots``."""
        device = self.tokens.device
        index = torch.tensor(slots, device=device)

        def put(target: torch.Tensor, values: list) -> None:
            target.index_copy_(0, index, torch.tensor(values, dtype=target.dtype).to(device))

        put(self.tokens, [r.token for r in rows])
        put(self.positions, [r.position for r in rows])
        put(self.keys, [r.key for r in rows])
        put(self.temperature, [r.temperature for r in rows])
        put(self.greedy, [r.greedy for r in rows])
        put(self.top_k, [r.top_k for r in rows])
        put(self.top_p, [r.top_p for r in rows])
        put(self.budget, [r.budget for r in rows])
        put(self.n_gen, [0] * len(rows))
        put(self.finish, [RUNNING] * len(rows))
        put(self.active, [True] * len(rows))
        tables = torch.zeros(len(rows), self.tables.shape[1], dtype=torch.int32)
        for i, r in enumerate(rows):
            tables[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        self.tables.index_copy_(0, index, tables.to(device))

    def read(self, bucket: int, steps: int) -> Window:
        """The last ``steps`` steps of slots [0, bucket); the window starts over."""
        b = bucket
        window = Window(self.out_tokens[:b, :steps].tolist(), self.out_logp[:b, :steps].tolist(),
                        self.out_ent[:b, :steps].tolist(), self.out_live[:b, :steps].tolist(),
                        self.finish[:b].tolist(),
                        None if self.out_routes is None else self.out_routes[:b, :steps].cpu())
        self.column.zero_()
        return window

    def clear(self, slots: list[int]) -> None:
        """Stop the rows in ``slots`` (their position goes to 0, so idle rows cost no attention)."""
        if slots:
            index = torch.tensor(slots, device=self.tokens.device)
            self.active[index] = False
            self.positions[index] = 0

    def move(self, sources: list[int], targets: list[int]) -> None:
        """Move rows from ``sources`` to the free ``targets`` (packing live rows into a smaller bucket)."""
        if sources:
            src, dst = (torch.tensor(s, device=self.tokens.device) for s in (sources, targets))
            for tensor in self.state:
                tensor[dst] = tensor[src]
            self.clear(sources)
