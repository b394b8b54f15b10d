"""Training curves: PNG figures drawn from a run's metrics.jsonl into `<run>/plots/`.

Each group of metric keys becomes one figure with a line per key over the steps where that key was logged,
both axes labelled, integer ticks on the step axis and the legend outside the axes (right), so it never
covers a line. Keys logged only at some steps (validation) are drawn with markers. No two lines of a figure
share a colour and line style; an aggregate over all data sources (``.../all/...``) is drawn in black,
dashed (then dash-dotted, dotted), with hollow markers and above the others, so a per-source line with the
same values never hides it; other keys with the same points share one line, labelled "a = b". A key logged
at two or more steps whose value never changes carries no curve: it is named ("all zero: ...", "constant 32:
...") under the legend's lines, or in the middle of the axes when nothing else is drawn, instead of drawn
over the others. Group entries are exact keys or glob patterns ("timing_s/*"); a group may be a dict of
panels (y label -> patterns), drawn one above the other on a shared step axis; a group none of whose keys
appear in the file gets no figure. ``timing`` is drawn as a stack of the stages under the step total (small
stages summed into one band). Figures are drawn on matplotlib's Agg canvas without pyplot, so no global
backend is switched.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping
from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from archer.errors import ArcherError
from archer.health.settings import CHECK_NAMES
from archer.step_lines import metrics_by_step

Group = list[str] | dict[str, list[str]]  # patterns, or panels: y label -> patterns

DEFAULT_GROUPS: dict[str, Group] = {
    "reward": ["critic/score/mean", "val-core/*", "val/*"],
    "entropy": ["actor/entropy"],
    "response_length": ["response_length/mean", "response_length/max", "response_length/min"],
    "kl_clip": ["actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/kl_loss"],
    "losses": ["actor/pg_loss", "critic/vf_loss"],
    "grad_norm": ["actor/grad_norm", "critic/grad_norm"],
    "timing": ["timing_s/*"],
    # the mechanisms of the entropy-aware methods and of DAPO (figures appear only when they are logged)
    "entropy_classes": ["actor/entropy_low_frac", "actor/entropy_high_frac", "actor/entropy_low_clipfrac",
                        "actor/entropy_high_clipfrac", "actor/top_entropy_selected_frac"],
    "token_selection": ["actor/cov_selected_tokens", "actor/top_entropy_selected_tokens"],
    "group_sampling": ["train/num_gen_batches", "train/num_candidate_groups", "train/num_kept_groups",
                       "train/num_rejected_groups"],
    "overlong": ["reward/overlong_penalised_frac", "reward/overlong_penalty_mean"],
    # the numeric extras a reward returns (f1, used_tool, ...), in training and in validation
    "reward_extras": ["reward/*/mean", "val-aux/*/mean@*"],
    # the gap between the engine's and the trainer's policy, and what the rollout correction did about it
    "rollout_correction": {"KL(rollout || train)": ["rollout_corr/kl", "rollout_corr/k3_kl"],
                           "IS weights": ["rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size"],
                           "share rejected": ["rollout_corr/rollout_rs_masked_fraction",
                                              "rollout_corr/rollout_rs_seq_masked_fraction"]},
    # how old the trained responses were (policy versions; 0 in the synchronous loop)
    "off_policy": ["training/off_policy/trajectory_staleness/mean", "training/off_policy/trajectory_staleness/max",
                   "training/off_policy/stale_fraction"],
    # an agentic run's tool use (archer/tools/executor.py tool_metrics, rollout_stats.py)
    "tools": {"calls per step": ["tools/*/calls", "tools/*/failures", "tools/invalid_calls",
                                 "tools/disallowed_calls"],
              "per response": ["tools/calls_per_response", "tools/call_limit_reached"],
              "seconds per call": ["tools/*/mean_latency_s"]},
    # the health checks' figures and what each check found (docs/health.md)
    "health": {"share": ["health/*_frac"], "log-prob/advantage covariance": ["health/logp_adv_cov"],
               "severity (1 info, 2 warning, 3 critical)": [f"health/{name}" for name in CHECK_NAMES]},
}
Y_LABELS = {  # a group without one is labelled with its own name
    "reward": "score / accuracy", "entropy": "entropy (nats per token)", "response_length": "tokens",
    "kl_clip": "KL / fraction of tokens", "losses": "loss", "grad_norm": "gradient norm", "timing": "seconds",
    "entropy_classes": "fraction of tokens", "token_selection": "tokens", "group_sampling": "prompt groups",
    "overlong": "fraction / penalty", "reward_extras": "mean over responses",
    "off_policy": "policy versions / fraction of responses",
}
COLOURS = colormaps["tab10"].colors
LINE_STYLES = ("-", "--", "-.", ":")  # with the 10 colours: 40 distinct lines before a pair repeats
AGGREGATE = "/all/"  # validation over all data sources
STEP_TOTAL = "timing_s/step"
OUTSIDE_STEP = ("timing_s/testing", "timing_s/health")  # validation and the health checks run outside the step's
# timer: not part of its stack
MAX_STAGE_BANDS = 6  # the largest stages get a band each; the rest share one "other stages" band
MIN_STAGE_SHARE = 0.05  # ... and so does any stage under this share of the step total
PANEL_HEIGHT = 2.6  # inches per panel of a figure of panels (at least the 4.5 inches of one figure)

Series = dict[str, dict[int, float]]


def read_series(metrics_path: Path) -> Series:
    """metrics.jsonl as {key: {step: value}}; null values and torn lines are skipped, later lines win."""
    if not metrics_path.is_file():
        raise ArcherError(
            f"no metrics file at {metrics_path}",
            "point at a run directory's metrics.jsonl (written by `archer train`)",
        )
    series: Series = {}
    for step, values in metrics_by_step(metrics_path).items():
        for key, value in values.items():
            series.setdefault(key, {})[step] = value
    return series


def matching_keys(patterns: list[str], keys: list[str]) -> list[str]:
    """Keys matched by the patterns, in pattern order then key order, each once."""
    matched = [key for pattern in patterns for key in sorted(keys) if fnmatchcase(key, pattern)]
    return list(dict.fromkeys(matched))


def _steps(series: Series, keys: list[str]) -> list[int]:
    """The steps at which any of ``keys`` was logged, in order."""
    return sorted({step for key in keys for step in series[key]})


def _constant(values: dict[int, float]) -> float | None:
    """The value of a series logged at two or more steps that never changes; None otherwise."""
    distinct = set(values.values())
    return distinct.pop() if len(values) > 1 and len(distinct) == 1 else None


def _finish(ax: Axes, ylabel: str, notes: list[str], steps: list[int], xlabel: bool = True) -> None:
    """Labels, integer step ticks, the legend outside the axes (right), and the notes naming the undrawn keys:
    in the legend under the lines, or in the middle of the axes when no line is drawn (over ``steps``)."""
    if xlabel:
        ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if not handles and notes:
        ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
        ax.set_yticks([])
        ax.text(0.5, 0.5, "\n".join(notes), transform=ax.transAxes, ha="center", va="center",
                bbox={"boxstyle": "round", "facecolor": "white"})
    elif handles:
        blank = [Line2D([], [], linestyle="none") for _ in notes]
        ax.legend(handles + blank, labels + notes, fontsize="x-small", loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _draw_lines(ax: Axes, series: Series, keys: list[str], dense_len: int) -> list[str]:
    """A line per changing key (see the module docstring); returns the notes naming the constant keys."""
    constant = {key: value for key in keys if (value := _constant(series[key])) is not None}
    same: dict[tuple[tuple[int, float], ...], list[str]] = {}  # per-source keys with equal points share a line
    for key in keys:
        if AGGREGATE not in key and key not in constant:
            same.setdefault(tuple(sorted(series[key].items())), []).append(key)
    for i, names in enumerate(same.values()):
        steps = sorted(series[names[0]])
        marker = "o" if len(steps) < dense_len else None
        ax.plot(steps, [series[names[0]][s] for s in steps], color=COLOURS[i % len(COLOURS)],
                linestyle=LINE_STYLES[i // len(COLOURS) % len(LINE_STYLES)], marker=marker, markersize=4,
                label="\n= ".join(names))
    for i, key in enumerate(key for key in keys if AGGREGATE in key and key not in constant):
        steps = sorted(series[key])
        ax.plot(steps, [series[key][s] for s in steps], color="black", linestyle=LINE_STYLES[(i + 1) % len(LINE_STYLES)],
                marker="s", markersize=7, markerfacecolor="none", zorder=3, label=key)
    by_value: dict[float, list[str]] = {}
    for key, value in constant.items():
        by_value.setdefault(value, []).append(key)
    return [f"{'all zero' if value == 0 else f'constant {value:g}'}:\n" + "\n".join(names)
            for value, names in by_value.items()]


def _draw_timing(ax: Axes, series: Series, keys: list[str]) -> None:
    """The stages stacked (largest first, small ones summed into one band) under the step total's line;
    stages outside the step (validation) as their own marked lines."""
    stages = [key for key in keys if key != STEP_TOTAL and key not in OUTSIDE_STEP]
    steps = sorted(series[STEP_TOTAL]) if STEP_TOTAL in keys else _steps(series, stages)
    if stages:
        columns = {key: np.array([series[key].get(s, 0.0) for s in steps]) for key in stages}
        reference = float(np.mean(list(series[STEP_TOTAL].values()))) if STEP_TOTAL in keys \
            else float(sum(c.mean() for c in columns.values()))
        ranked = sorted(stages, key=lambda key: -columns[key].mean())
        large = [key for key in ranked[:MAX_STAGE_BANDS] if columns[key].mean() >= MIN_STAGE_SHARE * reference]
        small = [key for key in ranked if key not in large]
        bands = [columns[key] for key in large]
        labels = [key.removeprefix("timing_s/") for key in large]
        if small:
            bands.append(sum(columns[key] for key in small))
            names = ", ".join(key.removeprefix("timing_s/") for key in small)
            labels.append(textwrap.fill(f"other stages: {names}", width=30))
        colours = [COLOURS[i % len(COLOURS)] for i in range(len(large))] + (["lightgrey"] if small else [])
        ax.stackplot(steps, *bands, labels=labels, colors=colours, alpha=0.85)
    if STEP_TOTAL in keys:
        ax.plot(steps, [series[STEP_TOTAL][s] for s in steps], color="black", linewidth=2.0, zorder=3,
                label="step (total)")
    for i, key in enumerate(key for key in keys if key in OUTSIDE_STEP):
        outside = sorted(series[key])
        ax.plot(outside, [series[key][s] for s in outside], color="black", linestyle=LINE_STYLES[i + 1],
                marker="s", markersize=5, markerfacecolor="none", zorder=3, label=key.removeprefix("timing_s/"))


def figure(title: str, series: Series, keys: list[str], dense_len: int, ylabel: str) -> Figure:
    """One single-panel figure of ``keys`` (``timing`` stacked; see the module docstring)."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    notes = [] if title == "timing" else _draw_lines(ax, series, keys, dense_len)
    if title == "timing":
        _draw_timing(ax, series, keys)
    ax.set_title(title)
    _finish(ax, ylabel, notes, _steps(series, keys))
    return fig


def panel_figure(title: str, series: Series, panels: dict[str, list[str]], dense_len: int) -> Figure:
    """One panel per (y label, keys) with keys, stacked on a shared step axis."""
    fig = Figure(figsize=(8, max(4.5, PANEL_HEIGHT * len(panels))), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for i, (ax, (ylabel, keys)) in enumerate(zip(axes, panels.items())):
        _finish(ax, ylabel, _draw_lines(ax, series, keys, dense_len), _steps(series, keys), i == len(axes) - 1)
    axes[0].set_title(title)
    return fig


def _file_name(group: str) -> str:
    return re.sub(r"[^\w.-]+", "_", group) + ".png"


def plot_metrics(metrics_path: Path, out_dir: Path, groups: Mapping[str, Group] | None = None) -> list[Path]:
    """Write one PNG per group (DEFAULT_GROUPS unless given) whose keys appear; return the written paths."""
    series = read_series(Path(metrics_path))
    dense_len = max((len(values) for values in series.values()), default=0)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for group, patterns in (DEFAULT_GROUPS if groups is None else groups).items():
        if isinstance(patterns, dict):
            panels = {label: keys for label, pats in patterns.items() if (keys := matching_keys(pats, list(series)))}
            fig = panel_figure(group, series, panels, dense_len) if panels else None
        else:
            keys = matching_keys(patterns, list(series))
            fig = figure(group, series, keys, dense_len, Y_LABELS.get(group, group)) if keys else None
        if fig is not None:
            path = out_dir / _file_name(group)
            fig.savefig(path, dpi=100)
            written.append(path)
    return written
