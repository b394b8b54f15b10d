"""The report of an ``archer eval``: a markdown table and a bar chart, drawn from results.json's figures.

One table row per benchmark and one "overall" row (every problem pooled): problems, what scored it (the rule
reward or the judge), mean@n (pass@1 as avg@n), pass@k and maj@k for each k, for QA sets the token F1 and
exact match (EM) the QA reward reports, and with tools the mean tool calls per sample; under the table, the
samples a judge could not grade (graded not correct). The chart draws mean@n, pass@k and maj@k of the largest k per benchmark
(matplotlib's Agg canvas, no pyplot).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

OVERALL = "all"


def _figure(metrics: dict[str, float], source: str, name: str) -> float | None:
    return metrics.get(f"val-core/{source}/acc/{name}")


def _columns(n: int, ks: list[int]) -> list[tuple[str, str]]:
    """(header, metric name) of the accuracy columns; with n = 1 only mean@1."""
    columns = [(f"mean@{n}", f"mean@{n}")]
    if n > 1:
        columns += [(f"pass@{k}", f"pass@{k}") for k in ks] + [(f"maj@{k}", f"maj@{k}/mean") for k in ks]
    return columns


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def results_table(results: dict[str, Any]) -> str:
    """The markdown table of results.json (accuracies in percent)."""
    metrics, n, ks = results["metrics"], int(results["n"]), list(results["k"])
    columns = _columns(n, ks)
    tools = any(f"/num_tool_calls/mean@{n}" in key for key in metrics)
    header = ["benchmark", "problems", "scored by", *(c for c, _ in columns), "F1", "EM",
              *(["tool calls"] if tools else [])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = [(name, info["problems"], info["scored_by"]) for name, info in results["benchmarks"].items()]
    rows.append((OVERALL, sum(info["problems"] for info in results["benchmarks"].values()), "-"))
    for source, problems, scored_by in rows:
        cells = [_cell(_figure(metrics, source, name)) for _, name in columns]
        f1 = metrics.get(f"val-aux/{source}/f1/mean@{n}")
        em = metrics.get(f"val-aux/{source}/rule_acc/mean@{n}", _figure(metrics, source, f"mean@{n}"))
        em = em if f1 is not None else None  # the QA reward's exact match (the rule's acc when a judge scored)
        calls = metrics.get(f"val-aux/{source}/num_tool_calls/mean@{n}")
        tool_cell = ([] if not tools else ["-" if calls is None else f"{calls:.2f}"])
        lines.append("| " + " | ".join([source, str(problems), scored_by, *cells, _cell(f1), _cell(em), *tool_cell])
                     + " |")
    ungraded = {name: info["judge_ungraded"] for name, info in results["benchmarks"].items()
                if info.get("judge_ungraded")}
    if ungraded:
        lines.append("\nThe judge could not grade " + ", ".join(f"{n} sample(s) of {name}" for name, n in ungraded.items())
                     + ": graded not correct (samples.jsonl's judge_error says why).")
    note = (f"\nAccuracy in %, {n} sample(s) per problem; mean@{n} is pass@1 as avg@{n}; pass@k is the unbiased "
            "estimator; maj@k votes over normalised answers (ties: the answer seen first). F1/EM: QA sets only"
            + ("; tool calls: mean per sample" if tools else "") + ".\n")
    return "\n".join(lines) + "\n" + note


def plot_results(results: dict[str, Any], path: Path) -> None:
    """Grouped bars per benchmark (and overall): mean@n, and with n > 1 pass@k and maj@k of the largest k."""
    metrics, n, ks = results["metrics"], int(results["n"]), list(results["k"])
    names = [*results["benchmarks"], OVERALL]
    series = [(f"mean@{n}", f"mean@{n}")]
    if n > 1:
        series += [(f"pass@{ks[-1]}", f"pass@{ks[-1]}"), (f"maj@{ks[-1]}", f"maj@{ks[-1]}/mean")]
    fig = Figure(figsize=(max(5.0, 1.4 * len(names) + 2), 4.0))
    ax = fig.add_subplot()
    width = 0.8 / len(series)
    x = np.arange(len(names))
    for j, (label, name) in enumerate(series):
        values = [100 * (_figure(metrics, source, name) or 0.0) for source in names]
        bars = ax.bar(x + (j - (len(series) - 1) / 2) * width, values, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(x, names)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{Path(results['model']).name}: {n} sample(s) per problem")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
