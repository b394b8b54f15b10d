"""Search caches: ARPO's cache file (``{query: "Page 1: ...\\nPage 2: ..."}``) and an in-memory LRU.

The file is read once at start; a corrupt or (read-only) missing file is a startup error naming it. A
writable cache is write-through: each new result is merged into the file under a lock file
(``<file>.lock``, so several trainers can share one cache), re-reading it first when another process has
changed it, and replaced atomically. Queries are keyed as ARPO keys them: stripped, without double quotes.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

from filelock import FileLock

from archer.atomic_files import write_json_atomically
from archer.errors import ArcherError


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
        self.writable = writable
        self._lock = threading.Lock()
        if self.path.is_file():
            self._entries = _read_cache(self.path)
            self._mtime = self.path.stat().st_mtime_ns
        elif writable:
            self._entries, self._mtime = {}, None
        else:
            raise ArcherError(f"search cache {self.path} does not exist",
                              "point cache_file at an existing cache (ARPO's search_cache.json format), or set "
                              "cache_writable=true to start a new one")

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, query: str) -> str | None:
        return self._entries.get(cache_key(query))

    def put(self, query: str, text: str) -> None:
        """Add one result and write the file through (only for a writable cache)."""
        if not self.writable:
            raise RuntimeError(f"search cache {self.path} is read-only")
        with self._lock, FileLock(f"{self.path}.lock"):
            if self.path.is_file() and self.path.stat().st_mtime_ns != self._mtime:
                self._entries = {**_read_cache(self.path), **self._entries}
            self._entries[cache_key(query)] = text
            write_json_atomically(self.path, self._entries, fsync=False)
            self._mtime = self.path.stat().st_mtime_ns


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
