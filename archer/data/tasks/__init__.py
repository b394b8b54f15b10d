"""Built-in generated tasks with verifiable rewards, written as verl-schema RL and SFT parquet files.

``TASKS`` maps a task name to its generator. ``write_task_files`` draws distinct problems (validation
first, then RL train, then SFT), so no validation problem appears in the train or SFT files, and the same
seed and knobs give byte-identical files.
"""

from __future__ import annotations

import inspect
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from archer.data.tasks import arithmetic, countdown, tool_arithmetic
from archer.data.tasks.base import Task, TaskInstance
from archer.errors import ArcherError

TASKS: dict[str, Task] = {
    "arithmetic": Task(arithmetic.DATA_SOURCE, arithmetic.ABILITY, arithmetic.make_instance),
    "countdown": Task(countdown.DATA_SOURCE, countdown.ABILITY, countdown.make_instance),
    "tool_arithmetic": Task(tool_arithmetic.DATA_SOURCE, tool_arithmetic.ABILITY, tool_arithmetic.make_instance),
}
_ATTEMPTS_PER_INSTANCE = 20
_MIN_ATTEMPTS = 1000


def get_task(name: str) -> Task:
    """The task called ``name``, else an ArcherError listing the built-in tasks."""
    if name not in TASKS:
        raise ArcherError(
            f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}", f"use one of {sorted(TASKS)}"
        )
    return TASKS[name]


def _check_knobs(name: str, task: Task, knobs: dict[str, Any]) -> None:
    params = inspect.signature(task.make_instance).parameters
    known = {k: p.default for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    unknown = sorted(set(knobs) - set(known))
    if unknown:
        raise ArcherError(
            f"task {name!r} has no knob(s) {unknown}; its knobs (with defaults) are {known}",
            "pass only those knobs",
        )


def _draw_distinct(
    task: Task, count: int, rng: random.Random, knobs: dict[str, Any], seen: set[str]
) -> list[TaskInstance]:
    """``count`` instances whose keys are new to ``seen`` (which is updated)."""
    out: list[TaskInstance] = []
    attempts_left = max(_MIN_ATTEMPTS, _ATTEMPTS_PER_INSTANCE * count)
    while len(out) < count:
        if attempts_left == 0:
            raise ArcherError(
                f"could only generate {len(seen)} distinct problems with knobs {knobs}; "
                f"{count - len(out)} more were asked for",
                "ask for fewer rows, or make the task larger (more operands/numbers, a larger maximum)",
            )
        attempts_left -= 1
        instance = task.make_instance(rng, **knobs)
        if instance.key not in seen:
            seen.add(instance.key)
            out.append(instance)
    return out


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArcherError(
            f"{name}={value!r} must be a positive integer", f"pass {name}=<number of rows, at least 1>"
        )


def _rows(task: Task, instances: list[TaskInstance], split: str) -> list[dict[str, Any]]:
    return [
        {
            "data_source": task.data_source,
            "prompt": [{"role": "user", "content": inst.question}],
            "ability": task.ability,
            "reward_model": {"style": "rule", "ground_truth": inst.ground_truth},
            "extra_info": {"split": split, "index": i, "question": inst.question, "solution": inst.solution},
        }
        for i, inst in enumerate(instances)
    ]


def generate_rows(task: str, n: int, seed: int, split: str = "train", **knobs: Any) -> list[dict[str, Any]]:
    """``n`` distinct problems of ``task`` as verl RL rows (data_source, prompt, ability, reward_model, extra_info)."""
    spec = get_task(task)
    _check_knobs(task, spec, knobs)
    _check_count("n", n)
    return _rows(spec, _draw_distinct(spec, n, random.Random(seed), knobs, set()), split)


def write_task_files(
    task: str,
    out_dir: str | Path,
    *,
    n_train: int,
    n_val: int,
    seed: int,
    n_sft: int | None = None,
    **knobs: Any,
) -> dict[str, Path]:
    """Write ``train.parquet``, ``val.parquet`` (RL rows) and ``sft.parquet`` (prompt, response) to ``out_dir``.

    All problems are distinct across the three files; ``n_sft`` defaults to ``n_train``.
    """
    spec = get_task(task)
    _check_knobs(task, spec, knobs)
    n_sft = n_train if n_sft is None else n_sft
    for name, value in (("n_train", n_train), ("n_val", n_val), ("n_sft", n_sft)):
        _check_count(name, value)
    rng, seen = random.Random(seed), set()
    val = _draw_distinct(spec, n_val, rng, knobs, seen)
    train = _draw_distinct(spec, n_train, rng, knobs, seen)
    sft = _draw_distinct(spec, n_sft, rng, knobs, seen)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = {
        "train": pa.Table.from_pylist(_rows(spec, train, "train")),
        "val": pa.Table.from_pylist(_rows(spec, val, "val")),
        "sft": pa.Table.from_pylist(
            [{"prompt": [{"role": "user", "content": i.question}], "response": i.solution} for i in sft]
        ),
    }
    paths = {name: out / f"{name}.parquet" for name in tables}
    for name, table in tables.items():
        pq.write_table(table, paths[name])
    return paths
