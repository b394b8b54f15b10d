"""ModelOwner: the dtype and trainability rule of each kind of model, the optimiser over the trainable
parameters only, the weight stream, and a checkpoint that restores weights and optimiser state exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from archer.errors import ArcherError
from archer.models.loading import parse_dtype
from archer.models.lora import LoraSettings
from archer.models.optim import LRSchedule
from archer.models.owner import ModelOwner, compute_dtypes

CPU = torch.device("cpu")
OPTIM = OmegaConf.create({"lr": 0.05, "weight_decay": 0.0, "betas": [0.9, 0.999], "lr_warmup_steps": 2,
                          "warmup_style": "constant"})


def lora() -> LoraSettings:
    return LoraSettings.from_config(OmegaConf.create({"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"}))


def policy(path: Path, settings: LoraSettings | None = None) -> ModelOwner:
    owner = ModelOwner.policy(path, device=CPU, lora=settings, gradient_checkpointing=False, trust_remote_code=False)
    owner.attach_optimizer(OPTIM, LRSchedule.from_rl_optim(OPTIM, total_steps=10))
    return owner


def train_step(owner: ModelOwner) -> None:
    ids = torch.arange(1, 9).unsqueeze(0)
    owner.model(input_ids=ids, labels=ids).loss.backward()
    owner.optimizer.step()
    owner.optimizer.zero_grad()
    owner.scheduler.step()


def test_each_kind_of_model_gets_its_dtype_mode_and_trainable_parameters(tiny_model_dir: Path) -> None:
    full = policy(tiny_model_dir)
    assert full.model.training and full.peft is None
    assert {p.dtype for p in full.model.parameters()} == {torch.float32}
    optimised = [p for group in full.optimizer.param_groups for p in group["params"]]
    assert len(optimised) == len(list(full.model.parameters()))
    adapters = policy(tiny_model_dir, lora())
    optimised = {id(p) for group in adapters.optimizer.param_groups for p in group["params"]}
    trainable = {id(p) for n, p in adapters.model.named_parameters() if "lora_" in n}
    assert optimised == trainable and adapters.peft is not None
    frozen = ModelOwner.frozen_policy(tiny_model_dir, device=CPU, trust_remote_code=False)
    assert not frozen.model.training and not any(p.requires_grad for p in frozen.model.parameters())
    assert frozen.optimizer is None
    value = ModelOwner.value_model(tiny_model_dir, device=CPU, gradient_checkpointing=False, trust_remote_code=False)
    assert value.model.config.num_labels == 1
    # the stream an engine syncs: the plain model's names, LoRA layers merged
    names = {n for n, _ in adapters.weights()}
    assert names == {n for n, _ in full.weights()} and not any("lora_" in n or "base_layer" in n for n in names)


@pytest.mark.parametrize("with_lora", [False, True])
def test_a_checkpoint_restores_weights_optimiser_and_schedule_exactly(tiny_model_dir: Path, tmp_path: Path,
                                                                      with_lora: bool) -> None:
    settings = lora() if with_lora else None
    owner = policy(tiny_model_dir, settings)
    train_step(owner)
    owner.save(tmp_path / "ckpt", tokenizer=None)
    assert (tmp_path / "ckpt" / "optim_state.pt").is_file()
    assert (tmp_path / "ckpt" / "lora_adapter").is_dir() == with_lora
    train_step(owner)
    want = {n: t.clone() for n, t in owner.weights()}
    resumed = policy(tiny_model_dir, settings)
    resumed.load(tmp_path / "ckpt", "actor_rollout_ref.model")
    assert resumed.scheduler.get_last_lr() == pytest.approx([0.05 * 0.5])  # one step into a 2-step warmup
    train_step(resumed)
    got = dict(resumed.weights())
    assert all(torch.equal(got[n], t) for n, t in want.items())


def test_a_lora_checkpoint_into_a_full_fine_tuning_owner_names_the_lora_keys(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    policy(tiny_model_dir, lora()).save(tmp_path / "ckpt")
    with pytest.raises(ArcherError, match="written by a LoRA run, and model.lora_rank=0"):
        policy(tiny_model_dir).load(tmp_path / "ckpt", "model")


def test_verls_model_dtype_and_mixed_precision_pick_the_dtypes(tiny_model_dir: Path) -> None:
    bf16 = ModelOwner.policy(tiny_model_dir, device=torch.device("cpu"), lora=None, gradient_checkpointing=False,
                             trust_remote_code=False, master_dtype=parse_dtype("bf16", "model_dtype"))
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    fsdp = OmegaConf.create({"mixed_precision": {"param_dtype": "fp16", "reduce_dtype": "bf16"}})
    assert compute_dtypes(fsdp, torch.device("cuda", 0)) == (torch.float16, torch.bfloat16)
    assert compute_dtypes(OmegaConf.create({}), torch.device("cuda", 0)) == (torch.bfloat16, torch.float32)
    assert compute_dtypes(fsdp, torch.device("cpu")) == (torch.float32, torch.float32)
    with pytest.raises(ArcherError, match="fsdp_config.mixed_precision.param_dtype='int8'"):
        compute_dtypes(OmegaConf.create({"mixed_precision": {"param_dtype": "int8"}}), torch.device("cuda", 0))
