"""Reading RL prompt files in verl's schema into plain Python rows, and refusing files the trainer cannot use.

Owns the normalisation of one row: ``prompt`` becomes a list of ``{"role", "content"}`` messages,
``reward_model`` and ``extra_info`` become dicts and ``ability`` a string, whether the file stores them as
parquet lists/structs or as the string repr of the Python list/dict (as ARPO's released files do). A file
without rows, without a needed column, or (when asked) with rows that have no ``reward_model.ground_truth``
is an error naming the file.
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
DICT_COLUMNS = ("reward_model", "extra_info")


def read_rl_parquet(path: str | Path, *, prompt_key: str = "prompt", reward_fn_key: str = "data_source",
                    require_ground_truth: bool = False) -> list[dict[str, Any]]:
    """Rows of one RL parquet file with prompt, reward_model, extra_info and ability normalised.

    ``prompt_key`` and ``reward_fn_key`` name columns the file must have; with ``require_ground_truth`` every
    row must have a ``reward_model.ground_truth`` that is not null.
    """
    table = _read_table(Path(path))
    if table.num_rows == 0:
        raise ArcherError(f"{path} has no rows", "write the prompts into it, or leave it out of "
                          "data.train_files / data.val_files")
    needed = dict.fromkeys((prompt_key, *REQUIRED_COLUMNS, reward_fn_key))
    missing = [c for c in needed if c not in table.column_names]
    if missing:
        raise ArcherError(
            f"{path} has no column(s) {missing}; its columns are {table.column_names}",
            "write the prompts in verl's schema (data_source, prompt, ability, reward_model, extra_info) "
            "or point data.prompt_key (the prompt) / data.reward_fn_key (what the reward routes on) at "
            "the file's columns",
        )
    rows = [_normalise_row(row, i, prompt_key, path) for i, row in enumerate(table.to_pylist())]
    if require_ground_truth:
        _check_ground_truth(rows, path, prompt_key)
    return rows


def read_rl_files(paths: str | Path | Iterable[str | Path], *, prompt_key: str = "prompt",
                  reward_fn_key: str = "data_source", require_ground_truth: bool = False) -> list[dict[str, Any]]:
    """Rows of one or several RL parquet files (read as ``read_rl_parquet`` does), concatenated in order."""
    path_list = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not path_list:
        raise ArcherError("no data files were given", "set data.train_files to a parquet path or a list of them")
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
            "store each row's answer as reward_model = {'ground_truth': ..., 'style': 'rule'}; for a reward "
            "that needs no ground truth set data.require_ground_truth=false (those rows then reach the reward "
            "with ground_truth=None)",
        )


def _read_table(path: Path) -> pa.Table:
    if not path.is_file():
        raise ArcherError(
            f"data file {path} does not exist",
            "check the path in data.train_files / data.val_files (relative paths start from the working directory)",
        )
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise ArcherError(
            f"{path} is not a readable parquet file ({exc})",
            "convert the data to parquet in verl's schema, e.g. pandas.DataFrame(rows).to_parquet(path)",
        ) from exc


def _normalise_row(row: dict[str, Any], i: int, prompt_key: str, path: str | Path) -> dict[str, Any]:
    out = dict(row)
    out[prompt_key] = _parse_prompt(row[prompt_key], i, path)
    for key in DICT_COLUMNS:
        out[key] = _parse_dict(row.get(key), key, i, path)
    out["ability"] = row.get("ability") or ""
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
