"""Rendering of the trace explorer: token heatmaps as HTML, side-by-side panels, and the matplotlib figures.

A heatmap is a ``<div class="archer-heatmap">`` holding one ``<span class="archer-tok">`` per token, with the
token's text (HTML-escaped, whitespace made visible), a hover ``title`` and ``data-pos`` / ``data-entropy`` /
``data-influence`` attributes. The background comes from ``entropy_colour`` (white -> red) or, for the
influence heatmap, ``influence_colour`` (blue for negative, white at zero, red for positive). Tool output is
grey (``archer-tok--tool``: not the policy's tokens), the model's tool calls are underlined in purple
(``archer-tok--call``), the tokens a health flag points at are boxed in green (``archer-tok--flag``). ``branch_tree_svg`` draws one prompt's responses as an SVG tree.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

WHITE = (255, 255, 255)
HOT = (214, 39, 40)  # high entropy / positive influence
COLD = (31, 119, 180)  # negative influence
MISSING = "rgb(221,221,221)"  # NaN (influence not computed)
TOOL = "rgb(236,236,236)"  # tool output: not coloured by entropy or influence
CALL = "rgb(106,61,154)"  # the model's tool calls
FLAGGED = "rgb(44,160,44)"  # the tokens a health flag points at
VISIBLE_WHITESPACE = {" ": "·", "\n": "↵", "\t": "→", "\r": "␍"}
_VISIBLE = str.maketrans(VISIBLE_WHITESPACE)
HEATMAP_CSS = (
    "<style>"
    ".archer-heatmap{font-family:ui-monospace,monospace;font-size:13px;line-height:1.9;color:#111;"
    "background:#fff;padding:6px;border:1px solid #ddd;border-radius:4px;max-height:520px;overflow:auto;"
    "word-break:break-all}"  # adjacent spans have no spaces between them: lines may break anywhere
    ".archer-heatmap .archer-tok{padding:1px 0;border-radius:2px;white-space:pre-wrap}"
    ".archer-heatmap .archer-tok--out{color:#aaa;background-color:transparent!important}"
    ".archer-heatmap .archer-tok--pad{outline:1px dashed #999}"
    ".archer-tok--tool{color:#8a8a8a;font-style:italic}"
    f".archer-tok--call{{box-shadow:inset 0 -3px 0 {CALL};color:#3f1d6b;font-weight:600}}"
    ".archer-tok--rejected{text-decoration:line-through}"
    f".archer-heatmap .archer-tok--flag{{outline:2px solid {FLAGGED};outline-offset:-1px}}"
    ".archer-heatmap .archer-tok:hover{outline:1px solid #000}"
    # side-by-side panels wrap onto further rows rather than run off the right edge
    ".archer-panels{display:grid;gap:8px;grid-template-columns:repeat(auto-fill,minmax(280px,1fr))}"
    ".archer-panel-title{font-size:12px;margin:2px 0;color:#333}"
    ".archer-legend{font-size:12px;margin:2px 0 4px;color:#333}"
    "</style>"
)


def _mix(low: tuple[int, int, int], high: tuple[int, int, int], t: float) -> str:
    r, g, b = (int(lo + t * (hi - lo) + 0.5) for lo, hi in zip(low, high))  # rounds halves up
    return f"rgb({r},{g},{b})"


def entropy_colour(value: float, vmax: float) -> str:
    """White at 0, HOT at ``vmax`` and above, linear in between; NaN -> grey."""
    if math.isnan(value):
        return MISSING
    t = min(max(value / vmax, 0.0), 1.0) if vmax > 0 else 0.0
    return _mix(WHITE, HOT, t)


def influence_colour(value: float, vmax: float) -> str:
    """Diverging: COLD at -vmax, white at 0, HOT at +vmax (clipped beyond); NaN -> grey."""
    if math.isnan(value):
        return MISSING
    t = min(max(value / vmax, -1.0), 1.0) if vmax > 0 else 0.0
    return _mix(WHITE, HOT, t) if t >= 0 else _mix(WHITE, COLD, -t)


def visible_whitespace(text: str) -> str:
    """Token text with space, newline, tab and CR shown as visible marks."""
    return text.translate(_VISIBLE)


def markdown_text(text: object) -> str:
    """``text`` for a Markdown component, shown as the text it is: HTML-escaped (no tags, so no ``<img>`` or
    ``<script>``), its backslashes and square brackets escaped (no links or ``![image](url)``), on one line."""
    escaped = html.escape(str(text), quote=False).replace("\\", "\\\\")
    return escaped.replace("[", "\\[").replace("]", "\\]").replace("\r", " ").replace("\n", " ")


def visible_text(text: str) -> str:
    """HTML-escaped token text with visible whitespace."""
    return html.escape(text).translate(_VISIBLE)


def _number(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.6g}"


def token_title(token: dict) -> str:
    """Hover text: position, token, id, entropy, log-prob (and probability), influence."""
    parts = [f"pos {token['position']}", f"token {token['token']!r}", f"id {token['token_id']}",
             f"entropy {_number(token['entropy'])}"]
    if "log_prob" in token:
        parts.append(f"log-prob {_number(token['log_prob'])} (p={_number(token['prob'])})")
    if "influence" in token:
        parts.append(f"influence {_number(token['influence'])}")
    if token.get("tool"):
        parts.append("tool output (not the policy's)")
    elif not token["valid"]:
        parts.append("padding")
    if token.get("tool_call"):
        parts.append("tool call")
    if token.get("rejected"):
        parts.append("rejected by the rollout correction (no loss)")
    return " | ".join(parts)


def legend_html(colour_by: str, vmax: float, tools: bool = False, scale: str = "", flagged: bool = False) -> str:
    """The colour scale of a heatmap in words and swatches (with the tool marks when ``tools``, the health
    flag's box when ``flagged``); ``scale`` says what the maximum is taken over."""
    if colour_by == "entropy":
        stops = [(0.0, "0"), (vmax / 2, f"{vmax / 2:.3g}"), (vmax, f"≥ {vmax:.3g}")]
        swatches = "".join(f'<span style="background-color:{entropy_colour(v, vmax)}">&nbsp;{label}&nbsp;</span>'
                           for v, label in stops)
        title = "entropy (nats)"
    else:
        stops = [(-vmax, f"≤ -{vmax:.3g}"), (0.0, "0"), (vmax, f"≥ {vmax:.3g}"), (math.nan, "not computed")]
        swatches = "".join(f'<span style="background-color:{influence_colour(v, vmax)}">&nbsp;{label}&nbsp;</span>'
                           for v, label in stops)
        title = "influence"
    if scale:
        title += f" (scale: {scale})"
    if tools:
        swatches += (f' &nbsp;<span class="archer-tok--tool" style="background-color:{TOOL}">&nbsp;tool output&nbsp;'
                     '</span> <span class="archer-tok--call">&nbsp;tool call&nbsp;</span>')
    if flagged:
        swatches += (f' &nbsp;<span style="outline:2px solid {FLAGGED};outline-offset:-1px">&nbsp;pointed at by the '
                     'health flag&nbsp;</span>')
    return f'<div class="archer-legend">{title}: {swatches}</div>'


def heatmap_html(tokens: pd.DataFrame, *, colour_by: str = "entropy", vmax: float = 1.0,
                 in_view: np.ndarray | None = None, max_tokens: int | None = None, legend: bool = True,
                 scale: str = "", flagged: Sequence[int] = ()) -> str:
    """One span per row of ``tokens`` (a token table, in its order), coloured by entropy or influence.

    Tokens where ``in_view`` is False get the class ``archer-tok--out`` (grey, no colour); padding tokens get
    ``archer-tok--pad``; tool output (``tool``) gets ``archer-tok--tool`` and the grey ``TOOL`` background,
    the model's tool calls (``tool_call``) ``archer-tok--call``, tokens the rollout correction rejected
    (``rejected``) ``archer-tok--rejected`` (struck through), the positions in ``flagged`` (a health flag's
    pointer) ``archer-tok--flag``. ``max_tokens`` cuts the heatmap and says how
    many tokens were left out; ``legend`` puts the colour scale above it (``scale`` naming what it spans).
    """
    if colour_by not in ("entropy", "influence"):
        raise ValueError(f"colour_by must be 'entropy' or 'influence', got {colour_by!r}")
    colour = entropy_colour if colour_by == "entropy" else influence_colour
    shown = tokens if max_tokens is None else tokens.iloc[:max_tokens]
    keep = np.ones(len(shown), dtype=bool) if in_view is None else np.asarray(in_view)[: len(shown)]
    has_influence = "influence" in shown.columns
    tools = "tool" in shown.columns and bool(shown["tool"].any())
    flagged = set(flagged)
    parts = [HEATMAP_CSS, legend_html(colour_by, vmax, tools, scale, bool(flagged)) if legend else "",
             f'<div class="archer-heatmap" data-colour="{colour_by}" data-vmax="{float(vmax)!r}" '
             f'data-tokens="{len(shown)}">']
    for token, inside in zip(shown.to_dict("records"), keep):
        tool = bool(token.get("tool"))
        classes = ("archer-tok" + ("" if inside else " archer-tok--out")
                   + (" archer-tok--tool" if tool else "" if token["valid"] else " archer-tok--pad")
                   + (" archer-tok--call" if token.get("tool_call") else "")
                   + (" archer-tok--rejected" if token.get("rejected") else "")
                   + (" archer-tok--flag" if token["position"] in flagged else ""))
        data = f'data-pos="{token["position"]}" data-entropy="{_number(token["entropy"])}"'
        if has_influence:
            data += f' data-influence="{_number(token["influence"])}"'
        text = visible_text(token["token"])
        background = TOOL if tool else colour(token[colour_by], vmax)
        parts.append(f'<span class="{classes}" {data} title="{html.escape(token_title(token))}" '
                     f'style="background-color:{background}">{text}</span>')
        if "\n" in token["token"]:
            parts.append("<br>")
    if len(shown) < len(tokens):
        parts.append(f'<div class="archer-panel-title">… {len(tokens) - len(shown)} more tokens</div>')
    parts.append("</div>")
    return "".join(parts)


def panels_html(panels: Sequence[tuple[str, str]]) -> str:
    """Side-by-side columns, each a (title, inner HTML) pair; the title is escaped."""
    columns = "".join(f'<div class="archer-panel"><div class="archer-panel-title">{html.escape(title)}</div>'
                      f"{body}</div>" for title, body in panels)
    return f'<div class="archer-panels">{columns}</div>'


TREE_WIDTH, TREE_LEFT, TREE_RIGHT, TREE_TOP, TREE_LANE = 980, 120, 280, 40, 30
REWARD_LOW, REWARD_MID, REWARD_HIGH = (214, 39, 40), (237, 177, 32), (44, 160, 44)
TREE_CSS = (
    "<style>"
    ".archer-tree{font-family:ui-monospace,monospace;font-size:12px;color:#111;background:#fff}"
    ".archer-tree svg{width:100%;height:auto;background:#fff;border:1px solid #ddd;border-radius:4px}"
    ".archer-tree .archer-tree-node{cursor:pointer}"
    ".archer-tree .archer-tree-node:hover .archer-tree-line{stroke:#000;stroke-width:3}"
    "</style>"
)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask, dtype=np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def reward_colour(value: float, low: float, high: float) -> str:
    """Red at the group's lowest reward, amber half way, green at its highest (amber when all are equal);
    NaN -> grey."""
    if math.isnan(value):
        return MISSING
    t = min(max((value - low) / (high - low) if high > low else 0.5, 0.0), 1.0)
    return _mix(REWARD_LOW, REWARD_MID, 2 * t) if t < 0.5 else _mix(REWARD_MID, REWARD_HIGH, 2 * t - 1)


def _lane_summary(record: dict, reward: float) -> str:
    """What the end of a response's lane says: reward, tool calls, finish reason."""
    calls = record.get("num_tool_calls")
    return " · ".join([f"reward {reward:.3g}" if np.isfinite(reward) else "no reward"]
                      + ([f"{int(calls)} call" + ("" if int(calls) == 1 else "s")] if calls is not None else [])
                      + ([str(record["finish_reason"])] if "finish_reason" in record else []))


def branch_tree_svg(tree: pd.DataFrame, marks: dict[int, tuple[np.ndarray, np.ndarray]], *, vmax: float,
                    selected: int | None = None) -> str:
    """One prompt's responses (``queries.branch_tree``) as an SVG tree: a lane per response along token
    positions, from its branch point (a root from 0) to its end; tool output grey and tool calls purple on it
    (``marks``: row -> (tool, tool_call) per position); at each branch point a dot on the parent's lane coloured
    by the token entropy there (``branch_token_entropy``; ``vmax`` as in the heatmaps) and labelled with
    it; at each end a dot coloured by the reward (``reward_colour``) and the reward, tool calls and finish
    reason. Every mark of a response is in a ``<g class="archer-tree-node" data-row=ROW>``; ``selected`` is
    highlighted."""
    n = len(tree)
    longest = max(int(tree["all_tokens"].max()) if n else 0, 1)
    span = TREE_WIDTH - TREE_LEFT - TREE_RIGHT
    height = TREE_TOP + n * TREE_LANE + 8

    def x(position: float) -> float:
        return round(TREE_LEFT + span * position / longest, 1)

    def bars(mask: np.ndarray, offset: int, y: int, name: str, fill: str) -> str:
        """A bar over each run of ``mask`` (positions from ``offset``) on the lane at ``y``."""
        return "".join(f'<rect class="archer-tree-{name}" x="{x(offset + a)}" y="{y - 5}" height="10" fill="{fill}" '
                       f'width="{max(x(offset + b) - x(offset + a), 1.5):.1f}"/>' for a, b in _runs(mask))

    lane = {int(r): TREE_TOP + i * TREE_LANE + TREE_LANE // 2 for i, r in enumerate(tree["row"])}
    rewards = tree["reward"].astype(np.float64).to_numpy() if "reward" in tree else np.full(n, np.nan)
    finite = rewards[np.isfinite(rewards)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {TREE_WIDTH} {height}" width="{TREE_WIDTH}" '
             f'height="{height}" data-responses="{n}">',
             f'<text x="{x(0)}" y="14" fill="#555">0</text>',
             f'<text x="{x(longest)}" y="14" fill="#555" text-anchor="end">{longest}</text>',
             f'<text x="{x(longest / 2)}" y="14" fill="#555" text-anchor="middle">token position</text>',
             f'<line x1="{x(0)}" y1="20" x2="{x(longest)}" y2="20" stroke="#ccc"/>']
    branch_marks = []
    for record, reward in zip(tree.to_dict("records"), rewards):
        row, y = int(record["row"]), lane[int(record["row"])]
        start, end = max(int(record["branch_position"]), 0), int(record["all_tokens"])
        tool, call = marks.get(row, (np.zeros(0, bool), np.zeros(0, bool)))
        summary = _lane_summary(record, reward)
        origin = (f"branched from #{record['parent']} (row {record['parent_row']}) at position {start}, "
                  f"token entropy {_number(record['branch_token_entropy'])} there"
                  if record["parent_row"] >= 0 else "a global sample")
        title = html.escape(f"#{record['sample_index']} · row {row} · {origin} · {end} tokens "
                            f"({record['tool_tokens']} of tool output) · {summary}")
        top = y - TREE_LANE // 2
        weight = ' font-weight="bold"' if row == selected else ""
        if row == selected:
            parts.append(f'<rect x="0" y="{top}" width="{TREE_WIDTH}" height="{TREE_LANE}" fill="#fff4c2"/>')
        parts.append(
            f'<g class="archer-tree-node" data-row="{row}"><title>{title}</title>'
            f'<rect x="0" y="{top}" width="{TREE_WIDTH}" height="{TREE_LANE}" fill="transparent"/>'
            f'<text x="8" y="{y + 4}"{weight}>#{record["sample_index"]} · row {row}</text>'
            f'<line class="archer-tree-line" x1="{x(start)}" y1="{y}" x2="{x(end)}" y2="{y}" stroke="#444" '
            'stroke-width="2"/>'
            + bars(tool[start:end], start, y, "tool", "#b0b0b0") + bars(call[start:end], start, y, "call", CALL)
            + f'<circle class="archer-tree-leaf" cx="{x(end)}" cy="{y}" r="6" stroke="#333" '
            f'fill="{reward_colour(reward, low, high)}"/>'
            f'<text x="{TREE_WIDTH - TREE_RIGHT + 14}" y="{y + 4}">{html.escape(summary)}</text></g>')
        if record["parent_row"] >= 0:
            joint = lane[int(record["parent_row"])]
            entropy = float(record["branch_token_entropy"])
            branch_marks.append(
                f'<g class="archer-tree-node" data-row="{row}"><title>{title}</title>'
                f'<line x1="{x(start)}" y1="{joint}" x2="{x(start)}" y2="{y}" stroke="#888" stroke-dasharray="3 2"/>'
                f'<circle class="archer-tree-branch" cx="{x(start)}" cy="{joint}" r="5" stroke="#000" '
                f'fill="{entropy_colour(entropy, vmax)}" data-entropy="{_number(entropy)}"/>'
                f'<text x="{x(start) + 6}" y="{joint - 7}" font-size="10">token entropy {entropy:.3g}</text>'
                '</g>')
    parts += branch_marks  # drawn last: on top of the lanes they join
    parts.append("</svg>")
    legend = ("Each line is one response along its token positions, from where it branched off (dashed, "
              "from the dot on its parent's line, coloured and labelled by the token entropy at the branch "
              "point: that of the branch's first token, in nats, not the windowed, normalised H the "
              "branching rule uses) to its end (the dot coloured by its reward: red the group's lowest, "
              "amber half way or all equal, green its highest). Grey: tool output; purple: tool calls. "
              "Click a response to open it.")
    return f'{TREE_CSS}<div class="archer-tree"><div class="archer-legend">{legend}</div>{"".join(parts)}</div>'


def curves_figure(table: pd.DataFrame) -> Figure:
    """Entropy (mean and percentiles), reward and influence statistics by step, one panel each."""
    groups = [("entropy", [c for c in ("entropy_mean", "entropy_p50", "entropy_p90", "entropy_p99") if c in table]),
              ("reward", [c for c in ("reward_mean",) if c in table]),
              ("influence", [c for c in ("influence_mean", "influence_p50", "influence_p90", "influence_p99")
                             if c in table])]
    groups = [(name, cols) for name, cols in groups if cols]
    fig = Figure(figsize=(10, 2.6 * max(len(groups), 1)), layout="constrained")
    if not groups:
        fig.text(0.5, 0.5, "no statistics in the manifest yet", ha="center")
        return fig
    axes = fig.subplots(len(groups), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, cols) in zip(axes, groups):
        for col in cols:
            ax.plot(table["step"], table[col], marker="o", markersize=3, label=col)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    axes[-1].set_xlabel("step")
    return fig


def histogram_figure(counts: np.ndarray, edges: np.ndarray, step: int) -> Figure:
    """Bar chart of an entropy histogram (counts per bin, log scale when counts span decades)."""
    fig = Figure(figsize=(10, 3.2), layout="constrained")
    ax = fig.subplots()
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#d62728", edgecolor="white")
    if counts.size and counts.max() > 0 and counts.max() > 100 * max(counts[counts > 0].min(), 1):
        ax.set_yscale("log")
    ax.set_xlabel("entropy (nats)")
    ax.set_ylabel("valid tokens")
    ax.set_title(f"step {step}: {int(counts.sum())} tokens")
    return fig
