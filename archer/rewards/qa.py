"""Deep-research QA reward (ARPO): a format gate, then token F1 of the boxed answer.

A response is well formed when its ``<think>`` blocks are balanced (at least one), it has exactly one
``<answer>...</answer>`` block holding a ``\\boxed{...}``, and every tool call (``<search>...</search>``
or ``<python>...</python>``) is closed and followed by a ``<result>...</result>`` block. A malformed
response scores -1. Otherwise the score is the token F1 (SQuAD normalisation) between the boxed answer
and the best-matching reference, plus 0.1 when F1 > 0 and both tools were used.
"""

from __future__ import annotations

import ast
import re
import string
from collections import Counter
from collections.abc import Sequence

from archer.errors import ArcherError
from archer.rewards.math import extract_boxed

MALFORMED_SCORE = -1.0
TOOL_BONUS = 0.1
_TOOLS = ("search", "python")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|textit|mathrm)\{([^{}]*)\}")
_THINK_TAGS = re.compile(r"</?think>")
_TOOL_TAGS = re.compile(r"</?(?:search|python|result)>")


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, reference: str) -> float:
    """Token-level F1 between two answers after SQuAD normalisation (1.0 when both are empty)."""
    pred_tokens = normalize_answer(prediction).split()
    ref_tokens = normalize_answer(reference).split()
    if not pred_tokens or not ref_tokens:
        return float(pred_tokens == ref_tokens)
    common = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def references(ground_truth: str | Sequence[str]) -> list[str]:
    """The reference answers: a list, or the string repr of a list of strings, or one string."""
    if isinstance(ground_truth, str):
        if ground_truth.lstrip().startswith("["):
            try:
                parsed = ast.literal_eval(ground_truth)
            except (ValueError, SyntaxError):
                return [ground_truth]
            if isinstance(parsed, list) and parsed and all(isinstance(x, str) for x in parsed):
                return parsed
        return [ground_truth]
    return [str(x) for x in ground_truth]


def _tool_calls_answered(text: str) -> bool:
    """Each tool call is closed and then followed by a complete <result> block."""
    expected: str | None = None
    for tag in _TOOL_TAGS.findall(text):
        if expected is not None:
            if tag != expected:
                return False
            expected = {"</search>": "<result>", "</python>": "<result>", "<result>": "</result>"}.get(tag)
        elif tag in ("<search>", "<python>"):
            expected = tag.replace("<", "</")
    return expected is None


def _think_balanced(text: str) -> bool:
    """At least one <think> block, and the think tags alternate open, close, open, close."""
    tags = _THINK_TAGS.findall(text)
    return bool(tags) and tags == ["<think>", "</think>"] * (len(tags) // 2)


def is_well_formed(text: str) -> bool:
    """ARPO's format gate (see the module docstring)."""
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return False
    start, end = text.index("<answer>"), text.index("</answer>")
    return (
        start < end
        and extract_boxed(text[start:end]) is not None
        and _think_balanced(text)
        and _tool_calls_answered(text)
    )


def _strip_latex_text(answer: str) -> str:
    return _LATEX_TEXT.sub(r"\1", answer)


def compute_qa_score(solution_str: str, ground_truth: str | Sequence[str]) -> dict[str, float]:
    """{"score", "acc" (exact match after normalisation), "f1", "format" (1 when well formed), "both_tools"
    (1 when it called search and python)}; score -1 for a malformed response."""
    used_all_tools = float(all(f"<{tool}>" in solution_str for tool in _TOOLS))
    if not is_well_formed(solution_str):
        return {"score": MALFORMED_SCORE, "acc": 0.0, "f1": 0.0, "format": 0.0, "both_tools": used_all_tools}
    answer_block = solution_str[solution_str.index("<answer>") : solution_str.index("</answer>")]
    answer = _strip_latex_text(extract_boxed(answer_block) or "")
    refs = references(ground_truth)
    if not refs:
        raise ArcherError(
            "the QA ground truth is an empty list", "give each QA row at least one reference answer"
        )
    f1 = max(token_f1(answer, ref) for ref in refs)
    exact = any(normalize_answer(answer) == normalize_answer(ref) for ref in refs)
    score = f1 + TOOL_BONUS if f1 > 0 and used_all_tools else f1
    return {"score": score, "acc": float(exact), "f1": f1, "format": 1.0, "both_tools": used_all_tools}
