"""SFT data: reading files, and tokenising conversations (``sft_formats.Conversation``: prompt/response, alpaca,
sharegpt rows) with the chat template so that only the assistant's tokens carry loss (``loss_mask`` 1), as
verl's SFT datasets do.

A trained assistant turn is the text the template adds after the generation prompt, up to its end-of-turn token
(``<|im_end|>`` for ChatML). Tool calls (a message's ``tool_calls``) render through the chat template when it
renders them (Qwen2.5's ``<tool_call>`` blocks); with a template that ignores ``tool_calls`` the calls are written
as JSON text in the message. Tool answers (``tool`` messages, LLaMA-Factory's observations) are context only.

Tool output inside an assistant turn carries no loss: each `` <result>\\n...\\n</result>`` span (ARPO's format,
the tag named by ``data.tool_result_tag``; the space before it included) is what a rollout loop appends after a
call, so it is tokenised as the loop does (the frame `` <result>\\n``, the answer and ``\\n</result>`` apart,
never merged with the model's own text), with ``loss_mask`` 0.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedTokenizerBase

from archer.batch import Batch
from archer.config.loader import as_list
from archer.data.rl_dataset import truncate_ids
from archer.data.sft_formats import Conversation, RowFormat, detect_format, read_dataset_info, read_json
from archer.errors import ArcherError

logger = logging.getLogger("archer.data")

TRUNCATION_MODES = ("error", "left", "right")
_PROBE = "archer_probe_7f3a"  # a tool name no template writes on its own


# -- reading files ---------------------------------------------------------------------------------
def read_sft_rows(paths: str | Path | Sequence[str | Path]) -> list[dict[str, Any]]:
    """Rows of one or several SFT files (.parquet, .jsonl, or .json holding a list of objects), in order."""
    path_list = as_list(paths)
    if not path_list:
        raise ArcherError("no SFT data files were given", "set data.train_files to a .parquet/.jsonl/.json path")
    rows: list[dict[str, Any]] = []
    for path in path_list:
        rows.extend(_read_file(Path(str(path)).expanduser()))
    return rows


def read_sft_conversations(files: Any, *, dataset_info: str | None = None, data_format: str = "auto",
                           prompt_key: str = "prompt", response_key: str = "response", multiturn: bool = False,
                           messages_key: str = "messages", tools_key: str = "tools"
                           ) -> tuple[list[Conversation], list[str]]:
    """The conversations of SFT files (each file's format as ``data_row_format`` picks it), or of the datasets
    ``files`` names in a LLaMA-Factory ``dataset_info`` json (each with its formatting, columns and tags); and
    where each came from (``row i of FILE``)."""
    names = [str(f) for f in as_list(files)]
    if not names:
        raise ArcherError("no SFT data files were given", "set data.train_files to a .parquet/.jsonl/.json path")
    if dataset_info is not None:
        if data_format != "auto" or multiturn:
            raise ArcherError("data.format / data.multiturn.enable apply to data files, but data.dataset_info is set "
                              "(its datasets carry their own formatting, columns and tags)",
                              "leave data.format=auto and data.multiturn.enable=false, or drop data.dataset_info")
        sources = [(entry.path, entry.row_format) for entry in read_dataset_info(dataset_info, names)]
    else:
        sources = [(Path(name).expanduser(), None) for name in names]
    conversations: list[Conversation] = []
    where: list[str] = []
    for path, row_format in sources:
        rows = _read_file(path)
        fmt = row_format or data_row_format(rows[0], data_format, where=f"row 0 of {path}", prompt_key=prompt_key,
                                            response_key=response_key, multiturn=multiturn,
                                            messages_key=messages_key, tools_key=tools_key)
        for i, row in enumerate(rows):
            where.append(f"row {i} of {path}")
            conversations.append(fmt.conversation(row, where[-1]))
    return conversations, where


def _read_file(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ArcherError(f"SFT data file {path} does not exist",
                          "check data.train_files / data.val_files (relative paths start from the working directory)")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        rows = _read_parquet(path)
    elif suffix == ".jsonl":
        rows = _read_jsonl(path)
    elif suffix == ".json":
        rows = _read_json(path)
    else:
        raise ArcherError(f"SFT data file {path} has an unsupported extension {suffix!r}",
                          "store the data as .parquet, .jsonl (one JSON object a line) or .json (a list of objects)")
    if not rows:
        raise ArcherError(f"SFT data file {path} holds no rows", "point data.train_files at a file with examples")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ArcherError(f"row {i} of {path} is a {type(row).__name__}, not an object with named fields",
                              "store one object per example, e.g. {\"prompt\": ..., \"response\": ...}")
    return rows


def _read_parquet(path: Path) -> list[Any]:
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise ArcherError(f"{path} is not a readable parquet file ({exc})",
                          "rewrite it, e.g. pandas.DataFrame(rows).to_parquet(path)") from exc


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ArcherError(f"line {number} of {path} is not valid JSON ({exc})",
                              "write one JSON object per line") from exc
    return rows


def _read_json(path: Path) -> list[Any]:
    return read_json(path, list, "a list of examples",
                     "write a JSON list of objects, or one object a line in a .jsonl file")


# -- tokenising ------------------------------------------------------------------------------------
class SFTDataset:
    """Tokenised SFT examples; item ``i`` is ``{"input_ids", "loss_mask"}`` (1-D int64 tensors), where
    ``loss_mask[t] = 1`` marks a token the model learns to produce (an assistant token). ``where[i]`` names
    example ``i`` in messages (its row and file)."""

    def __init__(
        self,
        conversations: Sequence[Conversation],
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_length: int,
        truncation: str = "error",
        tool_result_tag: str | None = "result",
        where: Sequence[str] | None = None,
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ArcherError(f"data.truncation={truncation!r} is not a truncation mode",
                              f"use one of {list(TRUNCATION_MODES)}")
        if max_length <= 0:
            raise ArcherError(f"data.max_length={max_length} must be positive",
                              "set data.max_length to the longest example (prompt + response, in tokens)")
        if not tokenizer.chat_template:
            raise ArcherError(f"the tokenizer ({tokenizer.name_or_path or type(tokenizer).__name__}) has no chat template",
                              "start from a chat/instruct model (model.partial_pretrain) whose tokenizer has one")
        if tool_result_tag is not None and not re.fullmatch(r"[\w.-]+", str(tool_result_tag)):
            raise ArcherError(f"data.tool_result_tag={tool_result_tag!r} is not a tag name",
                              "use a name such as result (for <result>...</result>), or null to train on tool output")
        self.tokenizer = tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.where = list(where) if where is not None else [f"SFT row {i}" for i in range(len(conversations))]
        calls_rendered = renders_tool_calls(tokenizer)
        segments = []
        for conversation, name in zip(conversations, self.where, strict=True):
            messages = conversation.messages if calls_rendered else [_calls_as_text(m) for m in conversation.messages]
            pieces = assistant_segments(tokenizer, messages, conversation.trained, where=name, tools=conversation.tools)
            segments.append(split_tool_results(pieces, tool_result_tag, where=name))
        self.num_truncated = 0
        self._items = [self._tokenise(segs, name, max_length, truncation) for segs, name in zip(segments, self.where,
                                                                                                 strict=True)]
        no_loss = sum(1 for item in self._items if not item["loss_mask"].any())
        logger.info("SFT dataset: %d examples, %d truncated (%s), %d without any response token left",
                    len(self._items), self.num_truncated, truncation, no_loss)

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, *,
                  row_format: RowFormat | None = None, prompt_key: str = "prompt", response_key: str = "response",
                  multiturn: bool = False, messages_key: str = "messages", tools_key: str = "tools",
                  **kwargs: Any) -> SFTDataset:
        """The dataset of rows in ``row_format`` (default: as ``data_row_format`` picks from the keys)."""
        where = [f"SFT row {i}" for i in range(len(rows))]
        fmt = row_format or data_row_format(rows[0] if rows else {}, "auto", where="SFT row 0", prompt_key=prompt_key,
                                            response_key=response_key, multiturn=multiturn,
                                            messages_key=messages_key, tools_key=tools_key)
        return cls([fmt.conversation(row, name) for row, name in zip(rows, where, strict=True)], tokenizer,
                   where=where, **kwargs)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self._items[i]

    def collate(self, items: Sequence[dict[str, torch.Tensor]]) -> Batch:
        """Right-padded batch: input_ids, attention_mask, position_ids, loss_mask (all [B, T] int64)."""
        return collate_sft(items, self.pad_token_id)

    def _tokenise(self, segments: list[tuple[str, bool]], where: str, max_length: int,
                  truncation: str) -> dict[str, torch.Tensor]:
        ids: list[int] = []
        mask: list[int] = []
        pieces = self.tokenizer([text for text, _ in segments], add_special_tokens=False)["input_ids"]
        for piece, (_, trained) in zip(pieces, segments, strict=True):
            ids.extend(piece)
            mask.extend([int(trained)] * len(piece))
        if len(ids) > max_length:
            if truncation == "error":
                raise ArcherError(f"{where} is {len(ids)} tokens long, more than data.max_length={max_length}",
                                  "raise data.max_length, or set data.truncation=left|right to cut over-long rows")
            self.num_truncated += 1
            ids, mask = truncate_ids(ids, max_length, truncation), truncate_ids(mask, max_length, truncation)
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}


def data_row_format(first_row: dict[str, Any], data_format: str, *, where: str, prompt_key: str, response_key: str,
                    multiturn: bool, messages_key: str, tools_key: str) -> RowFormat:
    """How a file's rows read under the data.* keys: ``data.format`` when set; with ``auto``, a message list
    under ``messages_key`` when data.multiturn.enable, else what the first row's fields show."""
    if multiturn and data_format in ("auto", "sharegpt"):
        return RowFormat.of("sharegpt", {"messages": messages_key, "tools": tools_key, "system": ""})
    if multiturn:
        raise ArcherError(f"data.multiturn.enable=true reads message lists, but data.format={data_format}",
                          "set data.format=auto (or sharegpt), or data.multiturn.enable=false")
    if data_format == "auto":
        return detect_format(first_row, prompt_key=prompt_key, response_key=response_key, messages_key=messages_key,
                             where=where)
    if data_format == "prompt_response":
        return RowFormat.of("prompt_response", {"prompt": prompt_key, "response": response_key})
    if data_format == "sharegpt":
        return RowFormat.of("sharegpt", {"messages": messages_key if messages_key in first_row else "conversations",
                                         "tools": tools_key})
    return RowFormat.of(data_format, where="data.format")


def renders_tool_calls(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template writes an assistant message's ``tool_calls`` (a probe call's name shows)."""
    call = {"type": "function", "function": {"name": _PROBE, "arguments": {}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "u"},
                                              {"role": "assistant", "content": "", "tool_calls": [call]}],
                                             tokenize=False)
    except (jinja2.TemplateError, TypeError, ValueError):
        return False
    return _PROBE in text


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """For a template that ignores ``tool_calls``: the calls as JSON lines after the message's text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    lines = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
             for c in calls]
    text = "\n".join([message["content"], *lines] if message.get("content") else lines)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def split_tool_results(segments: list[tuple[str, bool]], tag: str | None, *, where: str) -> list[tuple[str, bool]]:
    """``segments`` with every `` <tag>\\n...\\n</tag>`` span of a trained piece cut out as untrained pieces: the
    tool output a rollout loop appends (the space before it included), in the three pieces ARPO's loop tokenises
    apart (`` <tag>\\n``, the tool's answer, ``\\n</tag>``; each newline optional). ``tag=None`` changes nothing."""
    if tag is None:
        return segments
    span = re.compile(rf"( ?<{re.escape(tag)}>\n?)(.*?)(\n?</{re.escape(tag)}>)", re.DOTALL)
    out: list[tuple[str, bool]] = []
    for text, trained in segments:
        if not trained:
            out.append((text, False))
            continue
        cursor = 0
        for match in span.finditer(text):
            out += [(text[cursor:match.start()], True), *((piece, False) for piece in match.groups())]
            cursor = match.end()
        if f"<{tag}>" in text[cursor:]:
            raise ArcherError(f"an assistant turn of {where} opens <{tag}> and never closes it, so its tool output "
                              "cannot be told apart from the model's own text",
                              f"close each <{tag}> with </{tag}>, or set data.tool_result_tag=null to train on it")
        out.append((text[cursor:], True))
    return [(text, trained) for text, trained in out if text]


def assistant_segments(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], trained: list[int],
                       *, where: str, tools: list[dict[str, Any]] | None = None) -> list[tuple[str, bool]]:
    """The rendered conversation cut into ``(text, trained)`` pieces: each trained assistant turn is the
    text the template adds after the generation prompt, up to its end-of-turn token (whitespace after it
    is not trained). Needs a template that renders every prefix of the conversation as a prefix of the whole.
    ``tools`` (tool schemas) go to the template with every rendering."""
    full = _render(tokenizer, messages, False, where, tools)
    segments: list[tuple[str, bool]] = []
    cursor = 0
    for turn in trained:
        prompt = _render(tokenizer, messages[:turn], True, where, tools)
        through = _render(tokenizer, messages[: turn + 1], False, where, tools).rstrip()
        if not (through.startswith(prompt) and full.startswith(through) and len(prompt) >= cursor):
            raise ArcherError(
                f"the chat template does not render the conversation of {where} turn by turn (the text up to "
                f"assistant turn {turn} is not a prefix of the whole), so its tokens cannot be masked",
                "use a chat template that renders earlier turns unchanged (e.g. one that does not strip "
                "reasoning from past assistant turns)",
            )
        segments += [(full[cursor:len(prompt)], False), (full[len(prompt):len(through)], True)]
        cursor = len(through)
    segments.append((full[cursor:], False))
    return [(text, trained) for text, trained in segments if text]


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], add_generation_prompt: bool,
            where: str, tools: list[dict[str, Any]] | None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as exc:
        raise ArcherError(f"the chat template failed on the messages of {where}: {exc}",
                          "fix the messages of that row (roles the template accepts, in an order it accepts)") from exc


def collate_sft(items: Sequence[dict[str, torch.Tensor]], pad_token_id: int) -> Batch:
    """Right-pad ``input_ids`` with ``pad_token_id`` and ``loss_mask`` with 0; add attention_mask and
    position_ids (0, 1, ... over real tokens, 0 on padding)."""
    input_ids = pad_sequence([it["input_ids"] for it in items], batch_first=True, padding_value=pad_token_id)
    loss_mask = pad_sequence([it["loss_mask"] for it in items], batch_first=True, padding_value=0)
    attention_mask = pad_sequence([torch.ones_like(it["input_ids"]) for it in items], batch_first=True,
                                  padding_value=0)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0) * attention_mask
    return Batch(tensors={"input_ids": input_ids, "attention_mask": attention_mask,
                          "position_ids": position_ids, "loss_mask": loss_mask})


def pack_sft(items: Sequence[dict[str, torch.Tensor]], pad_token_id: int, capacity: int, *,
             unpacked_micro_batch_size: int = 1) -> Batch:
    """Several examples per row (``data.packing``): the items, longest first, each into the first row with room
    for it (rows of at most ``capacity`` tokens), right-padded to the longest row. ``position_ids`` restart at 0
    with every example (and on the padding), which is how the model keeps each example's attention to itself:
    the loss's pass reads the restarts as the examples' bounds and runs them through archer's attention
    (models/sequence_layout.py, ``ScoredRows``; a model that does not run it gets no attention mask, and
    transformers builds a block-diagonal one from the restarts). ``info["packed"]`` says so;
    ``info["token_slots_unpacked"]`` is what the items would cost unpacked, ``unpacked_micro_batch_size`` rows a
    forward pass (``token_slots``)."""
    lengths = [len(it["input_ids"]) for it in items]
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(items)), key=lambda i: -lengths[i]):
        if lengths[i] > capacity:
            raise ValueError(f"an example of {lengths[i]} tokens does not fit a packed row of {capacity}")
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    width = max(capacity - free for free in room)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for r, members in enumerate(rows):
        cursor = 0
        for i in members:
            span = slice(cursor, cursor + lengths[i])
            input_ids[r, span], loss_mask[r, span] = items[i]["input_ids"], items[i]["loss_mask"]
            attention_mask[r, span] = 1
            position_ids[r, span] = torch.arange(lengths[i])
            cursor += lengths[i]
        position_ids[r, cursor:] = torch.arange(width - cursor)
    return Batch(tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                          "loss_mask": loss_mask},
                 info={"packed": True, "token_slots_unpacked": token_slots(lengths, unpacked_micro_batch_size)})


def token_slots(lengths: Sequence[int], micro_batch_size: int) -> int:
    """Token positions the model computes for rows of these lengths, ``micro_batch_size`` rows a forward pass,
    each padded to the longest of its micro-batch."""
    chunks = [lengths[i:i + micro_batch_size] for i in range(0, len(lengths), micro_batch_size)]
    return sum(len(chunk) * max(chunk) for chunk in chunks)
