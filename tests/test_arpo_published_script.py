"""Issue 15's acceptance: ARPO's published ``ARPO_7B_Reasoning_1node.sh``, with ``python3 -m
verl.trainer.main_ppo`` replaced by ``archer train`` and only its placeholders and variables filled in (tiny
model, small sizes, CPU, a console logger, two steps), trains on ARPO's 10k data with its published
``ppo_trainer.yaml`` (placeholders filled), the cache-backed Bing search, the Python tool in a conda-style env,
and ARPO's own reward file ``deep_research.py``. The files are read from ../shared/data (never copied here)."""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PUBLISHED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "arpo" / "published"
ARPO = PUBLISHED.parent
pytestmark = [pytest.mark.skipif(not (PUBLISHED / "ARPO_7B_Reasoning_1node.sh").is_file(),
                                 reason="ARPO's published files are not in ../shared/data/arpo/published"),
              pytest.mark.timeout(1800)]  # the tool model's training and two agentic steps on the 2-core machine

# The script's variables as a CPU run fills them (the originals: 8 GPUs, 128 prompts x 16 rollouts, 1536/4096).
VARIABLES = {
    "N_GPUS_PER_NODE": ("8", "1"),
    "TRAIN_BATCH_SIZE": ("128", "2"),
    "PPO_MINI_BATCH_SIZE": ("16", "2"),
    "MAX_PROMPT_LENGTH": ("1536", "2048"),  # the tiny tokenizer spends up to 1770 tokens on an ARPO prompt
    "MAX_RESPONSE_LENGTH": ("4096", "128"),
    "ROLLOUT_N": ("16", "4"),
    "INITIAL_ROLLOUTS": ("8", "2"),
    "TEST_FREQ": ("5", "-1"),
}


def filled_script(text: str, arpo_root: Path, model: Path, save_dir: Path) -> str:
    text = text.replace("python3 -m verl.trainer.main_ppo", "archer train")
    for name, (published, ours) in VARIABLES.items():
        line = next(line for line in text.splitlines() if line.startswith(f"{name}={published}"))
        text = text.replace(line, line.replace(f"{name}={published}", f"{name}={ours}", 1))
    text = (text.replace("<your_path_to_ARPO>", str(arpo_root)).replace("<your_model_path>", str(model))
            .replace("<your_checkpoint_save_dir>", str(save_dir)).replace('"<your_wandb_key>"', '""'))
    text = text.replace('trainer.logger="[console, wandb]"', 'trainer.logger="[console]"')
    return text.replace("    trainer.val_before_train=False \\\n",
                        "    trainer.val_before_train=False \\\n    trainer.device=cpu \\\n"
                        "    trainer.total_training_steps=2 \\\n")


def arpo_checkout(root: Path, conda: Path) -> Path:
    """ARPO's folder layout as the script expects it; the data, cache and reward are links to ../shared."""
    links = {"rl_datasets/train_10k.parquet": ARPO / "train_10k.parquet",
             "rl_datasets/valid.parquet": ARPO / "valid.parquet",
             "search_cache/search_cache.json": ARPO / "search_cache.json",
             "verl_arpo_entropy/verl/utils/reward_score/deep_research.py": PUBLISHED / "deep_research.py"}
    for rel, target in links.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).symlink_to(target.resolve())
    config = (PUBLISHED / "ppo_trainer.yaml").read_text(encoding="utf-8")
    config = (config.replace("<your_conda_path>", str(conda)).replace("api_key: <your_api_key>", "api_key: null")
              .replace("<your_zone>", "serp_api1").replace("<your_search_cache_path>", str(ARPO / "search_cache.json")))
    (root / "scripts" / "config").mkdir(parents=True)
    (root / "scripts" / "config" / "ppo_trainer.yaml").write_text(config, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def arpo_run(tmp_path_factory: pytest.TempPathFactory, arpo_tool_model: Path) -> tuple[subprocess.CompletedProcess, Path]:
    tmp = tmp_path_factory.mktemp("arpo_script")
    model = arpo_tool_model
    conda = tmp / "conda"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--copies", str(conda / "envs" / "verl")],
                   check=True)
    root = arpo_checkout(tmp / "ARPO", conda)
    script = root / "scripts" / "ARPO_7B_Reasoning_1node.sh"
    text = (PUBLISHED / "ARPO_7B_Reasoning_1node.sh").read_text(encoding="utf-8")
    script.write_text(filled_script(text, root, model, tmp / "checkpoints"), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=1500, env=env)
    save = tmp / "checkpoints" / "ARPO_global_16_init_8_beam_2_random_0_arpo_0.2_entropy"
    return proc, save


def test_the_filled_script_differs_from_the_published_one_only_where_allowed(tmp_path) -> None:
    published = (PUBLISHED / "ARPO_7B_Reasoning_1node.sh").read_text(encoding="utf-8")
    ours = filled_script(published, tmp_path / "ARPO", tmp_path / "model", tmp_path / "ckpt")
    a, b = published.splitlines(), ours.splitlines()
    replaced, inserted = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        replaced += a[i1:i2] if tag == "replace" else []
        inserted += b[j1:j2] if tag == "insert" else []
        assert tag in ("equal", "replace", "insert"), (tag, a[i1:i2])
    assert all("<your_" in line or line.split("=")[0] in VARIABLES or "main_ppo" in line
               or "trainer.logger" in line for line in replaced), replaced
    placeholders = sum("<your_" in line for line in a)
    assert len(replaced) == placeholders + len(VARIABLES) + 2  # and the command and the logger
    assert inserted == ["    trainer.device=cpu \\", "    trainer.total_training_steps=2 \\"]


def test_arpos_published_script_trains_two_steps(arpo_run) -> None:
    proc, save = arpo_run
    log = (save / "run.log").read_text(encoding="utf-8")
    assert "Traceback" not in log and "archer: error" not in log, log[-3000:]
    steps = [json.loads(line) for line in (save / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    train = [s for s in steps if "actor/pg_loss" in s]
    assert [s["step"] for s in train] == [1, 2], log[-3000:]
    for step in train:
        assert step["rollout/initial_rollouts"] == 2  # ARPO's branching: 2 global samples of rollout.n=4 per prompt
        assert step["rollout/branches"] + step["rollout/refills"] > 0
        assert step["tools/search/calls"] > 0 and step["tools/python/calls"] > 0  # the model calls both tools
        assert -1.0 <= step["critic/score/mean"] <= 1.1  # deep_research.py's range: -1 (format) .. F1 + 0.1
    resolved = (save / "config.yaml").read_text(encoding="utf-8")
    assert "deep_research.py" in resolved and "BingSearchTool" in resolved
    hydra_dir = save / "outputs" / ".hydra"
    assert (hydra_dir / "config.yaml").is_file() and (hydra_dir / "overrides.yaml").is_file()
