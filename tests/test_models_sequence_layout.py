"""SequenceLayout and packed attention: the packed layout written out by hand, and log-probs, entropies, values and
gradients of packed rows of very different lengths equal to the padded rows' on the micro model (float32, the CPU's
per-sequence attention); the attention implementation keeps the sequences of a packed row apart."""

from __future__ import annotations

import pytest
import torch
from workers_support import PAD, hand_batch, unequal_batch

from archer.models import packed_attention as packed_attention_module
from archer.models.forward import MODEL_INPUTS
from archer.models.loading import load_causal_lm, load_value_model, value_forward
from archer.models.logprobs import layout_logprobs
from archer.models.packed_attention import (
    PACKED_ATTENTION,
    all_ones_mask,
    archer_mask,
    packed_attention,
    supports_packing,
    windowed_layers,
)
from archer.models.sequence_layout import PackedRows, ScoredRows, SequenceLayout


def test_packed_layout_by_hand():
    batch = hand_batch()  # sequences of 2 + 2, 4 + 3 and 3 + 1 tokens in rows of 4 + 3
    layout = SequenceLayout.build(*(batch[k] for k in MODEL_INPUTS), 3, packed=True)
    assert layout.packed and layout.input_ids.tolist() == [[11, 12, 21, 22, 13, 14, 15, 16, 23, 24, 25, 17, 18, 19, 26]]
    inputs = layout.model_inputs()
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]]
    assert inputs["attention_mask"].tolist() == [[1] * 15]  # transformers then makes no mask of its own
    assert inputs["cu_seq_lens_q"].tolist() == [0, 4, 11, 15] and inputs["cu_seq_lens_q"].dtype == torch.int32
    assert inputs["max_length_q"] == 7 and inputs["cu_seq_lens_k"] is inputs["cu_seq_lens_q"]
    # response token k of row i is scored by the output at first_predictor[i] + k (the token before it)
    assert layout.first_predictor.tolist() == [1, 7, 13]
    assert layout.predictor_index().tolist() == [[1, 2, 3], [7, 8, 9], [13, 14, 14]]
    assert layout.response_tokens().tolist() == [21, 22, 23, 24, 25, 26]
    states = torch.arange(15).view(1, 15)
    assert layout.response_states(states).tolist() == [1, 2, 7, 8, 9, 13]
    assert layout.scatter(torch.arange(6.0)).tolist() == [[0, 1, 0], [2, 3, 4], [5, 0, 0]]

    masked = SequenceLayout.build(*(batch[k] for k in MODEL_INPUTS), 3, packed=False, aligned=False)
    assert not masked.packed and masked.model_inputs()["attention_mask"] is batch["attention_mask"]
    assert masked.first_predictor.tolist() == [3, 10, 17]  # row i * 7 columns + column 3
    assert masked.response_tokens().tolist() == [21, 22, 23, 24, 25, 26]
    assert masked.response_states(torch.arange(21).view(3, 7)).tolist() == [3, 4, 10, 11, 12, 17]

    # the default padded layout: every row's tokens from column 0, padding (token 0) after, no mask needed
    aligned = SequenceLayout.build(*(batch[k] for k in MODEL_INPUTS), 3, packed=False)
    assert not aligned.packed
    assert aligned.input_ids.tolist() == [[11, 12, 21, 22, 0, 0, 0], [13, 14, 15, 16, 23, 24, 25],
                                          [17, 18, 19, 26, 0, 0, 0]]
    inputs = aligned.model_inputs()
    assert inputs["attention_mask"].tolist() == [[1] * 7] * 3
    assert inputs["position_ids"].tolist() == [list(range(7))] * 3  # the pads' positions count on
    # row 0's prompt started at column 2 (2 tokens): its first response token is now at column 2, scored at 1
    assert aligned.first_predictor.tolist() == [1, 10, 16]
    assert aligned.response_tokens().tolist() == [21, 22, 23, 24, 25, 26]
    assert aligned.response_states(torch.arange(21).view(3, 7)).tolist() == [1, 2, 10, 11, 12, 16]
    assert aligned.scatter(torch.arange(6.0)).tolist() == [[0, 1, 0], [2, 3, 4], [5, 0, 0]]


def test_a_layout_gathers_and_scatters_by_positions_computed_when_it_is_made():
    batch = hand_batch()
    layout = SequenceLayout.build(*(batch[k] for k in MODEL_INPUTS), 3, packed=True)
    # the outputs that score the six response tokens, the tokens themselves, and their places in the 3 x 3 rows
    assert layout.response_positions.tolist() == [1, 2, 7, 8, 9, 13]
    assert layout.token_positions.tolist() == [2, 3, 8, 9, 10, 14]
    assert layout.scatter_positions.tolist() == [0, 1, 3, 4, 5, 6]
    aligned = SequenceLayout.build(*(batch[k] for k in MODEL_INPUTS), 3, packed=False)
    assert aligned.response_positions.tolist() == [1, 2, 10, 11, 12, 16]
    assert aligned.attention_mask is None  # its rows need none; model_inputs makes the all-ones one
    for made in (layout, aligned):
        moved = made.to("cpu")
        assert moved.packed == made.packed
        for name in ("input_ids", "first_predictor", "response_mask", "response_positions", "token_positions",
                     "scatter_positions"):
            assert torch.equal(getattr(moved, name), getattr(made, name)), name
        for name, value in made.model_inputs().items():
            assert value == moved.model_inputs()[name] if isinstance(value, int) else torch.equal(
                moved.model_inputs()[name], value), name
    # gradients flow back through the gather and the scatter to the scored positions only
    states = torch.zeros(1, 15, 2, requires_grad=True)
    layout.scatter(layout.response_states(states)[:, 0]).sum().backward()
    assert states.grad[0, :, 0].nonzero().squeeze(1).tolist() == [1, 2, 7, 8, 9, 13]
    assert float(states.grad[0, :, 1].abs().sum()) == 0.0


def test_archers_mask_function_answers_an_all_ones_mask_without_reading_it_and_is_sdpas_otherwise(monkeypatch):
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    ones = all_ones_mask(torch.zeros(2, 6, dtype=torch.long))
    assert ones.dtype == torch.bool and bool(ones.all())
    causal = {"batch_size": 2, "q_length": 6, "kv_length": 6, "attention_mask": ones}
    assert sdpa_mask(**causal) is None  # causal: SDPA's is_causal, no mask (after reading the mask)
    with monkeypatch.context() as patched:  # archer's answers the same without SDPA's function
        patched.setattr(packed_attention_module, "sdpa_mask", lambda **_: pytest.fail("read the mask"))
        assert archer_mask(**causal) is None
    # a sliding window over an all-ones mask, of an architecture whose windows packed_attention applies: no mask
    # either (the attention applies the layer's window); of another (a chunked layer's, say), or with a padded row,
    # or keys the queries do not line up with, a mask: SDPA's own answer, unchanged
    from transformers import Gemma2Config, MistralConfig

    window = {**causal, "mask_function": sliding_window_causal_mask_function(2), "local_size": 2,
              "config": MistralConfig(sliding_window=2)}
    assert sdpa_mask(**window) is not None and archer_mask(**window) is None
    for other in (None, Gemma2Config(sliding_window=2)):
        torch.testing.assert_close(archer_mask(**{**window, "config": other}), sdpa_mask(**window))
    holed = torch.ones(2, 6, dtype=torch.bool)
    holed[0, :3] = False
    torch.testing.assert_close(archer_mask(**{**window, "attention_mask": holed}),
                               sdpa_mask(**{**window, "attention_mask": holed}))
    longer = {**causal, "kv_length": 8, "attention_mask": all_ones_mask(torch.zeros(2, 8))}
    torch.testing.assert_close(archer_mask(**longer), sdpa_mask(**longer))
    # an ordinary mask with a padded row is read as before
    padded = torch.ones(2, 6, dtype=torch.bool)
    padded[1, :2] = False
    torch.testing.assert_close(archer_mask(**{**causal, "attention_mask": padded}),
                               sdpa_mask(**{**causal, "attention_mask": padded}))


def test_rows_of_several_examples_pack_into_one_sequence_of_examples_with_their_bounds():
    # row 0: examples of 3 and 2 tokens, then padding; row 1: one of 4 tokens, then padding (positions restart)
    ids = torch.tensor([[11, 12, 13, 21, 22, PAD], [31, 32, 33, 34, PAD, PAD]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    rows = PackedRows.of_examples(ids, mask, positions)
    assert rows.input_ids.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert rows.cu_seq_lens.tolist() == [0, 3, 5, 9] and rows.cu_seq_lens.dtype == torch.int32
    assert rows.max_length == 4
    # a row that starts inside an example (positions not from 0) still begins a sequence of its own
    cut = PackedRows.of_examples(ids, mask, torch.tensor([[5, 6, 7, 0, 1, 0], [0, 1, 2, 3, 0, 1]]))
    assert cut.cu_seq_lens.tolist() == [0, 3, 5, 9]


def test_scored_rows_by_hand():
    from archer.data.sft_dataset import collate_sft, pack_sft

    items = [{"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(learn)}
             for ids, learn in (([11, 12, 13, 14], [0, 0, 1, 1]), ([21, 22], [0, 1]), ([31, 32, 33], [0, 1, 0]))]
    padded = collate_sft(items, pad_token_id=0)
    padded.tensors["input_ids"] = torch.cat([padded["input_ids"], torch.zeros(3, 2, dtype=torch.long)], dim=1)
    for name in ("attention_mask", "position_ids", "loss_mask"):  # two columns of padding beyond the longest row
        padded.tensors[name] = torch.cat([padded[name], torch.zeros(3, 2, dtype=torch.long)], dim=1)
    inputs = [padded[k] for k in ("input_ids", "attention_mask", "position_ids", "loss_mask")]
    rows = ScoredRows.build(*inputs, packed=False)
    # right-padded rows from column 0, cut to 4 columns: no mask (all ones), positions counting on over the padding
    assert rows.aligned and rows.input_ids.tolist() == [[11, 12, 13, 14], [21, 22, 0, 0], [31, 32, 33, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3]] * 3
    assert rows.model_inputs()["attention_mask"].all()
    # output c of the flat 3 x 4 input scores token c + 1: 13 and 14 (outputs 1, 2), 22 (4), 32 (8)
    assert rows.predictors.tolist() == [1, 2, 4, 8] and rows.targets.tolist() == [13, 14, 22, 32]
    assert rows.scored_states(torch.arange(12).view(3, 4)).tolist() == [1, 2, 4, 8]
    # row 2 left-padded by two: its tokens reach column 4, beyond the longest row's 4 tokens, and keep their mask
    left = [t.clone() for t in inputs]
    left[0][2], left[1][2] = torch.tensor([0, 0, 31, 32, 33, 0]), torch.tensor([0, 0, 1, 1, 1, 0])
    left[2][2], left[3][2] = torch.tensor([0, 0, 0, 1, 2, 0]), torch.tensor([0, 0, 0, 1, 1, 0])
    kept = ScoredRows.build(*left, packed=False)
    assert not kept.aligned and kept.model_inputs()["attention_mask"].tolist()[2] == [0, 0, 1, 1, 1]
    assert kept.position_ids.tolist()[2] == [0, 0, 0, 1, 2]
    assert kept.predictors.tolist() == [1, 2, 5, 12, 13] and kept.targets.tolist() == [13, 14, 22, 32, 33]
    packed = pack_sft(items, 0, capacity=16)  # one row: 11 12 13 14 | 31 32 33 | 21 22
    inputs = [packed[k] for k in ("input_ids", "attention_mask", "position_ids", "loss_mask")]
    rows = ScoredRows.build(*inputs, packed=True)
    assert rows.packing.cu_seq_lens.tolist() == [0, 4, 7, 9]
    # an example's first token is never scored (the output before it belongs to another example)
    assert rows.predictors.tolist() == [1, 2, 4, 7] and rows.targets.tolist() == [13, 14, 32, 22]
    plain = ScoredRows.build(*inputs, packed=True, examples=False)  # a model that does not run archer's attention
    assert plain.packing is None and plain.model_inputs()["attention_mask"] is None
    assert plain.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]] and plain.predictors.tolist() == [1, 2, 4, 7]


def test_a_model_with_sliding_window_layers_packs_and_its_packed_sft_rows_keep_their_window(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from archer.data.sft_dataset import collate_sft, pack_sft
    from archer.models.logprobs import masked_logprobs

    common = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1}
    windowed = Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert windowed_layers(windowed) and not windowed_layers(Qwen2Config(**common))
    assert not windowed_layers(Qwen2Config(**common, sliding_window=4))  # Qwen2.5's configs: window off
    torch.manual_seed(0)
    Qwen2ForCausalLM(windowed).save_pretrained(tmp_path / "windowed")
    model = load_causal_lm(tmp_path / "windowed", device="cpu", dtype=torch.float32)
    assert supports_packing(model)  # packed_attention applies each layer's window (models/packed_attention.py)
    gen = torch.Generator().manual_seed(1)
    items = [{"input_ids": torch.randint(3, 64, (n,), generator=gen), "loss_mask": (torch.arange(n) >= 2).long()}
             for n in (12, 6, 5)]  # longer than the window
    packed = pack_sft(items, 0, capacity=32)
    with torch.no_grad():
        got = masked_logprobs(model, *(packed[k] for k in ("input_ids", "attention_mask", "position_ids",
                                                            "loss_mask")), packed=True)
        rows = collate_sft(items, 0)
        want = masked_logprobs(model, *(rows[k] for k in ("input_ids", "attention_mask", "position_ids",
                                                           "loss_mask")))
    torch.testing.assert_close(got.sort().values, want.sort().values, atol=1e-5, rtol=0)


def test_a_row_that_is_not_one_run_of_tokens_is_refused():
    batch = hand_batch()
    holed = batch["attention_mask"].clone()
    holed[1, 5] = 0  # a hole inside the response of row 1
    with pytest.raises(ValueError, match="one run of tokens"):
        SequenceLayout.build(batch["input_ids"], holed, batch["position_ids"], 3, packed=True)
    padded = SequenceLayout.build(batch["input_ids"], holed, batch["position_ids"], 3, packed=False)
    assert padded.model_inputs()["attention_mask"] is holed  # padded rows keep their columns and mask
    assert padded.first_predictor.tolist() == [3, 10, 17]
    no_prompt = batch["attention_mask"].clone()
    no_prompt[0, :4] = 0
    with pytest.raises(ValueError, match="start with a prompt token"):
        SequenceLayout.build(batch["input_ids"], no_prompt, batch["position_ids"], 3, packed=True)


def test_packed_attention_keeps_sequences_apart_and_equals_sdpa_per_sequence():
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 9, 3]
    query = torch.randn(1, 4, 13, 8, generator=gen)
    key, value = torch.randn(1, 2, 13, 8, generator=gen), torch.randn(1, 2, 13, 8, generator=gen)
    cu = torch.tensor([0, 1, 10, 13], dtype=torch.int32)
    out, _ = packed_attention(None, query, key, value, None, scaling=8 ** -0.5, cu_seq_lens_q=cu, max_length_q=9)
    assert out.shape == (1, 13, 4, 8)
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        want = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, part], key[:, :, part].repeat_interleave(2, 1), value[:, :, part].repeat_interleave(2, 1),
            is_causal=True)
        torch.testing.assert_close(out[:, part], want.transpose(1, 2), atol=1e-6, rtol=0)
        start += length
    # a change in one sequence's keys leaves the others' outputs as they were
    changed = key.clone()
    changed[:, :, 1:10] += 1.0
    again, _ = packed_attention(None, query, changed, value, None, scaling=8 ** -0.5, cu_seq_lens_q=cu,
                                max_length_q=9)
    assert torch.equal(again[:, :1], out[:, :1]) and torch.equal(again[:, 10:], out[:, 10:])
    assert not torch.allclose(again[:, 1:10], out[:, 1:10])


def test_packed_attention_under_autocast_runs_in_its_dtype(monkeypatch):
    # rope leaves float32 queries and keys beside bf16 values under autocast; SDPA's autocast casts them all, and so
    # does packed attention before it picks a kernel: torch's flash varlen kernel takes bf16/fp16 only (on a GPU)
    asked = []
    monkeypatch.setattr(packed_attention_module, "uses_flash_varlen", lambda q, s: asked.append(q.dtype) or False)
    query, key, value = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8).bfloat16()
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = packed_attention(None, query, key, value, None, cu_seq_lens_q=cu, max_length_q=3)
    assert asked == [torch.bfloat16] and out.dtype == torch.bfloat16 and out.shape == (1, 5, 2, 8)
    packed_attention(None, query, key, value.float(), None, cu_seq_lens_q=cu, max_length_q=3)
    assert asked[-1] == torch.float32  # no autocast: float32 stays (SDPA per sequence)


def test_models_load_with_packed_attention(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, device="cpu")
    assert supports_packing(model) and model.config._attn_implementation == PACKED_ATTENTION


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_log_probs_entropies_and_gradients_equal_the_padded_ones(tiny_model_dir, checkpointing):
    model = load_causal_lm(tiny_model_dir, device="cpu", gradient_checkpointing=checkpointing).train()
    batch = unequal_batch(model.config.vocab_size)  # sequences of 6, 7, 6, 6, 6 and 10 tokens
    rows = (*(batch[k] for k in MODEL_INPUTS), 5)
    weights = torch.randn(6, 5, generator=torch.Generator().manual_seed(4))
    results = []
    for layout in ({"packed": False, "aligned": False}, {"packed": False}, {"packed": True}):
        model.zero_grad(set_to_none=True)
        logp, entropy = layout_logprobs(model, SequenceLayout.build(*rows, **layout), temperature=0.8)
        ((logp * weights).sum() + 0.3 * entropy.sum()).backward()
        results.append((logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logp, entropy, grads), *others = results  # the masked rows as they came, against left-aligned and packed
    assert torch.all(logp[rows[1][:, 6:] == 0] == 0) and torch.all(logp[rows[1][:, 6:] == 1] < 0)
    for other_logp, other_entropy, other_grads in others:
        torch.testing.assert_close(other_logp, logp, atol=1e-5, rtol=0)
        torch.testing.assert_close(other_entropy, entropy, atol=1e-5, rtol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(other_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_values_equal_the_padded_ones(tiny_model_dir):
    critic = load_value_model(tiny_model_dir, device="cpu")
    batch = unequal_batch(critic.config.vocab_size)
    rows = tuple(batch[k] for k in MODEL_INPUTS)
    masked = SequenceLayout.build(*rows, 5, packed=False, aligned=False)
    with torch.no_grad():
        want = masked.response_states(value_forward(critic, **masked.model_inputs()))
        for layout in (SequenceLayout.build(*rows, 5, packed=False), SequenceLayout.build(*rows, 5, packed=True)):
            got = layout.response_states(value_forward(critic, **layout.model_inputs()))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_packed_rows_of_the_reward_model_shape():
    ids = torch.tensor([[5, 6, PAD], [7, PAD, PAD]])
    rows = PackedRows.of(ids, (ids != PAD).long(), torch.arange(3).expand(2, 3))
    assert rows.input_ids.tolist() == [[5, 6, 7]] and rows.position_ids.tolist() == [[0, 1, 0]]
    assert rows.cu_seq_lens.tolist() == [0, 2, 3] and rows.max_length == 2
