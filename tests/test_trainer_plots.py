"""plot_metrics: which PNG files are written from a metrics.jsonl, that they are real images, and what each
figure draws: integer step ticks, the legend outside the axes, constant keys named instead of drawn, the timing
stack, validation extras and the tools panels."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from archer.errors import ArcherError
from archer.trainer.plots import (
    DEFAULT_GROUPS,
    Y_LABELS,
    figure,
    matching_keys,
    panel_figure,
    plot_metrics,
    read_series,
)

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
    return _lines_of(fig.axes[0])


def _legend_texts(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


def _assert_legend_outside(fig: Figure) -> None:
    """Every legend lies right of its axes' area, not over it."""
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    for ax in fig.axes:
        if ax.get_legend() is not None:
            box, area = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
            assert box.x0 > area.x1 and box.x1 <= fig.bbox.x1 + 1  # outside the axes, inside the figure


def test_timing_stacks_large_stages_under_the_step_total_and_groups_small_ones() -> None:
    large = {"gen": 10.0, "update_actor": 4.0, "old_log_prob": 1.5}  # step 2: 1 s more each; the rest 0.02 s each
    series = {f"timing_s/{stage}": {1: 0.01 * (i + 1), 2: 0.02} for i, stage in enumerate(TIMING_STAGES)}
    series |= {f"timing_s/{stage}": {1: seconds, 2: seconds + 1} for stage, seconds in large.items()}
    series["timing_s/step"] = {1: 16.5, 2: 19.5}
    series["timing_s/testing"] = {0: 3.0, 2: 2.0}
    fig = figure("timing", series, sorted(series), 2, "seconds")
    ax = fig.axes[0]
    bands = [band.get_label() for band in ax.collections]
    assert bands[:3] == ["gen", "update_actor", "old_log_prob"]  # largest first
    assert len(bands) == 4 and bands[3].startswith("other stages:")
    small = {"reward", "ref", "values", "adv", "update_critic", "entropy_trace", "dump_rollout"}
    assert set(bands[3].replace("other stages:", "").replace("\n", " ").replace(",", " ").split()) == small
    top = ax.collections[3].get_paths()[0].vertices[:, 1].max()  # the stack's top: all stages of step 2 summed
    assert top == pytest.approx(11.0 + 5.0 + 2.5 + 7 * 0.02)
    lines = _lines(fig)
    assert set(lines) == {"step (total)", "testing"}
    total = lines["step (total)"]
    assert total.get_color() == "black" and total.get_linewidth() >= 2 and list(total.get_ydata()) == [16.5, 19.5]
    assert lines["testing"].get_marker() == "s" and list(lines["testing"].get_xdata()) == [0, 2]
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "seconds"
    _assert_legend_outside(fig)


def test_step_axes_tick_only_whole_steps() -> None:
    series = {"actor/entropy": {s: 1.0 / s for s in range(1, 21)}, "timing_s/step": {s: 1.0 + s for s in range(1, 21)},
              "tools/calls_per_response": {s: 0.1 * s for s in range(1, 21)}}
    figures = [figure("entropy", series, ["actor/entropy"], 20, "nats"),
               figure("timing", series, ["timing_s/step"], 20, "seconds"),
               panel_figure("tools", series, {"per response": ["tools/calls_per_response"]}, 20)]
    for fig in figures:
        for ax in fig.axes:
            ticks = ax.get_xticks()
            assert len(ticks) >= 3 and all(float(t).is_integer() for t in ticks), ticks


def test_the_legend_is_outside_the_axes() -> None:
    series = {f"val-aux/archer/tool_arithmetic/extra_{i}/mean@1": {1: 0.1 * i, 2: 0.2 * i} for i in range(1, 9)}
    _assert_legend_outside(figure("reward_extras", series, sorted(series), 2, "mean"))


def test_keys_that_never_change_are_named_not_drawn() -> None:
    zeros = {key: {s: 0.0 for s in range(1, 6)} for key in ("actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_clipfrac_lower")}
    fig = figure("kl_clip", zeros, sorted(zeros), 5, "KL")
    ax = fig.axes[0]
    assert len(ax.get_lines()) == 0 and ax.get_legend() is None
    [note] = [text.get_text() for text in ax.texts]
    assert note.startswith("all zero:") and all(key in note for key in zeros)
    assert ax.get_xlim() == (0.5, 5.5)  # the steps the keys were logged at

    groups = {"train/num_candidate_groups": {s: 32.0 for s in range(1, 6)},
              "train/num_kept_groups": {s: 32.0 for s in range(1, 6)},
              "train/num_gen_batches": {s: float(s % 2 + 1) for s in range(1, 6)},
              "actor/ppo_kl": {1: 0.0}}  # one point is no constant: drawn
    fig = figure("group_sampling", groups, sorted(groups), 5, "prompt groups")
    assert set(_lines(fig)) == {"train/num_gen_batches", "actor/ppo_kl"}
    assert len(fig.axes[0].texts) == 0
    legend = _legend_texts(fig.axes[0])
    assert "constant 32:\ntrain/num_candidate_groups\ntrain/num_kept_groups" in legend
    _assert_legend_outside(fig)


def test_reward_extras_show_validation_extras_and_tools_get_their_panels(tmp_path: Path) -> None:
    records = []
    for step in range(1, 5):
        records.append({"step": step, "reward/used_tool/mean": 0.4 + 0.1 * step, "tools/python/calls": 100.0 + step,
                        "tools/python/failures": float(step % 2), "tools/python/mean_latency_s": 1.0 / step,
                        "tools/invalid_calls": 0.0, "tools/calls_per_response": 0.4 + 0.1 * step,
                        "tools/call_limit_reached": 0.01 * step})
        if step % 2 == 0:
            records.append({"step": step, "val-aux/archer/tool_arithmetic/used_tool/mean@1": step / 4,
                            "val-aux/all/used_tool/mean@1": step / 4, "val-core/all/acc/mean@1": step / 8})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots")
    assert [p.name for p in written] == ["reward.png", "reward_extras.png", "tools.png"]
    series = read_series(tmp_path / "metrics.jsonl")

    keys = matching_keys(DEFAULT_GROUPS["reward_extras"], list(series))
    lines = _lines(figure("reward_extras", series, keys, 4, Y_LABELS["reward_extras"]))
    assert set(lines) == {"reward/used_tool/mean", "val-aux/archer/tool_arithmetic/used_tool/mean@1",
                          "val-aux/all/used_tool/mean@1"}
    assert list(lines["val-aux/all/used_tool/mean@1"].get_ydata()) == [0.5, 1.0]

    panels = {label: matching_keys(patterns, list(series)) for label, patterns in DEFAULT_GROUPS["tools"].items()}
    fig = panel_figure("tools", series, panels, 4)
    calls, per_response, latency = fig.axes
    assert [ax.get_ylabel() for ax in fig.axes] == ["calls per step", "per response", "seconds per call"]
    assert set(_lines_of(calls)) == {"tools/python/calls", "tools/python/failures"}
    assert "all zero:\ntools/invalid_calls" in _legend_texts(calls)
    assert set(_lines_of(per_response)) == {"tools/calls_per_response", "tools/call_limit_reached"}
    assert set(_lines_of(latency)) == {"tools/python/mean_latency_s"}
    assert [ax.get_xlabel() for ax in fig.axes] == ["", "", "step"]
    _assert_legend_outside(fig)
    height, width, _ = matplotlib.image.imread(tmp_path / "plots" / "tools.png").shape
    assert (width, height) == (800, 780)  # three panels of 2.6 inches at dpi 100


def _lines_of(ax) -> dict[str, object]:
    return {line.get_label(): line for line in ax.get_lines()}


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
    for group, patterns in DEFAULT_GROUPS.items():
        if isinstance(patterns, dict):
            fig = panel_figure(group, series, {label: list(series) for label in patterns}, 2)
            assert [ax.get_ylabel() for ax in fig.axes] == list(patterns)
            assert fig.axes[-1].get_xlabel() == "step"
        else:
            fig = figure(group, series, list(series), 2, Y_LABELS[group])
            assert fig.axes[0].get_xlabel() == "step" and fig.axes[0].get_ylabel() == Y_LABELS[group]
        assert fig.axes[0].get_title() == group
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/f1/mean": 0.5, "train/loss": 1.0}) + "\n")
    written = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots",
                           {**DEFAULT_GROUPS, "train_loss": ["train/loss"]})
    assert [p.name for p in written] == ["reward_extras.png", "train_loss.png"]


def test_keys_with_the_same_points_share_one_labelled_line() -> None:
    groups = {"train/num_candidate_groups": {1: 32.0, 2: 64.0, 3: 32.0}, "train/num_kept_groups": {1: 32.0, 2: 64.0, 3: 32.0},
              "train/num_gen_batches": {1: 1.0, 2: 2.0, 3: 1.0}}
    lines = _lines(figure("group_sampling", groups, sorted(groups), 3, "prompt groups"))
    assert set(lines) == {"train/num_candidate_groups\n= train/num_kept_groups", "train/num_gen_batches"}
    assert list(lines["train/num_gen_batches"].get_ydata()) == [1.0, 2.0, 1.0]
