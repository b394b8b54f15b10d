"""Tests for archer.data.parquet: both prompt encodings, defaults, multi-file reading and every error."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from archer.data.parquet import read_rl_files, read_rl_parquet
from archer.errors import ArcherError

ARPO = Path(__file__).resolve().parents[2] / "shared" / "data" / "arpo"
VALID = ARPO / "valid.parquet"
GAIA = ARPO / "gaia_test.parquet"
needs_real_data = pytest.mark.skipif(not VALID.is_file(), reason="shared ARPO data not present")


def _write(path: Path, columns: dict[str, list]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


@needs_real_data
def test_real_structured_file_is_read_field_by_field() -> None:
    rows = read_rl_parquet(VALID)
    assert len(rows) == 180
    first, last = rows[0], rows[179]
    assert first["data_source"] == "DR_grpo_mix"
    assert first["ability"] == "qa"
    assert [m["role"] for m in first["prompt"]] == ["system", "user"]
    assert first["prompt"][0]["content"].startswith("You are a helpful assistant that can solve the given questio")
    assert len(first["prompt"][0]["content"]) == 1146
    assert first["prompt"][1] == {
        "role": "user", "content": "Who is older, William Henry Rodes Green or Eleanor Of Lancaster?",
    }
    assert first["reward_model"] == {"ground_truth": "Eleanor Of Lancaster", "style": "rule"}
    assert first["extra_info"] == {
        "index": 0, "need_tools_kwargs": True, "split": "valid",
        "question": "Who is older, William Henry Rodes Green or Eleanor Of Lancaster?",
    }
    assert last["ability"] == "math"
    assert last["reward_model"] == {"ground_truth": "1+274i", "style": "rule"}
    assert last["extra_info"]["index"] == 179
    assert sum(r["ability"] == "math" for r in rows) == 100


@needs_real_data
def test_real_rows_stored_as_string_repr_read_the_same(tmp_path: Path) -> None:
    table = pq.read_table(VALID).slice(0, 12)
    as_text = table.to_pydict()
    for key in ("prompt", "reward_model", "extra_info"):
        as_text[key] = [repr(v) for v in as_text[key]]
    path = _write(tmp_path / "repr.parquet", {k: v for k, v in as_text.items() if k != "metadata"})
    assert pq.read_schema(path).field("prompt").type == pa.string()
    structured = read_rl_parquet(VALID)[:12]
    for row in structured:
        del row["metadata"]
    assert read_rl_parquet(path) == structured


@needs_real_data
def test_real_file_with_null_ability_defaults_to_empty_string() -> None:
    rows = read_rl_parquet(GAIA)
    assert len(rows) == 103
    assert rows[0]["ability"] == ""
    assert rows[0]["reward_model"] == {"ground_truth": "34689"}
    assert rows[0]["data_source"] == "DR_gaia"


def test_string_repr_plain_text_and_json_encodings(tmp_path: Path) -> None:
    path = _write(tmp_path / "small.parquet", {
        "data_source": ["gsm8k", "countdown", "math"],
        "prompt": [
            "[{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'What is 2+2?'}]",
            "Make 24 from 3 8 1",
            '[{"role": "user", "content": "Solve x+1=3"}]',
        ],
        "reward_model": ["{'ground_truth': '4', 'style': 'rule'}", None, '{"ground_truth": "2", "exact": true}'],
    })
    rows = read_rl_parquet(path)
    assert rows[0]["prompt"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
    ]
    assert rows[1]["prompt"] == [{"role": "user", "content": "Make 24 from 3 8 1"}]
    assert rows[2]["prompt"] == [{"role": "user", "content": "Solve x+1=3"}]
    assert rows[0]["reward_model"] == {"ground_truth": "4", "style": "rule"}
    assert rows[1]["reward_model"] == {}
    assert rows[2]["reward_model"] == {"ground_truth": "2", "exact": True}
    assert [r["extra_info"] for r in rows] == [{}, {}, {}]
    assert [r["ability"] for r in rows] == ["", "", ""]
    assert [r["data_source"] for r in rows] == ["gsm8k", "countdown", "math"]


def test_custom_prompt_key_and_extra_message_keys_dropped(tmp_path: Path) -> None:
    path = _write(tmp_path / "q.parquet", {
        "data_source": ["a"],
        "question": [[{"role": "user", "content": "hi", "name": "bob"}]],
        "extra_info": ["{'index': 7}"],
    })
    (row,) = read_rl_parquet(path, prompt_key="question")
    assert row["question"] == [{"role": "user", "content": "hi"}]
    assert row["extra_info"] == {"index": 7}


def test_read_rl_files_concatenates_in_order(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.parquet", {"data_source": ["a0", "a1"], "prompt": ["x", "y"]})
    b = _write(tmp_path / "b.parquet", {"data_source": ["b0"], "prompt": ["z"]})
    assert [r["data_source"] for r in read_rl_files([a, str(b)])] == ["a0", "a1", "b0"]
    assert [r["data_source"] for r in read_rl_files(b)] == ["b0"]


def test_no_files_is_an_error() -> None:
    with pytest.raises(ArcherError, match="no data files") as info:
        read_rl_files([])
    assert "data.train_files" in info.value.fix


def test_missing_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.parquet"
    with pytest.raises(ArcherError) as info:
        read_rl_parquet(missing)
    assert str(missing) in info.value.problem
    assert "does not exist" in info.value.problem
    assert "data.train_files" in info.value.fix


def test_unreadable_parquet(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    path.write_text("data_source,prompt\na,b\n")
    with pytest.raises(ArcherError) as info:
        read_rl_parquet(path)
    assert "is not a readable parquet file" in info.value.problem
    assert str(path) in info.value.problem
    assert "to_parquet" in info.value.fix


@pytest.mark.parametrize(("columns", "missing"), [
    ({"data_source": ["a"], "question": ["hi"]}, "['prompt']"),
    ({"prompt": ["hi"], "source": ["a"]}, "['data_source']"),
])
def test_missing_column_names_columns_present(tmp_path: Path, columns: dict, missing: str) -> None:
    path = _write(tmp_path / "cols.parquet", columns)
    with pytest.raises(ArcherError) as info:
        read_rl_parquet(path)
    assert f"has no column(s) {missing}" in info.value.problem
    assert f"its columns are {list(columns)}" in info.value.problem
    assert "data.prompt_key" in info.value.fix


@pytest.mark.parametrize(("prompt", "why"), [
    ("[{'role': 'user', 'content': 'unclosed}]", "does not parse"),
    ("[]", "not a non-empty list of messages"),
    ("[{'role': 'user'}]", "lacks a string role and content"),
    ("['just text']", "lacks a string role and content"),
])
def test_unparsable_prompt_names_the_row(tmp_path: Path, prompt: str, why: str) -> None:
    path = _write(tmp_path / "p.parquet", {"data_source": ["a", "b"], "prompt": ["fine", prompt]})
    with pytest.raises(ArcherError) as info:
        read_rl_parquet(path)
    assert info.value.problem.startswith(f"cannot read the prompt of row 1 in {path}")
    assert why in info.value.problem
    assert "'role'" in info.value.fix


@pytest.mark.parametrize(("value", "why"), [("{'ground_truth': ", "does not parse"), ("['4']", "it is a list")])
def test_reward_model_that_is_not_a_dict_names_the_row(tmp_path: Path, value: str, why: str) -> None:
    path = _write(tmp_path / "r.parquet", {"data_source": ["a"], "prompt": ["hi"], "reward_model": [value]})
    with pytest.raises(ArcherError) as info:
        read_rl_parquet(path)
    assert info.value.problem.startswith(f"cannot read reward_model of row 0 in {path} as a dict")
    assert why in info.value.problem
    assert "string of a dict" in info.value.fix


# -- JSON / JSON lines (Archer2.0's files), ARPO's answer and per-row tools ----------------------------------
def _json_rows() -> list[dict]:
    return [
        {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "1+1?"}], "ability": "math",
         "reward_model": {"ground_truth": "2", "style": "rule"}, "extra_info": {"index": 0}},
        {"data_source": "hotpotqa", "prompt": "[{'role': 'user', 'content': 'Who?'}]",
         "reward_model": "{'ground_truth': 'Ann'}", "extra_info": None},
    ]


@pytest.mark.parametrize("layout", ["array.json", "lines.json", "lines.jsonl"])
def test_json_files_read_as_parquet_does(tmp_path: Path, layout: str) -> None:
    rows = _json_rows()
    path = tmp_path / layout
    if layout == "array.json":
        path.write_text(json.dumps(rows, indent=1))
    else:
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a blank line is skipped
    as_parquet = _write(tmp_path / "same.parquet", {k: [json.dumps(r.get(k)) if isinstance(r.get(k), dict | list)
                                                        else r.get(k) for r in rows] for k in rows[0]})
    got = read_rl_parquet(path)
    assert got == read_rl_parquet(as_parquet)
    assert got[0]["prompt"] == [{"role": "user", "content": "1+1?"}]
    assert got[1]["prompt"] == [{"role": "user", "content": "Who?"}]
    assert got[1]["reward_model"] == {"ground_truth": "Ann"} and got[1]["extra_info"] == {}
    assert got[1]["ability"] == "" and got[0]["tools"] is None
    assert read_rl_files([path, path]) == got + got


@needs_real_data
def test_real_rows_written_as_json_lines_read_the_same(tmp_path: Path) -> None:
    rows = pq.read_table(VALID).slice(0, 20).to_pylist()
    path = tmp_path / "valid.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_rl_parquet(path, require_ground_truth=True) == read_rl_parquet(VALID)[:20]


@pytest.mark.parametrize(("name", "text", "why"), [
    ("broken.json", '[{"data_source": "a", "prompt": "hi"},\n {"data_source": ', "line 2: Expecting value"),
    ("object.json", '{"data_source": "a", "prompt": "hi"}', "it holds a dict, not an array of rows"),
    ("scalar.json", '[{"data_source": "a", "prompt": "hi"}, 3]', "row 1 is a int, not an object"),
    ("broken.jsonl", '{"data_source": "a", "prompt": "hi"}\n{"data_source": "b", ', "line 2: Expecting"),
    ("list.jsonl", '{"data_source": "a", "prompt": "hi"}\n["b"]\n', "row 1 is a list, not an object"),
])
def test_unreadable_json_names_the_file_and_the_place(tmp_path: Path, name: str, text: str, why: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ArcherError) as info:
        read_rl_parquet(path)
    assert info.value.problem.startswith(f"{path} is not a readable JSON data file: ")
    assert why in info.value.problem
    assert ".jsonl" in info.value.fix


def test_bad_json_rows_get_the_errors_of_parquet_rows(tmp_path: Path) -> None:
    bad_prompt = tmp_path / "p.jsonl"
    bad_prompt.write_text('{"data_source": "a", "prompt": "fine"}\n{"data_source": "b", "prompt": []}\n')
    with pytest.raises(ArcherError, match=rf"cannot read the prompt of row 1 in {bad_prompt}: .*non-empty list"):
        read_rl_parquet(bad_prompt)
    no_prompt = tmp_path / "q.json"
    no_prompt.write_text('[{"data_source": "a", "question": "hi"}]')
    with pytest.raises(ArcherError, match=r"has no column\(s\) \['prompt'\]; its columns are \['data_source', "
                                          r"'question'\]"):
        read_rl_parquet(no_prompt)
    no_truth = tmp_path / "t.jsonl"
    no_truth.write_text('{"data_source": "a", "prompt": "hi", "reward_model": {"ground_truth": "1"}}\n'
                        '{"data_source": "a", "prompt": "yo"}\n')
    with pytest.raises(ArcherError, match=r"1 of 2 rows have no reward_model.ground_truth; the first is row 1 "):
        read_rl_parquet(no_truth, require_ground_truth=True)
    empty = tmp_path / "e.json"
    empty.write_text("[]")
    with pytest.raises(ArcherError, match="has no rows"):
        read_rl_parquet(empty)


def test_answer_is_the_ground_truth_when_reward_model_has_none(tmp_path: Path) -> None:
    path = _write(tmp_path / "arpo.parquet", {
        "data_source": ["bamboogle", "bamboogle", "gsm8k"], "prompt": ["a?", "b?", "c?"],
        "answer": [["Ann", "Anne"], None, ["7"]],
        "reward_model": [None, "{'ground_truth': 'Bo'}", "{'ground_truth': '8', 'style': 'rule'}"],
    })
    rows = read_rl_parquet(path, require_ground_truth=True)
    assert [r["reward_model"] for r in rows] == [
        {"ground_truth": ["Ann", "Anne"]}, {"ground_truth": "Bo"}, {"ground_truth": "8", "style": "rule"}]


def test_per_row_tools_are_read_as_tool_names(tmp_path: Path) -> None:
    path = tmp_path / "tools.jsonl"
    rows = [{"data_source": "a", "prompt": "hi", "tools": tools} for tools in (
        ["python", "search"], "['search']", [{"name": "python"}],
        [{"type": "function", "function": {"name": "search", "parameters": {}}}], [], None)]
    rows.append({"data_source": "a", "prompt": "hi"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["tools"] for r in read_rl_parquet(path)] == [
        ["python", "search"], ["search"], ["python"], ["search"], [], None, None]


@pytest.mark.parametrize(("tools", "why"), [("python", "does not parse"), ({"a": 1}, "it is a dict"),
                                            ([3], "entry 3 names no tool"), ([{"type": "x"}], "names no tool")])
def test_unreadable_tools_name_the_row(tmp_path: Path, tools: object, why: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"data_source": "a", "prompt": "hi", "tools": tools}) + "\n")
    with pytest.raises(ArcherError) as info:
        read_rl_parquet(path)
    assert info.value.problem.startswith(f"cannot read the tools of row 0 in {path}: ")
    assert why in info.value.problem
