"""`archer health RUN_DIR` on stored runs: one made before the checks existed (tests/fixtures/health/README.md says
how), with and without its trace, with thresholds changed on the command line and through a quickstart folder;
bad input; and the healthy quickstarts (their stored metrics, bench/health_quickstarts.py), on which the checks
of the day must raise no warning."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from archer import cli
from archer.health.offline import replay
from archer.step_lines import read_step_records

FIXTURES = Path(__file__).parent / "fixtures" / "health"
PRE_HEALTH_RUN = FIXTURES / "pre_health_run"
QUICKSTARTS = sorted((FIXTURES / "quickstarts").glob("*_seed*"))


def test_archer_health_reads_a_run_made_before_the_checks() -> None:
    assert not (PRE_HEALTH_RUN / "health.jsonl").exists()
    proc = subprocess.run([sys.executable, "-m", "archer.cli", "health", str(PRE_HEALTH_RUN)], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == (f"archer health: {PRE_HEALTH_RUN} (4 training steps; pointers and figures from "
                        f"{PRE_HEALTH_RUN / 'entropy_trace'})")
    assert lines[1].startswith("no learning signal at step 3 (critical): 100% of the prompt groups scored alike")
    assert lines[2] == "    response 0 (prompt group 3-0): reward its whole group shares 1"
    assert lines[-1] == "1 flag(s): 1 critical, 0 warning, 0 info"


def test_the_json_report_and_a_replay_from_the_metrics_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["health", str(PRE_HEALTH_RUN), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 4 and report["trace"] == str(PRE_HEALTH_RUN / "entropy_trace")
    (flag,) = report["flags"]
    assert (flag["step"], flag["check"], flag["severity"], flag["figures"]) == (
        3, "no_signal", "critical", {"zero_adv_group_frac": 1.0})
    # one response of each of the 4 prompt groups (4 responses each), all scored 1
    assert [(p["row"], p["uid"], p["value"]) for p in flag["pointers"]] == [
        (0, "3-0", 1.0), (4, "3-1", 1.0), (8, "3-2", 1.0), (12, "3-3", 1.0)]
    bare = tmp_path / "run"
    shutil.copytree(PRE_HEALTH_RUN, bare)
    shutil.rmtree(bare / "entropy_trace")
    alone = replay(bare)  # every advantage is zero: the metrics say so (critic/advantages/max = min = 0)
    assert alone.trace is None and [(f.step, f.check, f.severity, f.pointers) for f in alone.flags] == [
        (3, "no_signal", "critical", [])]
    assert "no entropy trace: metrics only" in alone.report()


def test_thresholds_from_the_command_line_and_a_quickstart_folder(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["health", str(PRE_HEALTH_RUN), "trainer.health.no_signal.critical=1.5"]) == 0
    assert "no learning signal at step 3 (warning)" in capsys.readouterr().out  # never critical: a warning
    out = tmp_path / "qs"
    shutil.copytree(PRE_HEALTH_RUN, out / "rl")
    (out / "summary.json").write_text(json.dumps({"rl_run_dir": str(out / "rl")}))
    assert replay(out).run_dir == out / "rl"


@pytest.mark.parametrize(("args", "message"), [
    (["trainer.health.windw=2"], "'trainer.health.windw=2' is not a trainer.health key=value (did you mean "
                                 "trainer.health.window?)"),
    (["trainer.health.window=0"], "trainer.health.window=0 must be an integer of at least 1"),
    (["data.train_batch_size=4"], "'data.train_batch_size=4' is not a trainer.health key=value"),
])
def test_bad_overrides_are_one_clear_error(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["health", str(PRE_HEALTH_RUN), *args]) == 2
    assert message in capsys.readouterr().err


def test_a_folder_without_metrics_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["health", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} holds no metrics.jsonl" in err and "a quickstart's RL run is <out>/rl" in err


def test_the_healthy_quickstarts_raise_no_warning() -> None:
    assert {p.name for p in QUICKSTARTS} == {f"{task}_seed{seed}" for task in ("arithmetic", "tool_arithmetic")
                                             for seed in (1, 2, 3)}
    for run in QUICKSTARTS:
        live = read_step_records(run / "health.jsonl")
        assert [f for f in live if f["severity"] != "info"] == [], run.name  # while it trained
        result = replay(run)  # the checks and thresholds of today, over its recorded metrics
        assert [f.line() for f in result.flags if f.severity != "info"] == [], run.name
        assert len(result.steps) == (40 if run.name.startswith("arithmetic") else 20)
