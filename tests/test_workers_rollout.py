"""Rollout worker: verl rollout keys as sampling parameters, verl's sequence layout, and generation with the HF
engine (rows repeated n times, rollout log-probs equal to the actor's)."""

from __future__ import annotations

import torch
from workers_support import ppo_config

from archer.batch import Batch
from archer.models.loading import load_tokenizer
from archer.rollout.base import SamplingParams
from archer.rollout.hf_engine import HFGenerateEngine
from archer.workers.actor import ActorWorker
from archer.workers.rollout import RolloutWorker, concat_sequences, layout_sequences, sampling_params

CPU = torch.device("cpu")
ROLLOUT = "actor_rollout_ref.rollout"


# -- sampling_params -------------------------------------------------------------------------------------------
def test_sampling_params_map_the_verl_rollout_keys(tiny_model_dir):
    cfg = ppo_config(tiny_model_dir, f"{ROLLOUT}.n=4", f"{ROLLOUT}.temperature=0.8", f"{ROLLOUT}.top_p=0.9",
                     f"{ROLLOUT}.top_k=5", "data.max_response_length=7", f'{ROLLOUT}.stop=["</answer>","a b"]')
    params = sampling_params(cfg.actor_rollout_ref.rollout, validate=False, seed=11)
    assert params == SamplingParams(n=4, temperature=0.8, top_p=0.9, top_k=5, max_new_tokens=7,
                                    stop=("</answer>", "a b"), do_sample=True, seed=11)
    assert not params.greedy

    # validation reads val_kwargs (defaults: greedy, one sample), but length and stops from the rollout block
    val = sampling_params(cfg.actor_rollout_ref.rollout, validate=True, seed=5)
    assert val == SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=7,
                                 stop=("</answer>", "a b"), do_sample=False, seed=5)
    assert val.greedy


def test_sampling_params_val_kwargs_overrides(tiny_model_dir):
    cfg = ppo_config(tiny_model_dir, f"{ROLLOUT}.n=4", f"{ROLLOUT}.temperature=0.8", f"{ROLLOUT}.val_kwargs.n=3",
                     f"{ROLLOUT}.val_kwargs.temperature=2", f"{ROLLOUT}.val_kwargs.do_sample=true",
                     f"{ROLLOUT}.val_kwargs.top_p=0.95", f"{ROLLOUT}.val_kwargs.top_k=7")
    val = sampling_params(cfg.actor_rollout_ref.rollout, validate=True, seed=0)
    assert (val.n, val.temperature, val.top_p, val.top_k, val.do_sample) == (3, 2.0, 0.95, 7, True)
    assert val.max_new_tokens == 512 and val.stop == () and not val.greedy
    train = sampling_params(cfg.actor_rollout_ref.rollout, validate=False, seed=0)
    assert (train.n, train.temperature, train.top_p, train.top_k) == (4, 0.8, 1.0, -1)


def test_val_kwargs_temperature_takes_a_float(tiny_model_dir):
    # verl scripts pass e.g. val_kwargs.temperature=0.6 (sampled validation, as in DAPO's recipes)
    cfg = ppo_config(tiny_model_dir, f"{ROLLOUT}.val_kwargs.temperature=0.6", f"{ROLLOUT}.val_kwargs.do_sample=true")
    val = sampling_params(cfg.actor_rollout_ref.rollout, validate=True, seed=0)
    assert val.temperature == 0.6 and not val.greedy


def test_temperature_zero_or_do_sample_false_is_greedy(tiny_model_dir):
    zero = ppo_config(tiny_model_dir, f"{ROLLOUT}.temperature=0").actor_rollout_ref.rollout
    params = sampling_params(zero, validate=False, seed=0)
    assert params.greedy and not params.do_sample and params.temperature == 0.0

    no_sample = ppo_config(tiny_model_dir, f"{ROLLOUT}.do_sample=false").actor_rollout_ref.rollout
    params = sampling_params(no_sample, validate=False, seed=0)
    assert params.greedy and not params.do_sample and params.temperature == 1.0


# -- layout_sequences ------------------------------------------------------------------------------------------
def test_layout_sequences_builds_verls_tensors_element_by_element():
    prompts = Batch(
        {"input_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]), "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
         "position_ids": torch.tensor([[0, 0, 1], [0, 1, 2]])},
        {"uid": ["a", "b"], "data_source": ["x", "y"]},
    )
    responses = torch.tensor([[10, 11, 0], [12, 0, 0], [13, 14, 15], [16, 17, 0]])
    response_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    out = layout_sequences(prompts, responses, response_mask, n=2)

    assert sorted(out.tensors) == ["attention_mask", "input_ids", "position_ids", "prompts", "response_mask",
                                   "responses"]
    assert out["uid"].tolist() == ["a", "a", "b", "b"]
    assert out["data_source"].tolist() == ["x", "x", "y", "y"]
    assert out["prompts"].tolist() == [[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]]
    assert out["responses"].tolist() == responses.tolist()
    assert out["response_mask"].tolist() == response_mask.tolist()
    assert out["input_ids"].tolist() == [[0, 5, 6, 10, 11, 0], [0, 5, 6, 12, 0, 0],
                                         [7, 8, 9, 13, 14, 15], [7, 8, 9, 16, 17, 0]]
    assert out["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0],
                                              [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]
    # cumsum(attention_mask) - 1, clamped at 0
    assert out["position_ids"].tolist() == [[0, 0, 1, 2, 3, 3], [0, 0, 1, 2, 2, 2],
                                            [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 4]]
    assert all(out[k].dtype == torch.long for k in out.tensors)
    assert sorted(prompts.tensors) == ["attention_mask", "input_ids", "position_ids"]  # the input is untouched


# -- generate_sequences ----------------------------------------------------------------------------------------
def test_generate_sequences_repeats_rows_and_matches_the_actor_log_probs(tiny_model_dir):
    cfg = ppo_config(tiny_model_dir, f"{ROLLOUT}.n=2", f"{ROLLOUT}.temperature=0.8", "data.max_response_length=6")
    actor = ActorWorker(cfg.actor_rollout_ref, device=CPU, total_steps=10)
    tokenizer = load_tokenizer(tiny_model_dir)
    worker = RolloutWorker(HFGenerateEngine(actor.model, tokenizer), cfg.actor_rollout_ref.rollout, device=CPU)
    ids = [tokenizer("what is 3 + 5?")["input_ids"], tokenizer("hi")["input_ids"]]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    prompts = Batch(
        {"input_ids": torch.tensor([[pad] * (width - len(p)) + p for p in ids]), "attention_mask": prompt_mask,
         "position_ids": (prompt_mask.cumsum(1) - 1).clamp(min=0)},
        {"uid": ["u0", "u1"], "data_source": ["math", "chat"]},
    )
    params = sampling_params(cfg.actor_rollout_ref.rollout, validate=False, seed=3)
    out = worker.generate_sequences(prompts, params)

    assert len(out) == 4
    assert out["uid"].tolist() == ["u0", "u0", "u1", "u1"]
    assert out["data_source"].tolist() == ["math", "math", "chat", "chat"]
    assert torch.equal(out["prompts"], prompts["input_ids"][[0, 0, 1, 1]])
    lengths = out["response_mask"].sum(1).tolist()
    response_length = out["responses"].shape[1]
    assert response_length == max(lengths) <= 6
    for row, length in enumerate(lengths):
        assert out["response_mask"][row].tolist() == [1] * length + [0] * (response_length - length)
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], dim=1))
    assert torch.equal(out["attention_mask"], torch.cat([prompt_mask[[0, 0, 1, 1]], out["response_mask"]], dim=1))
    assert len(out["finish_reason"]) == 4 and set(out["finish_reason"]) <= {"eos", "stop", "length"}

    scored = actor.compute_log_prob(out)
    torch.testing.assert_close(out["rollout_log_probs"], scored["old_log_probs"], atol=1e-4, rtol=0)
    torch.testing.assert_close(out["rollout_entropies"], scored["entropies"], atol=1e-4, rtol=0)
    valid = out["response_mask"].bool()
    assert torch.all(out["rollout_log_probs"][~valid] == 0) and torch.all(out["rollout_log_probs"][valid] < 0)


# -- concat_sequences ------------------------------------------------------------------------------------------
PAD_ID = 99


def generated(prompts: list[list[int]], prompt_mask: list[list[int]], responses: list[list[int]],
              response_mask: list[list[int]], log_probs: list[list[float]], uid: str) -> Batch:
    """A generated batch as layout_sequences lays it out, plus rollout log-probs and a per-row field."""
    batch = layout_sequences(
        Batch({"input_ids": torch.tensor(prompts), "attention_mask": torch.tensor(prompt_mask)},
              {"uid": [uid] * len(prompts)}),
        torch.tensor(responses), torch.tensor(response_mask), n=1)
    batch["rollout_log_probs"] = torch.tensor(log_probs)
    batch["score"] = torch.tensor([0.5] * len(prompts))  # one value a row: not response-aligned
    return batch


def test_concat_sequences_repads_prompts_left_and_responses_right():
    # a: prompts 2 wide, responses 3 wide; b: prompts 3 wide, responses 2 wide
    a = generated([[PAD_ID, 5], [6, 7]], [[0, 1], [1, 1]], [[10, 11, 12], [13, PAD_ID, PAD_ID]],
                  [[1, 1, 1], [1, 0, 0]], [[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0]], "a")
    b = generated([[PAD_ID, PAD_ID, 8], [9, 20, 21]], [[0, 0, 1], [1, 1, 1]], [[30, 31], [32, PAD_ID]],
                  [[1, 1], [1, 0]], [[-0.5, -0.6], [-0.7, 0.0]], "b")
    a_prompts = a["prompts"].clone()
    out = concat_sequences([a, b], PAD_ID)

    assert sorted(out.tensors) == ["attention_mask", "input_ids", "position_ids", "prompts", "response_mask",
                                   "responses", "rollout_log_probs", "score"]
    assert out["uid"].tolist() == ["a", "a", "b", "b"]
    assert out["prompts"].tolist() == [[PAD_ID, PAD_ID, 5], [PAD_ID, 6, 7], [PAD_ID, PAD_ID, 8], [9, 20, 21]]
    assert out["responses"].tolist() == [[10, 11, 12], [13, PAD_ID, PAD_ID], [30, 31, PAD_ID], [32, PAD_ID, PAD_ID]]
    assert out["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]]
    torch.testing.assert_close(out["rollout_log_probs"], torch.tensor(
        [[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0], [-0.5, -0.6, 0.0], [-0.7, 0.0, 0.0]]))
    assert out["score"].tolist() == [0.5] * 4
    assert out["input_ids"].tolist() == [[PAD_ID, PAD_ID, 5, 10, 11, 12], [PAD_ID, 6, 7, 13, PAD_ID, PAD_ID],
                                         [PAD_ID, PAD_ID, 8, 30, 31, PAD_ID], [9, 20, 21, 32, PAD_ID, PAD_ID]]
    assert out["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0],
                                              [0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]
    # cumsum(attention_mask) - 1, clamped at 0
    assert out["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3], [0, 0, 1, 2, 2, 2],
                                            [0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 3, 3]]
    assert out["input_ids"].dtype == out["attention_mask"].dtype == out["position_ids"].dtype == torch.long
    assert out["rollout_log_probs"].dtype == torch.float32
    assert torch.equal(a["prompts"], a_prompts) and a["responses"].shape == (2, 3)  # the inputs are untouched


def test_concat_sequences_of_equal_widths_is_plain_concatenation():
    a = generated([[PAD_ID, 5]], [[0, 1]], [[10, PAD_ID]], [[1, 0]], [[-0.1, 0.0]], "a")
    b = generated([[6, 7]], [[1, 1]], [[11, 12]], [[1, 1]], [[-0.2, -0.3]], "b")
    out = concat_sequences([a, b], PAD_ID)
    plain = Batch.concat([a, b])
    assert sorted(out.tensors) == sorted(plain.tensors)
    assert all(torch.equal(out[k], plain[k]) for k in plain.tensors)
    assert out["uid"].tolist() == ["a", "b"]


# -- the actor worker owns the engine -----------------------------------------------------------------------
class RecordingEngine(HFGenerateEngine):
    """The HF engine, recording what the actor worker asks of it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def generate(self, prompts, params):
        self.calls.append(f"generate n={params.n} greedy={params.greedy}")
        return super().generate(prompts, params)

    def sync_weights(self, weights) -> None:
        self.calls.append("sync")
        super().sync_weights(weights)

    def release_memory(self, weights: bool = False) -> None:
        self.calls.append("release+weights" if weights else "release")

    def reclaim_memory(self) -> None:
        self.calls.append("reclaim")


def recording_actor(model_dir, monkeypatch, *overrides: str) -> ActorWorker:
    monkeypatch.setattr("archer.workers.actor.build_engine", lambda rollout, model, tokenizer, device, **_:
                        RecordingEngine(model, tokenizer, device=device))
    cfg = ppo_config(model_dir, f"{ROLLOUT}.n=2", "data.max_response_length=4",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=2", *overrides)
    return ActorWorker(cfg.actor_rollout_ref, device=CPU, total_steps=10)


def prompt_batch(model_dir, **info) -> Batch:
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer(["what is 3 + 5?", "hi there"])["input_ids"]
    width = max(map(len, ids))
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    return Batch({"input_ids": torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in ids]),
                  "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
                 {"uid": ["u0", "u1"]}, info)


def test_the_actor_syncs_its_engine_after_an_update_and_frees_it_around_it(tiny_model_dir, monkeypatch):
    actor = recording_actor(tiny_model_dir, monkeypatch)
    engine = actor.rollout.engine
    out = actor.generate_sequences(prompt_batch(tiny_model_dir, validate=False, seed=3))
    assert len(out) == 4  # rollout.n responses per prompt
    val = actor.generate_sequences(prompt_batch(tiny_model_dir, validate=True, seed=3))
    assert len(val) == 2  # val_kwargs: one greedy response
    # free_cache_engine releases the KV cache and the weight copy, so every generation takes the weights again
    assert engine.calls == ["reclaim", "generate n=2 greedy=False", "release+weights",
                            "sync", "reclaim", "generate n=1 greedy=True", "release+weights"]
    engine.calls.clear()
    out = out.union(actor.compute_log_prob(out))
    out["advantages"] = torch.ones_like(out["old_log_probs"]) * out["response_mask"]
    actor.update_actor(out)
    actor.generate_sequences(prompt_batch(tiny_model_dir, validate=False, seed=4))
    assert engine.calls == ["sync", "reclaim", "generate n=2 greedy=False", "release+weights"]


def test_free_cache_engine_false_keeps_the_engine_memory(tiny_model_dir, monkeypatch):
    actor = recording_actor(tiny_model_dir, monkeypatch, f"{ROLLOUT}.free_cache_engine=false")
    actor.generate_sequences(prompt_batch(tiny_model_dir, validate=False, seed=3))
    actor.generate_sequences(prompt_batch(tiny_model_dir, validate=False, seed=4))
    assert actor.rollout.engine.calls == ["reclaim", "generate n=2 greedy=False",
                                          "reclaim", "generate n=2 greedy=False"]  # no update: weights kept


def test_the_hf_engine_on_the_policys_module_leaves_the_stream_unread(tiny_model_dir):
    actor = ActorWorker(ppo_config(tiny_model_dir).actor_rollout_ref, device=CPU, total_steps=1)

    def stream():
        raise AssertionError("the stream was read")
        yield

    actor.rollout.engine.sync_weights(stream())  # its own module: nothing to copy, no weight merged
