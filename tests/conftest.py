"""Shared fixtures: a micro corpus and a micro Qwen2 model folder built once per test session (``parts``: that
model and its tokenizer loaded once per test module), and the small arithmetic task with a micro model trained
on its texts (for tests that train a few RL steps)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
import torch
from train_support import task_model

from archer.data.tasks import write_task_files
from archer.models.loading import load_causal_lm, load_tokenizer
from archer.models.tiny import build_tiny_model

# Test models are tiny: one thread is fastest, and on shared cores OpenMP barriers cost milliseconds per op.
torch.set_num_threads(1)

# One Ray token for every Ray a test process starts, set before any starts: Ray keeps the token its first
# instance used for the rest of the process, so a later fixture's own token (or the one it wrote under ~/.ray)
# failed that fixture's cluster ("InvalidAuthToken") when the worker had run another Ray test first.
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

# The two quickstarts: the longest tests (their gains need their steps), each using more than one core. ``make
# test``'s two pytest-xdist workers (worksteal) each take one contiguous half of the collection and run it in
# order, so these go first, one after the other on the first worker: not last and alone while the other worker
# idles (as the tool quickstart did at the end of a 31-minute run), and never side by side (started one a worker,
# both ran past their 900 s limit).
QUICKSTARTS = ("tests/test_quickstart.py::test_quickstart_learns",
               "tests/test_quickstart.py::test_tool_quickstart_learns_to_call_the_tool")


@pytest.hookimpl(trylast=True)  # after -m's deselection
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The QUICKSTARTS first, in order (see above)."""
    first = [item for name in QUICKSTARTS for item in items if item.nodeid.endswith(name)]
    items[:] = first + [item for item in items if item not in first]

MICRO_MODEL_SIZES = {
    "vocab_size": 320,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 256,
}


def _micro_corpus() -> list[str]:
    sums = [
        f"Question: what is {a} + {b}? Answer: {a + b}." for a in range(3, 40, 7) for b in range(5, 60, 11)
    ]
    chat = [
        "<|im_start|>user\nSolve the problem step by step.<|im_end|>\n<|im_start|>assistant\nLet me think.",
        "The quick brown fox jumps over the lazy dog.",
        "Reinforcement learning trains a policy with rewards; the critic estimates values.",
        "<think>First add the tens, then the ones.</think> <answer>42</answer>",
        "Use the python tool: <python>print(2 ** 10)</python> and read the result 1024.",
    ]
    return sums + chat * 4


@pytest.fixture(scope="session")
def micro_corpus() -> list[str]:
    """About fifty short lines: arithmetic questions, chat markup, tags and plain sentences."""
    return _micro_corpus()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, micro_corpus: list[str]) -> Path:
    """A Hugging Face folder with a 2-layer, 32-wide Qwen2 model and its 320-token BPE tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), micro_corpus, seed=0, **MICRO_MODEL_SIZES)


@pytest.fixture(scope="module")
def parts(tiny_model_dir: Path):
    """The micro model (CPU, float32) and its tokenizer, loaded once per test module."""
    return load_causal_lm(tiny_model_dir, device="cpu"), load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def task_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The arithmetic task: 32 train, 4 validation and 32 warm-start rows."""
    return write_task_files("arithmetic", tmp_path_factory.mktemp("arithmetic"), n_train=32, n_val=4, n_sft=32,
                            seed=0, max_operand=9)


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory: pytest.TempPathFactory, task_files: dict[str, Path]) -> Path:
    return task_model(tmp_path_factory.mktemp("micro_model"), task_files["sft"], max_positions=128)


@pytest.fixture(scope="session")
def arpo_tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tool_model_support's tool-calling micro model with 4096 positions (ARPO's prompts, whole, plus a response)."""
    from tool_model_support import tool_model

    return tool_model(tmp_path_factory.mktemp("arpo_tool_model"), max_positions=4096)
