"""The explorer's legend (archer/viz/legend.py): every column of every table the explorer shows has a description,
on an influence trace of an asynchronous run (policy versions, rejected tokens, a reward extra) and a tool run's
trace (tool columns, the branch tree); and each view's legend, as the app draws it, names each of its columns and
colour scales."""

from __future__ import annotations

import gradio as gr
import pytest
import trace_support

from archer.viz import app as app_module
from archer.viz import legend
from archer.viz.explorer import Explorer
from archer.viz.health import FLAG_COLUMNS, POINTER_COLUMNS


@pytest.fixture(scope="module")
def tokenizer():
    return trace_support.tiny_tokenizer()


@pytest.fixture(scope="module")
def influence(tmp_path_factory, tokenizer) -> Explorer:
    folder = tmp_path_factory.mktemp("legend") / "influence_trace"
    return Explorer(trace_support.write_trace(folder, tokenizer, kind="influence", steps=(1, 2), off_policy=True))


@pytest.fixture(scope="module")
def tools(tmp_path_factory, tokenizer) -> Explorer:
    return Explorer(trace_support.write_tool_trace(tmp_path_factory.mktemp("legend") / "tool_trace", tokenizer))


def shown_tables(explorer: Explorer, step: int) -> dict[str, list[str]]:
    """The columns of each table the explorer shows for ``step`` (its first response opened)."""
    high, low = explorer.top_tokens(step, 3)
    summary, _ = explorer.compare_steps(step, 0, [s for s in explorer.steps() if s != step][0], 64)
    _, tree, _ = explorer.branch_tree(step, 0)
    return {"stats": list(explorer.stats_table(step).columns), "overview": list(explorer.overview(step).columns),
            "view": list(explorer.response(step, 0).view.columns), "top": [*high.columns, *low.columns],
            "compare": list(summary.columns), "tree": list(tree.columns), "health": [*FLAG_COLUMNS, *POINTER_COLUMNS]}


def test_every_column_the_explorer_shows_has_a_description(influence: Explorer, tools: Explorer) -> None:
    seen: set[str] = set()
    for explorer in (influence, tools):
        extras = legend.extra_columns(explorer.step_data(2).arrays)
        for table, columns in shown_tables(explorer, 2).items():
            for column in columns:
                assert legend.describe(column, extras), (table, column)
            seen.update(columns)
    # the columns, and a reward extra (f1) told apart from the trace's own fields
    assert {"first_policy_version", "influence_abs_p99", "rejected_tokens", "tool_call", "branch_token_entropy",
            "f1"} <= seen
    assert legend.describe("f1", ["f1"]) == legend.REWARD_EXTRA
    assert "accepted responses" in legend.describe("influence") and "below 0" in legend.describe("influence")
    with pytest.raises(KeyError):
        legend.describe("a_column_nobody_described")


def test_each_views_legend_names_its_columns_and_colours(influence: Explorer, tools: Explorer) -> None:
    for explorer, step in ((influence, 2), (tools, 2)):
        with gr.Blocks():
            c = app_module._layout(explorer, 0)
        views = app_module.Views(explorer, c)
        tables = shown_tables(explorer, step)
        response = views.response(step, 0, "", "", "", False, "position", "response", None, "")[c.legend]
        for column in [*tables["stats"], *tables["overview"], *tables["view"]]:
            assert f"- **{column}**: " in response, column
        assert f"- *entropy heatmap*: {legend.COLOURS['entropy heatmap']}" in response
        assert ("*influence heatmap*" in response) == ("influence" in explorer.step_data(step).arrays)
        assert ("*tool marks*" in response) == (explorer is tools)
        top = views.top(step, 3)[c.top_legend]
        assert all(f"- **{column}**: " in top for column in tables["top"])
        tree = views.tree(step, 0, app_module.TREE_TAB)[c.tree_legend]
        assert all(f"- **{column}**: " in tree for column in tables["tree"]) and "*branch tree*" in tree
        compare = views.compare(step, 0, 1, 64, app_module.COMPARE_TAB)[c.compare_legend]
        assert all(f"- **{column}**: " in compare for column in tables["compare"])


def test_a_legend_lists_each_column_once_in_order() -> None:
    text = legend.legend_markdown(["row", "reward", "row", "f1"], extras=["f1"], colours=["green box"])
    assert text.splitlines() == [f"- **row**: {legend.COLUMNS['row']}", f"- **reward**: {legend.COLUMNS['reward']}",
                                 f"- **f1**: {legend.REWARD_EXTRA}", f"- *green box*: {legend.COLOURS['green box']}"]

