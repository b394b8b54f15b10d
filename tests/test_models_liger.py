"""verl's model.use_liger (archer/models/liger.py) where no GPU is: the key's warning on the CPU, its refusal when
liger-kernel is missing, and which of liger's kernels it asks for (a stand-in liger module records the call).
The kernels themselves against transformers' eager ops: tests/test_liger_gpu.py."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

from archer.errors import ArcherError
from archer.models.liger import RL_KEY, apply_liger
from archer.models.loading import load_causal_lm
from archer.models.owner import ModelOwner

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


@pytest.fixture
def fake_liger(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """A liger_kernel package that knows qwen2 and records each call of _apply_liger_kernel_to_instance."""
    calls: list[dict] = []
    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen2": object()}
    patch._apply_liger_kernel_to_instance = lambda **kwargs: calls.append(kwargs)
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", patch)
    return calls


def test_on_the_cpu_the_key_warns_and_the_model_keeps_its_modules(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="archer.models"):
        model = ModelOwner.frozen_policy(tiny_model_dir, device=torch.device("cpu"), trust_remote_code=False,
                                         liger_key=RL_KEY).model
    assert [r.getMessage() for r in caplog.records] == [
        "actor_rollout_ref.model.use_liger=true has no effect on cpu: liger's kernels are Triton kernels for GPUs"]
    layer = model.model.layers[0]
    assert type(layer.input_layernorm) is Qwen2RMSNorm and type(layer.mlp) is Qwen2MLP


def test_without_the_package_the_key_is_refused_with_the_install_command(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # an import of it fails, installed or not
    model = load_causal_lm(tiny_model_dir, device="cpu")
    with pytest.raises(ArcherError) as err:
        apply_liger(model, CUDA, "model.use_liger")
    assert "model.use_liger=true needs the liger-kernel package" in str(err.value)
    assert "pip install liger-kernel, or set model.use_liger=false" in str(err.value)


def test_a_gpu_model_gets_the_norm_mlp_and_rotary_kernels_and_no_loss_kernel(tiny_model_dir, fake_liger):
    model = load_causal_lm(tiny_model_dir, device="cpu")
    assert apply_liger(model, CUDA, RL_KEY) is True
    assert fake_liger == [{"model": model, "rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                           "fused_linear_cross_entropy": False}]


def test_an_architecture_liger_lacks_keeps_its_ops_with_a_warning(tiny_model_dir, fake_liger, caplog):
    model = load_causal_lm(tiny_model_dir, device="cpu")
    model.config.model_type = "my_arch"
    with caplog.at_level(logging.WARNING, logger="archer.models"):
        assert apply_liger(model, CUDA, RL_KEY) is False
    assert fake_liger == []
    assert "liger-kernel has no kernels for model_type 'my_arch'" in caplog.text
