"""Steps that train on nothing: the responses a step generated and scored but did not train on (the groups that
rejection sampling or dynamic sampling dropped), the step's rollout dump of every response, trained or not,
and the stop after ``trainer.max_steps_without_update`` steps in a row without an update.

A step whose every prompt group is dropped updates nothing; a run of such steps would exit 0 with the model it
started from saved as "trained". ``UpdateGuard`` counts those steps and raises an ArcherError that says why
(every group scored alike), with the distribution of the scores and example responses, unless the key is 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from archer.batch import Batch
from archer.errors import ArcherError
from archer.rewards.extras import REWARD_EXTRAS

KEY = "trainer.max_steps_without_update"
# What the rollout dump writes of a response (trainer/ppo.py write_generations) and the guard shows.
DUMP_COLUMNS = ("data_source", "uid", "raw_prompt", "ground_truth", "response_text", "score", "acc", REWARD_EXTRAS)
TRAINED = "trained"  # the dump's field: whether the step trained on the response
EXAMPLES = 3
SHOWN_CHARS = 120  # an example response longer than this is cut
SHOWN_VALUES = 5  # distinct scores named one by one


def dump_rows(batch: Batch) -> Batch:
    """The dump's columns of a scored batch (rows only, so that batches of different lengths concatenate)."""
    return Batch({}, {k: batch[k] for k in DUMP_COLUMNS if k in batch.rows})


def every_response(trained: Batch, dropped: Sequence[Batch]) -> Batch:
    """The step's generated responses: the trained ones first (their rows keep the batch's row numbers, which
    the health pointers and traces name), then the dropped ones, each with ``trained`` true or false."""
    parts = [dump_rows(b) for b in (trained, *dropped) if len(b)]
    if not parts:
        return Batch({}, {TRAINED: np.zeros(0, dtype=bool)})
    out = Batch.concat(parts)
    out[TRAINED] = np.arange(len(out)) < len(trained)
    return out


def score_distribution(scores: np.ndarray) -> str:
    """``N responses: mean m (min a, max b); value x N times, ...`` of the most frequent values."""
    scores = np.asarray(scores, dtype=np.float64)
    if not len(scores):
        return "no responses"
    counts = Counter(float(s) for s in scores)
    common = ", ".join(f"{v:g} x{n}" for v, n in counts.most_common(SHOWN_VALUES))
    more = f", {len(counts) - SHOWN_VALUES} other values" if len(counts) > SHOWN_VALUES else ""
    return (f"{len(scores)} responses, mean {np.mean(scores):.4g} (min {np.min(scores):.4g}, max "
            f"{np.max(scores):.4g}); scores {common}{more}")


def examples(responses: Batch, k: int = EXAMPLES) -> list[str]:
    """One line for each of ``k`` responses of different prompt groups: its group, score and text."""
    lines, seen = [], set()
    for i in range(len(responses)):
        uid = str(responses["uid"][i])
        if uid in seen:
            continue
        seen.add(uid)
        text = str(responses["response_text"][i])
        text = text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."
        lines.append(f"score {float(responses['score'][i]):.4g} (ground truth {responses['ground_truth'][i]!r}, "
                     f"prompt group {uid}): {text!r}")
        if len(lines) == k:
            break
    return lines


class UpdateGuard:
    """Counts the steps that updated the policy and the steps in a row that trained on nothing."""

    def __init__(self, limit: int, updated_steps: int = 0) -> None:
        self.limit = limit  # 0: never stop
        self.updated_steps = updated_steps
        self.first_idle: int | None = None  # the first step of the current run of steps without an update
        self.idle: list[Batch] = []  # their generated responses

    def record(self, step: int, *, updated: bool, responses: Batch | None = None) -> None:
        """The step updated the policy, or trained on nothing (``responses``: every response it generated)."""
        if updated:
            self.updated_steps += 1
            self.first_idle, self.idle = None, []
            return
        if self.first_idle is None:
            self.first_idle = step
        if self.limit and responses is not None and len(responses):  # kept for the error only
            self.idle.append(responses)

    def check(self, step: int) -> None:
        """An ArcherError once ``limit`` steps in a row up to ``step`` trained on nothing."""
        if not self.limit or self.first_idle is None or step - self.first_idle + 1 < self.limit:
            return
        count = step - self.first_idle + 1
        seen = Batch.concat(self.idle) if self.idle else None
        if seen is None:
            why = "no prompt group was generated"
        else:
            why = (f"every prompt group scored alike (all its responses the same score or accuracy), so "
                   f"rejection / dynamic sampling dropped it and no advantage was left. Scores: "
                   f"{score_distribution(seen['score'])}. Examples:\n    " + "\n    ".join(examples(seen)))
        raise ArcherError(
            f"steps {self.first_idle}-{step}: {count} steps in a row made no update ({KEY}={self.limit}): {why}",
            "check that the reward function scores these responses as intended (a reward that is the same for "
            "every response teaches nothing), use prompts the model sometimes solves, or set "
            f"{KEY}=0 to train on regardless; the rollout dump (trainer.rollout_data_dir) holds every response "
            "with its score")

