"""The health checks on synthetic metric streams and hand-built responses: the figures against hand computation,
the trend windows, one induced failure per check (flagged at a stated step, quiet on its healthy counterpart,
its pointers naming the responses that carry it), the engine's one-flag-per-condition rule, the settings'
errors and a resumed monitor. The checks of asynchronous runs are tested here only: archer has no asynchronous
mode yet, so their metric streams are verl's names, built by hand."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import numpy as np
import pytest
from health_support import flagged, make_rows, run_stream, settings
from omegaconf import OmegaConf

from archer.config.loader import load_config
from archer.errors import ArcherError
from archer.health import checks
from archer.health.engine import Flag, HealthEngine, generated_zero_share
from archer.health.figures import (
    FIGURES,
    repeated_ngrams,
    step_figures,
    token_covariance,
    zero_advantage_share,
)
from archer.health.history import History
from archer.health.monitor import HEALTH_FILE, HealthMonitor
from archer.health.rows import tool_calls
from archer.health.settings import HealthSettings, default_health_config

BASE = {"actor/entropy": 0.5, "critic/score/mean": 0.3, "critic/acc/mean": 0.3, "response_length/mean": 100.0,
        "response_length/clip_ratio": 0.0, "actor/ppo_kl": 0.001, "actor/pg_clipfrac": 0.01, "actor/grad_norm": 1.0,
        "health/zero_adv_group_frac": 0.3}


def stream(steps: int, **series: list[float]) -> list[dict[str, float]]:
    """``steps`` steps of BASE with each named series (key with / written as __) in place."""
    out = []
    for i in range(steps):
        metrics = dict(BASE)
        for key, values in series.items():
            metrics[key.replace("__", "/")] = values[i]
        out.append(metrics)
    return out


# -- figures -------------------------------------------------------------------------------------------------------
def test_figures_by_hand() -> None:
    rows = make_rows([[0.005, 0.5, 9.0], [0.001, 0.02, 0.009]], mask=[[1, 1, 0], [1, 1, 1]],
                     log_probs=[[-0.1, -2.0, 0.0], [-0.5, -1.0, -3.0]], advantages=[[1, 1, 0], [-1, -1, -1]],
                     uid=["a", "a"], reward=[1.0, 1.0])
    figures = step_figures(rows, near_deterministic_entropy=0.01, ngram=2)
    # learned entropies 0.005 0.5 | 0.001 0.02 0.009: three below 0.01
    assert figures["health/near_deterministic_frac"] == pytest.approx(3 / 5)
    # log-probs mean -1.32, advantages mean -0.2: terms 1.464 -0.816 -0.656 -0.256 1.344, mean 0.216
    assert figures["health/logp_adv_cov"] == pytest.approx(0.216)
    assert token_covariance(rows)[0].tolist() == pytest.approx([1.464, -0.816, 0.0])
    assert figures["health/zero_adv_group_frac"] == 1.0  # one group of two, both scored 1
    assert figures["health/repetition_frac"] == 0.0  # arange ids never repeat
    assert "health/repeated_call_frac" not in figures  # a run without tools


def test_zero_advantage_share_counts_groups_of_two_or_more() -> None:
    assert zero_advantage_share(np.array(["a", "a", "b", "b", "c"]), np.array([1.0, 1.0, 0.0, 1.0, 5.0])) == 0.5
    assert zero_advantage_share(np.array(["a", "b"]), np.array([1.0, 1.0])) is None  # n=1: no group to judge


def test_repeated_ngrams_by_hand_and_tool_output_breaks_them() -> None:
    rows = make_rows(np.zeros((2, 8)), responses=[[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 7, 0, 0, 0, 0]],
                     mask=[[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]])
    assert np.flatnonzero(repeated_ngrams(rows, 3)[0]).tolist() == [3, 4, 5]  # 123 231 312 come again
    assert step_figures(rows, near_deterministic_entropy=0.01, ngram=3)["health/repetition_frac"] == pytest.approx(
        (3 / 6 + 0 / 2) / 2)
    # tool output at position 3 (not learned): only the windows 0..2 and 4..6 are whole, and they match
    gap = make_rows(np.zeros((1, 7)), responses=[[1, 2, 3, 9, 1, 2, 3]], mask=[[1, 1, 1, 0, 1, 1, 1]])
    assert np.flatnonzero(repeated_ngrams(gap, 3)[0]).tolist() == [4]
    assert step_figures(gap, near_deterministic_entropy=0.01, ngram=3)["health/repetition_frac"] == 0.5


def test_tool_calls_and_the_repeated_call_share() -> None:
    tags = (("<python>", "</python>"), ("<search>", "</search>"))
    text = "a <python>x=1</python> <result>1</result> <search>q</search> <python>x=1</python> <python>y</python>"
    assert tool_calls(text, tags) == ["<python>x=1</python>", "<search>q</search>", "<python>x=1</python>",
                                      "<python>y</python>"]
    rows = make_rows(np.zeros((2, 2)), calls=[tool_calls(text, tags), []])
    assert step_figures(rows, near_deterministic_entropy=0.01, ngram=2)["health/repeated_call_frac"] == 1 / 4


def test_the_share_without_signal_counts_the_groups_dropped_before_the_batch() -> None:
    rejected = {"train/num_candidate_groups": 10.0, "train/num_kept_groups": 4.0}
    assert generated_zero_share(rejected, 0.5) == pytest.approx((6 + 0.5 * 4) / 10)
    assert generated_zero_share({**rejected, "train/num_kept_groups": 0.0}, None) == 1.0
    assert generated_zero_share({"train/num_candidate_groups": 4.0, "train/num_kept_groups": 4.0}, 0.25) == 0.25
    # metrics alone (a run replayed without its trace): all-zero advantages are 1, anything else unknown
    assert generated_zero_share({"critic/advantages/max": 0.0, "critic/advantages/min": 0.0}, None) == 1.0
    assert generated_zero_share({"critic/advantages/max": 1.2, "critic/advantages/min": -0.8}, None) is None


def test_trend_compares_the_last_window_with_step_one_then_with_the_window_horizon_steps_earlier() -> None:
    history = History(window=3, horizon=10)
    for step in range(1, 4):
        history.add(step, {"x": float(step)})
    assert history.trend("x") is None  # now's window would hold step 1
    history.add(4, {"x": 4.0})
    assert (history.trend("x").then, history.trend("x").now) == (1.0, 3.0)  # median of 2 3 4 against step 1
    for step in range(5, 15):
        history.add(step, {"x": float(step)})
    trend = history.trend("x")  # last step 14: then is the window ending at step 4 (2 3 4)
    assert (trend.then, trend.now, trend.ratio) == (3.0, 13.0, 13 / 3)
    assert history.before("x") == [float(s) for s in range(4, 14)]  # the 10 steps before the last


# -- one induced failure per check -----------------------------------------------------------------------------
def test_a_steady_healthy_stream_raises_nothing() -> None:
    rng = np.random.default_rng(0)
    noisy = {k: (v * (1 + 0.1 * rng.standard_normal(40))).tolist() for k, v in BASE.items()}
    engine, flags = run_stream(stream(40, **{k.replace("/", "__"): v for k, v in noisy.items()}))
    assert flags == [] and engine.history.steps == list(range(1, 41))


def test_entropy_collapse_info_then_warning_then_critical_with_the_covariance_tokens() -> None:
    entropy = [0.8, 0.8, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.02]
    near = [0.4, 0.4, 0.4, 0.45, 0.5, 0.55, 0.6, 0.7, 0.8, 0.9, 0.95]
    metrics = stream(11, actor__entropy=entropy, health__near_deterministic_frac=near,
                     health__logp_adv_cov=[0.05] * 11)
    # step 5: median(.8 .6 .5) = .6 = .75 x .8, covariance > 0; step 7: .4 = .5 x .8, share .4 -> .55;
    # step 11: .05 <= .1 x .8
    assert flagged(run_stream(metrics)[1]) == [(5, "entropy_collapse", "info"), (7, "entropy_collapse", "warning"),
                                               (11, "entropy_collapse", "critical")]
    mastering = [{**m, "critic/acc/mean": 0.3 + 0.05 * i} for i, m in enumerate(metrics)]  # accuracy still rising
    assert flagged(run_stream(mastering)[1]) == [(5, "entropy_collapse", "info")]
    # the tokens that drive it: response 1's confident tokens (log-prob ~0) with a positive advantage
    rows = make_rows(np.full((4, 4), 0.001), log_probs=[[-2] * 4, [-0.01] * 4, [-2] * 4, [-2] * 4],
                     advantages=[[1] * 4, [1] * 4, [-1] * 4, [-1] * 4], row=[10, 11, 12, 13])
    flags = run_stream(metrics[:7], rows={7: rows})[1]
    warning = flags[-1]
    assert (warning.step, warning.severity) == (7, "warning")
    assert warning.figures["logp_adv_cov"] > 0
    assert [p.row for p in warning.pointers][:3] == [11, 12, 13]  # 1.4925, then the negative-advantage unsure
    assert warning.pointers[0].positions == [0, 1, 2] and warning.pointers[0].value == pytest.approx(1.4925)


def test_entropy_blowup_on_the_issue_numbers_and_not_when_accuracy_rises() -> None:
    # steps 1-4 of the quickstart model with lr 3e-4, clip ratios 10 and 4 PPO epochs (BENCHMARKS.md)
    metrics = stream(4, actor__entropy=[0.1054, 0.1719, 0.1864, 0.1769], critic__acc__mean=[0.238, 0.102, 0.078, 0.133],
                     response_length__mean=[20.46, 20.91, 22.14, 22.0])
    rows = make_rows([[0.1, 0.1, 0.1], [0.2, 0.1, 0.1], [2.0, 3.0, 0.5], [0.1, 0.1, 0.1], [0.3, 0.1, 0.1],
                      [1.0, 0.2, 4.0]], row=[0, 1, 2, 3, 4, 5])
    flags = run_stream(metrics, rows={4: rows})[1]
    assert flagged(flags) == [(4, "entropy_blowup", "critical")]  # x1.68, accuracy .238 -> .102
    assert [p.row for p in flags[0].pointers][:2] == [2, 5]  # the highest mean entropy
    assert flags[0].pointers[0].positions == [0, 1, 2] and flags[1:] == []
    exploring = stream(6, actor__entropy=[0.1, 0.1, 0.1, 0.2, 0.2, 0.2], critic__acc__mean=[0.2, 0.2, 0.2, 0.4, 0.4, 0.4])
    assert run_stream(exploring)[1] == []


def test_length_hacking_points_at_the_longest_wrong_responses_and_spares_a_run_that_learns() -> None:
    metrics = stream(6, response_length__mean=[4, 4, 4, 5, 6, 6], critic__score__mean=[0.3, 0.3, 0.3, 0.35, 0.4, 0.45])
    rows = make_rows(np.zeros((4, 8)), mask=[[1] * 8, [1] * 3 + [0] * 5, [1] * 8, [1] * 6 + [0] * 2], acc=[0, 1, 1, 0])
    flags = [f for f in run_stream(metrics, rows={6: rows})[1] if f.check == "length_hacking"]
    assert flagged(flags) == [(6, "length_hacking", "warning")]  # median(5 6 6) = 1.5 x 4, accuracy flat
    assert [(p.row, p.positions) for p in flags[0].pointers] == [(0, [4, 5, 6, 7]), (3, [4, 5])]  # past then's 4
    learning = stream(6, response_length__mean=[4, 4, 4, 5, 6, 6], critic__acc__mean=[0.3, 0.3, 0.3, 0.4, 0.5, 0.5])
    assert run_stream(learning)[1] == []
    truncated = stream(6, response_length__clip_ratio=[0, 0, 0, 0.1, 0.3, 0.3])
    assert flagged(run_stream(truncated)[1]) == [(6, "length_hacking", "warning")]  # median(.1 .3 .3) >= .2
    collapsing = stream(6, response_length__clip_ratio=[0, 0, 0, 0.6, 0.6, 0.6],
                        critic__acc__mean=[0.3, 0.3, 0.3, 0.2, 0.2, 0.2], critic__score__mean=[0.3] * 6)
    assert flagged(run_stream(collapsing)[1]) == [(5, "length_hacking", "critical")]


def test_reward_hacking_by_the_score_by_an_extra_and_by_validation() -> None:
    score = stream(5, critic__score__mean=[0.3, 0.3, 0.3, 0.4, 0.5])
    rows = make_rows(np.zeros((4, 2)), reward=[0.9, 0.8, 0.95, 0.1], acc=[0, 0, 1, 0])
    flags = run_stream(score, rows={5: rows})[1]
    assert flagged(flags) == [(5, "reward_hacking", "warning")]
    assert [p.row for p in flags[0].pointers] == [0, 1, 3]  # highest reward among the wrong ones
    falling = stream(5, critic__score__mean=[0.3, 0.3, 0.3, 0.4, 0.5], critic__acc__mean=[0.3, 0.3, 0.3, 0.15, 0.1])
    assert flagged(run_stream(falling)[1]) == [(5, "reward_hacking", "critical")]
    extra = stream(5, reward__format__mean=[0.0, 0.0, 0.0, 0.5, 0.6])
    rows = make_rows(np.zeros((3, 2)), acc=[1, 0, 0], extras={"format": [1.0, 1.0, 0.0]})
    flags = run_stream(extra, rows={5: rows})[1]
    assert flagged(flags) == [(5, "reward_hacking", "warning")] and "reward extra format 0 -> 0.5" in flags[0].message
    assert [p.row for p in flags[0].pointers] == [1, 2]  # highest format among the wrong ones
    # training accuracy and score rise, validation falls by 0.1 between its two points
    val = stream(10, critic__score__mean=[0.3] * 3 + [0.35, 0.4, 0.4, 0.45, 0.45, 0.45, 0.45],
                 critic__acc__mean=[0.3] * 3 + [0.35, 0.4, 0.4, 0.45, 0.45, 0.45, 0.45])
    val[-1]["val-core/arith/acc/mean@1"] = 0.4
    engine = HealthEngine(settings())
    engine.step(0, {"val-core/arith/acc/mean@1": 0.5}, None)
    flags = [f for s, m in enumerate(val, start=1) for f in engine.step(s, m, None)[1]]
    assert flagged(flags) == [(10, "reward_hacking", "warning")]
    assert flags[0].figures == {"val_acc_then": 0.5, "val_acc_now": 0.4, "score_then": 0.3, "score_now": 0.45}


def test_tool_abuse_calls_without_accuracy_repeated_calls_and_the_call_limit() -> None:
    calls = stream(5, tools__calls_per_response=[1.0, 1.0, 1.0, 2.0, 2.5])
    assert flagged(run_stream(calls)[1]) == [(5, "tool_abuse", "warning")]  # median(1 2 2.5) - 1 >= 0.5
    learning = stream(5, tools__calls_per_response=[0.45, 0.5, 0.6, 0.9, 1.0],
                      critic__acc__mean=[0.45, 0.5, 0.6, 0.9, 1.0])  # the tool quickstart: calls pay
    assert run_stream(learning)[1] == []
    limit = stream(5, tools__call_limit_reached=[0.0, 0.0, 0.0, 0.9, 0.9])
    assert flagged(run_stream(limit)[1]) == [(5, "tool_abuse", "critical")]
    repeated = stream(3, health__repeated_call_frac=[0.5, 0.5, 0.5])
    assert flagged(run_stream(repeated)[1]) == [(3, "tool_abuse", "warning")]
    loop = ["<python>print(1)</python>"]
    rows = make_rows(np.zeros((3, 2)), calls=[loop * 3, loop + ["<python>print(2)</python>"], loop * 2])
    flags = run_stream(repeated[:2] + [BASE], rows={3: rows})[1]
    assert [(p.row, p.value) for p in flags[0].pointers] == [(0, 2.0), (2, 1.0)]  # the most repeated calls


def test_no_signal_warning_then_critical_and_its_pointers_one_per_alike_group() -> None:
    metrics = stream(7, health__zero_adv_group_frac=[0.5, 0.95, 0.95, 0.95, 1.0, 1.0, 1.0])
    assert flagged(run_stream(metrics)[1]) == [(3, "no_signal", "warning"), (7, "no_signal", "critical")]
    rows = make_rows(np.zeros((6, 2)), uid=["a", "a", "b", "b", "c", "c"], reward=[1, 1, 0, 1, 0, 0])
    flags = run_stream(metrics[:2] + [{**BASE, "train/num_candidate_groups": 10.0, "train/num_kept_groups": 3.0}],
                       rows={3: rows})[1]
    # step 3: 7 of 10 groups dropped before the batch, 2 of its 3 scored alike: (7 + 2) / 10
    assert flags[0].figures == {"zero_adv_group_frac": 0.9}
    assert sorted(p.row for p in flags[0].pointers) == [0, 4]  # one response of groups a and c


def test_instability_spikes_skipped_steps_and_the_ratio() -> None:
    spike = stream(5, actor__grad_norm=[1.0, 1.1, 0.9, 1.0, 12.0])
    flags = run_stream(spike)[1]
    assert flagged(flags) == [(5, "instability", "warning")] and "actor/grad_norm 12 is 12x" in flags[0].message
    assert flagged(run_stream(stream(5, actor__grad_norm=[1.0, 1.1, 0.9, 1.0, 150.0]))[1]) == [
        (5, "instability", "critical")]
    # the KL loss to the reference grows from 0: a spike counts only from kl_loss_floor (0.05) up
    assert run_stream(stream(5, actor__kl_loss=[0.001, 0.001, 0.0012, 0.0013, 0.017]))[1] == []
    assert flagged(run_stream(stream(5, actor__kl_loss=[0.004, 0.005, 0.005, 0.006, 0.06]))[1]) == [
        (5, "instability", "warning")]
    skipped = stream(2)
    skipped[1]["actor/skipped_steps"] = 1.0
    assert flagged(run_stream(skipped)[1]) == [(2, "instability", "critical")]
    assert flagged(run_stream(stream(3, actor__ppo_kl=[0.1, 0.1, 0.1]))[1]) == [(3, "instability", "warning")]
    assert flagged(run_stream(stream(3, actor__pg_clipfrac=[0.4, 0.4, 0.4]))[1]) == [(3, "instability", "warning")]
    rows = make_rows(np.zeros((2, 3)), log_probs=[[-0.01, -3.0, -0.5], [-1.0, -1.0, -1.0]],
                     advantages=[[2.0, 2.0, 2.0], [0.5, 0.5, 0.5]])
    pointers = run_stream(spike, rows={5: rows})[1][0].pointers
    assert [(p.row, p.positions) for p in pointers] == [(0, [0, 1, 2]), (1, [0, 1, 2])]
    assert pointers[0].value == pytest.approx(2 * (1 - np.exp(-3.0)))  # |A| (1 - p) of the unlikely token


def test_staleness_and_importance_weights_read_verls_names_and_are_silent_without_them() -> None:
    assert run_stream(stream(10))[1] == []  # a synchronous run logs neither family
    stale = stream(4, training__off_policy__trajectory_staleness__mean=[1.0, 3.0, 3.0, 9.0],
                   training__off_policy__trajectory_staleness__max=[2.0, 4.0, 4.0, 12.0])
    assert flagged(run_stream(stale)[1]) == [(3, "staleness", "warning")]  # escalates when the mean reaches 8:
    late = stale + stream(2, training__off_policy__trajectory_staleness__mean=[9.0, 9.0],
                          training__off_policy__trajectory_staleness__max=[12.0, 12.0])
    assert flagged(run_stream(late)[1]) == [(3, "staleness", "warning"), (5, "staleness", "critical")]
    only_max = stream(3, training__off_policy__trajectory_staleness__max=[1.0, 1.0, 8.0])
    assert flagged(run_stream(only_max)[1]) == [(3, "staleness", "warning")]
    weights = stream(6, rollout_corr__rollout_is_eff_sample_size=[0.9, 0.4, 0.4, 0.4, 0.1, 0.1],
                     rollout_corr__rollout_is_mean=[1.0] * 6)
    assert flagged(run_stream(weights)[1]) == [(3, "importance_weights", "warning"),
                                               (6, "importance_weights", "critical")]
    drift = stream(3, rollout_corr__rollout_is_mean=[1.3, 1.3, 1.3])
    assert flagged(run_stream(drift)[1]) == [(3, "importance_weights", "warning")]
    masked = stream(3, rollout_corr__rollout_rs_masked_fraction=[0.6, 0.6, 0.6])
    assert flagged(run_stream(masked)[1]) == [(3, "importance_weights", "critical")]


# -- the engine, the settings, the monitor -----------------------------------------------------------------------
def test_a_lasting_condition_is_one_flag_that_rearms_after_window_quiet_steps_and_escalates() -> None:
    kl = [0, 0, 0.1, 0.1, 0.1, 0.1, 0, 0, 0, 0, 0.1, 0.1]
    engine, flags = run_stream(stream(12, actor__ppo_kl=kl))
    # step 4: median(0 .1 .1); steps 5-7 still (one flag); steps 8-10 quiet (re-armed); step 12 again
    assert flagged(flags) == [(4, "instability", "warning"), (12, "instability", "warning")]
    grad = stream(7, actor__ppo_kl=[0, 0, 0.1, 0.1, 0.1, 0.1, 0.1], actor__grad_norm=[1, 1, 1, 1, 1, 1, 150])
    assert flagged(run_stream(grad)[1]) == [(4, "instability", "warning"), (7, "instability", "critical")]
    values = run_stream(stream(12, actor__ppo_kl=kl))[0].history.values
    assert values[12]["actor/ppo_kl"] == 0.1


def test_flag_lines_and_records() -> None:
    flags = run_stream(stream(5, actor__grad_norm=[1.0, 1.1, 0.9, 1.0, 12.0]),
                       rows={5: make_rows(np.zeros((1, 1)), advantages=[[1.0]], log_probs=[[-1.0]], row=[7])})[1]
    flag = flags[0]
    assert flag.line() == ("instability at step 5 (warning): actor/grad_norm 12 is 12x its median of the last 4 "
                           "steps; responses 7 of the step carry it")
    record = flag.to_json()
    assert set(record) == {"step", "check", "severity", "message", "figures", "pointers"}
    assert record["pointers"] == [{"row": 7, "uid": "g0", "value": pytest.approx(1 - np.exp(-1.0)),
                                   "why": "largest policy-gradient weight |advantage| x (1 - p)", "positions": [0]}]
    assert Flag.from_json(json.loads(json.dumps(record))).to_json() == record


@pytest.mark.parametrize(("key", "value", "message"), [
    ("stop_on", "sometimes", "trainer.health.stop_on='sometimes' is not null, warning or critical"),
    ("window", 0, "trainer.health.window=0 must be an integer of at least 1"),
    ("pointers", -1, "trainer.health.pointers=-1 must be an integer of at least 0"),
    ("entropy_blowup.ratio", -1.5, "trainer.health.entropy_blowup.ratio=-1.5 must be a finite number of at least 0"),
    ("no_signal.warning", True, "trainer.health.no_signal.warning=True must be a finite number"),
])
def test_bad_settings_name_their_key(key: str, value: object, message: str) -> None:
    node = default_health_config()
    OmegaConf.update(node, key, value)
    with pytest.raises(ArcherError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HealthSettings.from_config(node)


def test_the_config_check_refuses_a_bad_health_setting_before_anything_loads() -> None:
    from archer.trainer.config_check import check_config

    cfg = load_config("ppo_trainer", ["actor_rollout_ref.model.path=/m", "data.train_files=/t.parquet",
                                      "trainer.health.stop_on=always"])
    with pytest.raises(ArcherError, match="trainer.health.stop_on='always'"):
        check_config(cfg)
    assert settings(stop_on="warning").stops_at("critical") and not settings(stop_on="critical").stops_at("warning")
    assert not settings().stops_at("critical")


def test_a_resumed_monitor_drops_later_flags_and_keeps_each_checks_state(tmp_path: Path) -> None:
    cfg = load_config("ppo_trainer", ["actor_rollout_ref.model.path=/m", "data.train_files=/t.parquet"])
    metrics = stream(6, actor__ppo_kl=[0, 0, 0.1, 0.1, 0.1, 0.1])
    first = HealthMonitor(cfg, tmp_path, start_step=0)
    assert first.check(0, {"val-core/all/acc/mean@1": 0.5}) == {}  # step 0's line keeps validation's keys alone
    lines = []
    for step, m in enumerate(metrics, start=1):
        lines.append(json.dumps({"step": step, **m, **first.check(step, m)}) + "\n")
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    assert [json.loads(x)["step"] for x in (tmp_path / HEALTH_FILE).read_text().splitlines()] == [4]
    resumed = HealthMonitor(cfg, tmp_path, start_step=3)  # the checkpoint of step 3: the flag of step 4 goes
    assert (tmp_path / HEALTH_FILE).read_text() == ""
    out = {}
    for step, m in enumerate(metrics[3:], start=4):
        out[step] = resumed.check(step, m)
    assert [json.loads(x)["step"] for x in (tmp_path / HEALTH_FILE).read_text().splitlines()] == [4]  # raised again
    assert out[4]["health/instability"] == 2.0 and out[4]["health/flags"] == 1.0 and out[5]["health/flags"] == 0.0
    assert out[4]["timing_s/health"] > 0
    again = HealthMonitor(cfg, tmp_path, start_step=5)  # resumed after the flag: the state says it was raised
    assert again.engine.state["instability"] == 2 and again.check(6, metrics[5])["health/flags"] == 0.0


# -- the metric names the checks read -----------------------------------------------------------------------------
METRIC_NAME = re.compile(r"^[a-z_]+(/[a-z_]+)+$")


def test_the_checks_name_metrics_only_through_module_constants() -> None:
    """No metric name written inside a check: each is one constant of checks.py (or figures.py's), so that the
    test below sees every name a check reads."""
    tree = ast.parse(Path(checks.__file__).read_text(encoding="utf-8"))
    inline = [node.value for fn in tree.body if isinstance(fn, ast.FunctionDef | ast.ClassDef)
              for node in ast.walk(fn) if isinstance(node, ast.Constant) and isinstance(node.value, str)
              and METRIC_NAME.match(node.value)]
    assert inline == []


def test_every_health_figure_a_check_reads_is_produced_by_step_figures() -> None:
    read = {v for v in vars(checks).values() if isinstance(v, str) and v.startswith("health/")}
    assert read == set(FIGURES)
    rows = make_rows([[0.001, 2.0], [0.5, 0.5]], uid=["g", "g"], reward=[1.0, 1.0], calls=[["a", "a"], ["b"]])
    assert read <= set(step_figures(rows, near_deterministic_entropy=0.01, ngram=2))
