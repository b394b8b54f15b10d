"""ARPO's warm start end to end: `archer sft` on tag-format tool data (<search>, <python>, their <result> blocks
out of the loss) makes a tiny model that `archer train` then runs agentic RL with, and the model calls both
tools there (the real Python sandbox and the search tool on ARPO's cache file)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from tool_model_support import PYTHON_ANSWER, RESPONSE, SEARCH_ANSWER, SEARCH_CACHE, TRAIN_FILE, arpo_rows

from archer.config.loader import CONFIG_DIR
from archer.models.loading import load_tokenizer
from archer.models.tiny import build_tiny_model
from archer.trainer.sft import build_dataset, run_sft

ROLLOUT = "actor_rollout_ref.rollout"
pytestmark = pytest.mark.skipif(not (TRAIN_FILE.is_file() and SEARCH_CACHE.is_file()),
                                reason="ARPO's data is not in ../shared/data/arpo")


def test_sft_on_tag_format_tool_data_warm_starts_agentic_rl_that_calls_its_tools(tmp_path: Path) -> None:
    rows = arpo_rows()
    base = build_tiny_model(tmp_path / "base", [m["content"] for r in rows for m in r["prompt"]] + [RESPONSE] * 4,
                            vocab_size=1200, hidden_size=64, num_layers=2, intermediate_size=128,
                            max_position_embeddings=1024, seed=0)
    sft_file = tmp_path / "sft.jsonl"
    sft_file.write_text("".join(json.dumps({"prompt": r["prompt"], "response": RESPONSE}) + "\n" for r in rows))
    cfg = OmegaConf.merge(OmegaConf.load(CONFIG_DIR / "sft_trainer.yaml"), OmegaConf.from_dotlist([
        f"data.train_files={sft_file}", "data.max_length=1024", "data.train_batch_size=2",
        "data.micro_batch_size_per_gpu=2", f"model.partial_pretrain={base}", "model.enable_gradient_checkpointing=false",
        "optim.lr=3e-3", "optim.warmup_steps_ratio=0", "optim.lr_scheduler=constant", "trainer.total_training_steps=60",
        f"trainer.default_local_dir={tmp_path / 'sft'}", "trainer.logger=[jsonl]", "trainer.device=cpu",
        "trainer.plots=false"]))
    # the tool answers inside the response are context, not targets
    tokenizer = load_tokenizer(base)
    item = build_dataset(cfg, tokenizer, str(sft_file))[0]
    trained = tokenizer.decode(item["input_ids"][item["loss_mask"].bool()].tolist())
    assert SEARCH_ANSWER not in trained and "<result>" not in trained and "</result>" not in trained
    assert trained == RESPONSE.replace(f" <result>\n{SEARCH_ANSWER}\n</result>", "").replace(
        f" <result>\n{PYTHON_ANSWER}\n</result>", "") + "<|im_end|>"
    model = run_sft(cfg)

    run = tmp_path / "rl"
    proc = subprocess.run(
        [sys.executable, "-m", "archer.cli", "train", f"actor_rollout_ref.model.path={model}",
         f"data.train_files={TRAIN_FILE}", "data.train_batch_size=2", f"{ROLLOUT}.n=2",
         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=768",
         "data.filter_overlong_prompts=true", "data.max_response_length=96", "trainer.total_training_steps=1",
         "trainer.device=cpu", "trainer.logger=[jsonl]", "trainer.plots=false", f"trainer.default_local_dir={run}",
         f"trainer.rollout_data_dir={run / 'rollouts'}", f"{ROLLOUT}.multi_turn.max_tool_response_length=200",
         f"+{ROLLOUT}.tools.tool_instances.python.class_path=python",
         f"+{ROLLOUT}.tools.tool_instances.search.class_path=search",
         f"+{ROLLOUT}.tools.tool_instances.search.params.cache_file={SEARCH_CACHE}"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["tools/search/calls"] >= 1 and metrics["tools/python/calls"] >= 1
    outputs = [json.loads(x)["output"] for x in (run / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    # the tools answered: the cache's page for the query, the sandbox's output of the snippet
    assert any(f"<result>\n{SEARCH_ANSWER}\n</result>" in o for o in outputs)
    assert any(f"<result>\n{PYTHON_ANSWER}\n</result>" in o for o in outputs)
