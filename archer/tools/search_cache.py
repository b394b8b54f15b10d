"""Search caches: ARPO's cache file (``{query: "Page 1: ...\\nPage 2: ..."}``) and an in-memory LRU.

The file is read once at start; a corrupt or (read-only) missing file is a startup error naming it. A
writable cache is write-through into an append-only log beside it (``<file>.log``, one JSON line
``{"query": ..., "text": ...}`` per new result, appended under the lock file ``<file>.lock`` so that several
trainers can share one cache): a new result costs one line, never a rewrite of the whole cache. Every cache
(read-only ones too) reads the log after the file, and reads the lines other processes appended when a query
misses. Queries are keyed as ARPO keys them: stripped, without double quotes; a query longer than
``MAX_QUERY_CHARS`` (model text: possibly huge) is neither looked up nor stored.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

from filelock import FileLock

from archer.errors import ArcherError

MAX_QUERY_CHARS = 2000


def cache_key(query: str) -> str:
    return query.replace('"', "").strip()


def _read_cache(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArcherError(f"search cache {path} cannot be read: {e}",
                          "fix or delete the file, or point cache_file at another one") from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ArcherError(f"search cache {path} is not a JSON object of query -> result text (ARPO's format)",
                          "fix or delete the file, or point cache_file at another one")
    return data


class SearchCacheFile:
    def __init__(self, path: str | Path, *, writable: bool = False) -> None:
        self.path = Path(path)
        self.log = Path(f"{self.path}.log")
        self.writable = writable
        self._lock = threading.Lock()
        self._log_read = 0  # bytes of the log already merged
        if self.path.is_file():
            self._entries = _read_cache(self.path)
        elif writable or self.log.is_file():
            self._entries = {}
        else:
            raise ArcherError(f"search cache {self.path} does not exist",
                              "point cache_file at an existing cache (ARPO's search_cache.json format), or set "
                              "cache_writable=true to start a new one")
        self._read_log()

    def __len__(self) -> int:
        return len(self._entries)

    def _read_log(self) -> None:
        """Merge the log lines appended since the last read (a torn last line waits for the next read)."""
        try:
            with self.log.open("rb") as f:
                f.seek(self._log_read)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
                self._entries[cache_key(row["query"])] = str(row["text"])
            except (ValueError, KeyError, TypeError):
                continue  # a line a crashed writer left half-written
        self._log_read += end

    def get(self, query: str) -> str | None:
        if len(query) > MAX_QUERY_CHARS:
            return None
        key = cache_key(query)
        with self._lock:
            if key not in self._entries:
                self._read_log()
            return self._entries.get(key)

    def put(self, query: str, text: str) -> None:
        """Add one result: one line appended to the log (only for a writable cache; an over-long query is not
        stored)."""
        if not self.writable:
            raise RuntimeError(f"search cache {self.path} is read-only")
        if len(query) > MAX_QUERY_CHARS:
            return
        line = json.dumps({"query": cache_key(query), "text": text}, ensure_ascii=False) + "\n"
        with self._lock, FileLock(f"{self.path}.lock"):
            self._read_log()
            with self.log.open("ab") as f:
                f.write(line.encode("utf-8"))
            self._log_read += len(line.encode("utf-8"))
            self._entries[cache_key(query)] = text


class MemoryCache:
    """A thread-safe least-recently-used map of query -> result text."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, query: str) -> str | None:
        key = cache_key(query)
        with self._lock:
            text = self._entries.get(key)
            if text is not None:
                self._entries.move_to_end(key)
            return text

    def put(self, query: str, text: str) -> None:
        if self.max_entries <= 0:
            return
        with self._lock:
            self._entries[cache_key(query)] = text
            self._entries.move_to_end(cache_key(query))
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
