"""Reading RL prompt files in verl's schema into plain Python rows, and refusing files the trainer cannot use.

A file is parquet, or JSON (``.json``: a JSON array of row objects, or one object per line as Archer2.0's files
are; ``.jsonl``: one object per line) with the same schema. Owns the normalisation of one row: ``prompt``
becomes a list of ``{"role", "content"}`` messages, ``reward_model`` and ``extra_info`` become dicts and
``ability`` a string, whether the file stores them as lists/structs or as the string repr of the Python
list/dict (as ARPO's released files do). A row without ``reward_model.ground_truth`` takes its top-level
``answer`` as the ground truth; a row's ``tools`` (the names of the configured tools it may call, as a list, a
list of ``{"name": ...}`` / ``{"function": {"name": ...}}`` schemas, or the string repr of one) becomes a list
of names, or None when the row has no ``tools`` (every tool). A file without rows, without a needed column, or
(when asked) with rows that have no ground truth is an error naming the file.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from archer.errors import ArcherError

REQUIRED_COLUMNS = ("data_source",)
JSON_SUFFIXES = (".json", ".jsonl")
DICT_COLUMNS = ("reward_model", "extra_info")


def read_rl_parquet(path: str | Path, *, prompt_key: str = "prompt", reward_fn_key: str = "data_source",
                    require_ground_truth: bool = False) -> list[dict[str, Any]]:
    """Rows of one RL file (parquet, .json or .jsonl) with prompt, reward_model, extra_info, ability and tools
    normalised.

    ``prompt_key`` and ``reward_fn_key`` name columns the file must have; with ``require_ground_truth`` every
    row must have a ``reward_model.ground_truth`` (or an ``answer``) that is not null.
    """
    raw_rows, columns = _read_rows(Path(path))
    if not raw_rows:
        raise ArcherError(f"{path} has no rows", "write the prompts into it, or leave it out of "
                          "data.train_files / data.val_files")
    needed = dict.fromkeys((prompt_key, *REQUIRED_COLUMNS, reward_fn_key))
    missing = [c for c in needed if c not in columns]
    if missing:
        raise ArcherError(
            f"{path} has no column(s) {missing}; its columns are {columns}",
            "write the prompts in verl's schema (data_source, prompt, ability, reward_model, extra_info) "
            "or point data.prompt_key (the prompt) / data.reward_fn_key (what the reward routes on) at "
            "the file's columns",
        )
    rows = [_normalise_row(row, i, prompt_key, path) for i, row in enumerate(raw_rows)]
    if require_ground_truth:
        _check_ground_truth(rows, path, prompt_key)
    return rows


def read_rl_files(paths: str | Path | Iterable[str | Path], *, prompt_key: str = "prompt",
                  reward_fn_key: str = "data_source", require_ground_truth: bool = False) -> list[dict[str, Any]]:
    """Rows of one or several RL files (read as ``read_rl_parquet`` does), concatenated in order."""
    path_list = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not path_list:
        raise ArcherError("no data files were given",
                          "set data.train_files to a parquet / .json / .jsonl path or a list of them")
    rows: list[dict[str, Any]] = []
    for path in path_list:
        rows.extend(read_rl_parquet(path, prompt_key=prompt_key, reward_fn_key=reward_fn_key,
                                    require_ground_truth=require_ground_truth))
    return rows


def _check_ground_truth(rows: list[dict[str, Any]], path: str | Path, prompt_key: str) -> None:
    """Rows whose reward_model has no ground_truth (or a null one) are an error: the file, the count, the first."""
    missing = [i for i, row in enumerate(rows) if row["reward_model"].get("ground_truth") is None]
    if missing:
        first = missing[0]
        question = rows[first][prompt_key][-1]["content"]
        shown = question if len(question) <= 80 else question[:77] + "..."
        raise ArcherError(
            f"{path}: {len(missing)} of {len(rows)} rows have no reward_model.ground_truth; the first is row "
            f"{first} ({shown!r})",
            "store each row's answer as reward_model = {'ground_truth': ..., 'style': 'rule'} (or a top-level "
            "'answer'); for a reward "
            "that needs no ground truth set data.require_ground_truth=false (those rows then reach the reward "
            "with ground_truth=None)",
        )


def _read_rows(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a parquet or JSON file and its columns (for JSON: every key some row has, in first-seen order)."""
    if not path.is_file():
        raise ArcherError(
            f"data file {path} does not exist",
            "check the path in data.train_files / data.val_files (relative paths start from the working directory)",
        )
    if path.suffix.lower() in JSON_SUFFIXES:
        rows = _read_json(path)
        columns = list(dict.fromkeys(key for row in rows for key in row))
        for column in columns:  # a key some rows lack reads as null there, as a parquet column would
            for row in rows:
                row.setdefault(column, None)
        return rows, columns
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise ArcherError(
            f"{path} is not a readable parquet file ({exc})",
            "convert the data to parquet in verl's schema, e.g. pandas.DataFrame(rows).to_parquet(path), or "
            "write it as .json / .jsonl",
        ) from exc
    return table.to_pylist(), table.column_names


def _read_json(path: Path) -> list[dict[str, Any]]:
    """A JSON array of objects, or one object per line (.jsonl, and .json files written that way)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            if exc.msg != "Extra data":  # "Extra data": several values, one per line
                raise _json_error(path, f"line {exc.lineno}: {exc.msg}") from exc
        else:
            if not isinstance(data, list):
                raise _json_error(path, f"it holds a {type(data).__name__}, not an array of rows")
            return [_json_row(row, i, path) for i, row in enumerate(data)]
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(_json_row(json.loads(line), len(rows), path))
        except json.JSONDecodeError as exc:
            raise _json_error(path, f"line {number}: {exc.msg}") from exc
    return rows


def _json_row(row: Any, i: int, path: Path) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise _json_error(path, f"row {i} is a {type(row).__name__}, not an object")
    return row


def _json_error(path: Path, why: str) -> ArcherError:
    return ArcherError(f"{path} is not a readable JSON data file: {why}",
                       "write a JSON array of row objects (.json) or one row object per line (.json / .jsonl), "
                       "each in verl's schema (data_source, prompt, ability, reward_model, extra_info)")


def _normalise_row(row: dict[str, Any], i: int, prompt_key: str, path: str | Path) -> dict[str, Any]:
    out = dict(row)
    out[prompt_key] = _parse_prompt(row[prompt_key], i, path)
    for key in DICT_COLUMNS:
        out[key] = _parse_dict(row.get(key), key, i, path)
    out["ability"] = row.get("ability") or ""
    if out["reward_model"].get("ground_truth") is None and row.get("answer") is not None:
        out["reward_model"] = {**out["reward_model"], "ground_truth": row["answer"]}  # ARPO's rows
    out["tools"] = _parse_tools(row.get("tools"), i, path)
    return out


def _parse_literal(text: str) -> Any:
    """A Python literal (repr of a list/dict) or, failing that, JSON; ValueError when it is neither."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return json.loads(text)


def _parse_prompt(value: Any, i: int, path: str | Path) -> list[dict[str, str]]:
    if isinstance(value, str):
        text = value.strip()
        if not (text.startswith("[") and text.endswith("]")):
            return [{"role": "user", "content": value}]
        try:
            value = _parse_literal(text)
        except ValueError as exc:
            raise _prompt_error(i, path, f"its text looks like a message list but does not parse ({exc})") from exc
    if not isinstance(value, list) or not value:
        raise _prompt_error(i, path, f"it is a {type(value).__name__}, not a non-empty list of messages")
    for message in value:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise _prompt_error(i, path, f"message {message!r} lacks a string role and content")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _prompt_error(i: int, path: str | Path, why: str) -> ArcherError:
    return ArcherError(
        f"cannot read the prompt of row {i} in {path}: {why}",
        "store each prompt as a list of {'role': ..., 'content': ...} dicts (or its Python/JSON string), "
        "or as plain text for a single user message",
    )


def _parse_dict(value: Any, key: str, i: int, path: str | Path) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = _parse_literal(value)
        except ValueError as exc:
            raise _dict_error(key, i, path, f"its text does not parse ({exc})") from exc
    if not isinstance(value, dict):
        raise _dict_error(key, i, path, f"it is a {type(value).__name__}")
    return value


def _dict_error(key: str, i: int, path: str | Path, why: str) -> ArcherError:
    return ArcherError(
        f"cannot read {key} of row {i} in {path} as a dict: {why}",
        f"store {key} as a struct or as the Python/JSON string of a dict",
    )


def _parse_tools(value: Any, i: int, path: str | Path) -> list[str] | None:
    """The tool names a row may call: None (no ``tools``: every configured tool) or a list of names."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = _parse_literal(value)
        except ValueError as exc:
            raise _tools_error(i, path, f"its text does not parse ({exc})") from exc
    if not isinstance(value, list | tuple):
        raise _tools_error(i, path, f"it is a {type(value).__name__}")
    names = []
    for tool in value:
        if isinstance(tool, dict):
            tool = (tool.get("function") or {}).get("name") if isinstance(tool.get("function"), dict) \
                else tool.get("name")
        if not isinstance(tool, str) or not tool:
            raise _tools_error(i, path, f"entry {tool!r} names no tool")
        names.append(tool)
    return names


def _tools_error(i: int, path: str | Path, why: str) -> ArcherError:
    return ArcherError(
        f"cannot read the tools of row {i} in {path}: {why}",
        "store a row's tools as a list of tool names (e.g. ['python', 'search']) or of {'name': ...} schemas; "
        "leave the column out (or null) for rows that may use every configured tool",
    )
