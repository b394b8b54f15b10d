"""HFGenerateEngine on the micro model: layout, seeds, greedy decoding, stops, and agreement with the
training-time log-prob pass (response_logprobs)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from archer.errors import ArcherError
from archer.models.loading import load_causal_lm, load_tokenizer
from archer.models.logprobs import response_logprobs
from archer.models.lora import policy_weights
from archer.rollout.base import RolloutOutput, SamplingParams
from archer.rollout.hf_engine import HFGenerateEngine

TEXTS = ["what is 3 + 5?", "hi", "The quick brown fox jumps"]


@pytest.fixture(scope="module")
def prompts(parts) -> list[list[int]]:
    return [parts[1](t)["input_ids"] for t in TEXTS]


@pytest.fixture
def engine(parts) -> HFGenerateEngine:
    return HFGenerateEngine(*parts)


def _full_sequences(prompts: list[list[int]], out: RolloutOutput, pad: int):
    """Left-padded prompts + responses, as the trainer builds them for the old-log-prob pass."""
    rows = [prompts[i] for i in out.prompt_index.tolist()]
    width = max(len(p) for p in rows)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    ids = torch.cat([ids, out.responses], dim=1)
    mask = torch.cat([mask, out.response_mask], dim=1)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_shapes_and_prompt_major_order(engine, prompts):
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=0))
    assert out.responses.shape == out.response_mask.shape == out.log_probs.shape == out.entropies.shape
    assert out.responses.shape == (6, 6)
    assert out.responses.dtype == out.response_mask.dtype == torch.long
    assert out.log_probs.dtype == out.entropies.dtype == torch.float32
    assert out.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert len(out.finish_reasons) == 6
    assert set(out.finish_reasons) <= {"eos", "stop", "length"}
    lengths = out.response_mask.sum(1)
    assert out.responses.shape[1] == lengths.max()
    for row, length in enumerate(lengths.tolist()):
        assert out.response_mask[row].tolist() == [1] * length + [0] * (6 - length)
        assert torch.all(out.responses[row, length:] == engine.pad_token_id)
        assert torch.all(out.entropies[row, length:] == 0) and torch.all(out.log_probs[row, length:] == 0)
    assert torch.all(out.log_probs[out.response_mask.bool()] < 0)
    assert torch.all(out.entropies[out.response_mask.bool()] > 0)

    # greedy rows of one prompt are identical and equal to generating that prompt alone
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=5)
    together = engine.generate(prompts, greedy)
    for i, prompt in enumerate(prompts):
        alone = engine.generate([prompt], SamplingParams(do_sample=False, max_new_tokens=5))
        width = alone.responses.shape[1]
        for row in (2 * i, 2 * i + 1):
            assert together.responses[row, :width].tolist() == alone.responses[0].tolist()
            torch.testing.assert_close(together.log_probs[row, :width], alone.log_probs[0], atol=1e-5, rtol=0)


def test_seed_reproduces_and_samples_differ(engine, prompts):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=7)
    first, second = engine.generate(prompts, params), engine.generate(prompts, params)
    assert torch.equal(first.responses, second.responses)
    assert torch.equal(first.log_probs, second.log_probs)
    other = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=8, seed=8))
    assert not torch.equal(first.responses, other.responses)
    for i in range(len(prompts)):
        samples = {tuple(r) for r in first.responses[4 * i : 4 * i + 4].tolist()}
        assert len(samples) == 4


def test_sampling_does_not_depend_on_sharding_padding_or_batch_size(parts, prompts):
    """Each row samples with the seed of its index in the whole batch: two data-parallel shards (each padded to
    its own longest prompt) and small batches give the rows of the whole batch in one go."""
    params = SamplingParams(n=3, temperature=1.0, top_k=50, max_new_tokens=10, seed=21)
    whole = HFGenerateEngine(*parts).generate(prompts, params)
    shards = [HFGenerateEngine(*parts, max_batch_size=2).generate(prompts[:1], params),
              HFGenerateEngine(*parts).generate(prompts[1:], replace(params, first_prompt=1))]
    width = max(s.responses.shape[1] for s in shards)
    for field in ("responses", "log_probs"):
        pieces = torch.cat([torch.nn.functional.pad(getattr(s, field), (0, width - s.responses.shape[1]))
                            for s in shards])
        expected = getattr(whole, field)[:, :width]
        torch.testing.assert_close(pieces, expected, atol=1e-5, rtol=0)
    assert [r for s in shards for r in s.finish_reasons] == whole.finish_reasons
    assert len({tuple(r) for r in whole.responses.tolist()}) == 9  # the rows sample apart


def test_greedy_is_argmax_of_full_forward(engine, parts, prompts):
    model, tokenizer = parts
    out = engine.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=7))
    ids, mask, pos = _full_sequences(prompts, out, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    size = out.responses.shape[1]
    expected = logits[:, -size - 1 : -1].argmax(-1)
    valid = out.response_mask.bool()
    assert torch.equal(out.responses[valid], expected[valid])
    zero_temperature = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=7))
    assert torch.equal(zero_temperature.responses, out.responses)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=10, seed=3),
        SamplingParams(n=1, temperature=1.3, max_new_tokens=10, seed=4),
        SamplingParams(do_sample=False, max_new_tokens=10),
    ],
)
def test_log_probs_and_entropies_match_training_pass(parts, prompts, params):
    model, tokenizer = parts
    out = HFGenerateEngine(model, tokenizer, max_batch_size=4).generate(prompts, params)
    ids, mask, pos = _full_sequences(prompts, out, tokenizer.pad_token_id)
    temperature = 1.0 if params.greedy else params.temperature
    with torch.no_grad():
        logp, entropy = response_logprobs(
            model, ids, mask, pos, out.responses.shape[1], temperature=temperature
        )
    torch.testing.assert_close(out.log_probs, logp, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.entropies, entropy, atol=1e-4, rtol=0)


def test_top_k_one_and_tiny_top_p_equal_greedy(engine, prompts):
    greedy = engine.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=6))
    top_k = engine.generate(prompts, SamplingParams(top_k=1, temperature=1.0, max_new_tokens=6, seed=1))
    top_p = engine.generate(prompts, SamplingParams(top_p=1e-6, temperature=1.0, max_new_tokens=6, seed=2))
    assert torch.equal(top_k.responses, greedy.responses)
    assert torch.equal(top_p.responses, greedy.responses)
    # same tokens, but the reported log-probs are those of the unfiltered distribution, not log(1) = 0
    torch.testing.assert_close(top_k.log_probs, greedy.log_probs, atol=1e-5, rtol=0)
    assert torch.all(top_k.log_probs[top_k.response_mask.bool()] < -0.1)


def test_stop_string_cuts_and_is_kept(engine, parts, prompts):
    tokenizer = parts[1]
    base = SamplingParams(max_new_tokens=16, seed=11)
    full = engine.generate(prompts[:1], base).responses[0].tolist()
    stop = tokenizer.decode(full[5:7])
    cut = next(j for j in range(len(full)) if stop in tokenizer.decode(full[: j + 1]))
    assert cut <= 6

    out = engine.generate(prompts[:1], SamplingParams(max_new_tokens=16, seed=11, stop=(stop, "\x00never")))
    assert out.finish_reasons == ["stop"]
    assert out.responses[0].tolist() == full[: cut + 1]
    assert stop in tokenizer.decode(out.responses[0])
    assert stop not in tokenizer.decode(out.responses[0, :-1])
    assert out.response_mask[0].sum() == cut + 1


def test_eos_stops_the_row_and_is_kept(engine, prompts, monkeypatch):
    base = SamplingParams(n=2, max_new_tokens=12, seed=5)
    full = engine.generate(prompts[:1], base)
    first = full.responses[0].tolist()
    position = next(j for j in range(3, len(first)) if first[j] not in first[:j])
    eos = first[position]
    monkeypatch.setattr(engine, "eos_token_ids", torch.tensor([eos]))

    out = engine.generate(prompts[:1], base)
    assert out.finish_reasons[0] == "eos"
    assert out.responses[0, : position + 1].tolist() == first[: position + 1]
    assert out.response_mask[0].sum() == position + 1
    # the other sample keeps going (it is "length" unless it drew the same token)
    second = full.responses[1].tolist()
    expected_second = second[: second.index(eos) + 1] if eos in second else second
    assert out.response_mask[1].sum() == len(expected_second)
    assert out.responses[1, : len(expected_second)].tolist() == expected_second


def test_eos_ids_come_from_tokenizer_and_generation_config(parts):
    model, tokenizer = parts
    model.generation_config.eos_token_id = [2, 7]
    try:
        assert HFGenerateEngine(model, tokenizer).eos_token_ids.tolist() == [2, 7]
    finally:
        model.generation_config.eos_token_id = 2


def test_small_batches_give_the_same_greedy_output(parts, prompts):
    params = SamplingParams(n=2, do_sample=False, max_new_tokens=5)
    whole = HFGenerateEngine(*parts).generate(prompts, params)
    pieces = HFGenerateEngine(*parts, max_batch_size=4).generate(prompts, params)
    assert torch.equal(whole.responses, pieces.responses)
    torch.testing.assert_close(whole.entropies, pieces.entropies, atol=1e-5, rtol=0)


def test_train_mode_is_restored(engine, parts, prompts):
    model = parts[0]
    model.train()
    try:
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=2, seed=0))
        assert model.training
    finally:
        model.eval()
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=2, seed=0))
    assert not model.training


def test_bad_input_is_refused(engine):
    with pytest.raises(ArcherError, match="prompt 1 is empty"):
        engine.generate([[5], []], SamplingParams(max_new_tokens=2))
    with pytest.raises(ArcherError, match="top_p=0"):
        SamplingParams(top_p=0)
    with pytest.raises(ArcherError, match="n=0"):
        SamplingParams(n=0)
    with pytest.raises(ArcherError, match="stop="):
        SamplingParams(stop=("",))
    assert SamplingParams(stop=["</answer>"]).stop == ("</answer>",)


def test_gradient_checkpointing_model_still_uses_the_cache(tiny_model_dir, parts, prompts):
    checkpointed = load_causal_lm(tiny_model_dir, device="cpu", gradient_checkpointing=True)
    checkpointed.train()
    params = SamplingParams(n=2, max_new_tokens=6, seed=9)
    out = HFGenerateEngine(checkpointed, parts[1]).generate(prompts, params)
    expected = HFGenerateEngine(*parts).generate(prompts, params)
    assert torch.equal(out.responses, expected.responses)
    torch.testing.assert_close(out.log_probs, expected.log_probs, atol=1e-5, rtol=0)
    assert checkpointed.training


def test_a_standalone_engine_filled_by_the_stream_generates_what_the_policy_generates(tiny_model_dir, prompts):
    """``standalone``: its own module from the policy's config (random weights until synced), filled from the
    policy's stream of named weights: then its tokens, log-probs and entropies are the policy module's own."""
    policy, tokenizer = load_causal_lm(tiny_model_dir, device="cpu"), load_tokenizer(tiny_model_dir)
    with torch.no_grad():  # weights no checkpoint holds, so only the stream can carry them
        for p in policy.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    engine = HFGenerateEngine.standalone(policy, tokenizer, device="cpu", dtype=torch.float32)
    assert engine.model is not policy
    sampled = SamplingParams(n=2, max_new_tokens=8, seed=11)
    want = HFGenerateEngine(policy, tokenizer).generate(prompts, sampled)
    assert not torch.equal(engine.generate(prompts, sampled).log_probs, want.log_probs)  # not yet synced
    engine.sync_weights(policy_weights(policy))
    for params, expected in ((sampled, want), (SamplingParams(do_sample=False, max_new_tokens=8), None)):
        expected = expected or HFGenerateEngine(policy, tokenizer).generate(prompts, params)
        got = engine.generate(prompts, params)
        for field in ("responses", "response_mask", "log_probs", "entropies"):
            assert torch.equal(getattr(got, field), getattr(expected, field)), field
    with pytest.raises(ArcherError, match="hf engine has no place for the weight 'extra'"):
        engine.sync_weights([("extra", torch.zeros(1))])
    with pytest.raises(ArcherError, match=r"hf engine's model.norm.weight is \(\d+,\), the weight given is \(3,\)"):
        engine.sync_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ArcherError, match="lack"):
        engine.sync_weights(list(policy_weights(policy))[1:])
