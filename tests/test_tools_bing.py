"""ARPO's BingSearchTool params on archer's search tool, against a local server that speaks Bright Data's request
API (the shape ARPO's search_tool.py sends and reads), and ARPO's conda_path/conda_env for the Python tool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from archer.errors import ArcherError
from archer.tools.bing import BingSearchTool
from archer.tools.executor import ToolCall
from archer.tools.python_tool import PythonTool
from archer.tools.registry import ToolRegistry, build_tool
from archer.tools.search_cache import SearchCacheFile

pytestmark = pytest.mark.serial  # asserts wall-clock bounds: `make test` runs it alone

KEY = "test-key"


class SERPServer(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), SERPHandler)
        self.requests: list[dict] = []
        self.status = 200
        self.delay_s = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/request"


class SERPHandler(BaseHTTPRequestHandler):
    server: SERPServer

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append({"auth": self.headers["Authorization"], **body})
        time.sleep(self.server.delay_s)
        bing = urlsplit(body["url"])
        query = parse_qs(bing.query)["q"][0]
        if self.server.status != 200 or bing.netloc != "www.bing.com" or self.headers["Authorization"] != f"Bearer {KEY}":
            self.send_response(self.server.status if self.server.status != 200 else 403)
            self.end_headers()
            self.wfile.write(b"denied")
            return
        organic = [{"title": "t1", "description": f"first about {query}"}, {"description": f"first about {query}"},
                   {"description": "  "}, {"description": "second"}, {"description": "third " + "x" * 50}]
        payload = json.dumps({"general": {"query": query}, "organic": organic}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (the timeout test)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def serp():
    server = SERPServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def cache_file(tmp_path: Path) -> Path:
    path = tmp_path / "search_cache.json"
    path.write_text(json.dumps({"cached query": "Page 1: from cache"}), encoding="utf-8")
    return path


def bing(serp: SERPServer | None, cache: Path, **params) -> BingSearchTool:
    url = serp.url if serp else "http://127.0.0.1:9/request"
    return build_tool("search", "verl.workers.rollout.tools.search_tool.BingSearchTool",
                      {"api_key": KEY, "zone": "my_zone", "location": "us", "max_results": 2, "result_length": 11,
                       "cache_file": str(cache), "endpoint": url, **params})


def test_a_miss_asks_the_api_as_arpo_and_is_written_through(serp, cache_file) -> None:
    tool = bing(serp, cache_file)
    result = tool.execute('"Who wrote" Hamlet')
    assert result.ok
    assert result.text == "Page 1: first about\nPage 2: second"  # de-duplicated, empty dropped, max_results, cut
    (request,) = serp.requests
    assert (request["auth"], request["zone"], request["format"]) == (f"Bearer {KEY}", "my_zone", "raw")
    bing_url = urlsplit(request["url"])
    assert (bing_url.scheme, bing_url.netloc, bing_url.path) == ("https", "www.bing.com", "/search")
    assert parse_qs(bing_url.query) == {"q": ["Who wrote Hamlet"], "mkt": ["en-US"], "setLang": ["en"],
                                        "brd_json": ["1"], "cc": ["us"]}
    written = SearchCacheFile(cache_file)  # what another process reads: the file and its log
    assert (len(written), written.get("Who wrote Hamlet")) == (2, "Page 1: first about\nPage 2: second")
    log = Path(f"{cache_file}.log").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["query"] for line in log] == ["Who wrote Hamlet"]  # ARPO's key: no double quotes
    tool.close()
    written = json.loads(cache_file.read_text(encoding="utf-8"))  # closing folds the log into ARPO's JSON file
    assert written == {"cached query": "Page 1: from cache", "Who wrote Hamlet": "Page 1: first about\nPage 2: second"}
    again = bing(serp, cache_file)
    assert again.execute("Who wrote Hamlet").text == "Page 1: first about\nPage 2: second"
    assert len(serp.requests) == 1  # the new tool read it from the file


def test_a_hit_needs_no_request_and_chinese_queries_ask_in_chinese(serp, cache_file) -> None:
    tool = bing(serp, cache_file)
    assert tool.execute("cached query").text == "Page 1: from cache"
    assert serp.requests == []
    tool.execute("甄嬛传导演")
    assert parse_qs(urlsplit(serp.requests[0]["url"]).query)["mkt"] == ["zh-CN"]


def test_without_a_key_hits_work_and_a_miss_is_a_counted_error(cache_file) -> None:
    registry = ToolRegistry.from_config({"tool_instances": {"search": {
        "class_path": "verl.workers.agent.tools.search_tool.BingSearchTool",
        "params": {"api_key": None, "cache_file": str(cache_file)}}}})
    hit, miss = registry.executor.run([ToolCall("search", "cached query"), ToolCall("search", "never seen")])
    assert (hit.text, hit.record.ok) == ("Page 1: from cache", True)
    assert miss.record.ok is False and "no cached result for this query" in miss.text
    registry.close()
    assert not Path(f"{cache_file}.log").exists()  # nothing written without a key


@pytest.mark.parametrize("status", [500, 403])
def test_an_api_error_is_a_counted_tool_error_after_retries(serp, cache_file, status) -> None:
    serp.status = status
    registry = ToolRegistry([bing(serp, cache_file)], retry_count=1)
    (miss,) = registry.executor.run([ToolCall("search", "unknown query")])
    assert miss.record.ok is False and miss.record.attempts == 2
    assert f"answered HTTP {status}" in miss.text
    assert SearchCacheFile(cache_file).get("unknown query") is None
    registry.close()


def test_no_network_and_a_slow_api_end_within_the_timeouts(serp, cache_file) -> None:
    unreachable = ToolRegistry([bing(None, cache_file, request_timeout=2.0)], retry_count=0)
    start = time.monotonic()
    (miss,) = unreachable.executor.run([ToolCall("search", "a miss")])
    assert miss.record.ok is False and time.monotonic() - start < 5
    serp.delay_s = 3.0
    slow = ToolRegistry([bing(serp, cache_file, request_timeout=0.5)], retry_count=0)
    start = time.monotonic()
    (miss,) = slow.executor.run([ToolCall("search", "a slow miss")])
    assert miss.record.ok is False and "timed out" in miss.text.lower() and time.monotonic() - start < 2.5
    unreachable.close()
    slow.close()


def test_an_unfilled_key_and_a_read_only_cache_folder_with_a_key_are_startup_errors(tmp_path, cache_file) -> None:
    with pytest.raises(ArcherError, match="params.api_key is the unfilled placeholder '<your_api_key>'"):
        bing(None, cache_file, api_key="<your_api_key>")
    cache_file.parent.chmod(0o555)
    try:
        if os.access(cache_file.parent, os.W_OK):
            pytest.skip("running as a user who can write read-only folders (root)")
        with pytest.raises(ArcherError, match="search_cache.json.log cannot be written"):
            bing(None, cache_file)
    finally:
        cache_file.parent.chmod(0o755)


def fake_conda(root: Path, env: str) -> Path:
    """A conda-like layout: ``root/envs/env`` is a virtual environment of this Python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--copies", str(root / "envs" / env)], check=True)
    return root / "envs" / env / "bin" / "python"


def test_conda_path_and_env_choose_the_sandbox_interpreter(tmp_path) -> None:
    python = fake_conda(tmp_path / "conda", "verl")
    tool = build_tool("python", "verl.workers.rollout.tools.python_tool.PythonTool",
                      {"conda_path": str(tmp_path / "conda"), "conda_env": "verl"})
    assert isinstance(tool, PythonTool)
    result = tool.execute("import sys; print(sys.executable)")
    assert result.ok and result.text.strip() == str(python)


def test_a_missing_conda_interpreter_is_a_clear_error(tmp_path) -> None:
    fake_conda(tmp_path / "conda", "verl")
    with pytest.raises(ArcherError, match=r"envs/other/bin/python \(conda_path=.*conda_env='other'\) does not exist"):
        build_tool("python", "verl.workers.rollout.tools.python_tool.PythonTool",
                   {"conda_path": str(tmp_path / "conda"), "conda_env": "other"})
    with pytest.raises(ArcherError, match="conda_path and .*conda_env go together"):
        build_tool("python", "python", {"conda_path": str(tmp_path / "conda")})
    with pytest.raises(ArcherError, match="both .*python and conda_path/conda_env"):
        build_tool("python", "python", {"python": sys.executable, "conda_path": "x", "conda_env": "y"})
