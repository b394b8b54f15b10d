"""The documentation site (mkdocs.yml, mkdocs_hooks.py) builds with --strict, as `make test` builds it: README as
its home page, SECURITY.md and BENCHMARKS.md as pages, the config reference generated; a broken link fails it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from readme_support import REPO

SITE_INPUTS = ("mkdocs.yml", "mkdocs_hooks.py", "README.md", "SECURITY.md", "BENCHMARKS.md", "docs", "bench/results")


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_site_builds_with_every_page(tmp_path: Path) -> None:
    built = build(REPO, tmp_path / "site")
    assert built.returncode == 0, built.stderr
    site = tmp_path / "site"
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "Two commands" in home and 'href="getting_started/"' in home  # README, its docs/ links made relative
    for page in ("SECURITY", "BENCHMARKS", "own_task", "agentic", "health", "async", "memory", "many_gpus"):
        assert (site / page / "index.html").is_file(), page
    reference = (site / "config_reference" / "index.html").read_text(encoding="utf-8")
    assert "<code>data.train_batch_size</code>" in reference and "prompts per step" in reference


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    for name in SITE_INPUTS:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, root / name)
    page = root / "docs" / "own_task.md"
    page.write_text(page.read_text(encoding="utf-8") + "\nSee [the missing page](no_such_page.md).\n")
    built = build(root, tmp_path / "site")
    assert built.returncode != 0
    assert "no_such_page.md" in built.stderr
