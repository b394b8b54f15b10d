"""The commands of README and of the docs site's pages (docs/*.md) as the tests run them: the words of a command
block, continuation lines joined."""

from __future__ import annotations

import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def page_command(page: str, start: str) -> list[str]:
    """The words of the command in ``page`` (a path from the repository root) whose first line starts with
    ``start`` (continuation lines joined)."""
    lines = (REPO / page).read_text(encoding="utf-8").splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    text = lines[first]
    while text.endswith("\\"):
        first += 1
        text = text[:-1] + lines[first]
    return shlex.split(text)

