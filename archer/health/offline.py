"""``archer health RUN_DIR``: the health checks replayed over a run directory, finished or still training, made
before the checks existed too.

The replay reads ``metrics.jsonl`` and, when the run has one, its entropy trace (``<run>/entropy_trace`` or the
one its config names): each traced step's responses give the pointers and, for a step whose metrics do not
record the ``health/*`` figures (a run made before them, or figure settings other than the run's), the figures.
The rollout dumps (trainer.rollout_data_dir), which hold every generated response with its score, give
no_signal's pointers, also at a step that trained on nothing (and so has no trace).
The settings are the run's ``trainer.health`` (config.yaml; archer's defaults for an older run) with the
command line's ``trainer.health.KEY=VALUE`` over them. The engine is the one training runs (engine.py), so a
replay of a run with its own settings gives its health.jsonl's flags.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from archer.errors import ArcherError
from archer.health.engine import FIGURE_PREFIX, Flag, HealthEngine
from archer.health.rows import ScoredResponses, StepRows
from archer.health.settings import HealthSettings, default_health_config
from archer.step_lines import METRICS_FILE, metrics_by_step
from archer.trace.format import TraceError, TraceReader, is_trace_dir

PREFIX = "trainer.health."
FIGURE_KEYS = ("near_deterministic_entropy", "repetition_ngram")  # settings that define the figures


@dataclass
class Replay:
    run_dir: Path
    settings: HealthSettings
    trace: Path | None  # the entropy trace read for pointers and figures
    flags: list[Flag] = field(default_factory=list)
    values: dict[int, dict[str, float]] = field(default_factory=dict)  # each step's health/* metrics
    notes: list[str] = field(default_factory=list)  # steps whose trace file could not be read

    @property
    def steps(self) -> list[int]:
        return sorted(s for s in self.values if s >= 1)

    def to_json(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "steps": len(self.steps), "trace": None if self.trace is None
                else str(self.trace), "flags": [f.to_json() for f in self.flags], "notes": self.notes}

    def report(self) -> str:
        """The replay as ``archer health`` prints it: one line per flag, its pointers, then a count."""
        source = f"; pointers and figures from {self.trace}" if self.trace else "; no entropy trace: metrics only"
        lines = [f"archer health: {self.run_dir} ({len(self.steps)} training steps{source})"]
        for flag in self.flags:
            lines.append(flag.line())
            for p in flag.pointers:
                tokens = f", tokens at {' '.join(map(str, p.positions))}" if p.positions else ""
                lines.append(f"    response {p.row} (prompt group {p.uid}): {p.why} {p.value:.4g}{tokens}")
        lines += self.notes
        counts = {s: sum(f.severity == s for f in self.flags) for s in ("critical", "warning", "info")}
        lines.append(f"{len(self.flags)} flag(s): " + ", ".join(f"{n} {s}" for s, n in counts.items()))
        return "\n".join(lines)


def health_settings(run_dir: Path, overrides: Sequence[str] = ()) -> tuple[HealthSettings, HealthSettings]:
    """(the settings to replay with, the run's own): archer's defaults, the run's config.yaml over them, then
    ``overrides`` (``trainer.health.KEY=VALUE``; an unknown key is an ArcherError naming the closest)."""
    node = default_health_config()
    config = run_dir / "config.yaml"
    if config.is_file():
        saved = OmegaConf.select(OmegaConf.load(config), "trainer.health")
        if isinstance(saved, DictConfig):
            node = OmegaConf.merge(node, saved)
    own = HealthSettings.from_config(node)
    known = _keys(node)
    for override in overrides:
        key, sep, value = override.lstrip("+").partition("=")
        short = key[len(PREFIX):] if key.startswith(PREFIX) else None
        if not sep or short not in known:
            near = difflib.get_close_matches(short or key, sorted(known), n=1)
            hint = f" (did you mean {PREFIX}{near[0]}?)" if near else ""
            raise ArcherError(f"{override!r} is not a trainer.health key=value{hint}",
                              "write overrides as trainer.health.KEY=VALUE with the keys of trainer.health in "
                              "archer/config/ppo_trainer.yaml")
        OmegaConf.update(node, short, OmegaConf.from_dotlist([f"v={value}"]).v)
    return HealthSettings.from_config(node), own


def _keys(node: DictConfig, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in node.items():
        path = f"{prefix}{k}"
        keys |= _keys(v, path + ".") if isinstance(v, DictConfig) else {path}
    return keys


def entropy_trace_of(run_dir: Path) -> Path | None:
    """The run's entropy trace: the output_dir its config.yaml names, else <run>/entropy_trace."""
    candidates = [run_dir / "entropy_trace"]
    config = run_dir / "config.yaml"
    if config.is_file():
        named = OmegaConf.select(OmegaConf.load(config), "trainer.entropy_trace.output_dir")
        if named:
            candidates.insert(0, Path(str(named)))
    return next((c for c in candidates if c.is_dir() and is_trace_dir(c)), None)


def rollout_dumps_of(run_dir: Path) -> Path | None:
    """The folder of the run's rollout dumps (trainer.rollout_data_dir in its config.yaml), if it has one."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        return None
    named = OmegaConf.select(OmegaConf.load(config), "trainer.rollout_data_dir")
    return Path(str(named)) if named and Path(str(named)).is_dir() else None


def quickstart_rl_run(folder: Path) -> Path:
    """``folder``, or the RL run a quickstart folder's summary.json names (rl_run_dir) when ``folder`` holds no
    metrics.jsonl of its own."""
    if (folder / METRICS_FILE).is_file() or not (folder / "summary.json").is_file():
        return folder
    try:
        named = json.loads((folder / "summary.json").read_text()).get("rl_run_dir")
    except (ValueError, AttributeError):
        return folder
    return Path(named) if isinstance(named, str) and (Path(named) / METRICS_FILE).is_file() else folder


_OWN_TRACE: Any = object()  # replay's default: the trace entropy_trace_of finds


def replay(run_dir: str | Path, overrides: Sequence[str] = (), *, trace: Path | None = _OWN_TRACE) -> Replay:
    """The checks over every logged step of ``run_dir``, with the entropy trace ``trace`` (by default the one
    ``entropy_trace_of`` finds; None: metrics only)."""
    run_dir = quickstart_rl_run(Path(run_dir))
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise ArcherError(f"{run_dir} holds no {METRICS_FILE}", "point at the trainer.default_local_dir of an "
                          "`archer train` run (a quickstart's RL run is <out>/rl)")
    settings, own = health_settings(run_dir, overrides)
    same_figures = all(getattr(settings, k) == getattr(own, k) for k in FIGURE_KEYS)
    trace = entropy_trace_of(run_dir) if trace is _OWN_TRACE else trace
    reader = TraceReader(trace) if trace is not None else None
    traced = set(reader.steps()) if reader is not None else set()
    call_tags, decode = _tool_reading(reader)
    engine = HealthEngine(settings)
    result = Replay(run_dir, settings, trace)
    dumps = rollout_dumps_of(run_dir)
    for step, metrics in sorted(metrics_by_step(metrics_path).items()):
        dump = None if dumps is None else dumps / f"step_{step}.jsonl"
        scored = ScoredResponses.from_dump(dump) if dump is not None and dump.is_file() else None
        rows = None
        if step in traced:
            try:
                rows = StepRows.from_trace(reader.load_step(step), call_tags, decode)
            except TraceError as e:
                result.notes.append(f"step {step}: {e} (checked from its metrics alone)")
        recorded = same_figures and any(k.startswith(FIGURE_PREFIX) for k in metrics)
        figures = engine.figures(metrics, None if recorded else rows)
        values, flags = engine.step(step, metrics, rows, figures, scored=scored)
        result.values[step] = values
        result.flags += flags
    return result


def _tool_reading(reader: TraceReader | None) -> tuple[tuple[tuple[str, str], ...], Any]:
    """(call tags, token ids -> text) for a trace of a run with tools; ((), None) otherwise."""
    if reader is None or "call_tags" not in reader.summary or reader.tokenizer_dir() is None:
        return (), None
    from archer.models.loading import load_tokenizer

    tokenizer = load_tokenizer(reader.tokenizer_dir())
    tags = tuple((str(a), str(b)) for a, b in reader.summary["call_tags"])
    return tags, lambda ids: tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


def print_replay(run_dir: str | Path, overrides: Sequence[str] = (), *, as_json: bool = False) -> Replay:
    result = replay(run_dir, overrides)
    print(json.dumps(result.to_json(), indent=2) if as_json else result.report())
    return result
