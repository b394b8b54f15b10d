"""README's commands as the tests run them: the words of a command block, continuation lines joined."""

from __future__ import annotations

import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_command(start: str) -> list[str]:
    """The words of README's command whose first line starts with ``start`` (continuation lines joined)."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    text = lines[first]
    while text.endswith("\\"):
        first += 1
        text = text[:-1] + lines[first]
    return shlex.split(text)
