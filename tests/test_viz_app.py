"""The explorer behind the UI (``Explorer``) on real synthetic traces, the Gradio app's construction, and the
`archer viz` command: tokenizer choice, CSV files, prompt views across steps, corrupt and missing steps, new
steps of a running training, bad paths and a busy port."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import health_support
import numpy as np
import pandas as pd
import pytest
import trace_support
from matplotlib.figure import Figure

from archer.cli import build_parser
from archer.errors import ArcherError
from archer.trace.format import TraceError, TraceWriter
from archer.viz import app as app_module
from archer.viz import queries, render
from archer.viz.explorer import Explorer, TokenDecoder

ARCHER = [sys.executable, "-m", "archer.cli"]


@pytest.fixture(scope="module")
def tokenizer():
    return trace_support.tiny_tokenizer()


@pytest.fixture(scope="module")
def influence_trace(tmp_path_factory, tokenizer) -> Path:
    return trace_support.write_trace(tmp_path_factory.mktemp("viz") / "influence_trace", tokenizer,
                                     kind="influence", steps=(1, 2, 3, 4))


@pytest.fixture(scope="module")
def explorer(influence_trace) -> Explorer:
    return Explorer(influence_trace)


def test_header_and_steps(explorer, influence_trace) -> None:
    assert explorer.kind == "influence" and explorer.has_influence
    assert explorer.steps() == [1, 2, 3, 4]
    header = explorer.header()
    assert header.startswith(f"**influence trace** `{influence_trace.resolve()}` — viz-tests / influence — "
                             "steps 1..4 (4 written), updated ")
    assert header.endswith("tokenizer: tokenizer/ of the trace")


def test_stats_table_is_the_step_statistics(explorer, tokenizer) -> None:
    table = explorer.stats_table(2)
    expected = queries.step_stats(trace_support.step_arrays(tokenizer, 2, kind="influence"))
    assert table.columns.tolist() == ["step", *expected]
    assert table.iloc[0].tolist() == pytest.approx([2, *expected.values()])


def test_response_view_decodes_filters_and_writes_the_csv(explorer, tokenizer) -> None:
    arrays = trace_support.step_arrays(tokenizer, 2, kind="influence")
    row = 4  # group 1 at step 2 -> PROMPTS[(1 + 1) % 4]
    result = explorer.response(2, row, entropy_range=(0.5, 2.5), search="e", sort="entropy_desc")
    assert result.prompt == trace_support.PROMPTS[2]
    valid_ids = arrays["responses"][row][arrays["response_mask"][row]]
    assert result.response == tokenizer.decode(valid_ids.tolist())
    entropy = arrays["entropies"][row].astype(np.float64)
    texts = [tokenizer.decode([int(i)]) for i in arrays["responses"][row]]
    expected = [p for p in range(arrays["response_mask"].shape[1]) if arrays["response_mask"][row, p]
                and 0.5 <= entropy[p] <= 2.5 and "e" in texts[p].lower()]
    expected.sort(key=lambda p: (-entropy[p], p))
    assert expected, "the filter should keep some tokens of this response"
    assert result.view["position"].tolist() == expected
    assert f"view: {len(expected)} rows (sort: entropy_desc); {len(expected)} valid tokens match" in result.metadata
    with open(result.csv_path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["position"]) for r in rows] == expected
    for r, p in zip(rows, expected):
        assert (r["step"], r["row"], r["token"], int(r["token_id"])) == ("2", "4", texts[p],
                                                                          arrays["responses"][row, p])
        assert float(r["entropy"]) == float(arrays["entropies"][row, p])
        assert float(r["log_prob"]) == float(arrays["old_log_probs"][row, p])
        assert float(r["prob"]) == pytest.approx(np.exp(float(arrays["old_log_probs"][row, p])), rel=1e-12)
        influence = float(arrays["influence"][row, p])
        assert (r["influence"] == "") if np.isnan(influence) else (float(r["influence"]) == influence)
        assert r["valid"] == "True"


def test_heatmaps_show_every_valid_token_and_mark_the_filtered_ones(explorer, tokenizer) -> None:
    arrays = trace_support.step_arrays(tokenizer, 3, kind="influence")
    row = 1
    result = explorer.response(3, row, entropy_range=(1.0, None))
    data = explorer.step_data(3)
    length = int(arrays["response_mask"][row].sum())
    for colour_by, html_text, vmax, colour in (
            ("entropy", result.entropy_html, data.entropy_vmax, render.entropy_colour),
            ("influence", result.influence_html, response_p99(arrays, row), render.influence_colour)):
        assert f'data-colour="{colour_by}" data-vmax="{vmax!r}" data-tokens="{length}"' in html_text
        for p in range(length):
            value = float(arrays[colour_by if colour_by == "influence" else "entropies"][row, p])
            faded = "" if float(arrays["entropies"][row, p]) >= 1.0 else " archer-tok--out"
            text = render.visible_text(tokenizer.decode([int(arrays["responses"][row, p])]))
            assert (f'<span class="archer-tok{faded}" data-pos="{p}"' in html_text
                    and f'style="background-color:{colour(value, vmax)}">{text}</span>' in html_text), (colour_by, p)
    assert 'data-pos="31"' not in result.entropy_html  # padding hidden
    with_padding = explorer.response(3, row, show_padding=True)
    assert with_padding.entropy_html.count('class="archer-tok') == arrays["response_mask"].shape[1]


def response_p99(arrays: dict, row: int) -> float:
    """p99 of |influence| over the row's learned tokens whose influence was computed, by hand."""
    values = [abs(float(v)) for v, m in zip(arrays["influence"][row], arrays["response_mask"][row])
              if m and not np.isnan(v)]
    return float(np.percentile(values, 99))


def test_the_influence_scale_is_the_responses_own_by_default_or_the_steps_and_says_which(explorer,
                                                                                           tokenizer) -> None:
    """The issue's case: one step's largest |influence| (402) left a response of +-1.4 all white."""
    arrays = trace_support.step_arrays(tokenizer, 3, kind="influence")
    data = explorer.step_data(3)
    for row in range(arrays["response_mask"].shape[0]):
        result = explorer.response(3, row)
        own = response_p99(arrays, row)
        assert f'data-colour="influence" data-vmax="{own!r}"' in result.influence_html
        assert "influence (scale: p99 of |influence| over this response)" in result.influence_html
        assert result.metadata.endswith(f"|influence| {own:.3g} (response)")
        per_step = explorer.response(3, row, influence_scale="step")
        assert f'data-colour="influence" data-vmax="{data.influence_vmax!r}"' in per_step.influence_html
        assert "influence (scale: p99 of |influence| over this step)" in per_step.influence_html
        assert per_step.metadata.endswith(f"|influence| {data.influence_vmax:.3g} (step)")
    assert len({response_p99(arrays, r) for r in range(arrays["response_mask"].shape[0])}) > 1
    with pytest.raises(ValueError, match="influence_scale"):
        explorer.response(3, 0, influence_scale="run")


def test_the_response_view_shows_policy_versions_staleness_and_rejected_tokens(tmp_path, tokenizer) -> None:
    trace = trace_support.write_trace(tmp_path / "entropy_trace", tokenizer, steps=(5,), off_policy=True)
    explorer = Explorer(trace)
    stale, fresh = explorer.response(5, 1), explorer.response(5, 0)
    assert "**first_policy_version** 3 | **policy_version** 3 | **staleness** 1" in stale.metadata
    assert "**first_policy_version** 4 | **policy_version** 4 | **staleness** 0" in fresh.metadata
    assert "**first_policy_version** 2 | **policy_version** 3" in explorer.response(5, 3).metadata  # resumed
    assert "**rejected_tokens** 1" in fresh.metadata and "**rejected_tokens** 0" in explorer.response(5, 4).metadata
    first = fresh.entropy_html.split('data-pos="0"')[0].rsplit("<span", 1)[1]
    assert "archer-tok--rejected" in first and "archer-tok--rejected" not in stale.entropy_html.split(
        'data-pos="1"')[0].rsplit("<span", 1)[1]
    assert "rejected by the rollout correction (no loss)" in fresh.entropy_html
    arrays = trace_support.step_arrays(tokenizer, 5, off_policy=True)
    assert fresh.response == tokenizer.decode(arrays["responses"][0][arrays["response_mask"][0]].tolist()), \
        "a rejected token is still part of the response"


def test_an_old_trace_shows_no_policy_versions(explorer) -> None:
    metadata = explorer.response(2, 1).metadata
    assert "policy_version" not in metadata and "staleness" not in metadata and "rejected" not in metadata


def test_csv_exports_are_pruned_to_the_newest(explorer) -> None:
    views = [(step, row, sort) for step in (1, 2, 4) for row in range(6) for sort in queries.SORTS]  # 54 CSVs
    paths = [explorer.response(step, row, sort=sort).csv_path for step, row, sort in views]
    assert len(set(paths)) == len(views)
    again = explorer.response(1, 0, sort="position").csv_path  # the first view again: same (content) name
    assert again == paths[0] and again.exists()
    kept = set(again.parent.glob("*.csv"))
    assert len(kept) == 32 and paths[-1] in kept and paths[1] not in kept


def test_an_empty_trace_opens(tmp_path) -> None:
    from archer.viz.app import build_app

    TraceWriter(tmp_path / "empty", kind="entropy")
    explorer = Explorer(tmp_path / "empty")
    assert explorer.steps() == [] and "no steps written yet" in explorer.header()
    assert explorer.curves().axes == []
    build_app(tmp_path / "empty", poll_seconds=0)


def test_top_tokens_histogram_and_curves(explorer, tokenizer) -> None:
    arrays = trace_support.step_arrays(tokenizer, 1, kind="influence")
    high, low = explorer.top_tokens(1, 5)
    valid = np.sort(arrays["entropies"][arrays["response_mask"]].astype(np.float64))
    assert high["entropy"].tolist() == valid[::-1][:5].tolist()
    assert low["entropy"].tolist() == valid[:5].tolist()
    assert high["token"].tolist() == [tokenizer.decode([int(i)]) for i in high["token_id"]]
    assert isinstance(explorer.histogram(1, 10), Figure) and isinstance(explorer.curves(), Figure)
    assert [ax.get_ylabel() for ax in explorer.curves().axes] == ["entropy", "reward", "influence"]


def test_prompt_group_and_the_same_prompt_at_another_step(explorer) -> None:
    # Step s, group g has PROMPTS[(g + s // 2) % 4]: step 2 group 0 -> PROMPTS[1] = step 1 group 1 and
    # step 3 group 0; step 4 has PROMPTS[2] and PROMPTS[3] only.
    prompt, body = explorer.prompt_group(2, 1)
    assert prompt == trace_support.PROMPTS[1]
    assert body.count('class="archer-panel"') == 3 and body.count("step 2 · row ") == 3
    table, body = explorer.compare_steps(2, 1, 1)
    assert table["step"].tolist() == [2, 1] and table["rows"].tolist() == ["0 1 2", "3 4 5"]
    assert table["responses"].tolist() == [3, 3]
    assert "step 1 · row 3 · sample_index 0" in body and "step 1 · row 5 · sample_index 2" in body
    table, _ = explorer.compare_steps(2, 1, 3)
    assert table["rows"].tolist() == ["0 1 2", "0 1 2"]
    table, body = explorer.compare_steps(2, 1, 4)
    assert table["responses"].tolist() == [3, 0] and "this prompt is not in the step" in body


def test_the_steps_holding_a_responses_prompt_are_found_by_its_token_ids(explorer, influence_trace, tmp_path) -> None:
    # step 4 row 0 has PROMPTS[2], as steps 2 and 3 (group 1, group 0); step 2 row 1 has PROMPTS[1], as steps 1, 3
    assert explorer.prompt_steps(4, 0) == [2, 3]
    assert explorer.prompt_steps(2, 1) == [1, 3]
    assert explorer.prompt_steps(1, 0) == []  # PROMPTS[0] is only in step 1
    damaged = Explorer(shutil.copytree(influence_trace, tmp_path / "trace"))
    damaged.reader.step_path(3).write_bytes(b"not a zip")  # holds no prompt; the other steps still count
    assert damaged.prompt_steps(4, 0) == [2]


def test_table_headers_break_between_words_only() -> None:
    shown = app_module._display(pd.DataFrame({"num_valid_influence": [1], "val-core/all/acc/mean@4": [0.5]}))
    assert list(shown.columns) == ["num_\u200bvalid_\u200binfluence", "val-core/\u200ball/\u200bacc/\u200bmean@\u200b4"]
    assert "anywhere" not in app_module.TABLE_CSS and "overflow-wrap:normal" in app_module.TABLE_CSS


@pytest.fixture(scope="module")
def tool_explorer(tmp_path_factory, tokenizer) -> Explorer:
    return Explorer(trace_support.write_tool_trace(tmp_path_factory.mktemp("viz-tools") / "entropy_trace",
                                                   tokenizer))


def test_a_tool_run_shows_its_tool_output_greyed_and_its_calls(tool_explorer, tokenizer) -> None:
    arrays = trace_support.tool_step_arrays(tokenizer, 2)
    row = 2
    present = arrays["response_mask"][row] | arrays["tool_mask"][row]
    result = tool_explorer.response(2, row)
    assert result.response == tokenizer.decode(arrays["responses"][row][present].tolist())  # tool output too
    assert " <result>\n1024\n</result>" in result.response
    assert result.view["position"].tolist() == np.flatnonzero(present).tolist()
    assert result.view["tool"].tolist() == arrays["tool_mask"][row][present].tolist()
    assert result.entropy_html.count('class="archer-tok archer-tok--tool"') == int(arrays["tool_mask"][row].sum())
    assert result.view["tool_call"].sum() == result.entropy_html.count("archer-tok archer-tok--call")
    called = "".join(result.view["token"][result.view["tool_call"]])
    assert called == "<python>print(2 ** 10)</python><python>print(3 + 5)</python>"
    overview = tool_explorer.overview(2)
    assert overview["branch_parent"].tolist() == arrays["branch_parent"].tolist()
    assert overview["num_tool_calls"].tolist() == [1, 1, 2, 2, 0, 1, 2, 1]
    _, body = tool_explorer.prompt_group(2, row)
    # every response's tool output
    assert body.count('class="archer-tok archer-tok--tool"') == int(arrays["tool_mask"][:4].sum())


def test_the_calls_marked_are_those_of_the_tags_the_trace_records(tmp_path, tokenizer) -> None:
    # a custom tool whose trigger tag is calc; the <python> block after its answer is plain text in this run
    ids, tool = [], []
    for text, is_tool in (("<calc>1+1</calc>", False), (" <result>\n2\n</result>", True),
                          (" <python>x</python>", False), (" The answer is 2.", False)):
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids, tool = ids + piece, tool + [is_tool] * len(piece)
    tool_mask = np.array([tool])
    arrays = {"entropies": np.ones(tool_mask.shape, np.float16), "response_mask": ~tool_mask,
              "responses": np.array([ids], np.int32), "response_index": np.zeros(1, np.int32), "tool_mask": tool_mask}

    def calls(metadata: dict) -> str:
        trace = tmp_path / f"trace{len(metadata)}"
        TraceWriter(trace, kind="entropy", metadata=metadata, tokenizer=tokenizer).write_step(
            1, arrays, trace_support.manifest_stats(arrays))
        result = Explorer(trace).response(1, 0)
        assert result.entropy_html.count("archer-tok archer-tok--call") == result.view["tool_call"].sum()
        return "".join(result.view["token"][result.view["tool_call"]])

    assert calls({"call_tags": [["<calc>", "</calc>"]]}) == "<calc>1+1</calc>"
    assert calls({}) == "<python>x</python>"  # a trace that records no tags: the built-in tools' calls
    bad = tmp_path / "bad"
    TraceWriter(bad, kind="entropy", metadata={"call_tags": ["calc"]})
    with pytest.raises(ArcherError, match="call_tags"):
        Explorer(bad)


def test_the_branch_tree_of_a_prompt(tool_explorer, tokenizer) -> None:
    arrays = trace_support.tool_step_arrays(tokenizer, 2)
    assert tool_explorer.prompt_choices(2) == [("t2-g0 · 4 responses, 2 branches", "t2-g0"),
                                               ("t2-g1 · 4 responses, 1 branches", "t2-g1")]
    assert tool_explorer.first_row(2, "t2-g1") == 4
    with pytest.raises(IndexError, match="no prompt with uid 'nope'"):
        tool_explorer.first_row(2, "nope")
    uid, table, body = tool_explorer.branch_tree(2, 6)
    assert uid == "t2-g1"
    pd.testing.assert_frame_equal(table, queries.branch_tree(arrays, "t2-g1"))
    assert table["row"].tolist() == [4, 5, 6, 7] and table["parent_row"].tolist() == [-1, -1, 5, -1]
    assert 'data-responses="4"' in body and body.count('class="archer-tree-branch"') == 1
    assert '<text x="8" y="119" font-weight="bold">#2 · row 6</text>' in body  # the response asked for


def test_the_branch_tree_of_a_run_without_tools(explorer) -> None:
    uid, table, body = explorer.branch_tree(2, 4)
    assert uid == "s2-g1" and table["row"].tolist() == [3, 4, 5] and (table["parent"] == -1).all()
    assert "records no branch parents" in body and 'class="archer-tree-branch"' not in body
    assert explorer.prompt_choices(2) == [("s2-g0 · 3 responses", "s2-g0"), ("s2-g1 · 3 responses", "s2-g1")]


def test_corrupt_and_missing_steps_raise_and_the_others_still_work(tmp_path, tokenizer) -> None:
    trace = trace_support.write_trace(tmp_path / "t", tokenizer, steps=(1, 2, 3))
    explorer = Explorer(trace)
    explorer.response(2, 0)  # cached before the damage: a reload is what fails
    (trace / "steps" / "step_000002.npz").write_bytes(b"PK\x03\x04 this is not a zip file")
    (trace / "steps" / "step_000003.npz").unlink()
    fresh = Explorer(trace)
    with pytest.raises(TraceError, match=r"step 2: file .*step_000002.npz cannot be read"):
        fresh.response(2, 0)
    with pytest.raises(TraceError, match=r"step 3: file .*step_000003.npz is missing"):
        fresh.overview(3)
    assert len(fresh.overview(1)) == 6 and fresh.response(1, 0).view.shape[0] > 0
    with pytest.raises(IndexError, match="out of range"):
        fresh.response(1, 6)


def test_new_steps_of_a_running_training_appear(tmp_path, tokenizer) -> None:
    trace = trace_support.write_trace(tmp_path / "t", tokenizer, steps=(1,))
    explorer = Explorer(trace)
    assert explorer.steps() == [1]
    writer = TraceWriter(trace, kind="entropy")
    trace_support.add_step(writer, tokenizer, 2)
    assert explorer.steps() == [1, 2]
    assert explorer.response(2, 0).view.shape[0] > 0


def test_tokenizer_choice(tmp_path, tokenizer) -> None:
    bare = trace_support.write_trace(tmp_path / "bare", tokenizer, steps=(1,), save_tokenizer=False)
    no_tokenizer = Explorer(bare)
    assert no_tokenizer.tokenizer is None and "tokens are shown as ids" in no_tokenizer.header()
    ids = trace_support.step_arrays(tokenizer, 1)["responses"][0]
    assert no_tokenizer.response(1, 0).view["token"].tolist()[:3] == [f"[{i}]" for i in ids[:3]]
    folder = tmp_path / "tok"
    tokenizer.save_pretrained(folder)
    explicit = Explorer(bare, model_path=folder)
    assert explicit.response(1, 0).view["token"].tolist()[:3] == [tokenizer.decode([int(i)]) for i in ids[:3]]
    assert f"tokenizer: {folder}" in explicit.header()
    with pytest.raises(ArcherError, match="does not exist"):
        Explorer(bare, model_path=tmp_path / "nope")
    broken = trace_support.write_trace(tmp_path / "broken", tokenizer, steps=(1,))
    (broken / "tokenizer" / "tokenizer.json").write_text("{not json")
    assert "could not be loaded" in Explorer(broken).tokenizer_note


def test_token_decoder_caches_and_marks_unknown_ids(tokenizer) -> None:
    decoder = TokenDecoder(tokenizer)
    space = tokenizer.encode(" ")[0]
    assert decoder(np.array([space, 10_000, -1, space])) == [" ", "[10000]", "[-1]", " "]
    assert TokenDecoder(None)(np.array([3, 4])) == ["[3]", "[4]"]
    assert decoder.text(np.array([space, 10_000])) == f"[{space}] [10000]"  # one unknown id: all as ids
    assert TokenDecoder(None).text(np.array([1, 2])) == "[1] [2]"


def test_build_app_and_bad_trace_dirs(influence_trace, tmp_path) -> None:
    import gradio as gr

    from archer.viz.app import build_app

    app = build_app(influence_trace, poll_seconds=0)
    assert isinstance(app, gr.Blocks)
    ids = {getattr(block, "elem_id", None) for block in app.blocks.values()}
    assert {"archer-step", "archer-row", "archer-heatmap-entropy", "archer-heatmap-influence", "archer-csv",
            "archer-top-high", "archer-curves", "archer-histogram", "archer-compare", "archer-group",
            "archer-tree", "archer-tree-uid", "archer-tree-table", "archer-health-note", "archer-health-timeline",
            "archer-health-flags", "archer-health-pointers"} <= ids
    with pytest.raises(ArcherError, match="does not exist"):
        build_app(tmp_path / "missing")
    with pytest.raises(ArcherError, match="is not a trace directory"):
        build_app(tmp_path)


def test_cli_parser_defaults_match_the_app() -> None:
    from archer.viz.app import DEFAULT_HOST, DEFAULT_PORT

    args = build_parser().parse_args(["viz", "--trace-dir", "T"])
    assert (args.trace_dir, args.model_path, args.host, args.port) == ("T", None, DEFAULT_HOST, DEFAULT_PORT)
    assert DEFAULT_HOST == "127.0.0.1"


def test_cli_bad_paths_exit_2(tmp_path) -> None:
    proc = subprocess.run([*ARCHER, "viz", "--trace-dir", str(tmp_path / "missing")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == (f"archer: error: trace directory {tmp_path / 'missing'} does not exist\n"
                           "  fix: pass --trace-dir <run>/entropy_trace or <run>/influence_trace of a run\n")
    proc = subprocess.run([*ARCHER, "viz", "--trace-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "is not a trace directory (no summary.json)" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_on_a_run_directory_names_its_trace_folders(tmp_path, tokenizer) -> None:
    run = tmp_path / "run"
    trace_support.write_trace(run / "entropy_trace", tokenizer, steps=(1,), save_tokenizer=False)
    (run / "summary.json").write_text(json.dumps({"steps": 1, "run_dir": str(run)}))  # the run's own summary
    proc = subprocess.run([*ARCHER, "viz", "--trace-dir", str(run)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == (f"archer: error: {run} is not a trace directory (its summary.json has no format_version, "
                           "as a run's own has not); it holds the trace folder(s) entropy_trace\n"
                           f"  fix: pass --trace-dir {run / 'entropy_trace'}\n")


@pytest.mark.parametrize("relative", [False, True])
def test_viz_on_a_quickstart_folder_opens_the_trace_its_summary_names(tmp_path, tokenizer, capsys,
                                                                     relative: bool) -> None:
    """The issue's case: `archer viz --trace-dir OUT` on a quickstart's --out folder, whose traces lie in rl/."""
    from archer.viz.explorer import existing_trace_dir

    out = tmp_path / "qs"
    for kind in ("entropy_trace", "influence_trace"):
        trace_support.write_trace(out / "rl" / kind, tokenizer, steps=(1,), save_tokenizer=False)
    named = "runs/qs" if relative else str(out)  # as the quickstart wrote it, maybe relative to where it ran
    (out / "summary.json").write_text(json.dumps({"run_dir": named, "entropy_trace": f"{named}/rl/entropy_trace",
                                                  "influence_trace": f"{named}/rl/influence_trace"}))
    assert existing_trace_dir(out) == out / "rl" / "influence_trace"
    assert capsys.readouterr().out == (f"{out} is a run folder: opening the trace its summary.json names, "
                                       f"{out / 'rl' / 'influence_trace'}\n")


def test_cli_serves_the_app_and_a_busy_port_exits_2(influence_trace) -> None:
    port = _free_port()
    proc = subprocess.Popen([*ARCHER, "viz", "--trace-dir", str(influence_trace), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # all it printed is in the pipe
    try:
        deadline, page = time.monotonic() + 120, ""
        while time.monotonic() < deadline and not page:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read().decode()
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.5)
        assert "archer trace explorer" in page
        busy = subprocess.run([*ARCHER, "viz", "--trace-dir", str(influence_trace), "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
        assert busy.returncode == 2
        assert busy.stderr.startswith(f"archer: error: cannot serve the explorer on 127.0.0.1:{port} (")
        assert "fix: pick another port with --port" in busy.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    printed = proc.stdout.read()
    assert f"archer viz: exploring {influence_trace} at http://127.0.0.1:{port}/ (Ctrl-C stops it)\n" in printed
    assert "share=True" not in printed and "public link" not in printed  # Gradio's hint, useless on the CLI
    assert "HTTP Request" not in printed  # nor httpx's log of Gradio's start-up request


def test_archer_console_script_lists_viz() -> None:
    exe = shutil.which("archer")
    assert exe is not None
    proc = subprocess.run([exe, "viz", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for option in ("--trace-dir", "--model-path", "--host", "--port"):
        assert option in proc.stdout


# -- the Health tab's data ----------------------------------------------------------------------------------------
def test_the_health_tab_reads_the_runs_flags_and_maps_pointers_to_trace_rows(tmp_path, tokenizer) -> None:
    trace = health_support.write_health_run(tmp_path / "run", tokenizer)
    explorer = Explorer(trace)
    assert explorer.run_dir == tmp_path / "run"
    health = explorer.run_health()
    assert health.source == f"flags of `{tmp_path / 'run' / 'health.jsonl'}`, written while training"
    assert health.flags_table().values.tolist() == [
        [0, 2, "warning", "instability", "4", "actor/ppo_kl 0.2 over the last 3 steps"],
        [1, 3, "critical", "entropy_blowup", "5 0", "entropy 0.5 -> 1.2 (x2.40)"]]
    assert health.pointers_table(1).values.tolist() == [[0, 5, "s3-g1", "0 2", 2.1, "highest mean token entropy"],
                                                        [1, 0, "s3-g0", "4", 1.9, "highest mean token entropy"]]
    assert health.pointers_table(-1).empty and list(health.pointers_table(-1)) == list(health.pointers_table(0))
    figure = health.timeline()
    lines = [line for ax in figure.axes for line in ax.lines if list(line.get_xdata()) in ([2, 2], [3, 3])]
    assert len(lines) == 2 * 3  # a vertical line per flag on each of the three panels
    assert explorer.trace_row(3, 5) == 5  # the entropy trace holds every row of the batch
    view = explorer.response(3, 5, flagged=("entropy_blowup (critical) at step 3", [0, 2]))
    assert view.metadata.endswith("health: entropy_blowup (critical) at step 3; tokens at 0 2 boxed in green")
    boxed = re.findall(r'class="[^"]*archer-tok--flag" data-pos="(\d+)"', view.entropy_html)
    assert boxed == ["0", "2"] and "pointed at by the health flag" in view.entropy_html  # and the legend says so
    assert 'archer-tok--flag"' not in explorer.response(3, 5).entropy_html


def test_a_run_without_health_jsonl_is_replayed_and_an_influence_trace_may_lack_a_row(tmp_path, tokenizer) -> None:
    trace = health_support.write_health_run(tmp_path / "run", tokenizer)
    (tmp_path / "run" / "health.jsonl").unlink()
    health = Explorer(trace).run_health()  # replayed: three synthetic steps raise nothing
    assert health.flags == [] and health.source.startswith(f"flags replayed by `archer health {tmp_path / 'run'}`")
    influence = trace_support.write_trace(tmp_path / "run" / "influence_trace", tokenizer, kind="influence",
                                          steps=(3,))
    arrays = np.load(influence / "steps" / "step_000003.npz")
    kept = dict(arrays)
    kept["response_index"] = np.array([0, 1, 2, 6, 7, 8], dtype=np.int32)  # rows 3-5 of the batch not traced
    np.savez_compressed(influence / "steps" / "step_000003.npz", **kept)
    explorer = Explorer(influence)
    assert explorer.trace_row(3, 7) == 4
    with pytest.raises(IndexError, match="response 5 of step 3 is not in this influence trace .*entropy trace"):
        explorer.trace_row(3, 5)
    assert Explorer(trace_support.write_trace(tmp_path / "lone" / "trace", tokenizer)).run_health() is None


# -- what the explorer reads: the trace, its run, the command line ----------------------------------------------
def _set_summary_fields(trace: Path, **fields: object) -> None:
    summary = json.loads((trace / "summary.json").read_text())
    (trace / "summary.json").write_text(json.dumps({**summary, **fields}))


def test_folders_a_trace_names_outside_itself_are_not_read(tmp_path, tokenizer) -> None:
    elsewhere = health_support.write_health_run(tmp_path / "other_run", tokenizer).parent  # a run with flags
    tokenizer.save_pretrained(str(tmp_path / "other_tokenizer"))
    trace = trace_support.write_trace(tmp_path / "downloaded" / "trace", tokenizer, steps=(1,), save_tokenizer=False)
    for named in (str(tmp_path / "other_tokenizer"), "../../other_tokenizer"):
        _set_summary_fields(trace, tokenizer=named, run_dir=str(elsewhere))
        explorer = Explorer(trace)
        assert explorer.tokenizer is None and explorer.tokenizer_note == (
            f"the trace's summary.json names a tokenizer outside the trace ({named!r}), which is not read: tokens "
            "are shown as ids (pass --model-path to name one)")
        assert explorer.run_dir is None and explorer.run_health() is None
        assert explorer.response(1, 0).response.startswith("[")  # ids, not text
    (trace / "tokenizer").symlink_to(tmp_path / "other_tokenizer")  # a link out of the trace
    _set_summary_fields(trace, tokenizer="tokenizer")
    assert Explorer(trace).tokenizer is None
    # what the command line names is read
    named = Explorer(trace, tmp_path / "other_tokenizer", run_dir=elsewhere)
    assert named.tokenizer is not None and named.run_dir == elsewhere and len(named.run_health().flags) == 2
    with pytest.raises(ArcherError, match=f"--run-dir {tmp_path / 'downloaded'} holds no metrics.jsonl"):
        Explorer(trace, run_dir=tmp_path / "downloaded")
    # the trace's own tokenizer folder and its parent run are read
    own = health_support.write_health_run(tmp_path / "run", tokenizer)
    explorer = Explorer(own)
    assert explorer.tokenizer is not None and explorer.run_dir == tmp_path / "run"


def test_a_quickstart_summary_naming_traces_outside_its_folder_opens_none(tmp_path, tokenizer) -> None:
    from archer.viz.explorer import existing_trace_dir

    outside = trace_support.write_trace(tmp_path / "elsewhere" / "influence_trace", tokenizer, steps=(1,))
    out = tmp_path / "qs"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"run_dir": str(tmp_path), "influence_trace": str(outside)}))
    with pytest.raises(ArcherError, match="is not a trace directory .*no folder inside it is one"):
        existing_trace_dir(out)


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.attrs: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.add(tag)
        self.attrs |= {name for name, _ in attrs}


def test_hostile_trace_text_reaches_the_html_and_markdown_only_escaped(tmp_path) -> None:
    port = 9  # nothing listens: the browser test serves one and checks that no request reaches it
    trace = trace_support.write_hostile_trace(tmp_path / "entropy_trace", port)
    explorer = Explorer(trace)
    view = explorer.response(2, 0)
    _, group = explorer.prompt_group(2, 0)
    _, compare = explorer.compare_steps(2, 0, 1)
    _, _, tree = explorer.branch_tree(2, 0)
    for html_text in (view.entropy_html, group, compare, tree):
        tags = _Tags()
        tags.feed(html_text)
        assert tags.tags <= {"style", "div", "span", "br", "svg", "g", "title", "rect", "text", "line", "circle", "p"}
        assert tags.attrs.isdisjoint({"src", "href", "srcdoc", "onerror", "onload"})
        assert f"127.0.0.1:{port}" in html_text  # the text is there, as text
    img, script, md, frame = trace_support.hostile_texts(port)
    assert "<span class=\"archer-tok\" data-pos=\"0\"" in view.entropy_html and \
        "&lt;img·src=http://127.0.0.1:9/img&gt;</span>" in view.entropy_html
    for markdown in (view.metadata, explorer.header()):  # Markdown: no tags, no link or image syntax
        assert "<" not in markdown and not re.search(r"(?<!\\)[\[\]]", markdown)
    assert "**uid** &lt;img src=http://127.0.0.1:9/img&gt; |" in view.metadata
    assert "**finish_reason** !\\[m\\](http://127.0.0.1:9/md) |" in view.metadata
    assert render.markdown_text("a\\[b]\nc") == "a\\\\\\[b\\] c"  # a backslash cannot unescape a bracket
    assert view.prompt.startswith(img + script + md + frame)  # the Textboxes show the decoded text as it is
