"""The health checks while training: the trainer hands each step's batch (``collect``, once its advantages are
computed) and each step's metrics (``check``, with the step's validation); the monitor runs the engine, logs
one console line per flag (logger ``archer.health``: info, warning or error by severity), appends the flag to
``<run>/health.jsonl`` and returns the ``health/*`` metrics (plus ``timing_s/health``, the checks' own time) that
go to every logger. With ``trainer.health.stop_on``, ``stop`` holds the first flag severe enough to stop at.

A resumed run drops the flags after its checkpoint's step (they are raised again) and takes the history and
each check's state from the metrics.jsonl lines up to that step, so its flags are those of an uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from archer.health.engine import Flag, HealthEngine
from archer.health.rows import ScoredResponses, StepRows
from archer.health.settings import HealthSettings
from archer.step_lines import METRICS_FILE, metrics_by_step, truncate_after_step

if TYPE_CHECKING:
    from archer.batch import Batch

log = logging.getLogger("archer.health")

HEALTH_FILE = "health.jsonl"
LOG_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.ERROR}


class HealthMonitor:
    def __init__(self, cfg: DictConfig, run_dir: Path, start_step: int, call_tags: Sequence[tuple[str, str]] = ()
                 ) -> None:
        self.settings = HealthSettings.from_config(cfg.trainer.health)
        self.engine = HealthEngine(self.settings)
        self.call_tags = tuple(call_tags)
        self.path = Path(run_dir) / HEALTH_FILE
        self.stop: Flag | None = None
        self._rows: StepRows | None = None
        self._scored: ScoredResponses | None = None
        self._seconds = 0.0
        if start_step > 0:
            for step, values in sorted(metrics_by_step(Path(run_dir) / METRICS_FILE).items()):
                if step <= start_step:
                    self.engine.restore(step, values)
            if self.path.exists():
                truncate_after_step(self.path, start_step)
        else:
            self.path.write_text("", encoding="utf-8")

    def collect(self, batch: Batch) -> None:
        """The step's responses (after its advantages); ``check`` reads them."""
        start = time.perf_counter()
        self._rows = StepRows.from_batch(batch, self.call_tags)
        self._seconds = time.perf_counter() - start

    def collect_scored(self, responses: Batch) -> None:
        """Every response the step generated, trained or dropped, with its score (the rollout dump's rows):
        what no_signal points at, also at a step that trained on nothing."""
        self._scored = ScoredResponses.from_rows(responses["uid"], responses["score"]) if len(responses) else None

    def check(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Run the checks on the step; returns the health/* metrics and timing_s/health (nothing for step 0)."""
        start = time.perf_counter()
        rows, scored, self._rows, self._scored = self._rows, self._scored, None, None
        out, flags = self.engine.step(step, metrics, rows, scored=scored)
        if step < 1:  # the validation before training joins the history and logs nothing more
            return out
        for flag in flags:
            log.log(LOG_LEVELS[flag.severity], "%s", flag.line())
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(flag.to_json(), allow_nan=False) + "\n")
            if self.stop is None and self.settings.stops_at(flag.severity):
                self.stop = flag
        out["timing_s/health"] = self._seconds + time.perf_counter() - start
        self._seconds = 0.0
        return out
