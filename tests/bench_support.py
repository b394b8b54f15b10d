"""Importing bench/ scripts in tests: bench/ is no package, so its folder is on sys.path while a test uses one
(the scripts import their siblings plainly, as they do when run)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@contextmanager
def bench_module(name: str) -> Iterator[ModuleType]:
    """The bench script ``name`` (e.g. "grpo_vs_trl"), with bench/ on sys.path until the block ends."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCH))
        yield importlib.import_module(name)
