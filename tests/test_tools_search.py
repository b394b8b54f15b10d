"""The search tool's back ends (ARPO's cache file, a bm25s index, a Search-R1 HTTP retriever) and caches."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from archer.cli import main
from archer.errors import ArcherError
from archer.tools import ToolCall, ToolExecutor
from archer.tools.bm25_index import BM25Index, Passage, build_index
from archer.tools.search import SearchTool, cut_pages, format_pages
from archer.tools.search_cache import MAX_QUERY_CHARS, SearchCacheFile

pytestmark = pytest.mark.serial  # asserts wall-clock bounds: `make test` runs it alone

ARPO_CACHE = Path(__file__).resolve().parents[2] / "shared" / "data" / "arpo" / "search_cache.json"
needs_arpo_cache = pytest.mark.skipif(not ARPO_CACHE.is_file(), reason="shared ARPO data not present")

CORPUS = [
    {"id": "p1", "title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris."},
    {"id": "p2", "title": "Louvre", "text": "The Louvre is the world's most visited museum, in Paris."},
    {"id": "p3", "title": "Mount Everest", "text": "Mount Everest is Earth's highest mountain above sea level."},
    {"id": "p4", "title": "Python", "text": "Python is a programming language created by Guido van Rossum."},
    {"id": "p5", "title": "Nile", "text": "The Nile is a major river in northeastern Africa."},
]


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus indexed by the CLI command users run."""
    root = tmp_path_factory.mktemp("bm25")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    assert main(["build-index", "--corpus", str(corpus), "--out", str(root / "index")]) == 0
    return root / "index"


# --- formatting ---

def test_format_pages_is_arpos_page_lines() -> None:
    passages = [Passage("Nile", "A river\nin Africa."), Passage("", "untitled text")]
    assert format_pages(passages, 1000) == "Page 1: Nile. A river in Africa.\nPage 2: untitled text"
    assert format_pages(passages, 8) == "Page 1: Nile. A \nPage 2: untitled"
    assert format_pages([], 1000) == "No search results found."
    assert cut_pages("Page 1: a\nPage 2: b\nPage 3: c", 2, 1000) == "Page 1: a\nPage 2: b"
    assert cut_pages("Page 1: a", 2, 1000) == "Page 1: a"
    assert cut_pages("Page 1: abcdef\nPage 2: xy\nPage 3: c", 2, 3) == "Page 1: abc\nPage 2: xy"
    assert cut_pages("No search results found.", 5, 3) == "No search results found."


# --- (a) ARPO's cache file ---

@needs_arpo_cache
def test_arpos_cache_answers_its_queries_read_only() -> None:
    tool = SearchTool(backend="cache", cache_file=str(ARPO_CACHE), top_k=3)
    expected = json.loads(ARPO_CACHE.read_text())["Amy Smart film debut Campfire Tales"]
    result = tool.execute("  Amy Smart film debut Campfire Tales\n")
    assert result.ok and result.text == expected[:expected.index("\nPage 4: ")]
    assert result.text.startswith("Page 1: The film is made up of three individual short segments")
    assert tool.execute('"Amy Smart" film debut "Campfire Tales"').text == result.text  # ARPO drops quotes
    missing = tool.execute("a query nobody asked")
    assert not missing.ok
    assert missing.text == "Error: no cached result for this query (read-only cache search_cache.json)."


def test_cache_hits_are_cut_to_top_k_pages_of_result_length_characters(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps({"nile":
                                 "Page 1: Nile. A major river\nPage 2: Africa. A continent\nPage 3: x"}))
    tool = SearchTool(backend="cache", cache_file=str(cache), top_k=2, result_length=8)
    assert tool.execute("nile").text == "Page 1: Nile. A \nPage 2: Africa. "  # each page's text cut to 8
    assert tool.execute("nile").text == "Page 1: Nile. A \nPage 2: Africa. "  # the in-memory cache alike


def test_a_corrupt_cache_file_is_a_startup_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "cache.json"
    bad.write_text('{"q": "Page 1: ...", ')
    with pytest.raises(ArcherError, match=f"search cache {bad} cannot be read"):
        SearchTool(backend="cache", cache_file=str(bad))
    bad.write_text('{"q": ["not", "text"]}')
    with pytest.raises(ArcherError, match=f"search cache {bad} is not a JSON object of query -> result text"):
        SearchTool(backend="cache", cache_file=str(bad))
    with pytest.raises(ArcherError, match=f"search cache {tmp_path / 'none.json'} does not exist"):
        SearchTool(backend="cache", cache_file=str(tmp_path / "none.json"))


def test_backend_settings_are_checked() -> None:
    with pytest.raises(ArcherError, match="unknown search backend 'google'"):
        SearchTool(backend="google")
    with pytest.raises(ArcherError, match="backend bm25 needs index_dir"):
        SearchTool(backend="bm25")


# --- (b) local BM25 index ---

def test_bm25_finds_the_passage_and_formats_it(index_dir: Path) -> None:
    tool = SearchTool(backend="bm25", index_dir=str(index_dir), top_k=2, result_length=40)
    result = tool.execute("highest mountain on Earth")
    assert result.ok
    assert result.text.split("\n")[0] == "Page 1: Mount Everest. Mount Everest is Earth's "  # 40 characters
    paris = tool.execute("museum in Paris").text.split("\n")
    assert paris[0].startswith("Page 1: Louvre.") and paris[1].startswith("Page 2: Eiffel Tower.")
    assert tool.execute("zebra quantum").text == "No search results found."
    assert tool.execute("the of and").text == "No search results found."  # only stop words


def test_a_missing_index_folder_is_a_startup_error(tmp_path: Path) -> None:
    with pytest.raises(ArcherError, match="BM25 index folder .* does not exist") as err:
        SearchTool(backend="bm25", index_dir=str(tmp_path / "nowhere"))
    assert f"archer build-index --corpus CORPUS.jsonl --out {tmp_path / 'nowhere'}`" in str(err.value)


def test_a_folder_of_other_files_as_index_dir_gets_advice_that_spares_it(tmp_path: Path) -> None:
    """The error's advice, followed as written, must not point build-index at the user's folder."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "val.parquet").write_bytes(b"PAR1 user data")
    with pytest.raises(ArcherError, match=f"BM25 index folder {data} is not an archer index") as err:
        SearchTool(backend="bm25", index_dir=str(data))
    assert f"--out {data}`" not in str(err.value) and "--out NEW_FOLDER" in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArcherError, match="is empty") as err:
        SearchTool(backend="bm25", index_dir=str(tmp_path / "empty"))
    assert f"--out {tmp_path / 'empty'}`" in str(err.value)  # an empty folder may be built into


def test_build_index_reads_parquet_and_replaces_an_old_index_only_when_asked(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = tmp_path / "corpus.parquet"
    pq.write_table(pa.Table.from_pylist(CORPUS[:2]), corpus)
    out = tmp_path / "index"
    assert build_index(corpus, out, show_progress=False) == 2
    meta = json.loads((out / "archer_index.json").read_text())
    assert meta["passages"] == 2 and sorted(meta["files"]) == sorted(p.name for p in out.iterdir()
                                                                      if p.name != "archer_index.json")
    pq.write_table(pa.Table.from_pylist(CORPUS[2:]), corpus)
    with pytest.raises(ArcherError, match=f"(?s)--out {out} already holds an archer index.*fix: pass --overwrite"):
        build_index(corpus, out, show_progress=False)
    assert BM25Index(out).size == 2  # refused: the old index is untouched
    assert build_index(corpus, out, overwrite=True, show_progress=False) == 3
    assert BM25Index(out).search("Nile river", 5) == [Passage("Nile", CORPUS[4]["text"])]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.parquet", "index"]  # no staging leftovers
    (tmp_path / "ordinary").mkdir()
    assert out.stat().st_mode == (tmp_path / "ordinary").stat().st_mode  # not mkdtemp's 0700


def test_an_open_index_keeps_answering_while_it_is_overwritten(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    out = tmp_path / "index"
    build_index(corpus, out, show_progress=False)
    before = BM25Index(out)
    corpus.write_text(json.dumps(CORPUS[0]) + "\n")
    build_index(corpus, out, overwrite=True, show_progress=False)
    assert before.search("Nile river", 5) == [Passage("Nile", CORPUS[4]["text"])]  # memory-mapped old files
    assert BM25Index(out).size == 1


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_build_index_never_deletes_a_folder_that_is_not_its_index(tmp_path: Path, capsys) -> None:
    """The issue's case: --out naming a folder of data (val.parquet) emptied it. Now: refused, untouched."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps(CORPUS[0]) + "\n")
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "val.parquet").write_bytes(b"PAR1 user data")
    (data / "sub" / "notes.txt").write_text("mine")
    before = snapshot(data)
    for flags in ([], ["--overwrite"]):
        assert main(["build-index", "--corpus", str(corpus), "--out", str(data), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"archer: error: --out {data} is a folder that is not an archer index "
                              "(holds sub, val.parquet); build-index leaves it untouched")
        assert f"--out {data / 'bm25_index'}" in err
        assert snapshot(data) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "data"]  # no staging leftovers

    index = tmp_path / "index"  # an index the user has put a file of their own into
    assert main(["build-index", "--corpus", str(corpus), "--out", str(index)]) == 0
    (index / "val.parquet").write_bytes(b"PAR1 user data")
    before = snapshot(index)
    assert main(["build-index", "--corpus", str(corpus), "--out", str(index), "--overwrite"]) == 2
    assert "is an archer index that also holds other files (holds val.parquet)" in capsys.readouterr().err
    assert snapshot(index) == before

    a_file = tmp_path / "corpus.jsonl"
    assert main(["build-index", "--corpus", str(corpus), "--out", str(a_file), "--overwrite"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert a_file.read_text() == json.dumps(CORPUS[0]) + "\n"
    (tmp_path / "empty").mkdir()
    assert main(["build-index", "--corpus", str(corpus), "--out", str(tmp_path / "empty")]) == 0
    assert BM25Index(tmp_path / "empty").size == 1


def test_an_index_through_a_symlink_is_replaced_behind_the_link(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps(CORPUS[0]) + "\n")
    build_index(corpus, tmp_path / "real", show_progress=False)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    assert build_index(corpus, tmp_path / "link", overwrite=True, show_progress=False) == 5
    assert (tmp_path / "link").is_symlink() and BM25Index(tmp_path / "real").size == 5


def test_build_index_cli_prints_the_result_and_rejects_a_corpus_without_text(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps(CORPUS[0]) + "\n")
    assert main(["build-index", "--corpus", str(corpus), "--out", str(tmp_path / "index")]) == 0
    assert capsys.readouterr().out == f"BM25 index of 1 passages: {tmp_path / 'index'}\n"
    corpus.write_text('{"id": 1, "title": "no text"}\n')
    assert main(["build-index", "--corpus", str(corpus), "--out", str(tmp_path / "other")]) == 2
    assert capsys.readouterr().err.startswith(f"archer: error: corpus {corpus} record 1 has no text field")
    assert not (tmp_path / "other").exists()


# --- write-through cache in front of a back end ---

def test_write_through_cache_file_receives_new_results(index_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    tool = SearchTool(backend="bm25", index_dir=str(index_dir), cache_file=str(cache), cache_writable=True)
    text = tool.execute('"Python" programming language').text
    log = Path(f"{cache}.log")
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"query": "Python programming language", "text": text}]
    other = SearchCacheFile(cache, writable=True)  # a second trainer sharing the file
    other.put("nile", "Page 1: Nile.")
    tool.execute("Eiffel Tower")
    on_disk = [json.loads(line)["query"] for line in log.read_text().splitlines()]
    assert on_disk == ["Python programming language", "nile", "Eiffel Tower"]
    assert tool.cache.get("nile") == "Page 1: Nile."  # the other trainer's line, read on the miss
    # a read-only cache in front of the index answers what it has (file and log) and asks the index for the rest
    reader = SearchTool(backend="bm25", index_dir=str(index_dir), cache_file=str(cache))
    assert reader.execute("nile").text == "Page 1: Nile."
    assert reader.execute("Louvre museum").text.startswith("Page 1: Louvre.")
    assert len(log.read_text().splitlines()) == 3
    reader.close()
    assert log.exists()  # a read-only cache leaves the log alone
    tool.close()  # the end of a run: the log is folded into ARPO's JSON file
    assert not log.exists() and set(json.loads(cache.read_text())) == set(on_disk)
    other.put("danube", "Page 1: Danube.")  # the other trainer goes on after the compaction
    assert tool.cache.get("danube") == "Page 1: Danube." and tool.cache.get("nile") == "Page 1: Nile."
    assert SearchCacheFile(cache).get("Eiffel Tower") == tool.memory.get("Eiffel Tower")


def test_a_new_result_appends_one_line_instead_of_rewriting_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps({f"query {i}": "Page 1: " + "x" * 1000 for i in range(5000)}))  # 5 MB
    before = cache.read_bytes()
    writer = SearchCacheFile(cache, writable=True)
    start = time.perf_counter()
    for i in range(200):
        writer.put(f"new {i}", "Page 1: y")
    assert time.perf_counter() - start < 1.0  # rewriting 5 MB per query took seconds for these 200
    assert cache.read_bytes() == before and len(Path(f"{cache}.log").read_text().splitlines()) == 200
    assert SearchCacheFile(cache).get("new 199") == "Page 1: y" and len(SearchCacheFile(cache)) == 5200
    with Path(f"{cache}.log").open("a") as f:
        f.write('{"query": "torn')  # a writer killed mid-line: the line is skipped, the next put starts anew
    assert len(SearchCacheFile(cache)) == 5200
    writer.put("after", "Page 1: after")
    assert SearchCacheFile(cache).get("after") == "Page 1: after" and len(SearchCacheFile(cache)) == 5201


def test_over_long_queries_are_neither_cached_nor_looked_up(tmp_path: Path) -> None:
    writer = SearchCacheFile(tmp_path / "cache.json", writable=True)
    huge = "q" * (MAX_QUERY_CHARS + 1)
    writer.put(huge, "Page 1: z")
    assert writer.get(huge) is None and not Path(f"{tmp_path / 'cache.json'}.log").exists()


# --- (c) HTTP retriever (Search-R1's /retrieve) ---

class Retriever(BaseHTTPRequestHandler):
    requests: list[dict] = []
    fail = False

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Retriever.requests.append(body)
        if Retriever.fail:
            self.send_response(500)
            self.end_headers()
            return
        docs = [{"document": {"id": str(i), "contents": f'"Doc {i}"\ntext {i} for {body["queries"][0]}'},
                 "score": 1.0 / (i + 1)} for i in range(body["topk"])]
        payload = json.dumps({"result": [docs]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def retriever_url() -> Iterator[str]:
    Retriever.requests, Retriever.fail = [], False
    server = ThreadingHTTPServer(("127.0.0.1", 0), Retriever)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    server.shutdown()
    server.server_close()


def test_http_retriever_search_r1_shape_and_memory_cache(retriever_url: str) -> None:
    tool = SearchTool(backend="http", url=retriever_url, top_k=2)
    expected = "Page 1: Doc 0. text 0 for who wrote Hamlet\nPage 2: Doc 1. text 1 for who wrote Hamlet"
    assert tool.execute("who wrote Hamlet").text == expected
    assert tool.execute(" who wrote Hamlet ").text == expected  # the in-memory cache answers
    assert Retriever.requests == [{"queries": ["who wrote Hamlet"], "topk": 2, "return_scores": True}]
    tool.close()


def test_concurrent_calls_share_the_cache_safely(retriever_url: str) -> None:
    tool = SearchTool(backend="http", url=retriever_url, top_k=1)
    executor = ToolExecutor({"search": tool}, max_workers=8)
    outcomes = executor.run([ToolCall("search", f"q{i % 4}") for i in range(32)])
    executor.close()
    tool.close()
    assert [o.text for o in outcomes] == [f"Page 1: Doc 0. text 0 for q{i % 4}" for i in range(32)]
    assert {r["queries"][0] for r in Retriever.requests} == {"q0", "q1", "q2", "q3"}


def test_a_failing_retriever_is_retried_then_an_error_result(retriever_url: str) -> None:
    Retriever.fail = True
    tool = SearchTool(backend="http", url=retriever_url)
    executor = ToolExecutor({"search": tool}, retry_count=2)
    [outcome] = executor.run([ToolCall("search", "anything")])
    executor.close()
    tool.close()
    assert not outcome.record.ok and outcome.record.attempts == 3 and len(Retriever.requests) == 3
    assert outcome.text.startswith("Error: Tool(search) execution failed with message: Server error '500")


def test_a_process_that_exits_without_closing_folds_its_log_into_the_file(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    cache.write_text('{"old": "Page 1: old"}')
    code = (f"from archer.tools.search_cache import SearchCacheFile\nc = SearchCacheFile({str(cache)!r}, "
            "writable=True)\nc.put('new', 'Page 1: new')\nassert c.log.exists()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert json.loads(cache.read_text()) == {"old": "Page 1: old", "new": "Page 1: new"}
    assert not Path(f"{cache}.log").exists()


def test_an_over_long_query_reaches_neither_cache_nor_retriever(retriever_url: str, tmp_path: Path) -> None:
    tool = SearchTool(backend="http", url=retriever_url, cache_file=str(tmp_path / "c.json"), cache_writable=True)
    huge = "q" * (MAX_QUERY_CHARS + 1)
    result = tool.execute(huge)
    assert not result.ok and result.text == f"Error: the search query is longer than {MAX_QUERY_CHARS} characters."
    assert Retriever.requests == [] and tool.memory.get(huge) is None and len(tool.memory._entries) == 0
    assert tool.execute("q" * MAX_QUERY_CHARS).ok and len(Retriever.requests) == 1  # the limit itself is asked
    tool.close()


def _trickle(server: socket.socket, stop: threading.Event) -> None:
    """Answers one request with a status line, then a header byte every 0.2 s (at most 40: 8 s), until the client
    hangs up or ``stop`` is set."""
    server.settimeout(5.0)
    try:
        conn, _ = server.accept()
    except OSError:
        return
    with conn:
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        for _ in range(40):
            if stop.wait(0.2):
                return
            try:
                conn.sendall(b"X")
            except OSError:
                return


def test_request_timeout_is_a_deadline_for_the_whole_request() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    thread = threading.Thread(target=_trickle, args=(server, stop), daemon=True)
    thread.start()
    tool = SearchTool(backend="http", url=f"http://127.0.0.1:{server.getsockname()[1]}/retrieve", request_timeout=1.0)
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="timed out: the request did not end within 1 s"):
            tool.execute("slow")
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        thread.join(5)
        server.close()
        tool.close()
    assert 1.0 <= elapsed < 1.5  # each read gets a byte within 0.2 s: per-read timeouts alone would take 8 s
