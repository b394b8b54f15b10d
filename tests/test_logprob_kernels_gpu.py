"""The Triton kernels of the chunked log-prob head (archer/models/logprob_kernels.py) against the torch code they
replace on a GPU (models/logprobs.py's ``_log_softmax_stats`` and ``_logit_grads``), on bf16 logits of Qwen's
vocabulary and of sizes that are not a multiple of the kernels' block. The whole head through them against
autograd: tests/test_models_logprobs.py's cuda cases. Skipped without a GPU; run on the device machine."""

from __future__ import annotations

import pytest
import torch

from archer.models.logprobs import _log_softmax_stats, _logit_grads, logprob_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or logprob_kernels is None,
                                reason="needs a CUDA GPU and Triton")
CUDA = torch.device("cuda")


def _logits(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    logits = (torch.randn(rows, vocab, device=CUDA, generator=gen) * 4).to(torch.bfloat16)
    logits[0, :7] = 60.0  # a row far from uniform: large shifts, entropy near log 7
    labels = torch.randint(0, vocab, (rows,), device=CUDA, generator=gen)
    return logits, labels


@pytest.mark.parametrize("vocab", [151936, 5000, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_stats_equal_the_torch_statistics(vocab, temperature):
    logits, labels = _logits(37, vocab, seed=vocab)
    got = logprob_kernels.row_stats(logits, labels, temperature)
    want = _log_softmax_stats(logits.clone(), labels, temperature, compute_entropy=True)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-5)
    peaks = min(7, vocab)  # row 0's entries at 60 dwarf the rest: its entropy is log of their count
    assert float(got[2][0]) == pytest.approx(float(torch.log(torch.tensor(float(peaks)))), abs=1e-3)


def test_a_broadcast_gradient_reads_as_its_values():
    """logp.sum().backward() hands the head a stride-0 gradient: every row must see 1, not storage past it."""
    logits, labels = _logits(29, 5000, seed=3)
    _, log_norm, entropy = _log_softmax_stats(logits.clone(), labels, 1.0, compute_entropy=True)
    ones = torch.ones((), device=CUDA).expand(29)
    full = torch.ones(29, device=CUDA)
    want = _logit_grads(logits.clone(), labels, log_norm, full, entropy, full, 1.0)
    got = logprob_kernels.logit_grads_(logits.clone(), labels, log_norm, ones, entropy, ones, 1.0)
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), atol=1e-6, rtol=1e-2)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("vocab", [151936, 5000])
def test_logit_gradients_equal_the_torch_closed_form(vocab, with_entropy):
    logits, labels = _logits(29, vocab, seed=1)
    temperature = 0.7
    _, log_norm, entropy = _log_softmax_stats(logits.clone(), labels, temperature, compute_entropy=True)
    gen = torch.Generator(device=CUDA).manual_seed(2)
    grad_logp = torch.randn(29, device=CUDA, generator=gen)
    grad_entropy = torch.randn(29, device=CUDA, generator=gen) if with_entropy else None
    want = _logit_grads(logits.clone(), labels, log_norm, grad_logp, entropy if with_entropy else None,
                        grad_entropy, 1.0 / temperature).to(torch.bfloat16)
    buffer = logits.clone()
    got = logprob_kernels.logit_grads_(buffer, labels, log_norm, grad_logp, entropy if with_entropy else None,
                                       grad_entropy, temperature)
    assert got.data_ptr() == buffer.data_ptr() and got.dtype == torch.bfloat16  # written over the logits
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=1e-2)
    picked = got.float().gather(1, labels[:, None]).squeeze(1)
    assert float(picked.abs().max()) > 1e-2  # the label's own term is there


def test_row_stats_entropy_is_precise_for_near_certain_rows():
    """Rows whose top token dominates by 12 to 33 nats at Qwen's vocabulary: entropies from 7.7 down to 1.5e-6,
    each within 5e-6 of float64 (the moment about the running maximum; an unshifted one was off by 2e-5)."""
    gen = torch.Generator(device=CUDA).manual_seed(0)
    logits = (torch.randn(8, 151936, device=CUDA, generator=gen) * 3).to(torch.bfloat16)
    for row in range(8):
        logits[row, row] = 12.0 + 3 * row
    _, _, entropy = logprob_kernels.row_stats(logits, torch.arange(8, device=CUDA), 1.0)
    want = torch.distributions.Categorical(logits=logits.double()).entropy()
    assert float(want[-1]) < 1e-5
    torch.testing.assert_close(entropy.double(), want, atol=5e-6, rtol=0)
