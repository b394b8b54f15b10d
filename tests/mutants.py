"""Injected bugs that the suite must catch (issue 30's mutation spot check): each mutant is one edit of archer's
source, applied to a copy of archer/ and tests/ in a temporary folder, where the tests named beside it run. A
mutant the tests pass is a hole in the suite; the unmutated copy must pass the same tests first.

    python tests/mutants.py             # every mutant: one line each, "caught" or "MISSED"; exit 1 if any missed
    python tests/mutants.py padding     # the mutants whose name contains "padding"

Not part of the suite (pytest collects test_*.py only): it runs the named tests once per mutant (a few minutes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly ``count`` times; the ``occurrence``-th (0-based) is replaced
    new: str
    tests: tuple[str, ...]
    occurrence: int = 0
    count: int = 1


DATA_PARALLEL = ("tests/test_workers_data_parallel.py",)
LOSSES = ("tests/algorithms/test_entropy_aware_losses.py",)
ENTROPY_SPLIT = ("    return (split(low_entropy_clip_ratio_low, high_entropy_clip_ratio_low),\n"
                 "            split(low_entropy_clip_ratio_high, high_entropy_clip_ratio_high))\n")
SWAPPED_SPLIT = ("    return (split(low_entropy_clip_ratio_high, high_entropy_clip_ratio_high),\n"
                 "            split(low_entropy_clip_ratio_low, high_entropy_clip_ratio_low))\n")

MUTANTS = (
    Mutant("data-parallel normaliser over the rank's own micro-batches (actor)", "archer/workers/actor.py",
           "passes.every_rank)", "passes.parts)", DATA_PARALLEL),
    Mutant("data-parallel normaliser over the rank's own micro-batches (rank_passes)",
           "archer/workers/data_parallel.py", "        every_rank += parts\n",
           "        every_rank += parts if rank == ctx.rank else []\n", DATA_PARALLEL),
    Mutant("padding passes weighted 1 (the actor's and critic's one epoch loop)", "archer/workers/mini_batches.py",
           "weight = 0.0 if passes.padding(index) else 1.0", "weight = 1.0", DATA_PARALLEL),
    Mutant("archer and aspo losses: clip_ratio_low and clip_ratio_high swapped", "archer/algorithms/policy_loss.py",
           ENTROPY_SPLIT, SWAPPED_SPLIT, LOSSES),
    Mutant("clip_cov loss: clip_ratio_low and clip_ratio_high swapped", "archer/algorithms/policy_loss.py",
           "advantages, clip_ratio_low, clip_ratio_high, enable_entropy_balanced_clipping)",
           "advantages, clip_ratio_high, clip_ratio_low, enable_entropy_balanced_clipping)",
           ("tests/algorithms/test_entropy_aware_losses.py::test_clip_cov_takes_its_lower_and_upper_bound_apart",)),
    Mutant("whole tool batches: a group at the staleness bound evicted", "archer/rollout/policy_versions.py",
           "version_age(version, started) > max_off_policy_threshold",
           "version_age(version, started) >= max_off_policy_threshold",
           ("tests/test_workers_async_tool_whole_batch.py",)),
    Mutant("memory plan: update stage without the other models", "archer/workers/memory.py",
           'held = {"policy": self.policy, "gradients": self.gradients, **self.others}',
           'held = {"policy": self.policy, "gradients": self.gradients}', ("tests/test_workers_memory.py",)),
    Mutant("pass@k counts acc > 0.5 as correct", "archer/eval/sampling_metrics.py",
           "np.sum(acc >= CORRECT_AT)", "np.sum(acc > CORRECT_AT)",
           ("tests/test_eval.py::test_a_sample_with_accuracy_exactly_one_half_counts_as_correct_for_pass_at_k",)),
    Mutant("LoRA merge: the delta scaled twice", "archer/models/lora.py",
           "merged = merged + layer.get_delta_weight(adapter).float()",
           "merged = merged + 2 * layer.get_delta_weight(adapter).float()",
           ("tests/test_lora.py::test_policy_weights_are_the_merged_weights_under_plain_names",)),
)


def copy_tree(to: Path) -> None:
    for name in ("archer", "tests"):
        shutil.copytree(ROOT / name, to / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", to / "pyproject.toml")


def apply(mutant: Mutant, root: Path) -> None:
    path = root / mutant.path
    text = path.read_text()
    found = text.count(mutant.old)
    if found != mutant.count:
        raise SystemExit(f"{mutant.name}: {mutant.path} holds the text to mutate {found} times, not "
                         f"{mutant.count}: update the mutant to the code")
    start = -1
    for _ in range(mutant.occurrence + 1):
        start = text.index(mutant.old, start + 1)
    path.write_text(text[:start] + mutant.new + text[start + len(mutant.old):])


def run_tests(root: Path, tests: tuple[str, ...]) -> tuple[bool, str]:
    """(whether the tests passed, pytest's last lines), run in ``root`` with ``root``'s archer first."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                          cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip().splitlines()[-1]


def main(selected: list[str]) -> int:
    mutants = [m for m in MUTANTS if not selected or any(s in m.name for s in selected)]
    missed = 0
    with tempfile.TemporaryDirectory(prefix="archer-mutants-") as tmp:
        clean = Path(tmp) / "clean"
        copy_tree(clean)
        for tests in dict.fromkeys(m.tests for m in mutants):
            passed, last = run_tests(clean, tests)
            if not passed:
                raise SystemExit(f"the unmutated code fails {' '.join(tests)}: {last}")
        for index, mutant in enumerate(mutants):
            root = Path(tmp) / f"mutant{index}"
            copy_tree(root)
            apply(mutant, root)
            start = time.monotonic()
            passed, last = run_tests(root, mutant.tests)
            missed += passed
            print(f"{'MISSED' if passed else 'caught'}  {mutant.name}  ({time.monotonic() - start:.0f} s: {last})",
                  flush=True)
            shutil.rmtree(root)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
