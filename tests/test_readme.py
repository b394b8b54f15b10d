"""What README promises at its top and the commands it gives, checked as written: the opening claims, the two
`make` commands (a virtualenv made or used, torch's CPU build from PyTorch's CPU index when there is no torch) and
what docs/getting_started.md says of them, and docs/sft.md's SFT command for LLaMA-Factory's demo files on a model
built as the quickstart builds its own."""

from __future__ import annotations

import http.server
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from readme_support import DOCS, page_command
from shared_data import SHARED_DATA

from archer import cli
from archer.data.tasks import write_task_files
from archer.models.tiny import build_tiny_model
from archer.trainer.quickstart import MODEL_POSITIONS, RECIPES, task_corpus

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
DEMO_FILES = ("alpaca_en_demo.json", "glaive_toolcall_en_demo.json")


def test_the_opening_says_what_runs_now() -> None:
    opening = README.split("## Two commands", 1)[0]
    assert "(later)" not in opening
    flat = " ".join(opening.split())
    assert "on many GPUs of one or more nodes through Ray ([Many GPUs](docs/scale_out.md))" in flat
    assert (DOCS / "scale_out.md").read_text(encoding="utf-8").startswith("# Many GPUs\n")


def test_readme_gives_the_two_commands_and_fits_a_few_screens() -> None:
    section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert commands == ["make quickstart", "make test"]
    assert len(README.splitlines()) <= 80  # the front page; the rest is the docs site


def make(target: str, folder: Path, python: str, *, dry_run: bool, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    """``make TARGET PY=python`` in ``folder`` (a copy of the repository's Makefile), outside any activated venv
    and as a make of its own (CI runs the suite under ``make test``, whose variables would make it a sub-make that
    prints the folders it enters)."""
    nested = {"VIRTUAL_ENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"}
    clean = {k: v for k, v in os.environ.items() if k not in nested}
    return subprocess.run(["make", *(["-n"] if dry_run else []), target, f"PY={python}"], cwd=folder, text=True,
                          capture_output=True, timeout=300, env={**clean, **(env or {})})


@pytest.fixture()
def makefile(tmp_path: Path) -> Path:
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    return tmp_path


def test_make_uses_the_virtualenv_python_runs_in(makefile: Path) -> None:
    venv = Path(sys.prefix)
    assert venv != Path(sys.base_prefix), "the tests run in a virtualenv"
    plan = make("quickstart", makefile, sys.executable, dry_run=True)
    assert plan.returncode == 0, plan.stderr
    assert f"{venv}/bin/python -m pip install -q -e .\n{venv}/bin/archer quickstart\n" in plan.stdout
    assert str(makefile / ".venv") not in plan.stdout
    plan = make("test", makefile, sys.executable, dry_run=True)
    pytest = f'PATH="{venv}/bin:$PATH" {venv}/bin/python -m pytest -q'  # the examples' `archer` too
    assert f'{pytest} -n 2 --dist worksteal -m "not serial" --durations=15\n{pytest} -m serial\n' in plan.stdout


def test_make_without_a_virtualenv_makes_dot_venv_and_installs_torchs_cpu_build_into_it(makefile: Path) -> None:
    base = str(Path(sys.base_prefix) / "bin" / "python3")  # a Python that is no virtualenv
    plan = make("quickstart", makefile, base, dry_run=True)
    venv = makefile / ".venv"
    assert f"{base} -m venv --system-site-packages {venv}" in plan.stdout
    assert f"{venv}/bin/python -m pip install -q --index-url {TORCH_INDEX} torch==2.13.0" in plan.stdout
    assert plan.stdout.rstrip().endswith(f"{venv}/bin/archer quickstart")
    assert not venv.exists()  # a dry run
    # for real (offline: pip may not reach an index): the venv is made; without torch, a line says what comes
    ran = make("torch", makefile, base, dry_run=False, env={"PIP_NO_INDEX": "1"})
    assert (venv / "bin" / "python").is_file()
    assert f"make: creating the virtualenv {venv} (packages of {base} stay visible)" in ran.stdout
    has_torch = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"], capture_output=True).returncode == 0
    said = f"make: no torch in {venv}: installing the CPU build of torch==2.13.0 from {TORCH_INDEX}"
    assert (said in ran.stdout) != has_torch, ran.stdout + ran.stderr
    assert (ran.returncode == 0) == has_torch  # no index here, so the install fails where it is needed
    assert make("venv", makefile, base, dry_run=False).stdout.startswith(f"make: using the virtualenv {venv}")


def test_getting_started_states_the_install_and_the_cpu_index() -> None:
    page = (DOCS / "getting_started.md").read_text(encoding="utf-8")
    section = page.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    flat = " ".join(section.split())
    assert "`.venv` in the repository" in flat and TORCH_INDEX in flat and ". .venv/bin/activate" in flat
    assert "The first one adds the install" in flat


@pytest.mark.skipif(not all((SHARED_DATA / "sft" / f).is_file() for f in DEMO_FILES), reason="no LLaMA-Factory demo files")
def test_the_sft_pages_demo_command_runs_as_written_on_the_quickstarts_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    recipe = RECIPES["arithmetic"]  # the quickstart's model, default seed: its data, tokenizer and positions
    write_task_files(recipe.task, tmp_path / "data", n_train=recipe.n_train, n_val=recipe.n_val, n_sft=recipe.n_sft,
                     seed=1, **recipe.knobs)
    model = build_tiny_model(tmp_path / "model", task_corpus(tmp_path / "data"), max_position_embeddings=MODEL_POSITIONS,
                             seed=1)
    for name in DEMO_FILES:  # the command names the files as they lie in the current folder
        (tmp_path / name).symlink_to(SHARED_DATA / "sft" / name)
    monkeypatch.chdir(tmp_path)
    command = page_command("docs/sft.md", "archer sft model.partial_pretrain=MODEL_DIR data.max_length=2048")
    assert command[:2] == ["archer", "sft"] and "data.truncation=right" in command
    args = [a.replace("MODEL_DIR", str(model)) for a in command[1:]]
    cheap = ["trainer.total_training_steps=1", "data.train_batch_size=2", "data.micro_batch_size_per_gpu=2",
             "trainer.logger=[jsonl]", "trainer.plots=false", "trainer.device=cpu", f"trainer.default_local_dir={tmp_path / 'run'}"]
    with caplog.at_level(logging.INFO, logger="archer"):
        assert cli.main([*args, *cheap]) == 0
    assert "SFT dataset: 1300 examples, 124 truncated (right)" in caplog.text  # the page's figures
    assert (tmp_path / "run" / "hf_model" / "config.json").is_file()


# A virtualenv's python for the torch step: `-m pip ...` is recorded (one line of arguments each) and answers as
# FAKE_PIP says (`cpu-wheel`: pip's sources hold torch's CPU wheel, so a dry run reports 2.13.0+cpu); anything else
# runs this interpreter, with a `torch` module that fails to import unless FAKE_TORCH=1.
FAKE_PYTHON = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  shift 2
  echo "$*" >> "$FAKE_PIP_LOG"
  case " $* " in
    *" --dry-run "*) [ "$FAKE_PIP" = cpu-wheel ] && printf '{"install": [{"metadata": {"name": "torch", "version": "2.13.0+cpu"}}]}\\n';;
  esac
  exit 0
fi
[ "$FAKE_TORCH" = 1 ] || export PYTHONPATH="$(dirname "$0")/no_torch"
exec REAL_PYTHON "$@"
"""


@pytest.fixture()
def fake_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin" / "no_torch").mkdir(parents=True)
    (venv / "bin" / "no_torch" / "torch.py").write_text("raise ImportError('no torch here')\n")
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON.replace("REAL_PYTHON", sys.executable))
    python.chmod(0o755)
    return venv


class AnIndex(http.server.BaseHTTPRequestHandler):
    """PyTorch's CPU index as the probe sees it: a page for every path."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"<html></html>")

    def log_message(self, *args: object) -> None:
        pass


def torch_step(makefile: Path, venv: Path, index: str, **fake: str) -> tuple[subprocess.CompletedProcess, list[str], float]:
    """``make torch`` into ``venv`` with the CPU index at ``index``: its result, the pip calls and its seconds."""
    log = venv / "pip.log"
    log.unlink(missing_ok=True)
    start = time.perf_counter()
    ran = subprocess.run(["make", "torch", f"VENV={venv}", f"TORCH_INDEX={index}"], cwd=makefile, text=True,
                         capture_output=True, timeout=120, env={**os.environ, "FAKE_PIP_LOG": str(log), **fake})
    calls = log.read_text().splitlines() if log.exists() else []
    return ran, calls, time.perf_counter() - start


def test_the_torch_step_fails_fast_without_the_cpu_index_and_uses_pips_own_cpu_wheel(makefile: Path,
                                                                                     fake_venv: Path) -> None:
    dry_run = "install -q --dry-run --no-deps --ignore-installed --retries 0 --timeout 5 --report - torch==2.13.0"
    closed = "http://127.0.0.1:9/whl/cpu"  # the discard port: nothing listens, the connection is refused at once
    # torch importable: no pip at all, one line
    ran, calls, _ = torch_step(makefile, fake_venv, closed, FAKE_TORCH="1")
    assert ran.returncode == 0 and calls == []
    assert f"make: torch is in {fake_venv} already: not installing it" in ran.stdout
    # no torch, pip's sources hold no CPU wheel, the index does not answer: one line, exit 1, in seconds
    ran, calls, seconds = torch_step(makefile, fake_venv, closed)
    assert ran.returncode != 0 and calls == [dry_run] and seconds < 30
    assert (f"make: no torch in {fake_venv}, and {closed} does not answer: install torch first "
            f"({fake_venv}/bin/python -m pip install torch==2.13.0 from a wheel or an index you can reach), "
            "then run make again") in ran.stdout.splitlines()
    # pip's sources (find-links, a local index) hold the CPU wheel: a plain install, the index never asked
    ran, calls, _ = torch_step(makefile, fake_venv, closed, FAKE_PIP="cpu-wheel")
    assert ran.returncode == 0 and calls == [dry_run, "install -q torch==2.13.0"]
    assert "installing the CPU build of torch==2.13.0 that pip's own sources hold" in ran.stdout
    # the index answers: the install from it
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), AnIndex)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_port}/whl/cpu"
        ran, calls, _ = torch_step(makefile, fake_venv, index)
    finally:
        server.shutdown()
    assert ran.returncode == 0 and calls == [dry_run, f"install -q --index-url {index} torch==2.13.0"]
    assert f"installing the CPU build of torch==2.13.0 from {index} (about 650 MB installed)" in ran.stdout
