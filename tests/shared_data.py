"""Where the shared real data folder (``shared/data`` beside the repository) is: next to a checkout in
/work/main, or two levels up from a git worktree in /work/wt/NAME. Tests that read it skip when it is absent."""

from __future__ import annotations

from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = next((p for p in (_REPO.parent / "shared" / "data", _REPO.parents[1] / "shared" / "data") if p.is_dir()),
                   _REPO.parent / "shared" / "data")
