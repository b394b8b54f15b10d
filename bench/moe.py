"""MoE at a real layer shape on one device (issue 49, point 5): decode tokens/s of the fast engine against the hf
engine, and one update pass (forward + backward of the policy's log-probs) through archer's grouped expert kernel
against transformers' per-expert loop, on a randomly initialised Qwen3-MoE.

    python bench/moe.py --json /tmp/moe.json                     # the default shape: 16 experts, top-4, hidden 2048
    python bench/moe.py --layers 1 --hidden 64 --experts 4 --top-k 2 --expert-intermediate 32 --vocab 256 \\
        --prompts 2 --prompt-len 8 --new-tokens 4                # a tiny smoke run (the CPU)

Decode: ``--prompts`` random prompts of ``--prompt-len`` tokens, greedy, up to ``--new-tokens`` each; the
figure is new tokens / wall seconds of the second of two runs (the first warms up and, on a GPU, captures the
graphs). Update: ``--prompts`` rows of prompt + new tokens, the mean of ``--repeats`` timed passes after one warm-up.
The device is a GPU when there is one (bfloat16), else the CPU (float32). No figure here was measured on a GPU
unless a results file says so.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from archer.models.logprobs import response_logprobs
from archer.models.moe import use_grouped_experts
from archer.rollout.base import SamplingParams
from archer.rollout.fast import FastEngine
from archer.rollout.hf_engine import HFGenerateEngine


class _Tokenizer:
    """What the engines read of a tokenizer: ids of the pad and end tokens, and a length."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.pad_token_id, self.eos_token_id = vocab, 0, vocab - 1

    def __len__(self) -> int:
        return self.vocab

    def decode(self, ids, **_) -> str:
        return " ".join(map(str, ids))

    def convert_ids_to_tokens(self, ids):
        return [str(i) for i in ids]


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                            intermediate_size=args.expert_intermediate * args.top_k, num_experts=args.experts,
                            num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_intermediate,
                            norm_topk_prob=True, max_position_embeddings=args.prompt_len + args.new_tokens + 16)
    return Qwen3MoeForCausalLM(config).to(device=device, dtype=dtype).eval()


def _timed(run) -> float:
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def decode(model, args: argparse.Namespace) -> dict[str, float]:
    tokenizer = _Tokenizer(args.vocab)
    prompts = torch.randint(1, args.vocab - 1, (args.prompts, args.prompt_len), generator=torch.Generator()
                            .manual_seed(1)).tolist()
    params = SamplingParams(do_sample=False, max_new_tokens=args.new_tokens)
    out = {}
    for name, engine in (("fast", FastEngine(model, tokenizer, max_num_seqs=args.prompts)),
                         ("hf", HFGenerateEngine(model, tokenizer))):
        made: list[int] = []
        seconds = _timed(lambda e=engine, m=made: m.append(int(e.generate(prompts, params).response_mask.sum())))
        out[f"decode_tok_s/{name}"] = made[-1] / seconds
    return out


def update(model, args: argparse.Namespace) -> dict[str, float]:
    width = args.prompt_len + args.new_tokens
    ids = torch.randint(1, args.vocab, (args.prompts, width), generator=torch.Generator().manual_seed(2))
    ids = ids.to(model.device)
    mask = torch.ones_like(ids)
    positions = torch.arange(width, device=ids.device).expand_as(ids)
    out = {}
    grouped = copy.deepcopy(model)
    use_grouped_experts(grouped)
    for name, policy in (("grouped", grouped), ("transformers", model)):
        policy.train()

        def step(p=policy) -> None:
            for _ in range(args.repeats):
                logp, _ = response_logprobs(p, ids, mask, positions, args.new_tokens, compute_entropy=False)
                logp.sum().backward()

        out[f"update_s/{name}"] = _timed(step) / args.repeats
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("layers", 4), ("hidden", 2048), ("heads", 16), ("kv-heads", 4), ("head-dim", 128),
                          ("experts", 16), ("top-k", 4), ("expert-intermediate", 1408), ("vocab", 32768),
                          ("prompts", 32), ("prompt-len", 256), ("new-tokens", 256), ("repeats", 3)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if gpu else "cpu"), torch.bfloat16 if gpu else torch.float32
    model = build(args, device, dtype)
    record = {"device": torch.cuda.get_device_name() if gpu else "cpu", **decode(model, args),
              **update(model, args)}
    print(json.dumps(record, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
