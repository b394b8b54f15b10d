"""SFT data: reading prompt/response or multi-turn message files, and tokenising them with the chat
template so that only the assistant's tokens carry loss (``loss_mask`` 1), as verl's SFT datasets do.

Single-turn rows hold a prompt (a message list, its Python/JSON string, or plain text for one user message)
and a response string; the response is trained as the template renders an assistant turn, i.e. the text
followed by the template's end-of-turn token (``<|im_end|>`` for ChatML). Multi-turn rows hold a message
list (``role``/``content``, or ShareGPT's ``from``/``value``; LLaMA-Factory's ``function_call`` speaker is an
assistant turn, its ``observation`` a tool turn) and every assistant turn is trained; a row's tool schemas
(``data.multiturn.tools_key``) go to the chat template as ``tools``.

Tool output inside an assistant turn carries no loss: each `` <result>\\n...\\n</result>`` span (ARPO's format,
the tag named by ``data.tool_result_tag``; the space before it included) is what a rollout loop appends after a
call, so it is tokenised as the loop does (the frame `` <result>\\n``, the answer and ``\\n</result>`` apart,
never merged with the model's own text), with ``loss_mask`` 0.
"""

from __future__ import annotations

import ast
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
from archer.errors import ArcherError

logger = logging.getLogger("archer.data")

TRUNCATION_MODES = ("error", "left", "right")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool"}


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
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ArcherError(f"{path} is not valid JSON ({exc})", "write a JSON list of objects, or use .jsonl") from exc
    if not isinstance(data, list):
        raise ArcherError(f"{path} holds a JSON {type(data).__name__}, not a list of examples",
                          "write a JSON list of objects, or one object a line in a .jsonl file")
    return data


# -- messages --------------------------------------------------------------------------------------
def to_messages(value: Any, *, plain_text_ok: bool, where: str) -> list[dict[str, Any]]:
    """A message list from a list of dicts, its Python/JSON string, or (if allowed) plain text."""
    if isinstance(value, str):
        text = value.strip()
        if not (text.startswith("[") and text.endswith("]")):
            if plain_text_ok:
                return [{"role": "user", "content": value}]
            raise _messages_error(where, "it is plain text, not a list of messages")
        value = _parse_literal(text, where)
    if not isinstance(value, list) or not value:
        raise _messages_error(where, f"it is a {type(value).__name__}, not a non-empty list of messages")
    return [_to_message(m, where) for m in value]


def _parse_literal(text: str, where: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise _messages_error(where, f"its text looks like a message list but does not parse ({exc})") from exc


def _to_message(message: Any, where: str) -> dict[str, Any]:
    if isinstance(message, dict) and "from" in message and "role" not in message:
        role = SHAREGPT_ROLES.get(message["from"])
        if role is None:
            raise _messages_error(where, f"ShareGPT speaker {message['from']!r} is not one of {sorted(SHAREGPT_ROLES)}")
        message = {"role": role, "content": message.get("value")}
    if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
        raise _messages_error(where, f"message {message!r} has no string 'role'")
    content = message.get("content")
    if not (content is None or isinstance(content, str)):
        raise _messages_error(where, f"message {message!r} has a non-string 'content'")
    return {**message, "content": content or ""}


def _messages_error(where: str, why: str) -> ArcherError:
    return ArcherError(f"cannot read the messages of {where}: {why}",
                       "store messages as a list of {'role': ..., 'content': ...} dicts (or its JSON/Python string)")


# -- tokenising ------------------------------------------------------------------------------------
class SFTDataset:
    """Tokenised SFT examples; item ``i`` is ``{"input_ids", "loss_mask"}`` (1-D int64 tensors), where
    ``loss_mask[t] = 1`` marks a token the model learns to produce (an assistant token)."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_length: int,
        truncation: str = "error",
        prompt_key: str = "prompt",
        response_key: str = "response",
        multiturn: bool = False,
        messages_key: str = "messages",
        tools_key: str = "tools",
        tool_result_tag: str | None = "result",
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
        self.tokenizer = tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if tool_result_tag is not None and not re.fullmatch(r"[\w.-]+", str(tool_result_tag)):
            raise ArcherError(f"data.tool_result_tag={tool_result_tag!r} is not a tag name",
                              "use a name such as result (for <result>...</result>), or null to train on tool output")
        keys = (messages_key,) if multiturn else (prompt_key, response_key)
        segments = [split_tool_results(_row_segments(tokenizer, row, i, keys, multiturn, tools_key), tool_result_tag,
                                       where=f"SFT row {i}") for i, row in enumerate(rows)]
        self.num_truncated = 0
        self._items = [self._tokenise(segs, i, max_length, truncation) for i, segs in enumerate(segments)]
        no_loss = sum(1 for item in self._items if not item["loss_mask"].any())
        logger.info("SFT dataset: %d examples, %d truncated (%s), %d without any response token left",
                    len(self._items), self.num_truncated, truncation, no_loss)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self._items[i]

    def collate(self, items: Sequence[dict[str, torch.Tensor]]) -> Batch:
        """Right-padded batch: input_ids, attention_mask, position_ids, loss_mask (all [B, T] int64)."""
        return collate_sft(items, self.pad_token_id)

    def _tokenise(self, segments: list[tuple[str, bool]], index: int, max_length: int,
                  truncation: str) -> dict[str, torch.Tensor]:
        ids: list[int] = []
        mask: list[int] = []
        pieces = self.tokenizer([text for text, _ in segments], add_special_tokens=False)["input_ids"]
        for piece, (_, trained) in zip(pieces, segments, strict=True):
            ids.extend(piece)
            mask.extend([int(trained)] * len(piece))
        if len(ids) > max_length:
            if truncation == "error":
                raise ArcherError(f"SFT row {index} is {len(ids)} tokens long, more than data.max_length={max_length}",
                                  "raise data.max_length, or set data.truncation=left|right to cut over-long rows")
            self.num_truncated += 1
            ids, mask = truncate_ids(ids, max_length, truncation), truncate_ids(mask, max_length, truncation)
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}


def _row_segments(tokenizer: PreTrainedTokenizerBase, row: dict[str, Any], index: int,
                  keys: tuple[str, ...], multiturn: bool, tools_key: str) -> list[tuple[str, bool]]:
    missing = [k for k in keys if k not in row]
    if missing:
        key_names = "data.multiturn.messages_key" if multiturn else "data.prompt_key / data.response_key"
        raise ArcherError(f"SFT row {index} has no field(s) {missing}; its fields are {sorted(row)}",
                          f"point {key_names} at the fields that hold the data")
    where = f"SFT row {index}"
    if multiturn:
        messages = to_messages(row[keys[0]], plain_text_ok=False, where=where)
        trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not trained:
            raise ArcherError(f"{where} has no assistant message, so nothing would be learned from it",
                              "add the assistant turns to train on, or remove the row")
    else:
        response = row[keys[1]]
        if not isinstance(response, str):
            raise ArcherError(f"the response of {where} is a {type(response).__name__}, not a string",
                              "store each response as text")
        messages = [*to_messages(row[keys[0]], plain_text_ok=True, where=where),
                    {"role": "assistant", "content": response}]
        trained = [len(messages) - 1]
    tools = _tools(row.get(tools_key), where) if multiturn else None
    return assistant_segments(tokenizer, messages, trained, where=where, tools=tools)


def _tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """A row's tool schemas (a list of dicts or its JSON text, as LLaMA-Factory stores them); None when absent."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ArcherError(f"the tools of {where} are not valid JSON ({exc})",
                              "store the tool schemas as a JSON list of objects (or leave the field empty)") from exc
    if not (isinstance(value, list) and all(isinstance(t, dict) for t in value)):
        raise ArcherError(f"the tools of {where} are a {type(value).__name__}, not a list of tool schemas",
                          "store the tool schemas as a list of objects (or its JSON text)")
    return value


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
