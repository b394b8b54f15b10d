"""SequenceLayout: the padding-free layout written out by hand, and log-probs, entropies and gradients of the
padding-free rows equal to the padded rows' on the micro model."""

from __future__ import annotations

import pytest
import torch
from workers_support import PAD, hand_batch, unequal_batch

from archer.models.forward import MODEL_INPUTS
from archer.models.loading import load_causal_lm
from archer.models.logprobs import response_logprobs
from archer.models.sequence_layout import SequenceLayout


def test_padding_free_layout_by_hand():
    batch = hand_batch()  # sequences of 2 + 2, 4 + 3 and 3 + 1 tokens in rows of 4 + 3
    layout = SequenceLayout.build(*(batch[k] for k in MODEL_INPUTS), 3, remove_padding=True)
    assert layout.attention_mask is None
    assert layout.input_ids.tolist() == [[11, 12, 21, 22, PAD, PAD, PAD],
                                         [13, 14, 15, 16, 23, 24, 25],
                                         [17, 18, 19, 26, PAD, PAD, PAD]]
    assert layout.position_ids.tolist() == [list(range(7))] * 3
    assert layout.response_start.tolist() == [2, 4, 3]
    # response token k is scored by the output at response_start - 1 + k
    assert layout.predictor_columns().tolist() == [[1, 2, 3], [3, 4, 5], [2, 3, 4]]
    assert layout.response_tokens().tolist() == [21, 22, 23, 24, 25, 26]
    states = torch.arange(21).view(3, 7)
    assert layout.response_states(states).tolist() == [1, 2, 10, 11, 12, 16]
    assert layout.scatter(torch.arange(6.0)).tolist() == [[0, 1, 0], [2, 3, 4], [5, 0, 0]]

    shorter = SequenceLayout.build(*(batch.index([0, 2])[k] for k in MODEL_INPUTS), 3, remove_padding=True)
    assert shorter.input_ids.tolist() == [[11, 12, 21, 22], [17, 18, 19, 26]]  # cut to the longest row

    padded = SequenceLayout.build(*(batch[k] for k in MODEL_INPUTS), 3, remove_padding=False)
    assert padded.attention_mask is batch["attention_mask"] and padded.response_start.tolist() == [4, 4, 4]
    assert padded.response_tokens().tolist() == [21, 22, 23, 24, 25, 26]


def test_a_row_that_is_not_one_run_of_tokens_is_refused():
    batch = hand_batch()
    holed = batch["attention_mask"].clone()
    holed[1, 5] = 0  # a hole inside the response of row 1
    with pytest.raises(ValueError, match="one run of tokens"):
        SequenceLayout.build(batch["input_ids"], holed, batch["position_ids"], 3, remove_padding=True)
    no_prompt = batch["attention_mask"].clone()
    no_prompt[0, :4] = 0
    with pytest.raises(ValueError, match="one run of tokens"):
        SequenceLayout.build(batch["input_ids"], no_prompt, batch["position_ids"], 3, remove_padding=True)


def test_padding_free_log_probs_entropies_and_gradients_equal_the_padded_ones(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, device="cpu")
    batch = unequal_batch(model.config.vocab_size)
    rows = (*(batch[k] for k in MODEL_INPUTS), 5)
    weights = torch.randn(6, 5, generator=torch.Generator().manual_seed(4))
    results = []
    for remove_padding in (False, True):
        model.zero_grad(set_to_none=True)
        logp, entropy = response_logprobs(model, *rows, temperature=0.8, remove_padding=remove_padding)
        ((logp * weights).sum() + 0.3 * entropy.sum()).backward()
        results.append((logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logp, entropy, grads), (free_logp, free_entropy, free_grads) = results
    assert torch.all(logp[rows[1][:, 6:] == 0] == 0) and torch.all(logp[rows[1][:, 6:] == 1] < 0)
    torch.testing.assert_close(free_logp, logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(free_entropy, entropy, atol=1e-6, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(free_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
