"""Tests of archer.rewards.qa: ARPO's format gate, SQuAD-normalised F1 and the tool bonus."""

from __future__ import annotations

import pytest

from archer.errors import ArcherError
from archer.rewards.qa import compute_qa_score, is_well_formed, normalize_answer, references, token_f1

SEARCH = "<search>who built it</search><result>Page 1: Gustave Eiffel</result>"
PYTHON = "<python>print(1889)</python><result>1889</result>"


def response(answer: str, tools: str = "") -> str:
    return f"<think>plan</think>{tools}<think>done</think><answer>The answer is \\boxed{{{answer}}}</answer>"


def test_normalisation_and_f1_by_hand() -> None:
    assert normalize_answer("The  Eiffel-Tower, Paris!") == "eiffeltower paris"
    # pred tokens: eiffel tower paris; ref: eiffel tower -> p = 2/3, r = 1, f1 = 0.8
    assert token_f1("the Eiffel Tower Paris", "Eiffel Tower") == pytest.approx(0.8)
    assert token_f1("a", "the") == 1.0  # both empty after normalisation
    assert token_f1("Paris", "an") == 0.0


def test_score_acc_and_f1() -> None:
    assert compute_qa_score(response("the Eiffel Tower Paris"), "Eiffel Tower") == pytest.approx(
        {"score": 0.8, "acc": 0.0, "f1": 0.8, "format": 1.0, "both_tools": 0.0}
    )
    assert compute_qa_score(response("eleanor of lancaster."), "Eleanor Of Lancaster") == {
        "score": 1.0,
        "acc": 1.0,
        "f1": 1.0,
        "format": 1.0,
        "both_tools": 0.0,
    }
    assert compute_qa_score(response(r"\text{Eleanor Of Lancaster}"), "Eleanor Of Lancaster")["acc"] == 1.0


def test_tool_bonus_needs_both_tools_and_some_overlap() -> None:
    both = compute_qa_score(response("Eiffel Tower", SEARCH + PYTHON), "Eiffel Tower")
    assert both["score"] == pytest.approx(1.1) and both["both_tools"] == 1.0
    assert compute_qa_score(response("Eiffel Tower", SEARCH), "Eiffel Tower")["score"] == pytest.approx(1.0)
    assert compute_qa_score(response("Louvre", SEARCH + PYTHON), "Eiffel Tower")["score"] == 0.0


def test_references_as_list_or_its_string() -> None:
    assert references("['Paris', 'City of Paris']") == ["Paris", "City of Paris"]
    assert references(["Paris", "Lyon"]) == ["Paris", "Lyon"]
    assert references("[4,\\infty)") == ["[4,\\infty)"]  # not a list literal: one reference
    # best reference: "city of paris" vs pred "paris city": common 2, p = 1, r = 2/3 -> 0.8
    result = compute_qa_score(response("Paris city"), "['Lyon', 'City of Paris']")
    assert result["f1"] == pytest.approx(0.8) and result["acc"] == 0.0
    assert compute_qa_score(response("lyon"), "['Lyon', 'City of Paris']")["acc"] == 1.0
    with pytest.raises(ArcherError, match="empty list"):
        compute_qa_score(response("x"), [])


@pytest.mark.parametrize(
    "text",
    [
        "<answer>\\boxed{Paris}</answer>",  # no think block
        "<think>a<think>b</think><answer>\\boxed{Paris}</answer>",  # unbalanced think
        "</think>a<think><answer>\\boxed{Paris}</answer>",  # think tags out of order
        "<think>a</think><answer>Paris</answer>",  # no box in the answer
        "<think>a</think>\\boxed{Paris}<answer>Paris</answer>",  # box outside the answer
        "<think>a</think><answer>\\boxed{A}</answer><answer>\\boxed{B}</answer>",  # two answers
        "<think>a</think></answer>\\boxed{Paris}<answer>",  # answer tags reversed
        "<think>a</think><search>q</search><answer>\\boxed{Paris}</answer>",  # call without result
        "<think>a</think><search>q<result>r</result><answer>\\boxed{Paris}</answer>",  # call not closed
        "<think>a</think><python>1</python><result>1<answer>\\boxed{Paris}</answer>",  # result not closed
    ],
)
def test_malformed_responses_score_minus_one(text: str) -> None:
    assert not is_well_formed(text)
    assert compute_qa_score(text, "Paris") == {"score": -1.0, "acc": 0.0, "f1": 0.0, "format": 0.0,
                                               "both_tools": float("<search>" in text and "<python>" in text)}


def test_well_formed_with_tools() -> None:
    assert is_well_formed(response("Paris", SEARCH + "<think>more</think>" + PYTHON))
