"""liger-kernel's RMSNorm / SwiGLU / rotary kernels (model.use_liger, archer/models/liger.py) against
transformers' eager ops on a GPU: the same response log-probs, entropies and gradients to bf16 rounding, padded
and packed. Skipped without a GPU or without liger-kernel; run on the device machine."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers.models.qwen2 import modeling_qwen2

from archer.models.liger import RL_KEY, apply_liger
from archer.models.loading import autocast_for, load_causal_lm
from archer.models.logprobs import response_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
                                reason="needs a CUDA GPU and liger-kernel")
CUDA = torch.device("cuda")


@pytest.fixture
def restore_qwen2():
    """liger patches transformers' qwen2 module for the process: put it back for the tests that follow."""
    saved = {name: getattr(modeling_qwen2, name) for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP")}
    yield
    for name, value in saved.items():
        setattr(modeling_qwen2, name, value)


def _rows(vocab: int) -> dict[str, torch.Tensor]:
    """Four left-padded prompts with right-padded responses of unequal lengths."""
    gen = torch.Generator().manual_seed(0)
    prompt, response = 12, 20
    prompt_len, response_len = torch.tensor([12, 5, 9, 1]), torch.tensor([20, 3, 11, 16])
    columns = torch.arange(prompt + response)
    mask = ((columns >= prompt - prompt_len[:, None]) & (columns < prompt + response_len[:, None])).long()
    ids = torch.randint(1, vocab, mask.shape, generator=gen) * mask
    return {"input_ids": ids.to(CUDA), "attention_mask": mask.to(CUDA),
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0).to(CUDA), "response_length": response}


def _pass(model, rows, packed: bool):
    model.zero_grad()
    with autocast_for(CUDA):
        logp, entropy = response_logprobs(model, rows["input_ids"], rows["attention_mask"], rows["position_ids"],
                                          rows["response_length"], packed=packed)
    (logp.sum() + entropy.sum()).backward()
    grads = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}
    return logp.float(), entropy.float(), grads


@pytest.mark.parametrize("packed", [False, True])
def test_liger_kernels_give_the_eager_log_probs_entropies_and_gradients(tiny_model_dir, restore_qwen2, packed):
    eager = load_causal_lm(tiny_model_dir, device=CUDA)
    rows = _rows(eager.config.vocab_size)
    want = _pass(eager, rows, packed)
    fused = load_causal_lm(tiny_model_dir, device=CUDA)
    assert apply_liger(fused, CUDA, RL_KEY)
    layer = fused.model.layers[0]
    assert (layer.mlp._get_name(), layer.input_layernorm._get_name()) == ("LigerSwiGLUMLP", "LigerRMSNorm")
    got = _pass(fused, rows, packed)
    mask = rows["attention_mask"][:, -rows["response_length"]:].bool()
    for g, w in zip(got[:2], want[:2], strict=True):
        torch.testing.assert_close(g[mask], w[mask], atol=3e-2, rtol=3e-2)
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():  # bf16 rounding, measured over the whole tensor
        assert float((got[2][name] - grad).norm() / grad.norm().clamp(min=1e-12)) < 3e-2, name
