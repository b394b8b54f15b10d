"""Loading: device and dtype choice, the policy, the critic, saving, and the error for each broken folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from archer.errors import ArcherError
from archer.models.loading import (
    VALUE_HEAD_INIT_STD,
    default_dtype,
    load_causal_lm,
    load_tokenizer,
    load_value_model,
    pick_device,
    save_hf,
    value_forward,
)
from archer.models.packed_attention import PACKED_ATTENTION
from archer.models.tiny import train_tokenizer


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


# -- device and dtype ------------------------------------------------------------------------------
def test_pick_device():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ArcherError, match="unknown device 'tpu9'"):
        pick_device("tpu9")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_pick_device_cuda_missing():
    with pytest.raises(ArcherError, match="no usable CUDA GPU") as info:
        pick_device("cuda")
    assert "device 'cpu'" in info.value.fix


def test_default_dtype():
    assert default_dtype(torch.device("cpu")) == torch.float32
    assert default_dtype(torch.device("cuda")) == torch.bfloat16


# -- the policy ------------------------------------------------------------------------------------
def checkpointing_on(model) -> bool:
    """transformers renamed the flag: releases before the rename only have ``is_gradient_checkpointing``."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return model.is_gradient_checkpointing if flag is None else flag


def test_load_causal_lm_options(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, device="cpu")
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == PACKED_ATTENTION  # SDPA, plus packed rows
    assert not checkpointing_on(model)
    half = load_causal_lm(tiny_model_dir, device="cpu", dtype=torch.bfloat16, gradient_checkpointing=True)
    assert half.dtype == torch.bfloat16
    assert checkpointing_on(half)
    assert half.config.use_cache is False
    assert torch.equal(half.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


def test_save_hf_round_trip(tiny_model_dir, tmp_path):
    model = load_causal_lm(tiny_model_dir, device="cpu")
    tokenizer = load_tokenizer(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.fill_(0.5)
    out = save_hf(model, tokenizer, tmp_path / "saved")
    assert (out / "model.safetensors").is_file()
    reloaded = load_causal_lm(out, device="cpu")
    assert torch.equal(reloaded.model.norm.weight, torch.full((32,), 0.5))
    assert load_tokenizer(out)("a 12")["input_ids"] == tokenizer("a 12")["input_ids"]


def test_missing_folder(tmp_path):
    with pytest.raises(ArcherError, match="does not exist") as info:
        load_causal_lm(tmp_path / "nope", device="cpu")
    assert str(tmp_path / "nope") in str(info.value)
    assert info.value.fix.startswith("check the path")
    assert "`archer quickstart` builds a tiny model" in info.value.fix and "archer.models" not in info.value.fix


def test_file_instead_of_folder(model_copy):
    with pytest.raises(ArcherError, match="is a file, not a folder"):
        load_causal_lm(model_copy / "config.json", device="cpu")


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(ArcherError, match="has no config.json") as info:
        load_causal_lm(model_copy, device="cpu")
    assert str(model_copy) in str(info.value)


@pytest.mark.parametrize("text", ["{not json", '{"hidden_size": 3}', '{"model_type": "no_such_model"}'])
def test_broken_config(model_copy, text):
    (model_copy / "config.json").write_text(text)
    with pytest.raises(ArcherError, match="config.json in .* could not be read") as info:
        load_causal_lm(model_copy, device="cpu")
    assert str(model_copy) in str(info.value)
    assert "model_type" in info.value.fix


def test_missing_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ArcherError, match="has no weights") as info:
        load_causal_lm(model_copy, device="cpu")
    assert str(model_copy) in str(info.value)


def test_truncated_weights(model_copy):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    for loader in (load_causal_lm, load_value_model):
        with pytest.raises(ArcherError, match="could not be loaded as AutoModelFor.*SafetensorError") as info:
            loader(model_copy, device="cpu")
        assert str(model_copy) in str(info.value)
        assert "truncated or corrupt" in info.value.fix


# -- the tokenizer ---------------------------------------------------------------------------------
def test_tokenizer_errors(model_copy, tmp_path):
    with pytest.raises(ArcherError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ArcherError, match="is a file, not a folder"):
        load_tokenizer(model_copy / "tokenizer.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(model_copy / "config.json", empty)
    with pytest.raises(ArcherError, match="has no tokenizer files"):
        load_tokenizer(empty)
    (model_copy / "tokenizer.json").write_text("{broken")
    with pytest.raises(ArcherError, match=r"tokenizer files in .* could not be read \(\w+"):
        load_tokenizer(model_copy)


def test_pad_falls_back_to_eos(micro_corpus, tmp_path):
    trained = train_tokenizer(micro_corpus, 300)
    trained.pad_token = None
    trained.save_pretrained(str(tmp_path))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2


# -- the critic ------------------------------------------------------------------------------------
def test_value_model_shares_backbone_and_starts_small(tiny_model_dir):
    policy = load_causal_lm(tiny_model_dir, device="cpu")
    critic = load_value_model(tiny_model_dir, device="cpu")
    for name, tensor in policy.model.state_dict().items():
        assert torch.equal(critic.model.state_dict()[name], tensor)
    assert critic.score.weight.shape == (1, 32)
    assert 0 < critic.score.weight.std().item() < 3 * VALUE_HEAD_INIT_STD
    assert torch.all(critic.score.bias == 0)

    ids, mask, pos = _inputs()
    values = value_forward(critic, ids, mask, pos)
    assert values.shape == (2, 6)
    assert values.dtype == torch.float32
    hidden = critic.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    expected = hidden @ critic.score.weight[0] + critic.score.bias[0]
    torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-7)
    assert values.abs().max() < 0.1


def test_value_model_trains_without_dropout_and_keeps_its_head(tiny_model_dir, tmp_path):
    critic = load_value_model(tiny_model_dir, device="cpu")
    critic.train()
    ids, mask, pos = _inputs()
    first = value_forward(critic, ids, mask, pos)
    assert torch.equal(first, value_forward(critic, ids, mask, pos))
    first.sum().backward()
    assert critic.score.weight.grad.abs().sum() > 0
    assert critic.model.embed_tokens.weight.grad.abs().sum() > 0

    with torch.no_grad():
        critic.score.weight.fill_(0.25)
    saved = save_hf(critic, load_tokenizer(tiny_model_dir), tmp_path / "critic")
    reloaded = load_value_model(saved, device="cpu")
    assert torch.equal(reloaded.score.weight, torch.full((1, 32), 0.25))
