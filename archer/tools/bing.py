"""ARPO's Bing search tool (``verl.workers.*.tools.search_tool.BingSearchTool``) on archer's search tool.

Its params are ARPO's: ``api_key`` and ``zone`` of Bright Data's SERP API, ``max_results`` pages of
``result_length`` characters, ``location`` (Bing's country code), ``cache_file`` (ARPO's JSON cache; default
``~/.verl_cache/bing_search_cache.json`` as ARPO's). A query the cache holds is answered from it; a query it lacks
goes to the API (``POST {endpoint}`` with ``{"zone", "url": "https://www.bing.com/search?q=...&brd_json=1&cc=...",
"format": "raw"}`` and a Bearer key; the answer's ``organic[].description`` snippets, de-duplicated, become ``Page
i: ...`` lines) and is written through to ``cache_file`` (appended to its log, search_cache.py). Without a key the cache is read-only and a miss is the
model's error text (counted in ``tools/<name>/failures``); an API that fails or does not answer within
``request_timeout`` seconds (a deadline for the whole request, archer/http_deadline.py) raises, which the executor retries and then reports the same way, so nothing hangs.
``async_cache_write`` and ``cache_refresh_interval`` are accepted: archer writes each result through at once, under
the cache's lock. Language: a query with CJK ideographs asks Bing in Chinese (``zh-CN``), any other in English
(ARPO classifies with langid).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlencode

from archer.errors import ArcherError
from archer.tools.bm25_index import Passage
from archer.tools.search import SearchTool
from archer.tools.search_cache import SearchCacheFile, cache_key

BRIGHTDATA_URL = "https://api.brightdata.com/request"
ARPO_CACHE_FILE = "~/.verl_cache/bing_search_cache.json"
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


class BrightDataSERP:
    """Bing results through Bright Data's request API, as ARPO asks for them."""

    def __init__(self, api_key: str, zone: str, location: str, endpoint: str, timeout: float) -> None:
        from archer.http_deadline import DeadlineClient

        self.zone, self.location, self.endpoint = zone, location, endpoint
        self._headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self._client = DeadlineClient(timeout)

    def bing_url(self, query: str) -> str:
        market, language = ("zh-CN", "zh") if _CJK.search(query) else ("en-US", "en")
        return (f"https://www.bing.com/search?{urlencode({'q': query, 'mkt': market, 'setLang': language})}"
                f"&brd_json=1&cc={self.location}")

    def search(self, query: str, k: int) -> list[Passage]:
        payload = {"zone": self.zone, "url": self.bing_url(cache_key(query)), "format": "raw"}  # ARPO drops '"'
        response = self._client.post(self.endpoint, headers=self._headers, json=payload)
        if response.status_code != 200:
            raise RuntimeError(f"Bing search via {self.endpoint} answered HTTP {response.status_code}: "
                               f"{response.text[:200]}")
        try:
            organic = response.json().get("organic") or []
            snippets = [str(hit.get("description") or "").strip() for hit in organic]
        except (ValueError, AttributeError, TypeError) as e:
            raise RuntimeError(f"Bing search via {self.endpoint} answered in an unknown shape ({e!r}); expected "
                               '{"organic": [{"description": ...}, ...]}') from None
        unique = list(dict.fromkeys(s for s in snippets if s))
        return [Passage("", s) for s in unique[:k]]

    def close(self) -> None:
        self._client.close()


def _api_key(name: str, api_key: str | None) -> str | None:
    if api_key is not None and re.fullmatch(r"<[^<>]*>", api_key.strip()):
        raise ArcherError(f"tool {name!r}: params.api_key is the unfilled placeholder {api_key!r}",
                          f"set tool_instances.{name}.params.api_key to your Bright Data key, or to null to answer "
                          "only from cache_file")
    return api_key or None


def _check_writable(name: str, cache: SearchCacheFile) -> None:
    """New results are appended to the cache's log beside the file (under a lock file there)."""
    targets = [cache.log.parent, *([cache.log] if cache.log.exists() else [])]
    if not all(os.access(t, os.W_OK) for t in targets):
        raise ArcherError(f"tool {name!r}: {cache.log} cannot be written, and with an api_key each new result is "
                          f"written through to it", f"point tool_instances.{name}.params.cache_file at a cache in a "
                          "writable folder (a copy), or set api_key=null (cache only)")


class BingSearchTool(SearchTool):
    def __init__(self, name: str = "search", *, api_key: str | None = None, zone: str = "serp_api1",
                 max_results: int = 10, result_length: int = 1000, location: str = "cn",
                 cache_file: str | None = None, async_cache_write: bool = True, cache_refresh_interval: float = 15.0,
                 endpoint: str = BRIGHTDATA_URL, request_timeout: float = 30.0, trigger_tag: str = "search",
                 memory_cache_size: int = 10000) -> None:
        key = _api_key(name, api_key)
        path = Path(cache_file or ARPO_CACHE_FILE).expanduser()
        if key:
            path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(name, trigger_tag=trigger_tag, backend="cache", cache_file=str(path),
                         cache_writable=bool(key), top_k=max_results, result_length=result_length,
                         memory_cache_size=memory_cache_size)
        if key:
            _check_writable(name, self.cache)
        self.retriever = BrightDataSERP(key, zone, location, endpoint, request_timeout) if key else None

    def close(self) -> None:
        if isinstance(self.retriever, BrightDataSERP):
            self.retriever.close()
        super().close()  # folds the cache's log into the file
