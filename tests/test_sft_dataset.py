"""Tests for archer.data.sft_dataset: reading files, exact token ids and loss masks (single- and multi-turn),
truncation, collation and the errors users see."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from shared_data import SHARED_DATA
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from archer.data.sft_dataset import (
    SFTDataset,
    collate_sft,
    pack_sft,
    read_sft_conversations,
    read_sft_rows,
    token_slots,
)
from archer.errors import ArcherError

GLAIVE = SHARED_DATA / "sft" / "glaive_toolcall_en_demo.json"
ALPACA = SHARED_DATA / "sft" / "alpaca_en_demo.json"
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)
# ids: <pad>=0 <unk>=1 <end>=2 <system>=3 <user>=4 <assistant>=5 <tool>=6 w0=7 w1=8 ... w9=16 <result>=17
# </result>=18 <call>=19 </call>=20
VOCAB = (["<pad>", "<unk>", "<end>", "<system>", "<user>", "<assistant>", "<tool>"] + [f"w{i}" for i in range(10)]
         + ["<result>", "</result>", "<call>", "</call>"])
PAD, END, SYSTEM, USER, ASSISTANT, TOOL, RESULT, END_RESULT, CALL, END_CALL = 0, 2, 3, 4, 5, 6, 17, 18, 19, 20
# TEMPLATE, with an assistant message's tool_calls written as "<call> NAME ARGUMENT-x </call> "
CALLS_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {% for c in m.get('tool_calls') or [] %}<call> {{ c.function.name }} "
    "{{ c.function.arguments.x }} </call> {% endfor %}{{ m['content'] }} <end> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


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
    item = SFTDataset.from_rows([_single()], tok, max_length=16)[0]
    assert item["input_ids"].tolist() == SINGLE_IDS
    assert item["loss_mask"].tolist() == SINGLE_MASK
    assert item["input_ids"].dtype == torch.long and item["loss_mask"].dtype == torch.long


@pytest.mark.parametrize("prompt", [
    "[{'role': 'user', 'content': 'w0 w1'}]",        # Python repr, as verl's parquet files store it
    '[{"role": "user", "content": "w0 w1"}]',        # JSON text
    "w0 w1",                                         # plain text: one user message
])
def test_prompt_encodings_give_the_same_tokens(tok: PreTrainedTokenizerFast, prompt: str) -> None:
    item = SFTDataset.from_rows([_single(prompt)], tok, max_length=16)[0]
    assert item["input_ids"].tolist() == SINGLE_IDS
    assert item["loss_mask"].tolist() == SINGLE_MASK


def test_custom_keys_and_few_shot_assistant_in_prompt_gets_no_loss(tok: PreTrainedTokenizerFast) -> None:
    prompt = [{"role": "user", "content": "w0"}, {"role": "assistant", "content": "w1"},
              {"role": "user", "content": "w2"}]
    item = SFTDataset.from_rows([{"q": prompt, "a": "w3"}], tok, max_length=32, prompt_key="q", response_key="a")[0]
    assert item["input_ids"].tolist() == [USER, w(0), END, ASSISTANT, w(1), END, USER, w(2), END,
                                          ASSISTANT, w(3), END]
    assert item["loss_mask"].tolist() == [0] * 10 + [1, 1]


MULTI = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w0"},
         {"role": "assistant", "content": "w1 w2"}, {"role": "user", "content": "w3"},
         {"role": "assistant", "content": "w4"}]
MULTI_IDS = [SYSTEM, w(9), END, USER, w(0), END, ASSISTANT, w(1), w(2), END, USER, w(3), END, ASSISTANT, w(4), END]
MULTI_MASK = [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]


def test_multi_turn_trains_every_assistant_turn_only(tok: PreTrainedTokenizerFast) -> None:
    item = SFTDataset.from_rows([{"messages": MULTI}], tok, max_length=32, multiturn=True)[0]
    assert item["input_ids"].tolist() == MULTI_IDS
    assert item["loss_mask"].tolist() == MULTI_MASK


def test_multi_turn_sharegpt_speakers_and_string_repr(tok: PreTrainedTokenizerFast) -> None:
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"from": speaker[m["role"]], "value": m["content"]} for m in MULTI]
    ds = SFTDataset.from_rows([{"conversations": sharegpt}, {"conversations": json.dumps(MULTI)}], tok, max_length=32,
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
    ds = SFTDataset.from_rows([_single(), {"prompt": "w5", "response": "w6"}], tok, max_length=6, truncation=mode)
    assert ds[0]["input_ids"].tolist() == ids
    assert ds[0]["loss_mask"].tolist() == mask
    assert ds[1]["input_ids"].tolist() == [USER, w(5), END, ASSISTANT, w(6), END]  # 6 tokens: kept whole
    assert ds.num_truncated == 1


def test_overlong_row_with_truncation_error_names_row_and_length(tok: PreTrainedTokenizerFast) -> None:
    rows = [_single(response="w2"), _single()]
    with pytest.raises(ArcherError) as info:
        SFTDataset.from_rows(rows, tok, max_length=7)
    assert "SFT row 1 is 8 tokens long" in info.value.problem
    assert "data.max_length=7" in info.value.problem
    assert "data.truncation=left|right" in info.value.fix


def test_collate_right_pads_with_masks_and_positions(tok: PreTrainedTokenizerFast) -> None:
    ds = SFTDataset.from_rows([_single(), {"prompt": "w5", "response": "w6"}], tok, max_length=16)
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
    ds = SFTDataset.from_rows(read_sft_rows(tmp_path / "a.parquet"), tok, max_length=16)
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
    ([{"question": "w0", "response": "w1"}], {}, "cannot tell the format of SFT row 0: its fields are "
     "['question', 'response']", "data.prompt_key"),
    ([{"prompt": "w0", "response": 3}], {}, "the response of SFT row 0 is a int", "text"),
    ([{"prompt": "[{'role': 'user', 'content': w0}]", "response": "w1"}], {}, "does not parse", "list of"),
    ([{"prompt": [{"content": "w0"}], "response": "w1"}], {}, "speaker None (key 'from')", "list of"),
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
        SFTDataset.from_rows(rows, tok, **{"max_length": 16, **kwargs})
    assert problem in info.value.problem
    assert fix in info.value.fix


def test_tokenizer_without_chat_template_is_an_error() -> None:
    with pytest.raises(ArcherError) as info:
        SFTDataset.from_rows([_single()], _tokenizer(chat_template=None), max_length=16)
    assert "no chat template" in info.value.problem and "model.partial_pretrain" in info.value.fix


def test_template_that_rewrites_past_turns_is_an_error() -> None:
    drops_past_answers = (
        "{% for m in messages %}<{{ m['role'] }}> {% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['content'] }} {% endif %}<end> {% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    with pytest.raises(ArcherError) as info:
        SFTDataset.from_rows([{"messages": MULTI}], _tokenizer(drops_past_answers), max_length=32, multiturn=True)
    assert "SFT row 0" in info.value.problem and "assistant turn 2" in info.value.problem


@pytest.mark.skipif(not GLAIVE.is_file(), reason="shared real SFT data not present")
def test_real_sharegpt_file_trains_each_assistant_turn(tok: PreTrainedTokenizerFast) -> None:
    rows = read_sft_rows(GLAIVE)[:20]
    ds = SFTDataset.from_rows(rows, tok, max_length=4096, multiturn=True, messages_key="conversations")
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
    item = SFTDataset.from_rows([_single(prompt="w0", response=response)], tok, max_length=32)[0]
    assert item["input_ids"].tolist() == [USER, w(0), END, ASSISTANT, w(1), RESULT, w(2), w(3), END_RESULT, w(4),
                                          RESULT, w(5), END_RESULT, END]
    assert item["loss_mask"].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1]
    trained_anyway = SFTDataset.from_rows([_single(prompt="w0", response=response)], tok, max_length=32, tool_result_tag=None)
    assert trained_anyway[0]["loss_mask"].tolist() == [0, 0, 0, 0] + [1] * 10


def test_tool_calls_and_observations_of_a_sharegpt_conversation() -> None:
    # LLaMA-Factory's speakers: function_call is an assistant turn whose call the chat template renders (trained),
    # observation a tool turn (not trained), and a result inside an assistant turn is not trained either
    conversation = [{"from": "human", "value": "w0"}, {"from": "function_call", "value": '{"name": "w1", '
                                                      '"arguments": {"x": "w2"}}'},
                    {"from": "observation", "value": "w3"}, {"from": "gpt", "value": "w4 <result> w5 </result> w6"}]
    item = SFTDataset.from_rows([{"conversations": conversation}], _tokenizer(CALLS_TEMPLATE), max_length=32)[0]
    assert item["input_ids"].tolist() == [USER, w(0), END, ASSISTANT, CALL, w(1), w(2), END_CALL, END, TOOL, w(3), END,
                                          ASSISTANT, w(4), RESULT, w(5), END_RESULT, w(6), END]
    assert item["loss_mask"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("tools", [[{"name": "w8"}, {"name": "w9"}], '[{"name": "w8"}, {"name": "w9"}]'])
def test_a_rows_tools_reach_the_chat_template(tools: object) -> None:
    lists_tools = "{% if tools %}<system> {% for t in tools %}{{ t['name'] }} {% endfor %}<end> {% endif %}" + TEMPLATE
    rows = [{"messages": MULTI[1:3], "tools": tools}, {"messages": MULTI[1:3]}]
    ds = SFTDataset.from_rows(rows, _tokenizer(lists_tools), max_length=32, multiturn=True)
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
        SFTDataset.from_rows(rows, tok, **{"max_length": 32, **kwargs})
    assert problem in info.value.problem
    assert fix in info.value.fix


# -- the formats users have ---------------------------------------------------------------------------------------
def test_alpaca_rows_join_instruction_and_input_and_train_history_answers(tok: PreTrainedTokenizerFast) -> None:
    # "<system> w3 <end> <user> w4 <end> <assistant> w5 <end> <user> w0\nw1 <end> <assistant> w2 <end> "
    row = {"instruction": "w0", "input": "w1", "output": "w2", "system": "w3", "history": [["w4", "w5"]]}
    item = SFTDataset.from_rows([row], tok, max_length=32)[0]
    assert item["input_ids"].tolist() == [SYSTEM, w(3), END, USER, w(4), END, ASSISTANT, w(5), END, USER, w(0), w(1),
                                          END, ASSISTANT, w(2), END]
    assert item["loss_mask"].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1]
    plain = SFTDataset.from_rows([{"instruction": "w0", "input": "", "output": "w2"}], tok, max_length=32)[0]
    assert plain["input_ids"].tolist() == [USER, w(0), END, ASSISTANT, w(2), END]
    assert plain["loss_mask"].tolist() == [0, 0, 0, 0, 1, 1]


def test_sharegpt_with_chat_role_speakers_and_a_system_column(tok: PreTrainedTokenizerFast) -> None:
    # ShareGPT files whose "from" holds user/assistant (rejected before) read like human/gpt
    row = {"conversations": [{"from": "user", "value": "w0"}, {"from": "assistant", "value": "w1"}], "system": "w2"}
    item = SFTDataset.from_rows([row], tok, max_length=32)[0]
    assert item["input_ids"].tolist() == [SYSTEM, w(2), END, USER, w(0), END, ASSISTANT, w(1), END]
    assert item["loss_mask"].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1]


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_dataset_info_maps_columns_and_tags(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    _write(tmp_path / "dialogs.json", [{"dialog": [{"speaker": "q", "text": "w0"}, {"speaker": "a", "text": "w1"}],
                                        "sys": "w2"}])
    (tmp_path / "qa.jsonl").write_text(json.dumps({"q": "w3", "a": "w4"}) + "\n")
    info = _write(tmp_path / "dataset_info.json", {
        "dialogs": {"file_name": "dialogs.json", "formatting": "sharegpt",
                    "columns": {"messages": "dialog", "system": "sys"},
                    "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "q", "assistant_tag": "a"}},
        "qa": {"file_name": "qa.jsonl", "columns": {"prompt": "q", "response": "a"}},
    })
    conversations, where = read_sft_conversations(["dialogs", "qa"], dataset_info=str(info))
    assert where == [f"row 0 of {tmp_path / 'dialogs.json'}", f"row 0 of {tmp_path / 'qa.jsonl'}"]
    ds = SFTDataset(conversations, tok, max_length=32, where=where)
    assert ds[0]["input_ids"].tolist() == [SYSTEM, w(2), END, USER, w(0), END, ASSISTANT, w(1), END]
    assert ds[0]["loss_mask"].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert ds[1]["input_ids"].tolist() == [USER, w(3), END, ASSISTANT, w(4), END]  # alpaca: the default formatting
    assert ds[1]["loss_mask"].tolist() == [0, 0, 0, 0, 1, 1]


def _sft_error(files: list, **kwargs: object) -> ArcherError:
    with pytest.raises(ArcherError) as info:
        read_sft_conversations(files, **kwargs)
    return info.value


def test_bad_formats_and_dataset_infos_are_errors(tmp_path: Path) -> None:
    alpaca = _write(tmp_path / "a.json", [{"instruction": "w0", "output": "w1"}, {"instruction": "w2"}])
    error = _sft_error([str(alpaca)])
    assert error.problem == f"row 1 of {alpaca} has no field(s) ['output'] (read as alpaca data); its fields are " \
                            "['instruction']"
    error = _sft_error([str(alpaca)], data_format="csv")
    assert "the SFT data format 'csv' is not known" in error.problem and "alpaca" in error.fix
    assert _sft_error([str(alpaca)], data_format="ShareGTP").fix.startswith("did you mean 'sharegpt'? use one of")
    # a format set by hand that the file is not in: the fix names the format its rows are in
    conversations = _write(tmp_path / "c.json", [{"conversations": [{"from": "human", "value": "w0"},
                                                                   {"from": "gpt", "value": "w1"}]}])
    error = _sft_error([str(conversations)], data_format="alpaca")
    assert error.problem == f"row 0 of {conversations} has no field(s) ['instruction', 'output'] (read as alpaca " \
                            "data); its fields are ['conversations']"
    assert error.fix.startswith("its fields are sharegpt data: set data.format=sharegpt (or auto, ")
    info = _write(tmp_path / "dataset_info.json", {"gone": {"file_name": "missing.json", "formatting": "sharegpt"},
                                                   "odd": {"file_name": "a.json", "formatting": "xml"},
                                                   "hub": {"hf_hub_url": "org/set"}})
    error = _sft_error(["gone"], dataset_info=str(info))
    assert error.problem == f"dataset 'gone' of {info} names the file {tmp_path / 'missing.json'}, which does not exist"
    assert "file_name" in error.fix
    assert "the SFT data format 'xml' is not known" in _sft_error(["odd"], dataset_info=str(info)).problem
    assert "archer sft reads local SFT files only" in _sft_error(["hub"], dataset_info=str(info)).problem
    error = _sft_error(["nope"], dataset_info=str(info))
    assert error.problem == f"dataset 'nope' is not described in {info} (it has: ['gone', 'hub', 'odd'])"
    assert "does not exist" in _sft_error(["x"], dataset_info=str(tmp_path / "none.json")).problem
    assert "data.dataset_info is set" in _sft_error(["odd"], dataset_info=str(info), data_format="alpaca").problem
    sharegpt = _write(tmp_path / "s.json", [{"conversations": [{"from": "human", "value": "w0"},
                                                              {"from": "function_call", "value": "w1"}]}])
    assert f"the function_call of row 0 of {sharegpt} is not JSON" in _sft_error([str(sharegpt)]).problem
    strict = _write(tmp_path / "info2.json", {"s": {"file_name": "s.json", "formatting": "sharegpt",
                                                    "tags": {"user_tag": "q"}}})
    assert "speaker 'human' (key 'from') is not one of" in _sft_error(["s"], dataset_info=str(strict)).problem


def test_pack_sft_fills_rows_longest_first_with_positions_restarting() -> None:
    items = [{"input_ids": torch.tensor([11, 12, 13]), "loss_mask": torch.tensor([0, 1, 1])},
             {"input_ids": torch.tensor([21, 22]), "loss_mask": torch.tensor([0, 1])},
             {"input_ids": torch.tensor([31, 32, 33, 34]), "loss_mask": torch.tensor([0, 0, 1, 1])}]
    batch = pack_sft(items, pad_token_id=0, capacity=5, unpacked_micro_batch_size=2)
    # longest first: [31..34] opens row 0; [11..13] does not fit there (7 > 5) and opens row 1; [21, 22] joins row 1
    assert batch["input_ids"].tolist() == [[31, 32, 33, 34, 0], [11, 12, 13, 21, 22]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 0, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    # unpacked, 2 rows a forward pass: [3, 2] padded to 3 and [4] -> 2*3 + 4 slots
    assert batch.info == {"packed": True, "token_slots_unpacked": 10}
    assert token_slots([3, 2, 4], 2) == 10 and token_slots([4, 5], 2) == 10 and token_slots([3, 2, 4], 1) == 9
