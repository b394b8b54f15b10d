"""Chunked log-probs and entropies: hand-computed values, the float64 reference, the autograd path under
bf16 autocast, gradients, memory bounds, and the padded and padding-free layouts on a real model."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM

from archer.errors import ArcherError
from archer.models.loading import load_causal_lm
from archer.models.logprobs import auto_chunk_size, backbone_of, logprobs_from_hidden, response_logprobs

N, H, V = 37, 16, 50


def _problem(seed: int = 0) -> tuple[torch.Tensor, nn.Linear, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    head = nn.Linear(H, V)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=gen) * 0.5)
        head.bias.copy_(torch.randn(V, generator=gen))
    labels = torch.randint(0, V, (N,), generator=gen)
    return hidden, head, labels


def _reference(hidden, weight, bias, labels, temperature):
    """Full-vocabulary float64 computation: the numbers the chunked kernel must reproduce."""
    logits = (hidden.double() @ weight.double().T + bias.double()) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def test_hand_computed_values():
    weight = torch.tensor([[0.0], [math.log(3.0)]])
    hidden = torch.tensor([[0.0], [1.0]])
    labels = torch.tensor([0, 1])
    logp, entropy = logprobs_from_hidden(hidden, (weight, None), labels)
    # row 0: logits [0, 0] -> p = [1/2, 1/2]; row 1: logits [0, ln 3] -> p = [1/4, 3/4]
    expected_logp = torch.tensor([math.log(0.5), math.log(0.75)])
    expected_entropy = torch.tensor([math.log(2.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])
    torch.testing.assert_close(logp, expected_logp)
    torch.testing.assert_close(entropy, expected_entropy)
    # temperature 2 halves the logits: row 1 -> [0, ln 3 / 2] -> p1 = sqrt(3) / (1 + sqrt(3))
    logp_t, _ = logprobs_from_hidden(hidden, (weight, None), labels, temperature=2.0)
    assert logp_t[1].item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 8, 37, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_matches_float64_reference(chunk_size, temperature):
    hidden, head, labels = _problem()
    with torch.no_grad():
        logp, entropy = logprobs_from_hidden(
            hidden, head, labels, temperature=temperature, chunk_size=chunk_size
        )
    ref_logp, ref_entropy = _reference(hidden, head.weight, head.bias, labels, temperature)
    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=0)
    no_entropy = logprobs_from_hidden(hidden, head, labels, chunk_size=chunk_size, compute_entropy=False)
    assert no_entropy[1] is None


@pytest.mark.parametrize("chunk_size", [5, 64])
def test_gradients_match_reference(chunk_size):
    hidden, head, labels = _problem(seed=1)
    hidden.requires_grad_(True)
    gen = torch.Generator().manual_seed(2)
    c_logp, c_entropy = torch.randn(N, generator=gen), torch.randn(N, generator=gen)

    logp, entropy = logprobs_from_hidden(hidden, head, labels, temperature=0.8, chunk_size=chunk_size)
    ((logp * c_logp).sum() + (entropy * c_entropy).sum()).backward()

    ref_hidden = hidden.detach().double().requires_grad_(True)
    ref_weight = head.weight.detach().double().requires_grad_(True)
    ref_bias = head.bias.detach().double().requires_grad_(True)
    ref_logp, ref_entropy = _reference(ref_hidden, ref_weight, ref_bias, labels, 0.8)
    ((ref_logp * c_logp.double()).sum() + (ref_entropy * c_entropy.double()).sum()).backward()

    torch.testing.assert_close(hidden.grad.double(), ref_hidden.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(head.weight.grad.double(), ref_weight.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(head.bias.grad.double(), ref_bias.grad, atol=1e-5, rtol=1e-4)


def test_entropy_alone_carries_gradient():
    hidden, head, labels = _problem(seed=3)
    hidden.requires_grad_(True)
    _, entropy = logprobs_from_hidden(hidden, head, labels, chunk_size=7)
    entropy.sum().backward()
    ref_hidden = hidden.detach().double().requires_grad_(True)
    _, ref_entropy = _reference(ref_hidden, head.weight.detach(), head.bias.detach(), labels, 1.0)
    ref_entropy.sum().backward()
    assert hidden.grad.abs().max() > 1e-3
    torch.testing.assert_close(hidden.grad.double(), ref_hidden.grad, atol=1e-5, rtol=1e-4)


class _LargestFloatTensor(TorchDispatchMode):
    """Records the element count of the largest floating-point tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_larger_than_a_chunk_of_logits():
    rows, hidden_size, vocab, chunk = 256, 8, 2000, 16
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    head = nn.Linear(hidden_size, vocab)
    labels = torch.randint(0, vocab, (rows,))

    with _LargestFloatTensor() as spy:
        logp, entropy = logprobs_from_hidden(hidden, head, labels, chunk_size=chunk)
        (logp.sum() + entropy.sum()).backward()
    assert spy.largest <= chunk * vocab

    with _LargestFloatTensor() as naive:
        torch.log_softmax(head(hidden).float(), dim=-1).gather(-1, labels[:, None]).sum().backward()
    assert naive.largest >= rows * vocab


def test_chunk_logits_are_not_kept_for_backward():
    rows, hidden_size, vocab, chunk = 64, 4, 500, 16
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    head = nn.Linear(hidden_size, vocab)
    labels = torch.randint(0, vocab, (rows,))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = logprobs_from_hidden(hidden, head, labels, chunk_size=chunk)
    assert max(saved) < chunk * vocab  # inputs and the head only, never a [chunk, vocab] tensor
    (logp.sum() + entropy.sum()).backward()
    assert hidden.grad.abs().sum() > 0

    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.log_softmax(head(hidden[:chunk]), dim=-1)
    assert max(saved) == chunk * vocab  # the hook does see logits when nothing is checkpointed


def _autograd_path(hidden, weight, bias, labels, temperature):
    """What autograd through F.linear, log_softmax and softmax computes: the previous kernel's numbers."""
    logits = F.linear(hidden, weight, bias).float() / temperature
    log_softmax = torch.log_softmax(logits, dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return log_softmax.gather(-1, labels[:, None]).squeeze(-1), entropy


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU's float32-accumulating head gradient needs CUDA"))])
@pytest.mark.parametrize("autocast", [False, True])
def test_values_and_gradients_equal_the_autograd_path(autocast, device):
    """The closed-form backward against autograd, in float32 and under bf16 autocast (the GPU's setting):
    the same bf16 logits, so the same numbers up to float32 rounding (and bf16 rounding of the gradients). On
    a GPU the head's gradient is accumulated by one float32 GEMM per chunk (``_add_product``)."""
    hidden, head, labels = _problem(seed=4)
    hidden, head, labels = hidden.to(device), head.to(device), labels.to(device)
    gen = torch.Generator().manual_seed(5)
    c_logp, c_entropy = torch.randn(N, generator=gen).to(device), torch.randn(N, generator=gen).to(device)
    results = []
    for fused in (True, False):
        h = hidden.clone().requires_grad_(True)
        head.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            if fused:
                logp, entropy = logprobs_from_hidden(h, head, labels, temperature=0.7, chunk_size=8)
            else:
                logp, entropy = _autograd_path(h, head.weight, head.bias, labels, 0.7)
        ((logp * c_logp).sum() + (entropy * c_entropy).sum()).backward()
        results.append((logp, entropy, h.grad, head.weight.grad.clone(), head.bias.grad.clone()))
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if autocast else {"atol": 1e-5, "rtol": 1e-5}
    for got, want in zip(*results):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tolerance)
    assert results[0][2].abs().max() > 1e-2


@pytest.fixture(scope="module")
def cpu_peak_bytes():
    """bench/logprob_memory.py's measure: the most bytes of CPU tensors alive at once while a function runs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
        yield importlib.import_module("logprob_memory").cpu_peak_bytes


def test_peak_memory_is_two_chunks_of_logits_whatever_the_token_count(cpu_peak_bytes):
    """Forward and backward hold at most two float32 [chunk, vocab] buffers beside the gradients they return;
    the token count changes only the [tokens, hidden] terms. (The previous kernel peaked at about 6 buffers.)"""
    hidden_size, vocab, chunk = 8, 4096, 32
    buffer = chunk * vocab * 4
    peaks = []
    for rows in (256, 1024):
        hidden = torch.randn(rows, hidden_size, requires_grad=True)
        head = nn.Linear(hidden_size, vocab)
        labels = torch.randint(0, vocab, (rows,))

        def step(hidden=hidden, head=head, labels=labels):
            logp, entropy = logprobs_from_hidden(hidden, head, labels, chunk_size=chunk)
            (logp.sum() + entropy.sum()).backward()

        gradients = (vocab * hidden_size + vocab + rows * hidden_size) * 4
        peaks.append(cpu_peak_bytes(step) - gradients)
    assert max(peaks) <= 2 * buffer * 1.05
    assert peaks[1] - peaks[0] <= 768 * hidden_size * 4 * 4  # a few [tokens, hidden] and [tokens] vectors


def test_auto_chunk_size_keeps_the_logits_of_a_chunk_within_256_mib():
    assert auto_chunk_size(152064) == 441  # 256 MiB / (4 bytes x 152064): the torch path's float32 logits
    assert auto_chunk_size(152064, logit_bytes=2) == 882  # the fused kernels' bf16 logits
    assert auto_chunk_size(2**28) == 1
    hidden, head, labels = _problem(seed=6)
    torch.testing.assert_close(logprobs_from_hidden(hidden, head, labels)[0],
                               logprobs_from_hidden(hidden, head, labels, chunk_size=3)[0])


def test_empty_input():
    _, head, _ = _problem()
    logp, entropy = logprobs_from_hidden(torch.zeros(0, H), head, torch.zeros(0, dtype=torch.long))
    assert logp.shape == entropy.shape == (0,)


# -- response_logprobs on a real model -------------------------------------------------------------
def _sequences() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Left-padded prompts (P = 4) followed by right-padded responses (R = 3)."""
    input_ids = torch.tensor(
        [
            [0, 0, 17, 18, 40, 41, 0],
            [21, 22, 23, 24, 50, 51, 52],
            [0, 0, 0, 30, 60, 0, 0],
        ]
    )
    attention_mask = torch.tensor(
        [
            [0, 0, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1, 1, 1],
            [0, 0, 0, 1, 1, 0, 0],
        ]
    )
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids, 3


def _naive_response_logprobs(model, input_ids, attention_mask, position_ids, size, temperature):
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logp_all = torch.log_softmax(logits[:, -size - 1 : -1].double() / temperature, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, -size:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    valid = attention_mask[:, -size:]
    return logp * valid, entropy * valid


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_logprobs_matches_full_logits(tiny_model_dir, temperature):
    model = load_causal_lm(tiny_model_dir, device="cpu")
    ids, mask, pos, size = _sequences()
    with torch.no_grad():
        logp, entropy = response_logprobs(model, ids, mask, pos, size, temperature=temperature, chunk_size=2)
        ref_logp, ref_entropy = _naive_response_logprobs(model, ids, mask, pos, size, temperature)
    assert logp.shape == entropy.shape == (3, 3)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=0)
    assert torch.all(logp[0, 2] == 0) and torch.all(logp[2, 1:] == 0)
    assert torch.all(entropy[2, 1:] == 0)
    assert torch.all(logp[mask[:, -size:].bool()] < 0)


def test_response_logprobs_gradient_matches_full_logits(tiny_model_dir):
    ids, mask, pos, size = _sequences()
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(3, size, generator=gen)
    grads = []
    for chunked in (True, False):
        model = load_causal_lm(tiny_model_dir, device="cpu")
        if chunked:
            logp, entropy = response_logprobs(model, ids, mask, pos, size, chunk_size=2)
        else:
            logp, entropy = _naive_response_logprobs(model, ids, mask, pos, size, 1.0)
        ((logp * weights).sum() + 0.1 * entropy.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert "model.embed_tokens.weight" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(
            grads[0][name], grads[1][name].to(grads[0][name].dtype), atol=1e-5, rtol=1e-4
        )


def test_backbone_of_llama_and_refusal():
    config = LlamaConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    model = LlamaForCausalLM(config)
    assert backbone_of(model) is model.model
    with pytest.raises(ArcherError, match="cannot find the transformer backbone inside Linear"):
        backbone_of(nn.Linear(2, 2))
