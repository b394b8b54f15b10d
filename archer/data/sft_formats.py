"""The SFT data formats users have, read into one form: a ``Conversation`` (chat messages, which of them are
trained, the row's tool schemas).

- ``prompt_response``: a prompt (message list, its string, or plain text) and a response string (verl's SFT data).
- ``alpaca`` (LLaMA-Factory): ``instruction`` + ``input`` (joined by a newline) as the user turn, ``output`` as
  the trained answer, an optional ``system`` prompt and ``history`` of earlier ``[query, answer]`` pairs (their
  answers trained too, as LLaMA-Factory does).
- ``sharegpt`` (LLaMA-Factory): a message list (``conversations``) whose speakers are named by tags: human/user,
  gpt/assistant (trained), ``function_call`` (a tool call, trained, kept as the message's ``tool_calls`` so the
  chat template renders it), ``observation`` (a tool answer, not trained), system; an optional ``system`` column
  and a ``tools`` column of tool schemas. Messages in OpenAI's role/content form read the same way.

Each format's fields are named by ``columns`` (LLaMA-Factory's ``dataset_info.json`` keys: prompt, query,
response, history, messages, system, tools) and, for sharegpt, its speakers by ``tags`` (role_tag, content_tag,
user_tag, assistant_tag, observation_tag, function_tag, system_tag). ``read_dataset_info`` reads such a file.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archer.errors import ArcherError

FORMATS = ("auto", "prompt_response", "alpaca", "sharegpt")
DEFAULT_COLUMNS = {
    "prompt_response": {"prompt": "prompt", "response": "response"},
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
               "history": "history", "tools": "tools"},
    "sharegpt": {"messages": "conversations", "system": "system", "tools": "tools"},
}
REQUIRED_COLUMNS = {"prompt_response": ("prompt", "response"), "alpaca": ("prompt", "response"),
                    "sharegpt": ("messages",)}
DEFAULT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
# speakers understood when no tags are given: ShareGPT's, and the chat roles some ShareGPT files use instead
AUTO_SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                 "function_call": "function_call", "observation": "tool", "tool": "tool", "system": "system"}
_TAG_ROLES = {"user_tag": "user", "assistant_tag": "assistant", "function_tag": "function_call",
              "observation_tag": "tool", "system_tag": "system"}


@dataclass(frozen=True)
class Conversation:
    """Chat messages (``role``/``content``, assistant tool calls as ``tool_calls``), the indices of the trained
    (assistant) messages, and the tool schemas the chat template gets as ``tools``."""

    messages: list[dict[str, Any]]
    trained: list[int]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class RowFormat:
    """How the rows of one file hold a conversation: the format, its column names and (sharegpt) speaker tags.
    ``tags=None`` reads the role/content or from/value keys and every speaker of ``AUTO_SPEAKERS``."""

    name: str
    columns: Mapping[str, str] = field(default_factory=dict)
    tags: Mapping[str, str] | None = None

    @classmethod
    def of(cls, name: str, columns: Mapping[str, str] | None = None, tags: Mapping[str, str] | None = None,
           *, where: str = "the data") -> RowFormat:
        """The format ``name`` with its default columns overridden by ``columns``; unknown names are errors."""
        if name not in DEFAULT_COLUMNS:
            raise ArcherError(f"{where}: the SFT data format {name!r} is not known",
                              f"{nearest_format(name)}use one of {list(FORMATS)} (LLaMA-Factory's formatting: alpaca "
                              "or sharegpt)")
        unknown = sorted(set(columns or {}) - set(DEFAULT_COLUMNS[name]))
        if unknown:
            raise ArcherError(f"{where}: the {name} format has no column(s) {unknown}",
                              f"name only these columns: {sorted(DEFAULT_COLUMNS[name])}")
        if tags is not None:
            bad = sorted(set(tags) - set(DEFAULT_TAGS))
            if bad:
                raise ArcherError(f"{where}: unknown sharegpt tag(s) {bad}", f"use only {sorted(DEFAULT_TAGS)}")
            tags = {**DEFAULT_TAGS, **tags}
        return cls(name, {**DEFAULT_COLUMNS[name], **(columns or {})}, tags)

    def conversation(self, row: Mapping[str, Any], where: str) -> Conversation:
        """The conversation of one row; a missing required field or a malformed value is an ArcherError."""
        missing = [self.columns[c] for c in REQUIRED_COLUMNS[self.name] if self.columns[c] not in row]
        if missing:
            fix = ("name the fields that hold the data (data.prompt_key / data.response_key, "
                   "data.multiturn.messages_key, or the columns of dataset_info.json), or fix the row")
            other = _default_format(row)
            if other not in (None, self.name):
                fix = f"its fields are {other} data: set data.format={other} (or auto, which reads each file's format " \
                      f"from its first row), or {fix}"
            raise ArcherError(f"{where} has no field(s) {missing} (read as {self.name} data); its fields are "
                              f"{sorted(row)}", fix)
        if self.name == "prompt_response":
            return self._prompt_response(row, where)
        if self.name == "alpaca":
            return self._alpaca(row, where)
        return self._sharegpt(row, where)

    def _field(self, row: Mapping[str, Any], column: str) -> Any:
        name = self.columns.get(column)
        return row.get(name) if name else None

    def _prompt_response(self, row: Mapping[str, Any], where: str) -> Conversation:
        messages = [*to_messages(row[self.columns["prompt"]], plain_text_ok=True, where=where),
                    {"role": "assistant", "content": _text(row[self.columns["response"]], "response", where)}]
        return Conversation(messages, [len(messages) - 1])

    def _alpaca(self, row: Mapping[str, Any], where: str) -> Conversation:
        messages = _system(self._field(row, "system"), where)
        for pair in _history(self._field(row, "history"), where):
            messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
        instruction = _text(row[self.columns["prompt"]], "instruction", where)
        query = self._field(row, "query")
        query = _text(query, "input", where) if query is not None else ""
        messages += [{"role": "user", "content": f"{instruction}\n{query}" if query else instruction},
                     {"role": "assistant", "content": _text(row[self.columns["response"]], "output", where)}]
        trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        return Conversation(messages, trained, parse_tools(self._field(row, "tools"), where))

    def _sharegpt(self, row: Mapping[str, Any], where: str) -> Conversation:
        messages = [self._message(m, where) for m in _message_list(row[self.columns["messages"]], False, where)]
        if not messages or messages[0]["role"] != "system":
            messages = _system(self._field(row, "system"), where) + messages
        trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not trained:
            raise ArcherError(f"{where} has no assistant message, so nothing would be learned from it",
                              "add the assistant turns to train on, or remove the row")
        return Conversation(messages, trained, parse_tools(self._field(row, "tools"), where))

    def _message(self, message: Any, where: str) -> dict[str, Any]:
        if not isinstance(message, dict):
            raise _messages_error(where, f"message {message!r} is not an object")
        tags = self.tags or DEFAULT_TAGS
        role_key, content_key = tags["role_tag"], tags["content_tag"]
        if self.tags is None and role_key not in message and "role" in message:
            role_key, content_key = "role", "content"  # OpenAI's form
        speaker = message.get(role_key)
        speakers = AUTO_SPEAKERS if self.tags is None else {self.tags[t]: r for t, r in _TAG_ROLES.items()}
        if self.tags is None and role_key == "role" and isinstance(speaker, str) and speaker not in speakers:
            speakers = {**speakers, speaker: speaker}  # a message list in role/content form keeps any chat role
        role = speakers.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise _messages_error(where, f"speaker {speaker!r} (key {role_key!r}) is not one of {sorted(speakers)}")
        content = message.get(content_key)
        if not (content is None or isinstance(content, str)):
            raise _messages_error(where, f"message {message!r} has a non-string {content_key!r}")
        if role == "function_call":
            return {"role": "assistant", "content": "", "tool_calls": parse_tool_calls(content or "", where)}
        extra = {k: v for k, v in message.items() if k not in (role_key, content_key)} if role_key == "role" else {}
        return {**extra, "role": role, "content": content or ""}


def to_messages(value: Any, *, plain_text_ok: bool, where: str) -> list[dict[str, Any]]:
    """A message list (role/content, or ShareGPT's from/value) from a list of dicts, its Python/JSON string,
    or (if allowed) plain text for one user message."""
    reader = RowFormat.of("sharegpt")
    return [reader._message(m, where) for m in _message_list(value, plain_text_ok, where)]


def _message_list(value: Any, plain_text_ok: bool, where: str) -> list[Any]:
    if isinstance(value, str):
        text = value.strip()
        if not (text.startswith("[") and text.endswith("]")):
            if plain_text_ok:
                return [{"role": "user", "content": value}]
            raise _messages_error(where, "it is plain text, not a list of messages")
        value = _parse_literal(text, where)
    if not isinstance(value, list) or not value:
        raise _messages_error(where, f"it is a {type(value).__name__}, not a non-empty list of messages")
    return value


def parse_tool_calls(text: str, where: str) -> list[dict[str, Any]]:
    """A function_call turn's calls (a JSON object ``{"name", "arguments"}`` or a list of them) as chat-template
    ``tool_calls`` entries; arguments given as JSON text are parsed."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ArcherError(f"the function_call of {where} is not JSON ({exc}): {text[:80]!r}",
                          'write each call as {"name": ..., "arguments": {...}} (or a list of them)') from exc
    calls = value if isinstance(value, list) else [value]
    out = []
    for call in calls:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            raise ArcherError(f"a function_call of {where} has no string \"name\": {call!r}",
                              'write each call as {"name": ..., "arguments": {...}}')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # free-text arguments stay text
                arguments = json.loads(arguments)
        out.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
    return out


def parse_tools(value: Any, where: str) -> list[dict[str, Any]] | None:
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


def detect_format(row: Mapping[str, Any], *, prompt_key: str, response_key: str, messages_key: str,
                  where: str) -> RowFormat:
    """The format of a file from its first row: the prompt/response keys, alpaca's instruction/output,
    or a message list under ``messages_key`` or ``conversations``."""
    if prompt_key in row and response_key in row:
        return RowFormat.of("prompt_response", {"prompt": prompt_key, "response": response_key})
    if "instruction" in row and "output" in row:
        return RowFormat.of("alpaca")
    for key in (messages_key, "conversations", "messages"):
        if key in row:
            return RowFormat.of("sharegpt", {"messages": key})
    raise ArcherError(f"cannot tell the format of {where}: its fields are {sorted(row)}",
                      f"use {prompt_key!r}/{response_key!r} (data.prompt_key/response_key), alpaca's instruction/"
                      f"output, or a message list ({messages_key!r} or 'conversations'), or set data.format")


def nearest_format(name: str) -> str:
    """``did you mean 'sharegpt'? `` for the format nearest ``name`` (any case), or nothing when none is near."""
    near = difflib.get_close_matches(name.lower(), FORMATS, n=1, cutoff=0.6)
    return f"did you mean {near[0]!r}? " if near else ""


def _default_format(row: Mapping[str, Any]) -> str | None:
    """The format ``detect_format`` reads a row as with the default keys, or None when it cannot tell."""
    try:
        return detect_format(row, prompt_key="prompt", response_key="response", messages_key="messages",
                             where="").name
    except ArcherError:
        return None


@dataclass(frozen=True)
class DatasetEntry:
    """One dataset of a dataset_info.json: its file and how its rows read."""

    name: str
    path: Path
    row_format: RowFormat


def read_dataset_info(path: str | Path, names: list[str]) -> list[DatasetEntry]:
    """The datasets ``names`` of a LLaMA-Factory dataset_info.json (``file_name`` relative to its folder,
    ``formatting`` alpaca (default) or sharegpt, optional ``columns`` and ``tags``)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ArcherError(f"data.dataset_info={path} does not exist", "point it at a LLaMA-Factory dataset_info.json")
    info = read_json(path, dict, "an object of datasets", 'write {"name": {"file_name": ..., "formatting": ...}}')
    entries = []
    for name in names:
        spec = info.get(name)
        if not isinstance(spec, dict):
            raise ArcherError(f"dataset {name!r} is not described in {path} (it has: {sorted(info)})",
                              "list dataset names of that file in data.train_files / data.val_files")
        where = f"dataset {name!r} of {path}"
        unsupported = sorted(k for k in ("hf_hub_url", "ms_hub_url", "script_url", "cloud_file_name") if spec.get(k))
        if unsupported or spec.get("ranking"):
            raise ArcherError(f"{where} is a {'ranking dataset' if spec.get('ranking') else unsupported[0]} "
                              "entry; archer sft reads local SFT files only", "describe a local file with file_name")
        if not isinstance(spec.get("file_name"), str):
            raise ArcherError(f"{where} has no file_name", "add the data file's name, relative to the json's folder")
        file = path.parent / spec["file_name"]
        if not file.is_file():
            raise ArcherError(f"{where} names the file {file}, which does not exist",
                              "fix its file_name (relative to the folder of dataset_info.json) or add the file")
        formatting = spec.get("formatting", "alpaca")
        columns, tags = spec.get("columns") or {}, spec.get("tags")
        if not isinstance(columns, dict) or not (tags is None or isinstance(tags, dict)):
            raise ArcherError(f"{where}: columns and tags must be objects", 'e.g. "columns": {"messages": "conversations"}')
        ignored = sorted(set(columns) & {"images", "videos", "audios", "chosen", "rejected", "kto_tag"})
        if ignored:
            raise ArcherError(f"{where} maps {ignored}, which archer sft does not train on",
                              "remove those columns (text SFT only)")
        entries.append(DatasetEntry(name, file, RowFormat.of(formatting, columns, tags if formatting == "sharegpt"
                                                             else None, where=where)))
    return entries


def read_json(path: Path, kind: type, what: str, fix: str) -> Any:
    """The JSON value of ``path``, which must be a ``kind`` (``what`` names it in the error, ``fix`` says what to do)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ArcherError(f"{path} is not valid JSON ({exc})", fix) from exc
    if not isinstance(data, kind):
        raise ArcherError(f"{path} holds a JSON {type(data).__name__}, not {what}", fix)
    return data


def _text(value: Any, name: str, where: str) -> str:
    if not isinstance(value, str):
        raise ArcherError(f"the {name} of {where} is a {type(value).__name__}, not a string", f"store each {name} as text")
    return value


def _system(value: Any, where: str) -> list[dict[str, Any]]:
    if value is None or value == "":
        return []
    return [{"role": "system", "content": _text(value, "system prompt", where)}]


def _history(value: Any, where: str) -> list[tuple[str, str]]:
    if value is None or value == []:
        return []
    if not (isinstance(value, list) and all(isinstance(p, list | tuple) and len(p) == 2
                                            and all(isinstance(s, str) for s in p) for p in value)):
        raise ArcherError(f"the history of {where} is not a list of [query, answer] text pairs",
                          'store it as [["first question", "first answer"], ...] (or leave it empty)')
    return [(p[0], p[1]) for p in value]


def _parse_literal(text: str, where: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise _messages_error(where, f"its text looks like a message list but does not parse ({exc})") from exc


def _messages_error(where: str, why: str) -> ArcherError:
    return ArcherError(f"cannot read the messages of {where}: {why}",
                       "store messages as a list of {'role': ..., 'content': ...} dicts (or ShareGPT's "
                       "{'from': ..., 'value': ...}), or its JSON/Python string")
