"""The Gradio app of the trace explorer (`archer viz`): layout and event wiring over an ``Explorer``.

Every callback loads at most the steps it shows (lazily, through the reader's cache) and turns a missing or
corrupt step file into a message in the error box, so the other steps keep working. A timer re-reads the
manifest so the steps of a running training appear without a restart.
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
from archer.viz import queries, render
from archer.viz.explorer import Explorer

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7862
POLL_SECONDS = 5.0
VIEW_ROWS_SHOWN = 500  # rows of the response view drawn in the table (all go to the CSV)
RESPONSES_TAB, GROUP_TAB, COMPARE_TAB, TREE_TAB = "Responses", "Prompt group", "Compare steps", "Branch tree"
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


def _tab_label(event: gr.SelectData) -> str:
    return str(event.value)


def theme() -> gr.themes.Base:
    """System fonts only: the explorer loads nothing from the internet."""
    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "monospace"])


def build_app(trace_dir: str | Path, model_path: str | Path | None = None, *,
              poll_seconds: float = POLL_SECONDS) -> gr.Blocks:
    """The explorer UI over one trace directory (ArcherError when it is not one)."""
    explorer = Explorer(trace_dir, model_path)
    steps = explorer.steps()
    influence = explorer.has_influence

    with gr.Blocks(title="archer trace explorer", analytics_enabled=False, delete_cache=(3600, 3600)) as app:
        header = gr.Markdown(explorer.header(), elem_id="archer-header")
        error = gr.Markdown(visible=False, elem_id="archer-error")
        seen = gr.State(explorer.manifest_signature())
        with gr.Row():
            step = gr.Dropdown(choices=steps, value=steps[-1] if steps else None, label="step",
                               elem_id="archer-step", scale=3)
            refresh = gr.Button("Refresh steps", elem_id="archer-refresh", scale=1)
        stats = gr.Dataframe(label="step statistics (entropy over valid tokens"
                             + (", influence over computed tokens)" if influence else ")"),
                             interactive=False, elem_id="archer-stats", elem_classes=["archer-table"])
        open_tab = gr.State(RESPONSES_TAB)
        drawn = gr.State("")  # the response view this browser session shows (see response_values)
        with gr.Tabs() as tabs:
            with gr.Tab(RESPONSES_TAB, id=RESPONSES_TAB):
                overview = gr.Dataframe(label="responses (select a row to open it)", interactive=False,
                                        max_height=300, elem_id="archer-overview", elem_classes=["archer-table"])
                with gr.Row():
                    row = gr.Number(value=0, precision=0, minimum=0, label="response row", elem_id="archer-row")
                    low = gr.Textbox(placeholder="none", label="entropy min", elem_id="archer-emin")
                    high = gr.Textbox(placeholder="none", label="entropy max", elem_id="archer-emax")
                    search = gr.Textbox(label="token search (substring, any case)", elem_id="archer-search")
                with gr.Row():
                    sort = gr.Radio(SORT_CHOICES, value="position", label="sort", elem_id="archer-sort")
                    padding = gr.Checkbox(value=False, label="show padding", elem_id="archer-padding")
                    scale = gr.Radio(INFLUENCE_SCALE_CHOICES, value="response", visible=influence,
                                     label="influence colour scale (p99 of |influence|)", elem_id="archer-scale")
                metadata = gr.Markdown(elem_id="archer-meta")
                with gr.Row():
                    prompt = gr.Textbox(label="prompt (decoded)", lines=3, max_lines=12, elem_id="archer-prompt")
                    response = gr.Textbox(label="response (decoded)", lines=3, max_lines=12,
                                          elem_id="archer-response")
                with gr.Row():
                    entropy_map = gr.HTML(label="entropy", elem_id="archer-heatmap-entropy")
                    influence_map = gr.HTML(label="influence", visible=influence, elem_id="archer-heatmap-influence")
                view = gr.Dataframe(label=f"response view (filter, search, padding and sort applied; the first "
                                    f"{VIEW_ROWS_SHOWN} rows, the CSV has all)",
                                    interactive=False, max_height=400, elem_id="archer-view")
                csv = gr.DownloadButton("Download this view as CSV", elem_id="archer-csv")
            with gr.Tab("Top-K tokens"):
                k = gr.Slider(1, 500, value=20, step=1, label="K", elem_id="archer-k")
                with gr.Row():
                    top_high = gr.Dataframe(label="highest entropy", interactive=False, elem_id="archer-top-high")
                    top_low = gr.Dataframe(label="lowest entropy", interactive=False, elem_id="archer-top-low")
            with gr.Tab(GROUP_TAB):
                group_tokens = gr.Slider(16, 4096, value=256, step=16, label="tokens shown per response")
                group_prompt = gr.Textbox(label="prompt of the selected response", lines=2, max_lines=8)
                group_map = gr.HTML(elem_id="archer-group")
            with gr.Tab(COMPARE_TAB):
                with gr.Row():
                    other = gr.Dropdown(choices=steps, value=steps[0] if steps else None, elem_id="archer-other",
                                        label="compare the selected response's prompt with step")
                    compare_tokens = gr.Slider(16, 4096, value=256, step=16, label="tokens shown per response")
                compare_table = gr.Dataframe(interactive=False, elem_id="archer-compare-table", elem_classes=["archer-table"])
                compare_map = gr.HTML(elem_id="archer-compare")
            with gr.Tab(TREE_TAB):
                tree_uid = gr.Dropdown(label="prompt (uid)", elem_id="archer-tree-uid")
                tree_map = gr.HTML(elem_id="archer-tree", js_on_load=TREE_CLICK_JS)
                tree_table = gr.Dataframe(label="the prompt's responses in tree order (select a row to open it)",
                                          interactive=False, elem_id="archer-tree-table", elem_classes=["archer-table"])
            with gr.Tab("Curves"):
                curves = gr.Plot(format="png", elem_id="archer-curves")
            with gr.Tab("Histogram"):
                bins = gr.Slider(5, 200, value=50, step=1, label="bins")
                histogram = gr.Plot(format="png", elem_id="archer-histogram")
        timer = gr.Timer(poll_seconds if poll_seconds > 0 else 1.0, active=poll_seconds > 0)

        def guarded(outputs: list[Any], fn: Callable[..., dict[Any, Any] | None]) -> Callable[..., dict[Any, Any]]:
            """Run a view; on a trace error show the message and blank the view's outputs. A view returning None,
            or asked for step None (no step written yet), changes nothing."""

            def run(*args: Any) -> dict[Any, Any]:
                if args and args[0] is None:
                    return {c: gr.skip() for c in outputs}
                try:
                    values = fn(*args)
                    if values is None:
                        return {c: gr.skip() for c in outputs}
                except VIEW_ERRORS as e:
                    blank = {c: (gr.update(value=None) if isinstance(c, (gr.Dataframe, gr.Plot, gr.DownloadButton))
                                 else "") for c in outputs if c is not error and c is not row}
                    return {**blank, error: gr.update(value=f"**error:** {e}", visible=True)}
                return {**values, error: gr.update(value="", visible=False)}

            return run

        response_inputs = [step, row, low, high, search, padding, sort, scale, drawn]
        response_outputs = [metadata, prompt, response, entropy_map, influence_map, view, csv, drawn, error]

        def response_values(step_value: Any, row_value: Any, low_value: Any, high_value: Any, search_value: str,
                            padding_value: bool, sort_value: str, scale_value: str,
                            drawn_value: str) -> dict[Any, Any] | None:
            options = {"entropy_range": _entropy_range(low_value, high_value), "search": search_value or "",
                       "show_padding": bool(padding_value), "sort": sort_value, "influence_scale": scale_value}
            key = repr((step_value, id(explorer.step_data(step_value).arrays), _row(row_value), options))
            if key == drawn_value:  # a blur or a repeated event: the page already shows this view
                return None
            result = explorer.response(step_value, _row(row_value), **options)
            return {metadata: result.metadata, prompt: result.prompt, response: result.response,
                    entropy_map: result.entropy_html, influence_map: result.influence_html or "",
                    view: _display(result.view.head(VIEW_ROWS_SHOWN)), csv: str(result.csv_path), drawn: key}

        step_outputs = [stats, overview, row, *response_outputs]

        def show_step(step_value: Any, row_value: Any, *response_args: Any) -> dict[Any, Any]:
            """The step's statistics and overview, and (one round trip less) the selected response."""
            data = explorer.step_data(step_value)
            kept = _row(row_value) if 0 <= _row(row_value) < data.arrays["response_mask"].shape[0] else 0
            values = {stats: _display(explorer.stats_table(step_value)), overview: _display(data.overview), row: kept}
            return {**values, **(response_values(step_value, kept, *response_args) or {})}

        top_outputs = [top_high, top_low, error]

        def show_top(step_value: Any, k_value: Any) -> dict[Any, Any]:
            high_table, low_table = explorer.top_tokens(step_value, int(k_value))
            return {top_high: _display(high_table), top_low: _display(low_table)}

        group_inputs = [step, row, group_tokens, open_tab]
        group_outputs = [group_prompt, group_map, error]

        def show_group(step_value: Any, row_value: Any, tokens_value: Any, tab: str) -> dict[Any, Any] | None:
            if tab != GROUP_TAB:  # drawn when its tab opens: the browser need not lay out hidden heatmaps
                return None
            text, body = explorer.prompt_group(step_value, _row(row_value), int(tokens_value))
            return {group_prompt: text, group_map: body}

        compare_inputs = [step, row, other, compare_tokens, open_tab]
        compare_outputs = [other, compare_table, compare_map, error]

        def show_compare(step_value: Any, row_value: Any, other_value: Any, tokens_value: Any,
                         tab: str, follow: bool = True) -> dict[Any, Any] | None:
            """The comparison; when the response or step changes (``follow``), with the nearest other step that
            holds the response's prompt, the steps holding it named above (a step picked by hand is kept)."""
            if tab != COMPARE_TAB:
                return None
            holding = explorer.prompt_steps(step_value, _row(row_value))
            if follow and holding and other_value not in holding:
                other_value = min(holding, key=lambda s: (abs(s - int(step_value)), s))
            label = (f"compare the selected response's prompt with step (also in step(s) {', '.join(map(str, holding))})"
                     if holding else "compare the selected response's prompt with step (in no other step)")
            if other_value is None:
                return {other: gr.update(label=label), compare_table: None, compare_map: ""}
            table, body = explorer.compare_steps(step_value, _row(row_value), other_value, int(tokens_value))
            return {other: gr.update(value=other_value, label=label), compare_table: _display(table), compare_map: body}

        tree_outputs = [tree_uid, tree_map, tree_table, error]

        def show_tree(step_value: Any, row_value: Any, tab: str) -> dict[Any, Any] | None:
            if tab != TREE_TAB:
                return None
            uid, table, body = explorer.branch_tree(step_value, _row(row_value))
            return {tree_uid: gr.update(choices=explorer.prompt_choices(step_value), value=uid),
                    tree_map: body, tree_table: _display(table)}

        def pick_prompt(step_value: Any, uid: str | None) -> dict[Any, Any] | None:
            """A prompt picked in the tree tab: open its first response (the tree follows the row)."""
            return None if uid is None else {row: explorer.first_row(step_value, uid)}

        def open_node(event: gr.EventData) -> dict[Any, Any]:
            """A response clicked in the tree: open it in the response view."""
            return {row: int(event.row), tabs: gr.Tabs(selected=RESPONSES_TAB), open_tab: RESPONSES_TAB}

        hist_outputs = [histogram, error]

        def show_histogram(step_value: Any, bins_value: Any) -> dict[Any, Any]:
            return {histogram: explorer.histogram(step_value, int(bins_value))}

        def show_curves() -> dict[Any, Any]:
            return {curves: explorer.curves()}

        refresh_outputs = [header, step, other, curves, seen]

        def poll(step_value: Any, other_value: Any, seen_value: str, force: bool) -> dict[Any, Any]:
            explorer.refresh()
            current = explorer.manifest_signature()
            if current == seen_value and not force:
                return {c: gr.skip() for c in refresh_outputs}
            choices = explorer.steps()
            latest = choices[-1] if choices else None
            return {header: explorer.header(), curves: explorer.curves(), seen: current,
                    step: gr.update(choices=choices, value=step_value if step_value in choices else latest),
                    other: gr.update(choices=choices, value=other_value if other_value in choices else latest)}

        Stage = tuple[Callable[..., Any], list[Any], list[Any]]
        step_stage: Stage = (guarded(step_outputs, show_step), response_inputs, step_outputs)
        response_stage: Stage = (guarded(response_outputs, response_values), response_inputs, response_outputs)
        top_stage: Stage = (guarded(top_outputs, show_top), [step, k], top_outputs)
        hist_stage: Stage = (guarded(hist_outputs, show_histogram), [step, bins], hist_outputs)
        group_stage: Stage = (guarded(group_outputs, show_group), group_inputs, group_outputs)
        compare_stage: Stage = (guarded(compare_outputs, show_compare), compare_inputs, compare_outputs)
        tree_stage: Stage = (guarded(tree_outputs, show_tree), [step, row, open_tab], tree_outputs)

        def chain(trigger: Callable[..., Any], stages: list[Stage], **options: Any) -> None:
            """The first stage on ``trigger``, each next one when the previous has finished."""
            event = trigger(*stages[0], **options)
            for stage in stages[1:]:
                event = event.then(*stage)

        after_step = [step_stage, top_stage, hist_stage, group_stage, compare_stage, tree_stage]
        chain(app.load, [(show_curves, [], [curves]), *after_step])
        chain(step.change, after_step)
        chain(row.change, [response_stage, group_stage, compare_stage, tree_stage], trigger_mode="always_last")
        chain(tabs.select, [(_tab_label, [], [open_tab]), group_stage, compare_stage, tree_stage])
        gr.on([low.submit, low.blur, high.submit, high.blur, search.change, padding.change, sort.change,
               scale.change],
              *response_stage, trigger_mode="always_last")
        k.release(*top_stage)
        bins.release(*hist_stage)
        group_tokens.release(*group_stage)
        picked = guarded(compare_outputs, lambda *args: show_compare(*args, follow=False))
        gr.on([other.input, compare_tokens.release], picked, compare_inputs, compare_outputs)

        overview.select(_select_row(0), None, row)  # the overview's first column is the row
        top_high.select(_select_row(1), None, row)  # top-K tables: rank, row, ...
        top_low.select(_select_row(1), None, row)
        tree_table.select(_select_row(0), None, row)  # the tree table's first column is the row
        tree_uid.input(guarded([row, error], pick_prompt), [step, tree_uid], [row, error])
        tree_map.click(open_node, None, [row, tabs, open_tab])
        refresh.click(lambda s, o, v: poll(s, o, v, True), [step, other, seen], refresh_outputs)
        timer.tick(lambda s, o, v: poll(s, o, v, False), [step, other, seen], refresh_outputs,
                   show_progress="hidden")
    return app


def launch(trace_dir: str | Path, model_path: str | Path | None = None, host: str = DEFAULT_HOST,
           port: int = DEFAULT_PORT, *, block: bool = True, poll_seconds: float = POLL_SECONDS) -> gr.Blocks:
    """Serve the explorer on ``host:port`` (127.0.0.1 unless told otherwise). With ``block`` it prints its one
    line (the trace and the address; Gradio's own notes, such as its share=True hint, and httpx's request log
    are silenced) and serves until interrupted."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio's request to itself at start-up is not news
    app = build_app(trace_dir, model_path, poll_seconds=poll_seconds)
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
