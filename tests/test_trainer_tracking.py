"""Tracking: metrics.jsonl content and resume truncation, backend selection, console, TensorBoard, wandb."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from archer.errors import ArcherError
from archer.trainer.tracking import StepClock, Tracking


def _tracking(run_dir: Path, backends: list[str], start_step: int = 0, total_steps: int = 10) -> Tracking:
    return Tracking(
        run_dir,
        backends=backends,
        project="proj",
        experiment="exp",
        config={"lr": 1e-6},
        total_steps=total_steps,
        start_step=start_step,
    )


def _lines(run_dir: Path) -> list[dict]:
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_jsonl_records_field_by_field(tmp_path: Path) -> None:
    with _tracking(tmp_path, []) as tracking:
        tracking.log(
            {
                "critic/score/mean": torch.tensor(0.25),
                "actor/entropy": np.float32(1.5),
                "response_length/mean": np.int64(12),
                "actor/pg_loss": 3,
            },
            step=1,
        )
        # Written and flushed before close: a reader sees the line while the run goes on.
        assert _lines(tmp_path) == [
            {
                "step": 1,
                "critic/score/mean": 0.25,
                "actor/entropy": 1.5,
                "response_length/mean": 12.0,
                "actor/pg_loss": 3.0,
            }
        ]
        tracking.log({"actor/ppo_kl": float("nan"), "critic/vf_loss": float("inf"), "x": -0.5}, step=2)

    records = _lines(tmp_path)
    assert len(records) == 2
    assert list(records[0]) == [
        "step",
        "critic/score/mean",
        "actor/entropy",
        "response_length/mean",
        "actor/pg_loss",
    ]
    assert records[1] == {"step": 2, "actor/ppo_kl": None, "critic/vf_loss": None, "x": -0.5}
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()


def test_non_scalar_metric_and_reserved_step_are_rejected(tmp_path: Path) -> None:
    with _tracking(tmp_path, []) as tracking:
        with pytest.raises(TypeError, match="'actor/entropy'"):
            tracking.log({"actor/entropy": torch.ones(2)}, step=1)
        with pytest.raises(ValueError, match="reserved"):
            tracking.log({"step": 1.0}, step=1)


def test_resume_truncates_later_and_torn_lines(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        '{"step": 1, "a": 1.0}\n'
        '{"step": 2, "a": 2.0}\n'
        '{"step": 2, "val-core/gsm8k/acc/mean@1": 0.5}\n'
        '{"step": 3, "a": 3.0}\n'
        '{"step": 4, "a": 4.0}\n'
        '{"step": 5, "a": 5.'  # killed mid-write
    )
    with _tracking(tmp_path, ["jsonl"], start_step=2) as tracking:
        assert _lines(tmp_path) == [
            {"step": 1, "a": 1.0},
            {"step": 2, "a": 2.0},
            {"step": 2, "val-core/gsm8k/acc/mean@1": 0.5},
        ]
        tracking.log({"a": 30.0}, step=3)
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 2, 3]
    assert _lines(tmp_path)[-1] == {"step": 3, "a": 30.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file left


def test_resume_drops_torn_line_even_when_its_step_is_kept(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"')
    _tracking(tmp_path, [], start_step=5).close()
    assert _lines(tmp_path) == [{"step": 1, "a": 1.0}]


def test_fresh_run_starts_a_new_file(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n')
    with _tracking(tmp_path, []) as tracking:
        tracking.log({"b": 2.0}, step=1)
    assert _lines(tmp_path) == [{"step": 1, "b": 2.0}]


def test_unknown_backend_lists_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ArcherError, match="mlflow") as err:
        _tracking(tmp_path / "run", ["console", "mlflow"])
    assert "console, jsonl, tensorboard, wandb" in err.value.fix
    assert not (tmp_path / "run").exists()


def test_missing_wandb_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail as if not installed
    with pytest.raises(ArcherError, match="wandb") as err:
        _tracking(tmp_path / "run", ["wandb"])
    assert "pip install wandb" in err.value.fix
    assert "trainer.logger" in err.value.fix
    assert not (tmp_path / "run").exists()


def test_wandb_backend_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []

    class FakeRun:
        def log(self, metrics: dict, step: int) -> None:
            calls.append(("log", metrics, step))

        def finish(self) -> None:
            calls.append(("finish",))

    def init(**kwargs: object) -> FakeRun:
        calls.append(("init", kwargs))
        return FakeRun()

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)

    with _tracking(tmp_path, ["wandb"]) as tracking:
        tracking.log({"a": np.float64(0.5)}, step=4)
    _tracking(tmp_path, ["wandb"], start_step=4).close()

    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    first_init = {
        "project": "proj",
        "name": "exp",
        "config": {"lr": 1e-6},
        "dir": str(tmp_path),
        "id": run_id,
        "resume": "allow",
    }
    assert calls == [
        ("init", first_init),
        ("log", {"a": 0.5}, 4),
        ("finish",),
        ("init", first_init),
        ("finish",),
    ]


def test_console_without_tty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _tracking(tmp_path, ["console"], start_step=1, total_steps=3) as tracking:
        tracking.log({"critic/score/mean": 0.5, "actor/entropy": 1.25, "other": 9.0}, step=2)
        tracking.log({"timing_s/step": 1.0}, step=3)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "\x1b[" not in out  # no cursor movement or colour codes in a non-terminal log
    assert lines[0].startswith("step 2/3  elapsed 0:00:00  eta ")
    assert lines[0].endswith("critic/score/mean=0.5  actor/entropy=1.25")
    assert "other" not in out
    assert lines[1].startswith("step 3/3  elapsed ")
    # The bar is printed once, at close, with the last key metrics (wrapped to the 80 columns of a log).
    assert lines[2].startswith("training ")
    assert "3/3" in lines[2]
    assert "critic/score/mean=0.5" in " ".join(lines[2:])
    assert sum("3/3" in line for line in lines) == 2
    assert len(_lines(tmp_path)) == 2


def test_tensorboard_event_file(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with _tracking(tmp_path, ["tensorboard"]) as tracking:
        tracking.log({"critic/score/mean": 0.25}, step=1)
        tracking.log({"critic/score/mean": 0.75}, step=2)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = acc.Scalars("critic/score/mean")
    assert [(s.step, s.value) for s in scalars] == [(1, 0.25), (2, 0.75)]


def test_tensorboard_resume_purges_steps_after_start(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with _tracking(tmp_path, ["tensorboard"]) as tracking:
        for step, value in ((1, 1.0), (2, 2.0), (3, 3.0)):
            tracking.log({"a": value}, step=step)
    with _tracking(tmp_path, ["tensorboard"], start_step=2) as tracking:
        tracking.log({"a": 30.0}, step=3)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("a")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_eta_is_the_moving_average_of_step_times_from_the_second_step() -> None:
    now = [0.0]
    clock = StepClock(total_steps=200, clock=lambda: now[0])  # window: max(10, 200 // 10) = 20 steps
    clock.tick(1)  # the first step's time includes start-up: not a rate
    assert clock.remaining() is None
    now[0] = 4.0
    clock.tick(2)
    assert clock.remaining() == 4.0 * 198
    now[0] = 4.0
    clock.tick(2)  # the same step logged again (its validation): no new duration
    assert clock.remaining() == 4.0 * 198
    now[0] = 10.0
    clock.tick(4)  # two steps in 6 s: 3 s each
    assert clock.remaining() == pytest.approx((4.0 + 3.0) / 2 * 196)
    for step in range(5, 30):  # 25 steps of 1 s: the 20-step window forgets the slow start
        now[0] += 1.0
        clock.tick(step)
    assert clock.remaining() == pytest.approx(1.0 * 171)


def test_console_eta_shows_from_the_second_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _tracking(tmp_path, ["console"], total_steps=3) as tracking:
        tracking.log({"actor/entropy": 1.0}, step=1)
        tracking.log({"actor/entropy": 1.0}, step=2)
    lines = capsys.readouterr().out.splitlines()
    assert "eta -:--:--" in lines[0] and "eta 0:00:00" in lines[1]  # 1 step left of ~0 s


def test_console_shows_the_validation_accuracy_when_a_step_validates(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    one_source = {"val-core/archer/arithmetic/acc/mean@1": 0.25, "val-core/all/acc/mean@1": 0.25,
                  "val-aux/archer/arithmetic/score/mean@1": 0.25, "timing_s/testing": 3.0}
    with _tracking(tmp_path, ["console"], total_steps=2) as tracking:
        tracking.log(one_source, step=0)  # validation before training: no training metrics
        tracking.log({"critic/score/mean": 0.5, "val-core/gsm8k/acc/mean@4": 0.5, "val-core/math/acc/mean@4": 0.75,
                      "val-core/all/acc/mean@4": 0.625, "val-core/all/acc/pass@4": 0.9}, step=1)
        tracking.log({"critic/score/mean": 0.5}, step=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("eta -:--:--  val-core/archer/arithmetic/acc/mean@1=0.25")
    assert lines[1].endswith("critic/score/mean=0.5  val-core/gsm8k/acc/mean@4=0.5  val-core/math/acc/mean@4=0.75  "
                             "val-core/all/acc/mean@4=0.625")
    assert lines[2].endswith("critic/score/mean=0.5")
