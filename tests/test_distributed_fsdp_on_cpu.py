"""FSDP2 over 2 gloo ranks on the CPU against one process (archer/distributed): three AdamW steps of a loss
normalised by the global token count give the single-process losses, grad norms and weights (float32, rtol 1e-5
/ atol 1e-6); the weight stream (models/lora.policy_weights, each tensor gathered) equals the plain state dict
exactly, and its LoRA-merged weights equal the unsharded stream's bit for bit (one merge, also on a bfloat16
base); DCP checkpoints resume 2 -> 2 and reshard 2 -> 1 and 1 -> 2 with
weights and Adam state exact; the HF export loads with from_pretrained and gives the trained model's logits;
clip_grad_norm gives the unsharded norm (CPU-offloaded shards included).

One 2-rank run (fsdp_support.rank_main) does all the sharded work; the tests compare its record with the
reference computed here in one process without a process group."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from fsdp_support import MAX_NORM, adamw, load_model, optim_state, run_ranks, train_step, weights
from transformers import AutoModelForCausalLM

from archer.distributed.context import ENV_KEYS, DistContext, shard_bounds
from archer.distributed.fsdp import clip_grad_norm, decoder_layers, shard_model
from archer.distributed.sharded_checkpoint import load_sharded, save_sharded
from archer.errors import ArcherError
from archer.models.lora import policy_weights, save_merged, trainable_parameters

SINGLE = DistContext.single("cpu")
TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference (one process) and the 2-rank record (rank0.pt, rank1.pt) over the same work folder."""
    work = tmp_path_factory.mktemp("fsdp")
    shutil.copytree(tiny_model_dir, work / "model")
    model = load_model(work / "model")
    optimizer = adamw(model.parameters())
    ref: dict = {"initial": {name: tensor.clone() for name, tensor in model.state_dict().items()}}
    ref["steps"] = [train_step(model, optimizer, SINGLE, step) for step in range(3)]
    ref["trained"] = weights(model)
    ref["trained_optim"] = optim_state(model, optimizer)
    save_sharded(work / "ckpt1", model, optimizer, SINGLE)
    ref["step3"] = train_step(model, optimizer, SINGLE, 3)
    ref["after_step3"] = weights(model)
    lora = load_model(work / "model", lora=True)
    ref["lora_initial"] = [(name, tensor.clone()) for name, tensor in policy_weights(lora.get_base_model())]
    lora_optimizer = adamw(trainable_parameters(lora))
    ref["lora_step"] = train_step(lora, lora_optimizer, SINGLE, 0)
    ref["lora_trained"] = [(name, tensor.clone()) for name, tensor in policy_weights(lora.get_base_model())]
    bf16 = load_model(work / "model", lora=True, dtype=torch.bfloat16)
    ref["bf16_initial"] = [(name, tensor.clone()) for name, tensor in policy_weights(bf16.get_base_model())]
    ref["bf16_step"] = train_step(bf16, adamw(trainable_parameters(bf16)), SINGLE, 0)
    ref["seconds"] = run_ranks(work)
    return {"work": work, "ref": ref, "ranks": torch.load(work / "rank0.pt"), "rank1": torch.load(work / "rank1.pt")}


def assert_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        if exact:
            assert torch.equal(got[name], tensor), name
        else:
            torch.testing.assert_close(got[name], tensor, **TOL, msg=name)


def assert_optim(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want) and len(want) > 10
    for name, state in want.items():
        assert sorted(got[name]) == ["exp_avg", "exp_avg_sq", "step"], name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[name][key], state[key]), (name, key)


def test_train_steps_on_two_ranks_match_one_process(runs):
    ref, ranks = runs["ref"], runs["ranks"]
    assert all(norm > MAX_NORM for _, norm in ref["steps"])  # clipping acted in every step
    for (loss, norm), (ref_loss, ref_norm) in zip(ranks["steps"] + [ranks["step3"]], ref["steps"] + [ref["step3"]],
                                                  strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)
    assert runs["rank1"]["steps"] == ranks["steps"]  # both ranks see the global loss and the global norm
    moved = max((ref["initial"][name] - tensor).abs().max() for name, tensor in ref["trained"].items())
    assert moved > 1e-3
    assert_weights(ranks["trained"], ref["trained"], exact=False)
    assert_weights(ranks["after_step3"], ref["after_step3"], exact=False)


def test_the_weight_stream_on_two_ranks_equals_the_plain_state_dict(runs):
    ref, ranks = runs["ref"], runs["ranks"]
    tied = {"lm_head.weight"} - set(ranks["initial"])  # tied to the embedding: given once
    assert_weights(ranks["initial"], {k: v for k, v in ref["initial"].items() if k not in tied}, exact=True)


def test_a_stream_cast_before_the_gather_holds_the_gathered_weights_cast(runs):
    """separate_async gathers the weights in the engine's dtype: half the bytes, the same values."""
    ranks = runs["ranks"]
    assert ranks["initial_bf16"].keys() == ranks["initial"].keys()
    for name, tensor in ranks["initial"].items():
        got = ranks["initial_bf16"][name]
        assert got.dtype == torch.bfloat16 and torch.equal(got, tensor.to(torch.bfloat16)), name
    for (name, got), (_, want) in zip(ranks["lora_initial_bf16"], ranks["lora_initial"], strict=True):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16)), name


def test_the_streams_names_and_whole_shapes_come_without_a_gather(runs):
    """What the weight sync plans its buckets from (a sharded parameter's shape is the whole one's)."""
    ranks = runs["ranks"]
    assert ranks["shapes"] == [(name, tuple(tensor.shape)) for name, tensor in ranks["initial"].items()]
    assert ranks["lora_shapes"] == [(name, tuple(tensor.shape)) for name, tensor in ranks["lora_initial"]]
    assert any(shape[0] > 1 for _, shape in ranks["shapes"])


def test_one_gather_a_bucket_gives_the_weight_syncs_buckets_of_the_per_tensor_stream(runs):
    """separate_async's sender gathers each bucket of shards at once (distributed/shard_buckets.py): rank 0's
    buckets hold exactly what packing the gathered stream gives, and unpack by the manifest to the initial
    weights cast; LoRA policies keep the stream (their weights are merged whole)."""
    ranks = runs["ranks"]
    for dtype, record in ranks["sync_buckets"].items():
        buckets = record["slots"]
        assert len(buckets) > 2 and any(len(b) == 1 for b in buckets)
        assert len(record["gathered"]) == len(record["packed"]) == len(buckets)
        for got, want in zip(record["gathered"], record["packed"], strict=True):
            assert got.dtype == dtype and torch.equal(got, want)
        for bucket, slots in zip(record["gathered"], buckets, strict=True):
            for name, shape, offset in slots:
                weight = bucket[offset: offset + math.prod(shape)].view(shape)
                assert torch.equal(weight, ranks["initial"][name].to(dtype)), name
    assert ranks["lora_plain_parameters"] is None


def test_the_lora_merged_stream_on_two_ranks_equals_the_unsharded_one(runs):
    ref, ranks = runs["ref"], runs["ranks"]
    assert [name for name, _ in ranks["lora_initial"]] == [name for name, _ in ref["lora_initial"]]
    assert not any("lora_" in name or "base_layer" in name for name, _ in ranks["lora_initial"])
    for (name, got), (_, want) in zip(ranks["lora_initial"], ref["lora_initial"], strict=True):
        assert torch.equal(got, want), name
    # a step with the shards offloaded to the CPU trains the adapters as one process does
    loss, norm = ranks["lora_step"]
    assert loss == pytest.approx(ref["lora_step"][0], rel=1e-5) and norm == pytest.approx(ref["lora_step"][1], rel=1e-5)
    changed = 0
    for (name, got), (_, want), (_, before) in zip(ranks["lora_trained"], ref["lora_trained"], ref["lora_initial"],
                                                   strict=True):
        torch.testing.assert_close(got, want, **TOL, msg=name)
        changed += not torch.equal(want, before)
    assert changed >= 4  # the merged weights of the adapted layers moved


def test_lora_on_a_bfloat16_base_trains_on_two_ranks_as_in_one_process(runs):
    """The merged stream keeps the base's dtype and bits; loss and gradient norm agree to bfloat16 precision
    (the weights after an Adam step are not compared: its first step is sign-like, so bfloat16 noise in
    near-zero gradients moves some weights by a whole step)."""
    ref, ranks = runs["ref"], runs["ranks"]
    for (name, got), (_, want) in zip(ranks["bf16_initial"], ref["bf16_initial"], strict=True):
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want), name
    assert ranks["bf16_step"][0] == pytest.approx(ref["bf16_step"][0], rel=1e-3)
    assert ranks["bf16_step"][1] == pytest.approx(ref["bf16_step"][1], rel=1e-2)


def fresh(model_dir: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = load_model(model_dir)
    return model, adamw(model.parameters())


def test_two_rank_checkpoint_resumes_in_one_process_exactly(runs):
    work, ranks = runs["work"], runs["ranks"]
    assert sorted(p.name for p in (work / "ckpt2").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    model, optimizer = fresh(work / "model")
    load_sharded(work / "ckpt2", model, optimizer, SINGLE)
    assert_weights(weights(model), ranks["trained"], exact=True)
    assert_optim(optim_state(model, optimizer), ranks["trained_optim"])
    loss, norm = train_step(model, optimizer, SINGLE, 3)
    assert loss == pytest.approx(ranks["step3"][0], rel=1e-5) and norm == pytest.approx(ranks["step3"][1], rel=1e-5)
    assert_weights(weights(model), ranks["after_step3"], exact=False)


def test_two_rank_checkpoint_resumes_on_two_ranks_exactly(runs):
    ranks = runs["ranks"]
    assert_weights(ranks["same_world"], ranks["trained"], exact=True)
    assert_optim(ranks["same_world_optim"], ranks["trained_optim"])


def test_one_process_checkpoint_resumes_on_two_ranks_exactly(runs):
    ref, ranks = runs["ref"], runs["ranks"]
    assert_weights(ranks["resumed"], ref["trained"], exact=True)
    assert_optim(ranks["resumed_optim"], ref["trained_optim"])
    assert ranks["resumed_step3"][0] == pytest.approx(ref["step3"][0], rel=1e-5)
    assert_weights(ranks["resumed_after_step3"], ref["after_step3"], exact=False)


def test_hf_export_from_two_ranks_loads_with_the_trained_logits(runs):
    work, ranks = runs["work"], runs["ranks"]
    exported = AutoModelForCausalLM.from_pretrained(work / "hf2", dtype=torch.float32)
    assert exported.config.architectures == ["Qwen2ForCausalLM"]
    assert (work / "hf2" / "tokenizer.json").is_file()
    trained = load_model(work / "model")
    trained.load_state_dict(ranks["trained"], strict=False)  # lm_head is tied to the embedding
    ids = torch.randint(0, trained.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(exported.eval()(ids).logits, trained.eval()(ids).logits)
    assert_weights({k: v for k, v in exported.state_dict().items() if k in ranks["trained"]}, ranks["trained"],
                   exact=True)


def test_lora_export_in_one_process_is_the_merged_model(tmp_path, tiny_model_dir):
    from archer.models.loading import load_tokenizer

    lora = load_model(tiny_model_dir, lora=True).eval()
    save_merged(lora, load_tokenizer(tiny_model_dir), tmp_path / "hf", SINGLE)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    merged = dict(policy_weights(lora.get_base_model()))
    saved = exported.state_dict()
    assert_weights({name: saved[name] for name in merged}, merged, exact=True)
    ids = torch.randint(0, exported.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, lora(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert not any("lora_" in k for k in exported.state_dict())


def test_clip_grad_norm_scales_by_the_global_norm_and_leaves_non_finite_grads(tiny_model_dir):
    model = load_model(tiny_model_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    norm = float(torch.cat([g.flatten() for g in grads.values()]).double().norm())
    assert norm > 1.0
    assert clip_grad_norm(model, None) == pytest.approx(norm, rel=1e-6)  # None and 0: no clipping
    assert clip_grad_norm(model, 0.0) == pytest.approx(norm, rel=1e-6)
    assert all(torch.equal(p.grad, grads[name]) for name, p in model.named_parameters())
    assert clip_grad_norm(model, 0.5) == pytest.approx(norm, rel=1e-6)  # the norm before clipping
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name] * 0.5 / norm, rtol=1e-5, atol=1e-9)
    assert clip_grad_norm(model, 0.5) == pytest.approx(0.5, rel=1e-5)
    clipped = {name: p.grad.clone() for name, p in model.named_parameters()}
    next(model.parameters()).grad[0, 0] = float("nan")
    assert math.isnan(clip_grad_norm(model, 0.1))  # returned as is: the caller skips the step
    for name, param in list(model.named_parameters())[1:]:
        assert torch.equal(param.grad, clipped[name]), name  # not scaled by a nan coefficient
    model.zero_grad(set_to_none=True)
    assert clip_grad_norm(model, 1.0) == 0.0


def test_world_one_is_the_plain_model_and_shard_bounds_split_like_numpy(tiny_model_dir, tmp_path):
    model = load_model(tiny_model_dir)
    assert shard_model(model, SINGLE, param_dtype=torch.float32) is model
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())
    assert [shard_bounds(7, rank, 3) for rank in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [shard_bounds(2, rank, 4) for rank in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    with pytest.raises(ValueError):
        shard_bounds(4, 2, 2)
    with pytest.raises(ArcherError, match="no sharded checkpoint"):
        load_sharded(tmp_path, model, None, SINGLE)
    stream = dict(policy_weights(model))  # world 1: the plain parameters' own storage, no copy
    assert all(stream[name].data_ptr() == param.data_ptr() for name, param in model.named_parameters())
    assert [type(layer).__name__ for layer in decoder_layers(model)] == ["Qwen2DecoderLayer"] * 2
    with pytest.raises(ArcherError, match="no decoder-layer classes"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_init_from_env_names_what_is_missing(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ArcherError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK are not set"):
        DistContext.init_from_env("cpu", timeout_s=5)
    for key, value in zip(ENV_KEYS, ("0", "1", "127.0.0.1", "29555", "0"), strict=True):
        monkeypatch.setenv(key, value)
    if not torch.cuda.is_available():
        with pytest.raises(ArcherError, match="needs a CUDA device"):
            DistContext.init_from_env("cuda", timeout_s=5)
    with pytest.raises(ArcherError, match="unknown device kind"):
        DistContext.init_from_env("tpu", timeout_s=5)  # type: ignore[arg-type]


def test_checkpoint_of_another_model_is_one_clear_error(tmp_path, tiny_model_dir):
    lora = load_model(tiny_model_dir, lora=True)
    save_sharded(tmp_path / "ckpt", lora, None, SINGLE)  # adapters only (the base is frozen)
    model, optimizer = fresh(tiny_model_dir)
    with pytest.raises(ArcherError, match="does not fit this model"):
        load_sharded(tmp_path / "ckpt", model, optimizer, SINGLE)

