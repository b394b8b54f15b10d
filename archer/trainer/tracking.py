"""Metric tracking for a training run: metrics.jsonl, a rich console view, TensorBoard and Weights & Biases.

`Tracking` takes verl's `trainer.logger` backend names. `<run>/metrics.jsonl` is always written, one JSON
object per `log` call: {"step": N, <metric>: value, ...}. JSON has no NaN, so non-finite values (NaN,
inf) are written as null. A resumed run (start_step > 0) first drops every line after start_step and any
half-written line, so a run killed and resumed never holds duplicated or torn lines; a run that starts
at step 0 starts a new file. The console's ETA is the moving average of the last steps' durations times the
steps left, shown from the second logged step on (a first step that includes start-up is not a rate). Its
line shows the key metrics and, when a log holds a validation, its accuracy (``val-core/<source>/acc/mean@n`` of
each data source, and of ``all`` when there are several).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Column
from rich.text import Text

from archer.atomic_files import write_text_atomically
from archer.errors import ArcherError
from archer.step_lines import METRICS_FILE, truncate_after_step

KNOWN_BACKENDS = ("console", "jsonl", "tensorboard", "wandb")
DEFAULT_KEY_METRICS = ("critic/score/mean", "actor/entropy", "response_length/mean")
ETA_WINDOW = 10  # steps whose mean duration the ETA extrapolates (a tenth of the run, when that is more)
VALIDATION_ACCURACY = re.compile(r"val-core/(.+)/acc/mean@\d+")


class _Backend(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _as_float(key: str, value: Any) -> float:
    """A metric value as a float; tensors and numpy scalars are unwrapped with `.item()`."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"metric {key!r} must be a scalar number, got {value!r}") from err


class _JsonlBackend:
    def __init__(self, path: Path, start_step: int) -> None:
        if start_step > 0 and path.exists():
            truncate_after_step(path, start_step)
        self._file = path.open("a" if start_step > 0 else "w", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: v if math.isfinite(v) else None for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def validation_accuracy(metrics: dict[str, float]) -> dict[str, float]:
    """The validation accuracies among ``metrics``: mean@n of each data source, and of "all" when there are
    several (with one source "all" repeats it)."""
    found = {key: value for key, value in metrics.items() if VALIDATION_ACCURACY.fullmatch(key)}
    sources = {VALIDATION_ACCURACY.fullmatch(key).group(1) for key in found}
    if sources - {"all"} and len(sources) <= 2:
        found = {key: value for key, value in found.items() if VALIDATION_ACCURACY.fullmatch(key).group(1) != "all"}
    return found


def _format_duration(seconds: float | None) -> str:
    return "-:--:--" if seconds is None else str(timedelta(seconds=int(seconds)))


class StepClock:
    """Time left from the mean duration of the last steps (None until two steps are logged)."""

    def __init__(self, total_steps: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self._total = total_steps
        self._clock = clock
        self._durations: deque[float] = deque(maxlen=max(ETA_WINDOW, total_steps // 10))
        self._last: tuple[int, float] | None = None

    def tick(self, step: int) -> None:
        """Step ``step`` is done now (a repeated step, e.g. its validation logged apart, changes nothing)."""
        now = self._clock()
        if self._last is not None and step > self._last[0]:
            self._durations.append((now - self._last[1]) / (step - self._last[0]))
        if self._last is None or step > self._last[0]:
            self._last = (step, now)

    def remaining(self) -> float | None:
        if not self._durations or self._last is None:
            return None
        return sum(self._durations) / len(self._durations) * max(self._total - self._last[0], 0)


class _ConsoleBackend:
    """A progress bar (live on a terminal, printed once at the end otherwise) and one line per log call."""

    def __init__(self, total_steps: int, start_step: int, key_metrics: tuple[str, ...],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._keys = key_metrics
        self._total = total_steps
        self._eta = StepClock(total_steps, clock=clock)
        self._progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta {task.fields[eta]}"),
            # ratio=1: the metrics take the remaining width and wrap, so the other columns keep theirs.
            TextColumn("{task.fields[summary]}", table_column=Column(ratio=1)),
            console=Console(),
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, summary="",
                                             eta=_format_duration(None))
        self._progress.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        summary = "  ".join(f"{k}={metrics[k]:.4g}" for k in self._keys if k in metrics)
        fields = {"summary": summary} if summary else {}  # a log without key metrics keeps the last ones
        self._eta.tick(step)
        eta = _format_duration(self._eta.remaining())
        self._progress.update(self._task, completed=step, eta=eta, **fields)
        task = self._progress.tasks[0]
        shown = "  ".join([summary, *(f"{k}={v:.4g}" for k, v in validation_accuracy(metrics).items())]).strip()
        line = f"step {step}/{self._total}  elapsed {_format_duration(task.elapsed)}  eta {eta}  {shown}"
        self._progress.console.print(Text(line.rstrip()), soft_wrap=True)

    def close(self) -> None:
        self._progress.stop()


class _TensorboardBackend:
    def __init__(self, log_dir: Path, start_step: int) -> None:
        # Imported here: tensorboard is needed only when this backend is chosen.
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events after start_step that a killed run wrote before its last checkpoint.
        self._writer = SummaryWriter(
            log_dir=str(log_dir), purge_step=start_step + 1 if start_step > 0 else None
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _wandb_run_id(run_dir: Path) -> str:
    """The run's wandb id, kept in `<run>/wandb_run_id` so that a resumed run continues the same wandb run."""
    path = run_dir / "wandb_run_id"
    if path.is_file() and path.read_text(encoding="utf-8").strip():
        return path.read_text(encoding="utf-8").strip()
    run_id = uuid.uuid4().hex
    write_text_atomically(path, run_id + "\n")
    return run_id


class _WandbBackend:
    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict) -> None:
        # Imported here: wandb is an optional dependency (checked by _require_wandb before any file is made).
        import wandb

        self._run = wandb.init(
            project=project,
            name=experiment,
            config=config,
            dir=str(run_dir),
            id=_wandb_run_id(run_dir),
            resume="allow",
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


def check_backends(backends: Iterable[str] | str) -> list[str]:
    """Validated backend names in order, without duplicates, with jsonl always first."""
    requested = [backends] if isinstance(backends, str) else list(backends)
    unknown = sorted({name for name in requested if name not in KNOWN_BACKENDS})
    if unknown:
        raise ArcherError(
            f"unknown trainer.logger backend(s): {', '.join(unknown)}",
            f"use any of {', '.join(KNOWN_BACKENDS)}, e.g. trainer.logger='[console,tensorboard]'",
        )
    return list(dict.fromkeys(["jsonl", *requested]))


def _require_wandb() -> None:
    if importlib.util.find_spec("wandb") is None:
        raise ArcherError(
            "trainer.logger includes 'wandb' but the wandb package is not installed",
            "pip install wandb (or pip install 'archer[wandb]'), or drop wandb from trainer.logger",
        )


class Tracking:
    """Sends each step's metrics to every chosen backend; use as a context manager or call `close()`."""

    def __init__(
        self,
        run_dir: Path,
        *,
        backends: list[str],
        project: str,
        experiment: str,
        config: dict,
        total_steps: int,
        start_step: int = 0,
        key_metrics: tuple[str, ...] = DEFAULT_KEY_METRICS,
    ) -> None:
        names = check_backends(backends)
        if "wandb" in names:
            _require_wandb()
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._backends: list[_Backend] = []
        try:
            for name in names:
                if name == "jsonl":
                    self._backends.append(_JsonlBackend(run_dir / METRICS_FILE, start_step))
                elif name == "console":
                    self._backends.append(_ConsoleBackend(total_steps, start_step, key_metrics))
                elif name == "tensorboard":
                    self._backends.append(_TensorboardBackend(run_dir / "tensorboard", start_step))
                elif name == "wandb":
                    self._backends.append(_WandbBackend(run_dir, project, experiment, config))
        except BaseException:
            self.close()
            raise

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record `metrics` (floats, ints, 0-d tensors or numpy scalars) for training step `step`."""
        if "step" in metrics:
            raise ValueError("'step' is reserved in metrics.jsonl; pass it as the step argument")
        values = {key: _as_float(key, value) for key, value in metrics.items()}
        for backend in self._backends:
            backend.log(values, step)

    def close(self) -> None:
        """Flush and close every backend; safe to call twice."""
        backends, self._backends = self._backends, []
        for backend in reversed(backends):
            backend.close()

    def __enter__(self) -> Tracking:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
