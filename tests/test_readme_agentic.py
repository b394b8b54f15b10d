"""The agentic commands of docs/agentic.md, run as written: the tool quickstart names the model that ARPO's
two-step command trains on ARPO's own data (skipped where ../shared/data/arpo is absent). The quickstart's warm
start is cut to a few SFT steps here; its folders, model and tokenizer are the quickstart's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from readme_support import page_command
from rich.console import Console

from archer.cli import build_parser
from archer.trainer.quickstart import parse_quickstart_args, warm_start

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"  # the page's ../shared, seen from the repository root
AGENTIC = "docs/agentic.md"
ARPO_TRAIN = SHARED / "data" / "arpo" / "train_10k.parquet"


def test_the_page_names_the_tool_quickstarts_model_in_the_arpo_command() -> None:
    quickstart = build_parser().parse_args(page_command(AGENTIC, "archer quickstart task=tool_arithmetic")[1:])
    train = page_command(AGENTIC, "archer train algorithm=arpo")
    model = next(a.partition("=")[2] for a in train if a.startswith("actor_rollout_ref.model.path="))
    assert Path(model) == Path(quickstart.out) / "sft" / "hf_model"  # where run_sft leaves the warm start


@pytest.mark.skipif(not ARPO_TRAIN.is_file(), reason=f"ARPO's data is not in {ARPO_TRAIN.parent}")
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_pages_arpo_command_runs_as_written_on_the_tool_quickstarts_model(tmp_path: Path) -> None:
    work = tmp_path / "repo"  # the page's commands run from the repository root, with ../shared beside it
    work.mkdir()
    (tmp_path / "shared").symlink_to(SHARED)
    quickstart = build_parser().parse_args(page_command(AGENTIC, "archer quickstart task=tool_arithmetic")[1:])
    seed, recipe, _ = parse_quickstart_args(quickstart.overrides)
    _, model = warm_start(work / quickstart.out, seed, Console(quiet=True),
                          sft_extra=["trainer.total_training_steps=4"], recipe=recipe)
    train = page_command(AGENTIC, "archer train algorithm=arpo")
    assert f"actor_rollout_ref.model.path={model.relative_to(work)}" in train
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "archer.cli", *train[1:]], cwd=work, env=env, capture_output=True,
                          text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = proc.stdout.rstrip().splitlines()[-1].removeprefix("run directory: ")
    lines = [json.loads(x) for x in (work / run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert line["rollout/initial_rollouts"] == 2.0
        assert line["rollout/branches"] + line["rollout/refills"] == 2.0  # 1 prompt x (n=4 - 2 global samples)
        assert "tools/calls_per_response" in line and line["prompt_length/max"] > 512  # beyond the old 512
