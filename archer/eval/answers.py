"""A sample's final answer, and its normal form for majority votes (maj@k).

The answer is what the math reward reads: the last ``\\boxed{...}`` (in the last ``<answer>`` block first), else
the text after the last ``####``. Normal forms: a plain number is written canonically (``1,000.50`` and ``1000.5``
vote together); math answers lose spacing, ``$``, ``\\left``/``\\right``, ``\\!``, ``\\text{..}`` wrappers,
``dfrac``/``tfrac`` spellings and a trailing period; QA answers get SQuAD's normalisation (lower case, no
punctuation or articles). Answers longer than ``MAX_ANSWER_CHARS`` are cut, so a hostile sample costs bounded
work.
"""

from __future__ import annotations

import re

from archer.rewards.math import extract_prediction, plain_number
from archer.rewards.qa import normalize_answer

MAX_ANSWER_CHARS = 2000
ANSWER_TYPES = ("math", "qa")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_DROPPED = ("\\left", "\\right", "\\!", "\\,", "\\;", "$", " ", "\n", "\t")


def extract_answer(text: str) -> str | None:
    """The sample's final answer (None when it gave none), at most MAX_ANSWER_CHARS characters."""
    answer = extract_prediction(text[-100_000:])
    return None if answer is None else answer[:MAX_ANSWER_CHARS]


def normalise(answer: str | None, answer_type: str) -> str | None:
    """The form answers are compared in for the vote (None stays None; an empty answer is None)."""
    if answer is None:
        return None
    if answer_type == "qa":
        return normalize_answer(_TEXT_WRAPPER.sub(r"\1", answer)) or None
    number = plain_number(answer)
    if number is not None:
        return format(number.normalize(), "f")
    text = _TEXT_WRAPPER.sub(r"\1", answer).replace("dfrac", "frac").replace("tfrac", "frac")
    for token in _DROPPED:
        text = text.replace(token, "")
    return text.rstrip(".") or None
