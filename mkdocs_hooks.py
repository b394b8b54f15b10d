"""MkDocs hooks of the documentation site (mkdocs.yml): the pages that live outside docs/ or are generated.

README.md is the home page (its links into docs/ made relative to the site), SECURITY.md and BENCHMARKS.md are
pages of their own (with the figures of bench/results/ that BENCHMARKS.md shows), and config_reference.md is
made from archer/config/ppo_trainer.yaml (archer/config/reference.py) at every build, so it cannot fall behind
the YAML. A docs page links the two root
files as GitHub reads them (``../SECURITY.md``); the link is pointed at their page in the site.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent
ROOT_PAGES = ("SECURITY.md", "BENCHMARKS.md")
sys.path.insert(0, str(ROOT))  # archer from this checkout, installed or not

from archer.config.reference import reference_markdown  # noqa: E402


def home_page(readme: str) -> str:
    """README as the site's home page: its links to docs/X become X."""
    return re.sub(r"\]\(docs/", "](", readme)


def on_files(files: Files, config) -> Files:
    pages = {"index.md": home_page((ROOT / "README.md").read_text(encoding="utf-8")),
             "config_reference.md": reference_markdown(),
             **{name: (ROOT / name).read_text(encoding="utf-8") for name in ROOT_PAGES}}
    for name, content in pages.items():
        files.append(File.generated(config, name, content=content))
    for image in sorted((ROOT / "bench" / "results").glob("*.png")):  # the figures BENCHMARKS.md shows
        files.append(File.generated(config, image.relative_to(ROOT).as_posix(), abs_src_path=str(image)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    for name in ROOT_PAGES:
        markdown = markdown.replace(f"](../{name}", f"]({name}")
    return markdown
