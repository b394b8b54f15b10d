"""JSON-lines files of one record per training step (``metrics.jsonl``, ``health.jsonl``): reading their complete
records and dropping the records after a step (a resumed run writes those steps again).

A record is a JSON object with an integer ``step``; a torn line (a run killed mid-write) or any other line is
skipped when read and dropped when truncated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from archer.atomic_files import write_text_atomically

METRICS_FILE = "metrics.jsonl"


def _record(line: str) -> dict[str, Any] | None:
    """The line as a step record, or None when it is not one."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def read_step_records(path: Path) -> list[dict[str, Any]]:
    """The complete records of ``path``, in file order."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return [record for record in map(_record, lines) if record is not None]


def truncate_after_step(path: Path, last_step: int) -> None:
    """Atomically rewrite ``path`` keeping only complete records with step <= last_step."""
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        record = _record(line)
        if record is not None and record["step"] <= last_step:
            kept.append(line + "\n")
    write_text_atomically(path, "".join(kept))


def metrics_by_step(path: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl by step: the numbers of each step's records merged (later lines win; nulls left out)."""
    by_step: dict[int, dict[str, float]] = {}
    for record in read_step_records(path) if path.is_file() else []:
        by_step.setdefault(record["step"], {}).update(
            {k: float(v) for k, v in record.items() if k != "step" and _is_number(v)})
    return by_step


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
