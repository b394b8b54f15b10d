"""How a response ends, for both engines: the eos ids of a model and its tokenizer, and the stop strings found in
the decoded text of a response (the token that completes one ends it and is kept).

Stop strings are matched on decoded text, never on token ids: a tag like ``</python>`` may be one token, or split
over several, or end inside a token that carries more text. Decoding is the costly part, so a window of new
tokens is decoded only when one of them can end a stop string: when the stop strings end in ASCII characters,
only a token whose vocabulary string holds such a character can (byte-level BPE and SentencePiece spell ASCII
characters as themselves, byte fallback as ``<0x..>``, which also holds ``>``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase


def eos_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokenizer's eos id and every eos id of the model's generation config, sorted."""
    ids = {tokenizer.eos_token_id}
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return sorted(i for i in ids if i is not None)


class StopMatcher:
    """Finds stop strings in the decoded tail of responses (a tail long enough to hold the longest one)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        # Every token decodes to at least one byte, so the longest stop string spans at most this many tokens;
        # the margin covers tokenizers that drop a leading space when decoding a fragment.
        self.window = max((len(s.encode("utf-8")) for s in stop), default=0) + 4
        self._enders: frozenset[int] | None = None  # token ids that can end a stop string (None: not worked out)

    def enders(self) -> frozenset[int] | None:
        """The token ids that can end a stop string; None when any id might (a stop string ending in a character
        that is not ASCII)."""
        last = {s[-1] for s in self.stop}
        if not all(c.isascii() for c in last):
            return None
        if self._enders is None:
            pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            self._enders = frozenset(i for i, piece in enumerate(pieces) if piece and any(c in piece for c in last))
        return self._enders

    def _tails_hit(self, tails: list[list[int]]) -> list[bool]:
        """Whether each decoded tail holds a stop string. No tail, no decode call: transformers 5.17's
        ``batch_decode([])`` answers ``[""]``, one text for no row."""
        if not tails:
            return []
        return [any(s in text for s in self.stop) for text in self.tokenizer.batch_decode(tails)]

    def matches(self, histories: list[list[int]], rows: list[int]) -> list[int]:
        """The rows (of ``rows``) whose response text now contains a stop string (checked after every token)."""
        if not self.stop or not rows:
            return []
        hits = self._tails_hit([histories[r][-self.window :] for r in rows])
        return [r for r, hit in zip(rows, hits, strict=True) if hit]

    def first_stops(self, responses: list[list[int]], starts: list[int]) -> list[int | None]:
        """For each response, the first index >= its start whose token completes a stop string (None: none), as
        ``matches`` would have found it token by token; the tokens before ``start`` were checked already."""
        found: list[int | None] = [None] * len(responses)
        if not self.stop:
            return found
        enders = self.enders()
        rows = [r for r, (tokens, start) in enumerate(zip(responses, starts, strict=True)) if start < len(tokens)
                and (enders is None or not enders.isdisjoint(tokens[start:]))]
        hits = self._tails_hit([responses[r][max(0, starts[r] - self.window):] for r in rows])
        for r, hit in zip(rows, hits, strict=True):
            if hit:
                tokens, start = responses[r], starts[r]
                prefixes = [tokens[: j + 1] for j in range(start, len(tokens))]
                hits = self.matches(prefixes, list(range(len(prefixes))))
                found[r] = start + min(hits) if hits else None
        return found
