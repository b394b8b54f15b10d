"""The explorer in a real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright).

One app serves an influence trace of steps 1, 2, 3 (corrupt) and 4 for the whole module; each test drives the
page through the controls a user touches and checks what the browser shows against the trace's arrays:
heatmap spans and their computed colours, the filter and search, the downloaded CSV row by row, the error of
a corrupt step, a step written while the app runs, and the other tabs. A second app serves the entropy trace
of a tool run (trace_support.write_tool_trace): grey tool output, highlighted tool calls and the branch tree
(its screenshots land in the tests' tmp_path: tool_tokens.png, branch_tree.png). A third serves a run folder with
health flags (health_support.write_health_run): the Health tab, and a flag's pointers opened with their tokens
boxed (health_tab.png, flag_opened.png).
"""

from __future__ import annotations

import csv
import http.server
import socket
import threading
import time
from pathlib import Path

import gradio as gr
import health_support
import numpy as np
import pytest
import trace_support

from archer.trace.format import TraceWriter
from archer.viz import app as app_module
from archer.viz import legend, queries, render
from archer.viz.app import launch

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed at /usr/bin/chromium "
                       "(make test installs it with apt-get install chromium)"),
    # pandas 3 deprecations raised inside Gradio's own queue code
    pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|The copy keyword is deprecated)"),
]
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
TIMEOUT_MS = 20_000
STEPS = (1, 2, 3, 4)
CORRUPT_STEP = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tokenizer():
    return trace_support.tiny_tokenizer()


@pytest.fixture(scope="module")
def trace(tmp_path_factory, tokenizer) -> Path:
    folder = trace_support.write_trace(tmp_path_factory.mktemp("browser") / "influence_trace", tokenizer,
                                       kind="influence", steps=STEPS)
    (folder / "steps" / f"step_{CORRUPT_STEP:06d}.npz").write_bytes(b"PK\x03\x04 truncated by a full disk")
    return folder


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield browser
        browser.close()


def open_page(browser, trace: Path):
    """The explorer served over ``trace`` in a page of its own, once it shows a heatmap (a generator fixture)."""
    port = _free_port()
    app = launch(trace, host="127.0.0.1", port=port, block=False, poll_seconds=1.0)
    try:
        context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
        page = context.new_page()
        page.requested = []  # every URL the page asked for (see the last test)
        page.on("request", lambda request: page.requested.append(request.url))
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(f"http://127.0.0.1:{port}/")
        page.wait_for_selector("#archer-heatmap-entropy .archer-tok")
        yield page
        context.close()
    finally:
        app.close()


@pytest.fixture(scope="module")
def page(browser, trace):
    yield from open_page(browser, trace)


def arrays_of(tokenizer, step: int) -> dict[str, np.ndarray]:
    return trace_support.step_arrays(tokenizer, step, kind="influence")


def pick_step(page, step: int) -> None:
    page.locator("#archer-step input").click()
    page.locator("#archer-step input").press("Control+a")
    page.locator("#archer-step input").press_sequentially(str(step))  # the list shows 100 steps: filter it
    page.locator(f'#archer-step li[role="option"][aria-label="{step}"]').click()


def set_text(page, elem_id: str, text: str) -> None:
    box = page.locator(f"#{elem_id} textarea, #{elem_id} input").first
    box.fill(text)
    box.press("Enter")


def wait_for_response(page, step: int, row: int) -> None:
    page.wait_for_function(
        "([s, r]) => { const m = document.querySelector('#archer-meta');"
        " return m && m.innerText.startsWith(`step ${s} | row ${r} |`); }", arg=[step, row])


def open_response(page, step: int, row: int) -> None:
    page.get_by_role("tab", name="Responses").click()  # where an earlier test may have left another tab open
    pick_step(page, step)
    page.wait_for_function("(s) => document.querySelector('#archer-meta')?.innerText.startsWith(`step ${s} |`)",
                           arg=step)
    set_text(page, "archer-row", str(row))
    wait_for_response(page, step, row)


def heatmap_spans(page, elem_id: str) -> list[dict]:
    """Every token span of a heatmap as the browser has it: attributes, text, computed background colour."""
    return page.eval_on_selector_all(
        f"#{elem_id} .archer-tok",
        "spans => spans.map(s => ({pos: +s.dataset.pos, entropy: s.dataset.entropy, influence: s.dataset.influence,"
        " cls: s.className, title: s.title, text: s.textContent, shadow: getComputedStyle(s).boxShadow,"
        " colour: getComputedStyle(s).backgroundColor.replaceAll(' ', '')}))")


def vmax_of(page, elem_id: str) -> float:
    return float(page.get_attribute(f"#{elem_id} .archer-heatmap", "data-vmax"))


def test_page_opens_on_the_latest_step_with_both_heatmaps(page) -> None:
    assert "influence trace" in page.inner_text("#archer-header")
    assert page.input_value("#archer-step input") == "4"
    wait_for_response(page, 4, 0)
    assert page.locator("#archer-heatmap-influence .archer-tok").count() == page.locator(
        "#archer-heatmap-entropy .archer-tok").count() > 0


def test_heatmap_spans_and_colours_match_the_data(page, tokenizer) -> None:
    step, row = 2, 4
    open_response(page, step, row)
    arrays = arrays_of(tokenizer, step)
    mask = arrays["response_mask"]
    vmax = vmax_of(page, "archer-heatmap-entropy")
    assert vmax == pytest.approx(np.percentile(arrays["entropies"][mask].astype(np.float64), 99), rel=1e-12)
    spans = heatmap_spans(page, "archer-heatmap-entropy")
    assert [s["pos"] for s in spans] == list(range(int(mask[row].sum())))  # padding hidden
    for s in spans:
        entropy = float(arrays["entropies"][row, s["pos"]])
        token_id = int(arrays["responses"][row, s["pos"]])
        assert float(s["entropy"]) == pytest.approx(entropy, rel=1e-5)
        assert s["colour"] == render.entropy_colour(entropy, vmax)
        assert s["text"] == render.visible_whitespace(tokenizer.decode([token_id]))
        assert s["title"].startswith(f"pos {s['pos']} | token {tokenizer.decode([token_id])!r} | id {token_id} | ")
        assert s["cls"] == "archer-tok"
    influence_vmax = vmax_of(page, "archer-heatmap-influence")
    for s in heatmap_spans(page, "archer-heatmap-influence"):
        influence = float(arrays["influence"][row, s["pos"]])
        assert s["colour"] == render.influence_colour(influence, influence_vmax)
        assert (s["influence"] == "nan") if np.isnan(influence) else float(s["influence"]) == pytest.approx(
            influence, rel=1e-5)
    assert any(s["text"].startswith("·") for s in spans)  # visible spaces


def test_the_influence_scale_is_per_response_by_default_and_per_step_on_request(page, tokenizer) -> None:
    step, row = 2, 4
    open_response(page, step, row)
    arrays = arrays_of(tokenizer, step)
    valid = arrays["response_mask"][row] & ~np.isnan(arrays["influence"][row])
    own = float(np.percentile(np.abs(arrays["influence"][row][valid].astype(np.float64)), 99))
    both = arrays["response_mask"] & ~np.isnan(arrays["influence"])
    of_step = float(np.percentile(np.abs(arrays["influence"][both].astype(np.float64)), 99))
    assert own != pytest.approx(of_step)
    legend = "#archer-heatmap-influence .archer-legend"
    assert vmax_of(page, "archer-heatmap-influence") == pytest.approx(own, rel=1e-12)
    assert page.inner_text(legend).startswith("influence (scale: p99 of |influence| over this response)")
    page.locator("#archer-scale label", has_text="per step").click()
    page.wait_for_function("() => document.querySelector('#archer-heatmap-influence .archer-legend')"
                           "?.innerText.includes('over this step')")
    assert vmax_of(page, "archer-heatmap-influence") == pytest.approx(of_step, rel=1e-12)
    for s in heatmap_spans(page, "archer-heatmap-influence"):
        assert s["colour"] == render.influence_colour(float(arrays["influence"][row, s["pos"]]), of_step)
    page.locator("#archer-scale label", has_text="per response").click()
    page.wait_for_function("() => document.querySelector('#archer-heatmap-influence .archer-legend')"
                           "?.innerText.includes('over this response')")


def test_filter_search_sort_and_csv_download(page, tokenizer, tmp_path) -> None:
    step, row = 2, 4
    open_response(page, step, row)
    arrays = arrays_of(tokenizer, step)
    length = int(arrays["response_mask"][row].sum())
    entropy = arrays["entropies"][row].astype(np.float64)
    texts = [tokenizer.decode([int(i)]) for i in arrays["responses"][row]]
    expected = [p for p in range(length) if 0.5 <= entropy[p] <= 2.5 and "e" in texts[p].lower()]
    assert 0 < len(expected) < length
    set_text(page, "archer-emin", "0.5")
    set_text(page, "archer-emax", "2.5")
    set_text(page, "archer-search", "E")
    page.get_by_test_id("entropy descending-radio-label").click()
    page.wait_for_function(
        "(n) => document.querySelector('#archer-meta').innerText.includes(`view: ${n} rows (sort: entropy_desc);`)",
        arg=len(expected))
    spans = heatmap_spans(page, "archer-heatmap-entropy")
    assert len(spans) == length  # the heatmap keeps its context, in position order ...
    assert [s["pos"] for s in spans if "archer-tok--out" not in s["cls"]] == expected  # ... and greys the rest
    vmax = vmax_of(page, "archer-heatmap-entropy")
    for s in spans:
        shown = "rgba(0,0,0,0)" if "archer-tok--out" in s["cls"] else render.entropy_colour(entropy[s["pos"]], vmax)
        assert s["colour"] == shown
    with page.expect_download() as download_info:
        page.click("#archer-csv")
    path = tmp_path / "view.csv"
    download_info.value.save_as(path)
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    order = sorted(expected, key=lambda p: (-entropy[p], p))
    assert [int(r["position"]) for r in rows] == order
    for r, p in zip(rows, order):
        assert (r["step"], r["row"], r["token"], r["valid"]) == (str(step), str(row), texts[p], "True")
        assert int(r["token_id"]) == arrays["responses"][row, p]
        assert float(r["entropy"]) == float(arrays["entropies"][row, p])
        assert float(r["log_prob"]) == float(arrays["old_log_probs"][row, p])
        assert float(r["prob"]) == pytest.approx(np.exp(float(arrays["old_log_probs"][row, p])), rel=1e-12)
        influence = float(arrays["influence"][row, p])
        assert (r["influence"] == "") if np.isnan(influence) else (float(r["influence"]) == influence)
    page.screenshot(path=str(tmp_path / "explorer.png"), full_page=True)
    assert (tmp_path / "explorer.png").stat().st_size > 10_000
    for elem_id in ("archer-emin", "archer-emax", "archer-search"):
        set_text(page, elem_id, "")
    page.get_by_test_id("position-radio-label").click()


def test_a_corrupt_step_shows_an_error_and_other_steps_still_work(page, tokenizer) -> None:
    pick_step(page, CORRUPT_STEP)
    error = page.locator("#archer-error")
    error.wait_for(state="visible")
    assert f"step {CORRUPT_STEP}: file" in error.inner_text() and "cannot be read" in error.inner_text()
    open_response(page, 1, 2)
    error.wait_for(state="hidden")
    arrays = arrays_of(tokenizer, 1)
    spans = heatmap_spans(page, "archer-heatmap-entropy")
    assert [float(s["entropy"]) for s in spans] == pytest.approx(
        arrays["entropies"][2][arrays["response_mask"][2]].astype(np.float64).tolist(), rel=1e-5)


def test_selecting_an_overview_row_opens_that_response(page) -> None:
    open_response(page, 2, 0)
    # Row 3 is the first response of group 1 (uid s2-g1).
    page.locator("#archer-overview [role=gridcell]").filter(has_text="s2-g1").first.click()
    wait_for_response(page, 2, 3)


def test_the_overview_and_the_response_show_the_reward_extras(page, tokenizer, tmp_path) -> None:
    step, row = 2, 1
    open_response(page, step, row)
    f1 = arrays_of(tokenizer, step)["reward_extra/f1"]
    headers = page.eval_on_selector_all("#archer-overview [role=columnheader]",
                                        "cs => cs.map(c => c.innerText.replace(/\\u200b/g, '').trim())")
    assert headers[headers.index("group_id") + 1] == "f1"  # the extra's key, after the fixed columns
    cells = page.eval_on_selector_all(
        "#archer-overview [role=row]:has([role=gridcell])",
        "rows => rows.map(r => Array.from(r.querySelectorAll('[role=gridcell]')).map(c => c.innerText.trim()))")
    column = headers.index("f1")
    assert [r[column] for r in cells] == ["" if np.isnan(v) else f"{float(v):.4g}" for v in f1]  # NaN: no value
    assert 0 < np.isnan(f1).sum() < len(f1)
    assert f" | f1 {float(f1[row]):.4g} | " in page.inner_text("#archer-meta")
    page.screenshot(path=str(tmp_path / "overview.png"))



def test_the_legend_says_what_the_columns_and_the_colours_mean(page, tmp_path) -> None:
    open_response(page, 2, 1)
    box = page.locator("#archer-legend-box")
    assert not page.locator("#archer-legend").is_visible()  # folded away until asked for
    box.get_by_text(app_module.LEGEND).click()
    page.locator("#archer-legend").wait_for(state="visible")
    text = " ".join(page.inner_text("#archer-legend").split())
    for column in ("influence_abs_p99", "entropy_mean", "group_id", "f1", "influence", "log_prob"):
        description = legend.REWARD_EXTRA if column == "f1" else legend.COLUMNS[column]
        assert f"{column}: {' '.join(description.split())}" in text, column
    for scale in ("entropy heatmap", "influence heatmap"):
        assert f"{scale}: " in text and "accepted responses" in text
    page.screenshot(path=str(tmp_path / "legend.png"))

def test_other_tabs_show_top_tokens_groups_comparison_curves_and_histogram(page, tokenizer) -> None:
    open_response(page, 2, 1)
    page.get_by_role("tab", name="Top-K tokens").click()
    arrays = arrays_of(tokenizer, 2)
    top = np.sort(arrays["entropies"][arrays["response_mask"]].astype(np.float64))[::-1][0]
    # The first row's last cell is the highest entropy of step 2, shown rounded to 4 decimals.
    page.wait_for_function(
        "(top) => { const row = document.querySelector('#archer-top-high [role=row]:has([role=gridcell])');"
        " const cells = row ? row.querySelectorAll('[role=gridcell]') : [];"
        " return cells.length > 0 && Math.abs(parseFloat(cells[cells.length - 1].innerText) - top) < 5e-5; }",
        arg=float(top))
    page.get_by_role("tab", name="Prompt group").click()
    page.wait_for_function("() => document.querySelectorAll('#archer-group .archer-panel').length === 3")
    assert "step 2 · row 0 · sample_index 0" in page.inner_text("#archer-group")
    page.get_by_role("tab", name="Compare steps").click()
    # it opens on the nearest other step holding the prompt (step 1; step 3 would too, but its file is damaged)
    page.wait_for_function("() => document.querySelector('#archer-compare')?.innerText.includes('step 1: 3 responses')")
    assert "step 1 · row 3" in page.inner_text("#archer-compare")  # same prompt, another uid
    assert "(also in step(s) 1)" in page.inner_text("#archer-other")
    page.locator("#archer-other input").click()
    page.locator('#archer-other li[role="option"][aria-label="4"]').click()  # a step picked by hand is kept
    page.wait_for_function("() => document.querySelector('#archer-compare')?.innerText.includes('step 4: 0 responses')")
    page.get_by_role("tab", name="Curves").click()
    page.wait_for_selector("#archer-curves img")
    page.get_by_role("tab", name="Histogram").click()
    page.wait_for_selector("#archer-histogram img")
    page.get_by_role("tab", name="Responses").click()


def test_a_step_written_while_the_app_runs_appears(page, trace, tokenizer) -> None:
    writer = TraceWriter(trace, kind="influence")
    trace_support.add_step(writer, tokenizer, 5)
    page.wait_for_function("() => document.querySelector('#archer-header').innerText.includes('steps 1..5')")
    open_response(page, 5, 0)
    length = int(arrays_of(tokenizer, 5)["response_mask"][0].sum())
    assert page.locator("#archer-heatmap-entropy .archer-tok").count() == length


def test_clicks_made_while_the_last_is_still_answered_all_count(browser, trace, monkeypatch) -> None:
    # A slow server: opening a tab and picking a row take a second each, and the second click comes before the
    # first has been answered (Gradio ignores a second trigger of an event still pending: one event for all tabs
    # dropped the second tab, and a table's select event the second row).
    opened, select_row = app_module._opened, app_module._select_row

    def slow_tab(label: str):
        def run() -> str:
            time.sleep(1.0)
            return opened(label)()
        return run

    def slow_row(column: int):
        def pick(event: gr.SelectData) -> int:
            time.sleep(1.0)
            return select_row(column)(event)
        return pick

    monkeypatch.setattr(app_module, "_opened", slow_tab)
    monkeypatch.setattr(app_module, "_select_row", slow_row)
    for page in open_page(browser, trace):
        page.get_by_role("tab", name="Top-K tokens").click()
        page.get_by_role("tab", name="Prompt group").click()
        page.wait_for_function("() => document.querySelectorAll('#archer-group .archer-panel').length === 3")
        assert page.get_by_role("tab", name="Prompt group").get_attribute("aria-selected") == "true"
        page.get_by_role("tab", name="Responses").click()
        rows = page.locator("#archer-overview [role=row]:has([role=gridcell])")
        rows.nth(1).locator("[role=gridcell]").first.click()
        rows.nth(2).locator("[role=gridcell]").first.click()
        wait_for_response(page, int(page.input_value("#archer-step input")), 2)  # the latest step (4, or 5 if written)


def test_the_page_loads_nothing_from_outside_the_app(page) -> None:
    origin = page.url.rstrip("/")
    outside = [url for url in page.requested if not (url.startswith(origin) or url.startswith(("data:", "blob:")))]
    assert page.requested and outside == []


# -- a tool run: greyed tool output, highlighted tool calls, the branch tree ---------------------------------------

@pytest.fixture(scope="module")
def tool_trace(tmp_path_factory, tokenizer) -> Path:
    return trace_support.write_tool_trace(tmp_path_factory.mktemp("browser-tools") / "entropy_trace", tokenizer)


@pytest.fixture(scope="module")
def tool_page(browser, tool_trace):
    yield from open_page(browser, tool_trace)


def test_tool_output_is_grey_and_tool_calls_are_highlighted(tool_page, tokenizer, tmp_path) -> None:
    page, step, row = tool_page, 2, 2  # row 2: two python calls, each answered
    open_response(page, step, row)
    arrays = trace_support.tool_step_arrays(tokenizer, step)
    mask, tool = arrays["response_mask"][row], arrays["tool_mask"][row]
    texts = [tokenizer.decode([int(i)]) for i in arrays["responses"][row]]
    calls = queries.call_tokens(texts, mask)
    spans = heatmap_spans(page, "archer-heatmap-entropy")
    assert [s["pos"] for s in spans] == np.flatnonzero(mask | tool).tolist()  # tool output shown, padding not
    vmax = vmax_of(page, "archer-heatmap-entropy")
    for s in spans:
        p = s["pos"]
        if tool[p]:
            assert "archer-tok--tool" in s["cls"] and s["colour"] == render.TOOL  # grey, not the entropy's colour
            assert "tool output (not the policy's)" in s["title"]
        else:
            assert s["colour"] == render.entropy_colour(float(arrays["entropies"][row, p]), vmax)
        assert ("archer-tok--call" in s["cls"]) == calls[p] == ("inset" in s["shadow"])
    called = "".join(texts[p] for p in np.flatnonzero(calls))
    assert called == "<python>print(2 ** 10)</python><python>print(3 + 5)</python>"
    assert not (calls & tool).any() and tool.sum() > 0
    assert " <result>\n1024\n</result>" in page.input_value("#archer-response textarea")
    legend = page.inner_text("#archer-heatmap-entropy .archer-legend")
    assert "tool output" in legend and "tool call" in legend
    page.locator("#archer-heatmap-entropy").screenshot(path=str(tmp_path / "tool_tokens.png"))
    assert (tmp_path / "tool_tokens.png").stat().st_size > 5_000


def tree_lanes(page) -> list[int]:
    return page.eval_on_selector_all("#archer-tree g.archer-tree-node:has(.archer-tree-line)",
                                     "gs => gs.map(g => +g.dataset.row)")


def test_the_branch_tree_draws_a_prompts_responses_and_opens_one(tool_page, tokenizer, tmp_path) -> None:
    page, step = tool_page, 2
    open_response(page, step, 3)  # branched from row 2, which branched from row 0
    page.get_by_role("tab", name="Branch tree").click()
    page.wait_for_selector("#archer-tree svg[data-responses='4']")
    arrays = trace_support.tool_step_arrays(tokenizer, step)
    tree = queries.branch_tree(arrays, "t2-g0")
    assert tree["row"].tolist() == [0, 2, 3, 1]  # each branch right after its parent
    assert tree_lanes(page) == [0, 2, 3, 1]
    branch = page.eval_on_selector_all("#archer-tree .archer-tree-branch",
                                       "cs => cs.map(c => [+c.closest('g').dataset.row, +c.dataset.entropy])")
    positions = arrays["branch_position"]
    assert [r for r, _ in branch] == [2, 3]
    for r, entropy in branch:  # the entropy at the branch point: that of the branch's first token of its own
        assert entropy == pytest.approx(float(arrays["entropies"][r, positions[r]]), rel=1e-5)
    labels = page.eval_on_selector_all("#archer-tree g.archer-tree-node:has(.archer-tree-line) text",
                                       "ts => ts.map(t => t.textContent)")
    assert labels == ["#0 · row 0", "reward 1 · 1 call · eos", "#2 · row 2", "reward 0 · 2 calls · eos",
                      "#3 · row 3", "reward 1 · 2 calls · eos", "#1 · row 1", "reward 0 · 1 call · eos"]
    assert page.get_attribute("#archer-tree g[data-row='3'] text", "font-weight") == "bold"  # the open response
    # a lane draws its own part only: rows 0, 2 and 1 each call and get an answer once there, row 3 does not
    assert page.locator("#archer-tree .archer-tree-tool").count() == 3
    assert page.locator("#archer-tree .archer-tree-call").count() == 3
    assert page.input_value("#archer-tree-uid input") == "t2-g0 · 4 responses, 2 branches"
    page.locator("#archer-tree").screenshot(path=str(tmp_path / "branch_tree.png"))
    assert (tmp_path / "branch_tree.png").stat().st_size > 5_000
    page.screenshot(path=str(tmp_path / "branch_tree_page.png"), full_page=True)
    page.locator("#archer-tree g[data-row='1'] .archer-tree-leaf").click()  # opens row 1 in the response view
    wait_for_response(page, step, 1)
    assert page.locator("#archer-heatmap-entropy").is_visible()


def test_picking_a_prompt_in_the_branch_tree_tab_draws_its_tree(tool_page, tokenizer) -> None:
    page, step = tool_page, 2
    open_response(page, step, 0)
    page.get_by_role("tab", name="Branch tree").click()
    page.wait_for_selector("#archer-tree svg[data-responses='4']")
    page.locator("#archer-tree-uid input").click()
    page.locator('#archer-tree-uid li[role="option"]').filter(has_text="t2-g1").click()
    page.wait_for_function("() => document.querySelector('#archer-tree g.archer-tree-node')?.dataset.row === '4'")
    assert tree_lanes(page) == queries.branch_tree(trace_support.tool_step_arrays(tokenizer, step), "t2-g1")[
        "row"].tolist() == [4, 5, 6, 7]
    page.get_by_role("tab", name="Responses").click()
    wait_for_response(page, step, 4)  # the prompt's first response is open


def test_wide_tables_and_the_group_panels_are_not_cut_off_on_the_right(page, tool_page) -> None:
    """The issue's case: the stats table and the overview hid their last columns (num_val..., num_tool_call...)
    behind the right edge, and the group view's fourth panel was cut off."""
    right_edges = ("(e) => { const box = e.getBoundingClientRect();"
                   " return [box.right, [...e.querySelectorAll('thead th')].map(th => th.getBoundingClientRect().right)]; }")
    for shown in (page, tool_page):  # an influence trace (most statistics), a tool run (most overview columns)
        for elem_id in ("archer-stats", "archer-overview"):
            box_right, header_rights = shown.eval_on_selector(f"#{elem_id}", right_edges)
            assert len(header_rights) >= 9 and max(header_rights) <= box_right + 1, (elem_id, box_right, header_rights)
            # and every header wraps between words only: no word is cut, none sticks out of its cell
            overflowing = shown.eval_on_selector(f"#{elem_id}", "(e) => [...e.querySelectorAll('thead th')]"
                                                 ".filter(th => th.scrollWidth > th.clientWidth + 1).map(th => th.innerText)")
            assert overflowing == [], (elem_id, overflowing)
    tool_page.get_by_role("tab", name="Prompt group").click()
    tool_page.wait_for_selector("#archer-group .archer-panel .archer-tok")
    box_right, panel_rights = tool_page.eval_on_selector(
        "#archer-group", "(e) => [e.getBoundingClientRect().right,"
        " [...e.querySelectorAll('.archer-panel')].map(p => p.getBoundingClientRect().right)]")
    assert len(panel_rights) == 4 and max(panel_rights) <= box_right + 1, (box_right, panel_rights)
    tool_page.get_by_role("tab", name="Responses").click()


# -- a run with health flags: the Health tab, a flag opened with its tokens boxed ------------------------------------

@pytest.fixture(scope="module")
def health_page(browser, tmp_path_factory, tokenizer):
    trace = health_support.write_health_run(tmp_path_factory.mktemp("browser-health") / "run", tokenizer)
    yield from open_page(browser, trace)


def flagged_positions(page) -> list[int]:
    return [s["pos"] for s in heatmap_spans(page, "archer-heatmap-entropy") if "archer-tok--flag" in s["cls"]]


def test_the_health_tab_shows_the_flags_over_the_curves_and_opens_a_flags_responses(health_page, tmp_path) -> None:
    page = health_page
    page.get_by_role("tab", name="Health").click()
    page.wait_for_selector("#archer-health-timeline img")
    page.wait_for_function("() => document.querySelector('#archer-health-flags')?.innerText.includes('entropy_blowup')")
    note = page.inner_text("#archer-health-note")
    assert "2 flag(s) (1 warning, 1 critical) — flags of" in note and "health.jsonl, written while training" in note
    cells = page.eval_on_selector_all("#archer-health-flags [role=row]:has([role=gridcell])",
                                      "rows => rows.map(r => [...r.querySelectorAll('[role=gridcell]')]"
                                      ".map(c => c.innerText.trim()))")
    assert [c[:4] for c in cells] == [["0", "2", "warning", "instability"], ["1", "3", "critical", "entropy_blowup"]]
    page.screenshot(path=str(tmp_path / "health_tab.png"), full_page=True)
    # a flag: its step and first pointed response open, the pointed tokens boxed in green
    page.locator("#archer-health-flags [role=gridcell]").filter(has_text="instability").first.click()
    wait_for_response(page, 2, 4)
    assert page.get_by_role("tab", name="Responses").get_attribute("aria-selected") == "true"
    assert "health: instability (warning) at step 2: largest policy-gradient weight 1.5; tokens at 1 3 boxed" in (
        page.inner_text("#archer-meta"))
    assert flagged_positions(page) == [1, 3]
    outline = page.eval_on_selector("#archer-heatmap-entropy .archer-tok--flag", "s => getComputedStyle(s).outlineColor")
    assert outline.replace(" ", "") == render.FLAGGED
    page.screenshot(path=str(tmp_path / "flag_opened.png"), full_page=True)
    set_text(page, "archer-row", "2")  # another response: nothing boxed
    wait_for_response(page, 2, 2)
    assert flagged_positions(page) == []
    # the second flag's second pointer, from the pointers table
    page.get_by_role("tab", name="Health").click()
    page.locator("#archer-health-flags [role=gridcell]").filter(has_text="entropy_blowup").first.click()
    wait_for_response(page, 3, 5)
    assert flagged_positions(page) == [0, 2]
    page.get_by_role("tab", name="Health").click()
    page.wait_for_function("() => document.querySelector('#archer-health-pointers')?.innerText.includes('s3-g0')")
    page.locator("#archer-health-pointers [role=gridcell]").filter(has_text="s3-g0").first.click()
    wait_for_response(page, 3, 0)
    assert flagged_positions(page) == [4]


# -- hostile text in a trace: shown as text, nothing loaded -------------------------------------------------------

class _Bait(http.server.BaseHTTPRequestHandler):
    """Counts every request: the page must send none."""

    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        _Bait.hits.append(self.path)
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_hostile_trace_text_is_shown_as_text_and_loads_nothing(browser, tmp_path) -> None:
    bait = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Bait)
    threading.Thread(target=bait.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    port = bait.server_address[1]
    _Bait.hits = []
    try:
        trace = trace_support.write_hostile_trace(tmp_path / "entropy_trace", port)
        for page in open_page(browser, trace):
            wait_for_response(page, 2, 0)
            time.sleep(1.0)  # what a tag would load has had time to be asked for
            assert [url for url in page.requested if f":{port}" in url] == [] and _Bait.hits == []
            img, script, md, frame = trace_support.hostile_texts(port)
            meta = page.inner_text("#archer-meta")
            assert img in meta and script in meta and md in meta and frame in meta  # the text itself, shown
            assert img in page.inner_text("#archer-header") and md in page.inner_text("#archer-header")
            table = page.inner_text("#archer-overview").replace("\u200b", "")  # Gradio's break points after / and _
            assert img in table and script in table and md in table and frame in table
            tokens = [s["text"] for s in heatmap_spans(page, "archer-heatmap-entropy")]
            assert tokens[:4] == [render.visible_whitespace(t) for t in (img, script, md, frame)]
            for tab, shown in (("Top-K tokens", "#archer-top-high"), ("Prompt group", "#archer-group"),
                               ("Compare steps", "#archer-compare"), ("Branch tree", "#archer-tree")):
                page.get_by_role("tab", name=tab).click()
                page.wait_for_function("(sel) => document.querySelector(sel)?.innerText.length > 0", arg=shown)
            page.wait_for_function("() => document.querySelector('#archer-group .archer-tok')")
            time.sleep(1.0)  # what a tag would load has had time to be asked for
            counts = page.evaluate("() => ['img', 'script', 'iframe'].map(t => [...document.querySelectorAll(t)]"
                                   f".filter(e => (e.src || '').includes(':{port}')).length)")
            assert counts == [0, 0, 0]
            assert [url for url in page.requested if f":{port}" in url] == [] and _Bait.hits == []
    finally:
        bait.shutdown()
        bait.server_close()
