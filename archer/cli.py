"""``archer <command>``: train, sft, eval, data, quickstart, viz, health, build-index, tools check.

Every command turns an ArcherError into one clear message and exit status 2, without a traceback.
``archer train --help`` and ``archer sft --help`` list the main config keys with their defaults (read
from the YAML); ``--cfg job`` checks the resolved config, prints it and exits without running, as in Hydra.
``--config-path=DIR --config-name=NAME.yaml`` (``-cp``/``-cn``) reads a user's own full YAML in verl's layout
(config/loader.py); ``hydra.run.dir=D`` makes D, writes Hydra's ``.hydra/config.yaml`` and ``overrides.yaml``
there and runs with D as the working directory, as verl's ``main_ppo`` (Hydra 1.1 behaviour;
``hydra.job.chdir=false`` stays put).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from archer.controller.ray_cluster import termination
from archer.errors import ArcherError

if TYPE_CHECKING:
    from omegaconf import DictConfig

# The keys `archer train --help` / `archer sft --help` show, by section; the YAML holds them all.
TRAIN_HELP_KEYS = {
    "data": ("train_files", "val_files", "prompt_key", "max_prompt_length", "max_response_length",
             "train_batch_size"),
    "actor_rollout_ref": ("model.path", "model.lora_rank", "actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size_per_gpu",
                          "actor.optim.lr", "actor.use_kl_loss", "actor.policy_loss.loss_mode", "rollout.n",
                          "rollout.temperature"),
    "algorithm": ("adv_estimator", "use_kl_in_reward", "rollout_correction.rollout_is",
                  "rollout_correction.bypass_mode"),
    "custom_reward_function": ("path", "name"),
    "reward_model": ("enable", "model.path", "rm_weight", "rule_weight"),
    "trainer": ("total_epochs", "total_training_steps", "default_local_dir", "save_freq", "test_freq",
                "val_before_train", "val_only", "resume_mode", "logger", "device", "v1.trainer_mode"),
}
SFT_HELP_KEYS = {
    "data": ("train_files", "val_files", "prompt_key", "response_key", "max_length", "train_batch_size",
             "micro_batch_size_per_gpu"),
    "model": ("partial_pretrain", "lora_rank"),
    "optim": ("lr", "lr_scheduler"),
    "trainer": ("total_epochs", "total_training_steps", "default_local_dir", "logger", "device"),
}
EVAL_HELP = """short keys (the RL config key they set):
  model=DIR              HF model folder or archer checkpoint (actor_rollout_ref.model.path)
  benchmark=[a,b]        names in archer/config/benchmark/ or paths of benchmark YAMLs (eval.benchmark)
  data_dir=DIR           folder the benchmark files resolve against, e.g. ../shared/data (eval.data_dir)
  n=8 k=[1,4,8]          samples per problem and the k of pass@k/maj@k (rollout.val_kwargs.n, eval.k)
  temperature top_p top_k  sampling (rollout.val_kwargs.*; n > 1 without temperature samples at 1.0)
  max_prompt_length max_response_length seed device limit batch_size score_workers output_dir
  tools=[python,search]  the built-in tools by name (their params as full keys); the agent loop generates
  judge.url judge.model judge.api_key_env   an OpenAI-compatible LLM judge for sets with a judge_prompt
any other RL config key is given in full, e.g. +actor_rollout_ref.rollout.tools.tool_instances.python.class_path=python"""


def config_help(config_name: str, sections: dict[str, tuple[str, ...]]) -> str:
    """The help epilog of a training command: its config sections and main keys with their defaults."""
    from omegaconf import OmegaConf

    from archer.config.loader import CONFIG_DIR, config_groups, group_options

    path = CONFIG_DIR / f"{config_name}.yaml"
    defaults = OmegaConf.load(path)
    lines = [f"config sections: {', '.join(k for k in defaults if k != 'defaults')}", "main keys (default):"]
    for section, keys in sections.items():
        for key in keys:
            parent, _, leaf = f"{section}.{key}".rpartition(".")
            node = OmegaConf.select(defaults, parent)
            value = "??? (required)" if OmegaConf.is_missing(node, leaf) else _shown(node[leaf])
            lines.append(f"  {section}.{key} = {value}")
    if config_name == "ppo_trainer":
        lines += [f"config groups: {group}=NAME, NAME one of {', '.join(group_options(group))}"
                  for group in sorted(config_groups())]
    lines += [f"every key, with what it does: {path}",
              "set keys as key=value (+key=value works too); --cfg job prints the resolved config and exits"]
    return "\n".join(lines)


def _shown(value: object) -> str:
    """A default as YAML writes it: null, true, [a, b]."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return str(value)


def _print_config(cfg: object) -> None:
    from omegaconf import OmegaConf

    print(OmegaConf.to_yaml(cfg), end="")


def _user_config(args: argparse.Namespace) -> Path | None:
    """The YAML that --config-path/--config-name name (a name without .yaml gets it, as in Hydra)."""
    if args.config_name is None:
        if args.config_path is not None:
            raise ArcherError("--config-path is given without --config-name",
                              "add --config-name=NAME.yaml (the YAML file inside that folder)")
        return None
    name = args.config_name if args.config_name.endswith((".yaml", ".yml")) else f"{args.config_name}.yaml"
    return Path(args.config_path or ".").expanduser() / name


def _load(config_name: str, args: argparse.Namespace) -> tuple[DictConfig, dict[str, str]]:
    from archer.config.loader import hydra_settings, load_config

    overrides, hydra = hydra_settings(args.overrides)
    return load_config(config_name, overrides, user_config=_user_config(args)), hydra


def _enter_hydra_run_dir(hydra: dict[str, str], cfg: DictConfig, overrides: Sequence[str]) -> None:
    """As Hydra does for verl's main_ppo: make hydra.run.dir, record the job's config there, and work in it."""
    from omegaconf import OmegaConf

    from archer.atomic_files import write_text_atomically

    if not hydra.get("hydra.run.dir"):
        return
    run_dir = Path(hydra["hydra.run.dir"]).expanduser().resolve()
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    write_text_atomically(run_dir / ".hydra" / "config.yaml", OmegaConf.to_yaml(cfg))
    write_text_atomically(run_dir / ".hydra" / "overrides.yaml", OmegaConf.to_yaml(list(overrides)))
    if hydra.get("hydra.job.chdir", "true").lower() not in ("false", "0", "no"):
        os.chdir(run_dir)
        logging.getLogger("archer").info("working directory: %s (hydra.run.dir, as Hydra runs verl)", run_dir)


def _train(args: argparse.Namespace) -> None:
    cfg, hydra = _load("ppo_trainer", args)  # before the trainer's heavy imports: typos fail fast
    from archer.trainer.config_check import check_config

    check_config(cfg)
    if args.cfg:
        _print_config(cfg)
        return
    _enter_hydra_run_dir(hydra, cfg, args.overrides)
    from archer.trainer.ppo import PPOTrainer

    summary = PPOTrainer(cfg).fit()
    if cfg.trainer.val_only:
        print(f"validated {summary['validated_model']} (step {summary['steps']}):")
        for key, value in summary["val_after"].items():
            print(f"  {key} = {value:.4f}")
        print(f"appended to {summary['val_only_file']}")
    print(f"run directory: {summary['run_dir']}")


def _sft(args: argparse.Namespace) -> None:
    cfg, hydra = _load("sft_trainer", args)
    from archer.trainer.sft import check_sft_config, run_sft

    check_sft_config(cfg)
    if args.cfg:
        _print_config(cfg)
        return
    _enter_hydra_run_dir(hydra, cfg, args.overrides)
    out = run_sft(cfg)
    print(f"SFT model: {out}")


def _eval(args: argparse.Namespace) -> None:
    from archer.eval.run import EvalRun, eval_config
    from archer.trainer.config_check import check_counts

    cfg = eval_config(args.overrides)
    check_counts(cfg)
    if args.cfg:
        _print_config(cfg)
        return
    EvalRun(cfg).run()


def _data(args: argparse.Namespace) -> None:
    from archer.data.tasks import write_task_files

    knobs = dict(_parse_knob(k) for k in args.knob)
    paths = write_task_files(args.task, args.out, n_train=args.train_size, n_val=args.val_size, seed=args.seed,
                             **knobs)
    for name, path in paths.items():
        print(f"{name}: {path}")


def _parse_knob(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise ArcherError(f"task option {text!r} is not NAME=VALUE", "write task options as --knob num_operands=3")
    key, value = text.split("=", 1)
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, value


def _quickstart(args: argparse.Namespace) -> None:
    from archer.trainer.quickstart import run_quickstart

    run_quickstart(args.overrides, out_dir=args.out)


def _viz(args: argparse.Namespace) -> None:
    from archer.viz.explorer import existing_trace_dir

    trace_dir = existing_trace_dir(args.trace_dir)  # a wrong path fails before Gradio's import
    from archer.viz.app import launch

    launch(trace_dir, args.model_path, host=args.host, port=args.port, run_dir=args.run_dir)


def _health(args: argparse.Namespace) -> None:
    from archer.health.offline import print_replay

    print_replay(args.run_dir, args.overrides, as_json=args.json)


def _build_index(args: argparse.Namespace) -> None:
    from pathlib import Path

    from archer.tools.bm25_index import build_index

    n = build_index(Path(args.corpus), Path(args.out), overwrite=args.overwrite)
    print(f"BM25 index of {n} passages: {args.out}")


def _config_file_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config-path", "-cp", default=None, metavar="DIR",
                   help="folder of your own full config YAML in verl's layout (relative: to the current folder)")
    p.add_argument("--config-name", "-cn", default=None, metavar="NAME.yaml",
                   help="that YAML's file name; its keys replace archer's defaults, overrides apply after")


def _tools_check(args: argparse.Namespace) -> None:
    from archer.tools.check import report

    text, ready = report(args.python or sys.executable)
    print(text)
    if not ready:
        raise ArcherError("this machine cannot isolate the Python tool's snippets", "see the lines marked OFF above")


Subcommands = argparse._SubParsersAction  # what add_subparsers returns (argparse names no public type)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="archer", description="RL post-training of language models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_config_command(sub, "train", _train, "ppo_trainer", TRAIN_HELP_KEYS,
                        summary="RL training (PPO/GRPO/...) with Hydra overrides in verl's key names",
                        overrides="key=value or +key=value, e.g. data.train_files=F")
    _add_config_command(sub, "sft", _sft, "sft_trainer", SFT_HELP_KEYS,
                        summary="supervised fine-tuning on prompt/response data",
                        overrides="key=value, e.g. model.partial_pretrain=DIR data.train_files=F")
    for add in (_add_eval, _add_data, _add_quickstart, _add_viz, _add_health, _add_build_index, _add_tools):
        add(sub)
    return parser


def _add_config_command(sub: Subcommands, name: str, func: Callable[[argparse.Namespace], None], config_name: str,
                        help_keys: Sequence[str], *, summary: str, overrides: str) -> None:
    """A trainer command (train, sft): Hydra overrides of ``config_name``, --cfg job and a user's config file;
    its --help lists ``help_keys`` with their defaults."""
    p = sub.add_parser(name, help=summary, epilog=config_help(config_name, help_keys),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help=overrides)
    p.add_argument("--cfg", choices=["job"], help="print the resolved config (checked, as YAML) and exit")
    _config_file_args(p)
    p.set_defaults(func=func)


def _add_eval(sub: Subcommands) -> None:
    p = sub.add_parser("eval", help="evaluate a model on benchmarks: mean@n, pass@k, maj@k (docs/eval.md)",
                       epilog=EVAL_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="e.g. model=DIR benchmark=[gsm8k,math500] n=8 k=[1,4,8] data_dir=D")
    p.add_argument("--cfg", choices=["job"], help="print the resolved config (as YAML) and exit")
    p.set_defaults(func=_eval)


def _add_data(sub: Subcommands) -> None:
    p = sub.add_parser("data", help="generate a built-in task's train/val/sft parquet files")
    p.add_argument("--task", default="arithmetic", help="built-in task name (arithmetic, countdown, tool_arithmetic)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--val-size", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE", help="task difficulty option")
    p.set_defaults(func=_data)


def _add_quickstart(sub: Subcommands) -> None:
    p = sub.add_parser("quickstart", help="tiny model, SFT warm start, GRPO, before/after accuracy (CPU, minutes)")
    p.add_argument("--out", default=None, help="run directory (default: the latest unfinished runs/quickstart/<date>-<time>, continued, "
                   "else a new one)")
    p.add_argument("overrides", nargs="*", help="e.g. seed=3, task=tool_arithmetic, or trainer keys for the RL stage")
    p.set_defaults(func=_quickstart)


def _add_viz(sub: Subcommands) -> None:
    p = sub.add_parser("viz", help="explore an entropy or influence trace in the browser (Gradio)")
    p.add_argument("--trace-dir", required=True, help="a trace folder, e.g. <run>/entropy_trace")
    p.add_argument("--model-path", default=None, help="tokenizer folder (default: the trace's own tokenizer/)")
    p.add_argument("--run-dir", default=None, help="the run whose health flags the Health tab shows (default: the "
                   "trace's parent folder; a folder the trace's files name is never read)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7862)
    p.set_defaults(func=_viz)


def _add_health(sub: Subcommands) -> None:
    p = sub.add_parser("health", help="the training health checks over a run directory, made before them too "
                       "(docs/health.md)")
    p.add_argument("run_dir", help="an `archer train` run directory (trainer.default_local_dir)")
    p.add_argument("overrides", nargs="*", help="thresholds other than the run's, e.g. trainer.health.window=5")
    p.add_argument("--json", action="store_true", help="print the flags as JSON (health.jsonl's records)")
    p.set_defaults(func=_health)


def _add_build_index(sub: Subcommands) -> None:
    p = sub.add_parser("build-index", help="build a local BM25 index for the search tool (bm25s)")
    p.add_argument("--corpus", required=True, help="passages as .jsonl or .parquet with text (and id, title)")
    p.add_argument("--out", required=True, help="index folder: new or empty (a folder of other files is refused)")
    p.add_argument("--overwrite", action="store_true", help="replace the archer index already in --out (atomically)")
    p.set_defaults(func=_build_index)


def _add_tools(sub: Subcommands) -> None:
    p = sub.add_parser("tools", help="tool utilities: `archer tools check` prints the sandbox's protections here")
    tools = p.add_subparsers(dest="tools_command", required=True)
    p = tools.add_parser("check", help="which protections of the Python tool are active on this machine")
    p.add_argument("--python", default=None, help="the tool's interpreter (default: the one running archer)")
    p.set_defaults(func=_tools_check)


# Library notices a user cannot act on (transformers 5 renamed a keyword that torch's module call passes on).
QUIET_WARNINGS = (r".*`past_key_values` is deprecated",)


def setup_logging(verbose: bool) -> None:
    """archer's own INFO lines; the libraries' (bm25s, the root logger, ...) only from WARNING up, unless ``-v``."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("archer").setLevel(logging.DEBUG if verbose else logging.INFO)


def quiet_libraries(verbose: bool = False) -> None:
    """archer shows its own progress; the libraries' loading/saving bars and notices are noise (``-v`` keeps
    their notices)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if verbose:
        return
    hf_logging.set_verbosity_error()
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_libraries(args.verbose)
    try:
        args.func(args)
    except ArcherError as e:
        if args.verbose:
            raise
        print(f"archer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        terminated = termination(stop)
        if terminated is None:
            print("archer: interrupted", file=sys.stderr)
            return 130
        # SIGTERM once Ray runs: the finally blocks have stopped the run's groups and Ray
        print("archer: terminated (SIGTERM)", file=sys.stderr, flush=True)
        logging.shutdown()
        sys.stdout.flush()
        os._exit(int(terminated.code))  # the interpreter's own teardown after Ray's shutdown exits with 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
