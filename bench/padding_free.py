"""Padded against packed micro-batches for the actor's log-prob forward + backward (packed: the sequences of a
micro-batch in one row, archer's varlen attention, models/packed_attention.py), and packing through transformers'
own block-diagonal SDPA mask, on a random Qwen2 model and a batch of left-padded prompts and long-tailed responses.

    python bench/padding_free.py --threads 1                       # CPU: 4 layers, hidden 256
    python bench/padding_free.py --device cuda --shape qwen2.5-0.5b --rows 64 --max-response 1024 --budget 16384

For each layout: forward + backward time (median), peak extra memory, the tokens the forward computes
(rows x width summed over micro-batches) and the largest difference of the log-probs and of the gradient
from the padded batch in one micro-batch. (The padding-free layout this bench first measured, rows cut to
their longest sequence, gave way to packing.)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from logprob_memory import cpu_peak_bytes
from transformers import Qwen2Config, Qwen2ForCausalLM

from archer.batch import Batch
from archer.models.loading import autocast_for
from archer.models.logprobs import backbone_of, layout_logprobs, logprobs_from_hidden
from archer.models.micro_batches import MicroBatching
from archer.models.packed_attention import use_packed_attention

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocabulary
    "cpu-small": (256, 4, 4, 2, 512, 4096),
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936),
}


def random_model(shape: str, device: torch.device) -> Qwen2ForCausalLM:
    hidden, layers, heads, kv_heads, intermediate, vocab = SHAPES[shape]
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device)
    use_packed_attention(model)  # as archer loads its models: SDPA, plus packed rows
    return model


def rl_batch(rows: int, max_prompt: int, max_response: int, vocab: int) -> Batch:
    """Prompts of 20%..100% of max_prompt tokens, responses with an exponential length (mean max/5)."""
    gen = torch.Generator().manual_seed(1)
    prompt_len = torch.randint(max(1, max_prompt // 5), max_prompt + 1, (rows,), generator=gen)
    response_len = (torch.empty(rows).exponential_(5 / max_response, generator=gen).long() + 1).clamp(max=max_response)
    columns = torch.arange(max_prompt + max_response)
    attention = ((columns >= max_prompt - prompt_len[:, None]) & (columns < max_prompt + response_len[:, None])).long()
    input_ids = torch.randint(1, vocab, attention.shape, generator=gen) * attention
    return Batch({"input_ids": input_ids, "attention_mask": attention,
                  "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "responses": input_ids[:, max_prompt:]})


def micro_batched(micro: MicroBatching) -> Callable[[torch.nn.Module, Batch, torch.device], tuple[torch.Tensor, int]]:
    """The actor's way: log-probs [B, R] of each micro-batch (backward included), and the tokens computed."""
    def run(model: torch.nn.Module, batch: Batch, device: torch.device) -> tuple[torch.Tensor, int]:
        logp = torch.zeros(batch["responses"].shape)
        tokens = 0
        for rows in micro.split(batch["attention_mask"]):
            layout = micro.layout(batch.index(rows).to(device))
            with autocast_for(device):
                mb_logp, _ = layout_logprobs(model, layout)
            mb_logp.sum().backward()
            logp[rows] = mb_logp.detach().float().cpu()
            tokens += layout.input_ids.numel()
        return logp, tokens
    return run


def block_diagonal_one_row(model: torch.nn.Module, batch: Batch, device: torch.device) -> tuple[torch.Tensor, int]:
    """Every sequence in one row with its own positions and no mask: transformers builds a block-diagonal one."""
    present = batch["attention_mask"].bool()
    ids, positions = batch["input_ids"][present][None].to(device), batch["position_ids"][present][None].to(device)
    response_length = batch["responses"].shape[1]
    index = present.long().cumsum(1) - 1 + (present.sum(1).cumsum(0) - present.sum(1))[:, None]  # flat column
    response = present[:, -response_length:]
    columns = index[:, -response_length:][response].to(device)
    with autocast_for(device):
        hidden = backbone_of(model)(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state[0]
        logp, _ = logprobs_from_hidden(hidden[columns - 1], model.get_output_embeddings(), ids[0, columns],
                                       compute_entropy=False)
    logp.sum().backward()
    out = torch.zeros(response.shape)
    out[response] = logp.detach().float().cpu()
    return out, ids.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="cpu-small", choices=list(SHAPES))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=100)
    parser.add_argument("--max-response", type=int, default=400)
    parser.add_argument("--budget", type=int, default=4096, help="ppo_max_token_len_per_gpu of the dynamic layouts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="CPU threads (1 gives steadier times on a shared machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = random_model(args.shape, device)
    batch = rl_batch(args.rows, args.max_prompt, args.max_response, model.config.vocab_size)
    layouts = {
        "padded, one micro-batch": micro_batched(MicroBatching(None, None, packed=False)),
        f"padded, budget {args.budget}": micro_batched(MicroBatching(None, args.budget, packed=False)),
        "packed, one micro-batch": micro_batched(MicroBatching(None, None, packed=True)),
        f"packed, budget {args.budget}": micro_batched(MicroBatching(None, args.budget, packed=True)),
        "one row, transformers' block-diagonal SDPA mask": block_diagonal_one_row,
    }
    real = int(batch["attention_mask"].sum())
    print(f"{args.rows} rows, {real} real tokens of {batch['input_ids'].numel()} padded; "
          f"shape {args.shape} on {device}")
    print("| layout | tokens computed | fwd+bwd s | peak extra MiB | max diff log-prob | max diff gradient |")
    print("|---|---|---|---|---|---|")
    reference = None
    for name, run in layouts.items():
        model.zero_grad(set_to_none=True)
        logp, tokens = run(model, batch, device)
        grad = torch.cat([p.grad.flatten().float().cpu() for p in model.parameters()])
        reference = reference or (logp, grad)
        times = []
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            run(model, batch, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            run(model, batch, device)
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = cpu_peak_bytes(lambda run=run: run(model, batch, device))
        print(f"| {name} | {tokens} | {statistics.median(times):.3f} | {peak / 2**20:.0f} | "
              f"{float((logp - reference[0]).abs().max()):.1e} | {float((grad - reference[1]).abs().max()):.1e} |")
    print(f"(largest gradient entry {float(reference[1].abs().max()):.2e})")


if __name__ == "__main__":
    main()
