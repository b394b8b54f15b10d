"""``archer quickstart``: the whole pipeline on a laptop CPU in a few minutes.

1. generate a built-in task (train/val/sft parquet, verl schema) whose warm-start solutions leave RL a
   behaviour to select: for ``task=arithmetic`` (the default) they mix a boxed final answer with a prose one
   ("The answer is 7."), and the reward reads only boxed answers; for ``task=tool_arithmetic`` they mix
   Python tool calls with in-the-head estimates of products too large for the model to compute;
2. build the built-in tiny Qwen2-architecture model and its BPE tokenizer as an HF folder;
3. a short supervised warm start (``archer sft``) that leaves the model clearly below the ceiling;
4. GRPO (``archer train``; ``archer quickstart algorithm=NAME`` runs a preset of archer/config/algorithm/
   instead) from the warm-started folder, validating before and after, with the entropy and influence traces on
   (and the Python tool in the rollouts of ``task=tool_arithmetic``);
5. ``summary.json`` with the before/after accuracy (and tool-call rate, for the tool task), the RL-trained
   policy (the last checkpoint's ``actor/`` folder) and where the RL run and its traces are (``<out>/rl``, or
   wherever ``trainer.default_local_dir`` / the traces' ``output_dir`` put them); the commands that evaluate the
   policy on the validation set (``archer eval``, with the benchmark YAML step 1 writes), repeat the RL stage and
   open the trace explorer.

Each task's sizes, knobs and stage overrides form a ``Recipe`` (``RECIPES``). Both stages' run folders are
checked before anything is written (trainer/run_folder.py): a rerun into the same ``--out`` with other settings
is refused and changes nothing, a finished one prints its results again, an interrupted one continues.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from rich.console import Console

from archer.atomic_files import write_json_atomically, write_text_atomically
from archer.config.loader import load_config
from archer.data.tasks import get_task, write_task_files
from archer.errors import ArcherError
from archer.models.tiny import build_tiny_model
from archer.trace.entropy import trace_dir
from archer.trainer.config_check import check_config
from archer.trainer.ppo import PPOTrainer
from archer.trainer.run_folder import CONFIG_FILE, SUMMARY_FILE, RunFolder
from archer.trainer.sft import check_sft_config, run_sft

TASK = "arithmetic"
TASK_KNOBS: dict[str, Any] = {"num_operands": 3, "max_operand": 9, "unboxed_fraction": 0.6}
N_TRAIN, N_VAL, N_SFT = 1000, 200, 1500
# The tiny model's positions: room for ARPO's prompts (up to about 1,900 tokens with its small tokenizer) and a
# response, so that docs/agentic.md's ARPO command runs on the tool quickstart's model. Its rotary positions have no
# weights: the number changes nothing the quickstart computes.
MODEL_POSITIONS = 4096
VAL_KEY = "val-core/archer/arithmetic/acc/mean@1"
# where a quickstart without --out runs: a <date>-<time> folder of its own
DEFAULT_ROOT = Path("runs") / "quickstart"
RUN_NAME = re.compile(r"\d{8}-\d{6}")

SFT_OVERRIDES = [
    "data.train_batch_size=32",
    "data.micro_batch_size_per_gpu=32",
    "data.max_length=96",
    "optim.lr=3e-3",
    "optim.warmup_steps_ratio=0.05",
    "trainer.total_training_steps=400",
    "trainer.logger=[console]",
    "model.enable_gradient_checkpointing=false",
]

# The RL algorithm of the quickstart; `archer quickstart algorithm=NAME` replaces it with a whole preset.
DEFAULT_ALGORITHM_OVERRIDES = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.entropy_coeff=0",
]

# The task's budget and shapes, whatever the algorithm.
RL_OVERRIDES = [
    "data.train_batch_size=32",
    "data.max_prompt_length=64",
    "data.max_response_length=48",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    "actor_rollout_ref.actor.optim.lr=2e-4",
    "reward_model.overlong_buffer.len=16",  # for presets with a buffer (DAPO's 4096 does not fit 48 tokens)
    "trainer.total_training_steps=40",
    "trainer.test_freq=10",
    "trainer.save_freq=10",  # the last checkpoint's actor/ is the RL-trained policy (archer eval); an interrupted run continues
    "trainer.logger=[console,jsonl]",
    # the tiny model's generation memory is small: on a GPU the fast engine keeps its KV cache and CUDA graphs
    # between steps instead of re-capturing them every step (no effect on the CPU's hf engine)
    "actor_rollout_ref.rollout.free_cache_engine=false",
    # what RL does, token by token: both traces (bit-identical training; cost in BENCHMARKS.md)
    "trainer.entropy_trace.enable=true",
    "trainer.influence_trace.enable=true",
]


@dataclass(frozen=True)
class Recipe:
    """One task's quickstart: the data (task, knobs, sizes), the warm start's and the RL stage's overrides,
    and the validation metrics reported before and after RL (summary key ``val_<name>_before_rl`` -> metric)."""

    task: str
    knobs: dict[str, Any]
    n_train: int
    n_val: int
    n_sft: int
    sft_overrides: list[str]
    rl_overrides: list[str]
    reported: dict[str, str] = field(default_factory=dict)


def replacing(overrides: Sequence[str], *changes: str) -> list[str]:
    """``overrides`` with each ``key=value`` of ``changes`` in place of the same key (appended if it is new)."""
    keys = {c.lstrip("+").partition("=")[0] for c in changes}
    return [*(o for o in overrides if o.lstrip("+").partition("=")[0] not in keys), *changes]


TOOL_TASK = "tool_arithmetic"
# The tool task's warm start: its solutions hold the tool's output, which is context and carries no loss.
TOOL_SFT_OVERRIDES = replacing(SFT_OVERRIDES, "data.tool_result_tag=result")
# Its RL stage: rollouts stop at </python>, the sandboxed Python tool runs the call and its output comes back
# as " <result>\n...\n</result>" (context, response_mask 0); one call per response is enough. Each call starts
# a sandboxed interpreter, so steps cost more than the arithmetic ones; the tool-call rate saturates by step 10.
TOOL_RL_OVERRIDES = replacing(
    RL_OVERRIDES,
    "data.max_response_length=64",
    "trainer.total_training_steps=20",
    "+actor_rollout_ref.rollout.tools.tool_instances.python.class_path=python",
    "actor_rollout_ref.rollout.tools.call_limit=1",
)

RECIPES: dict[str, Recipe] = {
    TASK: Recipe(TASK, TASK_KNOBS, N_TRAIN, N_VAL, N_SFT, SFT_OVERRIDES, RL_OVERRIDES, {"acc": VAL_KEY}),
    TOOL_TASK: Recipe(
        TOOL_TASK, {"num_operands": 2, "min_operand": 320, "max_operand": 999, "ops": "*", "tool_fraction": 0.4},
        N_TRAIN, N_VAL, 1500, TOOL_SFT_OVERRIDES, TOOL_RL_OVERRIDES,
        {"acc": "val-core/archer/tool_arithmetic/acc/mean@1",
         "tool_call_rate": "val-aux/archer/tool_arithmetic/used_tool/mean@1"}),
}


def task_corpus(data_dir: Path) -> list[str]:
    import pyarrow.parquet as pq

    texts: list[str] = []
    table = pq.read_table(data_dir / "sft.parquet").to_pylist()
    for row in table:
        texts.extend(m["content"] for m in row["prompt"])
        texts.append(row["response"])
    return texts


def chosen_preset(rl_extra: Sequence[str]) -> str | None:
    """The NAME of an ``algorithm=NAME`` (or ``+algorithm=NAME``) among the RL overrides, if any."""
    for arg in rl_extra:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "algorithm":
            return value
    return None


def algorithm_overrides(rl_extra: Sequence[str]) -> list[str]:
    """The quickstart's own algorithm keys, unless the user picked a preset with ``algorithm=NAME``."""
    return [] if chosen_preset(rl_extra) is not None else list(DEFAULT_ALGORITHM_OVERRIDES)


def stage_files(run: Path) -> dict[str, Path]:
    """Where step 1 writes the task's train, val and sft parquet files."""
    return {split: run / "data" / f"{split}.parquet" for split in ("train", "val", "sft")}


def write_val_benchmark(run: Path, task: str) -> Path:
    """``<run>/data/val_benchmark.yaml``: the validation file beside it as an ``archer eval`` benchmark (verl's
    schema)."""
    path = run / "data" / "val_benchmark.yaml"
    write_text_atomically(path, f"# the quickstart's validation set as an `archer eval` benchmark\nfile: val.parquet\n"
                                f"format: verl\ndata_source: {get_task(task).data_source}\nanswer_type: math\n")
    return path


def sft_config(run: Path, seed: int, recipe: Recipe, sft_extra: Sequence[str] = ()) -> DictConfig:
    """The warm start's config: the tiny model of step 2 on the sft file of step 1, into ``run/sft``."""
    return load_config("sft_trainer", [
        f"model.partial_pretrain={run / 'base_model'}", f"data.train_files={stage_files(run)['sft']}",
        f"trainer.default_local_dir={run / 'sft'}", f"trainer.seed={seed}", *recipe.sft_overrides, *sft_extra])


def warm_start(run: Path, seed: int, console: Console, sft_extra: Sequence[str] = (),
               recipe: Recipe = RECIPES[TASK]) -> tuple[dict[str, Path], Path]:
    """Steps 1-3 into ``run``: task data (``run/data``), tiny model (``run/base_model``) and its supervised
    warm start (``run/sft``); returns the task files and the warm-started model folder. Steps 1-2 are kept
    from an earlier run whose warm start has begun (its config.yaml is written after them)."""
    files = stage_files(run)
    if (run / "sft" / CONFIG_FILE).is_file():
        console.rule("[bold]1-2/4 task data and tiny model: kept from the earlier run in this folder")
    else:
        console.rule(f"[bold]1/4 task data ({recipe.task})")
        files = write_task_files(recipe.task, run / "data", n_train=recipe.n_train, n_val=recipe.n_val,
                                 n_sft=recipe.n_sft, seed=seed, **recipe.knobs)
        console.rule("[bold]2/4 tiny model")
        build_tiny_model(run / "base_model", task_corpus(run / "data"), max_position_embeddings=MODEL_POSITIONS,
                         seed=seed)
    console.rule("[bold]3/4 supervised warm start")
    return files, run_sft(sft_config(run, seed, recipe, sft_extra))


def parse_quickstart_args(args: Sequence[str]) -> tuple[int, Recipe, list[str]]:
    """``seed=N`` sets every seed of the pipeline and ``task=NAME`` picks the recipe; other ``key=value`` go
    to the RL stage."""
    seed, recipe, rest = 1, RECIPES[TASK], []
    for arg in args:
        if arg.startswith("seed="):
            try:
                seed = int(arg.split("=", 1)[1])
            except ValueError:
                raise ArcherError(f"quickstart seed must be an integer, got {arg!r}", "write e.g. seed=3") from None
        elif arg.startswith("task="):
            name = arg.split("=", 1)[1]
            if name not in RECIPES:
                raise ArcherError(f"the quickstart has no task {name!r}; its tasks are {sorted(RECIPES)}",
                                  f"write task=NAME with NAME one of {sorted(RECIPES)}")
            recipe = RECIPES[name]
        else:
            rest.append(arg)
    return seed, recipe, rest


def rl_outputs(cfg: DictConfig) -> dict[str, str | None]:
    """Where the RL stage of ``cfg`` writes: its run directory and each trace folder (None when it is off)."""
    run_dir = Path(cfg.trainer.default_local_dir)
    traces: dict[str, str | None] = {
        kind: os.path.abspath(trace_dir(cfg.trainer[kind], run_dir, kind)) if cfg.trainer[kind].enable else None
        for kind in ("entropy_trace", "influence_trace")}
    return {"rl_run_dir": os.path.abspath(run_dir), **traces}


def repeat_command(rl_args: Sequence[str], rl_run_dir: Path) -> str:
    """The ``archer train`` command that repeats the RL stage into ``<rl_run_dir>_again``."""
    kept = [a for a in rl_args if a.lstrip("+").partition("=")[0] != "trainer.default_local_dir"]
    again = rl_run_dir.with_name(rl_run_dir.name + "_again")
    return "archer train " + " ".join(shlex.quote(a) for a in [*kept, f"trainer.default_local_dir={again}"])


def eval_command(rl_cfg: DictConfig, model: str, benchmark: Path, out: Path) -> str:
    """The ``archer eval`` command that evaluates ``model`` on ``benchmark`` as the RL stage validated: greedy,
    its prompt and response lengths and tools."""
    tools = rl_cfg.actor_rollout_ref.rollout.tools
    args = [f"model={model}", f"benchmark=[{benchmark}]", f"max_prompt_length={rl_cfg.data.max_prompt_length}",
            f"max_response_length={rl_cfg.data.max_response_length}"]
    for name, tool in tools.tool_instances.items():
        args.append(f"+actor_rollout_ref.rollout.tools.tool_instances.{name}.class_path={tool.class_path}")
    if tools.tool_instances:
        args.append(f"actor_rollout_ref.rollout.tools.call_limit={tools.call_limit}")
    return "archer eval " + " ".join(shlex.quote(a) for a in [*args, f"output_dir={out}"])


def print_results(console: Console, summary: dict[str, Any], algorithm: str, rl_cfg: DictConfig,
                  rl_args: Sequence[str]) -> None:
    """The figures and where they are, and the commands that evaluate the policy, repeat the RL stage and open
    the traces."""
    before, after = summary["val_acc_before_rl"], summary["val_acc_after_rl"]
    console.print(f"validation accuracy before RL: {before:.3f}   after RL: {after:.3f}   "
                  f"({(after - before) * 100:+.1f} points, {summary['steps']} {algorithm} steps)")
    if "val_tool_call_rate_before_rl" in summary:
        console.print(f"tool-call rate before RL: {summary['val_tool_call_rate_before_rl']:.3f}   "
                      f"after RL: {summary['val_tool_call_rate_after_rl']:.3f}")
    run, rl_dir = Path(summary["run_dir"]), Path(summary["rl_run_dir"])
    console.print(f"run directory: {run}  (summary.json); RL run: {rl_dir}  (metrics.jsonl, plots/)")
    if summary.get("model_path") is not None and "val_benchmark" in summary:
        console.print("evaluate the RL-trained policy on the validation set with:")
        print(f"  {eval_command(rl_cfg, summary['model_path'], Path(summary['val_benchmark']), run / 'eval')}")
    else:  # trainer.save_freq=-1 (or a quickstart of an archer that did not save it)
        console.print("the RL-trained policy was not saved (trainer.save_freq=-1)")
    console.print("repeat the RL stage with:")
    print(f"  {repeat_command(rl_args, rl_dir)}")
    trace = summary["influence_trace"] or summary["entropy_trace"]
    if trace is not None:
        console.print("explore what RL did, token by token:")
        print(f"  archer viz --trace-dir {shlex.quote(trace)}")


def default_run_folder(root: Path) -> Path:
    """The folder of a quickstart without ``--out``: the newest unfinished one under ``root`` (a
    ``<date>-<time>`` folder without summary.json, which the quickstart writes last), else a new one."""
    started = sorted(p for p in root.glob("*") if p.is_dir() and RUN_NAME.fullmatch(p.name)) if root.is_dir() else []
    if started and not (started[-1] / SUMMARY_FILE).is_file():
        return started[-1]
    return root / time.strftime("%Y%m%d-%H%M%S")


def resume_command(run: Path, args: Sequence[str]) -> str:
    """The ``archer quickstart`` command that continues the quickstart in ``run``."""
    return "archer quickstart " + " ".join(shlex.quote(a) for a in ["--out", str(run), *args])


def run_quickstart(args: Sequence[str] = (), out_dir: str | None = None) -> dict[str, Any]:
    """The whole pipeline into ``out_dir``; the RL stage's run directory is ``<out_dir>/rl`` unless the
    overrides set trainer.default_local_dir, and the summary and printed commands follow it either way."""
    seed, recipe, rl_extra = parse_quickstart_args(args)
    console = Console()
    start = time.perf_counter()
    # absolute, so that summary.json and the printed commands name the same files from any directory
    run = Path(os.path.abspath(out_dir)) if out_dir else default_run_folder(Path(os.path.abspath(DEFAULT_ROOT)))
    if out_dir is None and run.exists():
        print(f"continuing the unfinished quickstart in {run} (--out DIR starts another)")

    algorithm_name = chosen_preset(rl_extra) or "grpo"
    data_dir = run / "data"

    def rl_args(model: Path | str) -> list[str]:
        return [f"actor_rollout_ref.model.path={model}", f"data.train_files={data_dir / 'train.parquet'}",
                f"data.val_files={data_dir / 'val.parquet'}", f"trainer.default_local_dir={run / 'rl'}",
                f"trainer.seed={seed}", f"data.seed={seed}", *algorithm_overrides(rl_extra), *recipe.rl_overrides,
                *rl_extra]

    # Bad overrides, and another experiment in a stage's folder, fail before anything is written.
    rl_cfg = load_config("ppo_trainer", rl_args(run / "sft" / "hf_model"))
    check_config(rl_cfg)
    sft_cfg = sft_config(run, seed, recipe)
    check_sft_config(sft_cfg)
    rl_folder = RunFolder(rl_cfg, "ppo_trainer")
    try:
        RunFolder(sft_cfg, "sft_trainer").check_experiment()
        rl_folder.check_experiment()
    except ArcherError as err:
        raise ArcherError(err.problem, f"give this quickstart another --out DIR (without --out, a run continues the "
                                       f"latest unfinished one), or the settings of the run in {run} to continue it"
                          ) from None
    steps = rl_cfg.trainer.total_training_steps
    if (run / SUMMARY_FILE).is_file() and steps is not None and rl_folder.finished_summary(int(steps)) is not None:
        summary = json.loads((run / SUMMARY_FILE).read_text(encoding="utf-8"))
        print(f"the quickstart in {run} has finished; nothing to do (a new --out runs it again):")
        print_results(console, summary, algorithm_name, rl_cfg, rl_args(run / "sft" / "hf_model"))
        return summary
    run.mkdir(parents=True, exist_ok=True)

    try:
        files, sft_model = warm_start(run, seed, console, recipe=recipe)
        benchmark = write_val_benchmark(run, recipe.task)

        console.rule(f"[bold]4/4 RL ({algorithm_name})")
        final_args = rl_args(sft_model)
        rl_cfg = load_config("ppo_trainer", final_args)
        rl_summary = PPOTrainer(rl_cfg).fit()
    except KeyboardInterrupt:
        again = " (or the same command without --out)" if out_dir is None else ""
        print(f"the quickstart in {run} stopped; continue it with: {resume_command(run, args)}{again}", file=sys.stderr)
        raise

    reported = {}
    for name, key in recipe.reported.items():
        reported[f"val_{name}_before_rl"] = rl_summary["val_before"].get(key, float("nan"))
        reported[f"val_{name}_after_rl"] = rl_summary["val_after"].get(key, float("nan"))
    summary = {
        "task": recipe.task,
        **reported,
        "steps": rl_summary["steps"],
        "wall_time_s": time.perf_counter() - start,
        "rl_wall_time_s": rl_summary["wall_time_s"],
        "seed": seed,
        "model_path": rl_summary.get("latest_checkpoint"),
        "sft_model_path": str(sft_model),
        "train_files": [str(files["train"])],
        "val_files": [str(files["val"])],
        "val_benchmark": str(benchmark),
        "run_dir": str(run),
        **rl_outputs(rl_cfg),
    }
    write_json_atomically(run / SUMMARY_FILE, summary)
    console.rule("[bold]quickstart done")
    print_results(console, summary, algorithm_name, rl_cfg, final_args)
    return summary
