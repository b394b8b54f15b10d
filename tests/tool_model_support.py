"""A micro model that calls tools: the tiny Qwen2 of archer.models.tiny, trained for a few seconds to answer
every ARPO prompt with one fixed tool-using response (a search the cache file answers, a Python call, a boxed
answer), so that the real HF engine, the real tools and the real ARPO data run the agentic loop end to end."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import torch
from shared_data import SHARED_DATA

from archer.models.loading import load_causal_lm, load_tokenizer, save_hf
from archer.models.tiny import build_tiny_model

ARPO = SHARED_DATA / "arpo"
TRAIN_FILE = ARPO / "train_10k.parquet"
SEARCH_CACHE = ARPO / "search_cache.json"
QUERY = "Stedelijk Museum Amsterdam type"  # a key of the cache file, with a short answer
SEARCH_ANSWER = "Page 1: Post/No/Bills #5EssentialsHistory"
CODE = "print(6 * 7)"
PYTHON_ANSWER = "42\n"  # what the python tool answers: the snippet's output
SEARCH_CALL = f"<think>look it up</think> <search>{QUERY}</search>"
PYTHON_CALL = f" <python>{CODE}</python>"
ANSWER = " <answer>\\boxed{42}</answer>"
RESPONSE = (SEARCH_CALL + f" <result>\n{SEARCH_ANSWER}\n</result>" + PYTHON_CALL + f" <result>\n{PYTHON_ANSWER}\n</result>"
            + ANSWER)
ROWS = 8  # ARPO rows whose prompts the model learns to answer


def arpo_rows(count: int = ROWS) -> list[dict]:
    return pq.read_table(TRAIN_FILE).slice(0, count).to_pylist()


def tool_model(out: Path, steps: int = 120, max_positions: int = 1024) -> Path:
    """The model folder; its tokenizer is trained on ARPO prompts and the response, its weights on the response."""
    rows = arpo_rows()
    corpus = [m["content"] for r in rows for m in r["prompt"]] + [RESPONSE] * 4
    folder = build_tiny_model(out, corpus, vocab_size=1200, hidden_size=64, num_layers=2, intermediate_size=128,
                              max_position_embeddings=max_positions, seed=0)
    tokenizer = load_tokenizer(folder)
    model = load_causal_lm(folder, device="cpu", dtype=torch.float32)
    prompts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    prompt_lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    ids = [tokenizer(p + RESPONSE + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for p in prompts]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        i = int(torch.randint(len(ids), (1,), generator=generator))
        x = torch.tensor([ids[i]])
        labels = x.clone()
        labels[0, :prompt_lengths[i]] = -100  # learn the response only
        loss = model(input_ids=x, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return save_hf(model, tokenizer, folder)
