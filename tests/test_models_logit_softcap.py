"""Soft-capped final logits (``final_logit_softcapping``: Gemma 2, some Gemma 3 configs) in archer's chunked
log-prob pass: log-probs, entropies and gradients equal autograd through cap * tanh(z / cap) written out, and a
Gemma 3 model's log-probs equal those of its own (capped) logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from archer.models.logprobs import logit_softcap, logprobs_from_hidden, response_logprobs


def test_capped_log_probs_entropies_and_gradients_equal_autograd_through_the_cap():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=gen, requires_grad=True)
    weight = (3 * torch.randn(50, 16, generator=gen)).requires_grad_()
    labels = torch.randint(0, 50, (7,), generator=gen)
    w_logp, w_entropy = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    results = []
    for capped in (True, False):
        hidden.grad = weight.grad = None
        if capped:  # chunks of 3 tokens: the backward makes each chunk's capped logits again
            logp, entropy = logprobs_from_hidden(
                hidden, (weight, None), labels, temperature=0.7, chunk_size=3, softcap=2.5
            )
        else:
            logits = 2.5 * torch.tanh(hidden @ weight.t() / 2.5) / 0.7
            log_p = F.log_softmax(logits, dim=-1)
            logp, entropy = log_p.gather(1, labels.unsqueeze(1)).squeeze(1), -(log_p.exp() * log_p).sum(-1)
        ((logp * w_logp).sum() + (entropy * w_entropy).sum()).backward()
        results.append((logp.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone()))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain, _ = logprobs_from_hidden(hidden, (weight, None), labels, temperature=0.7)
    assert (plain - results[0][0]).abs().max() > 0.1  # the cap (2.5 against logits of about 10) matters


def test_a_gemma3_models_log_probs_are_those_of_its_capped_logits():
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        final_logit_softcapping=1.5,
        max_position_embeddings=64,
    )
    model = Gemma3ForCausalLM(config).eval()
    assert logit_softcap(model) == 1.5
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask, positions = torch.ones_like(ids), torch.arange(12).expand(2, 12)
    with torch.no_grad():
        logp, entropy = response_logprobs(model, ids, mask, positions, 5)
        log_p = F.log_softmax(model(ids).logits[:, -6:-1], dim=-1)
    assert float(model(ids).logits.abs().max()) < 1.5
    torch.testing.assert_close(logp, log_p.gather(2, ids[:, -5:].unsqueeze(2)).squeeze(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1), atol=1e-5, rtol=0)
