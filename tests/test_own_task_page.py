"""docs/own_task.md run as written: its files (the python blocks, each named on its first line) saved, and every
command of its bash blocks run in one folder with the tiny test model as MODEL_DIR: the data, two GRPO steps with
the page's reward function and both traces, the health report, and the explorer answering at the address it
prints."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
from readme_support import DOCS, REPO

from archer import cli

PAGE = DOCS / "own_task.md"


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def commands(text: str) -> list[list[str]]:
    """The words of every command of the page's bash blocks (continuation lines joined)."""
    joined = "\n".join(blocks(text, "bash")).replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line from {proc.args} within {timeout} s"
    return proc.stdout.readline()


def test_the_pages_reward_function_scores_as_it_says(tmp_path: Path) -> None:
    (source,) = [b for b in blocks(PAGE.read_text(encoding="utf-8"), "python") if b.startswith("# reverse_reward.py")]
    (tmp_path / "reverse_reward.py").write_text(source)
    spec = importlib.util.spec_from_file_location("reverse_reward", tmp_path / "reverse_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.compute_score("reverse", "It is tenalp", "tenalp") == {"score": 1.0, "acc": 1.0, "answer_length": 6}
    # one letter of six wrong: 5 matching letters of 6 + 6, 2 * 5 / 12
    assert module.compute_score("reverse", "tenxlp", "tenalp") == {"score": 10 / 12, "acc": 0.0, "answer_length": 6}
    assert module.compute_score("reverse", "", "tenalp") == {"score": 0.0, "acc": 0.0, "answer_length": 0}


@pytest.mark.slow
def test_every_command_of_the_page_runs_as_written(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    text = PAGE.read_text(encoding="utf-8")
    for block in blocks(text, "python"):
        (tmp_path / re.match(r"# (\w+\.py): ", block)[1]).write_text(block)
    make_data, train, health, viz = commands(text)  # the page's four commands, in its order
    assert (make_data, train[:2], health[:2], viz[:2]) == (["python", "make_data.py"], ["archer", "train"],
                                                          ["archer", "health"], ["archer", "viz"])
    monkeypatch.chdir(tmp_path)

    made = subprocess.run([sys.executable, *make_data[1:]], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert made.stdout == "wrote data/reverse/train.parquet (256 rows) and data/reverse/val.parquet (32 rows)\n"
    row = pq.read_table("data/reverse/train.parquet").to_pylist()[0]
    word = row["prompt"][0]["content"].removeprefix("Reverse the letters of: ")
    assert row["data_source"] == "reverse" and row["reward_model"]["ground_truth"] == word[::-1]

    assert cli.main([a.replace("MODEL_DIR", str(tiny_model_dir)) for a in train[1:]]) == 0
    lines = [json.loads(x) for x in Path("runs/reverse/metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]  # validation before training, two steps
    for line in lines[1:]:  # the page's metric names
        assert 0 <= line["critic/score/mean"] <= 1 and 0 <= line["critic/acc/mean"] <= 1
        assert line["reward/answer_length/mean"] >= 0
    assert {"val-core/reverse/acc/mean@1", "val-aux/reverse/answer_length/mean@1"} <= set(lines[-1])
    assert Path("runs/reverse/entropy_trace").is_dir() and Path("runs/reverse/influence_trace").is_dir()

    capsys.readouterr()
    assert cli.main(health[1:]) == 0
    assert capsys.readouterr().out.startswith("archer health: runs/reverse (2 training steps")

    port = free_port()  # the page's command on a port of its own (tests run side by side)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "archer.cli", *viz[1:], "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = first_line(proc, timeout=120)
        url = f"http://127.0.0.1:{port}/"
        assert line.startswith(f"archer viz: exploring runs/reverse/influence_trace at {url}"), line
        page = httpx.get(url, timeout=30)
        assert page.status_code == 200 and "archer trace explorer" in page.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
