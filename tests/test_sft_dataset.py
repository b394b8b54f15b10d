"""Tests for archer.data.sft_dataset: reading files, exact token ids and loss masks (single- and multi-turn),
truncation, collation and the errors users see."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from archer.data.sft_dataset import SFTDataset, collate_sft, read_sft_rows
from archer.errors import ArcherError

GLAIVE = Path(__file__).resolve().parents[2] / "shared" / "data" / "sft" / "glaive_toolcall_en_demo.json"
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)
# ids: <pad>=0 <unk>=1 <end>=2 <system>=3 <user>=4 <assistant>=5 <tool>=6 w0=7 w1=8 ... w9=16 <result>=17
# </result>=18
VOCAB = (["<pad>", "<unk>", "<end>", "<system>", "<user>", "<assistant>", "<tool>"] + [f"w{i}" for i in range(10)]
         + ["<result>", "</result>"])
PAD, END, SYSTEM, USER, ASSISTANT, TOOL, RESULT, END_RESULT = 0, 2, 3, 4, 5, 6, 17, 18


def w(i: int) -> int:
    return 7 + i


def _tokenizer(chat_template: str | None = TEMPLATE) -> PreTrainedTokenizerFast:
    word_level = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", unk_token="<unk>",
                                  eos_token="<end>")
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return _tokenizer()


def _single(prompt: object = None, response: str = "w2 w3") -> dict:
    return {"prompt": [{"role": "user", "content": "w0 w1"}] if prompt is None else prompt, "response": response}


# "<user> w0 w1 <end> <assistant> w2 w3 <end> ": loss on the response and its end-of-turn token only
SINGLE_IDS = [USER, w(0), w(1), END, ASSISTANT, w(2), w(3), END]
SINGLE_MASK = [0, 0, 0, 0, 0, 1, 1, 1]


def test_single_turn_ids_and_loss_mask_token_by_token(tok: PreTrainedTokenizerFast) -> None:
    item = SFTDataset([_single()], tok, max_length=16)[0]
    assert item["input_ids"].tolist() == SINGLE_IDS
    assert item["loss_mask"].tolist() == SINGLE_MASK
    assert item["input_ids"].dtype == torch.long and item["loss_mask"].dtype == torch.long


@pytest.mark.parametrize("prompt", [
    "[{'role': 'user', 'content': 'w0 w1'}]",        # Python repr, as verl's parquet files store it
    '[{"role": "user", "content": "w0 w1"}]',        # JSON text
    "w0 w1",                                         # plain text: one user message
])
def test_prompt_encodings_give_the_same_tokens(tok: PreTrainedTokenizerFast, prompt: str) -> None:
    item = SFTDataset([_single(prompt)], tok, max_length=16)[0]
    assert item["input_ids"].tolist() == SINGLE_IDS
    assert item["loss_mask"].tolist() == SINGLE_MASK


def test_custom_keys_and_few_shot_assistant_in_prompt_gets_no_loss(tok: PreTrainedTokenizerFast) -> None:
    prompt = [{"role": "user", "content": "w0"}, {"role": "assistant", "content": "w1"},
              {"role": "user", "content": "w2"}]
    item = SFTDataset([{"q": prompt, "a": "w3"}], tok, max_length=32, prompt_key="q", response_key="a")[0]
    assert item["input_ids"].tolist() == [USER, w(0), END, ASSISTANT, w(1), END, USER, w(2), END,
                                          ASSISTANT, w(3), END]
    assert item["loss_mask"].tolist() == [0] * 10 + [1, 1]


MULTI = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w0"},
         {"role": "assistant", "content": "w1 w2"}, {"role": "user", "content": "w3"},
         {"role": "assistant", "content": "w4"}]
MULTI_IDS = [SYSTEM, w(9), END, USER, w(0), END, ASSISTANT, w(1), w(2), END, USER, w(3), END, ASSISTANT, w(4), END]
MULTI_MASK = [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]


def test_multi_turn_trains_every_assistant_turn_only(tok: PreTrainedTokenizerFast) -> None:
    item = SFTDataset([{"messages": MULTI}], tok, max_length=32, multiturn=True)[0]
    assert item["input_ids"].tolist() == MULTI_IDS
    assert item["loss_mask"].tolist() == MULTI_MASK


def test_multi_turn_sharegpt_speakers_and_string_repr(tok: PreTrainedTokenizerFast) -> None:
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"from": speaker[m["role"]], "value": m["content"]} for m in MULTI]
    ds = SFTDataset([{"conversations": sharegpt}, {"conversations": json.dumps(MULTI)}], tok, max_length=32,
                    multiturn=True, messages_key="conversations")
    for item in ds:
        assert item["input_ids"].tolist() == MULTI_IDS
        assert item["loss_mask"].tolist() == MULTI_MASK


@pytest.mark.parametrize(("mode", "ids", "mask"), [
    ("right", SINGLE_IDS[:6], SINGLE_MASK[:6]),
    ("left", SINGLE_IDS[2:], SINGLE_MASK[2:]),
])
def test_truncation_cuts_ids_and_mask_together(tok: PreTrainedTokenizerFast, mode: str, ids: list[int],
                                               mask: list[int]) -> None:
    ds = SFTDataset([_single(), {"prompt": "w5", "response": "w6"}], tok, max_length=6, truncation=mode)
    assert ds[0]["input_ids"].tolist() == ids
    assert ds[0]["loss_mask"].tolist() == mask
    assert ds[1]["input_ids"].tolist() == [USER, w(5), END, ASSISTANT, w(6), END]  # 6 tokens: kept whole
    assert ds.num_truncated == 1


def test_overlong_row_with_truncation_error_names_row_and_length(tok: PreTrainedTokenizerFast) -> None:
    rows = [_single(response="w2"), _single()]
    with pytest.raises(ArcherError) as info:
        SFTDataset(rows, tok, max_length=7)
    assert "SFT row 1 is 8 tokens long" in info.value.problem
    assert "data.max_length=7" in info.value.problem
    assert "data.truncation=left|right" in info.value.fix


def test_collate_right_pads_with_masks_and_positions(tok: PreTrainedTokenizerFast) -> None:
    ds = SFTDataset([_single(), {"prompt": "w5", "response": "w6"}], tok, max_length=16)
    batch = ds.collate([ds[0], ds[1]])
    short = [USER, w(5), END, ASSISTANT, w(6), END]
    assert batch["input_ids"].tolist() == [SINGLE_IDS, short + [PAD, PAD]]
    assert batch["attention_mask"].tolist() == [[1] * 8, [1] * 6 + [0, 0]]
    assert batch["position_ids"].tolist() == [list(range(8)), [0, 1, 2, 3, 4, 5, 0, 0]]
    assert batch["loss_mask"].tolist() == [SINGLE_MASK, [0, 0, 0, 0, 1, 1, 0, 0]]


def test_collate_pads_with_given_id() -> None:
    items = [{"input_ids": torch.tensor([5, 6]), "loss_mask": torch.tensor([0, 1])},
             {"input_ids": torch.tensor([7]), "loss_mask": torch.tensor([1])}]
    batch = collate_sft(items, pad_token_id=99)
    assert batch["input_ids"].tolist() == [[5, 6], [7, 99]]
    assert batch["loss_mask"].tolist() == [[0, 1], [1, 0]]


def test_read_rows_from_parquet_jsonl_and_json(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    rows = [_single(), {"prompt": [{"role": "user", "content": "w5"}], "response": "w6"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "c.json").write_text(json.dumps(rows))
    read = read_sft_rows([str(tmp_path / "a.parquet"), tmp_path / "b.jsonl", str(tmp_path / "c.json")])
    assert read == rows * 3
    assert read_sft_rows(str(tmp_path / "b.jsonl")) == rows
    ds = SFTDataset(read_sft_rows(tmp_path / "a.parquet"), tok, max_length=16)
    assert ds[0]["input_ids"].tolist() == SINGLE_IDS


@pytest.mark.parametrize(("name", "text", "problem"), [
    ("missing.jsonl", None, "does not exist"),
    ("data.csv", "prompt,response\n", "unsupported extension '.csv'"),
    ("bad.jsonl", '{"prompt": "w0"}\n{oops\n', "line 2 of"),
    ("obj.json", '{"prompt": "w0"}', "holds a JSON dict, not a list"),
    ("empty.jsonl", "\n", "holds no rows"),
    ("scalars.json", "[1, 2]", "row 0 of"),
    ("broken.parquet", "not parquet", "not a readable parquet file"),
])
def test_bad_files_are_errors_naming_the_problem(tmp_path: Path, name: str, text: str | None, problem: str) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ArcherError) as info:
        read_sft_rows([path])
    assert problem in info.value.problem and str(path) in info.value.problem
    assert info.value.fix


def test_no_files_is_an_error() -> None:
    with pytest.raises(ArcherError, match="no SFT data files"):
        read_sft_rows([])


@pytest.mark.parametrize(("rows", "kwargs", "problem", "fix"), [
    ([{"question": "w0", "response": "w1"}], {}, "SFT row 0 has no field(s) ['prompt']; its fields are "
     "['question', 'response']", "data.prompt_key"),
    ([{"prompt": "w0", "response": 3}], {}, "the response of SFT row 0 is a int", "text"),
    ([{"prompt": "[{'role': 'user', 'content': w0}]", "response": "w1"}], {}, "does not parse", "list of"),
    ([{"prompt": [{"content": "w0"}], "response": "w1"}], {}, "has no string 'role'", "list of"),
    ([{"messages": "w0"}], {"multiturn": True}, "plain text", "list of"),
    ([{"messages": [{"role": "user", "content": "w0"}]}], {"multiturn": True}, "no assistant message", "add"),
    ([{"messages": [{"from": "robot", "value": "w0"}]}], {"multiturn": True}, "'robot'", "list of"),
    ([{"turns": MULTI}], {"multiturn": True}, "no field(s) ['messages']", "data.multiturn.messages_key"),
    ([_single()], {"truncation": "middle"}, "data.truncation='middle'", "'left'"),
    ([_single()], {"max_length": 0}, "data.max_length=0", "data.max_length"),
])
def test_bad_rows_and_settings_are_errors(tok: PreTrainedTokenizerFast, rows: list, kwargs: dict, problem: str,
                                          fix: str) -> None:
    with pytest.raises(ArcherError) as info:
        SFTDataset(rows, tok, **{"max_length": 16, **kwargs})
    assert problem in info.value.problem
    assert fix in info.value.fix


def test_tokenizer_without_chat_template_is_an_error() -> None:
    with pytest.raises(ArcherError) as info:
        SFTDataset([_single()], _tokenizer(chat_template=None), max_length=16)
    assert "no chat template" in info.value.problem and "model.partial_pretrain" in info.value.fix


def test_template_that_rewrites_past_turns_is_an_error() -> None:
    drops_past_answers = (
        "{% for m in messages %}<{{ m['role'] }}> {% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['content'] }} {% endif %}<end> {% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    with pytest.raises(ArcherError) as info:
        SFTDataset([{"messages": MULTI}], _tokenizer(drops_past_answers), max_length=32, multiturn=True)
    assert "SFT row 0" in info.value.problem and "assistant turn 2" in info.value.problem


@pytest.mark.skipif(not GLAIVE.is_file(), reason="shared real SFT data not present")
def test_real_sharegpt_file_trains_each_assistant_turn(tok: PreTrainedTokenizerFast) -> None:
    rows = read_sft_rows(GLAIVE)[:20]
    ds = SFTDataset(rows, tok, max_length=4096, multiturn=True, messages_key="conversations")
    for row, item in zip(rows, ds, strict=True):
        assistant_turns = sum(m["from"] in ("gpt", "function_call") for m in row["conversations"])
        mask = item["loss_mask"].tolist()
        runs = sum(1 for a, b in zip([0, *mask], mask, strict=False) if b and not a)
        assert runs == assistant_turns
        assert mask[0] == 0 and mask[-1] == 1


def test_tool_results_in_a_response_get_no_loss(tok: PreTrainedTokenizerFast) -> None:
    # "<user> w0 <end> <assistant> w1 <result> w2 w3 </result> w4 <result> w5 </result> <end> ": the model's
    # own w1, w4 and end-of-turn are trained; each " <result> ... </result>" span (the space before it too) is not
    response = "w1 <result> w2 w3 </result> w4 <result> w5 </result>"
    item = SFTDataset([_single(prompt="w0", response=response)], tok, max_length=32)[0]
    assert item["input_ids"].tolist() == [USER, w(0), END, ASSISTANT, w(1), RESULT, w(2), w(3), END_RESULT, w(4),
                                          RESULT, w(5), END_RESULT, END]
    assert item["loss_mask"].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1]
    trained_anyway = SFTDataset([_single(prompt="w0", response=response)], tok, max_length=32, tool_result_tag=None)
    assert trained_anyway[0]["loss_mask"].tolist() == [0, 0, 0, 0] + [1] * 10


def test_tool_calls_and_observations_of_a_sharegpt_conversation(tok: PreTrainedTokenizerFast) -> None:
    # LLaMA-Factory's speakers: function_call is an assistant turn (trained), observation a tool turn (not),
    # and a result inside an assistant turn is not trained either
    conversation = [{"from": "human", "value": "w0"}, {"from": "function_call", "value": "w1"},
                    {"from": "observation", "value": "w2"}, {"from": "gpt", "value": "w3 <result> w4 </result> w5"}]
    item = SFTDataset([{"conversations": conversation}], tok, max_length=32, multiturn=True,
                      messages_key="conversations")[0]
    assert item["input_ids"].tolist() == [USER, w(0), END, ASSISTANT, w(1), END, TOOL, w(2), END, ASSISTANT, w(3),
                                          RESULT, w(4), END_RESULT, w(5), END]
    assert item["loss_mask"].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("tools", [[{"name": "w8"}, {"name": "w9"}], '[{"name": "w8"}, {"name": "w9"}]'])
def test_a_rows_tools_reach_the_chat_template(tools: object) -> None:
    lists_tools = "{% if tools %}<system> {% for t in tools %}{{ t['name'] }} {% endfor %}<end> {% endif %}" + TEMPLATE
    rows = [{"messages": MULTI[1:3], "tools": tools}, {"messages": MULTI[1:3]}]
    ds = SFTDataset(rows, _tokenizer(lists_tools), max_length=32, multiturn=True)
    assert ds[0]["input_ids"].tolist() == [SYSTEM, w(8), w(9), END, USER, w(0), END, ASSISTANT, w(1), w(2), END]
    assert ds[0]["loss_mask"].tolist() == [0] * 8 + [1, 1, 1]
    assert ds[1]["input_ids"].tolist() == [USER, w(0), END, ASSISTANT, w(1), w(2), END]


@pytest.mark.parametrize(("rows", "kwargs", "problem", "fix"), [
    ([_single(response="w1 <result> w2")], {}, "opens <result> and never closes it", "data.tool_result_tag=null"),
    ([_single()], {"tool_result_tag": "<result>"}, "data.tool_result_tag='<result>' is not a tag name", "null"),
    ([{"messages": MULTI, "tools": "{oops"}], {"multiturn": True}, "the tools of SFT row 0 are not valid JSON",
     "JSON list"),
    ([{"messages": MULTI, "tools": {"name": "w8"}}], {"multiturn": True}, "are a dict, not a list", "list"),
])
def test_bad_tool_markup_is_an_error(tok: PreTrainedTokenizerFast, rows: list, kwargs: dict, problem: str,
                                     fix: str) -> None:
    with pytest.raises(ArcherError) as info:
        SFTDataset(rows, tok, **{"max_length": 32, **kwargs})
    assert problem in info.value.problem
    assert fix in info.value.fix
