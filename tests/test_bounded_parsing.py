"""Hostile model text through every parser the trainer runs on it: each finishes in time proportional to the text.

The inputs are the shapes that made the old lazy regexes quadratic (many opening tags, no closing tag); sizes are
bounded so that CI stays fast, and each bound is far above what linear code needs on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import random
import re
import time

import numpy as np
import pytest
from agentic_support import tokenizer

from archer.rewards.countdown import compute_countdown_score
from archer.rewards.math import compute_math_score, extract_boxed
from archer.rewards.qa import compute_qa_score
from archer.rewards.routing import default_compute_score
from archer.rollout.call_formats import HermesCalls
from archer.tagged_text import last_tag_block, tag_blocks, tag_spans
from archer.tools.python_tool import strip_code_fence
from archer.viz.queries import call_tokens

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


def test_tag_spans_match_the_lazy_alternation_on_random_text() -> None:
    rng = random.Random(0)
    atoms = ["<python>", "</python>", "<search>", "</search>", "<a>", "</a>", "</b>", "x", "\n", "<"]
    for tags in ([("<python>", "</python>"), ("<search>", "</search>")], [("<a>", "</a>"), ("<a>", "</b>")]):
        pattern = re.compile("|".join(f"{re.escape(o)}.*?{re.escape(c)}" for o, c in tags), re.DOTALL)
        for _ in range(3000):
            text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 12)))
            assert [(a, b) for a, b, _ in tag_spans(text, tags)] == [(m.start(), m.end())
                                                                   for m in pattern.finditer(text)], text


def test_the_explorer_marks_calls_of_a_hostile_response_quickly() -> None:
    texts = ["<python>"] * TAGS + ["<search>", "x", "</search>"]  # no </python>: every <python> used to rescan
    marked, seconds = timed(call_tokens, texts, np.ones(len(texts), dtype=bool))
    assert seconds < BOUND_S, f"{seconds:.2f} s"
    assert marked.tolist() == [False] * TAGS + [True] * 3


@pytest.mark.parametrize("fn, text", [
    (strip_code_fence, "```python\n" + "```   x\n" * TAGS),
    (strip_code_fence, "   " * TAGS + "```" + "\t" * TAGS),
    (extract_boxed, "\\boxed{" * TAGS),
    (lambda t: compute_math_score(t, "42"), "####" + " \n####" * TAGS + " 42"),  # a plain number: no worker
    (lambda t: compute_qa_score(t, ["a"]), "<answer>\\boxed{" + "\\text{" * TAGS + "}</answer>" + "<think>" * TAGS),
], ids=["fence-many", "fence-spaces", "boxes", "hashes", "qa-latex"])
def test_other_parsers_of_model_text_are_linear(fn, text) -> None:
    _, seconds = timed(fn, text)
    assert seconds < BOUND_S, f"{seconds:.2f} s"
