"""A local BM25 index (bm25s) over a user's corpus: building it (``archer build-index``) and querying it.

The corpus is jsonl or parquet with a ``text`` column and optional ``id`` and ``title``. Title and text are
indexed together (lower-cased, English stop words removed, no stemming); the index folder holds bm25s's
arrays, the corpus as jsonl, and ``archer_index.json``. It is loaded memory-mapped, so a large index costs
page cache, not process memory.
"""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from archer.atomic_files import TMP_PREFIX, make_staging_dir, write_json_atomically
from archer.errors import ArcherError

STOPWORDS = "en"
META_FILE = "archer_index.json"


@dataclass(frozen=True)
class Passage:
    title: str
    text: str


def read_corpus(path: Path) -> list[dict[str, str]]:
    """Records ``{id, title, text}`` of a jsonl or parquet corpus (id defaults to the row number)."""
    if not path.is_file():
        raise ArcherError(f"corpus file {path} does not exist", "pass --corpus FILE.jsonl or FILE.parquet")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix == ".jsonl":
        rows = []
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ArcherError(f"corpus {path} line {n} is not JSON: {e}",
                                          "write one JSON object per line: {\"id\", \"title\", \"text\"}") from None
    else:
        raise ArcherError(f"corpus {path} is neither .jsonl nor .parquet", "convert it to jsonl or parquet")
    records = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ArcherError(f"corpus {path} record {i + 1} has no text field",
                              "give every record a string 'text' (and optionally 'id' and 'title')")
        records.append({"id": str(row.get("id", i)), "title": str(row.get("title") or ""), "text": row["text"]})
    if not records:
        raise ArcherError(f"corpus {path} has no records", "pass a corpus with at least one passage")
    return records


def _document(record: dict[str, str]) -> str:
    return f"{record['title']} {record['text']}".strip()


def build_index(corpus: Path, out: Path, *, show_progress: bool = True) -> int:
    """Index ``corpus`` into the folder ``out`` (replacing it whole); returns the number of passages."""
    import bm25s

    records = read_corpus(corpus)
    tokens = bm25s.tokenize([_document(r) for r in records], stopwords=STOPWORDS, show_progress=show_progress)
    retriever = bm25s.BM25()
    retriever.index(tokens, show_progress=show_progress)
    staging = make_staging_dir(out)
    try:
        retriever.save(staging, corpus=records, show_progress=show_progress)
        write_json_atomically(staging / META_FILE, {"format": 1, "passages": len(records),
                                                    "corpus": str(corpus.resolve()), "stopwords": STOPWORDS})
        if out.exists():
            old = out.with_name(f"{TMP_PREFIX}{out.name}-old")
            out.rename(old)
            staging.rename(out)
            shutil.rmtree(old)
        else:
            staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return len(records)


class BM25Index:
    def __init__(self, index_dir: str | Path) -> None:
        import bm25s

        self.index_dir = Path(index_dir)
        if not (self.index_dir / META_FILE).is_file():
            what = "does not exist" if not self.index_dir.exists() else f"has no {META_FILE}"
            raise ArcherError(f"BM25 index folder {self.index_dir} {what}",
                              f"build it with `archer build-index --corpus CORPUS.jsonl --out {self.index_dir}`")
        self._bm25s = bm25s
        self._retriever = bm25s.BM25.load(self.index_dir, load_corpus=True, mmap=True, show_progress=False)
        self.size = json.loads((self.index_dir / META_FILE).read_text())["passages"]
        self._lock = threading.Lock()

    def search(self, query: str, k: int) -> list[Passage]:
        """The best ``k`` passages that share a term with the query, best first."""
        tokens = self._bm25s.tokenize([query], stopwords=STOPWORDS, return_ids=False, show_progress=False)
        if not tokens[0]:
            return []
        with self._lock:
            docs, scores = self._retriever.retrieve(tokens, k=min(k, self.size), show_progress=False)
        return [Passage(d["title"], d["text"]) for d, s in zip(docs[0], scores[0]) if s > 0]
