"""Tests of archer.rewards.reward_stage: decoding, scoring in order, token placement and errors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from archer.batch import Batch
from archer.errors import ArcherError
from archer.models.loading import load_tokenizer
from archer.rewards.extras import REWARD_EXTRAS, numeric_columns
from archer.rewards.reward_stage import RewardManager
from archer.rewards.shaping import OverlongBuffer

CHARS = list("0123456789+-*/()=. {}\\<>abcdefghijklmnopqrstuvwxyz\"'[],_")
PAD, EOS = "<pad>", "<eos>"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, *CHARS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS)


def encode(
    tok: PreTrainedTokenizerFast, texts: Sequence[str], width: int, eos: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded one-token-per-character ids (an EOS after each text) and their mask."""
    ids = torch.full((len(texts), width), tok.pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(texts), width), dtype=torch.int64)
    for i, text in enumerate(texts):
        row = tok.convert_tokens_to_ids(list(text)) + ([tok.eos_token_id] if eos else [])
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def make_batch(
    tok: PreTrainedTokenizerFast,
    texts: Sequence[str],
    sources: Sequence[str],
    gts: Sequence[object],
    width: int = 48,
    **rows: Sequence[object],
) -> Batch:
    responses, mask = encode(tok, texts, width)
    return Batch(
        {"responses": responses, "response_mask": mask, "attention_mask": mask},
        {
            "data_source": list(sources),
            "ground_truth": list(gts),
            "extra_info": [{"index": i} for i in range(len(texts))],
            **{k: list(v) for k, v in rows.items()},
        },
    )


def test_scores_land_on_the_last_valid_token(tokenizer: PreTrainedTokenizerFast) -> None:
    texts = ["\\boxed{64}", "\\boxed{65}", "<answer>(3+5)*2</answer>", "<answer>3+5+2</answer>"]
    cd = '{"target": 16, "numbers": [3, 5, 2]}'
    batch = make_batch(
        tokenizer, texts, ["archer/arithmetic"] * 2 + ["archer/countdown"] * 2, ["64", "64", cd, cd]
    )
    out = RewardManager(tokenizer)(batch)

    assert out.response_text == texts  # EOS and padding are not decoded
    np.testing.assert_array_equal(out.scores, [1.0, 0.0, 1.0, 0.1])
    np.testing.assert_array_equal(out.acc, [1.0, 0.0, 1.0, 0.0])  # countdown's format credit is not accuracy
    assert out.token_level_scores.dtype == torch.float32 and out.token_level_scores.shape == (4, 48)
    expected = torch.zeros(4, 48)
    for i, text in enumerate(texts):
        expected[i, len(text)] = float(out.scores[i])  # the EOS is the last valid token
    torch.testing.assert_close(out.token_level_scores, expected)


def test_qa_f1_is_an_extra_of_its_row(tokenizer: PreTrainedTokenizerFast) -> None:
    qa = "<think>t</think><answer>\\boxed{paris city}</answer>"
    batch = make_batch(
        tokenizer,
        [qa, "<answer>\\boxed{3}</answer>"],
        ["DR_grpo_mix"] * 2,
        ["city of paris", "3"],
        width=64,
        ability=["qa", "math"],
    )
    out = RewardManager(tokenizer)(batch)
    # "paris city" vs "city of paris": 2 common tokens, p = 1, r = 2/3 -> f1 = 0.8
    np.testing.assert_allclose(out.scores, [0.8, 1.0])
    np.testing.assert_array_equal(out.acc, [0.0, 1.0])
    assert out.extras.tolist() == [{"f1": pytest.approx(0.8), "format": 1.0, "both_tools": 0.0}, {}]  # math: a number


def test_custom_function_scores_every_row(tokenizer: PreTrainedTokenizerFast) -> None:
    calls: list[tuple[object, ...]] = []

    def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> object:
        calls.append((data_source, solution_str, ground_truth, extra_info["index"]))
        return {"score": -0.5, "acc": 1.0, "tag": data_source} if data_source == "b" else len(solution_str)

    batch = make_batch(tokenizer, ["abc", "de"], ["unknown/source", "b"], ["x", "y"])
    out = RewardManager(tokenizer, compute_score=compute_score)(batch)
    assert calls == [("unknown/source", "abc", "x", 0), ("b", "de", "y", 1)]
    np.testing.assert_array_equal(out.scores, [3.0, -0.5])
    np.testing.assert_array_equal(out.acc, [1.0, 1.0])  # row 0: 3 > 0; row 1: the dict's acc
    assert out.extras.tolist() == [{}, {"tag": "b"}]
    assert out.token_level_scores[0, 3] == 3.0 and out.token_level_scores[1, 2] == -0.5


def test_every_extra_reaches_the_batch_and_survives_concat(tokenizer: PreTrainedTokenizerFast) -> None:
    def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> object:
        if data_source == "plain":
            return 0.5
        return {"score": 1.0, "acc": True, "f1": 0.25 * len(solution_str), "format_ok": solution_str[0] == "a",
                "count": np.int64(3), "note": f"len {len(solution_str)}"}

    manager = RewardManager(tokenizer, compute_score=compute_score)
    batch = make_batch(tokenizer, ["abc", "de", "a"], ["rich", "rich", "plain"], ["x"] * 3)
    out = manager(batch)
    assert out.extras.tolist() == [{"f1": 0.75, "format_ok": True, "count": 3, "note": "len 3"},
                                   {"f1": 0.5, "format_ok": False, "count": 3, "note": "len 2"}, {}]
    assert out.add_to(batch) is batch
    torch.testing.assert_close(batch["token_level_scores"], out.token_level_scores)
    assert batch["score"].tolist() == [1.0, 1.0, 0.5] and batch["acc"].tolist() == [1.0, 1.0, 1.0]
    assert batch["response_text"].tolist() == ["abc", "de", "a"]
    assert batch[REWARD_EXTRAS] is out.extras and "overlong_penalty" not in batch
    # another generation batch whose scorer returns other keys: rows keep their own extras through concat
    other = make_batch(tokenizer, ["xyz"], ["b"], ["y"])
    RewardManager(tokenizer, compute_score=lambda **kw: {"score": 0.0, "steps": 4})(other).add_to(other)
    merged = Batch.concat([batch.select(["score", REWARD_EXTRAS]), other.select(["score", REWARD_EXTRAS])])
    columns = numeric_columns(merged[REWARD_EXTRAS])
    assert list(columns) == ["count", "f1", "format_ok", "steps"]  # "note" is text: dumps only
    np.testing.assert_array_equal(columns["count"], [3.0, 3.0, np.nan, np.nan])
    np.testing.assert_array_equal(columns["f1"], [0.75, 0.5, np.nan, np.nan])
    np.testing.assert_array_equal(columns["format_ok"], [1.0, 0.0, np.nan, np.nan])
    np.testing.assert_array_equal(columns["steps"], [np.nan, np.nan, np.nan, 4.0])


@pytest.mark.parametrize("returned, shown", [
    (math.nan, "score nan"), (math.inf, "score inf"), ({"score": -math.inf, "f1": 1.0}, "score -inf"),
    ({"score": 1.0, "acc": math.nan}, "acc nan"), (np.float32("nan"), "score nan"),
])
def test_a_non_finite_reward_stops_naming_the_first_row_and_its_data_source(
        tokenizer: PreTrainedTokenizerFast, returned: object, shown: str) -> None:
    def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> object:
        return returned if data_source == "ds1" else 1.0

    batch = make_batch(tokenizer, ["ok", "abc", "xyz"], ["ds0", "ds1", "ds1"], ["x"] * 3)
    with pytest.raises(ArcherError) as err:
        RewardManager(tokenizer, compute_score=compute_score)(batch)
    assert err.value.problem.startswith(f"the reward function returned {shown} for row 1 (data_source 'ds1', "
                                        "response 'abc'): a non-finite reward makes every update a no-op")
    assert "return a finite number for every response" in err.value.fix


def test_reward_fn_key_and_empty_rows(tokenizer: PreTrainedTokenizerFast) -> None:
    responses, mask = encode(tokenizer, ["\\boxed{7}", ""], 16, eos=False)
    batch = Batch(
        {"responses": responses, "response_mask": mask, "attention_mask": mask},
        {"source": ["openai/gsm8k", "openai/gsm8k"], "ground_truth": ["7", "7"]},
    )
    out = RewardManager(tokenizer, reward_fn_key="source")(batch)
    np.testing.assert_array_equal(out.scores, [1.0, 0.0])
    assert out.token_level_scores[0, 8] == 1.0 and out.token_level_scores.sum() == 1.0
    assert out.response_text == ["\\boxed{7}", ""]


def test_scorer_exception_names_row_source_and_cause(tokenizer: PreTrainedTokenizerFast) -> None:
    def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
        if ground_truth == "bad":
            raise KeyError("missing field")
        return 1.0

    batch = make_batch(tokenizer, ["a", "b"], ["ds0", "ds1"], ["ok", "bad"])
    with pytest.raises(ArcherError, match=r"row 1 \(data_source 'ds1'\): KeyError: 'missing field'") as err:
        RewardManager(tokenizer, compute_score=compute_score)(batch)
    assert "custom_reward_function.path" in str(err.value)


def test_bad_return_value_and_missing_fields(tokenizer: PreTrainedTokenizerFast) -> None:
    batch = make_batch(tokenizer, ["a"], ["ds"], ["x"])
    with pytest.raises(ArcherError, match="returned 'high'"):
        RewardManager(tokenizer, compute_score=lambda **kw: "high")(batch)
    for result in ({"score": "0.5"}, {"score": None}, {"score": 1.0, "acc": "yes"}):
        with pytest.raises(ArcherError, match=r"returned .* for row 0 \(data_source 'ds', response 'a'\); its "
                                              r"(score|acc) must be a number"):
            RewardManager(tokenizer, compute_score=lambda r=result, **kw: r)(batch)
    with pytest.raises(ArcherError, match="no built-in reward for data_source 'ds'"):
        RewardManager(tokenizer)(batch)
    batch.pop(["ground_truth"])
    with pytest.raises(ArcherError, match=r"needs batch field\(s\) \['ground_truth'\]"):
        RewardManager(tokenizer)(batch)


# -- shaping: the overlong buffer and the wrong-answer score (with the micro model's BPE tokenizer) --------------
def bpe_batch(tok: PreTrainedTokenizerFast, rows: Sequence[list[int]], sources: Sequence[str], gts: Sequence[str], width: int) -> Batch:
    """Right-padded responses from token id lists (each ends with EOS) and the rows the manager reads."""
    responses = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, ids in enumerate(rows):
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    return Batch({"responses": responses, "response_mask": mask, "attention_mask": mask},
                 {"data_source": list(sources), "ground_truth": list(gts)})


def bpe_ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_overlong_penalty_is_added_to_scores_and_the_last_token(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    a = tok("a", add_special_tokens=False)["input_ids"]
    assert len(a) == 1
    lengths = [10, 16, 18, 20]  # EOS included; L_max 20, L_buf 5: the penalty starts after 15 tokens
    rows = [a * (n - 1) + [tok.eos_token_id] for n in lengths]
    batch = bpe_batch(tok, rows, ["right", "half", "right", "half"], ["x"] * 4, width=24)

    def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: object) -> object:
        return {"score": 1.0, "acc": 1.0} if data_source == "right" else {"score": 0.5, "acc": 0.0}

    out = RewardManager(tok, compute_score=compute_score, overlong=OverlongBuffer(20, 5, 1.0))(batch)
    assert out.response_text == ["a" * (n - 1) for n in lengths]
    np.testing.assert_allclose(out.overlong_penalty, [0.0, -0.2, -0.6, -1.0], atol=1e-12)
    np.testing.assert_allclose(out.scores, [1.0, 0.3, 0.4, -0.5], atol=1e-12)
    np.testing.assert_array_equal(out.acc, [1.0, 0.0, 1.0, 0.0])  # the unshaped accuracy
    expected = torch.zeros(4, 24)
    expected[torch.arange(4), torch.tensor(lengths) - 1] = torch.tensor([1.0, 0.3, 0.4, -0.5])
    torch.testing.assert_close(out.token_level_scores, expected)


def test_wrong_answer_score_applies_to_built_in_rule_rewards(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    texts = ["\\boxed{64}", "\\boxed{65}", "<answer>3+5+2</answer>"]
    cd = '{"target": 16, "numbers": [3, 5, 2]}'
    rows = [bpe_ids(tok, t) for t in texts]
    batch = bpe_batch(tok, rows, ["archer/arithmetic"] * 2 + ["archer/countdown"], ["64", "64", cd], width=32)
    out = RewardManager(tok, wrong_answer_score=-1.0)(batch)
    assert out.response_text == texts
    # right: 1; wrong: 0 -> -1; countdown's format credit 0.1 (acc 0) is not a score of 0, so it stays
    np.testing.assert_allclose(out.scores, [1.0, -1.0, 0.1])
    np.testing.assert_array_equal(out.acc, [1.0, 0.0, 0.0])
    assert out.overlong_penalty is None
    last = torch.tensor([len(r) - 1 for r in rows])
    torch.testing.assert_close(out.token_level_scores[torch.arange(3), last], torch.tensor([1.0, -1.0, 0.1]))
    assert float(out.token_level_scores.abs().sum()) == pytest.approx(2.1)


def test_wrong_answer_score_leaves_a_custom_reward_alone(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    batch = bpe_batch(tok, [bpe_ids(tok, "\\boxed{65}")], ["archer/arithmetic"], ["64"], width=16)
    out = RewardManager(tok, compute_score=lambda **kw: 0.0, wrong_answer_score=-1.0)(batch)
    assert out.scores.tolist() == [0.0] and out.acc.tolist() == [0.0]
    assert float(out.token_level_scores.abs().sum()) == 0.0


def test_wrong_answer_score_then_overlong_penalty(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    rows = [bpe_ids(tok, "\\boxed{64}"), bpe_ids(tok, "\\boxed{65}")]
    assert [len(r) for r in rows] == [11, 11]  # 10 tokens and the EOS
    batch = bpe_batch(tok, rows, ["archer/arithmetic"] * 2, ["64", "64"], width=12)
    # L_max 12, L_buf 4: 11 tokens are 3 into the buffer, -3/4
    out = RewardManager(tok, overlong=OverlongBuffer(12, 4, 1.0), wrong_answer_score=-1.0)(batch)
    np.testing.assert_allclose(out.overlong_penalty, [-0.75, -0.75])
    np.testing.assert_allclose(out.scores, [0.25, -1.75])
    np.testing.assert_array_equal(out.acc, [1.0, 0.0])
    torch.testing.assert_close(out.token_level_scores[:, 10], torch.tensor([0.25, -1.75]))
