"""The explorer's Health tab behind the UI: the flags of the trace's run, their timeline over the run's curves,
and where each flag's pointers are in the trace.

The run is the folder named by ``archer viz --run-dir``, else the trace's parent folder (``<run>/entropy_trace``),
when it holds a metrics.jsonl; the ``run_dir`` a trace's summary names is not followed (a summary is data). Its
flags come from ``<run>/health.jsonl`` when training wrote one, else from a replay of the checks
(archer/health/offline.py: a run made before them) over ``<run>/entropy_trace`` (not the trace its config.yaml
may name elsewhere). A pointer names a response by its row in the
step's batch; the trace's ``response_index`` says which of its rows that is (an influence trace holds only the
groups it traced, so a pointed response may be missing from it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from archer.errors import ArcherError
from archer.health.engine import Flag
from archer.health.monitor import HEALTH_FILE
from archer.health.offline import replay
from archer.step_lines import METRICS_FILE, metrics_by_step, read_step_records
from archer.trace.format import is_trace_dir

SEVERITY_COLOURS = {"info": "#1f77b4", "warning": "#ff7f0e", "critical": "#d62728"}
PANELS = (("entropy", ("actor/entropy",)), ("score / accuracy", ("critic/score/mean", "critic/acc/mean")),
          ("response length", ("response_length/mean",)))
FLAG_COLUMNS = ["flag", "step", "severity", "check", "responses", "message"]
POINTER_COLUMNS = ["pointer", "response", "prompt group", "tokens", "value", "why"]


def run_dir_of(trace_dir: Path, run_dir: str | Path | None = None) -> Path | None:
    """The run a trace belongs to: ``run_dir`` (the user's --run-dir), else the trace's parent, when it holds a
    metrics.jsonl (ArcherError for a ``run_dir`` that does not)."""
    if run_dir is not None:
        path = Path(run_dir).expanduser()
        if not (path / METRICS_FILE).is_file():
            raise ArcherError(f"--run-dir {path} holds no {METRICS_FILE}",
                              "pass the trainer.default_local_dir of the run the trace belongs to, or leave --run-dir "
                              "out (the trace's parent folder is read when it holds one)")
        return path
    return trace_dir.parent if (trace_dir.parent / METRICS_FILE).is_file() else None


@dataclass
class RunHealth:
    """A run's flags and its metrics by step, with how the flags were found."""

    flags: list[Flag]
    metrics: dict[int, dict[str, float]]
    source: str

    @classmethod
    def read(cls, run_dir: Path) -> RunHealth:
        metrics = metrics_by_step(run_dir / METRICS_FILE)
        log = run_dir / HEALTH_FILE
        if log.is_file():
            flags = [Flag.from_json(r) for r in read_step_records(log)]
            return cls(flags, metrics, f"flags of `{log}`, written while training")
        own = run_dir / "entropy_trace"
        result = replay(run_dir, trace=own if is_trace_dir(own) else None)
        return cls(result.flags, metrics, f"flags replayed by `archer health {run_dir}` (the run wrote no "
                                          f"{HEALTH_FILE})")

    def note(self) -> str:
        counts = {s: sum(f.severity == s for f in self.flags) for s in SEVERITY_COLOURS}
        listed = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        return (f"**{len(self.flags)} flag(s)**" + (f" ({listed})" if listed else "") + f" — {self.source}. "
                "Select a flag to open the first response it points at, or one of its pointers below; the tokens it "
                "points at are boxed in green.")

    def flags_table(self) -> pd.DataFrame:
        return pd.DataFrame([{"flag": i, "step": f.step, "severity": f.severity, "check": f.check,
                              "message": f.message, "responses": " ".join(str(p.row) for p in f.pointers)}
                             for i, f in enumerate(self.flags)], columns=FLAG_COLUMNS)

    def pointers_table(self, flag: int) -> pd.DataFrame:
        pointers = self.flags[flag].pointers if 0 <= flag < len(self.flags) else []
        return pd.DataFrame([{"pointer": i, "response": p.row, "prompt group": p.uid,
                              "tokens": " ".join(map(str, p.positions)), "value": p.value, "why": p.why}
                             for i, p in enumerate(pointers)], columns=POINTER_COLUMNS)

    def timeline(self) -> Figure:
        """The run's curves, one panel each, under a vertical line per flag (coloured by severity)."""
        steps = sorted(s for s in self.metrics if s >= 1)
        fig = Figure(figsize=(10, 7), layout="constrained")
        axes = fig.subplots(len(PANELS), 1, sharex=True, squeeze=False)[:, 0]
        for ax, (label, keys) in zip(axes, PANELS):
            for key in keys:
                points = [(s, self.metrics[s][key]) for s in steps if key in self.metrics[s]]
                if points:
                    ax.plot(*zip(*points), marker="o", markersize=2, label=key)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            for flag in self.flags:
                ax.axvline(flag.step, color=SEVERITY_COLOURS.get(flag.severity, "black"), linewidth=1.5, alpha=0.8)
            if ax.lines:
                ax.legend(fontsize=8, loc="upper left")
        for flag in self.flags:
            axes[0].annotate(flag.check, (flag.step, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                             fontsize=8, va="top", ha="right", color=SEVERITY_COLOURS.get(flag.severity, "black"))
        axes[-1].set_xlabel("step")
        axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.suptitle("training curves and health flags (info blue, warning orange, critical red)", fontsize=10)
        return fig


def trace_row(arrays: dict[str, np.ndarray], batch_row: int) -> int | None:
    """The trace row of the response that was row ``batch_row`` of its step's batch (None when not traced)."""
    found = np.flatnonzero(arrays["response_index"] == batch_row)
    return int(found[0]) if len(found) else None
