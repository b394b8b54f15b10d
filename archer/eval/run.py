"""``archer eval``: a model on benchmarks, n samples per problem, through the Evaluator of training's validation.

The command's short keys (``model``, ``benchmark``, ``n``, ``k``, ``temperature``, ``data_dir``, ``judge.url``, ...)
stand for keys of archer's RL config (``EVAL_ALIASES``); any other RL config key (the rollout's, the tools') is
given in full. The run folder holds ``samples.jsonl`` (a line per problem, appended batch by batch: an interrupted
eval resumes and redoes no finished batch), ``eval_state.json`` (what the samples depend on: a resume with other
settings is refused), ``results.json``, ``results.md`` and ``results.png``, and ``judge_cache.jsonl`` with a judge.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from archer.atomic_files import recorded_path, write_json_atomically, write_text_atomically
from archer.config.loader import load_config
from archer.data.rl_dataset import RLDataset
from archer.errors import ArcherError
from archer.eval.benchmarks import BenchmarkSpec, load_rows, load_spec
from archer.eval.evaluator import Evaluator, ProblemRecord, records_metrics
from archer.eval.judge import Judge, fill_prompt
from archer.eval.report import plot_results, results_table
from archer.eval.sampling_metrics import check_ks, default_ks
from archer.folder_lock import FolderLock, hold_folder, refuse_if_held
from archer.models.loading import load_tokenizer, pick_device
from archer.rewards.reward_stage import build_reward_manager
from archer.rewards.routing import check_routes
from archer.rollout.agentic_config import check_agentic_config
from archer.rollout.factory import check_engine_name
from archer.workers.generator import CHECKPOINT_ACTOR, GenerationWorker, resolve_model_folder

log = logging.getLogger("archer.eval")

_VAL = "actor_rollout_ref.rollout.val_kwargs"
EVAL_ALIASES = {
    "model": "actor_rollout_ref.model.path", "n": f"{_VAL}.n", "temperature": f"{_VAL}.temperature",
    "top_p": f"{_VAL}.top_p", "top_k": f"{_VAL}.top_k", "max_prompt_length": "data.max_prompt_length",
    "max_response_length": "data.max_response_length", "seed": "trainer.seed", "device": "trainer.device",
    **{k: f"eval.{k}" for k in ("benchmark", "k", "data_dir", "output_dir", "limit", "batch_size", "score_workers")},
}
TOOLS_KEY = "actor_rollout_ref.rollout.tools.tool_instances"
# RL config keys archer eval does not read (training's), and what to set instead
UNREAD_KEYS = {
    "data.train_files": "benchmark=[...]", "data.val_files": "benchmark=[...] (a YAML with format: verl reads them)",
    "actor_rollout_ref.rollout.n": "n=", "actor_rollout_ref.rollout.temperature": "temperature=",
    "actor_rollout_ref.rollout.top_p": "top_p=", "actor_rollout_ref.rollout.top_k": "top_k=",
    "actor_rollout_ref.actor.": "nothing (no training here)", "actor_rollout_ref.ref.": "nothing (no training here)",
    "critic.": "nothing (no training here)", "algorithm": "nothing (no training here)",
    "trainer.": "seed=, device= (the only trainer keys eval reads)",
    "data.filter_overlong_prompts": "max_prompt_length= (archer eval scores every problem, none is dropped) or "
                                    "data.truncation=left|right|middle",
}
READ_TRAINER_KEYS = ("trainer.seed", "trainer.device")
SAMPLING_TEMPERATURE = 1.0  # n > 1 without a temperature: sample (n greedy answers would be n copies of one)
SAMPLES, STATE, JUDGE_CACHE = "samples.jsonl", "eval_state.json", "judge_cache.jsonl"
EVAL_OVERLONG_FIX = ("pass max_prompt_length={longest} (archer eval scores every problem: it never drops an overlong "
                     "prompt, so data.filter_overlong_prompts does not apply), or cut prompts with "
                     "data.truncation=left|right|middle")


def eval_config(overrides: Sequence[str]) -> DictConfig:
    """The RL config with the short keys mapped (``model=M`` is ``actor_rollout_ref.model.path=M``, ``judge.url``
    is ``eval.judge.url``, ``tools=[python]`` configures the built-in python tool); n > 1 without a temperature
    samples at temperature 1.0; temperature > 0 samples."""
    mapped, given = [], set()
    for raw in overrides:
        key, sep, value = raw.lstrip("+").partition("=")
        if key == "tools":  # tools=[python,search]: the built-in tools by name (their params as full keys)
            names = [t.strip() for t in value.strip("[]").split(",") if t.strip()]
            mapped += [f"{TOOLS_KEY}.{t}.class_path={t}" for t in names]
            continue
        full = EVAL_ALIASES.get(key) or (f"eval.{key}" if key.startswith("judge.") else key)
        unread = next((fix for prefix, fix in UNREAD_KEYS.items() if full.startswith(prefix)), None)
        if unread is not None and full not in READ_TRAINER_KEYS:
            log.warning("archer eval does not read %s (a training key); set %s", full, unread)
        given.add(full)
        mapped.append(f"{full}{sep}{value}")
    cfg = load_config("ppo_trainer", mapped)
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    if f"{_VAL}.temperature" not in given and int(val.n) > 1:
        val.temperature = SAMPLING_TEMPERATURE
        log.info("n=%d without a temperature: sampling at temperature=%.1f", int(val.n), SAMPLING_TEMPERATURE)
    if f"{_VAL}.do_sample" not in given:
        val.do_sample = float(val.temperature) > 0
    return cfg


def default_output_dir(model: Path) -> Path:
    """``eval_runs/<model folder>``, one per model: a checkpoint's (``<run>/checkpoints/global_step_N[/actor]``)
    is ``eval_runs/<run>/global_step_N`` and a run's ``hf_model`` is ``eval_runs/<run>/hf_model``."""
    folder = model.resolve()
    if folder.name == CHECKPOINT_ACTOR:
        folder = folder.parent
    if folder.parent.name == "checkpoints":
        return Path("eval_runs") / folder.parent.parent.name / folder.name
    if folder.name == "hf_model":
        return Path("eval_runs") / folder.parent.name / folder.name
    return Path("eval_runs") / folder.name


def _fingerprint(cfg: DictConfig, model: Path, specs: Sequence[BenchmarkSpec]) -> dict[str, Any]:
    """What the samples depend on; a resume must match it."""
    rollout = cfg.actor_rollout_ref.rollout
    return {"model": str(model.resolve()), "val_kwargs": OmegaConf.to_container(rollout.val_kwargs),
            "max_prompt_length": int(cfg.data.max_prompt_length), "response_length": int(rollout.response_length),
            "seed": int(cfg.trainer.seed), "batch_size": int(cfg.eval.batch_size),
            "multi_turn": OmegaConf.to_container(rollout.multi_turn), "tools": OmegaConf.to_container(rollout.tools),
            "benchmarks": {s.name: {"file": s.file, "prompt": s.prompt, "system": s.system} for s in specs}}


def _read_samples(path: Path) -> list[ProblemRecord]:
    """The records of earlier runs with their rule scores (a judge's verdicts are applied again, from its cache);
    a line cut by an interrupted write is dropped (its batch is redone)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        for sample in record["samples"]:
            if "rule_acc" in sample:
                sample["acc"] = sample.pop("rule_acc")
                sample.pop("judge", None)
                sample.pop("judge_error", None)
                sample["extras"].pop("rule_acc", None)
        records.append(record)
    return records


def _done_batches(records: list[ProblemRecord], sizes: dict[str, int], batch_size: int) -> set[tuple[str, int]]:
    """(benchmark, batch) pairs whose every problem is in ``records``."""
    seen: dict[tuple[str, int], int] = {}
    for r in records:
        key = (r["benchmark"], r["index"] // batch_size)
        seen[key] = seen.get(key, 0) + 1
    return {(b, i) for (b, i), count in seen.items() if b in sizes
            and count == min(batch_size, sizes[b] - i * batch_size)}


class EvalRun:
    """One ``archer eval``: config, benchmarks, the run folder, generation, judging and the report."""

    def __init__(self, cfg: DictConfig) -> None:
        check_engine_name(cfg.actor_rollout_ref.rollout.name)
        check_agentic_config(cfg.actor_rollout_ref.rollout)
        ev = cfg.eval
        if not ev.benchmark:
            raise ArcherError("no benchmark given", "name one or more, e.g. benchmark=[gsm8k,math500]")
        self.cfg = cfg
        self.n = int(cfg.actor_rollout_ref.rollout.val_kwargs.n)
        self.ks = check_ks(list(ev.k), self.n) if ev.k else default_ks(self.n)
        self.model = resolve_model_folder(cfg.actor_rollout_ref.model.path)
        self.specs = [load_spec(str(name)) for name in ev.benchmark]
        names = [s.name for s in self.specs]
        if len(set(names)) < len(names):
            raise ArcherError(f"benchmark names repeat: {names} (a benchmark is named by its YAML file's name)",
                              "give each benchmark once, and your own YAML files names of their own")
        self.batch_size = int(ev.batch_size)
        if self.batch_size < 1:
            raise ArcherError(f"batch_size={self.batch_size} must be at least 1", "set batch_size=64 (or any >= 1)")
        self.out = Path(ev.output_dir) if ev.output_dir else default_output_dir(self.model)
        self.lock: FolderLock | None = None
        self.judged: set[str] = set()  # the benchmarks a judge scored, and how many samples it could not grade
        self.ungraded: dict[str, int] = {}
        self.tokenizer = load_tokenizer(cfg.data.tokenizer or self.model, role="model")
        self.datasets = {s.name: self._dataset(s) for s in self.specs}

    def _dataset(self, spec: BenchmarkSpec) -> RLDataset:
        data = self.cfg.data
        limit = self.cfg.eval.limit
        rows = load_rows(spec, self.cfg.eval.data_dir, None if limit is None else int(limit))
        if not self.cfg.custom_reward_function.path:  # every row has a built-in reward, known before generating
            check_routes(((r["data_source"], r.get("ability")) for r in rows), f"benchmark {spec.name!r}")
        return RLDataset(rows, self.tokenizer, max_prompt_length=int(data.max_prompt_length), truncation=data.truncation,
                         filter_overlong_prompts=False, chat_template=self.cfg.actor_rollout_ref.model.custom_chat_template,
                         apply_chat_template_kwargs=OmegaConf.to_container(data.apply_chat_template_kwargs),
                         where=f"benchmark {spec.name!r}", overlong_fix=EVAL_OVERLONG_FIX)

    def _resume(self) -> list[ProblemRecord]:
        state = {"fingerprint": _fingerprint(self.cfg, self.model, self.specs)}
        state_path = self.out / STATE
        if state_path.is_file():
            earlier = json.loads(state_path.read_text(encoding="utf-8")).get("fingerprint", {})
            differ = [key for key, value in state["fingerprint"].items() if earlier.get(key) != value]
            if earlier.get("model") != state["fingerprint"]["model"]:
                raise ArcherError(f"{self.out} holds an evaluation of another model ({earlier.get('model')}; this one "
                                  f"is {state['fingerprint']['model']})",
                                  "choose another output_dir=FOLDER for this model (without output_dir each model "
                                  "gets its own folder under eval_runs/)")
            if differ:
                raise ArcherError(f"{self.out} holds an evaluation with other settings ({', '.join(differ)} differ "
                                  "from this one's)", "choose another output_dir=FOLDER, or rerun with the settings "
                                  f"of {state_path} to resume it")
        self.lock = hold_folder(self.out, "archer eval")  # one process writes an output folder, until run ends
        write_json_atomically(state_path, state)
        records = [r for r in _read_samples(self.out / SAMPLES) if r.get("benchmark") in self.datasets]
        done = _done_batches(records, {b: len(d) for b, d in self.datasets.items()}, self.batch_size)
        kept = [r for r in records if (r["benchmark"], r["index"] // self.batch_size) in done]
        write_text_atomically(self.out / SAMPLES, "".join(json.dumps(r) + "\n" for r in kept))  # drop partial batches
        return kept

    def run(self) -> dict[str, Any]:
        refuse_if_held(self.out, "archer eval")  # a folder another process writes is refused first
        try:
            return self._run()
        finally:
            if self.lock is not None:
                self.lock.release()
                self.lock = None

    def _run(self) -> dict[str, Any]:
        records = self._resume()
        done = {(r["benchmark"], r["index"] // self.batch_size) for r in records}
        todo = [(name, b) for name, data in self.datasets.items()
                for b in range((len(data) + self.batch_size - 1) // self.batch_size) if (name, b) not in done]
        if records:
            log.info("resuming %s: %d problem(s) already evaluated", self.out, len(records))
        if todo:
            records += self._generate(todo)
        self._judge(records)
        return self._report(records)

    def _generate(self, todo: list[tuple[str, int]]) -> list[ProblemRecord]:
        cfg = self.cfg
        generator = GenerationWorker(cfg.actor_rollout_ref, self.model, device=pick_device(cfg.trainer.device),
                                     tokenizer=self.tokenizer,
                                     chat_template_kwargs=OmegaConf.to_container(cfg.data.apply_chat_template_kwargs))
        reward = build_reward_manager(cfg, self.tokenizer)
        evaluator = Evaluator(generator.generate_sequences, reward, self.tokenizer.pad_token_id, n=self.n,
                              seed=int(cfg.trainer.seed))
        new: list[ProblemRecord] = []
        total = sum(min(self.batch_size, len(self.datasets[b]) - i * self.batch_size) for b, i in todo)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("problems"),
                   TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
        with Progress(*columns) as progress, (self.out / SAMPLES).open("a", encoding="utf-8") as f:
            task = progress.add_task(f"eval x{self.n}", total=total)
            for name, b in todo:
                data = self.datasets[name]
                items = [data[i] for i in range(b * self.batch_size, min(len(data), (b + 1) * self.batch_size))]
                progress.update(task, description=f"{name} x{self.n}")
                _, batch_records = evaluator.run_batch(items, b, uid_prefix=name)
                for record in batch_records:
                    record["benchmark"] = name
                f.write("".join(json.dumps(r) + "\n" for r in batch_records))  # one write: a batch lands whole
                f.flush()
                os.fsync(f.fileno())
                new += batch_records
                progress.advance(task, len(items))
        return new

    def _judge(self, records: list[ProblemRecord]) -> None:
        """With judge.url: the judge's verdict becomes each sample's acc of the sets with a judge_prompt; the rule's
        acc is kept as rule_acc."""
        judged = {s.name: s for s in self.specs if s.judge_prompt}
        self.judged, self.ungraded = (set(judged) if self.cfg.eval.judge.url else set()), {}
        if not self.cfg.eval.judge.url:
            if judged:
                log.info("no judge.url: %s scored by the rule reward only", ", ".join(judged))
            return
        judge = Judge(self.cfg.eval.judge, self.out / JUDGE_CACHE)
        targets = [(r, s) for r in records if r["benchmark"] in judged for s in r["samples"]]
        prompts = [fill_prompt(judged[r["benchmark"]].judge_prompt, _question(r), r["ground_truth"], s["answer"])
                   for r, s in targets]
        ungraded: dict[str, int] = {}
        for (record, sample), verdict in zip(targets, judge.judge(prompts), strict=True):
            sample.setdefault("rule_acc", sample["acc"])
            sample["extras"]["rule_acc"] = sample["rule_acc"]
            sample["judge"] = verdict.correct
            sample["acc"] = float(verdict.correct)
            sample.pop("judge_error", None)
            if verdict.reason:
                sample["judge_error"] = verdict.reason
                ungraded[record["benchmark"]] = ungraded.get(record["benchmark"], 0) + 1
        self.ungraded = ungraded
        for name, count in ungraded.items():
            log.warning("the judge could not grade %d sample(s) of %s: graded not correct (the reasons are in %s, "
                        "judge_error)", count, name, self.out / SAMPLES)
        write_text_atomically(self.out / SAMPLES, "".join(json.dumps(r) + "\n" for r in records))

    def scored_by(self, spec: BenchmarkSpec) -> str:
        if spec.judge_prompt and self.cfg.eval.judge.url:
            return f"judge ({self.cfg.eval.judge.model})"
        return "rule: math-verify" if spec.answer_type == "math" else "rule: exact match"

    def _report(self, records: list[ProblemRecord]) -> dict[str, Any]:
        metrics = records_metrics(records, self.n, self.ks, source_key="benchmark")
        benchmarks = {s.name: {"problems": len(self.datasets[s.name]), "scored_by": self.scored_by(s),
                               "data_source": s.data_source, "answer_type": s.answer_type, "spec": s.origin,
                               **({"judge_ungraded": self.ungraded.get(s.name, 0)} if s.name in self.judged else {})}
                      for s in self.specs}
        results = {"model": recorded_path(self.model), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "n": self.n, "k": self.ks, "benchmarks": benchmarks, "metrics": metrics,
                   "config": OmegaConf.to_container(self.cfg, resolve=True)}
        write_json_atomically(self.out / "results.json", results)
        table = results_table(results)
        write_text_atomically(self.out / "results.md", table)
        plot_results(results, self.out / "results.png")
        print(table, end="")
        print(f"results: {self.out}")
        return results


def _question(record: ProblemRecord) -> str:
    """The question of a record: its last user message."""
    prompt = record["prompt"]
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1]) if users else ""
    return str(prompt)


