"""A micro model for tests that train a few RL steps on a built-in task."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from archer.models.tiny import build_tiny_model


def task_model(out: Path, sft_file: Path, max_positions: int) -> Path:
    """A micro Qwen2 model (2 layers, 64 wide) whose BPE tokenizer is trained on a task's questions and solutions."""
    corpus = []
    for row in pq.read_table(sft_file).to_pylist():
        corpus.extend(m["content"] for m in row["prompt"])
        corpus.append(row["response"])
    return build_tiny_model(out, corpus, hidden_size=64, num_layers=2, intermediate_size=128,
                            max_position_embeddings=max_positions, seed=0)
