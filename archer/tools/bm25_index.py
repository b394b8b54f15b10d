"""A local BM25 index (bm25s) over a user's corpus: building it (``archer build-index``) and querying it.

The corpus is jsonl or parquet with a ``text`` column and optional ``id`` and ``title``. Title and text are
indexed together (lower-cased, English stop words removed, no stemming); the index folder holds bm25s's
arrays, the corpus as jsonl, and ``archer_index.json`` (which lists the files the index owns). It is loaded
memory-mapped, so a large index costs page cache, not process memory.

Building never deletes what is not its own: the output folder must be new, empty, or an archer index holding
only its own files, and an index is replaced only when the caller asks (``--overwrite``), in one atomic step.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from archer.atomic_files import make_staging_dir, replace_dir, write_json_atomically
from archer.errors import ArcherError

STOPWORDS = "en"
META_FILE = "archer_index.json"
# What bm25s 0.3 writes with the corpus: the files of an index whose archer_index.json lists none.
BM25S_FILES = ("params.index.json", "vocab.index.json", "data.csc.index.npy", "indices.csc.index.npy",
               "indptr.csc.index.npy", "corpus.jsonl", "corpus.mmindex.json")


@dataclass(frozen=True)
class Passage:
    title: str
    text: str


def _bm25s():
    """The bm25s module, its logger following the application's levels (bm25s sets DEBUG on import)."""
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.NOTSET)
    return bm25s


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


def check_output_folder(out: Path, *, overwrite: bool) -> None:
    """Refuse an ``out`` that building an index there would lose data in; return if it is safe to write.

    Safe: no such path, an empty folder, or (with ``overwrite``) an archer index holding only its own files.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise ArcherError(f"--out {out} is a file, not a folder", "pass a new folder for the index")
    entries = {e.name for e in out.iterdir()}
    if not entries:
        return
    if META_FILE not in entries:
        raise ArcherError(f"--out {out} is a folder that is not an archer index ({_listing(entries)}); "
                          "build-index leaves it untouched",
                          f"pass a new or empty folder, e.g. --out {out / 'bm25_index'}")
    foreign = entries - _index_files(out)
    if foreign:
        raise ArcherError(f"--out {out} is an archer index that also holds other files ({_listing(foreign)}); "
                          "build-index leaves it untouched",
                          "move those files out of the index folder, or pass a new folder")
    if not overwrite:
        raise ArcherError(f"--out {out} already holds an archer index",
                          "pass --overwrite to replace it, or a new folder")


def _index_files(folder: Path) -> set[str]:
    try:
        listed = json.loads((folder / META_FILE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    names = listed if isinstance(listed, list) and all(isinstance(n, str) for n in listed) else BM25S_FILES
    return {META_FILE, *names}


def _listing(names: Iterable[str], shown: int = 3) -> str:
    names = sorted(names)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return "holds " + ", ".join(names[:shown]) + more


def build_index(corpus: Path, out: Path, *, overwrite: bool = False, show_progress: bool = True) -> int:
    """Index ``corpus`` into the folder ``out``; returns the number of passages.

    ``out`` must pass ``check_output_folder`` (checked before any work and again before the index is put in
    place); an existing index there is replaced whole, atomically.
    """
    bm25s = _bm25s()
    out = out.resolve()  # a symlinked folder: the folder it names is the one replaced, not the link
    check_output_folder(out, overwrite=overwrite)
    records = read_corpus(corpus)
    tokens = bm25s.tokenize([_document(r) for r in records], stopwords=STOPWORDS, show_progress=show_progress)
    retriever = bm25s.BM25()
    retriever.index(tokens, show_progress=show_progress)
    staging = make_staging_dir(out)
    try:
        retriever.save(staging, corpus=records, show_progress=show_progress)
        files = sorted(e.name for e in staging.iterdir())
        write_json_atomically(staging / META_FILE, {"format": 1, "passages": len(records), "files": files,
                                                    "corpus": str(corpus.resolve()), "stopwords": STOPWORDS})
        check_output_folder(out, overwrite=overwrite)  # nothing may have appeared there while we indexed
        replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return len(records)


class BM25Index:
    def __init__(self, index_dir: str | Path) -> None:
        bm25s = _bm25s()
        self.index_dir = Path(index_dir)
        if not (self.index_dir / META_FILE).is_file():
            raise _not_an_index(self.index_dir)
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


def _not_an_index(folder: Path) -> ArcherError:
    """The error for an ``index_dir`` without an index; its advice never points build-index at a user's files."""
    build = "archer build-index --corpus CORPUS.jsonl --out"
    if not folder.exists():
        return ArcherError(f"BM25 index folder {folder} does not exist", f"build it with `{build} {folder}`")
    if folder.is_dir() and not any(folder.iterdir()):
        return ArcherError(f"BM25 index folder {folder} is empty", f"build the index into it with `{build} {folder}`")
    return ArcherError(f"BM25 index folder {folder} is not an archer index (it has no {META_FILE})",
                       f"set index_dir to a folder built by `{build} NEW_FOLDER` (a new folder: build-index "
                       "does not write into a folder of other files)")
