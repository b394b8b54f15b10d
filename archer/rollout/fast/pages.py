"""The fast engine's paged KV cache: one tensor allocated from a memory budget, pages handed to sequences with
reference counts, so a prompt's pages are shared by its samples and a fork shares its parent's.

A sequence's keys/values fill its pages in order; a page that another sequence also holds is copied before
it is written (copy on write), so only the partly filled last page of a shared prefix is ever copied.
Page 0 is never handed out: rows that are not decoding write their keys/values there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from archer.errors import ArcherError
from archer.rollout.fast.model import ModelSpec, weight_bytes
from archer.units import GIB

TRASH_PAGE = 0


@dataclass(eq=False)
class Sequence:
    """A token sequence and the pages that hold its keys/values.

    ``cached`` tokens (a prefix of ``tokens``) have their keys/values in the cache; a sequence is ready to
    decode when all but its last token are cached: decoding starts by feeding that last token.
    """

    tokens: list[int]
    key: int
    pages: list[int] = field(default_factory=list)
    cached: int = 0

    @property
    def ready(self) -> bool:
        return self.cached == len(self.tokens) - 1


def page_bytes(spec: ModelSpec, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page: keys and values of ``page_size`` tokens in every layer."""
    return 2 * spec.layers * spec.kv_heads * page_size * spec.head_dim * dtype.itemsize


@dataclass(frozen=True)
class CacheBudget:
    """The pages the KV cache gets (``pages``) and the ``wanted`` ones its share gives (within its cap); fewer
    when the card had less free (``free`` bytes of ``total``, after the allocator's cached blocks went back)."""

    pages: int
    wanted: int
    page: int
    free: int = 0
    total: int = 0

    @property
    def shrunk(self) -> bool:
        return self.pages < self.wanted


def budget_pages(spec: ModelSpec, page_size: int, dtype: torch.dtype, device: torch.device, utilization: float,
                 workspace: int, max_pages: int, min_pages: int = 2) -> CacheBudget:
    """How many pages the KV cache gets: its share's, at most ``max_pages``; fewer where the card has less free.

    On a GPU, verl's gpu_memory_utilization: the engine may hold ``utilization`` of the card's total memory, for
    its weights (``weight_bytes``), ``workspace`` bytes of activations and the KV cache in the rest, whatever else
    the process holds. The caching allocator's free blocks (the update's activations) are released first. Where
    the share's cache and the workspace do not fit in what the card then has free, the cache shrinks to what
    fits (the scheduler queues the rows it cannot hold) down to ``min_pages`` (the engine's: one sequence of
    max_model_len tokens); below that, one error with the figures. On a CPU, ``utilization`` of the memory that is
    free, less the workspace.
    """
    page = page_bytes(spec, page_size, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        share = utilization * total - weight_bytes(spec, dtype) - workspace
        if share < 2 * page:
            raise ArcherError(
                f"rollout.gpu_memory_utilization={utilization} leaves no room for the fast engine's KV cache: of "
                f"the GPU's {total / GIB:.1f} GiB it may hold {utilization * total / GIB:.1f} GiB, its weights take "
                f"{weight_bytes(spec, dtype) / GIB:.1f} GiB and its activations {workspace / GIB:.1f} GiB",
                "raise actor_rollout_ref.rollout.gpu_memory_utilization, or lower rollout.max_num_seqs / "
                "rollout.max_num_batched_tokens")
        wanted = min(int(share // page), max_pages)
        fits = max(0, int((free - workspace) // page))
        if fits < min(wanted, min_pages):
            own = torch.cuda.memory_reserved(device)
            raise ArcherError(
                f"the fast engine's KV cache needs at least {min_pages * page / GIB:.1f} GiB (one sequence of "
                f"rollout.max_model_len tokens) and its activations {workspace / GIB:.1f} GiB, which do not fit in the "
                f"{free / GIB:.1f} GiB the GPU has free (of {total / GIB:.1f} GiB; {own / GIB:.1f} GiB are held by "
                "this process's tensors: the policy, its optimiser, other models and the engine's weights; "
                f"{(total - free - own) / GIB:.1f} GiB by CUDA contexts and other processes)",
                "set actor_rollout_ref.actor.fsdp_config.optimizer_offload=true / param_offload=true, lower "
                "rollout.max_num_seqs / rollout.max_num_batched_tokens, or free the GPU of other processes "
                "(nvidia-smi lists them)")
        return CacheBudget(min(wanted, fits), wanted, page, free, total)
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    pages = min(int((utilization * free - workspace) // page), max_pages)
    if pages < 2:
        raise ArcherError(
            f"rollout.gpu_memory_utilization={utilization} leaves no room for the fast engine's KV cache "
            f"({free / GIB:.1f} GiB of memory are free; activations need {workspace / GIB:.1f} GiB)",
            "raise actor_rollout_ref.rollout.gpu_memory_utilization, or lower rollout.max_num_seqs / "
            "rollout.max_num_batched_tokens")
    return CacheBudget(pages, pages, page, free)


class KVCache:
    """Keys and values of every layer, [layers, 2, pages, kv_heads, page_size, head_dim], and the page ledger."""

    def __init__(self, spec: ModelSpec, pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        self.page_size = page_size
        self.data = torch.zeros(spec.layers, 2, pages, spec.kv_heads, page_size, spec.head_dim, dtype=dtype,
                                device=device)
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(spec.layers)]
        self.refs = [0] * pages
        self.free = list(range(pages - 1, TRASH_PAGE, -1))

    @property
    def pages(self) -> int:
        return len(self.refs)

    @property
    def free_pages(self) -> int:
        return len(self.free)

    def _take(self) -> int:
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def _drop(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)

    def blocks(self, tokens: int) -> int:
        """Pages that hold ``tokens`` positions."""
        return -(-tokens // self.page_size)

    def pages_needed(self, seq: Sequence, capacity: int) -> int:
        """Fresh pages that ``make_writable(seq, capacity)`` takes."""
        start = seq.cached // self.page_size
        shared = sum(1 for page in seq.pages[start:] if self.refs[page] > 1)
        return shared + max(0, self.blocks(capacity) - len(seq.pages))

    def fork_pages_needed(self, prefix: int, capacity: int) -> int:
        """Fresh pages a fork of a sequence with ``prefix`` cached tokens takes to write up to ``capacity``."""
        return self.blocks(capacity) - prefix // self.page_size

    def make_writable(self, seq: Sequence, capacity: int) -> list[tuple[int, int]]:
        """Give ``seq`` private pages for positions cached .. capacity - 1; returns the (source, copy) pages
        whose content ``copy_pages`` must duplicate (a shared, partly filled page)."""
        if self.pages_needed(seq, capacity) > self.free_pages:  # before a page is taken: nothing half done
            raise ArcherError(f"the fast engine's KV cache ({self.pages} pages of {self.page_size} tokens) is full",
                              "raise actor_rollout_ref.rollout.gpu_memory_utilization, or release session sequences")
        copies = []
        for index in range(seq.cached // self.page_size, len(seq.pages)):
            page = seq.pages[index]
            if self.refs[page] > 1:
                fresh = self._take()
                if index * self.page_size < seq.cached:
                    copies.append((page, fresh))
                self._drop([page])
                seq.pages[index] = fresh
        while len(seq.pages) < self.blocks(capacity):
            seq.pages.append(self._take())
        return copies

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src, dst = (torch.tensor(side, device=self.data.device) for side in zip(*copies))
            self.data[:, :, dst] = self.data[:, :, src]

    def fork(self, seq: Sequence, key: int) -> Sequence:
        """A new sequence with ``seq``'s tokens that shares the pages of its cached prefix."""
        child = Sequence(list(seq.tokens), key)
        self.share(seq, child, seq.cached)
        return child

    def share(self, source: Sequence, seq: Sequence, cached: int) -> None:
        """Give ``seq`` (holding no pages; its first ``cached`` tokens those of ``source``) the pages of
        ``source``'s first ``cached`` positions, which ``source`` has cached."""
        assert not seq.pages and cached <= source.cached, "share needs an empty sequence and a cached prefix"
        shared = source.pages[: self.blocks(cached)]
        for page in shared:
            self.refs[page] += 1
        seq.pages, seq.cached = list(shared), cached

    def shrink(self, seq: Sequence) -> None:
        """Return the pages past ``seq``'s cached prefix."""
        keep = self.blocks(seq.cached)
        self._drop(seq.pages[keep:])
        del seq.pages[keep:]

    def release(self, seq: Sequence) -> None:
        """Return all of ``seq``'s pages; its keys/values will be computed again if it is decoded later."""
        self._drop(seq.pages)
        seq.pages.clear()
        seq.cached = 0
