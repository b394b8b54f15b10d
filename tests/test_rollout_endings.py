"""archer/rollout/endings.py: where a stop string first completes in a window of new tokens, found with the
vocabulary filter exactly where decoding every prefix finds it (random ids, ids past the tokenizer's vocabulary,
stop strings split over tokens or ending inside one), and the eos ids of a model."""

from __future__ import annotations

import random

import pytest
from agentic_support import tokenizer

from archer.rollout.endings import StopMatcher

TOK = tokenizer()


def brute_force(tokens: list[int], start: int, stop: tuple[str, ...]) -> int | None:
    return next((j for j in range(start, len(tokens)) if any(s in TOK.decode(tokens[: j + 1]) for s in stop)), None)


@pytest.mark.parametrize("stop", [("</python>", "</search>"), ("42)",), ("é",)])
def test_first_stops_find_what_decoding_every_prefix_finds(stop):
    rng = random.Random(0)
    pieces = [TOK.encode(t, add_special_tokens=False) for t in ("</python>", "</search>", " 42)", "é", "x>")]
    rows, starts = [], []
    for _ in range(300):
        tokens = []
        while len(tokens) < 40:
            tokens += rng.choice(pieces) if rng.random() < 0.2 else [rng.randrange(len(TOK) + 50)]
        rows.append(tokens)
        starts.append(rng.randrange(0, 40))
    matcher = StopMatcher(TOK, stop)
    # a row whose first stop lies before its start was cut there already: the check starts after the last one
    starts = [s if brute_force(r[:s], 0, stop) is None else len(r) for r, s in zip(rows, starts)]
    expected = [brute_force(r, s, stop) for r, s in zip(rows, starts)]
    assert matcher.first_stops(rows, starts) == expected
    assert sum(e is not None for e in expected) > 50
    assert (matcher.enders() is None) == (stop == ("é",))  # a stop string that ends beyond ASCII: no filter


class OneTextForNoRow:
    """A tokenizer whose ``batch_decode([])`` answers ``[""]``, as transformers 5.17's does."""

    def __init__(self) -> None:
        self.decoded: list[list[list[int]]] = []

    def __len__(self) -> int:
        return len(TOK)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return TOK.convert_ids_to_tokens(ids)

    def batch_decode(self, sequences: list[list[int]]) -> list[str]:
        self.decoded.append(sequences)
        return TOK.batch_decode(sequences) if sequences else [""]


def test_a_window_without_a_token_that_can_end_a_stop_string_is_not_decoded():
    quiet = TOK.encode("abc def", add_special_tokens=False)  # no token holds ">"
    stopping = TOK.encode("x </python>", add_special_tokens=False)
    decoder = OneTextForNoRow()
    matcher = StopMatcher(decoder, ("</python>",))
    assert matcher.first_stops([quiet, quiet], [0, 1]) == [None, None]
    assert matcher.matches([quiet], []) == []
    assert decoder.decoded == []  # no row could stop: nothing decoded (an empty batch is never sent)
    assert matcher.first_stops([quiet, stopping], [0, 0]) == [None, len(stopping) - 1]
    assert decoder.decoded[0] == [stopping]  # the one row that could stop
