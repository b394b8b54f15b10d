"""examples/: every script's config loads (``--cfg job``) with the settings it promises, each RL example composes
at 8 GPUs per node (its multi-GPU variant: N_GPUS_PER_NODE=8), the math recipe's one-GPU command fits archer's
memory plan of an 80 GB card (workers/memory.py, offline on the model's meta shape), and each RL example runs one
step on a micro model with the model, data and sizes swapped in through the variables at its top."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from multi_gpu_support import multi_gpu_refused
from omegaconf import DictConfig, OmegaConf
from tool_model_support import ARPO, ROWS, SEARCH_CACHE, TRAIN_FILE
from transformers import Qwen2Config, Qwen2ForCausalLM

from archer.config.loader import hydra_settings, load_config
from archer.errors import ArcherError
from archer.trainer.config_check import check_config
from archer.workers.memory import GIB, MemoryPlan, plan_actor_memory

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MATH = ["archer2_math_1.5b", "archer2_math_1.5b_entropy_trace", "archer2_math_1.5b_influence_trace",
        "archer2_math_1.5b_entropy_trace_1gpu"]
AGENTIC = ["arpo_7b_reasoning_1node", "arpo_14b_deepsearch_1node", "aepo_7b_reasoning_1node", "dapo_baseline",
           "grpo_baseline"]
RL = MATH + AGENTIC
ONE_GPU = "archer2_math_1.5b_entropy_trace_1gpu"  # a one-GPU recipe by design: it pins trainer.n_gpus_per_node=1
# the multi-GPU variant: one node of 8 GPUs, as ARPO and the trace release ran theirs (Archer2.0's math run used 2)
MULTI_GPU = {"N_GPUS_PER_NODE": "8", "NNODES": "1"}
SUBPROCESS_TIMEOUT_S = 900
H100 = int(79.2 * GIB)  # what an 80 GB H100 gives a process
# The math recipes' model, DeepSeek-R1-Distill-Qwen-1.5B, by its config.json (untied embeddings: 1.78B parameters)
R1_DISTILL_QWEN_1_5B = Qwen2Config(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                   num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=False)


def run_example(name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    return subprocess.run(["bash", str(EXAMPLES / f"{name}.sh"), *args], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S, env=full_env)


def cfg_job(name: str, env: dict[str, str] | None = None) -> dict:
    proc = run_example(name, "--cfg", "job", env=env)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_every_script_is_covered_here() -> None:
    assert {p.stem for p in EXAMPLES.glob("*.sh")} == {*RL, "sft_arpo_qwen", "eval_pass_at_k"}


def resolved_config(name: str, tmp_path: Path) -> dict:
    """The config ``archer train`` resolves from what the script passes it (``passed_overrides``), built in this
    process (``cfg_job`` runs the CLI's ``--cfg job`` instead: a process of its own per script)."""
    overrides = passed_overrides(name, {}, tmp_path / name)
    return OmegaConf.to_container(load_config("ppo_trainer", hydra_settings(overrides)[0]), resolve=True)


def test_archer2_math_configs_keep_the_published_settings(tmp_path) -> None:
    plain, entropy, influence, one_gpu = (resolved_config(name, tmp_path) for name in MATH)
    actor = plain["actor_rollout_ref"]["actor"]
    assert actor["policy_loss"]["loss_mode"] == "aspo" and actor["ppo_epochs"] == 3
    assert (actor["high_entropy_clip_ratio_low"], actor["high_entropy_clip_ratio_high"]) == (0.4, 0.4)
    assert (actor["kl_loss_coef"], actor["optim"]["lr_warmup_steps"], actor["optim"]["weight_decay"]) == (0.001, 10, 0.1)
    assert plain["reward_model"]["overlong_buffer"] == {"enable": True, "len": 16, "penalty_factor": 1.0, "log": False}
    assert plain["trainer"]["rejection_sample"] is True and plain["data"]["train_batch_size"] == 64
    assert entropy["trainer"]["entropy_trace"]["enable"] and entropy["trainer"]["total_training_steps"] == 100
    assert entropy["actor_rollout_ref"]["actor"]["ppo_epochs"] == 1
    trace = influence["trainer"]["influence_trace"]
    assert trace["enable"] and trace["module_name_filter"] == ["self_attn.o_proj", "mlp.down_proj"]
    assert (trace["max_modules"], trace["max_proj_vector_sum"], influence["trainer"]["total_training_steps"]) == (1, 64, 2)
    assert (one_gpu["data"]["train_batch_size"], one_gpu["actor_rollout_ref"]["rollout"]["n"]) == (2, 1)
    assert (one_gpu["data"]["max_prompt_length"], one_gpu["data"]["max_response_length"]) == (128, 64)
    assert one_gpu["trainer"]["entropy_trace"]["enable"] and one_gpu["trainer"]["test_freq"] == -1


def header_command(name: str) -> tuple[dict[str, str], list[str]]:
    """The variables and arguments of the command a script's header gives (``# VAR=V ... bash examples/NAME.sh ARGS``)."""
    text = (EXAMPLES / f"{name}.sh").read_text(encoding="utf-8")
    line = next(x[2:] for x in text.splitlines() if x.startswith("# ") and f"bash examples/{name}.sh" in x)
    before, _, after = line.partition(f"bash examples/{name}.sh")
    return dict(word.split("=", 1) for word in before.split()), after.split()


REFERENCE_BYTES_PER_PARAM = 2  # bf16


def memory_plan(cfg: DictConfig, model: Qwen2Config, gpus: int) -> MemoryPlan:
    """archer's memory plan of one card of an 80 GB H100 run of ``cfg`` (the fast engine, the reference policy
    beside the actor as the rank's workers count it), the models sharded over ``gpus`` ranks."""
    with torch.device("meta"):
        policy = Qwen2ForCausalLM(model)
    params = sum(p.numel() for p in policy.parameters())
    # the reference policy's own bf16 copy, sharded like the actor (what its ModelOwner.card_bytes counts)
    reference = -(-REFERENCE_BYTES_PER_PARAM * params // gpus)
    others = {"reference policy": reference} if cfg.actor_rollout_ref.actor.use_kl_loss else {}
    return plan_actor_memory(cfg.actor_rollout_ref, policy, total=H100, fast_engine=True, others=others, shards=gpus)


@pytest.mark.parametrize("tied", [False, True])  # the distilled model's shape, and Qwen2.5-1.5B's tied one
def test_the_math_recipes_one_gpu_command_fits_archers_memory_plan_at_80_gb(tmp_path, tied) -> None:
    model = Qwen2Config(**{**R1_DISTILL_QWEN_1_5B.to_dict(), "tie_word_embeddings": tied})
    env, args = header_command("archer2_math_1.5b")
    assert env["N_GPUS_PER_NODE"] == "1"
    cfg = load_config("ppo_trainer", hydra_settings(passed_overrides("archer2_math_1.5b", env, tmp_path, *args))[0])
    check_config(cfg)
    assert (cfg.trainer.n_gpus_per_node, cfg.actor_rollout_ref.rollout.free_cache_engine) == (1, True)
    one_gpu = memory_plan(cfg, model, gpus=1)
    one_gpu.check()
    assert sum(one_gpu.generation().values()) < 72 * GIB
    # gradient_checkpointing_layers=auto: the update keeps some layers' activations, within the card with the margin
    assert 0 < one_gpu.checkpointed_layers < 28
    assert sum(one_gpu.update().values()) + one_gpu.activations * (1 / 0.85 - 1) <= H100
    every = load_config("ppo_trainer", hydra_settings([*passed_overrides("archer2_math_1.5b", env, tmp_path / "all",
                                                                         *args),
                                                       "actor_rollout_ref.model.gradient_checkpointing_layers=all"])[0])
    assert sum(memory_plan(every, model, gpus=1).update().values()) < 37 * GIB  # verl's every layer
    # the published settings fit two cards, not one: that is why the header gives its command
    published = load_config("ppo_trainer", hydra_settings(passed_overrides("archer2_math_1.5b", {}, tmp_path / "2"))[0])
    assert published.trainer.n_gpus_per_node == 2
    memory_plan(published, model, gpus=2).check()
    single = memory_plan(published, model, gpus=1)
    assert sum(single.update().values()) > H100  # the engine's 55 GiB kept through the update
    with pytest.raises(ArcherError, match="the GPU's 79.2 GiB cannot hold"):
        single.check()


def test_agentic_configs_keep_the_published_settings(tmp_path) -> None:
    arpo, deep, aepo, dapo, grpo = (resolved_config(name, tmp_path) for name in AGENTIC)
    rollout = arpo["actor_rollout_ref"]["rollout"]
    assert (rollout["n"], rollout["initial_rollouts"], rollout["beam_size"], rollout["mode"]) == (16, 8, 2,
                                                                                                  "sync_with_tool")
    tools = rollout["tools"]["tool_instances"]
    assert tools["search"]["class_path"] == "verl.workers.agent.tools.search_tool.BingSearchTool"
    assert tools["search"]["params"]["api_key"] is None and tools["python"]["class_path"].endswith("PythonTool")
    assert arpo["data"]["max_response_length"] == 4096 and arpo["trainer"]["total_epochs"] == 2
    assert arpo["custom_reward_function"]["path"].endswith("reward_score/deep_research.py")
    deep_rollout = deep["actor_rollout_ref"]["rollout"]
    assert (deep_rollout["n"], deep_rollout["initial_rollouts"], deep["trainer"]["total_epochs"]) == (12, 6, 5)
    assert [Path(f).name for f in deep["data"]["val_files"]] == ["gaia_test.parquet", "hle_test.parquet"]
    assert aepo["actor_rollout_ref"]["rollout"]["enable_dynamic_rollouts"] is True
    assert aepo["actor_rollout_ref"]["actor"]["enable_entropy_balanced_clipping"] is True
    for baseline in (dapo, grpo):
        assert (baseline["actor_rollout_ref"]["rollout"]["initial_rollouts"],
                baseline["actor_rollout_ref"]["rollout"]["beam_size"]) == (16, 1)
    assert dapo["actor_rollout_ref"]["actor"]["clip_ratio_high"] == 0.28 and dapo["algorithm"]["filter_groups"]["enable"]
    assert dapo["reward_model"]["overlong_buffer"]["len"] == 1024
    assert grpo["actor_rollout_ref"]["actor"]["clip_ratio_high"] is None


def test_sft_config_keeps_the_published_settings() -> None:
    cfg = cfg_job("sft_arpo_qwen")
    assert (cfg["optim"]["lr"], cfg["optim"]["lr_scheduler"], cfg["trainer"]["total_epochs"]) == (7e-6, "cosine", 3)
    assert cfg["data"]["multiturn"] == {"enable": True, "messages_key": "conversations", "tools_key": "tools"}
    assert (cfg["data"]["max_length"], cfg["data"]["train_batch_size"]) == (15000, 16)


def test_eval_script_runs_archer_eval() -> None:
    if run_example("eval_pass_at_k", "--help").returncode != 0:
        pytest.skip("archer eval is not there yet")
    cfg = cfg_job("eval_pass_at_k")
    assert (cfg["eval"]["k"], cfg["eval"]["benchmark"]) == ([1, 4, 8], ["gsm8k", "math500", "aime24", "hotpotqa", "2wiki"])
    val = cfg["actor_rollout_ref"]["rollout"]["val_kwargs"]
    assert (val["n"], val["temperature"], val["top_p"], cfg["data"]["max_response_length"]) == (8, 0.6, 0.95, 4096)


def one_step(name: str, env: dict[str, str], out: Path, *extra: str) -> list[dict]:
    proc = run_example(name, "trainer.device=cpu", "trainer.total_training_steps=1", "trainer.test_freq=-1",
                       "trainer.save_freq=-1", "trainer.resume_mode=disable", *extra, env={**env, "LOGGER": "[console]"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = out / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", MATH)
def test_a_math_example_runs_one_step_on_the_micro_model(name, micro_model, task_files, tmp_path) -> None:
    out = tmp_path / "run"
    env = {"MODEL_PATH": str(micro_model), "TRAIN_FILES": str(task_files["train"]), "VAL_FILES": str(task_files["val"]),
           "CKPTS_DIR": str(out), "MAX_PROMPT_LENGTH": "64", "MAX_RESPONSE_LENGTH": "32", "TRAIN_BATCH_SIZE": "2",
           "PPO_MINI_BATCH_SIZE": "2", "MICRO_BATCH_SIZE_PER_GPU": "2", "ROLLOUT_N": "2", "VAL_N": "1"}
    if name != "archer2_math_1.5b":  # the base script runs at its 2 ranks (Ray on the CPU); the trace scripts call
        env["N_GPUS_PER_NODE"] = "1"  # it, so they run on one (CI's 2 cores: 114 s at 2 ranks for the entropy trace)
    steps = one_step(name, env, out, "trainer.rejection_sample=False")  # keep the micro model's uniform groups
    assert [s["step"] for s in steps] == [1]
    if "entropy" in name or "influence" in name:
        assert (out / "entropy_trace" / "steps" / "step_000001.npz").is_file()
    if "influence" in name:
        assert (out / "influence_trace" / "manifest.jsonl").is_file()


@pytest.fixture(scope="module")
def arpo_rows_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ARPO rows the tool model learned (a small slice of ARPO's train_10k, not a copy kept anywhere)."""
    path = tmp_path_factory.mktemp("arpo_rows") / "train.parquet"
    pq.write_table(pq.read_table(TRAIN_FILE).slice(0, ROWS), path)
    return path


@pytest.mark.skipif(not TRAIN_FILE.is_file(), reason="ARPO's data is not in ../shared/data/arpo")
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", AGENTIC)
def test_an_agentic_example_runs_one_step_on_the_tool_model(name, arpo_tool_model, arpo_rows_file, tmp_path) -> None:
    out = tmp_path / "run"
    env = {"MODEL_PATH": str(arpo_tool_model), "TRAIN_FILES": str(arpo_rows_file), "VAL_FILES": str(arpo_rows_file),
           "SEARCH_CACHE": str(SEARCH_CACHE), "REWARD_FILE": str(ARPO / "published" / "deep_research.py"),
           "SAVE_PATH": str(out), "TRAIN_BATCH_SIZE": "2", "PPO_MINI_BATCH_SIZE": "2", "MAX_PROMPT_LENGTH": "2048",
           "MAX_RESPONSE_LENGTH": "64", "ROLLOUT_N": "4", "INITIAL_ROLLOUTS": "2"}
    if name in ("dapo_baseline", "grpo_baseline"):
        env["INITIAL_ROLLOUTS"] = "4"
    # the base script runs on 2 ranks (Ray on the CPU: its published 8 are 8 processes on CI's 2 cores, 81 s a step;
    # test_an_rl_example_composes_at_eight_gpus_per_node checks the 8-rank config); the others on one
    env["N_GPUS_PER_NODE"] = "2" if name == "arpo_7b_reasoning_1node" else "1"
    extra = ["algorithm.filter_groups.enable=false"] if name == "dapo_baseline" else []  # one generation batch
    steps = one_step(name, env, out, *extra)
    assert [s["step"] for s in steps] == [1]
    assert steps[0]["tools/search/calls"] + steps[0]["tools/python/calls"] > 0


def passed_overrides(name: str, env: dict[str, str], tmp_path: Path, *args: str) -> list[str]:
    """The arguments the script (run with ``args``) hands to ``archer train``, recorded by an ``archer`` stand-in
    first on PATH."""
    bin_dir, record = tmp_path / "bin", tmp_path / "archer_args"
    bin_dir.mkdir(parents=True)
    (bin_dir / "archer").write_text(f"#!/usr/bin/env bash\nprintf '%s\\0' \"$@\" > '{record}'\n")
    (bin_dir / "archer").chmod(0o755)
    proc = run_example(name, *args, env={**env, "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"]])})
    assert proc.returncode == 0, proc.stderr
    command, *overrides = record.read_text().split("\0")[:-1]
    assert command == "train"
    return overrides


def assert_divides_across(cfg: DictConfig, world: int) -> None:
    """verl's batch-size rules for ``world`` data-parallel ranks: every batch's rows (prompts x rollout.n) split
    evenly, and a rank's share of a mini-batch is whole micro-batches (without dynamic batch sizes)."""
    actor, n = cfg.actor_rollout_ref.actor, int(cfg.actor_rollout_ref.rollout.n)
    prompts = int(cfg.data.train_batch_size)
    assert prompts % world == 0 and prompts * n % world == 0
    if cfg.data.gen_batch_size is not None:
        assert int(cfg.data.gen_batch_size) * n % world == 0
    mini_rows = int(actor.ppo_mini_batch_size) * n
    assert mini_rows % world == 0 and mini_rows >= world
    if not actor.use_dynamic_bsz:
        assert (mini_rows // world) % int(actor.ppo_micro_batch_size_per_gpu) == 0


@pytest.mark.parametrize("name", [name for name in RL if name != ONE_GPU])
def test_an_rl_example_composes_at_eight_gpus_per_node(name, tmp_path) -> None:
    overrides = passed_overrides(name, MULTI_GPU, tmp_path)
    assert "trainer.n_gpus_per_node=8" in overrides and "trainer.nnodes=1" in overrides
    cfg = load_config("ppo_trainer", hydra_settings(overrides)[0])
    assert (cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes) == (8, 1)
    assert_divides_across(cfg, cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes)
    if multi_gpu_refused():  # the switch (tests/multi_gpu_support.py): archer's own check refuses world > 1
        with pytest.raises(ArcherError, match=r"trainer.n_gpus_per_node=8 cannot be honoured") as refusal:
            check_config(cfg)
        assert "set trainer.n_gpus_per_node=1" in str(refusal.value)
    else:  # what `archer train --cfg job` checks before printing (test_cli runs that command itself)
        check_config(cfg)


def test_the_one_gpu_recipe_stays_on_one_gpu(tmp_path) -> None:
    overrides = passed_overrides(ONE_GPU, MULTI_GPU, tmp_path)
    cfg = load_config("ppo_trainer", hydra_settings(overrides)[0])
    assert cfg.trainer.n_gpus_per_node == 1  # its own trainer.n_gpus_per_node=1 comes after the variable's
    check_config(cfg)
