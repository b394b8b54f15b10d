"""Trace format v1 (docs/traces.md): the writer's files field by field, atomic replacement, the reader."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from archer import atomic_files
from archer.contained_paths import OutsideFolderError
from archer.errors import ArcherError
from archer.trace.format import (
    RESPONSE_FIELDS,
    TOOL_FIELDS,
    ManifestError,
    TraceError,
    TraceReader,
    TraceWriter,
    check_step_arrays,
    field_spec,
    read_manifest,
    step_file_name,
    value_stats,
)

STAT_NAMES = ("mean", "std", "min", "max", "p50", "p90", "p99")
# Valid entropies of entropy_arrays(): 0.5, 1.25, 2.0, 0.0, 3.5 (all exact in float16); 9.0 sits on padding.
VALID_ENTROPIES = [0.5, 1.25, 2.0, 0.0, 3.5]
HAND_STATS = {
    "entropy_mean": 7.25 / 5,
    # deviations from 1.45: -0.95, -0.2, 0.55, -1.45, 2.05; squares sum to 7.55
    "entropy_std": math.sqrt(7.55 / 5),
    "entropy_min": 0.0,
    "entropy_max": 3.5,
    "entropy_p50": 1.25,                    # sorted 0, 0.5, 1.25, 2.0, 3.5: the middle one
    "entropy_p90": 2.0 + 0.6 * (3.5 - 2.0),  # position 0.9 * 4 = 3.6
    "entropy_p99": 2.0 + 0.96 * (3.5 - 2.0),  # position 0.99 * 4 = 3.96
}


def entropy_arrays(shift: float = 0.0) -> dict[str, np.ndarray]:
    """Two responses of length 3; ``shift`` changes the entropies so two versions of a step differ."""
    return {
        "entropies": np.array([[0.5, 1.25, 9.0], [2.0, 0.0, 3.5]], dtype=np.float16) + np.float16(shift),
        "response_mask": np.array([[True, True, False], [True, True, True]]),
        "responses": np.array([[21, 22, 0], [23, 24, 25]], dtype=np.int32),
        "response_index": np.array([0, 1], dtype=np.int32),
        "uid": np.array(["u0", "u1"]),
        "reward": np.array([1.0, 0.0], dtype=np.float32),
    }


def influence_arrays() -> dict[str, np.ndarray]:
    arrays = entropy_arrays()
    arrays.update({
        "influence": np.array([[0.25, -1.5, np.nan], [np.nan, 2.0, 0.5]], dtype=np.float16),
        "selected_row_id": np.array([4, 7], dtype=np.int32),
        "accepted": np.array([True, False]),
        "group_id": np.array([0, 0], dtype=np.int32),
    })
    return arrays


def tool_arrays() -> dict[str, np.ndarray]:
    """entropy_arrays() of a tool run: response 1 holds tool output at position 1 and branched from response 0
    (same uid) at position 2."""
    arrays = entropy_arrays()
    arrays.update({
        "uid": np.array(["u0", "u0"]),
        "response_mask": np.array([[True, True, False], [True, False, True]]),
        "tool_mask": np.array([[False, False, False], [False, True, False]]),
        "num_tool_calls": np.array([0, 1], dtype=np.int32),
        "num_turns": np.array([1, 2], dtype=np.int32),
        "branch_parent": np.array([-1, 0], dtype=np.int32),
        "branch_position": np.array([-1, 2], dtype=np.int32),
        "finish_reason": np.array(["eos", "call_limit"]),
    })
    return arrays


def write(writer: TraceWriter, step: int, shift: float = 0.0) -> Path:
    arrays = entropy_arrays(shift)
    return writer.write_step(step, arrays, value_stats(arrays["entropies"][arrays["response_mask"]], "entropy"))


def manifest_lines(trace: Path) -> list[dict]:
    return [json.loads(line) for line in (trace / "manifest.jsonl").read_text().splitlines()]


def summary(trace: Path) -> dict:
    return json.loads((trace / "summary.json").read_text())


def snapshot(trace: Path) -> dict[str, bytes]:
    """Every file under the trace directory, by relative path."""
    return {str(p.relative_to(trace)): p.read_bytes() for p in sorted(trace.rglob("*")) if p.is_file()}


def tmp_debris(trace: Path) -> list[Path]:
    return sorted(trace.rglob(".tmp-*"))


def assert_iso_time(text: str) -> None:
    time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S")
    assert text[19] in "+-" and text[20:].isdigit() and len(text) == 24


# -- value_stats --------------------------------------------------------------------------------------

def test_value_stats_matches_hand_computation() -> None:
    stats = value_stats(np.array(VALID_ENTROPIES, dtype=np.float16), "entropy")
    assert set(stats) == set(HAND_STATS)
    for name, expected in HAND_STATS.items():
        assert stats[name] == pytest.approx(expected, abs=1e-12), name
        assert type(stats[name]) is float


def test_value_stats_of_nothing_is_nan_and_of_one_value_is_that_value() -> None:
    empty = value_stats(np.zeros(0), "influence")
    assert sorted(empty) == sorted(f"influence_{k}" for k in STAT_NAMES)
    assert all(math.isnan(v) for v in empty.values())
    one = value_stats(np.array([2.5]), "x")
    assert one == {"x_mean": 2.5, "x_std": 0.0, "x_min": 2.5, "x_max": 2.5, "x_p50": 2.5, "x_p90": 2.5,
                   "x_p99": 2.5}


def test_step_file_name_pads_to_six_digits() -> None:
    assert step_file_name(7) == "steps/step_000007.npz"
    assert step_file_name(1234567) == "steps/step_1234567.npz"


# -- writer: the files -----------------------------------------------------------------------------------

def test_written_step_files_field_by_field(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    writer = TraceWriter(trace, kind="entropy", metadata={"project_name": "p", "experiment_name": "e"})
    path = write(writer, 3)
    assert path == trace / "steps" / "step_000003.npz"
    assert sorted(p.name for p in (trace / "steps").iterdir()) == ["step_000003.npz"]

    s = summary(trace)
    assert set(s) == {"project_name", "experiment_name", "format_version", "kind", "created_at", "updated_at",
                      "latest_step", "num_steps_written", "write_every", "step_file_pattern", "tokenizer"}
    assert (s["project_name"], s["experiment_name"]) == ("p", "e")
    assert s["format_version"] == 1 and s["kind"] == "entropy"
    assert s["latest_step"] == 3 and s["num_steps_written"] == 1 and s["write_every"] == 1
    assert s["step_file_pattern"] == "steps/step_{step:06d}.npz"
    assert s["tokenizer"] is None and not (trace / "tokenizer").exists()
    assert_iso_time(s["created_at"])
    assert_iso_time(s["updated_at"])

    [entry] = manifest_lines(trace)
    assert set(entry) == {"step", "created_at", "file", "num_responses", "response_len", "num_valid_tokens",
                          *HAND_STATS}
    assert entry["step"] == 3 and entry["file"] == "steps/step_000003.npz"
    assert entry["num_responses"] == 2 and entry["response_len"] == 3 and entry["num_valid_tokens"] == 5
    assert_iso_time(entry["created_at"])
    for name, expected in HAND_STATS.items():
        assert entry[name] == pytest.approx(expected, abs=1e-12), name

    assert (trace / "latest_step.txt").read_text() == "3\n"

    with np.load(path, allow_pickle=False) as npz:
        assert sorted(npz.files) == ["entropies", "response_index", "response_mask", "responses", "reward", "uid"]
        assert npz["entropies"].dtype == np.float16 and npz["entropies"].shape == (2, 3)
        assert npz["entropies"].tolist() == [[0.5, 1.25, 9.0], [2.0, 0.0, 3.5]]
        assert npz["response_mask"].dtype == np.bool_
        assert npz["response_mask"].tolist() == [[True, True, False], [True, True, True]]
        assert npz["responses"].dtype == np.int32 and npz["responses"].tolist() == [[21, 22, 0], [23, 24, 25]]
        assert npz["response_index"].dtype == np.int32 and npz["response_index"].tolist() == [0, 1]
        assert npz["uid"].dtype.kind == "U" and npz["uid"].tolist() == ["u0", "u1"]
        assert npz["reward"].dtype == np.float32 and npz["reward"].tolist() == [1.0, 0.0]
    assert tmp_debris(trace) == []


def test_manifest_keeps_nan_statistics_of_a_step_without_valid_tokens(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, kind="entropy")
    arrays = entropy_arrays()
    arrays["response_mask"][:] = False
    writer.write_step(1, arrays, value_stats(arrays["entropies"][arrays["response_mask"]], "entropy"))
    [entry] = read_manifest(tmp_path / "manifest.jsonl")
    assert entry["num_valid_tokens"] == 0
    assert all(math.isnan(entry[f"entropy_{k}"]) for k in STAT_NAMES)


def test_writer_rejects_unknown_kind_and_write_every_below_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown trace kind 'tokens'"):
        TraceWriter(tmp_path / "a", kind="tokens")
    with pytest.raises(ArcherError, match="write_every=0 must be at least 1") as info:
        TraceWriter(tmp_path / "b", kind="entropy", write_every=0)
    assert "write_every" in info.value.fix


def test_write_every_two_writes_only_even_steps(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, kind="entropy", write_every=2)
    written = [step for step in range(1, 6) if writer.should_write(step) and write(writer, step)]
    assert written == [2, 4]
    assert [e["step"] for e in manifest_lines(tmp_path)] == [2, 4]
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == ["step_000002.npz", "step_000004.npz"]
    assert summary(tmp_path)["write_every"] == 2
    assert summary(tmp_path)["num_steps_written"] == 2 and summary(tmp_path)["latest_step"] == 4
    assert (tmp_path / "latest_step.txt").read_text() == "4\n"


def test_rewriting_a_step_replaces_its_line_and_file(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, kind="entropy")
    write(writer, 1)
    write(writer, 2)
    write(writer, 2, shift=1.0)
    lines = manifest_lines(tmp_path)
    assert [e["step"] for e in lines] == [1, 2]
    assert lines[0]["entropy_mean"] == pytest.approx(1.45)
    assert lines[1]["entropy_mean"] == pytest.approx(2.45)
    with np.load(tmp_path / "steps" / "step_000002.npz") as npz:
        assert npz["entropies"].tolist() == [[1.5, 2.25, 10.0], [3.0, 1.0, 4.5]]
    assert summary(tmp_path)["num_steps_written"] == 2


def test_steps_written_out_of_order_are_sorted_and_latest_is_the_largest(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, kind="entropy")
    for step in (5, 1, 3):
        write(writer, step)
    assert [e["step"] for e in manifest_lines(tmp_path)] == [1, 3, 5]
    assert (tmp_path / "latest_step.txt").read_text() == "5\n"
    assert summary(tmp_path)["latest_step"] == 5


def test_truncate_after_drops_later_lines_and_files(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, kind="entropy")
    for step in (1, 2, 3, 4):
        write(writer, step)
    before = manifest_lines(tmp_path)
    assert writer.truncate_after(2) == 2
    assert manifest_lines(tmp_path) == before[:2]
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == ["step_000001.npz", "step_000002.npz"]
    assert (tmp_path / "latest_step.txt").read_text() == "2\n"
    assert summary(tmp_path)["latest_step"] == 2 and summary(tmp_path)["num_steps_written"] == 2

    files = snapshot(tmp_path)
    assert writer.truncate_after(10) == 0
    assert snapshot(tmp_path) == files

    assert writer.truncate_after(0) == 2
    assert (tmp_path / "manifest.jsonl").read_text() == ""
    assert list((tmp_path / "steps").iterdir()) == []
    assert (tmp_path / "latest_step.txt").read_text() == ""
    assert summary(tmp_path)["latest_step"] is None and summary(tmp_path)["num_steps_written"] == 0
    assert tmp_debris(tmp_path) == []


def test_truncated_steps_can_be_written_again(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, kind="entropy")
    for step in (1, 2, 3):
        write(writer, step)
    writer.truncate_after(1)
    write(writer, 2, shift=1.0)
    assert [e["step"] for e in manifest_lines(tmp_path)] == [1, 2]
    assert manifest_lines(tmp_path)[1]["entropy_mean"] == pytest.approx(2.45)
    assert summary(tmp_path)["latest_step"] == 2


def test_opening_a_writer_removes_tmp_debris_only(tmp_path: Path) -> None:
    (tmp_path / "steps").mkdir()
    debris = [tmp_path / ".tmp-manifest.jsonl-abc", tmp_path / ".tmp-summary.json-x1",
              tmp_path / "steps" / ".tmp-step_000001.npz-q9"]
    for path in debris:
        path.write_bytes(b"half a file")
    keep = [tmp_path / "notes.txt", tmp_path / "steps" / "tmp-not-debris.npz"]
    for path in keep:
        path.write_text("mine")
    TraceWriter(tmp_path, kind="entropy")
    assert not any(p.exists() for p in debris)
    assert all(p.read_text() == "mine" for p in keep)


def test_reopened_writer_continues_the_manifest_and_keeps_created_at(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, kind="entropy", write_every=1)
    write(writer, 1)
    write(writer, 2)
    first_lines = manifest_lines(tmp_path)
    old = summary(tmp_path)
    old["created_at"] = "2001-02-03T04:05:06+0000"  # as if the trace were started long ago
    (tmp_path / "summary.json").write_text(json.dumps(old))

    reopened = TraceWriter(tmp_path, kind="entropy", write_every=1)
    assert [e["step"] for e in reopened.entries] == [1, 2]
    s = summary(tmp_path)
    assert s["created_at"] == "2001-02-03T04:05:06+0000"
    assert s["updated_at"] != s["created_at"]
    assert s["num_steps_written"] == 2 and s["latest_step"] == 2

    write(reopened, 3)
    lines = manifest_lines(tmp_path)
    assert lines[:2] == first_lines and lines[2]["step"] == 3
    assert summary(tmp_path)["created_at"] == "2001-02-03T04:05:06+0000"
    assert summary(tmp_path)["num_steps_written"] == 3


def test_writer_saves_the_tokenizer_once(tmp_path: Path) -> None:
    calls = []

    class Tokenizer:
        def save_pretrained(self, folder: str) -> None:
            calls.append(folder)
            Path(folder).mkdir(parents=True)
            (Path(folder) / "tokenizer.json").write_text("{}")

    TraceWriter(tmp_path, kind="entropy", tokenizer=Tokenizer())
    TraceWriter(tmp_path, kind="entropy", tokenizer=Tokenizer())
    assert calls == [str(tmp_path / "tokenizer")]
    assert summary(tmp_path)["tokenizer"] == "tokenizer"
    assert TraceReader(tmp_path).tokenizer_dir() == (tmp_path / "tokenizer").resolve()


# -- writer: atomicity ------------------------------------------------------------------------------------

def test_crash_while_writing_a_step_file_leaves_the_old_files(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    writer = TraceWriter(tmp_path, kind="entropy")
    write(writer, 1)
    before = snapshot(tmp_path)

    def half_written(file, **arrays) -> None:
        file.write(b"PK\x03\x04 half of a zip")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez_compressed", half_written)
    with pytest.raises(OSError, match="disk full"):
        write(writer, 1, shift=1.0)
    with pytest.raises(OSError, match="disk full"):
        write(writer, 2)
    assert snapshot(tmp_path) == before
    assert tmp_debris(tmp_path) == []
    monkeypatch.undo()
    with np.load(tmp_path / "steps" / "step_000001.npz") as npz:
        assert npz["entropies"].tolist() == [[0.5, 1.25, 9.0], [2.0, 0.0, 3.5]]


@pytest.mark.parametrize("failing", ["step_000002.npz", "manifest.jsonl", "latest_step.txt"])
def test_crash_at_a_replace_keeps_the_manifest_naming_existing_files(tmp_path: Path, failing: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    writer = TraceWriter(tmp_path, kind="entropy")
    write(writer, 1)
    before = snapshot(tmp_path)
    real_replace = os.replace

    def replace(src, dst) -> None:
        if Path(dst).name == failing:
            raise KeyboardInterrupt  # killed between writing the temporary file and replacing
        real_replace(src, dst)

    monkeypatch.setattr(atomic_files.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        write(writer, 2)
    assert tmp_debris(tmp_path) == []
    after = snapshot(tmp_path)
    if failing == "step_000002.npz":
        assert after == before
    else:  # the step file is in place; the files written after it still hold their old versions
        assert (tmp_path / "steps" / "step_000002.npz").is_file()
        assert after["latest_step.txt"] == before["latest_step.txt"] == b"1\n"
        assert after["summary.json"] == before["summary.json"]
    on_disk = read_manifest(tmp_path / "manifest.jsonl")
    assert all((tmp_path / e["file"]).is_file() for e in on_disk)
    assert [e["step"] for e in on_disk] == ([1] if failing != "latest_step.txt" else [1, 2])


# -- check_step_arrays --------------------------------------------------------------------------------------

def test_check_step_arrays_accepts_both_kinds() -> None:
    check_step_arrays(entropy_arrays(), "entropy")
    check_step_arrays(influence_arrays(), "influence")


@pytest.mark.parametrize("field", ["entropies", "response_mask", "responses", "response_index"])
@pytest.mark.parametrize("kind", ["entropy", "influence"])
def test_check_step_arrays_requires_the_shared_fields(kind: str, field: str) -> None:
    arrays = influence_arrays() if kind == "influence" else entropy_arrays()
    del arrays[field]
    with pytest.raises(ValueError, match=rf"{kind} trace step is missing fields \['{field}'\]"):
        check_step_arrays(arrays, kind)


@pytest.mark.parametrize("field", ["influence", "selected_row_id", "reward", "accepted", "group_id"])
def test_check_step_arrays_requires_the_influence_fields(field: str) -> None:
    arrays = influence_arrays()
    del arrays[field]
    with pytest.raises(ValueError, match=rf"missing fields \['{field}'\]"):
        check_step_arrays(arrays, "influence")
    check_step_arrays(arrays, "entropy")  # an entropy step does not need them


@pytest.mark.parametrize(("field", "bad"), [
    ("entropies", np.zeros((2, 3), np.float32)),
    ("response_mask", np.ones((2, 3), np.uint8)),
    ("responses", np.zeros((2, 3), np.int64)),
    ("response_index", np.zeros(2, np.int64)),
    ("uid", np.array(["u0", "u1"], dtype=object)),
    ("reward", np.zeros(2, np.float64)),
    ("old_log_probs", np.zeros((2, 3), np.float32)),
    ("prompt_length", np.zeros(2, np.float32)),
    ("influence", np.zeros((2, 3), np.float32)),
    ("accepted", np.zeros(2, np.int32)),
    ("group_id", np.zeros(2, np.int64)),
    ("selected_row_id", np.zeros(2, np.uint32)),
    ("tool_mask", np.zeros((2, 3), np.int64)),
    ("num_tool_calls", np.zeros(2, np.int64)),
    ("num_turns", np.zeros(2, np.float32)),
    ("branch_parent", np.full(2, -1, np.int64)),
    ("branch_position", np.full(2, -1, np.int16)),
    ("finish_reason", np.array([b"eos", b"eos"])),
])
def test_check_step_arrays_rejects_wrong_dtypes(field: str, bad: np.ndarray) -> None:
    arrays = {**influence_arrays(), **tool_arrays()}
    arrays[field] = bad
    with pytest.raises(ValueError, match=rf"trace field {field} must be"):
        check_step_arrays(arrays, "influence")


@pytest.mark.parametrize(("field", "bad", "message"), [
    ("response_index", np.zeros(3, np.int32), r"response_index has shape \(3,\), expected 1-D with 2 rows"),
    ("uid", np.array(["u"]), r"uid has shape \(1,\), expected 1-D with 2 rows"),
    ("prompts", np.zeros((1, 4), np.int32), r"prompts has shape \(1, 4\), expected 2-D with 2 rows"),
    ("entropies", np.zeros((2, 4), np.float16), r"entropies has shape \(2, 4\), expected \(2, 3\)"),
    ("responses", np.zeros((2, 2), np.int32), r"responses has shape \(2, 2\), expected \(2, 3\)"),
    ("old_log_probs", np.zeros((2, 4), np.float16), r"old_log_probs has shape \(2, 4\), expected \(2, 3\)"),
    ("influence", np.zeros((2, 1), np.float16), r"influence has shape \(2, 1\), expected \(2, 3\)"),
    ("tool_mask", np.zeros((2, 4), bool), r"tool_mask has shape \(2, 4\), expected \(2, 3\)"),
    ("tool_mask", np.zeros(2, bool), r"tool_mask has shape \(2,\), expected 2-D with 2 rows"),
    ("branch_parent", np.zeros((2, 1), np.int32), r"branch_parent has shape \(2, 1\), expected 1-D with 2 rows"),
    ("finish_reason", np.array(["eos"]), r"finish_reason has shape \(1,\), expected 1-D with 2 rows"),
])
def test_check_step_arrays_rejects_wrong_shapes(field: str, bad: np.ndarray, message: str) -> None:
    arrays = {**influence_arrays(), **tool_arrays()}
    arrays[field] = bad
    with pytest.raises(ValueError, match=message):
        check_step_arrays(arrays, "influence")


def test_the_tool_fields_are_optional_and_declared() -> None:
    assert set(TOOL_FIELDS) == {"tool_mask", "num_tool_calls", "num_turns", "branch_parent", "branch_position"}
    assert field_spec("tool_mask")[0] == "bool" and field_spec("finish_reason")[0] == "str"
    assert all(field_spec(name)[0] == "int32" for name in ("num_tool_calls", "num_turns", "branch_parent",
                                                          "branch_position"))
    check_step_arrays(tool_arrays(), "entropy")
    check_step_arrays({**influence_arrays(), **tool_arrays()}, "influence")
    check_step_arrays(entropy_arrays(), "entropy")  # a run without tools writes none of them


@pytest.mark.parametrize(("change", "message"), [
    ({"tool_mask": np.array([[False, True, False], [False, True, False]])},
     "tool_mask and response_mask are both True"),
    ({"branch_position": None}, "branch_parent and branch_position come together"),
    ({"branch_parent": None}, "branch_parent and branch_position come together"),
    ({"branch_position": np.array([-1, -1], np.int32)}, "must both be -1"),
    ({"branch_parent": np.array([-1, -1], np.int32)}, "must both be -1"),
    ({"branch_parent": np.array([-2, 0], np.int32), "branch_position": np.array([-1, 2], np.int32)},
     "must both be -1"),
    ({"branch_position": np.array([-1, 3], np.int32)}, "branch_position points past the response length"),
])
def test_check_step_arrays_rejects_inconsistent_tool_fields(change: dict, message: str) -> None:
    arrays = tool_arrays()
    for name, value in change.items():
        if value is None:
            del arrays[name]
        else:
            arrays[name] = value
    with pytest.raises(ValueError, match=message):
        check_step_arrays(arrays, "entropy")


def test_the_tool_fields_round_trip_through_writer_and_reader(tmp_path: Path) -> None:
    arrays = tool_arrays()
    TraceWriter(tmp_path, kind="entropy").write_step(1, arrays, {})
    step = TraceReader(tmp_path).load_step(1)
    assert sorted(step) == sorted(arrays)
    for name, array in arrays.items():
        assert step[name].dtype == array.dtype and np.array_equal(step[name], array), name
    assert step["finish_reason"].tolist() == ["eos", "call_limit"]
    assert step["tool_mask"].tolist() == [[False, False, False], [False, True, False]]


def test_a_step_file_written_before_the_tool_fields_still_loads(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, kind="entropy")
    write(writer, 1)
    old = entropy_arrays()  # the fields a trace of an older archer holds: no tool fields, no finish_reason
    np.savez_compressed(tmp_path / "steps" / "step_000001.npz", **old)
    step = TraceReader(tmp_path).load_step(1)
    assert sorted(step) == sorted(old) and not set(TOOL_FIELDS) & set(step) and "finish_reason" not in step


def off_policy_arrays() -> dict[str, np.ndarray]:
    """entropy_arrays() of a run with the policy versions and the rollout correction's rejection."""
    return {**entropy_arrays(), "policy_version": np.array([4, 3], dtype=np.int32),
            "first_policy_version": np.array([3, 3], dtype=np.int32), "staleness": np.array([0, 1], dtype=np.int32),
            "rollout_rs_rejected": np.array([[False, True, False], [False, False, False]])}


def test_the_off_policy_fields_round_trip_and_are_checked(tmp_path: Path) -> None:
    assert [field_spec(name)[0] for name in ("policy_version", "first_policy_version", "staleness",
                                             "rollout_rs_rejected")] == ["int32", "int32", "int32", "bool"]
    arrays = off_policy_arrays()
    TraceWriter(tmp_path, kind="entropy").write_step(1, arrays, {})
    step = TraceReader(tmp_path).load_step(1)
    for name, array in arrays.items():
        assert step[name].dtype == array.dtype and np.array_equal(step[name], array), name
    for name, bad, message in (("policy_version", np.array([4, 3]), "policy_version must be int32"),
                               ("staleness", np.zeros((2, 3), np.int32), "staleness has shape"),
                               ("rollout_rs_rejected", np.zeros((2, 2), bool), "rollout_rs_rejected has shape"),
                               ("rollout_rs_rejected", np.array([[False, False, True], [False] * 3]),
                                "rollout_rs_rejected is True at a token response_mask leaves out")):
        with pytest.raises(ValueError, match=message):
            check_step_arrays({**arrays, name: bad}, "entropy")


def test_a_step_file_written_before_the_policy_versions_still_loads(tmp_path: Path) -> None:
    old = tool_arrays()  # what this archer wrote before the off-policy fields
    TraceWriter(tmp_path, kind="entropy").write_step(1, old, {})
    step = TraceReader(tmp_path).load_step(1)
    assert sorted(step) == sorted(old)
    assert not {"policy_version", "first_policy_version", "staleness", "rollout_rs_rejected"} & set(step)


def test_reward_extra_fields_are_float32_per_response() -> None:
    dtype, description = field_spec("reward_extra/f1")
    assert dtype == "float32" and "NaN in the rows it did not" in description
    assert field_spec("reward_extra/format ok") == (dtype, description)
    assert field_spec("reward") == RESPONSE_FIELDS["reward"] and field_spec("something_else") is None
    arrays = entropy_arrays()
    arrays["reward_extra/f1"] = np.array([0.5, np.nan], np.float32)
    check_step_arrays(arrays, "entropy")
    for bad, message in ((np.array([0.5, 1.0]), "reward_extra/f1 must be float32"),
                         (np.zeros(3, np.float32), r"reward_extra/f1 has shape \(3,\), expected 1-D with 2 rows"),
                         (np.zeros((2, 3), np.float32), r"reward_extra/f1 has shape \(2, 3\), expected 1-D")):
        arrays["reward_extra/f1"] = bad
        with pytest.raises(ValueError, match=message):
            check_step_arrays(arrays, "entropy")


def test_check_step_arrays_rejects_a_one_dimensional_mask(tmp_path: Path) -> None:
    arrays = {"entropies": np.zeros(2, np.float16), "response_mask": np.ones(2, bool),
              "responses": np.zeros(2, np.int32), "response_index": np.zeros(2, np.int32)}
    writer = TraceWriter(tmp_path, kind="entropy")
    with pytest.raises(ValueError):
        writer.write_step(1, arrays, {})
    assert list((tmp_path / "steps").iterdir()) == []


def test_check_step_arrays_rejects_a_scalar_field() -> None:
    arrays = entropy_arrays()
    arrays["response_index"] = np.array(0, np.int32)
    with pytest.raises(ValueError):
        check_step_arrays(arrays, "entropy")


def test_write_step_checks_before_writing(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, kind="entropy")
    arrays = entropy_arrays()
    arrays["entropies"] = arrays["entropies"].astype(np.float32)
    with pytest.raises(ValueError, match="entropies must be float16"):
        writer.write_step(1, arrays, {})
    assert list((tmp_path / "steps").iterdir()) == [] and not (tmp_path / "manifest.jsonl").exists()


# -- read_manifest ----------------------------------------------------------------------------------------

def test_read_manifest_skips_blank_and_torn_lines_and_sorts(tmp_path: Path) -> None:
    path = tmp_path / "manifest.jsonl"
    path.write_text('{"step": 4, "file": "b"}\n\n{"step": 2, "file": "a"}\n{"step": 6, "fi')
    assert read_manifest(path) == [{"step": 2, "file": "a"}, {"step": 4, "file": "b"}]


@pytest.mark.parametrize("line, problem", [
    ("[]", "a JSON array"), ("7", "a JSON int"), ('"step"', "a JSON str"),
    ('{"step": "3", "file": "steps/step_000003.npz"}', "step '3'"),
    ('{"step": true, "file": "steps/step_000003.npz"}', "step True"),
    ('{"step": -1, "file": "steps/step_000003.npz"}', "step -1"),
    ('{"step": 3}', "an object without file"), ('{"created_at": "now"}', "an object without step and file"),
    ('{"step": 3, "file": ["a"]}', "file ['a']"),
    ('{"step": 1, "file": "steps/step_000001.npz"}', "step 1 again (line 1 has it)"),
])
def test_a_manifest_line_that_is_json_but_not_an_entry_is_one_named_error(tmp_path: Path, line: str,
                                                                           problem: str) -> None:
    written_trace(tmp_path, steps=(1, 2))
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(manifest.read_text() + line + "\n")  # line 3
    before = snapshot(tmp_path)
    for read in (lambda: read_manifest(manifest), lambda: TraceReader(tmp_path).steps(),
                 lambda: TraceWriter(tmp_path, kind="entropy")):  # the explorer's reader and a resume's writer
        with pytest.raises(ManifestError) as info:
            read()
        assert info.value.problem == (f"{manifest} line 3 holds {problem}; expected a JSON object with an integer "
                                      "step (0 or more) and a file name (a string), as archer writes them")
        assert isinstance(info.value, ArcherError)  # the CLI prints it without a traceback, the explorer shows it
    assert snapshot(tmp_path) == before


# -- reader ---------------------------------------------------------------------------------------------

def written_trace(trace: Path, steps: tuple[int, ...] = (1, 2)) -> TraceWriter:
    writer = TraceWriter(trace, kind="entropy", metadata={"project_name": "p"})
    for step in steps:
        write(writer, step, shift=float(step))
    return writer


def test_reader_reads_what_the_writer_wrote(tmp_path: Path) -> None:
    written_trace(tmp_path)
    reader = TraceReader(tmp_path)
    assert reader.kind == "entropy" and reader.summary["project_name"] == "p"
    assert reader.steps() == [1, 2]
    assert reader.entries() == manifest_lines(tmp_path)
    assert reader.entry(2)["num_valid_tokens"] == 5
    assert reader.step_path(2) == (tmp_path / "steps" / "step_000002.npz").resolve()
    step = reader.load_step(2)
    expected = entropy_arrays(shift=2.0)
    assert sorted(step) == sorted(expected)
    for name, array in expected.items():
        assert step[name].dtype == array.dtype and np.array_equal(step[name], array), name
    assert reader.load_step(2) is step  # cached
    assert reader.tokenizer_dir() is None
    with pytest.raises(TraceError, match="step 9 is not in"):
        reader.load_step(9)


def test_reader_reads_an_influence_trace(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, kind="influence")
    writer.write_step(1, influence_arrays(), {"influence_sum": 1.25})
    reader = TraceReader(tmp_path)
    assert reader.kind == "influence" and reader.entry(1)["influence_sum"] == 1.25
    step = reader.load_step(1)
    assert step["influence"].dtype == np.float16
    assert np.array_equal(step["influence"], influence_arrays()["influence"], equal_nan=True)
    assert step["accepted"].tolist() == [True, False] and step["selected_row_id"].tolist() == [4, 7]


def test_reader_opens_no_step_file_until_asked_and_only_the_one_asked(tmp_path: Path) -> None:
    written_trace(tmp_path, steps=(1, 2, 3))
    for step in (2, 3):
        (tmp_path / step_file_name(step)).write_bytes(b"not a zip")
    reader = TraceReader(tmp_path)
    assert reader.steps() == [1, 2, 3]
    assert reader.load_step(1)["entropies"][0, 0] == 1.5
    with pytest.raises(TraceError, match="step 2: file .*step_000002.npz cannot be read"):
        reader.load_step(2)


def test_reader_cache_is_least_recently_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written_trace(tmp_path, steps=(1, 2, 3))
    reader = TraceReader(tmp_path, cache_size=2)
    opened: list[str] = []
    real_load = np.load

    def counting_load(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(np, "load", counting_load)
    one = reader.load_step(1)
    reader.load_step(2)
    assert reader.load_step(1) is one  # a cache hit; 1 is now the most recently used
    three = reader.load_step(3)        # evicts 2
    assert reader.load_step(1) is one and reader.load_step(3) is three
    reader.load_step(2)
    assert opened == ["step_000001.npz", "step_000002.npz", "step_000003.npz", "step_000002.npz"]
    (tmp_path / step_file_name(3)).unlink()
    with pytest.raises(TraceError, match="step 3: file .*step_000003.npz is missing"):
        reader.load_step(3)  # a deleted file is an error even while its arrays are cached


def test_refresh_sees_steps_written_after_the_reader_opened(tmp_path: Path) -> None:
    writer = written_trace(tmp_path, steps=(1,))
    reader = TraceReader(tmp_path)
    assert reader.steps() == [1]
    assert reader.refresh() is False
    write(writer, 2, shift=2.0)
    assert reader.refresh() is True
    assert reader.refresh() is False
    assert reader.steps() == [1, 2] and reader.summary["latest_step"] == 2
    assert reader.load_step(2)["entropies"][0, 0] == 2.5


def test_refresh_drops_truncated_steps_from_the_cache(tmp_path: Path) -> None:
    writer = written_trace(tmp_path, steps=(1, 2))
    reader = TraceReader(tmp_path)
    reader.load_step(2)
    writer.truncate_after(1)
    assert reader.refresh() is True
    assert reader.steps() == [1]
    with pytest.raises(TraceError, match="step 2 is not in"):
        reader.load_step(2)


def test_refresh_drops_a_rewritten_step_from_the_cache(tmp_path: Path) -> None:
    writer = written_trace(tmp_path, steps=(1, 2))
    reader = TraceReader(tmp_path)
    assert reader.load_step(2)["entropies"][0, 0] == 2.5
    write(writer, 2, shift=5.0)
    assert reader.refresh() is True
    assert reader.load_step(2)["entropies"][0, 0] == 5.5


def test_refresh_after_the_manifest_is_deleted_lists_no_steps(tmp_path: Path) -> None:
    written_trace(tmp_path)
    reader = TraceReader(tmp_path)
    assert reader.steps() == [1, 2]
    (tmp_path / "manifest.jsonl").unlink()
    assert reader.refresh() is True
    assert reader.steps() == [] and reader.refresh() is False


def test_truncated_npz_gives_trace_error_naming_the_file(tmp_path: Path) -> None:
    written_trace(tmp_path)
    path = tmp_path / step_file_name(2)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(TraceError, match=r"step 2: file .*steps/step_000002\.npz cannot be read"):
        TraceReader(tmp_path).load_step(2)


def test_deleted_npz_gives_trace_error(tmp_path: Path) -> None:
    written_trace(tmp_path)
    (tmp_path / step_file_name(1)).unlink()
    with pytest.raises(TraceError, match=r"step 1: file .*steps/step_000001\.npz is missing"):
        TraceReader(tmp_path).load_step(1)


def test_npz_without_the_format_fields_gives_trace_error(tmp_path: Path) -> None:
    written_trace(tmp_path)
    np.savez_compressed(tmp_path / step_file_name(1), entropies=np.zeros((2, 3), np.float16))
    with pytest.raises(TraceError, match=r"step_000001\.npz does not match trace format v1 .*missing fields"):
        TraceReader(tmp_path).load_step(1)


def rewrite_file_field(trace: Path, step: int, file: str) -> None:
    lines = manifest_lines(trace)
    for line in lines:
        if line["step"] == step:
            line["file"] = file
    (trace / "manifest.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_resume_refuses_step_files_outside_the_trace_and_deletes_nothing(tmp_path: Path) -> None:
    """Resume drops the steps after the checkpoint by deleting their files: entries naming an absolute path and
    ``../../x`` must not delete those files, nor anything else (every entry is checked before any deletion)."""
    trace = tmp_path / "run" / "entropy_trace"
    written_trace(trace, steps=(1, 2, 3, 4))
    victims = {tmp_path / "absolute_victim.txt": b"keep me", tmp_path / "x": b"keep me too"}
    for victim, content in victims.items():
        victim.write_bytes(content)
    rewrite_file_field(trace, 3, str(tmp_path / "absolute_victim.txt"))
    rewrite_file_field(trace, 4, "../../x")  # trace/../../x is tmp_path/x
    before = snapshot(trace)
    with pytest.raises(OutsideFolderError) as info:
        TraceWriter(trace, kind="entropy").truncate_after(1)  # what open_traces does on a resume at step 1
    message = str(info.value)
    assert str(trace / "manifest.jsonl") in message and "step 3's file" in message
    assert str(tmp_path / "absolute_victim.txt") in message and "lies outside the trace directory" in message
    assert {v: v.read_bytes() for v in victims} == victims
    assert snapshot(trace) == before  # no step file, manifest line or summary changed


def test_a_resume_refuses_a_relative_escape_named_alone(tmp_path: Path) -> None:
    trace = tmp_path / "run" / "entropy_trace"
    written_trace(trace, steps=(1, 2))
    (tmp_path / "x").write_text("keep")
    rewrite_file_field(trace, 2, "../../x")
    with pytest.raises(OutsideFolderError, match=r"manifest\.jsonl, step 2's file: names '\.\./\.\./x'"):
        TraceWriter(trace, kind="entropy")
    assert (tmp_path / "x").read_text() == "keep" and (trace / step_file_name(1)).is_file()


def test_truncate_after_checks_every_dropped_file_before_deleting_one(tmp_path: Path) -> None:
    """Entries are checked again when dropped: a step file swapped for a symlink out after the writer opened."""
    trace = tmp_path / "trace"
    writer = written_trace(trace, steps=(1, 2, 3))
    outside = tmp_path / "outside.npz"
    outside.write_bytes(b"not the trace's")
    (trace / step_file_name(3)).unlink()
    (trace / step_file_name(3)).symlink_to(outside)
    before = snapshot(trace)
    with pytest.raises(OutsideFolderError, match="step 3's file"):
        writer.truncate_after(1)
    assert outside.read_bytes() == b"not the trace's" and snapshot(trace) == before
    assert [e["step"] for e in writer.entries] == [1, 2, 3]


@pytest.mark.parametrize("escape", ["../../etc/passwd", "absolute", "symlink", "."])
def test_step_files_outside_the_trace_dir_are_refused(tmp_path: Path, escape: str) -> None:
    trace = tmp_path / "runs" / "trace"
    written_trace(trace)
    outside = tmp_path / "outside.npz"  # a valid step file, only in the wrong place
    shutil.copy(trace / step_file_name(1), outside)
    if escape == "absolute":
        rewrite_file_field(trace, 1, str(outside))
    elif escape == "symlink":
        (trace / step_file_name(1)).unlink()
        (trace / step_file_name(1)).symlink_to(outside)
    else:
        rewrite_file_field(trace, 1, escape)
    reader = TraceReader(trace)
    with pytest.raises(TraceError, match="lies outside the trace directory"):
        reader.step_path(1)
    with pytest.raises(TraceError, match="lies outside the trace directory"):
        reader.load_step(1)
    assert reader.load_step(2)["entropies"][0, 0] == 2.5


def test_reader_ignores_a_torn_last_manifest_line(tmp_path: Path) -> None:
    written_trace(tmp_path)
    with (tmp_path / "manifest.jsonl").open("a") as f:
        f.write('{"step": 3, "created_at": "2024-01-0')
    reader = TraceReader(tmp_path)
    assert reader.steps() == [1, 2]
    assert reader.load_step(2)["entropies"][0, 0] == 2.5


def test_reader_refuses_a_directory_that_is_not_a_trace(tmp_path: Path) -> None:
    (tmp_path / "manifest.jsonl").write_text("")
    with pytest.raises(ArcherError, match="is not a trace directory") as info:
        TraceReader(tmp_path)
    assert "--trace-dir" in info.value.fix
    with pytest.raises(ArcherError, match="is not a trace directory"):
        TraceReader(tmp_path / "missing")


def test_a_run_directory_names_the_trace_folders_inside_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"steps": 3, "run_dir": str(run)}))  # the run's own summary
    with pytest.raises(ArcherError) as info:
        TraceReader(run)
    assert info.value.problem == (f"{run} is not a trace directory (its summary.json has no format_version, as a "
                                  "run's own has not), and no folder inside it is one")
    assert "<run>/entropy_trace" in info.value.fix and "+trainer.entropy_trace.enable=True" in info.value.fix
    written_trace(run / "influence")
    written_trace(run / "entropy_trace")
    with pytest.raises(ArcherError) as info:
        TraceReader(run)
    assert info.value.problem == (f"{run} is not a trace directory (its summary.json has no format_version, as a "
                                  "run's own has not); it holds the trace folder(s) entropy_trace, influence")
    assert info.value.fix == f"pass --trace-dir {run / 'entropy_trace'} (or another of them)"
    (run / "summary.json").unlink()
    with pytest.raises(ArcherError, match=r"\(no summary.json\); it holds the trace folder\(s\) entropy_trace"):
        TraceReader(run)


@pytest.mark.parametrize("version", [2, "1", None])
def test_reader_refuses_another_format_version(tmp_path: Path, version: object) -> None:
    written_trace(tmp_path)
    s = summary(tmp_path)
    s["format_version"] = version
    (tmp_path / "summary.json").write_text(json.dumps(s))
    with pytest.raises(ArcherError, match=rf"format_version {version!r} is not supported \(expected 1\)"):
        TraceReader(tmp_path)


def test_reader_refuses_a_summary_that_is_not_json(tmp_path: Path) -> None:
    written_trace(tmp_path)
    (tmp_path / "summary.json").write_text('{"format_version": 1,')
    with pytest.raises(ArcherError, match="summary.json is not valid JSON"):
        TraceReader(tmp_path)


def test_reopening_keeps_metadata_and_refuses_another_kind(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, kind="entropy", metadata={"experiment_name": "exp", "rollout_n": 4})
    write(writer, 1)
    reopened = TraceWriter(tmp_path, kind="entropy", metadata={"rollout_n": 8})
    write(reopened, 2)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["experiment_name"] == "exp" and summary["rollout_n"] == 8
    assert summary["num_steps_written"] == 2
    with pytest.raises(ArcherError, match="holds an entropy trace, not an influence trace"):
        TraceWriter(tmp_path, kind="influence")


def test_a_summary_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    written_trace(tmp_path)
    (tmp_path / "summary.json").write_text("[1]")
    with pytest.raises(ArcherError, match="does not hold a JSON object"):
        TraceReader(tmp_path)


def test_background_writes_land_in_order_and_surface_errors(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, kind="entropy")
    for step in (1, 2, 3):
        writer.write_step_later(step, entropy_arrays(shift=float(step)), lambda a: {"marker": float(a["entropies"][0, 0])})
    writer.flush()
    entries = read_manifest(tmp_path / "manifest.jsonl")
    assert [e["step"] for e in entries] == [1, 2, 3]
    assert [e["marker"] for e in entries] == [np.float16(entropy_arrays(shift=float(s))["entropies"][0, 0]) for s in (1, 2, 3)]

    def failing_stats(arrays: dict[str, np.ndarray]) -> dict[str, float]:
        raise OSError("disk full")

    writer.write_step_later(4, entropy_arrays(), failing_stats)
    with pytest.raises(OSError, match="disk full"):
        writer.flush()
    writer.flush()  # the error is reported once
    assert TraceReader(tmp_path).steps() == [1, 2, 3]


def _claiming_npz(path: Path, claims: dict[str, tuple[str, tuple[int, ...]]], real: dict[str, np.ndarray]) -> None:
    """A step file whose arrays ``claims`` have headers claiming (dtype, shape) but only 64 bytes of data each
    (a compressed file of zeros could hold them truly); ``real`` are stored as they are."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, (dtype, shape) in claims.items():
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                          "fortran_order": False, "shape": shape})
            zf.writestr(f"{name}.npy", header.getvalue() + bytes(64))
        for name, array in real.items():
            out = io.BytesIO()
            np.lib.format.write_array(out, array)
            zf.writestr(f"{name}.npy", out.getvalue())


def _peak_bytes_of(fn: object) -> tuple[BaseException | None, int]:
    tracemalloc.start()
    try:
        fn()  # type: ignore[operator]
        error = None
    except Exception as e:
        error = e
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return error, peak


def test_a_small_step_file_claiming_huge_arrays_is_refused_before_unpacking(tmp_path: Path) -> None:
    written_trace(tmp_path)
    arrays = entropy_arrays()
    rows, length = arrays["response_mask"].shape
    path = tmp_path / step_file_name(2)
    others = {k: v for k, v in arrays.items() if k != "response_mask"}
    _claiming_npz(path, {"response_mask": ("bool", (100_000, 10_000))}, others)  # 1 GB unpacked
    assert path.stat().st_size < 4096
    error, peak = _peak_bytes_of(lambda: TraceReader(tmp_path).load_step(2))
    assert isinstance(error, TraceError) and str(error) == (
        f"step 2: file {path.resolve()} does not fit its manifest line (its response_mask has shape (100000, 10000), "
        f"its manifest line says num_responses={rows}, response_len={length})")
    assert peak < 2 << 20  # nothing unpacked (numpy would allocate the 1 GB before reading the data)
    # a field of the right rows but a huge second dimension
    _claiming_npz(path, {"entropies": ("float16", (rows, 500_000_000))},
                  {k: v for k, v in arrays.items() if k != "entropies"})
    error, peak = _peak_bytes_of(lambda: TraceReader(tmp_path).load_step(2))
    assert isinstance(error, TraceError) and f"its field entropies has shape ({rows}, 500000000), expected " \
        f"({rows}, {length})" in str(error) and peak < 2 << 20
    # a manifest line that lies too: the cap on one step's memory holds
    lines = manifest_lines(tmp_path)
    lines[1].update(num_responses=100_000, response_len=100_000)
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    huge = (100_000, 100_000)
    _claiming_npz(path, {"response_mask": ("bool", huge), "entropies": ("float16", huge),
                         "responses": ("int32", huge), "response_index": ("int32", (100_000,))}, {})
    error, peak = _peak_bytes_of(lambda: TraceReader(tmp_path).load_step(2))
    assert isinstance(error, TraceError) and "its arrays would take 66758 MB unpacked, more than the 4096 MB cap on " \
        "one step (MAX_STEP_BYTES)" in str(error) and peak < 2 << 20
    assert TraceReader(tmp_path).load_step(1)["entropies"].shape == (rows, length)  # the other step still loads
