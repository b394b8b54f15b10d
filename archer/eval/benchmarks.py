"""Benchmarks: a YAML spec per set (archer/config/benchmark/<name>.yaml, or any YAML file a user writes) and its
rows as RL prompt rows in verl's schema (data_source, prompt messages, reward_model.ground_truth).

A spec names its ``file`` (jsonl, json or parquet; a relative path resolves against the data root the user
gives with ``data_dir=``, then against the YAML's own folder), the ``question_key`` and ``answer_key`` of its
rows (dotted for nested keys; an answer may be a string or a list of accepted strings), the ``data_source`` the
reward registry routes on, the ``answer_type`` (math or qa: how answers are compared for maj@k), a ``prompt``
template in which ``{question}`` stands for the question, an optional ``system`` message, and an optional
``judge_prompt`` for an LLM judge (``{question}``, ``{reference}``, ``{answer}``). A spec with
``format: verl`` reads a parquet already in verl's schema (ARPO's gaia_test / hle_test) as it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from archer.data.parquet import read_rl_parquet
from archer.errors import ArcherError
from archer.eval.answers import ANSWER_TYPES

BENCHMARK_DIR = Path(__file__).resolve().parents[1] / "config" / "benchmark"
FORMATS = ("plain", "verl")


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    file: str
    data_source: str
    answer_type: str = "math"
    format: str = "plain"
    question_key: str = "question"
    answer_key: str = "answer"
    prompt: str = "{question}"
    system: str | None = None
    judge_prompt: str | None = None
    origin: str = ""  # the YAML the spec came from

    def resolve_file(self, data_dir: str | None) -> Path:
        """The data file: absolute, else under ``data_dir``, else next to the YAML; an error names every place tried."""
        path = Path(self.file).expanduser()
        candidates = [path] if path.is_absolute() else [
            *([Path(data_dir).expanduser() / path] if data_dir else []), Path(self.origin).parent / path]
        for candidate in candidates:
            if candidate.is_file():
                return candidate
        raise ArcherError(f"benchmark {self.name!r}: data file {self.file} not found (looked at "
                          f"{', '.join(str(c) for c in candidates)})",
                          "set data_dir=FOLDER to the folder that holds it (e.g. the folder with benchmarks/"
                          f"{self.name}/), or point 'file' in {self.origin} at the file")


def benchmark_names() -> list[str]:
    """The built-in benchmarks (archer/config/benchmark/*.yaml)."""
    return sorted(p.stem for p in BENCHMARK_DIR.glob("*.yaml"))


def load_spec(name: str) -> BenchmarkSpec:
    """The spec of a built-in benchmark by name, or of a YAML file by path."""
    path = Path(name).expanduser()
    if not name.endswith((".yaml", ".yml")):
        path = BENCHMARK_DIR / f"{name}.yaml"
        if not path.is_file():
            raise ArcherError(f"unknown benchmark {name!r}; built-in ones: {', '.join(benchmark_names())}",
                              "pick one of them, or pass the path of your own benchmark YAML (benchmark=[my.yaml]); "
                              "see docs/eval.md")
    if not path.is_file():
        raise ArcherError(f"benchmark file {path} does not exist", "check the path of the benchmark YAML")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ArcherError(f"benchmark YAML {path} does not parse: {exc}", "fix its syntax") from exc
    known = {f.name for f in fields(BenchmarkSpec)} - {"name", "origin"}
    if not isinstance(raw, dict) or "file" not in raw or "data_source" not in raw:
        raise ArcherError(f"benchmark YAML {path} needs at least 'file' and 'data_source'",
                          "see archer/config/benchmark/gsm8k.yaml for the keys")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ArcherError(f"benchmark YAML {path} has unknown key(s) {unknown}", f"its keys are {sorted(known)}")
    spec = BenchmarkSpec(name=path.stem, origin=str(path), **{k: str(v) if v is not None else None for k, v in raw.items()})
    if spec.answer_type not in ANSWER_TYPES or spec.format not in FORMATS:
        raise ArcherError(f"benchmark YAML {path}: answer_type must be one of {ANSWER_TYPES} and format one of "
                          f"{FORMATS}", "fix those keys")
    if spec.format == "plain" and "{question}" not in spec.prompt:
        raise ArcherError(f"benchmark YAML {path}: the prompt template has no {{question}}",
                          "write {question} where the question goes")
    return spec


def _read_records(path: Path) -> list[dict[str, Any]]:
    try:
        if path.suffix == ".parquet":
            return pq.read_table(path).to_pylist()
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            records = json.loads(text)
        else:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (json.JSONDecodeError, pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        raise ArcherError(f"benchmark data {path} does not read: {exc}",
                          "give a .jsonl (one JSON object a line), .json (a list of objects) or .parquet file") from exc
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ArcherError(f"benchmark data {path} is not a list of objects", "one JSON object per problem")
    return records


def _field(record: dict[str, Any], key: str) -> Any:
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _answer(value: Any) -> str | list[str] | None:
    if isinstance(value, list):
        return [str(v) for v in value] or None
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    return str(value)


def load_rows(spec: BenchmarkSpec, data_dir: str | None, limit: int | None = None) -> list[dict[str, Any]]:
    """The benchmark's problems as verl-schema rows (first ``limit`` of them when set), in file order."""
    path = spec.resolve_file(data_dir)
    if spec.format == "verl":
        rows = read_rl_parquet(path, require_ground_truth=True)
        for row in rows:
            row["data_source"] = spec.data_source
            row["ability"] = row.get("ability") or spec.answer_type
        return rows[:limit]
    records = _read_records(path)
    if not records:
        raise ArcherError(f"benchmark data {path} has no rows", "point the benchmark at a file with problems")
    rows = []
    for i, record in enumerate(records[:limit]):
        question, answer = _field(record, spec.question_key), _answer(_field(record, spec.answer_key))
        if not isinstance(question, str) or answer is None:
            missing = spec.question_key if not isinstance(question, str) else spec.answer_key
            raise ArcherError(f"benchmark {spec.name!r}: row {i} of {path} has no {missing!r} (its keys: "
                              f"{sorted(record)})",
                              f"set question_key / answer_key in {spec.origin} to the file's keys, or fix that row")
        messages = ([{"role": "system", "content": spec.system}] if spec.system else [])
        messages.append({"role": "user", "content": spec.prompt.replace("{question}", question)})
        rows.append({"data_source": spec.data_source, "prompt": messages, "ability": spec.answer_type,
                     "reward_model": {"ground_truth": answer}, "extra_info": {"index": i, "question": question}})
    return rows
