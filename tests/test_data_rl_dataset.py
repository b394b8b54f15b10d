"""Tests for archer.data.rl_dataset: chat templating, exact token ids, filtering vs truncation, errors."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from archer.data.parquet import read_rl_parquet
from archer.data.rl_dataset import RLDataset, truncate_ids
from archer.errors import ArcherError

VALID = Path(__file__).resolve().parents[2] / "shared" / "data" / "arpo" / "valid.parquet"
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# ids: <pad>=0 <unk>=1 <system>=2 <user>=3 <assistant>=4 w0=5 w1=6 ... w9=14
VOCAB = ["<pad>", "<unk>", "<system>", "<user>", "<assistant>"] + [f"w{i}" for i in range(10)]


def _tokenizer(chat_template: str | None = TEMPLATE) -> PreTrainedTokenizerFast:
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return _tokenizer()


def _row(words: str, source: str = "math", **extra: object) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": words}],
        "ability": "math",
        "reward_model": {"ground_truth": f"gt-{words}", "style": "rule"},
        "extra_info": {"split": "train"},
        **extra,
    }


def test_item_fields_and_exact_ids(tok: PreTrainedTokenizerFast) -> None:
    rows = [_row("w0 w1 w2"), _row("w9 zzz", source="gsm8k", tools=["search"])]
    rows[1]["prompt"].insert(0, {"role": "system", "content": "w3"})
    ds = RLDataset(rows, tok, max_prompt_length=8)
    assert len(ds) == 2
    assert ds[0] == {
        "prompt_ids": [3, 5, 6, 7, 4],
        "raw_prompt": [{"role": "user", "content": "w0 w1 w2"}],
        "data_source": "math",
        "ability": "math",
        "ground_truth": "gt-w0 w1 w2",
        "extra_info": {"split": "train"},
        "tools": None,
        "index": 0,
    }
    assert ds[1]["tools"] == ["search"]
    # <system> w3 <user> w9 <unk> <assistant>
    assert ds[1]["prompt_ids"] == [2, 8, 3, 14, 1, 4]
    assert ds[1]["data_source"] == "gsm8k"
    assert (ds.num_filtered, ds.num_truncated) == (0, 0)


def test_overlong_prompts_are_filtered_and_logged(tok: PreTrainedTokenizerFast, caplog) -> None:
    rows = [_row("w0 w1 w2"), _row("w0 w1 w2 w3 w4"), _row("w5 w6"), _row("w0 w1 w2 w3")]
    with caplog.at_level(logging.INFO, logger="archer.data"):
        ds = RLDataset(rows, tok, max_prompt_length=5, filter_overlong_prompts=True)
    assert [ds[i]["index"] for i in range(len(ds))] == [0, 2]
    assert [ds[i]["prompt_ids"] for i in range(len(ds))] == [[3, 5, 6, 7, 4], [3, 10, 11, 4]]
    assert (ds.num_filtered, ds.num_truncated) == (2, 0)
    (record,) = [r for r in caplog.records if r.name == "archer.data"]
    assert "2 of 4 prompts kept" in record.getMessage()
    assert "2 filtered as overlong" in record.getMessage()


@pytest.mark.parametrize(("mode", "expected"), [
    # full ids: <user> w0 w1 w2 w3 w4 w5 w6 <assistant> = [3, 5, 6, 7, 8, 9, 10, 11, 4]
    ("left", [8, 9, 10, 11, 4]),
    ("right", [3, 5, 6, 7, 8]),
    ("middle", [3, 5, 10, 11, 4]),
])
def test_truncation_modes_give_exact_ids(tok: PreTrainedTokenizerFast, mode: str, expected: list[int]) -> None:
    rows = [_row("w0 w1 w2 w3 w4 w5 w6"), _row("w0")]
    ds = RLDataset(rows, tok, max_prompt_length=5, filter_overlong_prompts=False, truncation=mode)
    assert ds[0]["prompt_ids"] == expected
    assert ds[1]["prompt_ids"] == [3, 5, 4]
    assert (len(ds), ds.num_filtered, ds.num_truncated) == (2, 0, 1)


def test_truncate_ids_middle_with_even_length() -> None:
    ids = list(range(10))
    assert truncate_ids(ids, 4, "middle") == [0, 1, 8, 9]
    assert truncate_ids(ids, 10, "left") == ids
    with pytest.raises(ValueError, match="unknown mode 'error'"):
        truncate_ids(ids, 4, "error")


def test_overlong_prompt_with_truncation_error_names_row_length_and_fixes(tok: PreTrainedTokenizerFast) -> None:
    rows = [_row("w0"), _row("w0 w1 w2 w3")]
    with pytest.raises(ArcherError) as info:
        RLDataset(rows, tok, max_prompt_length=4, filter_overlong_prompts=False)
    assert info.value.problem == ("the prompt of row 1 is 6 tokens, longer than data.max_prompt_length=4 (the longest "
                                  "prompt has 6)")
    assert "raise data.max_prompt_length (to 6 keeps every prompt whole)" in info.value.fix
    assert "data.filter_overlong_prompts=True" in info.value.fix
    assert "data.truncation=left|right|middle" in info.value.fix


def test_all_rows_filtered_is_an_error(tok: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ArcherError) as info:
        RLDataset([_row("w0 w1"), _row("w2 w3 w4")], tok, max_prompt_length=3)
    assert "all 2 rows are longer than data.max_prompt_length=3" in info.value.problem
    assert "raise data.max_prompt_length" in info.value.fix


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"truncation": "both"}, "data.truncation='both' is not a truncation mode"),
    ({"max_prompt_length": 0}, "data.max_prompt_length=0 must be positive"),
])
def test_bad_settings_are_errors(tok: PreTrainedTokenizerFast, kwargs: dict, words: str) -> None:
    with pytest.raises(ArcherError) as info:
        RLDataset([_row("w0")], tok, **{"max_prompt_length": 8, **kwargs})
    assert info.value.problem == words


def test_tokenizer_without_chat_template_is_an_error() -> None:
    with pytest.raises(ArcherError) as info:
        RLDataset([_row("w0")], _tokenizer(chat_template=None), max_prompt_length=8)
    assert "has no chat template" in info.value.problem
    assert "actor_rollout_ref.model.custom_chat_template" in info.value.fix


def test_custom_chat_template_overrides_and_needs_no_tokenizer_template() -> None:
    custom = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if greet %}w9{% endif %}"
    for tokenizer in (_tokenizer(), _tokenizer(chat_template=None)):
        ds = RLDataset([_row("w0 w1")], tokenizer, max_prompt_length=8, chat_template=custom)
        assert ds[0]["prompt_ids"] == [5, 6]
    ds = RLDataset([_row("w0 w1")], _tokenizer(), max_prompt_length=8, chat_template=custom,
                   apply_chat_template_kwargs={"greet": True})
    assert ds[0]["prompt_ids"] == [5, 6, 14]


TOOLS = [{"type": "function", "function": {"name": "python", "description": "Run Python code",
                                          "parameters": {"type": "object", "properties": {}}}}]


def test_tools_a_chat_template_does_not_render_are_an_error_naming_the_key(tok: PreTrainedTokenizerFast) -> None:
    """The issue's case: the tools went to a template that ignores them, so the model never saw them."""
    with pytest.raises(ArcherError) as info:
        RLDataset([_row("w0")], tok, max_prompt_length=8, apply_chat_template_kwargs={"tools": TOOLS})
    assert info.value.problem.startswith("data.apply_chat_template_kwargs.tools is set, but the chat template "
                                         "renders the prompt the same with and without it")
    assert "custom_chat_template" in info.value.fix
    renders = "{% if tools %}<system> w9 {% endif %}" + TEMPLATE  # a template that shows the tools (as w9)
    ds = RLDataset([_row("w0")], tok, max_prompt_length=8, chat_template=renders,
                   apply_chat_template_kwargs={"tools": TOOLS})
    assert ds[0]["prompt_ids"] == [2, 14, 3, 5, 4]
    RLDataset([_row("w0")], tok, max_prompt_length=8, apply_chat_template_kwargs={"tools": []})  # none to show


def test_template_failure_names_the_row(tok: PreTrainedTokenizerFast) -> None:
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
    rows = [_row("w0"), _row("w1")]
    rows[1]["prompt"].insert(0, {"role": "system", "content": "w2"})
    with pytest.raises(ArcherError) as info:
        RLDataset(rows, tok, max_prompt_length=8, chat_template=strict)
    assert info.value.problem == "the chat template failed on the prompt of row 1: no system role"
    assert "custom_chat_template" in info.value.fix


@pytest.mark.skipif(not VALID.is_file(), reason="shared ARPO data not present")
def test_real_data_in_both_encodings(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    structured = read_rl_parquet(VALID)
    table = pq.read_table(VALID).drop_columns(["metadata"])
    columns = table.to_pydict()
    for key in ("prompt", "reward_model", "extra_info"):
        columns[key] = [repr(v) for v in columns[key]]
    repr_path = tmp_path / "valid_repr.parquet"
    pq.write_table(pa.table(columns), repr_path)
    # each prompt: <system> + system words + <user> + question words + <assistant>
    lengths = [3 + len(r["prompt"][0]["content"].split()) + len(r["prompt"][1]["content"].split())
               for r in structured]
    limit = sorted(lengths)[90]
    expected_kept = [i for i, n in enumerate(lengths) if n <= limit]
    for rows in (structured, read_rl_parquet(repr_path)):
        ds = RLDataset(rows, tok, max_prompt_length=limit)
        assert [ds[i]["index"] for i in range(len(ds))] == expected_kept
        assert ds.num_filtered == 180 - len(expected_kept)
        first = ds[0]
        assert len(first["prompt_ids"]) == lengths[expected_kept[0]]
        assert first["prompt_ids"][0] == 2 and first["prompt_ids"][-1] == 4
        assert first["ground_truth"] == structured[expected_kept[0]]["reward_model"]["ground_truth"]
        assert first["extra_info"]["index"] == expected_kept[0]
