"""An optional LLM judge for QA sets exact match cannot judge (GAIA, HLE, WebWalker, ...): any OpenAI-compatible
chat endpoint (``eval.judge.url`` + ``/chat/completions``, ``eval.judge.model``).

The benchmark's ``judge_prompt`` is filled with the question, the reference answer(s) and the sample's extracted
answer; the reply must start with "Correct" or "Incorrect" (case and punctuation aside). Each request has a
bounded timeout and ``max_retries`` further attempts (exponential backoff) after a network error, an HTTP error
or an unreadable reply; a request that still fails is an error naming the endpoint (nothing is lost: the samples
are on disk and verdicts already given are cached). Verdicts are cached in a JSON-lines file keyed by the judge
model and the filled prompt, so a resumed or repeated evaluation asks each question once. A sample without an
answer is wrong without asking.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from omegaconf import DictConfig

from archer.errors import ArcherError

MAX_REPLY_CHARS = 200  # of a judge reply kept in an error message
BACKOFF_S = 0.5


def parse_verdict(reply: str) -> bool | None:
    """True for a reply starting with "correct", False for "incorrect" (or "wrong"), None otherwise."""
    word = reply.strip().lstrip("*#`\"' ").lower()
    if word.startswith(("incorrect", "wrong")):
        return False
    if word.startswith("correct"):
        return True
    return None


class Judge:
    """Verdicts from the endpoint of ``cfg`` (eval.judge), cached in ``cache_path``."""

    def __init__(self, cfg: DictConfig, cache_path: Path) -> None:
        if not cfg.model:
            raise ArcherError("eval.judge.url is set but eval.judge.model is not", "set judge.model=NAME")
        self.url = str(cfg.url).rstrip("/") + "/chat/completions"
        self.model = str(cfg.model)
        self.timeout_s = float(cfg.timeout_s)
        self.max_retries = int(cfg.max_retries)
        self.max_workers = max(1, int(cfg.max_workers))
        self.headers = {}
        if cfg.api_key_env:
            key = os.environ.get(str(cfg.api_key_env))
            if not key:
                raise ArcherError(f"eval.judge.api_key_env={cfg.api_key_env} but that environment variable is empty",
                                  f"export {cfg.api_key_env}=<key>, or unset judge.api_key_env")
            self.headers["Authorization"] = f"Bearer {key}"
        self.cache_path = cache_path
        self.cache: dict[str, bool] = {}
        if cache_path.is_file():
            for line in cache_path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self.cache[entry["key"]] = bool(entry["verdict"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line cut by an interrupted write: that verdict is asked again
        self._lock = threading.Lock()

    def _key(self, prompt: str) -> str:
        return hashlib.sha256(f"{self.model}\n{prompt}".encode()).hexdigest()

    def _ask(self, client: httpx.Client, prompt: str) -> bool:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0.0,
                "max_tokens": 16}
        problem = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                response = client.post(self.url, json=body, headers=self.headers)
                response.raise_for_status()
                reply = str(response.json()["choices"][0]["message"]["content"])
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
                continue
            verdict = parse_verdict(reply)
            if verdict is not None:
                return verdict
            problem = f"unreadable reply {reply[:MAX_REPLY_CHARS]!r}"
        raise ArcherError(f"the judge at {self.url} failed after {self.max_retries + 1} attempt(s): {problem}",
                          "check judge.url / judge.model (an OpenAI-compatible chat endpoint) and rerun: the samples "
                          "and the verdicts given so far are kept")

    def verdict(self, client: httpx.Client, prompt: str) -> bool:
        key = self._key(prompt)
        with self._lock:
            if key in self.cache:
                return self.cache[key]
        verdict = self._ask(client, prompt)
        with self._lock:
            self.cache[key] = verdict
            with self.cache_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "verdict": verdict}) + "\n")
        return verdict

    def judge(self, prompts: Sequence[str | None]) -> list[bool]:
        """The verdict of each filled prompt (None: the sample gave no answer, so False)."""
        timeout = httpx.Timeout(self.timeout_s)
        with httpx.Client(timeout=timeout) as client, ThreadPoolExecutor(self.max_workers) as pool:
            return list(pool.map(lambda p: False if p is None else self.verdict(client, p), prompts))


def fill_prompt(template: str, question: str, reference: object, answer: str | None) -> str | None:
    """The judge prompt of one sample (None when it gave no answer)."""
    if answer is None:
        return None
    refs = " | ".join(reference) if isinstance(reference, list) else str(reference)
    return template.replace("{question}", question).replace("{reference}", refs).replace("{answer}", answer)
