"""plot_metrics: which PNG files are written from a metrics.jsonl, and that they are real images."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest

from archer.errors import ArcherError
from archer.trainer.plots import DEFAULT_GROUPS, Y_LABELS, figure, plot_metrics, read_series

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_metrics(path: Path) -> None:
    records = []
    for step in range(1, 7):
        record = {
            "step": step,
            "critic/score/mean": 0.1 * step,
            "actor/entropy": 2.0 - 0.1 * step,
            "actor/pg_loss": None if step == 3 else -0.01 * step,  # a NaN written as null
            "timing_s/gen": 1.0,
            "timing_s/update_actor": 2.0,
        }
        records.append(record)
        if step % 3 == 0:
            records.append({"step": step, "val-core/gsm8k/acc/mean@1": 0.2 * step / 3})
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 7, "critic/sc')


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width, channels = matplotlib.image.imread(path).shape
    assert (width, height) == (800, 450)  # figsize (8, 4.5) at dpi 100
    assert channels == 4


def test_default_groups_write_only_present_figures(tmp_path: Path) -> None:
    _write_metrics(tmp_path / "metrics.jsonl")
    written = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots")

    names = ["reward.png", "entropy.png", "losses.png", "timing.png"]
    assert written == [tmp_path / "plots" / name for name in names]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(names)
    for path in written:
        _assert_png(path)


def test_read_series_skips_nulls_and_torn_lines(tmp_path: Path) -> None:
    _write_metrics(tmp_path / "metrics.jsonl")
    series = read_series(tmp_path / "metrics.jsonl")
    assert sorted(series["actor/pg_loss"]) == [1, 2, 4, 5, 6]
    assert series["val-core/gsm8k/acc/mean@1"] == {3: pytest.approx(0.2), 6: pytest.approx(0.4)}
    assert 7 not in series["critic/score/mean"]
    assert "step" not in series


def test_custom_groups_with_patterns(tmp_path: Path) -> None:
    _write_metrics(tmp_path / "metrics.jsonl")
    groups = {"my/score": ["critic/*", "val-core/*"], "absent": ["actor/grad_norm"]}
    written = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "out", groups)
    assert written == [tmp_path / "out" / "my_score.png"]
    _assert_png(written[0])


def test_missing_metrics_file(tmp_path: Path) -> None:
    with pytest.raises(ArcherError, match="no metrics file"):
        plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots")


TIMING_STAGES = ["gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
                 "entropy_trace", "dump_rollout", "step"]


def _lines(fig) -> dict[str, object]:
    return {line.get_label(): line for line in fig.axes[0].get_lines()}


def test_eleven_timing_series_have_eleven_different_looks() -> None:
    series = {f"timing_s/{stage}": {1: 1.0 + i, 2: 2.0 + i} for i, stage in enumerate(TIMING_STAGES)}
    fig = figure("timing", series, sorted(series), 2, "seconds")
    looks = [(line.get_color(), line.get_linestyle()) for line in _lines(fig).values()]
    assert len(looks) == 11 and len(set(looks)) == 11
    assert fig.axes[0].get_xlabel() == "step" and fig.axes[0].get_ylabel() == "seconds"


def test_the_all_sources_line_stays_visible_over_an_equal_per_source_line() -> None:
    val = {0: 0.1, 2: 0.4, 4: 0.6}
    series = {"critic/score/mean": {s: 0.1 * s for s in range(1, 5)}, "val-core/archer/arithmetic/acc/mean@1": val,
              "val-core/all/acc/mean@1": dict(val), "val-core/all/acc/best@4/mean": {0: 0.3, 2: 0.5, 4: 0.7}}
    fig = figure("reward", series, sorted(series), 4, "score / accuracy")
    lines = _lines(fig)
    source, overall = lines["val-core/archer/arithmetic/acc/mean@1"], lines["val-core/all/acc/mean@1"]
    # The same points (one data source): the aggregate is drawn above, dashed, in another colour, hollow markers.
    assert list(source.get_ydata()) == list(overall.get_ydata())
    assert overall.get_zorder() > max(line.get_zorder() for k, line in lines.items() if "/all/" not in k)
    assert source.get_linestyle() == "-" and overall.get_linestyle() in ("--", "-.", ":")  # gaps show the line below
    assert overall.get_color() != source.get_color() and overall.get_markerfacecolor() == "none"
    looks = [(line.get_color(), line.get_linestyle()) for line in lines.values()]
    assert len(set(looks)) == len(looks) == 4


def test_every_default_figure_labels_both_axes(tmp_path: Path) -> None:
    series = {"critic/score/mean": {1: 0.5, 2: 0.6}}
    for group in DEFAULT_GROUPS:
        fig = figure(group, series, list(series), 2, Y_LABELS[group])
        assert fig.axes[0].get_xlabel() == "step" and fig.axes[0].get_ylabel() == Y_LABELS[group]
    assert fig.axes[0].get_title() == group
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/f1/mean": 0.5, "train/loss": 1.0}) + "\n")
    written = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots",
                           {**DEFAULT_GROUPS, "train_loss": ["train/loss"]})
    assert [p.name for p in written] == ["reward_extras.png", "train_loss.png"]
