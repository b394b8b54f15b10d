"""The workload the FSDP2 tests run both in one process (the reference) and as 2 gloo ranks (``python
fsdp_support.py WORKDIR`` with RANK / WORLD_SIZE / MASTER_* set): a few AdamW steps of a next-token loss
normalised by the GLOBAL token count, each rank taking its ``shard_bounds`` rows; plus the rank program,
which writes what rank 0 saw into WORKDIR/rank0.pt (and its losses into rank1.pt on rank 1)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from archer.distributed.context import DistContext, shard_bounds
from archer.distributed.fsdp import clip_grad_norm, shard_model
from archer.distributed.shard_buckets import ShardGather, gatherable
from archer.distributed.sharded_checkpoint import load_sharded, save_sharded
from archer.distributed.weight_sync import WeightManifest, packed_buckets
from archer.models.loading import load_causal_lm, load_tokenizer
from archer.models.lora import (
    LoraSettings,
    add_lora,
    plain_policy_parameters,
    policy_weight_shapes,
    policy_weights,
    save_merged,
    trainable_parameters,
)

ROWS = 5  # odd: rank 0 takes 3 rows, rank 1 takes 2
LENGTHS = (12, 9, 12, 5, 10)  # right-padded to 12: the token count differs per row and per rank
MAX_NORM = 0.5  # below the tiny model's gradient norms: clipping acts
LR = 1e-2
LORA = LoraSettings(4, 8.0, "all-linear")
SYNC_BUCKET_BYTES = 4096  # the weight sync's buckets in the record: several, and the embedding alone in one


def batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch of ``step``: input ids and the attention mask (right padding)."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (ROWS, max(LENGTHS)), generator=gen)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    return ids * mask, mask


def load_model(model_dir: Path, *, lora: bool = False, checkpointing: bool = False,
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """The tiny model in training mode, in ``dtype``; with LoRA (adapters in float32 whatever the base's), adapters drawn from a fixed generator (B not
    the zero start, so that the merge matters), the same in every process."""
    model = load_causal_lm(model_dir, device="cpu", dtype=dtype, gradient_checkpointing=checkpointing)
    model.train()
    if not lora:
        return model
    peft_model = add_lora(model, LORA)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return peft_model


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.AdamW:
    """AdamW with eps 1e-6: the tiny model's k_proj biases get gradients near 1e-9 (RoPE makes them small
    but not zero), and with the default eps 1e-8 Adam's normalisation blows their float reduction-order
    noise up to 1e-6 per step; eps 1e-6 keeps 1 and 2 ranks within rtol 1e-5 / atol 1e-6."""
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext, step: int) -> tuple[float, float]:
    """One AdamW step on this rank's rows of ``batch(step)``; returns (global loss, global grad norm)."""
    ids, mask = batch(step, model.config.vocab_size)
    total_tokens = mask[:, 1:].sum()  # the whole batch's normaliser, known to every rank
    start, stop = shard_bounds(ROWS, ctx.rank, ctx.world_size)
    ids, mask = ids[start:stop], mask[start:stop]
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(logprobs * mask[:, 1:]).sum() / total_tokens
    loss.backward()
    norm = clip_grad_norm(model, MAX_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    global_loss = ctx.all_reduce_sum(loss.detach().clone())
    return float(global_loss), norm


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full-weight stream copied (every rank must call this)."""
    return {name: tensor.clone() for name, tensor in policy_weights(model)}


def optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state by parameter name, whole tensors (every rank calls; rank 0's is complete)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_state_dict(model, optimizer, options=options)[1].get("state", {})  # empty off rank 0
    return copy.deepcopy(state)  # at world 1 the tensors are the optimizer's own


def rank_main(work: Path) -> None:
    torch.set_num_threads(1)
    ctx = DistContext.init_from_env("cpu", timeout_s=60)
    out = record(ctx, work)  # the models are gone once it returns, before the group is destroyed
    if ctx.is_main:
        torch.save(out, work / "rank0.pt")
    else:
        torch.save({"steps": out["steps"], "step3": out["step3"]}, work / f"rank{ctx.rank}.pt")
    group = weakref.ref(ctx.mesh.get_group())
    ctx.destroy()
    # a group still alive here is torn down at exit, where gloo aborts about one process in five
    assert group() is None, "the process group outlived DistContext.destroy"


def record(ctx: DistContext, work: Path) -> dict:
    """Every sharded scenario in turn; what this rank saw."""
    model_dir = work / "model"
    out: dict = {}
    # (a) + (e): three steps with gradient checkpointing, sharded, against the reference's single process.
    model = shard_model(load_model(model_dir, checkpointing=True), ctx, param_dtype=torch.float32)
    out["initial"] = weights(model)
    out["initial_bf16"] = {name: tensor.clone() for name, tensor in policy_weights(model, torch.bfloat16)}
    out["shapes"] = policy_weight_shapes(model)
    out["sync_buckets"] = sync_buckets(model)
    optimizer = adamw(model.parameters())
    out["steps"] = [train_step(model, optimizer, ctx, step) for step in range(3)]
    out["trained"] = weights(model)
    out["trained_optim"] = optim_state(model, optimizer)
    # (c) 2 -> 1 (the test loads it) and (d) the HF export.
    save_sharded(work / "ckpt2", model, optimizer, ctx)
    save_merged(model, load_tokenizer(model_dir), work / "hf2", ctx)
    out["step3"] = train_step(model, optimizer, ctx, 3)
    out["after_step3"] = weights(model)
    # (c) 2 -> 2: the ranks' own checkpoint into a fresh sharded model.
    model = shard_model(load_model(model_dir), ctx, param_dtype=torch.float32)
    optimizer = adamw(model.parameters())
    load_sharded(work / "ckpt2", model, optimizer, ctx)
    out["same_world"] = weights(model)
    out["same_world_optim"] = optim_state(model, optimizer)
    # (c) 1 -> 2: the reference's checkpoint into a fresh sharded model, then one more step.
    model = shard_model(load_model(model_dir), ctx, param_dtype=torch.float32)
    optimizer = adamw(model.parameters())
    load_sharded(work / "ckpt1", model, optimizer, ctx)
    out["resumed"] = weights(model)
    out["resumed_optim"] = optim_state(model, optimizer)
    out["resumed_step3"] = train_step(model, optimizer, ctx, 3)
    out["resumed_after_step3"] = weights(model)
    # (b) LoRA: the merged stream after a no-grad forward that leaves the weights gathered (as log-prob passes
    # do with reshard_after_forward=False), then a step with the shards offloaded to the CPU.
    lora = shard_model(load_model(model_dir, lora=True), ctx, param_dtype=torch.float32, cpu_offload=True,
                       reshard_after_forward=False)
    with torch.no_grad():
        lora(input_ids=batch(0, lora.config.vocab_size)[0][:1])
    out["lora_initial"] = list(policy_weights(lora))
    out["lora_initial_bf16"] = list(policy_weights(lora, torch.bfloat16))
    out["lora_shapes"] = policy_weight_shapes(lora)
    out["lora_plain_parameters"] = plain_policy_parameters(lora)
    optimizer = adamw(trainable_parameters(lora))
    out["lora_step"] = train_step(lora, optimizer, ctx, 0)
    out["lora_trained"] = list(policy_weights(lora))
    # LoRA as on a GPU: a bfloat16 base, float32 adapters, bfloat16 compute.
    lora = shard_model(load_model(model_dir, lora=True, dtype=torch.bfloat16), ctx, param_dtype=torch.bfloat16)
    out["bf16_initial"] = list(policy_weights(lora))
    out["bf16_step"] = train_step(lora, adamw(trainable_parameters(lora)), ctx, 0)
    return out


def sync_buckets(model: nn.Module) -> dict:
    """The weight sync's buckets of a sharded plain model in bfloat16 and float32, made both ways: one gather a
    bucket (ShardGather, whose buckets only rank 0 gets) and the per-tensor stream packed; copies."""
    params = plain_policy_parameters(model)
    assert params is not None and gatherable(params)
    out: dict = {}
    for dtype in (torch.bfloat16, torch.float32):
        manifest = WeightManifest.plan(policy_weight_shapes(model), dtype, SYNC_BUCKET_BYTES)
        gathered = [None if b is None else b.clone()
                    for b in ShardGather(params, manifest, torch.device("cpu")).buckets()]
        packed = [b.clone() for b in packed_buckets(policy_weights(model, dtype), manifest, torch.device("cpu"))]
        slots = [[(slot.name, slot.shape, slot.offset) for slot in bucket] for bucket in manifest.buckets]
        out[dtype] = {"slots": slots, "gathered": gathered, "packed": packed}
    return out


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(work: Path, world: int = 2, timeout_s: float = 150) -> float:
    """Run ``rank_main(work)`` as ``world`` gloo processes; the seconds it took. Fails with every rank's
    output when one exits non-zero or the group runs past ``timeout_s``."""
    port = free_port()
    root = Path(__file__).resolve().parents[1]
    started = time.monotonic()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        log = (work / f"rank{rank}.log").open("w")
        procs.append((subprocess.Popen([sys.executable, __file__, str(work)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
        log.close()
        if code != 0:
            failed.append(rank)
    if failed:
        logs = "\n".join(f"--- rank {rank}\n" + (work / f"rank{rank}.log").read_text()[-3000:] for rank in range(world))
        raise AssertionError(f"ranks {failed} failed:\n{logs}")
    return time.monotonic() - started


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
