"""The Gradio app of the trace explorer (`archer viz`): layout and event wiring over an ``Explorer``.

``build_app`` lays out the controls (``Controls``: the header and step picker, then one function per tab),
binds the views (``Views``: one method per callback, over the explorer) and wires the events. Every callback
loads at most the steps it shows (lazily, through the reader's cache) and turns a missing or corrupt step file
into a message in the error box, so the other steps keep working. A timer re-reads the manifest so the steps
of a running training appear without a restart. The Health tab shows the run's health flags over its curves;
selecting a flag (or one of its pointers) opens the pointed response with its tokens boxed.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from archer.errors import ArcherError
from archer.trace.format import TraceError
from archer.viz import legend, queries, render
from archer.viz.explorer import Explorer
from archer.viz.health import FLAG_COLUMNS, POINTER_COLUMNS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7862
POLL_SECONDS = 5.0
VIEW_ROWS_SHOWN = 500  # rows of the response view drawn in the table (all go to the CSV)
RESPONSES_TAB, GROUP_TAB, COMPARE_TAB, TREE_TAB = "Responses", "Prompt group", "Compare steps", "Branch tree"
HEALTH_TAB = "Health"
# What a click sets (the open tab, the row, a flag) is set in the order of the clicks, each answered: Gradio ignores
# a second trigger of an event still pending (its default "once": a row or tab clicked while the last click was
# being answered was dropped, the tab shown undrawn), and takes events of different concurrency groups in a random
# order, so these events share one group, one at a time, first come first served.
EVERY_CLICK = {"trigger_mode": "multiple", "concurrency_id": "archer-clicks"}
TAB_VIEWS = {GROUP_TAB: "group", COMPARE_TAB: "compare", TREE_TAB: "tree", HEALTH_TAB: "health"}  # drawn on opening
# A click on a response of the branch tree sends its row (render.branch_tree_svg marks it with data-row).
TREE_CLICK_JS = ("element.addEventListener('click', (event) => { const node = event.target.closest('[data-row]'); "
                 "if (node) trigger('click', {row: Number(node.dataset.row)}); });")
SORT_CHOICES = list(zip(("position", "entropy ascending", "entropy descending"), queries.SORTS))
INFLUENCE_SCALE_CHOICES = list(zip(("per response", "per step"), queries.INFLUENCE_SCALES))
# Wide tables fit the page instead of hiding their right-hand columns behind a scroll: headers wrap between the
# words of their snake_case names (each "_", "/" and "@" is followed by a zero-width space, HEADER_BREAK, never
# inside a word), cells are a size smaller.
TABLE_CSS = (".archer-table th, .archer-table th *{white-space:normal!important;overflow-wrap:normal!important;"
             "word-break:normal!important}"
             ".archer-table table{width:100%!important}"
             ".archer-table th, .archer-table td{font-size:12px;padding:4px!important;min-width:0!important}"
             ".archer-table th{font-size:11px;padding:4px 2px!important}"
             ".archer-table th .cell-wrap{padding:0 2px!important;gap:2px!important}"
             "#archer-stats .cell-menu-button{display:none}")  # one row: nothing to sort or filter
HEADER_BREAK = "\u200b"
LEGEND = "What the columns and colours mean"  # the accordion under each view's tables (archer/viz/legend.py)
# Errors a view turns into a message: a missing/corrupt step, a row out of range, a bad user path.
VIEW_ERRORS = (TraceError, IndexError, ArcherError)


def _display(table: pd.DataFrame, digits: int = 4) -> pd.DataFrame:
    """A table as shown: floats rounded (through float64, so float32 noise goes), whitespace made visible, and
    the headers breakable between words only (HEADER_BREAK after "_", "/" and "@")."""
    out = table.copy()
    for name in out.columns:
        if out[name].dtype.kind == "f":
            out[name] = out[name].astype("float64").round(digits)
    if "token" in out.columns:
        out["token"] = [render.visible_whitespace(t) for t in out["token"]]
    out.columns = [re.sub(r"([_/@])", rf"\1{HEADER_BREAK}", str(name)) for name in out.columns]
    return out


def _row(value: Any) -> int:
    return 0 if value is None else int(value)


def _bound(text: str | None, name: str) -> float | None:
    """An entropy bound typed by the user: empty means open."""
    text = (text or "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise ArcherError(f"{name} {text!r} is not a number", "type a number such as 0.5, or leave it empty") from None


def _entropy_range(low: str | None, high: str | None) -> tuple[float | None, float | None]:
    return _bound(low, "entropy min"), _bound(high, "entropy max")


def _select_row(column: int) -> Callable[[gr.SelectData], int]:
    """A table's select handler that opens the response named in ``column`` of the selected row."""

    def pick(event: gr.SelectData) -> int:
        return int(event.row_value[column])

    return pick


def _opened(label: str) -> Callable[[], str]:
    """What a tab's select event stores as the open tab (its own label: Gradio may hand a re-sent event the
    first click's data)."""
    return lambda: label


def guarded(outputs: list[Any], fn: Callable[..., dict[Any, Any] | None], error: gr.Markdown,
            keep: tuple[Any, ...] = ()) -> Callable[..., dict[Any, Any]]:
    """Run a view; on a trace error show the message and blank the view's outputs (those in ``keep`` are left
    as they are). A view returning None, or asked for step None (no step written yet), changes nothing."""

    def run(*args: Any) -> dict[Any, Any]:
        if args and args[0] is None:
            return {c: gr.skip() for c in outputs}
        try:
            values = fn(*args)
            if values is None:
                return {c: gr.skip() for c in outputs}
        except VIEW_ERRORS as e:
            blank = {c: gr.skip() if c in keep else
                     gr.update(value=None) if isinstance(c, (gr.Dataframe, gr.Plot, gr.DownloadButton)) else ""
                     for c in outputs if c is not error}
            return {**blank, error: gr.update(value=f"**error:** {render.markdown_text(e)}", visible=True)}
        return {**values, error: gr.update(value="", visible=False)}

    return run


def theme() -> gr.themes.Base:
    """System fonts only: the explorer loads nothing from the internet."""
    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "monospace"])


class Controls:
    """The app's components, set by the layout functions below (names as the views and wiring use them)."""


def _tab(c: Controls, label: str) -> gr.Tab:
    """A tab, kept in ``c.tab_of`` for its select event."""
    c.tab_of[label] = gr.Tab(label, id=label)
    return c.tab_of[label]


def _layout_step(c: Controls, explorer: Explorer, steps: list[int]) -> None:
    """The header, the error box, the step picker and the step's statistics."""
    c.header = gr.Markdown(explorer.header(), elem_id="archer-header")
    c.error = gr.Markdown(visible=False, elem_id="archer-error")
    c.seen = gr.State(explorer.manifest_signature())
    with gr.Row():
        c.step = gr.Dropdown(choices=steps, value=steps[-1] if steps else None, label="step",
                             elem_id="archer-step", scale=3)
        c.refresh = gr.Button("Refresh steps", elem_id="archer-refresh", scale=1)
    c.stats = gr.Dataframe(label="step statistics (entropy over valid tokens"
                           + (", influence over computed tokens)" if explorer.has_influence else ")"),
                           interactive=False, elem_id="archer-stats", elem_classes=["archer-table"])
    c.open_tab = gr.State(RESPONSES_TAB)
    c.drawn = gr.State("")  # the response view this browser session shows (see Views.response)
    c.marked = gr.State(None)  # (step, row, what points, positions) of the health pointer opened last


def _layout_responses(c: Controls, influence: bool) -> None:
    c.overview = gr.Dataframe(label="responses (select a row to open it)", interactive=False, max_height=300,
                              elem_id="archer-overview", elem_classes=["archer-table"])
    c.legend = _legend("archer-legend")  # the step's tables, the response's view and heatmaps
    with gr.Row():
        c.row = gr.Number(value=0, precision=0, minimum=0, label="response row", elem_id="archer-row")
        c.low = gr.Textbox(placeholder="none", label="entropy min", elem_id="archer-emin")
        c.high = gr.Textbox(placeholder="none", label="entropy max", elem_id="archer-emax")
        c.search = gr.Textbox(label="token search (substring, any case)", elem_id="archer-search")
    with gr.Row():
        c.sort = gr.Radio(SORT_CHOICES, value="position", label="sort", elem_id="archer-sort")
        c.padding = gr.Checkbox(value=False, label="show padding", elem_id="archer-padding")
        c.scale = gr.Radio(INFLUENCE_SCALE_CHOICES, value="response", visible=influence,
                           label="influence colour scale (p99 of |influence|)", elem_id="archer-scale")
    c.metadata = gr.Markdown(elem_id="archer-meta")
    with gr.Row():
        c.prompt = gr.Textbox(label="prompt (decoded)", lines=3, max_lines=12, elem_id="archer-prompt")
        c.response = gr.Textbox(label="response (decoded)", lines=3, max_lines=12, elem_id="archer-response")
    with gr.Row():
        c.entropy_map = gr.HTML(label="entropy", elem_id="archer-heatmap-entropy")
        c.influence_map = gr.HTML(label="influence", visible=influence, elem_id="archer-heatmap-influence")
    c.view = gr.Dataframe(label=f"response view (filter, search, padding and sort applied; the first "
                          f"{VIEW_ROWS_SHOWN} rows, the CSV has all)", interactive=False, max_height=400,
                          elem_id="archer-view")
    c.csv = gr.DownloadButton("Download this view as CSV", elem_id="archer-csv")


def _legend(elem_id: str, text: str = "") -> gr.Markdown:
    """A view's legend, folded away under LEGEND."""
    with gr.Accordion(LEGEND, open=False, elem_id=f"{elem_id}-box"):
        return gr.Markdown(text, elem_id=elem_id)


def _layout_groups(c: Controls, steps: list[int]) -> None:
    """The tabs of several responses: top-K tokens, the prompt group, two steps compared, the branch tree."""
    with _tab(c, "Top-K tokens"):
        c.k = gr.Slider(1, 500, value=20, step=1, label="K", elem_id="archer-k")
        with gr.Row():
            c.top_high = gr.Dataframe(label="highest entropy", interactive=False, elem_id="archer-top-high")
            c.top_low = gr.Dataframe(label="lowest entropy", interactive=False, elem_id="archer-top-low")
        c.top_legend = _legend("archer-top-legend")
    with _tab(c, GROUP_TAB):
        c.group_tokens = gr.Slider(16, 4096, value=256, step=16, label="tokens shown per response")
        c.group_prompt = gr.Textbox(label="prompt of the selected response", lines=2, max_lines=8)
        c.group_map = gr.HTML(elem_id="archer-group")
    with _tab(c, COMPARE_TAB):
        with gr.Row():
            c.other = gr.Dropdown(choices=steps, value=steps[0] if steps else None, elem_id="archer-other",
                                  label="compare the selected response's prompt with step")
            c.compare_tokens = gr.Slider(16, 4096, value=256, step=16, label="tokens shown per response")
        c.compare_table = gr.Dataframe(interactive=False, elem_id="archer-compare-table", elem_classes=["archer-table"])
        c.compare_map = gr.HTML(elem_id="archer-compare")
        c.compare_legend = _legend("archer-compare-legend")
    with _tab(c, TREE_TAB):
        c.tree_uid = gr.Dropdown(label="prompt (uid)", elem_id="archer-tree-uid")
        c.tree_map = gr.HTML(elem_id="archer-tree", js_on_load=TREE_CLICK_JS)
        c.tree_table = gr.Dataframe(label="the prompt's responses in tree order (select a row to open it)",
                                    interactive=False, elem_id="archer-tree-table", elem_classes=["archer-table"])
        c.tree_legend = _legend("archer-tree-legend")


def _layout_run(c: Controls) -> None:
    """The tabs over the whole run: its curves, a step's histogram, the health flags."""
    with _tab(c, "Curves"):
        c.curves = gr.Plot(format="png", elem_id="archer-curves")
    with _tab(c, "Histogram"):
        c.bins = gr.Slider(5, 200, value=50, step=1, label="bins")
        c.histogram = gr.Plot(format="png", elem_id="archer-histogram")
    with _tab(c, HEALTH_TAB):
        c.health_note = gr.Markdown(elem_id="archer-health-note")
        c.health_plot = gr.Plot(format="png", elem_id="archer-health-timeline")
        c.health_flags = gr.Dataframe(label="flags (select one to open its first pointer)", interactive=False,
                                      elem_id="archer-health-flags", elem_classes=["archer-table"],
                                      column_widths=["5%", "5%", "8%", "14%", "13%", "55%"])
        c.health_pointers = gr.Dataframe(label="the selected flag's pointers (select one to open it)",
                                         interactive=False, elem_id="archer-health-pointers",
                                         elem_classes=["archer-table"])
        _legend("archer-health-legend", legend.legend_markdown([*FLAG_COLUMNS, *POINTER_COLUMNS],
                                                               colours=["health timeline"]))
        c.flag = gr.State(None)  # the selected flag's index
        c.pointer = gr.State(None)  # and its pointer's
        c.health_seen = gr.State(None)  # the run's health files as the tab last drew them


def _layout(explorer: Explorer, poll_seconds: float) -> Controls:
    c = Controls()
    c.tab_of = {}
    steps = explorer.steps()
    _layout_step(c, explorer, steps)
    with gr.Tabs() as c.tabs:
        with _tab(c, RESPONSES_TAB):
            _layout_responses(c, explorer.has_influence)
        _layout_groups(c, steps)
        _layout_run(c)
    c.timer = gr.Timer(poll_seconds if poll_seconds > 0 else 1.0, active=poll_seconds > 0)
    return c


class Views:
    """The callbacks: each takes the values of its inputs and returns {component: value}."""

    def __init__(self, explorer: Explorer, c: Controls) -> None:
        self.explorer, self.c = explorer, c

    def response(self, step: Any, row: Any, low: Any, high: Any, search: str, padding: bool, sort: str,
                 scale: str, marked: Any, drawn: str) -> dict[Any, Any] | None:
        c, row = self.c, _row(row)
        options = {"entropy_range": _entropy_range(low, high), "search": search or "", "show_padding": bool(padding),
                   "sort": sort, "influence_scale": scale}
        flagged = (marked[2], list(marked[3])) if marked and (marked[0], marked[1]) == (step, row) else None
        key = repr((step, id(self.explorer.step_data(step).arrays), row, options, flagged))
        if key == drawn:  # a blur or a repeated event: the page already shows this view
            return None
        result = self.explorer.response(step, row, **options, flagged=flagged)
        data = self.explorer.step_data(step)
        columns = [*self.explorer.stats_table(step).columns, *data.overview.columns, *result.view.columns]
        return {c.metadata: result.metadata, c.prompt: result.prompt, c.response: result.response,
                c.entropy_map: result.entropy_html, c.influence_map: result.influence_html or "",
                c.view: _display(result.view.head(VIEW_ROWS_SHOWN)), c.csv: str(result.csv_path), c.drawn: key,
                c.legend: legend.legend_markdown(columns, legend.extra_columns(data.arrays),
                                                 legend.heatmap_colours(data.arrays, bool(flagged)))}

    def step(self, step: Any, row: Any, *response_args: Any) -> dict[Any, Any]:
        """The step's statistics and overview, and (one round trip less) the selected response."""
        c, data = self.c, self.explorer.step_data(step)
        kept = _row(row) if 0 <= _row(row) < data.arrays["response_mask"].shape[0] else 0
        values = {c.stats: _display(self.explorer.stats_table(step)), c.overview: _display(data.overview), c.row: kept}
        return {**values, **(self.response(step, kept, *response_args) or {})}

    def top(self, step: Any, k: Any) -> dict[Any, Any]:
        high, low = self.explorer.top_tokens(step, int(k))
        return {self.c.top_high: _display(high), self.c.top_low: _display(low),
                self.c.top_legend: legend.legend_markdown(high.columns)}

    def group(self, step: Any, row: Any, tokens: Any, tab: str) -> dict[Any, Any] | None:
        if tab != GROUP_TAB:  # drawn when its tab opens: the browser need not lay out hidden heatmaps
            return None
        text, body = self.explorer.prompt_group(step, _row(row), int(tokens))
        return {self.c.group_prompt: text, self.c.group_map: body}

    def compare(self, step: Any, row: Any, other: Any, tokens: Any, tab: str,
                follow: bool = True) -> dict[Any, Any] | None:
        """The comparison; when the response or step changes (``follow``), with the nearest other step that
        holds the response's prompt, the steps holding it named above (a step picked by hand is kept)."""
        if tab != COMPARE_TAB:
            return None
        c = self.c
        holding = self.explorer.prompt_steps(step, _row(row))
        if follow and holding and other not in holding:
            other = min(holding, key=lambda s: (abs(s - int(step)), s))
        label = (f"compare the selected response's prompt with step (also in step(s) {', '.join(map(str, holding))})"
                 if holding else "compare the selected response's prompt with step (in no other step)")
        if other is None:
            return {c.other: gr.update(label=label), c.compare_table: None, c.compare_map: "",
                    c.compare_legend: ""}
        table, body = self.explorer.compare_steps(step, _row(row), other, int(tokens))
        colours = legend.heatmap_colours(self.explorer.step_data(step).arrays)
        return {c.other: gr.update(value=other, label=label), c.compare_table: _display(table), c.compare_map: body,
                c.compare_legend: legend.legend_markdown(table.columns, colours=colours)}

    def compare_picked(self, *args: Any) -> dict[Any, Any] | None:
        """The comparison with the step picked by hand."""
        return self.compare(*args, follow=False)

    def tree(self, step: Any, row: Any, tab: str) -> dict[Any, Any] | None:
        if tab != TREE_TAB:
            return None
        uid, table, body = self.explorer.branch_tree(step, _row(row))
        return {self.c.tree_uid: gr.update(choices=self.explorer.prompt_choices(step), value=uid),
                self.c.tree_map: body, self.c.tree_table: _display(table),
                self.c.tree_legend: legend.legend_markdown(table.columns, legend.extra_columns(
                    self.explorer.step_data(step).arrays), colours=["branch tree"])}

    def pick_prompt(self, step: Any, uid: str | None) -> dict[Any, Any] | None:
        """A prompt picked in the tree tab: open its first response (the tree follows the row)."""
        return None if uid is None else {self.c.row: self.explorer.first_row(step, uid)}

    def open_node(self, event: gr.EventData) -> dict[Any, Any]:
        """A response clicked in the tree: open it in the response view."""
        c = self.c
        return {c.row: int(event.row), c.tabs: gr.Tabs(selected=RESPONSES_TAB), c.open_tab: RESPONSES_TAB}

    def histogram(self, step: Any, bins: Any) -> dict[Any, Any]:
        return {self.c.histogram: self.explorer.histogram(step, int(bins))}

    def curves(self) -> dict[Any, Any]:
        return {self.c.curves: self.explorer.curves()}

    def poll(self, step: Any, other: Any, seen: str, force: bool) -> dict[Any, Any]:
        c, explorer = self.c, self.explorer
        explorer.refresh()
        current = explorer.manifest_signature()
        if current == seen and not force:
            return {x: gr.skip() for x in (c.header, c.step, c.other, c.curves, c.seen)}
        choices = explorer.steps()
        latest = choices[-1] if choices else None
        return {c.header: explorer.header(), c.curves: explorer.curves(), c.seen: current,
                c.step: gr.update(choices=choices, value=step if step in choices else latest),
                c.other: gr.update(choices=choices, value=other if other in choices else latest)}

    def health(self, tab: str, seen: Any) -> dict[Any, Any] | None:
        """The Health tab, drawn when it is open and the run's health files changed since it was drawn."""
        c, explorer = self.c, self.explorer
        if tab != HEALTH_TAB:
            return None
        health = explorer.run_health()
        if health is None:
            return {c.health_note: "the trace's parent folder holds no metrics.jsonl of a run: no health flags to show "
                                   "(name the run with `archer viz --run-dir RUN`)"}
        if explorer.health_signature() == seen:
            return None
        return {c.health_note: health.note(), c.health_plot: health.timeline(), c.health_flags: health.flags_table(),
                c.health_pointers: health.pointers_table(-1), c.health_seen: explorer.health_signature()}

    def pick_flag(self, event: gr.SelectData) -> dict[Any, Any]:
        """A flag selected: its pointers (then ``open_first`` opens the first)."""
        index = int(event.row_value[0])
        return {self.c.flag: index, self.c.health_pointers: self.explorer.run_health().pointers_table(index)}

    def open_first(self, index: Any) -> dict[Any, Any] | None:
        flag = self.explorer.run_health().flags[int(index)]
        return self.open_pointer(int(index), 0) if flag.pointers else None  # a flag of metrics alone

    def open_picked(self, flag: Any, pointer: Any) -> dict[Any, Any] | None:
        return None if flag is None or pointer is None else self.open_pointer(int(flag), int(pointer))

    def open_pointer(self, index: int, pointer: int) -> dict[Any, Any]:
        """Open the step and the response a flag's pointer names, its tokens boxed, in the Responses tab."""
        c, explorer = self.c, self.explorer
        flag = explorer.run_health().flags[index]
        if flag.step not in explorer.steps():
            raise IndexError(f"step {flag.step} is not in this trace (it writes every "
                             f"{explorer.reader.summary.get('write_every', '?')} steps)")
        target = flag.pointers[pointer]
        row = explorer.trace_row(flag.step, target.row)
        what = f"{flag.check} ({flag.severity}) at step {flag.step}: {target.why} {target.value:.4g}"
        return {c.step: flag.step, c.row: row, c.marked: (flag.step, row, what, target.positions),
                c.tabs: gr.Tabs(selected=RESPONSES_TAB), c.open_tab: RESPONSES_TAB}


Stage = tuple[Callable[..., Any], list[Any], list[Any]]


def _chain(trigger: Callable[..., Any], stages: list[Stage], **options: Any) -> None:
    """The first stage on ``trigger``, each next one when the previous has finished."""
    event = trigger(*stages[0], **options)
    for stage in stages[1:]:
        event = event.then(*stage)


def _stages(c: Controls, v: Views) -> dict[str, Stage]:
    """Each view guarded, with its inputs and outputs."""
    response_inputs = [c.step, c.row, c.low, c.high, c.search, c.padding, c.sort, c.scale, c.marked, c.drawn]
    response_outputs = [c.metadata, c.prompt, c.response, c.entropy_map, c.influence_map, c.view, c.csv, c.drawn,
                        c.legend, c.error]
    step_outputs = [c.stats, c.overview, c.row, *response_outputs]
    compare_inputs = [c.step, c.row, c.other, c.compare_tokens, c.open_tab]
    compare_outputs = [c.other, c.compare_table, c.compare_map, c.compare_legend, c.error]
    views: dict[str, tuple[Callable[..., Any], list[Any], list[Any]]] = {
        "step": (v.step, response_inputs, step_outputs),
        "response": (v.response, response_inputs, response_outputs),
        "top": (v.top, [c.step, c.k], [c.top_high, c.top_low, c.top_legend, c.error]),
        "histogram": (v.histogram, [c.step, c.bins], [c.histogram, c.error]),
        "group": (v.group, [c.step, c.row, c.group_tokens, c.open_tab], [c.group_prompt, c.group_map, c.error]),
        "compare": (v.compare, compare_inputs, compare_outputs),
        "compare_picked": (v.compare_picked, compare_inputs, compare_outputs),
        "tree": (v.tree, [c.step, c.row, c.open_tab],
                 [c.tree_uid, c.tree_map, c.tree_table, c.tree_legend, c.error]),
        "health": (v.health, [c.open_tab, c.health_seen],
                   [c.health_note, c.health_plot, c.health_flags, c.health_pointers, c.health_seen, c.error]),
    }
    return {name: (guarded(outputs, fn, c.error, (c.row, c.other)), inputs, outputs)  # a row or step kept, never blanked
            for name, (fn, inputs, outputs) in views.items()}


def _wire_views(app: gr.Blocks, c: Controls, v: Views, stages: dict[str, Stage]) -> None:
    """What redraws which view: a new step, row, tab, filter or slider."""
    after_step = [stages[name] for name in ("step", "top", "histogram", "group", "compare", "tree")]
    _chain(app.load, [(v.curves, [], [c.curves]), *after_step])
    _chain(c.step.change, after_step)
    _chain(c.row.change, [stages[name] for name in ("response", "group", "compare", "tree")],
           trigger_mode="always_last")
    for label, tab in c.tab_of.items():  # each tab its own event, its label stored in the order of the clicks
        view = TAB_VIEWS.get(label)
        _chain(tab.select, [(_opened(label), [], [c.open_tab]), *([stages[view]] if view else [])], **EVERY_CLICK)
    gr.on([c.low.submit, c.low.blur, c.high.submit, c.high.blur, c.search.change, c.padding.change, c.sort.change,
           c.scale.change], *stages["response"], trigger_mode="always_last")
    c.k.release(*stages["top"])
    c.bins.release(*stages["histogram"])
    c.group_tokens.release(*stages["group"])
    gr.on([c.other.input, c.compare_tokens.release], *stages["compare_picked"])


def _wire_selections(c: Controls, v: Views, health: Stage) -> None:
    """What a click opens (a table's row, a tree's node, a flag or its pointer) and the refresh of the steps."""
    every = EVERY_CLICK
    c.overview.select(_select_row(0), None, c.row, **every)  # the overview's first column is the row
    c.top_high.select(_select_row(1), None, c.row, **every)  # top-K tables: rank, row, ...
    c.top_low.select(_select_row(1), None, c.row, **every)
    c.tree_table.select(_select_row(0), None, c.row, **every)  # the tree table's first column is the row
    c.tree_uid.input(guarded([c.row, c.error], v.pick_prompt, c.error, (c.row,)), [c.step, c.tree_uid],
                     [c.row, c.error], **every)
    c.tree_map.click(v.open_node, None, [c.row, c.tabs, c.open_tab], **every)
    opened = [c.step, c.row, c.marked, c.tabs, c.open_tab]  # what opening a pointer sets (kept on an error)
    c.health_flags.select(v.pick_flag, None, [c.flag, c.health_pointers], **every).then(
        guarded([*opened, c.error], v.open_first, c.error, tuple(opened)), [c.flag], [*opened, c.error], **every)
    c.health_pointers.select(_select_row(0), None, c.pointer, **every).then(  # a callback Gradio hands the selection to
        guarded([*opened, c.error], v.open_picked, c.error, tuple(opened)), [c.flag, c.pointer], [*opened, c.error],
        **every)
    refresh_outputs = [c.header, c.step, c.other, c.curves, c.seen]
    c.refresh.click(lambda s, o, seen: v.poll(s, o, seen, True), [c.step, c.other, c.seen], refresh_outputs)
    c.timer.tick(lambda s, o, seen: v.poll(s, o, seen, False), [c.step, c.other, c.seen], refresh_outputs,
                 show_progress="hidden").then(*health, show_progress="hidden")


def build_app(trace_dir: str | Path, model_path: str | Path | None = None, *,
              poll_seconds: float = POLL_SECONDS, run_dir: str | Path | None = None) -> gr.Blocks:
    """The explorer UI over one trace directory (ArcherError when it is not one); ``run_dir``: the run whose
    health flags it shows (default: the trace's parent folder)."""
    explorer = Explorer(trace_dir, model_path, run_dir)
    with gr.Blocks(title="archer trace explorer", analytics_enabled=False, delete_cache=(3600, 3600)) as app:
        controls = _layout(explorer, poll_seconds)
        views = Views(explorer, controls)
        stages = _stages(controls, views)
        _wire_views(app, controls, views, stages)
        _wire_selections(controls, views, stages["health"])
    return app


def launch(trace_dir: str | Path, model_path: str | Path | None = None, host: str = DEFAULT_HOST,
           port: int = DEFAULT_PORT, *, block: bool = True, poll_seconds: float = POLL_SECONDS,
           run_dir: str | Path | None = None) -> gr.Blocks:
    """Serve the explorer on ``host:port`` (127.0.0.1 unless told otherwise). With ``block`` it prints its one
    line (the trace and the address; Gradio's own notes, such as its share=True hint, and httpx's request log
    are silenced) and serves until interrupted."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio's request to itself at start-up is not news
    app = build_app(trace_dir, model_path, poll_seconds=poll_seconds, run_dir=run_dir)
    try:
        app.launch(server_name=host, server_port=int(port), share=False, prevent_thread_lock=True,
                   theme=theme(), css=TABLE_CSS, footer_links=[], quiet=True,
                   run_history=False)  # a saved run holds whole heatmaps: the browser would slow down and fill
    except OSError as e:
        raise ArcherError(f"cannot serve the explorer on {host}:{port} ({e})",
                          "pick another port with --port, or stop the program that holds this one") from e
    if block:
        print(f"archer viz: exploring {trace_dir} at {app.local_url} (Ctrl-C stops it)", flush=True)
        try:
            while app.is_running:
                time.sleep(0.2)
        finally:
            app.close(verbose=False)
    return app
