"""Heatmap HTML and colour scales: colours by hand, spans parsed back attribute by attribute."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from archer.viz import render


class Spans(HTMLParser):
    """Collects the token spans of a heatmap: attributes, text, and whether a <br> followed."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[dict] = []
        self.heatmaps: list[dict] = []
        self._in_token = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attrs = dict(attrs)
        if tag == "span" and "archer-tok" in attrs.get("class", "").split():
            self.spans.append({**attrs, "text": "", "br_after": False})
            self._in_token = True
        elif tag == "div" and attrs.get("class") == "archer-heatmap":
            self.heatmaps.append(attrs)
        elif tag == "br" and self.spans:
            self.spans[-1]["br_after"] = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "span":
            self._in_token = False

    def handle_data(self, data: str) -> None:
        if self._in_token:
            self.spans[-1]["text"] += data


def parse(html_text: str) -> Spans:
    parser = Spans()
    parser.feed(html_text)
    return parser


def tokens() -> pd.DataFrame:
    return pd.DataFrame({
        "position": [0, 1, 2, 3],
        "token": ["<b>", " x\n", "\ty", "&"],
        "token_id": [7, 8, 9, 0],
        "entropy": [0.0, 1.0, 2.5, 0.0],
        "log_prob": [-0.5, -1.0, -2.0, 0.0],
        "prob": [math.exp(-0.5), math.exp(-1.0), math.exp(-2.0), 1.0],
        "influence": [0.5, np.nan, -1.0, np.nan],
        "valid": [True, True, True, False],
    })


def test_entropy_colour_by_hand() -> None:
    # white (255,255,255) -> HOT (214,39,40), linear, halves rounded up.
    assert render.entropy_colour(0.0, 2.0) == "rgb(255,255,255)"
    assert render.entropy_colour(2.0, 2.0) == "rgb(214,39,40)"
    assert render.entropy_colour(1.0, 2.0) == "rgb(235,147,148)"  # 234.5, 147, 147.5
    assert render.entropy_colour(0.5, 2.0) == "rgb(245,201,201)"  # 244.75, 201, 201.25
    assert render.entropy_colour(9.0, 2.0) == "rgb(214,39,40)"  # clipped
    assert render.entropy_colour(-1.0, 2.0) == "rgb(255,255,255)"
    assert render.entropy_colour(float("nan"), 2.0) == render.MISSING
    assert render.entropy_colour(1.0, 0.0) == "rgb(255,255,255)"


def test_influence_colour_is_diverging() -> None:
    assert render.influence_colour(0.0, 2.0) == "rgb(255,255,255)"
    assert render.influence_colour(2.0, 2.0) == "rgb(214,39,40)"
    assert render.influence_colour(-2.0, 2.0) == "rgb(31,119,180)"
    assert render.influence_colour(-5.0, 2.0) == "rgb(31,119,180)"  # clipped
    assert render.influence_colour(-1.0, 2.0) == "rgb(143,187,218)"  # 143, 187, 217.5
    assert render.influence_colour(1.0, 2.0) == "rgb(235,147,148)"
    assert render.influence_colour(float("nan"), 2.0) == "rgb(221,221,221)"


def test_visible_text_escapes_and_shows_whitespace() -> None:
    assert render.visible_text('<a href="x"> &\n\t\r') == "&lt;a·href=&quot;x&quot;&gt;·&amp;↵→␍"
    assert render.visible_whitespace("a b\nc\td") == "a·b↵c→d"


def test_heatmap_spans_carry_position_values_colours_and_tooltips() -> None:
    html_text = render.heatmap_html(tokens(), colour_by="entropy", vmax=2.0)
    parsed = parse(html_text)
    assert parsed.heatmaps == [{"class": "archer-heatmap", "data-colour": "entropy", "data-vmax": "2.0",
                                "data-tokens": "4"}]
    spans = parsed.spans
    assert [s["data-pos"] for s in spans] == ["0", "1", "2", "3"]
    assert [s["data-entropy"] for s in spans] == ["0", "1", "2.5", "0"]
    assert [s["data-influence"] for s in spans] == ["0.5", "nan", "-1", "nan"]
    assert [s["style"] for s in spans] == ["background-color:rgb(255,255,255)", "background-color:rgb(235,147,148)",
                                           "background-color:rgb(214,39,40)", "background-color:rgb(255,255,255)"]
    assert [s["text"] for s in spans] == ["<b>", "·x↵", "→y", "&"]  # unescaped by the parser
    assert ">&lt;b&gt;</span>" in html_text and "<b>" not in html_text
    assert [s["br_after"] for s in spans] == [False, True, False, False]  # the newline token breaks the line
    assert spans[2]["title"] == ("pos 2 | token '\\ty' | id 9 | entropy 2.5 | log-prob -2 (p=0.135335) | "
                                 "influence -1")
    assert spans[3]["title"].endswith("| influence nan | padding")
    assert [s["class"] for s in spans] == ["archer-tok"] * 3 + ["archer-tok archer-tok--pad"]


def test_influence_heatmap_and_view_mask() -> None:
    in_view = np.array([True, False, True, False])
    spans = parse(render.heatmap_html(tokens(), colour_by="influence", vmax=2.0, in_view=in_view)).spans
    # 0.5 / 2 -> a quarter of the way to HOT; -1 / 2 -> half way to COLD; NaN -> grey.
    assert [s["style"].split(":")[1] for s in spans] == ["rgb(245,201,201)", render.MISSING, "rgb(143,187,218)",
                                                        render.MISSING]
    assert [s["class"] for s in spans] == ["archer-tok", "archer-tok archer-tok--out", "archer-tok",
                                           "archer-tok archer-tok--out archer-tok--pad"]


def test_heatmap_without_influence_and_cut_at_max_tokens() -> None:
    table = tokens().drop(columns=["influence", "log_prob", "prob"])
    html_text = render.heatmap_html(table, vmax=1.0, max_tokens=2, legend=False)
    spans = parse(html_text).spans
    assert len(spans) == 2 and all("data-influence" not in s for s in spans)
    assert spans[1]["title"] == "pos 1 | token ' x\\n' | id 8 | entropy 1"
    assert "… 2 more tokens" in html_text
    assert 'class="archer-legend"' not in html_text
    assert 'class="archer-legend"' in render.heatmap_html(table, vmax=1.0)


def test_panels_escape_titles() -> None:
    out = render.panels_html([("row <1>", "<i>a</i>"), ("row 2", "b")])
    assert out.count('class="archer-panel"') == 2
    assert "row &lt;1&gt;" in out and "<i>a</i>" in out


def test_figures_have_one_panel_per_statistic_group() -> None:
    table = pd.DataFrame({"step": [1, 2], "entropy_mean": [1.0, 0.5], "entropy_p90": [2.0, 1.5],
                          "reward_mean": [0.1, 0.4], "influence_mean": [0.0, 0.2]})
    fig = render.curves_figure(table)
    assert isinstance(fig, Figure)
    assert [ax.get_ylabel() for ax in fig.axes] == ["entropy", "reward", "influence"]
    assert [line.get_label() for line in fig.axes[0].lines] == ["entropy_mean", "entropy_p90"]
    assert fig.axes[1].lines[0].get_ydata().tolist() == [0.1, 0.4]
    assert len(render.curves_figure(table[["step"]]).axes) == 0
    hist = render.histogram_figure(np.array([4, 2, 3]), np.array([0.0, 1.0, 2.0, 3.0]), step=5)
    assert [p.get_height() for p in hist.axes[0].patches] == [4, 2, 3]
    assert hist.axes[0].get_title() == "step 5: 9 tokens"


def tool_tokens() -> pd.DataFrame:
    """A tool run's tokens: a call (0-2), its answer (3-4, tool output), the model again (5), padding (6)."""
    return pd.DataFrame({
        "position": list(range(7)),
        "token": ["<python>", "x", "</python>", " <result>", "</result>", " 7", "<pad>"],
        "token_id": [20, 21, 22, 23, 25, 24, 0],
        "entropy": [0.0, 1.0, 2.0, 2.0, 2.0, 0.5, 0.0],
        "valid": [True, True, True, False, False, True, False],
        "tool": [False, False, False, True, True, False, False],
        "tool_call": [True, True, True, False, False, False, False],
    })


def test_heatmap_greys_tool_output_and_marks_tool_calls() -> None:
    html_text = render.heatmap_html(tool_tokens(), vmax=2.0)
    spans = parse(html_text).spans
    assert [s["class"] for s in spans] == ["archer-tok archer-tok--call"] * 3 + ["archer-tok archer-tok--tool"] * 2 + [
        "archer-tok", "archer-tok archer-tok--pad"]
    # tool output is grey whatever its entropy; the model's tokens (calls included) keep the entropy colour
    assert [s["style"].split(":")[1] for s in spans] == [
        "rgb(255,255,255)", "rgb(235,147,148)", "rgb(214,39,40)", render.TOOL, render.TOOL, "rgb(245,201,201)",
        "rgb(255,255,255)"]
    assert spans[3]["title"] == "pos 3 | token ' <result>' | id 23 | entropy 2 | tool output (not the policy's)"
    assert spans[0]["title"].endswith("| entropy 0 | tool call")
    assert spans[6]["title"].endswith("| padding")
    assert "tool output" in html_text.split('class="archer-heatmap"')[0]  # the legend names the marks
    spans = parse(render.heatmap_html(tool_tokens(), vmax=2.0, in_view=np.array([1, 1, 0, 0, 1, 1, 1], bool))).spans
    assert spans[2]["class"] == "archer-tok archer-tok--out archer-tok--call"
    assert spans[3]["class"] == "archer-tok archer-tok--out archer-tok--tool"
    assert "tool output" not in render.heatmap_html(tokens(), vmax=2.0)  # no tool marks without tools


def test_reward_colour_from_the_groups_lowest_to_highest() -> None:
    assert render.reward_colour(0.0, 0.0, 1.0) == "rgb(214,39,40)"
    assert render.reward_colour(1.0, 0.0, 1.0) == "rgb(44,160,44)"
    assert render.reward_colour(0.5, 0.0, 1.0) == "rgb(237,177,32)"  # amber half way
    assert render.reward_colour(0.25, 0.0, 1.0) == "rgb(226,108,36)"  # half way to amber: 225.5, 108, 36
    assert render.reward_colour(0.75, 0.0, 1.0) == "rgb(141,169,38)"  # 140.5, 168.5, 38
    assert render.reward_colour(3.0, 3.0, 3.0) == "rgb(237,177,32)"  # all equal: amber
    assert render.reward_colour(9.0, 0.0, 1.0) == "rgb(44,160,44)"  # clipped
    assert render.reward_colour(float("nan"), 0.0, 1.0) == render.MISSING


def tree_svg(selected: int | None = 1) -> ET.Element:
    tree = pd.DataFrame({"row": [0, 1, 2], "sample_index": [0, 1, 2], "parent": [-1, 0, -1],
                         "parent_row": [-1, 0, -1], "branch_position": [-1, 6, -1],
                         "branch_token_entropy": [np.nan, 1.0, np.nan], "depth": [0, 1, 0],
                         "branches": [1, 0, 0],
                         "all_tokens": [7, 14, 3], "tool_tokens": [3, 3, 0], "reward": [1.0, 0.0, 0.5],
                         "num_tool_calls": [1, 1, 0], "finish_reason": ["eos", "length", "eos"]})
    tool, call = np.zeros(14, bool), np.zeros(14, bool)
    tool[3:6], call[0:3] = True, True  # row 1 inherits them from row 0: its own part starts at 6
    tool_1, call_1 = tool.copy(), call.copy()
    tool_1[10:12], call_1[7:10] = True, True
    marks = {0: (tool[:7], call[:7]), 1: (tool_1, call_1), 2: (np.zeros(3, bool), np.zeros(3, bool))}
    text = render.branch_tree_svg(tree, marks, vmax=2.0, selected=selected)
    return ET.fromstring(text[text.index("<svg"):text.index("</svg>") + 6])


SVG = "{http://www.w3.org/2000/svg}"


def test_branch_tree_svg_by_hand() -> None:
    svg = tree_svg()
    assert svg.get("data-responses") == "3"
    lanes = [g for g in svg.iter(f"{SVG}g") if g.find(f"{SVG}line[@class='archer-tree-line']") is not None]
    assert [g.get("data-row") for g in lanes] == ["0", "1", "2"]
    # x = 120 + 580 * position / 14 (the longest response); lanes 30 apart from y = 55
    lines = [g.find(f"{SVG}line[@class='archer-tree-line']").attrib for g in lanes]
    assert [(ln["x1"], ln["x2"], ln["y1"]) for ln in lines] == [("120.0", "410.0", "55"), ("368.6", "700.0", "85"),
                                                                ("120.0", "244.3", "115")]
    bars = [(r.get("class"), r.get("x"), r.get("width")) for r in lanes[1].iter(f"{SVG}rect") if r.get("class")]
    assert bars == [("archer-tree-tool", "534.3", "82.8"), ("archer-tree-call", "410.0", "124.3")]  # its own part
    assert len([r for r in lanes[0].iter(f"{SVG}rect") if r.get("class")]) == 2 and lanes[2].find(
        f"{SVG}rect[@class='archer-tree-tool']") is None
    leaves = [g.find(f"{SVG}circle").get("fill") for g in lanes]
    assert leaves == ["rgb(44,160,44)", "rgb(214,39,40)", "rgb(237,177,32)"]  # rewards 1, 0, 0.5
    texts = [[t.text for t in g.iter(f"{SVG}text")] for g in lanes]
    assert texts == [["#0 · row 0", "reward 1 · 1 call · eos"], ["#1 · row 1", "reward 0 · 1 call · length"],
                     ["#2 · row 2", "reward 0.5 · 0 calls · eos"]]
    title = lanes[1].find(f"{SVG}title").text
    assert "branched from #0 (row 0) at position 6, token entropy 1 there" in title
    # the branch point: on row 0's lane at position 6, coloured by the entropy there, opening row 1
    branch = [g for g in svg.iter(f"{SVG}g") if g.find(f"{SVG}circle[@class='archer-tree-branch']") is not None]
    assert [g.get("data-row") for g in branch] == ["1"]
    dot = branch[0].find(f"{SVG}circle").attrib
    assert (dot["cx"], dot["cy"], dot["fill"], dot["data-entropy"]) == ("368.6", "55", "rgb(235,147,148)", "1")
    assert branch[0].find(f"{SVG}text").text == "token entropy 1"
    assert lanes[1].find(f"{SVG}text").get("font-weight") == "bold"  # the selected response
    assert [r.get("fill") for r in svg.findall(f"{SVG}rect")] == ["#fff4c2"]  # its highlighted lane
    assert tree_svg(selected=None).findall(f"{SVG}rect") == []
