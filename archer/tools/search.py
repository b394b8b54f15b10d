"""The search tool: one tool, three back ends, ARPO's result format, caches in front.

- ``backend: cache``: only the cache file (ARPO's ``search_cache.json``); a query it lacks is an error result.
- ``backend: bm25``: a local bm25s index (``index_dir``, built by ``archer build-index``).
- ``backend: http``: a retriever server with Search-R1's API: ``POST url`` with ``{"queries": [q], "topk": k,
  "return_scores": true}`` answered by ``{"result": [[{"document": {"contents": "\\"Title\\"\\ntext"}, ...}]]}``.

Results read ``Page 1: ...\\nPage 2: ...`` (``top_k`` pages, each cut to ``result_length`` characters, cached
results alike), or ``No search results found.``. An in-memory LRU (``memory_cache_size``) answers repeated
queries; with ``cache_file`` set, the cache file is consulted before the bm25/http back end and, when
``cache_writable``, receives each new result (write-through). A query longer than ``MAX_QUERY_CHARS`` is an
error result that reaches no cache and no back end; ``request_timeout`` is a deadline for each whole HTTP request
(archer/http_deadline.py).
"""

from __future__ import annotations

import re
from typing import Any

from archer.errors import ArcherError
from archer.tools.base import Tool, ToolResult
from archer.tools.bm25_index import BM25Index, Passage
from archer.tools.search_cache import MAX_QUERY_CHARS, MemoryCache, SearchCacheFile

BACKENDS = ("cache", "bm25", "http")
NO_RESULTS = "No search results found."
_PAGE_START = re.compile(r"\n(?=Page \d+: )")
_PAGE = re.compile(r"(Page \d+: )(.*)", re.DOTALL)


def format_pages(passages: list[Passage], result_length: int) -> str:
    """ARPO's format: one ``Page i: <title>. <text>`` line per passage, each cut to ``result_length``."""
    pages = []
    for i, p in enumerate(passages, 1):
        body = (f"{p.title}. {p.text}" if p.title else p.text).replace("\n", " ")
        pages.append(f"Page {i}: {body[:result_length]}")
    return "\n".join(pages) if pages else NO_RESULTS


def cut_pages(text: str, top_k: int, result_length: int) -> str:
    """A cached result cut as ``format_pages`` cuts a fresh one: its first ``top_k`` pages, each page's text
    to ``result_length`` characters (a text without pages, such as ``No search results found.``, as it is)."""
    return "\n".join(_cut_page(page, result_length) for page in _PAGE_START.split(text)[:top_k])


def _cut_page(page: str, result_length: int) -> str:
    match = _PAGE.fullmatch(page)
    return page if match is None else match[1] + match[2][:result_length]


def _passage_of(document: dict[str, Any]) -> Passage:
    if "contents" in document:  # Search-R1's wiki-18 documents: '"Title"\ntext'
        title, _, text = str(document["contents"]).partition("\n")
        return Passage(title.strip().strip('"'), text.strip())
    return Passage(str(document.get("title") or ""), str(document.get("text") or ""))


class HTTPRetriever:
    """Search-R1's retriever API; each request ends within ``timeout`` seconds (a deadline for the whole request)."""

    def __init__(self, url: str, timeout: float) -> None:
        from archer.http_deadline import DeadlineClient

        self.url = url
        self._client = DeadlineClient(timeout)

    def search(self, query: str, k: int) -> list[Passage]:
        response = self._client.post(self.url, json={"queries": [query], "topk": k, "return_scores": True})
        response.raise_for_status()
        try:
            hits = response.json()["result"][0]
            return [_passage_of(h.get("document", h)) for h in hits][:k]
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise ValueError(f"retriever {self.url} answered in an unknown shape ({e!r}); expected Search-R1's "
                             '{"result": [[{"document": {"contents": ...}}]]}') from None

    def close(self) -> None:
        self._client.close()


class SearchTool(Tool):
    def __init__(self, name: str = "search", *, trigger_tag: str = "search", backend: str = "cache",
                 cache_file: str | None = None, cache_writable: bool = False, index_dir: str | None = None,
                 url: str | None = None, request_timeout: float = 30.0, top_k: int = 5,
                 result_length: int = 1000, memory_cache_size: int = 10000) -> None:
        super().__init__(name, trigger_tag)
        if backend not in BACKENDS:
            raise ArcherError(f"tool {name!r}: unknown search backend {backend!r}",
                              f"set tool_instances.{name}.params.backend to one of {', '.join(BACKENDS)}")
        needed = {"cache": ("cache_file", cache_file), "bm25": ("index_dir", index_dir), "http": ("url", url)}
        key, value = needed[backend]
        if not value:
            raise ArcherError(f"tool {name!r}: backend {backend} needs {key}",
                              f"set tool_instances.{name}.params.{key}")
        self.top_k = top_k
        self.result_length = result_length
        self.memory = MemoryCache(memory_cache_size)
        self.cache = SearchCacheFile(cache_file, writable=cache_writable) if cache_file else None
        self.retriever = (BM25Index(index_dir) if backend == "bm25"
                          else HTTPRetriever(url, request_timeout) if backend == "http" else None)

    def execute(self, text: str) -> ToolResult:
        query = text.strip()
        if not query:
            return ToolResult("Error: the search query is empty.", ok=False)
        if len(query) > MAX_QUERY_CHARS:  # model text: neither the caches nor the retriever see it
            return ToolResult(f"Error: the search query is longer than {MAX_QUERY_CHARS} characters.", ok=False)
        hit = self.memory.get(query)
        if hit is None and self.cache is not None:
            hit = self.cache.get(query)
        if hit is None:
            if self.retriever is None:
                return ToolResult(f"Error: no cached result for this query (read-only cache {self.cache.path.name}).",
                                  ok=False)
            hit = format_pages(self.retriever.search(query, self.top_k), self.result_length)
            if self.cache is not None and self.cache.writable:
                self.cache.put(query, hit)
        self.memory.put(query, hit)
        return ToolResult(cut_pages(hit, self.top_k, self.result_length))

    def close(self) -> None:
        if isinstance(self.retriever, HTTPRetriever):
            self.retriever.close()
        if self.cache is not None:
            self.cache.compact()
