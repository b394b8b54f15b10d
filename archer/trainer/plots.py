"""Training curves: PNG figures drawn from a run's metrics.jsonl into `<run>/plots/`.

Each group of metric keys becomes one figure with a line per key over the steps where that key was
logged, both axes labelled. Keys logged only at some steps (validation) are drawn with markers. No two lines
of a figure share a colour and line style; an aggregate over all data sources (``.../all/...``) is drawn in
black, dashed (then dash-dotted, dotted), with hollow markers and above the others, so a per-source line with the same values never
hides it. Group entries are exact keys or glob patterns ("timing_s/*"); a group none of whose keys appear in
the file gets no figure. Figures are drawn on matplotlib's Agg canvas without pyplot, so no global backend
is switched.
"""

from __future__ import annotations

import json
import re
from fnmatch import fnmatchcase
from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure

from archer.errors import ArcherError

DEFAULT_GROUPS: dict[str, list[str]] = {
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
    "reward_extras": ["reward/*/mean"],  # the numeric extras a reward returns (f1, format_ok, ...)
}
Y_LABELS = {  # a group without one is labelled with its own name
    "reward": "score / accuracy", "entropy": "entropy (nats per token)", "response_length": "tokens",
    "kl_clip": "KL / fraction of tokens", "losses": "loss", "grad_norm": "gradient norm", "timing": "seconds",
    "entropy_classes": "fraction of tokens", "token_selection": "tokens", "group_sampling": "prompt groups",
    "overlong": "fraction / penalty", "reward_extras": "mean over responses",
}
COLOURS = colormaps["tab10"].colors
LINE_STYLES = ("-", "--", "-.", ":")  # with the 10 colours: 40 distinct lines before a pair repeats
AGGREGATE = "/all/"  # validation over all data sources

Series = dict[str, dict[int, float]]


def read_series(metrics_path: Path) -> Series:
    """metrics.jsonl as {key: {step: value}}; null values and torn lines are skipped, later lines win."""
    if not metrics_path.is_file():
        raise ArcherError(
            f"no metrics file at {metrics_path}",
            "point at a run directory's metrics.jsonl (written by `archer train`)",
        )
    series: Series = {}
    for line in metrics_path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int):
            continue
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, {})[step] = float(value)
    return series


def _matching_keys(patterns: list[str], keys: list[str]) -> list[str]:
    """Keys matched by the patterns, in pattern order then key order, each once."""
    matched = [key for pattern in patterns for key in sorted(keys) if fnmatchcase(key, pattern)]
    return list(dict.fromkeys(matched))


def figure(title: str, series: Series, keys: list[str], dense_len: int, ylabel: str) -> Figure:
    """One figure; a key with fewer points than the most-logged key (validation) gets markers."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    others = [key for key in keys if AGGREGATE not in key]
    for i, key in enumerate(others):
        steps = sorted(series[key])
        marker = "o" if len(steps) < dense_len else None
        ax.plot(steps, [series[key][s] for s in steps], color=COLOURS[i % len(COLOURS)],
                linestyle=LINE_STYLES[i // len(COLOURS) % len(LINE_STYLES)], marker=marker, markersize=4, label=key)
    for i, key in enumerate(key for key in keys if AGGREGATE in key):
        steps = sorted(series[key])
        ax.plot(steps, [series[key][s] for s in steps], color="black", linestyle=LINE_STYLES[(i + 1) % len(LINE_STYLES)],
                marker="s", markersize=7, markerfacecolor="none", zorder=3, label=key)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _file_name(group: str) -> str:
    return re.sub(r"[^\w.-]+", "_", group) + ".png"


def plot_metrics(metrics_path: Path, out_dir: Path, groups: dict[str, list[str]] | None = None) -> list[Path]:
    """Write one PNG per group (DEFAULT_GROUPS unless given) whose keys appear; return the written paths."""
    series = read_series(Path(metrics_path))
    dense_len = max((len(values) for values in series.values()), default=0)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for group, patterns in (DEFAULT_GROUPS if groups is None else groups).items():
        keys = _matching_keys(patterns, list(series))
        if keys:
            path = out_dir / _file_name(group)
            figure(group, series, keys, dense_len, Y_LABELS.get(group, group)).savefig(path, dpi=100)
            written.append(path)
    return written
