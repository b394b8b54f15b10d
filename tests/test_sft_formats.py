"""LLaMA-Factory's demo files read as they are, tokenised with the tiny model's real BPE tokenizer: every run of
trained tokens decodes to exactly one assistant turn (function calls as the chat template writes them, with a
Qwen2.5-like template and with one that ignores tool calls), and no observation or prompt token is trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from shared_data import SHARED_DATA

from archer.data.sft_dataset import SFTDataset, read_sft_conversations, renders_tool_calls
from archer.models.loading import load_tokenizer

GLAIVE = SHARED_DATA / "sft" / "glaive_toolcall_en_demo.json"
ALPACA = SHARED_DATA / "sft" / "alpaca_en_demo.json"
needs_data = pytest.mark.skipif(not (GLAIVE.is_file() and ALPACA.is_file()), reason="shared SFT demo data absent")

# Written for these tests after Qwen2.5's format: tool schemas in a system turn, each call in <tool_call> JSON,
# consecutive tool answers in one user turn of <tool_response> blocks.
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + m.content }}"
    "{%- for c in m.tool_calls or [] %}{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n' + ({'name': c.function.name, 'arguments': c.function.arguments} | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def _runs(ids: list[int], mask: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Maximal runs of trained and of untrained tokens."""
    trained: list[list[int]] = []
    untrained: list[list[int]] = []
    for i, (token, flag) in enumerate(zip(ids, mask, strict=True)):
        runs = trained if flag else untrained
        if i == 0 or mask[i - 1] != flag:
            runs.append([])
        runs[-1].append(token)
    return trained, untrained


def _call_text(value: str, hermes: bool) -> str:
    call = json.loads(value)
    text = json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
    return f"<tool_call>\n{text}\n</tool_call>" if hermes else text


@needs_data
@pytest.mark.parametrize("hermes", [True, False])
def test_glaive_tool_calls_are_trained_as_the_template_writes_them_and_observations_are_not(tok, hermes: bool) -> None:
    tokenizer = tok
    if hermes:
        tokenizer = load_tokenizer(tok.name_or_path)
        tokenizer.chat_template = HERMES_TEMPLATE
    assert renders_tool_calls(tokenizer) is hermes
    conversations, where = read_sft_conversations(str(GLAIVE))
    assert len(conversations) == 300 and where[7] == f"row 7 of {GLAIVE}"
    rows = json.loads(GLAIVE.read_text())[:12]
    ds = SFTDataset(conversations[:12], tokenizer, max_length=8192, where=where[:12])
    calls_seen = 0
    for row, item, conversation in zip(rows, ds, conversations[:12], strict=True):
        ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
        rendered = tokenizer.apply_chat_template(
            conversation.messages if hermes else [_flat(m) for m in conversation.messages],
            tools=conversation.tools, tokenize=False)
        assert tokenizer.decode(ids) == rendered
        trained, untrained = _runs(ids, mask)
        expected = [(_call_text(t["value"], hermes) if t["from"] == "function_call" else t["value"]) + "<|im_end|>"
                    for t in row["conversations"] if t["from"] in ("gpt", "function_call")]
        assert [tokenizer.decode(run) for run in trained] == expected
        context = "".join(tokenizer.decode(run) for run in untrained)
        for turn in row["conversations"]:
            if turn["from"] in ("human", "observation"):
                assert turn["value"] in context
        calls_seen += sum(t["from"] == "function_call" for t in row["conversations"])
    assert calls_seen > 0
    if hermes:  # the row's tool schemas went to the template
        assert json.loads(rows[0]["tools"])[0]["name"] in tokenizer.decode(ds[0]["input_ids"].tolist())


def _flat(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {"role": "assistant", "content": "\n".join(json.dumps({"name": c["function"]["name"], "arguments":
                                                                  c["function"]["arguments"]}, ensure_ascii=False)
                                                      for c in calls)}


@needs_data
def test_alpaca_demo_reads_as_it_is(tok) -> None:
    conversations, _ = read_sft_conversations(str(ALPACA))
    rows = json.loads(ALPACA.read_text())
    assert len(conversations) == len(rows) == 1000
    with_input = next(i for i, r in enumerate(rows) if r["input"])
    picked = [0, with_input]
    for i in picked:
        user = rows[i]["instruction"] + (f"\n{rows[i]['input']}" if rows[i]["input"] else "")
        assert conversations[i].messages == [{"role": "user", "content": user},
                                             {"role": "assistant", "content": rows[i]["output"]}]
    ds = SFTDataset([conversations[i] for i in picked], tok, max_length=8192)
    for i, item in zip(picked, ds, strict=True):
        trained, _ = _runs(item["input_ids"].tolist(), item["loss_mask"].tolist())
        assert [tok.decode(run) for run in trained] == [rows[i]["output"] + "<|im_end|>"]
