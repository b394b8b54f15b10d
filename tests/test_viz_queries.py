"""The explorer's queries on a hand-made step: every number is computed by hand in the comments."""

from __future__ import annotations

import csv
import io
import math

import numpy as np
import pandas as pd
import pytest

from archer.errors import ArcherError
from archer.viz import queries

VOCAB = {0: "<pad>", 10: " the", 11: "cat", 12: "\n", 13: "The", 14: "a", 15: "\t", 16: "THE end", 20: "<python>",
         21: "x", 22: "</python>", 23: " <result>", 24: "7", 25: "</result>", 28: "<search>", 29: "q",
         30: "</search>"}
NAN = np.nan


def decode(ids: np.ndarray) -> list[str]:
    return [VOCAB[int(i)] for i in np.asarray(ids).reshape(-1)]


def entropy_step() -> dict[str, np.ndarray]:
    """3 responses x 4 positions; lengths 3, 2, 4; all values exact in float16."""
    return {
        "entropies": np.array([[0.5, 1.0, 2.0, 0.0], [0.25, 3.0, 0.0, 0.0], [1.5, 0.75, 0.5, 2.5]], np.float16),
        "response_mask": np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool),
        "responses": np.array([[10, 11, 12, 0], [13, 10, 0, 0], [14, 15, 10, 16]], np.int32),
        "response_index": np.array([5, 6, 7], np.int32),
        "prompt_length": np.array([2, 2, 3], np.int32),
        "prompts": np.array([[0, 0, 1, 2], [0, 0, 1, 2], [0, 3, 4, 5]], np.int32),
        "uid": np.array(["a", "a", "b"]),
        "sample_index": np.array([1, 0, 0], np.int32),
        "old_log_probs": np.array([[-0.5, -1.0, -2.0, 0.0], [-0.25, -3.0, 0.0, 0.0], [-1.5, -0.75, -0.5, -2.5]],
                                  np.float16),
        "reward": np.array([1.0, 0.0, 1.0], np.float32),
        "advantage": np.array([0.5, -0.5, 0.25], np.float32),
        "data_source": np.array(["x", "y", "x"]),
    }


def influence_step() -> dict[str, np.ndarray]:
    arrays = entropy_step()
    arrays.update({
        "influence": np.array([[0.5, NAN, -1.0, NAN], [0.25, 0.75, NAN, NAN], [NAN, -0.5, 1.0, 2.0]], np.float16),
        "selected_row_id": np.array([5, 6, 7], np.int32),
        "accepted": np.array([True, False, True]),
        "group_id": np.array([0, 0, 1], np.int32),
    })
    return arrays


# Valid entropies: 0.5 1 2 | 0.25 3 | 1.5 0.75 0.5 2.5 -> sorted 0.25 0.5 0.5 0.75 1 1.5 2 2.5 3, sum 12,
# sum of squares 23.625. numpy's linear percentiles: p50 at index 4 -> 1.0; p90 at 7.2 -> 2.5 + 0.2 * 0.5;
# p99 at 7.92 -> 2.5 + 0.92 * 0.5.
ENTROPY_STATS = {"entropy_mean": 12 / 9, "entropy_std": math.sqrt(23.625 / 9 - (12 / 9) ** 2),
                 "entropy_p50": 1.0, "entropy_p90": 2.6, "entropy_p99": 2.96}


def test_step_stats_of_an_entropy_step() -> None:
    stats = queries.step_stats(entropy_step())
    assert list(stats) == ["num_responses", "num_valid_tokens", *ENTROPY_STATS, "reward_mean"]
    assert stats["num_responses"] == 3 and stats["num_valid_tokens"] == 9
    for key, value in ENTROPY_STATS.items():
        assert stats[key] == pytest.approx(value, abs=1e-12), key
    assert stats["reward_mean"] == pytest.approx(2 / 3)


def test_step_stats_of_an_influence_step_skip_nan_and_padding() -> None:
    # Computed valid influences: 0.5 -1 | 0.25 0.75 | -0.5 1 2 -> sorted -1 -0.5 0.25 0.5 0.75 1 2, sum 3;
    # sum of squares 7.125; p50 index 3 -> 0.5; p90 index 5.4 -> 1 + 0.4; p99 index 5.94 -> 1 + 0.94.
    # |influence| sorted 0.25 0.5 0.5 0.75 1 1 2 -> p99 index 5.94 -> 1 + 0.94.
    stats = queries.step_stats(influence_step())
    assert stats["accepted_fraction"] == pytest.approx(2 / 3)
    assert stats["num_valid_influence"] == 7
    expected = {"influence_mean": 3 / 7, "influence_std": math.sqrt(7.125 / 7 - (3 / 7) ** 2),
                "influence_p50": 0.5, "influence_p90": 1.4, "influence_p99": 1.94, "influence_abs_p99": 1.94}
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, abs=1e-12), key
    for key, value in ENTROPY_STATS.items():
        assert stats[key] == pytest.approx(value, abs=1e-12), key


def test_colour_scales_fall_back_to_one() -> None:
    assert queries.colour_scales({"entropy_p99": 2.96, "influence_abs_p99": 1.94}) == (2.96, 1.94)
    assert queries.colour_scales({"entropy_p99": 0.0}) == (1.0, 1.0)
    assert queries.colour_scales({"entropy_p99": float("nan"), "influence_abs_p99": -1.0}) == (1.0, 1.0)


def test_overview_table_row_by_row() -> None:
    table = queries.overview_table(influence_step())
    assert list(table.columns) == ["row", "response_index", "uid", "sample_index", "data_source", "learned_tokens",
                                   "reward", "advantage", "accepted", "group_id", "entropy_mean", "entropy_max",
                                   "influence_mean"]
    assert table["row"].tolist() == [0, 1, 2]
    assert table["response_index"].tolist() == [5, 6, 7]
    assert table["uid"].tolist() == ["a", "a", "b"] and table["sample_index"].tolist() == [1, 0, 0]
    assert table["data_source"].tolist() == ["x", "y", "x"]
    assert table["learned_tokens"].tolist() == [3, 2, 4]
    assert table["reward"].tolist() == [1.0, 0.0, 1.0] and table["advantage"].tolist() == [0.5, -0.5, 0.25]
    assert table["accepted"].tolist() == [True, False, True] and table["group_id"].tolist() == [0, 0, 1]
    # (0.5+1+2)/3, (0.25+3)/2, (1.5+0.75+0.5+2.5)/4; padding never counts.
    assert table["entropy_mean"].tolist() == pytest.approx([3.5 / 3, 1.625, 1.3125])
    assert table["entropy_max"].tolist() == [2.0, 3.0, 2.5]
    # (0.5-1)/2, (0.25+0.75)/2, (-0.5+1+2)/3: NaN (not computed) and padding skipped.
    assert table["influence_mean"].tolist() == pytest.approx([-0.25, 0.5, 2.5 / 3])


def test_overview_of_an_entropy_step_has_no_influence_columns_and_empty_rows_are_nan() -> None:
    arrays = entropy_step()
    arrays["response_mask"][1] = False
    table = queries.overview_table(arrays)
    assert "influence_mean" not in table and "accepted" not in table and "group_id" not in table
    assert table["learned_tokens"].tolist() == [3, 0, 4]
    assert math.isnan(table["entropy_mean"][1]) and math.isnan(table["entropy_max"][1])


def test_overview_shows_each_reward_extra_under_its_key() -> None:
    arrays = entropy_step()
    arrays["reward_extra/f1"] = np.array([0.5, NAN, 0.25], np.float32)
    arrays["reward_extra/format_ok"] = np.array([1, 0, 1], np.float32)
    arrays["reward_extra/reward"] = np.array([7, 8, 9], np.float32)  # "reward" is taken: the field name shows
    table = queries.overview_table(arrays)
    assert list(table.columns) == ["row", "response_index", "uid", "sample_index", "data_source", "learned_tokens",
                                   "reward", "advantage", "f1", "format_ok", "reward_extra/reward", "entropy_mean",
                                   "entropy_max"]
    assert table["f1"].tolist()[::2] == [0.5, 0.25] and math.isnan(table["f1"][1])
    assert table["format_ok"].tolist() == [1.0, 0.0, 1.0]
    assert table["learned_tokens"].tolist() == [3, 2, 4] and table["reward_extra/reward"].tolist() == [7.0, 8.0, 9.0]


def test_prompt_and_response_ids_drop_padding() -> None:
    arrays = entropy_step()
    assert queries.prompt_ids(arrays, 0).tolist() == [1, 2]
    assert queries.prompt_ids(arrays, 2).tolist() == [3, 4, 5]
    assert queries.response_ids(arrays, 1).tolist() == [13, 10]
    del arrays["prompt_length"]
    assert queries.prompt_ids(arrays, 0).tolist() == [0, 0, 1, 2]  # no lengths: the whole row
    del arrays["prompts"]
    assert queries.prompt_ids(arrays, 0) is None


def test_token_table_of_one_response() -> None:
    table = queries.token_table(influence_step(), 0, decode)
    assert list(table.columns) == ["position", "token", "token_id", "entropy", "log_prob", "prob", "influence",
                                   "valid"]
    assert table["position"].tolist() == [0, 1, 2, 3]
    assert table["token"].tolist() == [" the", "cat", "\n", "<pad>"]
    assert table["token_id"].tolist() == [10, 11, 12, 0]
    assert table["entropy"].tolist() == [0.5, 1.0, 2.0, 0.0]
    assert table["log_prob"].tolist() == [-0.5, -1.0, -2.0, 0.0]
    assert table["prob"].tolist() == pytest.approx([math.exp(-0.5), math.exp(-1.0), math.exp(-2.0), 1.0])
    assert table["influence"].tolist()[::2] == [0.5, -1.0] and np.isnan(table["influence"][1])
    assert table["valid"].tolist() == [True, True, True, False]
    with pytest.raises(IndexError, match="row 3 is out of range"):
        queries.token_table(influence_step(), 3, decode)


def _view(row: int, **options) -> pd.DataFrame:
    return queries.token_view(queries.token_table(entropy_step(), row, decode), **options)


def test_token_view_hides_padding_unless_asked() -> None:
    assert _view(0)["position"].tolist() == [0, 1, 2]
    assert _view(0, show_padding=True)["position"].tolist() == [0, 1, 2, 3]


def test_entropy_filter_is_inclusive_and_open_ended() -> None:
    # Row 2 entropies by position: 1.5, 0.75, 0.5, 2.5.
    assert _view(2, entropy_range=(0.5, 1.5))["position"].tolist() == [0, 1, 2]
    assert _view(2, entropy_range=(0.6, 2.0))["position"].tolist() == [0, 1]
    assert _view(2, entropy_range=(1.0, None))["position"].tolist() == [0, 3]
    assert _view(2, entropy_range=(None, 0.75))["position"].tolist() == [1, 2]
    assert _view(2, entropy_range=(3.0, 4.0)).empty


def test_search_is_a_case_insensitive_substring_of_the_token_text() -> None:
    # Row 2 tokens: "a", "\t", " the", "THE end".
    assert _view(2, search="the")["position"].tolist() == [2, 3]
    assert _view(2, search=" t")["position"].tolist() == [2]  # the leading space is part of the text
    assert _view(2, search="\t")["position"].tolist() == [1]
    assert _view(2, search="E e")["position"].tolist() == [3]
    assert _view(2, search="zebra").empty
    assert _view(2, search="the", entropy_range=(None, 1.0))["position"].tolist() == [2]  # both apply


def test_sorts_keep_position_order_between_ties() -> None:
    # Row 1 with padding: entropies 0.25, 3.0, 0.0 (pad), 0.0 (pad).
    assert _view(1, show_padding=True, sort="entropy_asc")["position"].tolist() == [2, 3, 0, 1]
    assert _view(1, show_padding=True, sort="entropy_desc")["position"].tolist() == [1, 0, 2, 3]
    assert _view(2, sort="entropy_desc")["position"].tolist() == [3, 0, 1, 2]
    assert _view(2, sort="entropy_asc", search="the")["position"].tolist() == [2, 3]
    assert _view(2, sort="position")["position"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="unknown sort"):
        _view(2, sort="length")


def test_csv_of_a_view_field_by_field() -> None:
    view = _view(0, show_padding=True, sort="entropy_desc")
    text = queries.view_csv(view, step=7, row=0)
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == ["step", "row", "position", "token", "token_id", "entropy", "log_prob", "prob", "valid"]
    # entropy descending: positions 2 (2.0), 1 (1.0), 0 (0.5), 3 (padding, 0.0).
    assert rows[1] == ["7", "0", "2", "\n", "12", "2.0", "-2.0", repr(math.exp(-2.0)), "True"]
    assert rows[2] == ["7", "0", "1", "cat", "11", "1.0", "-1.0", repr(math.exp(-1.0)), "True"]
    assert rows[3] == ["7", "0", "0", " the", "10", "0.5", "-0.5", repr(math.exp(-0.5)), "True"]
    assert rows[4] == ["7", "0", "3", "<pad>", "0", "0.0", "0.0", "1.0", "False"]
    assert len(rows) == 5
    assert '"\n"' in text  # the newline token is quoted, not a row break


def test_top_tokens_highest_and_lowest_with_ties_by_row() -> None:
    arrays = entropy_step()
    high = queries.top_tokens(arrays, 3, decode, highest=True)
    assert list(high.columns) == ["rank", "row", "response_index", "position", "token", "token_id", "entropy"]
    assert high["rank"].tolist() == [1, 2, 3]
    assert list(zip(high["row"], high["position"])) == [(1, 1), (2, 3), (0, 2)]  # 3.0, 2.5, 2.0
    assert high["entropy"].tolist() == [3.0, 2.5, 2.0]
    assert high["response_index"].tolist() == [6, 7, 5]
    assert high["token"].tolist() == [" the", "THE end", "\n"] and high["token_id"].tolist() == [10, 16, 12]
    low = queries.top_tokens(arrays, 3, decode, highest=False)
    # 0.25 (row 1), then the two 0.5 in row order; padding (0.0) never counts.
    assert list(zip(low["row"], low["position"])) == [(1, 0), (0, 0), (2, 2)]
    assert low["entropy"].tolist() == [0.25, 0.5, 0.5]
    low2 = queries.top_tokens(arrays, 2, decode, highest=False)
    assert list(zip(low2["row"], low2["position"])) == [(1, 0), (0, 0)]  # the tie at the cut goes to row 0
    assert len(queries.top_tokens(arrays, 100, decode)) == 9  # K beyond the valid tokens
    assert queries.top_tokens(arrays, 0, decode).empty


def test_entropy_histogram_counts_valid_tokens() -> None:
    counts, edges = queries.entropy_histogram(entropy_step(), bins=3)
    assert edges.tolist() == [0.0, 1.0, 2.0, 3.0]  # 0 .. max (3.0)
    # [0,1): 0.25 0.5 0.5 0.75; [1,2): 1 1.5; [2,3]: 2 2.5 3.
    assert counts.tolist() == [4, 2, 3]
    counts, edges = queries.entropy_histogram(entropy_step(), bins=2, value_range=(0.0, 4.0))
    assert counts.tolist() == [6, 3] and edges.tolist() == [0.0, 2.0, 4.0]  # [0,2): six values; [2,4]: three


def test_curves_from_manifest_entries() -> None:
    entries = [
        {"step": 4, "created_at": "t", "file": "steps/step_000004.npz", "num_responses": 8, "response_len": 16,
         "num_valid_tokens": 100, "entropy_mean": 0.5, "reward_mean": 1.0, "flag": True},
        {"step": 2, "created_at": "t", "file": "steps/step_000002.npz", "num_responses": 8, "response_len": 16,
         "num_valid_tokens": 90, "entropy_mean": 0.75, "influence_mean": -0.5},
    ]
    table = queries.curves(entries)
    assert table["step"].tolist() == [2, 4]
    assert set(table.columns) == {"step", "num_valid_tokens", "entropy_mean", "reward_mean", "influence_mean"}
    assert table["entropy_mean"].tolist() == [0.75, 0.5]
    assert table["num_valid_tokens"].tolist() == [90.0, 100.0]
    assert np.isnan(table["reward_mean"][0]) and table["reward_mean"][1] == 1.0
    assert table["influence_mean"][0] == -0.5 and np.isnan(table["influence_mean"][1])
    assert queries.curves([]).columns.tolist() == ["step"]


def test_group_rows_order_by_sample_index() -> None:
    arrays = entropy_step()
    assert queries.group_rows(arrays, "a").tolist() == [1, 0]  # sample_index 0 is row 1
    assert queries.group_rows(arrays, "b").tolist() == [2]
    assert queries.group_rows(arrays, "zzz").tolist() == []


def test_matching_rows_compare_prompt_ids_not_uids() -> None:
    here = entropy_step()
    other = entropy_step()
    other["uid"] = np.array(["p", "q", "r"])  # uids are per step
    other["prompts"] = np.array([[9, 9, 1, 2], [0, 9, 1, 2], [0, 0, 1, 2]], np.int32)
    other["prompt_length"] = np.array([2, 3, 2], np.int32)
    other["sample_index"] = np.array([1, 0, 0], np.int32)
    # Row 0 of here has prompt [1, 2]. Other row 0: [1, 2] (left padding differs); row 1: [9, 1, 2] (no);
    # row 2: [1, 2]. Ordered by sample_index: row 2 (0), then row 0 (1).
    assert queries.matching_rows(here, 0, other).tolist() == [2, 0]
    assert queries.matching_rows(here, 2, other).tolist() == []  # [3, 4, 5] is not there
    del other["prompts"]
    assert queries.matching_rows(here, 0, other).tolist() == []


# -- a tool run ------------------------------------------------------------------------------------------------
def tool_step() -> dict[str, np.ndarray]:
    """5 responses x 7 positions of a tool run. Prompt g: row 0 calls python (positions 0-2), gets the answer
    (3-5, tool output) and ends with " the"; rows 1 and 3 branched from it right after the answer (position 6);
    row 2 is a global sample with a search call. Prompt h: row 4, whose parent is not an earlier response."""
    call, answer = [20, 21, 22], [23, 24, 25]
    responses = np.array([call + answer + [10], call + answer + [11], [13, 28, 29, 30, 23, 25, 10],
                          call + answer + [16], [14, 10, 0, 0, 0, 0, 0]], np.int32)
    tool = np.zeros((5, 7), bool)
    tool[[0, 1, 3], 3:6] = True
    tool[2, 4:6] = True
    mask = (responses != 0) & ~tool
    entropies = (np.arange(35, dtype=np.float16).reshape(5, 7) / 4).astype(np.float16)  # exact quarters
    return {"entropies": entropies, "response_mask": mask, "responses": responses, "tool_mask": tool,
            "response_index": np.arange(5, dtype=np.int32), "uid": np.array(["g", "g", "g", "g", "h"]),
            "sample_index": np.array([0, 1, 2, 3, 0], np.int32),
            "reward": np.array([1.0, 0.0, 0.5, 1.0, 0.0], np.float32),
            "num_tool_calls": np.array([1, 1, 1, 1, 0], np.int32), "num_turns": np.array([2, 2, 2, 2, 1], np.int32),
            "branch_parent": np.array([-1, 0, -1, 0, 0], np.int32),
            "branch_position": np.array([-1, 6, -1, 6, 1], np.int32),
            "finish_reason": np.array(["eos", "eos", "length", "eos", "eos"])}


def test_call_tokens_are_the_tagged_blocks_the_model_wrote() -> None:
    texts = ["a<py", "thon>x</python>", " <result>", "7", "</result>", "<search>q", "</search>", " <python>open"]
    written = np.array([1, 1, 0, 0, 0, 1, 1, 1], bool)
    # "a<py" holds the start of the tag; the unclosed call at the end is no call
    assert queries.call_tokens(texts, written).tolist() == [True, True, False, False, False, True, True, False]
    # a block interrupted by tool output is no call of the model's
    assert queries.call_tokens(["<python>", "x", "</python>"], np.array([1, 0, 1], bool)).tolist() == [False] * 3
    texts = ["<tool_call>", '{"name": "python"}', "</tool_call>", "<search>", "q"]
    assert queries.call_tokens(texts, np.ones(5, bool)).tolist() == [True, True, True, False, False]
    assert queries.call_tokens([], np.zeros(0, bool)).tolist() == []


def test_call_tokens_are_the_calls_of_the_runs_own_tags() -> None:
    # a custom tool (trigger tag calc): its call, the tool output, then a <python> block that is no call in this run
    texts = ["<calc>", "1+1", "</calc>", " <result>", "2", "</result>", " <python>", "x", "</python>"]
    written = np.array([1, 1, 1, 0, 0, 0, 1, 1, 1], bool)
    calls = queries.call_tokens(texts, written, (("<calc>", "</calc>"),))
    assert calls.tolist() == [True, True, True] + [False] * 6
    both = (("<calc>", "</calc>"), ("<python>", "</python>"))
    assert queries.call_tokens(texts, written, both).tolist() == [True] * 3 + [False] * 3 + [True] * 3
    # tags with regex characters are matched as text; no tags: no calls
    texts = ["<a.b>", "q", "</a.b>", "<axb>", "q", "</axb>"]
    assert queries.call_tokens(texts, np.ones(6, bool), (("<a.b>", "</a.b>"),)).tolist() == [True] * 3 + [False] * 3
    assert queries.call_tokens(texts, np.ones(6, bool), ()).tolist() == [False] * 6


def test_call_tags_are_what_the_trace_records() -> None:
    assert queries.call_tags({"kind": "entropy"}) == queries.DEFAULT_CALL_TAGS  # a trace that records none
    assert queries.DEFAULT_CALL_TAGS == (("<python>", "</python>"), ("<search>", "</search>"),
                                         ("<tool_call>", "</tool_call>"))
    assert queries.call_tags({"call_tags": [["<calc>", "</calc>"]]}) == (("<calc>", "</calc>"),)
    assert queries.call_tags({"call_tags": []}) == ()
    for bad in ("<calc>", [["<calc>"]], [["<calc>", ""]], [["<calc>", 3]]):
        with pytest.raises(ArcherError, match="call_tags"):
            queries.call_tags({"call_tags": bad})


def test_token_table_of_a_tool_run_marks_tool_output_and_calls() -> None:
    table = queries.token_table(tool_step(), 2, decode)
    assert list(table.columns)[-3:] == ["valid", "tool", "tool_call"]
    assert table["valid"].tolist() == [True, True, True, True, False, False, True]
    assert table["tool"].tolist() == [False, False, False, False, True, True, False]
    assert table["tool_call"].tolist() == [False, True, True, True, False, False, False]
    assert queries.in_response(table).tolist() == [True] * 7
    assert "tool" not in queries.token_table(entropy_step(), 0, decode)  # a run without tools
    # a run whose only tool is search: the python block of row 0 is no call there
    assert queries.token_table(tool_step(), 0, decode)["tool_call"].tolist() == [True] * 3 + [False] * 4
    searching = queries.token_table(tool_step(), 0, decode, tags=(("<search>", "</search>"),))
    assert searching["tool_call"].tolist() == [False] * 7
    assert queries.token_table(tool_step(), 2, decode, tags=(("<search>", "</search>"),))["tool_call"].tolist() == (
        table["tool_call"].tolist())


def test_the_response_of_a_tool_run_holds_its_tool_output() -> None:
    arrays = tool_step()
    assert queries.response_ids(arrays, 0).tolist() == [20, 21, 22, 23, 24, 25, 10]
    assert queries.response_ids(arrays, 4).tolist() == [14, 10]
    assert queries.content_mask(arrays)[2].tolist() == [True] * 7


def test_the_view_of_a_tool_run_keeps_tool_output_out_of_entropy_filters_and_sorts_it_last() -> None:
    tokens = queries.token_table(tool_step(), 0, decode)  # entropies 0, 0.25, ..., 1.5 by position
    assert queries.token_view(tokens)["position"].tolist() == list(range(7))  # tool output is no padding
    assert queries.token_view(tokens, entropy_range=(0.5, None))["position"].tolist() == [2, 6]  # not 3, 4, 5
    assert queries.token_view(tokens, search="result")["position"].tolist() == [3, 5]  # the search sees it
    assert queries.token_view(tokens, sort="entropy_desc")["position"].tolist() == [6, 2, 1, 0, 5, 4, 3]
    assert queries.token_view(tokens, sort="entropy_asc")["position"].tolist() == [0, 1, 2, 6, 3, 4, 5]


def test_overview_of_a_tool_run() -> None:
    table = queries.overview_table(tool_step())
    assert list(table.columns) == ["row", "response_index", "uid", "sample_index", "learned_tokens", "tool_tokens",
                                   "reward", "num_tool_calls", "num_turns", "branch_parent", "branch_position",
                                   "finish_reason", "entropy_mean", "entropy_max"]
    assert table["learned_tokens"].tolist() == [4, 4, 5, 4, 2] and table["tool_tokens"].tolist() == [3, 3, 2, 3, 0]
    assert table["finish_reason"].tolist() == ["eos", "eos", "length", "eos", "eos"]
    # row 0: the model's entropies at 0, 1, 2 and 6 (tool output at 3-5 never counts): 0, 0.25, 0.5, 1.5
    assert table["entropy_mean"][0] == pytest.approx(2.25 / 4) and table["entropy_max"][0] == 1.5


def test_branch_tree_of_a_prompt_by_hand() -> None:
    arrays = tool_step()
    tree = queries.branch_tree(arrays, "g")
    # row 0, then its branches (both at position 6, by sample_index), then the other global sample
    assert tree["row"].tolist() == [0, 1, 3, 2]
    assert tree["sample_index"].tolist() == [0, 1, 3, 2]
    assert tree["parent"].tolist() == [-1, 0, 0, -1] and tree["parent_row"].tolist() == [-1, 0, 0, -1]
    assert tree["branch_position"].tolist() == [-1, 6, 6, -1]
    # the entropy of the branch's token at its branch point: row 1 position 6 = 13/4, row 3 position 6 = 27/4
    assert np.isnan(tree["branch_token_entropy"][0]) and np.isnan(tree["branch_token_entropy"][3])
    assert tree["branch_token_entropy"].tolist()[1:3] == [3.25, 6.75]
    assert tree["depth"].tolist() == [0, 1, 1, 0] and tree["branches"].tolist() == [2, 0, 0, 0]
    assert tree["all_tokens"].tolist() == [7, 7, 7, 7] and tree["tool_tokens"].tolist() == [3, 3, 3, 2]
    assert tree["reward"].tolist() == [1.0, 0.0, 1.0, 0.5]
    assert tree["num_tool_calls"].tolist() == [1, 1, 1, 1]
    assert tree["finish_reason"].tolist() == ["eos", "eos", "eos", "length"]
    lone = queries.branch_tree(arrays, "h")  # parent 0 is not an earlier response of its group: a root
    assert lone[["row", "parent", "parent_row", "branch_position", "depth", "all_tokens"]].values.tolist() == [
        [4, -1, -1, -1, 0, 2]]
    assert queries.branch_tree(arrays, "zzz").empty


def test_branch_tree_of_a_deeper_tree_and_of_a_run_without_tools() -> None:
    arrays = tool_step()
    arrays["branch_parent"] = np.array([-1, 0, -1, 1, 0], np.int32)  # row 3 branched from row 1 at 6
    tree = queries.branch_tree(arrays, "g")
    assert tree["row"].tolist() == [0, 1, 3, 2] and tree["depth"].tolist() == [0, 1, 2, 0]
    assert tree["branches"].tolist() == [1, 1, 0, 0] and tree["parent"].tolist() == [-1, 0, 1, -1]
    plain = queries.branch_tree(entropy_step(), "a")  # no branch fields: every response is a root
    assert plain["row"].tolist() == [1, 0] and plain["parent"].tolist() == [-1, -1]
    assert plain["all_tokens"].tolist() == [2, 3] and plain["tool_tokens"].tolist() == [0, 0]
    assert "num_tool_calls" not in plain and plain["reward"].tolist() == [0.0, 1.0]


def test_prompt_uids_in_order_of_first_response() -> None:
    arrays = entropy_step()
    arrays["uid"] = np.array(["b", "a", "b"])
    assert queries.prompt_uids(arrays) == ["b", "a"]
    del arrays["uid"]
    assert queries.prompt_uids(arrays) == []
