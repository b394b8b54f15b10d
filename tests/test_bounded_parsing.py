"""Hostile model text through every parser the trainer runs on it: each finishes in time proportional to the text.

The inputs are the shapes that made the old lazy regexes quadratic (many opening tags, no closing tag); sizes are
bounded so that CI stays fast, and each bound is far above what linear code needs on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from agentic_support import tokenizer

from archer.rewards.countdown import compute_countdown_score
from archer.rewards.math import compute_math_score, extract_boxed
from archer.rewards.qa import compute_qa_score
from archer.rewards.registry import default_compute_score
from archer.rollout.call_formats import HermesCalls
from archer.tagged_text import last_tag_block, tag_blocks

TAGS = 20_000
BOUND_S = 0.5


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


@pytest.mark.parametrize("score", [
    lambda text: compute_math_score(text, "42"),
    lambda text: default_compute_score("math_dapo", text, "42"),
    lambda text: compute_countdown_score(text, {"target": 24, "numbers": [4, 6, 1]}),
    lambda text: compute_qa_score(text, ["Paris"]),
], ids=["math", "dapo", "countdown", "qa"])
@pytest.mark.parametrize("text", [
    "<answer>" * TAGS,
    "<answer>" * TAGS + "</answer>",
    ("<answer>\\boxed{" * TAGS),
    "<tool_call>" * TAGS + "<answer>1</answer" * TAGS,
], ids=["open-tags", "one-close-at-end", "open-boxes", "broken-closes"])
def test_twenty_thousand_repeated_tags_score_in_well_under_a_second(score, text) -> None:
    _, seconds = timed(score, text)
    assert seconds < BOUND_S, f"{seconds:.2f} s"


def test_the_last_answer_block_is_still_the_one_scored() -> None:
    text = "<answer>\\boxed{7}</answer> then <answer>" * 3 + "<answer>\\boxed{42}</answer> and <answer>"
    assert extract_boxed(text) == "42"
    assert compute_countdown_score("<answer>1+1</answer><answer>6*4*1</answer><answer>",
                                   {"target": 24, "numbers": [4, 6, 1]})["acc"] == 1.0


@pytest.mark.parametrize("text", ["<answer>a</answer><answer>b", "x<answer><answer>y</answer>z</answer>",
                                  "</answer><answer>", "<answer></answer><answer>\n</answer>", ""])
def test_tag_blocks_find_what_the_lazy_regex_found(text: str) -> None:
    assert tag_blocks(text, "<answer>", "</answer>") == re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    assert last_tag_block(text, "<answer>", "</answer>") == (found[-1] if found else None)


@pytest.fixture(scope="module")
def hermes() -> HermesCalls:
    return HermesCalls(tokenizer())


def test_hermes_parsing_of_twenty_thousand_unclosed_tool_calls_is_fast(hermes: HermesCalls) -> None:
    calls, seconds = timed(hermes.parse, "<tool_call>" * TAGS + "</tool_call" * TAGS, "eos")
    assert calls == [] and seconds < BOUND_S, f"{seconds:.2f} s"


def test_a_tool_call_nested_past_the_stack_is_an_error_answer_not_a_crash(hermes: HermesCalls) -> None:
    good = json.dumps({"name": "python", "arguments": {"code": "print(1)"}})
    text = f"<tool_call>{'[' * 100_000}</tool_call><tool_call>{good}</tool_call>"
    (deep, ok), seconds = timed(hermes.parse, text, "eos")
    assert deep.error == "Error: the tool call's JSON is nested too deeply."
    assert ok.error is None and ok.call.content == "print(1)"
    assert seconds < BOUND_S
